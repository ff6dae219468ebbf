"""deploy/kubeflow as Kubernetes and Kubeflow's training operator would run it: each pod's
TF_CONFIG rendered exactly as the operator writes it (genClusterSpec: every replica type
lower-cased, ``<job>-<type>-<i>.<namespace>.svc:<tfjob-port>``, the evaluator inside the
cluster in current operators and outside in old ones) goes through tfpsx.init()'s
resolver; the manifests parse and name the image, command and ports the Dockerfile and the
example provide; the restart policies retry exactly what tfpsx asks to be retried."""

import json
import os
import re

import pytest
import yaml

from tfpsx import cluster
from tfpsx.control import scheduler, watchdog

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEPLOY = os.path.join(ROOT, "deploy", "kubeflow")
# The training operator's IsRetryableExitCode (pkg/util/train): SIGINT, SIGKILL, SIGTERM
# and 138 (SIGUSR1), "reserved for user-defined retryable errors"; every other code fails
# the replica for good under restartPolicy: ExitCode.
OPERATOR_RETRYABLE = {130, 137, 138, 143}
NAMESPACE = "team-ctr"


def load(name):
    with open(os.path.join(DEPLOY, name)) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def operator_tf_config(job, rtype, index, evaluator_in_cluster=True):
    """genClusterSpec + genTFConfigJSONStr of Kubeflow's training operator."""
    spec = {}
    for name, replica in job["spec"]["tfReplicaSpecs"].items():
        rt = name.lower()
        if rt == "evaluator" and not evaluator_in_cluster:
            continue  # the v1alpha2 operator: "evaluator is not part of training cluster"
        container = [c for c in replica["template"]["spec"]["containers"]
                     if c["name"] == "tensorflow"][0]  # the operator's default container
        port = [p["containerPort"] for p in container.get("ports", ())
                if p["name"] == "tfjob-port"] or [2222]
        spec[rt] = [f"{job['metadata']['name']}-{rt}-{i}.{NAMESPACE}.svc:{port[0]}"
                    for i in range(replica["replicas"])]
    return json.dumps({"cluster": spec, "task": {"type": rtype.lower(), "index": index},
                       "environment": "cloud"})


@pytest.mark.parametrize("evaluator_in_cluster", [True, False], ids=["current", "v1alpha2"])
def test_every_pod_of_the_tfjob_resolves_its_place(evaluator_in_cluster):
    (job,) = load("tfjob-criteo.yaml")
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "TFJob")
    replicas = {n: r["replicas"] for n, r in job["spec"]["tfReplicaSpecs"].items()}
    assert replicas == {"Chief": 1, "Worker": 2, "PS": 2, "Evaluator": 1}
    configs = {}
    for rtype, count in replicas.items():
        for i in range(count):
            env = {"TF_CONFIG": operator_tf_config(job, rtype, i, evaluator_in_cluster)}
            configs[(rtype, i)] = cluster.resolve(env)
    name = "tfpsx-criteo"
    chief = configs[("Chief", 0)]
    assert chief.is_chief and (chief.role, chief.index, chief.job_name) == ("worker", 0, "chief")
    assert chief.workers == (f"{name}-chief-0.{NAMESPACE}.svc:2222",
                             f"{name}-worker-0.{NAMESPACE}.svc:2222",
                             f"{name}-worker-1.{NAMESPACE}.svc:2222")
    for i in range(2):
        worker, ps = configs[("Worker", i)], configs[("PS", i)]
        assert (worker.role, worker.index, worker.is_chief) == ("worker", i + 1, False)
        assert (worker.job_name, worker.task_index) == ("worker", i)
        assert (ps.role, ps.index, ps.job_name) == ("server", i, "ps")
    assert configs[("Evaluator", 0)].role == "evaluator"
    # Every training task sees one cluster, and the evaluator is never in it.
    specs = {json.dumps(c.cluster_dict(), sort_keys=True) for c in configs.values()}
    assert len(specs) == 1 and "evaluator" not in json.loads(specs.pop())


def _containers(doc):
    template = doc["spec"]["template"] if doc["kind"] == "Job" else None
    if template is not None:
        return [(doc["metadata"]["name"], doc["spec"], template["spec"])]
    return [(n, r, r["template"]["spec"]) for n, r in doc["spec"]["tfReplicaSpecs"].items()]


def _example_flags():
    text = open(os.path.join(ROOT, "examples", "criteo", "train.py")).read()
    return set(re.findall(r'flags\.DEFINE_\w+\("(\w+)"', text))


def _dockerfile():
    return open(os.path.join(DEPLOY, "Dockerfile")).read()


@pytest.mark.parametrize("manifest", ["tfjob-criteo.yaml", "scheduler-criteo.yaml"])
def test_manifests_name_the_image_command_and_ports(manifest):
    docker = _dockerfile()
    workdir = re.search(r"^WORKDIR (\S+)", docker, re.M).group(1)
    exposed = int(re.search(r"^EXPOSE (\d+)", docker, re.M).group(1))
    flags = _example_flags()
    claims = {d["metadata"]["name"] for d in load("pvc.yaml")}
    seen = 0
    for doc in load(manifest):
        if doc["kind"] not in ("Job", "TFJob"):
            continue
        for name, _, pod in _containers(doc):
            (c,) = pod["containers"]
            assert c["image"] == "tfpsx:latest", (name, c["image"])
            if c["command"][0] == "python":
                script = c["command"][1]
                assert script.startswith(workdir + "/"), (name, script)
                assert os.path.exists(os.path.join(ROOT, script[len(workdir) + 1:]))
                given = {a.split("=")[0].lstrip("-") for a in c["args"]}
                assert given <= flags, (name, given - flags)
                assert "train_data" in given  # a required flag of the example
                seen += 1
            else:
                assert c["command"] == ["tfpsx-scheduler"]  # setup.py's console script
            if "ports" in c and name != "tfpsx-criteo-scheduler":
                assert [p["containerPort"] for p in c["ports"]] == [exposed]
            for mount in c.get("volumeMounts", ()):
                (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
                assert volume["persistentVolumeClaim"]["claimName"] in claims
    assert seen >= 3  # servers, workers (the chief among them), evaluator


def test_the_dockerfile_installs_tfpsx_against_the_images_tensorflow():
    docker = _dockerfile()
    tf_install = docker.index('pip install --no-cache-dir "${TF_PACKAGE}"')
    tfpsx_install = docker.index("pip install --no-cache-dir .")
    assert tf_install < tfpsx_install  # the ops compile against the TF installed first
    for source in re.findall(r"^COPY (.+) \S+$", docker, re.M):
        for path in source.split():
            assert os.path.exists(os.path.join(ROOT, path)), path
    assert "tfpsx.load_ops()" in docker  # a build whose ops do not load fails there


def test_restart_policies_retry_what_tfpsx_asks_to_be_retried():
    assert watchdog.EXIT_PEER_LOST in OPERATOR_RETRYABLE
    (job,) = load("tfjob-criteo.yaml")
    for name, replica in job["spec"]["tfReplicaSpecs"].items():
        assert replica["restartPolicy"] == "ExitCode", name
    for doc in load("scheduler-criteo.yaml"):
        if doc["kind"] != "Job":
            continue
        policy = doc["spec"].get("podFailurePolicy")
        if policy is None:
            assert doc["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure"
            continue
        fatal = {code for rule in policy["rules"] if rule["action"] == "FailJob"
                 for code in rule["onExitCodes"]["values"]}
        assert fatal == {1, 2} and watchdog.EXIT_PEER_LOST not in fatal
        assert doc["spec"]["template"]["spec"]["restartPolicy"] == "Never"  # the API's rule


def test_the_scheduler_variant_resolves_through_the_scheduler_path():
    docs = {d["metadata"]["name"]: d for d in load("scheduler-criteo.yaml")}
    service = docs["tfpsx-scheduler"]
    port = service["spec"]["ports"][0]["port"]
    for job, role, count in (("tfpsx-criteo-server", "server", 2),
                             ("tfpsx-criteo-worker", "worker", 3)):
        spec = docs[job]["spec"]
        assert (spec["completionMode"], spec["completions"]) == ("Indexed", count)
        (c,) = spec["template"]["spec"]["containers"]
        for rank in range(count):
            env = {}
            for var in c["env"]:
                value = var.get("value")
                if "secretKeyRef" in var.get("valueFrom", {}):
                    value = "s3cret"  # TFPSX_TOKEN, from the job's Secret
                elif value is None:  # the downward API: the completion index, the pod IP
                    field = var["valueFrom"]["fieldRef"]["fieldPath"]
                    value = str(rank) if "job-completion-index" in field else "10.0.0.7"
                env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], value)
            assert env["TFPSX_SCHED_ADDR"] == f"tfpsx-scheduler:{port}"
            config = cluster.resolve(env)
            assert (config.role, config.index, config.needs_scheduler) == (role, rank, True)
            assert (config.scheduler.server_num, config.scheduler.worker_num) == (2, 3)
            assert env["TFPSX_NODE_ID"] == f"{role}-{rank}"
    sched = docs["tfpsx-criteo-scheduler"]["spec"]["template"]["spec"]["containers"][0]
    env = {v["name"]: v.get("value", "s3cret") for v in sched["env"]}
    config = cluster.resolve(env)
    assert config.role == "scheduler" and config.scheduler.token == "s3cret"
    # It listens on every interface of its pod: without the Secret's token it would not
    # start (tfpsx-scheduler exits 2 naming TFPSX_TOKEN).
    scheduler.check_listen_address(config.scheduler.address, config.scheduler.token)
    with pytest.raises(ValueError, match="no TFPSX_TOKEN is set"):
        scheduler.check_listen_address(config.scheduler.address, None)
    evaluator = docs["tfpsx-criteo-evaluator"]["spec"]["template"]["spec"]["containers"][0]
    assert cluster.resolve({v["name"]: v["value"] for v in evaluator["env"]}).role == "evaluator"


# --------------------------------------------------------------------- network policies

def _selects(selector, labels):
    """Kubernetes' label selector semantics: matchLabels and matchExpressions, ANDed."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for e in selector.get("matchExpressions") or ():
        op, key, values = e["operator"], e["key"], e.get("values", ())
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def _pods(manifest):
    """(labels, container ports) of every pod a manifest makes: its template's labels and
    those Kubernetes' Job controller (batch.kubernetes.io/job-name, job-name) or Kubeflow's
    training operator (training.kubeflow.org/*) put on them."""
    pods = []
    for doc in load(manifest):
        if doc["kind"] == "Job":
            name = doc["metadata"]["name"]
            template = doc["spec"]["template"]
            given = {"batch.kubernetes.io/job-name": name, "job-name": name,
                     "controller-uid": "1234"}
            templates = [(template, given)]
        elif doc["kind"] == "TFJob":
            name = doc["metadata"]["name"]
            templates = [(r["template"], {"training.kubeflow.org/job-name": name,
                                          "training.kubeflow.org/operator-name": "tfjob-controller",
                                          "training.kubeflow.org/replica-type": rtype.lower(),
                                          "training.kubeflow.org/replica-index": "0"})
                         for rtype, r in doc["spec"]["tfReplicaSpecs"].items()]
        else:
            continue
        for template, given in templates:
            labels = dict((template.get("metadata") or {}).get("labels") or {}, **given)
            ports = {p["containerPort"] for c in template["spec"]["containers"]
                     for p in c.get("ports", ())}
            pods.append((labels, ports))
    return pods


# Pods of another job in the same namespace, as each controller labels them.
_STRANGERS = [{"batch.kubernetes.io/job-name": "other-job", "job-name": "other-job"},
              {"training.kubeflow.org/job-name": "other-tfjob",
               "training.kubeflow.org/replica-type": "worker"},
              {"app": "tfpsx-scheduler-impostor"}, {}]


@pytest.mark.parametrize("manifest", ["tfjob-criteo.yaml", "scheduler-criteo.yaml"])
def test_a_network_policy_admits_only_the_jobs_own_pods_to_its_ports(manifest):
    pods = _pods(manifest)
    policies = [p for p in load("networkpolicy.yaml")
                if all(_selects(p["spec"]["podSelector"], labels) for labels, _ in pods)]
    assert len(policies) == 1, f"one policy selects every pod of {manifest}"
    (policy,) = policies
    spec = policy["spec"]
    assert (policy["apiVersion"], policy["kind"]) == ("networking.k8s.io/v1", "NetworkPolicy")
    assert "Ingress" in spec["policyTypes"]  # a selected pod takes only what a rule admits
    for stranger in _STRANGERS:
        assert not _selects(spec["podSelector"], stranger), stranger
    listened = set().union(*(ports for _, ports in pods))
    for rule in spec["ingress"]:
        # from the job's pods only: no namespace-wide or address-block source
        assert all(set(source) == {"podSelector"} for source in rule["from"]), rule
        for source in rule["from"]:
            assert all(_selects(source["podSelector"], labels) for labels, _ in pods)
            assert not any(_selects(source["podSelector"], s) for s in _STRANGERS)
        assert {(p["protocol"], p["port"]) for p in rule["ports"]} == \
            {("TCP", port) for port in listened}, (rule, listened)
    assert listened == ({2222} if manifest == "tfjob-criteo.yaml" else {2222, 7000})


def test_the_tfdata_service_manifest_serves_the_tfjobs_workers():
    """data-service.yaml: a dispatcher and data workers as tfpsx.data.service parses
    their arguments, the address every data worker and the TFJob's training pods dial is
    the dispatcher pod's (its StatefulSet's pod 0 under the headless service, its port),
    the data workers read the files on the volume the TFJob mounts, and a network policy
    admits the data pods and the TFJob's pods to its ports, nobody else."""
    from tfpsx.data import service

    docs = load("data-service.yaml")
    (headless,) = [d for d in docs if d["kind"] == "Service"]
    assert headless["spec"]["clusterIP"] == "None"
    sets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "StatefulSet"}
    assert set(sets) == {"tfpsx-criteo-dispatcher", "tfpsx-criteo-data-worker"}
    setup = open(os.path.join(ROOT, "setup.py")).read()
    assert '"tfpsx-data-service=tfpsx.data.service:main"' in setup
    parsed, ports = {}, {}
    for name, doc in sets.items():
        assert doc["spec"]["serviceName"] == headless["metadata"]["name"]
        pod = doc["spec"]["template"]
        assert all(pod["metadata"]["labels"][k] == v
                   for k, v in doc["spec"]["selector"]["matchLabels"].items())
        assert all(headless["spec"]["selector"][k] == pod["metadata"]["labels"][k]
                   for k in headless["spec"]["selector"])
        (c,) = pod["spec"]["containers"]
        assert c["image"] == "tfpsx:latest" and c["command"][0] == "tfpsx-data-service"
        parsed[name] = service._parser().parse_args(c["command"][1:])
        ports[name] = [p["containerPort"] for p in c["ports"]]
        assert ports[name] == [parsed[name].port]
        assert {p["port"] for p in headless["spec"]["ports"]} >= set(ports[name])
        assert [m["mountPath"] for m in c["volumeMounts"]] == ["/data"]
    dispatcher, worker = parsed["tfpsx-criteo-dispatcher"], parsed["tfpsx-criteo-data-worker"]
    assert dispatcher.role == "dispatcher" and dispatcher.work_dir.startswith("/data/")
    address = f"tfpsx-criteo-dispatcher-0.tfpsx-criteo-data:{dispatcher.port}"
    assert worker.role == "data_worker" and worker.dispatcher == address
    assert worker.host == "$(POD_NAME).tfpsx-criteo-data"  # its own pod's name
    (job,) = load("tfjob-criteo.yaml")
    for rtype in ("Chief", "Worker"):
        (c,) = job["spec"]["tfReplicaSpecs"][rtype]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in c.get("env", ())}
        assert env["TFPSX_DATA_SERVICE"] == f"grpc://{address}", rtype
        service.check_address(env["TFPSX_DATA_SERVICE"])  # (what address() takes)
    # The network policy: the data pods and the TFJob's, to the service's ports.
    data_pods = [doc["spec"]["template"]["metadata"]["labels"] for doc in sets.values()]
    tfjob_pods = [labels for labels, _ in _pods("tfjob-criteo.yaml")]
    (policy,) = [p for p in load("networkpolicy.yaml")
                 if all(_selects(p["spec"]["podSelector"], labels) for labels in data_pods)]
    assert not any(_selects(policy["spec"]["podSelector"], labels) for labels in tfjob_pods)
    (rule,) = policy["spec"]["ingress"]
    assert {(p["protocol"], p["port"]) for p in rule["ports"]} == \
        {("TCP", p) for p in sum(ports.values(), [])}
    admitted = lambda labels: any(_selects(s["podSelector"], labels)  # noqa: E731
                                  for s in rule["from"])
    assert all(admitted(labels) for labels in data_pods + tfjob_pods)
    assert not any(admitted(stranger) for stranger in _STRANGERS)

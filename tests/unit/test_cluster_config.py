"""The config matrix: every source resolves to the same ClusterConfig shape, and every
malformed input is a ValueError that names the source, the bad value and what was expected."""

import json

import pytest

import tfpsx
from tfpsx import cluster, settings
from tfpsx.cluster import (EnvRoleMaker, FlagsRoleMaker, TFConfigRoleMaker,
                              UserDefinedRoleMaker)

PS = ["127.0.0.1:2001", "127.0.0.1:2002"]
WK = ["127.0.0.1:3001", "127.0.0.1:3002", "127.0.0.1:3003"]


def tf_config(task_type="worker", index=0, **cluster_extra):
    spec = {"ps": PS, "worker": WK}
    spec.update(cluster_extra)
    return json.dumps({"cluster": spec, "task": {"type": task_type, "index": index},
                       "environment": "cloud"})


def env_vars(role="worker", rank="1", servers=",".join(PS), workers=",".join(WK), **extra):
    env = {"TFPSX_ROLE": role, "TFPSX_RANK": rank, "TFPSX_SERVER_ENDPOINTS": servers,
           "TFPSX_WORKER_ENDPOINTS": workers}
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


# ------------------------------------------------------------------ valid configurations

def test_tf_config_worker_with_extra_keys():
    c = cluster.resolve({"TF_CONFIG": tf_config("worker", 2)})
    assert (c.role, c.index, c.servers, c.workers) == ("worker", 2, tuple(PS), tuple(WK))
    assert (c.job_name, c.task_index, c.source) == ("worker", 2, "TF_CONFIG")
    assert c.cluster_dict() == {"ps": PS, "worker": WK}
    assert not c.is_chief


def test_tf_config_chief_job_is_worker_zero():
    spec = {"cluster": {"chief": ["h:1"], "worker": ["h:2", "h:3"], "ps": ["h:4"]},
            "task": {"type": "worker", "index": 1}}
    c = cluster.from_tf_config(spec)
    assert (c.role, c.index, c.workers) == ("worker", 2, ("h:1", "h:2", "h:3"))
    assert (c.job_name, c.task_index) == ("worker", 1)
    chief = cluster.from_tf_config(spec, task_type="chief", task_index=0)
    assert chief.is_chief and (chief.job_name, chief.task_index) == ("chief", 0)
    assert chief.cluster_dict() == {"ps": ["h:4"], "chief": ["h:1"], "worker": ["h:2", "h:3"]}


def test_tf_config_ps_and_evaluator():
    ps = cluster.from_tf_config(tf_config("ps", 1))
    assert (ps.role, ps.index, ps.job_name) == ("server", 1, "ps")
    ev = cluster.from_tf_config(tf_config("evaluator", 0, evaluator=["127.0.0.1:4001"]))
    assert ev.role == "evaluator" and "evaluator" not in ev.cluster_dict()
    assert ev.tf_config()["cluster"]["evaluator"] == ["127.0.0.1:4001"]


def test_an_evaluator_outside_the_cluster_as_tf_defines_it():
    ev = cluster.from_tf_config(tf_config("evaluator", 0))  # TF's form; Kubeflow lists it
    assert (ev.role, ev.index, ev.evaluators) == ("evaluator", 0, ())
    with pytest.raises(ValueError, match=r"index 1 is out of range for 1 evaluator"):
        cluster.from_tf_config(tf_config("evaluator", 1))
    env = cluster.from_env({"TFPSX_ROLE": "evaluator"})  # tfpsx-run's env and scheduler modes
    assert (env.role, env.index, env.servers) == ("evaluator", 0, ())


def test_launcher_tasks_with_a_chief_and_an_evaluator(tmp_path):
    """The chief is worker rank 0 in every mode; TF_CONFIG names it ``chief`` (as Kubeflow
    writes it) and keeps the evaluator out of every training task's cluster."""
    from tfpsx.launcher.local import LocalCluster

    def made(mode):
        return LocalCluster("x.py", 1, 2, config_mode=mode, chief=True, evaluator=True,
                            log_dir=str(tmp_path / mode))

    c = made("tf_config")
    assert c.tasks() == [("server", 0), ("chief", 0), ("worker", 0), ("worker", 1),
                         ("evaluator", 0)]
    resolved = {t: cluster.resolve(c.task_env(*t)) for t in c.tasks()}
    assert [(r.role, r.index) for r in resolved.values()] == [
        ("server", 0), ("worker", 0), ("worker", 1), ("worker", 2), ("evaluator", 0)]
    assert resolved[("chief", 0)].is_chief and resolved[("chief", 0)].job_name == "chief"
    for task in c.tasks():
        assert "evaluator" not in json.loads(c.task_env(*task)["TF_CONFIG"])["cluster"]
    for mode in ("env", "scheduler"):
        c = made(mode)
        env = c.task_env("worker", 1)
        assert (env["TFPSX_ROLE"], env["TFPSX_RANK"]) == ("worker", "2")
        assert c.task_env("chief", 0)["TFPSX_RANK"] == "0"
        assert cluster.resolve(c.task_env("evaluator", 0)).role == "evaluator"
    assert made("scheduler").task_env("chief", 0)["TFPSX_WORKER_NUM"] == "3"


def test_a_joining_workers_rank_may_go_up_to_the_maximum():
    env = {"TFPSX_ROLE": "worker", "TFPSX_SCHED_ADDR": "127.0.0.1:7000",
           "TFPSX_SERVER_NUM": "1", "TFPSX_WORKER_NUM": "2", "TFPSX_RANK": "2"}
    with pytest.raises(ValueError, match="index 2 is out of range for 2 worker"):
        cluster.from_env(env)
    joiner = cluster.from_env(dict(env, TFPSX_MAX_WORKER_NUM="3"))
    assert joiner.index == 2 and joiner.needs_scheduler
    # What the scheduler hands back: the started-with count makes it a joiner.
    import dataclasses
    done = dataclasses.replace(joiner, servers=("h:1",), workers=("h:2", "h:3", "h:4"),
                               initial_worker_num=2)
    assert done.joined and done.worker_num == 3
    assert not dataclasses.replace(done, index=1).joined


def test_tf_config_round_trip():
    c = cluster.from_tf_config(tf_config("ps", 0))
    assert cluster.from_tf_config(json.dumps(c.tf_config())) == c


def test_env_endpoints_and_ipv6_and_hostnames():
    c = cluster.resolve(env_vars(role="server", rank="0",
                                 servers="[::1]:2001, ps-1.ps.svc.cluster.local:2222"))
    assert c.role == "server" and c.servers == ("[::1]:2001", "ps-1.ps.svc.cluster.local:2222")
    assert c.source == "env"


def test_env_scheduler_variant_leaves_hook():
    c = cluster.resolve({"TFPSX_ROLE": "worker", "TFPSX_SCHED_ADDR": "127.0.0.1:7000",
                         "TFPSX_SERVER_NUM": "2", "TFPSX_WORKER_NUM": "4", "TFPSX_TOKEN": "s3"})
    assert c.needs_scheduler and c.index is None
    assert c.scheduler == cluster.SchedulerInfo("127.0.0.1:7000", 2, 4, "s3")
    assert (c.server_num, c.worker_num) == (2, 4)


def test_env_arguments_override_variables():
    c = EnvRoleMaker(role="server", rank=1, env=env_vars()).resolve()
    assert (c.role, c.index) == ("server", 1)


def test_tf_config_arguments_override_task():
    c = TFConfigRoleMaker(tf_config("worker", 0), task_type="ps", task_index=1).resolve()
    assert (c.role, c.index) == ("server", 1)


def test_flags_and_user_defined_agree():
    argv = ["--ps_hosts", ",".join(PS), "--worker_hosts", ",".join(WK), "--job_name",
            "worker", "--task_index", "2", "--learning_rate", "0.1"]
    flags = FlagsRoleMaker(argv).resolve()
    user = UserDefinedRoleMaker("worker", 2, PS, WK).resolve()
    assert (flags.role, flags.index, flags.servers, flags.workers) == \
        (user.role, user.index, user.servers, user.workers)


@pytest.fixture
def fresh_runtime():
    """The process runtime as no init left it, and again afterwards (RUNTIME.reset()): a
    role set here must not reach later tests (a server role makes tables in this process
    look remote)."""
    from tfpsx.runtime import RUNTIME
    RUNTIME.reset()
    yield RUNTIME
    RUNTIME.reset()


def test_fleet_api_after_init(fresh_runtime):
    tfpsx.init(UserDefinedRoleMaker("worker", 0, PS, WK))
    assert tfpsx.is_worker() and tfpsx.is_chief() and not tfpsx.is_server()
    assert (tfpsx.worker_index(), tfpsx.worker_num(), tfpsx.server_num()) == (0, 3, 2)
    assert tfpsx.cluster_spec().as_dict() == {"ps": PS, "worker": WK}
    assert tfpsx.session_config().device_filters == ["/job:ps", "/job:worker/task:0"]
    with pytest.raises(tfpsx.errors.WrongRoleError, match="for a server"):
        tfpsx.server_index()
    with pytest.raises(tfpsx.errors.WrongRoleError, match="run_server.*for a server"):
        tfpsx.run_server()
    tfpsx.init(UserDefinedRoleMaker("server", 1, PS, WK))
    assert tfpsx.is_server() and tfpsx.server_index() == 1 and not tfpsx.is_chief()
    with pytest.raises(tfpsx.errors.WrongRoleError, match="init_worker"):
        tfpsx.init_worker()


def test_calls_before_init_are_clear(monkeypatch):
    from tfpsx.runtime import RUNTIME as FLEET
    monkeypatch.setattr(FLEET, "config", None)
    for call in (tfpsx.is_server, tfpsx.worker_num, tfpsx.cluster_spec, tfpsx.stop_worker):
        with pytest.raises(tfpsx.errors.NotInitializedError, match="call tfpsx.init"):
            call()


def test_init_rejects_non_role_maker():
    with pytest.raises(TypeError, match="expects a tfpsx RoleMaker"):
        tfpsx.init(role_maker={"role": "worker"})


# ------------------------------------------------------------------ bad inputs
# (id, source dict or callable, substrings the message must contain)

BAD_TF_CONFIG = [
    ("not-json", "{cluster:", ["TF_CONFIG is not valid JSON", "{cluster:"]),
    ("not-object", "[1, 2]", ["must be a JSON object", "list"]),
    ("no-cluster", '{"task": {"type": "ps", "index": 0}}', ["TF_CONFIG['cluster']", "None"]),
    ("cluster-not-dict", '{"cluster": ["h:1"]}', ["TF_CONFIG['cluster']", "['h:1']"]),
    ("unknown-job", tf_config(master=["h:9"]), ["unknown job 'master'", "chief, worker, ps"]),
    ("hosts-not-list", tf_config(evaluator="h:9"), ["['evaluator']", "'h:9'", "list"]),
    ("host-without-port", tf_config(evaluator=["localhost"]), ["'localhost'", "host:port"]),
    ("port-out-of-range", tf_config(evaluator=["h:70000"]), ["'70000'", "1..65535"]),
    ("port-not-number", tf_config(evaluator=["h:http"]), ["'http'", "1..65535"]),
    ("host-not-string", tf_config(evaluator=[2222]), ["2222", "'host:port' string"]),
    ("bad-hostname", tf_config(evaluator=["bad host:22"]), ["'bad host:22'", "host:port"]),
    ("duplicate-across-jobs", tf_config(evaluator=[PS[0]]), ["duplicate endpoint", PS[0]]),
    ("two-chiefs", tf_config(chief=["h:7", "h:8"]), ["['chief']", "at most one"]),
    ("no-ps", json.dumps({"cluster": {"worker": WK}, "task": {"type": "worker"}}),
     ["no 'ps' hosts", "at least one parameter server"]),
    ("no-worker", json.dumps({"cluster": {"ps": PS}, "task": {"type": "ps"}}),
     ["no 'chief' or 'worker'"]),
    ("task-not-dict", json.dumps({"cluster": {"ps": PS, "worker": WK}, "task": "ps"}),
     ["TF_CONFIG['task']", "'ps'"]),
    ("task-type-missing", json.dumps({"cluster": {"ps": PS, "worker": WK}, "task": {"index": 0}}),
     ["['type'] is missing"]),
    ("task-type-unknown", tf_config("trainer", 0), ["'trainer'", "chief, worker, ps, evaluator"]),
    ("task-type-absent-job", tf_config("chief", 0), ["'chief'", "no 'chief' hosts"]),
    ("task-index-negative", tf_config("worker", -1), ["['index']", "-1", ">= 0"]),
    ("task-index-out-of-range", tf_config("ps", 2), ["index 2", "0..1"]),
    ("task-index-float", tf_config("ps", 0.5), ["['index']", "0.5"]),
    ("task-index-bool", tf_config("ps", True), ["['index']", "True"]),
]

BAD_ENV = [
    ("unknown-role", env_vars(role="trainer"), ["TFPSX_ROLE", "'trainer'", "server, worker, scheduler"]),
    ("rank-not-int", env_vars(rank="one"), ["TFPSX_RANK", "'one'", "integer"]),
    ("rank-negative", env_vars(rank="-1"), ["TFPSX_RANK", "'-1'", ">= 0"]),
    ("rank-out-of-range", env_vars(rank="3"), ["TFPSX_RANK", "index 3", "0..2"]),
    ("rank-missing", env_vars(rank=None), ["TFPSX_RANK is not set"]),
    ("role-missing", env_vars(role=None), ["TFPSX_ROLE is not set", "server, worker, scheduler"]),
    ("servers-missing", env_vars(servers=None), ["TFPSX_SERVER_ENDPOINTS is not set"]),
    ("workers-empty", env_vars(workers=" "), ["TFPSX_WORKER_ENDPOINTS is not set"]),
    ("server-endpoint-empty-item", env_vars(servers=PS[0] + ",,"), ["TFPSX_SERVER_ENDPOINTS", "''"]),
    ("worker-malformed", env_vars(workers="127.0.0.1"), ["TFPSX_WORKER_ENDPOINTS", "'127.0.0.1'"]),
    ("duplicate-in-list", env_vars(workers=f"{WK[0]},{WK[0]}"), ["duplicate endpoint", WK[0]]),
    ("duplicate-server-worker", env_vars(workers=PS[1]), ["duplicate endpoint", PS[1]]),
    ("count-disagrees", env_vars(TFPSX_WORKER_NUM="5"), ["TFPSX_WORKER_NUM=5", "3 endpoint"]),
    ("sched-with-endpoints", env_vars(TFPSX_SCHED_ADDR="127.0.0.1:7000"),
     ["conflicting cluster sources", "TFPSX_SCHED_ADDR", "TFPSX_SERVER_ENDPOINTS"]),
    ("sched-bad-addr", {"TFPSX_ROLE": "worker", "TFPSX_SCHED_ADDR": "sched",
                        "TFPSX_SERVER_NUM": "1", "TFPSX_WORKER_NUM": "1"},
     ["TFPSX_SCHED_ADDR", "'sched'"]),
    ("sched-count-missing", {"TFPSX_ROLE": "server", "TFPSX_SCHED_ADDR": "h:7000",
                             "TFPSX_SERVER_NUM": "1"}, ["TFPSX_WORKER_NUM"]),
    ("sched-count-words", {"TFPSX_ROLE": "server", "TFPSX_SCHED_ADDR": "h:7000",
                           "TFPSX_SERVER_NUM": "two", "TFPSX_WORKER_NUM": "1"},
     ["TFPSX_SERVER_NUM", "'two'", ">= 1"]),
    ("sched-count-zero", {"TFPSX_ROLE": "server", "TFPSX_SCHED_ADDR": "h:7000",
                          "TFPSX_SERVER_NUM": "1", "TFPSX_WORKER_NUM": "0"},
     ["TFPSX_WORKER_NUM", "'0'", ">= 1"]),
    ("sched-count-negative", {"TFPSX_ROLE": "server", "TFPSX_SCHED_ADDR": "h:7000",
                              "TFPSX_SERVER_NUM": "-2", "TFPSX_WORKER_NUM": "1"},
     ["TFPSX_SERVER_NUM", "'-2'"]),
    ("scheduler-without-addr", env_vars(role="scheduler"), ["TFPSX_ROLE=scheduler", "TFPSX_SCHED_ADDR"]),
    ("tf-config-and-env", dict(env_vars(), TF_CONFIG=tf_config()),
     ["conflicting cluster sources", "TF_CONFIG", "TFPSX_ROLE"]),
    ("nothing-set", {}, ["no cluster configured", "TF_CONFIG", "TFPSX_ROLE"]),
]


@pytest.mark.parametrize("value,needles", [c[1:] for c in BAD_TF_CONFIG],
                         ids=[c[0] for c in BAD_TF_CONFIG])
def test_bad_tf_config(value, needles):
    with pytest.raises(ValueError) as info:
        cluster.resolve({"TF_CONFIG": value})
    for needle in needles:
        assert needle in str(info.value)


@pytest.mark.parametrize("env,needles", [c[1:] for c in BAD_ENV], ids=[c[0] for c in BAD_ENV])
def test_bad_env(env, needles):
    with pytest.raises(ValueError) as info:
        cluster.resolve(env)
    for needle in needles:
        assert needle in str(info.value)


BAD_ARGS = [
    ("user-role", lambda: UserDefinedRoleMaker("ps", 0, PS, WK), ["role", "'ps'", "server, worker"]),
    ("user-id-range", lambda: UserDefinedRoleMaker("server", 5, PS, WK), ["current_id", "index 5", "0..1"]),
    ("user-endpoints-type", lambda: UserDefinedRoleMaker("worker", 0, 2001, WK),
     ["server_endpoints", "2001", "list of 'host:port'"]),
    ("user-endpoints-empty", lambda: UserDefinedRoleMaker("worker", 0, PS, []),
     ["worker_endpoints", "no endpoints", "at least one"]),
    ("flags-missing", lambda: FlagsRoleMaker(["--job_name", "ps"]), ["--ps_hosts", "--worker_hosts"]),
    ("flags-job", lambda: FlagsRoleMaker(["--ps_hosts", PS[0], "--worker_hosts", WK[0],
                                          "--job_name", "chief", "--task_index", "0"]),
     ["--job_name", "'chief'", "'ps' or 'worker'"]),
    ("flags-index", lambda: FlagsRoleMaker(["--ps_hosts", PS[0], "--worker_hosts", WK[0],
                                            "--job_name", "ps", "--task_index", "x"]),
     ["current_id", "'x'", "integer"]),
    ("env-override-role", lambda: EnvRoleMaker(role="boss", env=env_vars()),
     ["argument for TFPSX_ROLE", "'boss'"]),
    ("tfconfig-maker-unset", lambda: TFConfigRoleMaker(), ["TF_CONFIG is not set"]),
]


@pytest.mark.parametrize("make,needles", [c[1:] for c in BAD_ARGS], ids=[c[0] for c in BAD_ARGS])
def test_bad_arguments(make, needles, monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError) as info:
        make().resolve()
    for needle in needles:
        assert needle in str(info.value)


def test_bad_input_count():
    # The issue asks for at least 25 malformed inputs with clear errors.
    assert len(BAD_TF_CONFIG) + len(BAD_ENV) + len(BAD_ARGS) >= 25


@pytest.mark.parametrize("name,value", [("TFPSX_CONNECT_TIMEOUT", "soon"),
                                        ("TFPSX_CONNECT_TIMEOUT", "-3"),
                                        ("TFPSX_HEARTBEAT_TIMEOUT", "nan")])
def test_bad_timeout_env(name, value):
    with pytest.raises(ValueError, match=f"{name}.*{value}"):
        settings.get(name, env={name: value})


def test_reset_forgets_the_role_and_the_control_plane(fresh_runtime):
    from tfpsx.metrics import sinks
    tfpsx.init(UserDefinedRoleMaker("worker", 1, PS, WK))
    assert fresh_runtime.config.index == 1 and fresh_runtime._coord is not None
    assert sinks._identity == {"role": "worker", "rank": 1}
    fresh_runtime.reset()
    assert fresh_runtime.config is None and fresh_runtime._coord is None
    assert not fresh_runtime.worker_started
    assert sinks._identity == {"role": None, "rank": None}
    with pytest.raises(tfpsx.errors.NotInitializedError, match="call tfpsx.init"):
        tfpsx.worker_index()
    fresh_runtime.reset()  # twice is fine


# ------------------------------------------------------------------ collective jobs

def test_a_collective_job_has_workers_only_in_every_source():
    spec = {"cluster": {"worker": WK}, "task": {"type": "worker", "index": 1}}
    c = cluster.from_tf_config(spec, collective=True)
    assert (c.role, c.index, c.servers, c.collective) == ("worker", 1, (), True)
    assert c.cluster_dict() == {"worker": WK} and c.server_num == 0
    env = env_vars(servers=None)
    assert EnvRoleMaker(env=env).resolve(collective=True).workers == tuple(WK)
    sched = {"TFPSX_ROLE": "worker", "TFPSX_SCHED_ADDR": "127.0.0.1:7000",
             "TFPSX_SERVER_NUM": "0", "TFPSX_WORKER_NUM": "3"}
    s = cluster.from_env(sched, collective=True)
    assert s.needs_scheduler and s.server_num == 0 and s.collective
    user = UserDefinedRoleMaker("worker", 0, [], WK).resolve(collective=True)
    assert user.servers == () and user.collective
    flags = FlagsRoleMaker(["--worker_hosts", ",".join(WK), "--job_name", "worker",
                            "--task_index", "2"]).resolve(collective=True)
    assert (flags.index, flags.servers) == (2, ())


def test_servers_in_a_collective_job_and_none_in_a_ps_job_are_refused():
    with pytest.raises(ValueError, match=r"TF_CONFIG\['cluster'\]\['ps'\]: 2 parameter server\(s\) "
                       r".*tfpsx.init\(is_collective=True\) trains by all-reduce"):
        cluster.from_tf_config(tf_config("worker", 0), collective=True)
    with pytest.raises(ValueError, match=r"TFPSX_SERVER_ENDPOINTS: 2 parameter server"):
        cluster.from_env(env_vars(), collective=True)
    with pytest.raises(ValueError, match=r"TFPSX_SERVER_NUM: 1 parameter server"):
        cluster.from_env({"TFPSX_ROLE": "worker", "TFPSX_SCHED_ADDR": "127.0.0.1:7000",
                          "TFPSX_SERVER_NUM": "1", "TFPSX_WORKER_NUM": "2"}, collective=True)
    with pytest.raises(ValueError, match=r"has no 'ps' hosts.*is_collective=True"):
        cluster.from_tf_config({"cluster": {"worker": WK}, "task": {"type": "worker"}})
    with pytest.raises(ValueError, match=r"TFPSX_SERVER_NUM: expected an integer >= 1, got '0'"):
        cluster.from_env({"TFPSX_ROLE": "worker", "TFPSX_SCHED_ADDR": "127.0.0.1:7000",
                          "TFPSX_SERVER_NUM": "0", "TFPSX_WORKER_NUM": "2"})
    with pytest.raises(ValueError, match=r"server_endpoints: no endpoints given"):
        UserDefinedRoleMaker("worker", 0, [], WK).resolve(collective=False)


def test_init_takes_is_collective_as_a_bool_only():
    with pytest.raises(TypeError, match=r"is_collective=\.\.\.\) expects True or False, got 'yes'"):
        tfpsx.init(UserDefinedRoleMaker("worker", 0, [], WK), is_collective="yes")


def test_a_listen_port_is_refused_without_the_port_the_others_dial(monkeypatch):
    """With a scheduler the node registers host:TFPSX_PORT; listening elsewhere
    (TFPSX_LISTEN_PORT) on a port picked at random would register an address nothing
    listens on: refused, naming both, before any registration."""
    from tfpsx.control import sched_client

    config = cluster.resolve({"TFPSX_ROLE": "worker", "TFPSX_SCHED_ADDR": "127.0.0.1:7000",
                              "TFPSX_SERVER_NUM": "1", "TFPSX_WORKER_NUM": "1"})
    monkeypatch.setenv("TFPSX_LISTEN_PORT", "2222")
    for port in (None, "0"):
        if port is None:
            monkeypatch.delenv("TFPSX_PORT", raising=False)
        else:
            monkeypatch.setenv("TFPSX_PORT", port)
        with pytest.raises(ValueError, match=r"TFPSX_LISTEN_PORT=2222 needs TFPSX_PORT.*got "
                                             + ("None" if port is None else "'0'")):
            sched_client.register_node(config, 1.0, 1.0, 1.0, 1.0)


def test_the_launcher_never_hands_one_listen_port_to_every_task(monkeypatch, tmp_path):
    from tfpsx.testing import LocalCluster

    monkeypatch.setenv("TFPSX_LISTEN_PORT", "2222")
    c = LocalCluster("train.py", 1, 2, log_dir=str(tmp_path))
    for role, index in (("server", 0), ("worker", 0), ("worker", 1)):
        assert "TFPSX_LISTEN_PORT" not in c.task_env(role, index)


def test_a_process_dials_itself_at_its_listen_port(monkeypatch):
    c = EnvRoleMaker(role="server", rank=0, env=env_vars()).resolve()
    other = c.servers[1]
    assert c.dial(c.task_address()) == c.task_address()  # no listen port: as listed
    monkeypatch.setenv("TFPSX_LISTEN_PORT", "2222")
    assert c.dial(c.task_address()) == "localhost:2222"
    assert c.dial(other) == other

"""One cluster resolver: TF_CONFIG, TFPSX_* env, classic flags or Python arguments.

Every source becomes the same validated :class:`ClusterConfig`. Validation lives here
and only here; every error is a ``ValueError`` that names the source (the variable,
flag or argument), the bad value, and what was expected.

Sources, in the order :func:`resolve` tries them when no role maker is given:

1. ``TF_CONFIG`` as TF and Kubeflow's TFJob write it::

     {"cluster": {"chief": [...], "worker": [...], "ps": [...], "evaluator": [...]},
      "task": {"type": "worker", "index": 1}, "environment": "cloud"}

2. bare env: ``TFPSX_ROLE`` (server|worker|scheduler), ``TFPSX_SERVER_ENDPOINTS``,
   ``TFPSX_WORKER_ENDPOINTS`` (comma-separated host:port) and ``TFPSX_RANK``; or the
   scheduler variant ``TFPSX_SCHED_ADDR``, ``TFPSX_SERVER_NUM``, ``TFPSX_WORKER_NUM``
   (optional ``TFPSX_TOKEN``), where a scheduler assigns ranks and endpoints.

Setting both TF_CONFIG and TFPSX_* cluster variables is an error (which one wins would
be a guess). Explicit arguments (the role makers' constructor arguments) override the
environment field by field.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import os
import re
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

SERVER = "server"
WORKER = "worker"
SCHEDULER = "scheduler"
EVALUATOR = "evaluator"
ROLES = (SERVER, WORKER, SCHEDULER)

# TF_CONFIG job names tfpsx understands. "master" (TF1 estimator) is deliberately absent.
TF_CONFIG_JOBS = ("chief", "worker", "ps", "evaluator")

ENV_ROLE = "TFPSX_ROLE"
ENV_RANK = "TFPSX_RANK"
ENV_SERVER_ENDPOINTS = "TFPSX_SERVER_ENDPOINTS"
ENV_WORKER_ENDPOINTS = "TFPSX_WORKER_ENDPOINTS"
ENV_SCHED_ADDR = "TFPSX_SCHED_ADDR"
ENV_SERVER_NUM = "TFPSX_SERVER_NUM"
ENV_WORKER_NUM = "TFPSX_WORKER_NUM"
ENV_TOKEN = "TFPSX_TOKEN"
CLUSTER_ENV_VARS = (ENV_ROLE, ENV_RANK, ENV_SERVER_ENDPOINTS, ENV_WORKER_ENDPOINTS,
                    ENV_SCHED_ADDR, ENV_SERVER_NUM, ENV_WORKER_NUM)

_HOSTNAME_RE = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")


@dataclasses.dataclass(frozen=True)
class SchedulerInfo:
    """Where the scheduler is and how many nodes it waits for."""
    address: str
    server_num: int
    worker_num: int
    token: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """A validated cluster and this process's place in it.

    Attributes:
      role: "server", "worker", "scheduler" or "evaluator".
      index: this process's rank within its role (worker rank counts the chief as 0);
        None while a scheduler has yet to assign it.
      servers: PS endpoints, rank order.
      workers: worker endpoints, rank order; with a TF_CONFIG ``chief`` job its host is
        worker 0 and the ``worker`` job's hosts follow.
      has_chief_job: TF_CONFIG had a ``chief`` job (so TF device names use /job:chief).
      evaluators: TF_CONFIG ``evaluator`` hosts (not part of the training cluster).
      scheduler: set when a scheduler assigns ranks (then endpoints may be empty).
      source: where the config came from, for messages.
    """
    role: str
    index: Optional[int]
    servers: Tuple[str, ...] = ()
    workers: Tuple[str, ...] = ()
    has_chief_job: bool = False
    evaluators: Tuple[str, ...] = ()
    scheduler: Optional[SchedulerInfo] = None
    source: str = "user"

    @property
    def server_num(self) -> int:
        return self.scheduler.server_num if self.scheduler and not self.servers else len(self.servers)

    @property
    def worker_num(self) -> int:
        return self.scheduler.worker_num if self.scheduler and not self.workers else len(self.workers)

    @property
    def needs_scheduler(self) -> bool:
        """True while ranks and endpoints are still to come from the scheduler."""
        return self.scheduler is not None and (self.index is None or not self.servers)

    @property
    def is_chief(self) -> bool:
        return self.role == WORKER and self.index == 0

    def task_address(self) -> Optional[str]:
        """This process's own host:port, when it has one in the cluster."""
        if self.role == SERVER:
            return self.servers[self.index]
        if self.role == WORKER:
            return self.workers[self.index]
        if self.role == EVALUATOR and self.evaluators:
            return self.evaluators[self.index]
        return None

    def worker_device_job(self, worker_index: int) -> Tuple[str, int]:
        """TF (job name, task index) of a worker rank: honours a TF_CONFIG chief job."""
        if self.has_chief_job:
            return ("chief", 0) if worker_index == 0 else ("worker", worker_index - 1)
        return ("worker", worker_index)

    @property
    def job_name(self) -> str:
        """This process's TF job name ("ps", "worker", "chief", "evaluator")."""
        if self.role == SERVER:
            return "ps"
        if self.role == WORKER:
            return self.worker_device_job(self.index)[0]
        return self.role

    @property
    def task_index(self) -> int:
        """This process's TF task index within :attr:`job_name`."""
        if self.role == WORKER:
            return self.worker_device_job(self.index)[1]
        return self.index

    def cluster_dict(self) -> Dict[str, list]:
        """The training cluster as TF's ClusterSpec dict (no evaluator, like TF)."""
        if self.needs_scheduler:
            raise ValueError("the cluster is not known yet: the scheduler at "
                             f"{self.scheduler.address} has not assigned endpoints")
        spec = {"ps": list(self.servers)}
        if self.has_chief_job:
            spec["chief"] = [self.workers[0]]
            if len(self.workers) > 1:
                spec["worker"] = list(self.workers[1:])
        else:
            spec["worker"] = list(self.workers)
        return spec

    def cluster_spec(self):
        """The training cluster as a ``tf.train.ClusterSpec``."""
        import tensorflow as tf

        return tf.train.ClusterSpec(self.cluster_dict())

    def tf_config(self) -> Dict[str, Any]:
        """This config as a TF_CONFIG dict (what tfpsx-run writes for plain TF scripts)."""
        cluster = self.cluster_dict()
        if self.evaluators:
            cluster["evaluator"] = list(self.evaluators)
        return {"cluster": cluster, "task": {"type": self.job_name, "index": self.task_index}}


# ----------------------------------------------------------------------------- parsing


def parse_endpoint(value: Any, what: str) -> str:
    """Validates one ``host:port`` (IPv6 as ``[addr]:port``) and returns it stripped."""
    if not isinstance(value, str):
        raise ValueError(f"{what}: expected a 'host:port' string, got {value!r} "
                         f"({type(value).__name__})")
    text = value.strip()
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        host_ok = bool(sep)
        if host_ok:
            try:
                ipaddress.IPv6Address(host)
            except ValueError:
                host_ok = False
    else:
        host, sep, port = text.rpartition(":")
        host_ok = bool(sep) and bool(_HOSTNAME_RE.match(host))
    if not host_ok:
        raise ValueError(f"{what}: malformed endpoint {value!r}: expected 'host:port' "
                         "(e.g. '10.0.0.1:2222', 'ps-0.svc:2222', '[::1]:2222')")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what}: endpoint {value!r} has port {port!r}; expected an "
                         "integer in 1..65535")
    return text


def parse_endpoint_list(value: Any, what: str, allow_empty: bool = False) -> Tuple[str, ...]:
    """Parses a comma-separated string or a list of endpoints; rejects duplicates."""
    if isinstance(value, str):
        items = [] if not value.strip() else value.split(",")
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise ValueError(f"{what}: expected a list of 'host:port' strings or a comma-separated "
                         f"string, got {value!r} ({type(value).__name__})")
    if not items and not allow_empty:
        raise ValueError(f"{what}: no endpoints given (got {value!r}); expected at least one "
                         "'host:port'")
    endpoints = tuple(parse_endpoint(item, what) for item in items)
    _reject_duplicates([(what, ep) for ep in endpoints])
    return endpoints


def _reject_duplicates(named: Sequence[Tuple[str, str]]) -> None:
    seen: Dict[str, str] = {}
    for what, ep in named:
        if ep in seen:
            where = (f"twice in {what}" if seen[ep] == what else f"in {seen[ep]} and in {what}")
            raise ValueError(f"duplicate endpoint {ep!r}: listed {where}; every task needs its "
                             "own host:port")
        seen[ep] = what


def parse_int(value: Any, what: str, minimum: int = 0) -> int:
    """Parses a non-bool integer (an int, or a string of digits) >= ``minimum``."""
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected an integer >= {minimum}, got {value!r}")
    if isinstance(value, int):
        number = value
    elif isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        number = int(value)
    else:
        raise ValueError(f"{what}: expected an integer >= {minimum}, got {value!r}")
    if number < minimum:
        raise ValueError(f"{what}: expected an integer >= {minimum}, got {value!r}")
    return number


def parse_float(value: Any, what: str, minimum: float = 0.0) -> float:
    """Parses a number > ``minimum`` (e.g. a timeout in seconds)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what}: expected a number of seconds > {minimum:g}, got {value!r}") from None
    if isinstance(value, bool) or not number > minimum or number != number:
        raise ValueError(f"{what}: expected a number of seconds > {minimum:g}, got {value!r}")
    return number


def env_float(name: str, default: Optional[float], env: Optional[Mapping[str, str]] = None,
              minimum: float = 0.0) -> Optional[float]:
    """Reads a positive float from the environment; unset or empty means ``default``."""
    env = os.environ if env is None else env
    raw = env.get(name, "")
    return default if raw.strip() == "" else parse_float(raw, name, minimum)


def _check_role(role: Any, what: str, allowed: Sequence[str] = ROLES) -> str:
    if not isinstance(role, str) or role.strip().lower() not in allowed:
        raise ValueError(f"{what}: unknown role {role!r}; expected one of {', '.join(allowed)}")
    return role.strip().lower()


def _check_index(index: Any, what: str, count: int, role: str) -> int:
    number = parse_int(index, what)
    if number >= count:
        raise ValueError(f"{what}: index {number} is out of range for {count} {role} "
                         f"endpoint(s); expected 0..{count - 1}")
    return number


# ----------------------------------------------------------------------------- sources


def from_user(role: str, index: int, server_endpoints: Any, worker_endpoints: Any,
              source: str = "user") -> ClusterConfig:
    """A config from explicit Python arguments (UserDefinedRoleMaker)."""
    role = _check_role(role, f"{source}: role", (SERVER, WORKER))
    servers = parse_endpoint_list(server_endpoints, f"{source}: server_endpoints")
    workers = parse_endpoint_list(worker_endpoints, f"{source}: worker_endpoints")
    _reject_duplicates([(f"{source}: server_endpoints", e) for e in servers] +
                       [(f"{source}: worker_endpoints", e) for e in workers])
    count = len(servers) if role == SERVER else len(workers)
    index = _check_index(index, f"{source}: current_id", count, role)
    return ClusterConfig(role=role, index=index, servers=servers, workers=workers, source=source)


def from_tf_config(tf_config: Any, task_type: Optional[str] = None,
                   task_index: Optional[int] = None) -> ClusterConfig:
    """A config from TF_CONFIG (a JSON string or an already parsed dict).

    ``task_type`` / ``task_index`` override the ``task`` entry when given.
    """
    what = "TF_CONFIG"
    if isinstance(tf_config, str):
        try:
            tf_config = json.loads(tf_config)
        except ValueError as e:
            raise ValueError(f"TF_CONFIG is not valid JSON ({e}): {tf_config[:200]!r}; expected "
                             '{"cluster": {...}, "task": {"type": ..., "index": ...}}') from None
    if not isinstance(tf_config, dict):
        raise ValueError(f"TF_CONFIG must be a JSON object, got {type(tf_config).__name__}: "
                         f"{tf_config!r:.200}")
    cluster = tf_config.get("cluster")
    if not isinstance(cluster, dict) or not cluster:
        raise ValueError(f"TF_CONFIG['cluster'] must be a non-empty object mapping job names "
                         f"({', '.join(TF_CONFIG_JOBS)}) to host lists, got {cluster!r}")
    jobs: Dict[str, Tuple[str, ...]] = {}
    for job, hosts in cluster.items():
        if job not in TF_CONFIG_JOBS:
            raise ValueError(f"TF_CONFIG['cluster'] has unknown job {job!r}; expected one of "
                             f"{', '.join(TF_CONFIG_JOBS)}")
        if not isinstance(hosts, list):
            raise ValueError(f"TF_CONFIG['cluster'][{job!r}] must be a list of 'host:port', "
                             f"got {hosts!r}")
        jobs[job] = parse_endpoint_list(hosts, f"TF_CONFIG['cluster'][{job!r}]", allow_empty=True)
    _reject_duplicates([(f"TF_CONFIG['cluster'][{j!r}]", e) for j, eps in jobs.items() for e in eps])
    for single in ("chief", "evaluator"):
        if len(jobs.get(single, ())) > 1:
            raise ValueError(f"TF_CONFIG['cluster'][{single!r}] lists {len(jobs[single])} hosts "
                             f"{list(jobs[single])}; expected at most one")
    if not jobs.get("ps"):
        raise ValueError(f"TF_CONFIG['cluster'] has no 'ps' hosts (jobs: {sorted(jobs)}); tfpsx "
                         "needs at least one parameter server")
    if not jobs.get("chief") and not jobs.get("worker"):
        raise ValueError(f"TF_CONFIG['cluster'] has no 'chief' or 'worker' hosts "
                         f"(jobs: {sorted(jobs)}); expected at least one worker")

    task = tf_config.get("task", {})
    if not isinstance(task, dict):
        raise ValueError(f"TF_CONFIG['task'] must be an object like "
                         f'{{"type": "worker", "index": 0}}, got {task!r}')
    ttype = task_type if task_type is not None else task.get("type")
    tindex = task_index if task_index is not None else task.get("index", 0)
    if ttype is None:
        raise ValueError("TF_CONFIG['task']['type'] is missing; expected one of "
                         f"{', '.join(TF_CONFIG_JOBS)}")
    if ttype not in TF_CONFIG_JOBS:
        raise ValueError(f"TF_CONFIG['task']['type'] is {ttype!r}; expected one of "
                         f"{', '.join(TF_CONFIG_JOBS)}")
    if not jobs.get(ttype):
        raise ValueError(f"TF_CONFIG['task']['type'] is {ttype!r} but TF_CONFIG['cluster'] has no "
                         f"{ttype!r} hosts (jobs: {sorted(jobs)})")
    tindex = _check_index(tindex, "TF_CONFIG['task']['index']", len(jobs[ttype]), ttype)

    has_chief = bool(jobs.get("chief"))
    workers = jobs.get("chief", ()) + jobs.get("worker", ())
    if ttype == "ps":
        role, index = SERVER, tindex
    elif ttype == "chief":
        role, index = WORKER, 0
    elif ttype == "worker":
        role, index = WORKER, tindex + (1 if has_chief else 0)
    else:
        role, index = EVALUATOR, tindex
    return ClusterConfig(role=role, index=index, servers=jobs["ps"], workers=workers,
                         has_chief_job=has_chief, evaluators=jobs.get("evaluator", ()),
                         source="TF_CONFIG")


def from_env(env: Optional[Mapping[str, str]] = None, role: Optional[str] = None,
             rank: Optional[int] = None, server_endpoints: Any = None,
             worker_endpoints: Any = None) -> ClusterConfig:
    """A config from TFPSX_* variables; the arguments override single variables."""
    env = os.environ if env is None else env

    def get(name, override):
        if override is not None:
            return override, f"argument for {name}"
        raw = env.get(name)
        return (None if raw is None or raw.strip() == "" else raw), name

    role_value, role_src = get(ENV_ROLE, role)
    sched_value, sched_src = get(ENV_SCHED_ADDR, None)
    servers_value, servers_src = get(ENV_SERVER_ENDPOINTS, server_endpoints)
    workers_value, workers_src = get(ENV_WORKER_ENDPOINTS, worker_endpoints)
    rank_value, rank_src = get(ENV_RANK, rank)
    if role_value is None:
        raise ValueError(f"{ENV_ROLE} is not set; expected one of {', '.join(ROLES)} "
                         "(set it, or TF_CONFIG, or pass a role maker to tfpsx.init())")
    role_value = _check_role(role_value, role_src)

    if sched_value is not None:
        given = [n for n, v in ((ENV_SERVER_ENDPOINTS, servers_value),
                                (ENV_WORKER_ENDPOINTS, workers_value)) if v is not None]
        if given:
            raise ValueError(f"conflicting cluster sources: {ENV_SCHED_ADDR}={sched_value!r} asks a "
                             f"scheduler to assign endpoints, but {', '.join(given)} also set; "
                             "use one or the other")
        address = parse_endpoint(sched_value, sched_src)
        num_s = env.get(ENV_SERVER_NUM)
        num_w = env.get(ENV_WORKER_NUM)
        if num_s is None or num_w is None:
            missing = [n for n, v in ((ENV_SERVER_NUM, num_s), (ENV_WORKER_NUM, num_w)) if v is None]
            raise ValueError(f"{ENV_SCHED_ADDR} is set but {', '.join(missing)} is not; expected "
                             "the number of servers and workers the scheduler waits for")
        info = SchedulerInfo(address=address,
                             server_num=parse_int(num_s, ENV_SERVER_NUM, minimum=1),
                             worker_num=parse_int(num_w, ENV_WORKER_NUM, minimum=1),
                             token=env.get(ENV_TOKEN) or None)
        index = None
        if rank_value is not None:
            count = info.server_num if role_value == SERVER else info.worker_num
            index = (None if role_value == SCHEDULER
                     else _check_index(rank_value, rank_src, count, role_value))
        return ClusterConfig(role=role_value, index=index, scheduler=info, source="env")

    if role_value == SCHEDULER:
        raise ValueError(f"{ENV_ROLE}=scheduler needs {ENV_SCHED_ADDR} (host:port to serve on), "
                         f"{ENV_SERVER_NUM} and {ENV_WORKER_NUM}")
    if servers_value is None:
        raise ValueError(f"{ENV_SERVER_ENDPOINTS} is not set; expected comma-separated host:port "
                         f"of every server (or {ENV_SCHED_ADDR} to use a scheduler)")
    if workers_value is None:
        raise ValueError(f"{ENV_WORKER_ENDPOINTS} is not set; expected comma-separated host:port "
                         f"of every worker (or {ENV_SCHED_ADDR} to use a scheduler)")
    servers = parse_endpoint_list(servers_value, servers_src)
    workers = parse_endpoint_list(workers_value, workers_src)
    _reject_duplicates([(servers_src, e) for e in servers] + [(workers_src, e) for e in workers])
    if rank_value is None:
        raise ValueError(f"{ENV_RANK} is not set; expected this {role_value}'s index")
    count = len(servers) if role_value == SERVER else len(workers)
    index = _check_index(rank_value, rank_src, count, role_value)
    for name, expected in ((ENV_SERVER_NUM, len(servers)), (ENV_WORKER_NUM, len(workers))):
        if env.get(name, "").strip():
            declared = parse_int(env[name], name, minimum=1)
            if declared != expected:
                raise ValueError(f"{name}={declared} disagrees with the {expected} endpoint(s) "
                                 "listed; fix one of them")
    return ClusterConfig(role=role_value, index=index, servers=servers, workers=workers,
                         source="env")


def from_flags(argv: Sequence[str]) -> ClusterConfig:
    """A config from TF's classic between-graph flags.

    ``--ps_hosts h:p,... --worker_hosts h:p,... --job_name ps|worker --task_index N``;
    other arguments are left alone.
    """
    parser = argparse.ArgumentParser(add_help=False)
    for flag in ("--ps_hosts", "--worker_hosts", "--job_name", "--task_index"):
        parser.add_argument(flag, default=None)
    known, _ = parser.parse_known_args(list(argv))
    missing = [f"--{k}" for k, v in vars(known).items() if v is None]
    if missing:
        raise ValueError(f"classic flags: missing {', '.join(missing)}; expected --ps_hosts, "
                         "--worker_hosts, --job_name (ps|worker) and --task_index")
    if known.job_name not in ("ps", "worker"):
        raise ValueError(f"--job_name: unknown job {known.job_name!r}; expected 'ps' or 'worker'")
    return from_user(SERVER if known.job_name == "ps" else WORKER, known.task_index,
                     known.ps_hosts, known.worker_hosts, source="flags")


def resolve(env: Optional[Mapping[str, str]] = None) -> ClusterConfig:
    """Resolves the cluster from the environment: TF_CONFIG, else TFPSX_* variables.

    Raises:
      ValueError: nothing describes a cluster, both sources do, or a value is malformed.
    """
    env = os.environ if env is None else env
    tf_config = env.get("TF_CONFIG", "")
    tfpsx_vars = [n for n in CLUSTER_ENV_VARS if env.get(n, "").strip()]
    if tf_config.strip():
        if tfpsx_vars:
            raise ValueError(f"conflicting cluster sources: TF_CONFIG is set and so are "
                             f"{', '.join(tfpsx_vars)}; set only one of them")
        return from_tf_config(tf_config)
    if tfpsx_vars:
        return from_env(env)
    raise ValueError("no cluster configured: set TF_CONFIG, or TFPSX_ROLE with "
                     "TFPSX_SERVER_ENDPOINTS/TFPSX_WORKER_ENDPOINTS/TFPSX_RANK (or TFPSX_SCHED_ADDR), "
                     "or pass a role maker to tfpsx.init(); tfpsx-run sets these for you")

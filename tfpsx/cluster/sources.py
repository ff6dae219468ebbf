"""One cluster resolver: TF_CONFIG, TFPSX_* env, classic flags or Python arguments.

Every source becomes the same validated :class:`ClusterConfig`. Validation lives here
and only here; every error is a ``ValueError`` that names the source (the variable,
flag or argument), the bad value, and what was expected.

Sources, in the order :func:`resolve` tries them when no role maker is given:

1. ``TF_CONFIG`` as TF and Kubeflow's TFJob write it::

     {"cluster": {"chief": [...], "worker": [...], "ps": [...], "evaluator": [...]},
      "task": {"type": "worker", "index": 1}, "environment": "cloud"}

2. bare env: ``TFPSX_ROLE`` (server|worker|scheduler|evaluator), ``TFPSX_SERVER_ENDPOINTS``,
   ``TFPSX_WORKER_ENDPOINTS`` (comma-separated host:port) and ``TFPSX_RANK``; or the
   scheduler variant ``TFPSX_SCHED_ADDR``, ``TFPSX_SERVER_NUM``, ``TFPSX_WORKER_NUM``
   (optional ``TFPSX_TOKEN``), where a scheduler assigns ranks and endpoints.

Setting both TF_CONFIG and TFPSX_* cluster variables is an error (which one wins would
be a guess). Explicit arguments (the role makers' constructor arguments) override the
environment field by field.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from tfpsx import settings
from tfpsx.cluster.config import (CLUSTER_ENV_VARS, ENV_RANK, ENV_ROLE, ENV_SCHED_ADDR,
                                  ENV_SERVER_ENDPOINTS, ENV_SERVER_NUM, ENV_TOKEN,
                                  ENV_WORKER_ENDPOINTS, ENV_WORKER_NUM, EVALUATOR, ROLES,
                                  SCHEDULER, SERVER, TF_CONFIG_JOBS, WORKER, ClusterConfig,
                                  SchedulerInfo, reject_duplicates, parse_endpoint,
                                  parse_endpoint_list)
from tfpsx.settings import parse_int


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


def _check_servers(count: int, collective: bool, what: str, listed: Any = None) -> None:
    """A collective job has no parameter servers; any other job has at least one."""
    if collective and count:
        raise ValueError(
            f"{what}: {count} parameter server(s) {list(listed) if listed else ''} declared, "
            "but tfpsx.init(is_collective=True) trains by all-reduce among the workers "
            "alone; remove them (tfpsx-run --server_num 0), or drop is_collective=True to "
            "train on them")
    if not collective and not count:
        raise ValueError(
            f"{what}: no parameter servers; tfpsx needs at least one (or "
            "tfpsx.init(is_collective=True) for all-reduce among the workers alone)")


# ----------------------------------------------------------------------------- sources


def from_user(role: str, index: int, server_endpoints: Any, worker_endpoints: Any,
              source: str = "user", collective: bool = False) -> ClusterConfig:
    """A config from explicit Python arguments (UserDefinedRoleMaker)."""
    role = _check_role(role, f"{source}: role", (WORKER,) if collective else (SERVER, WORKER))
    servers = parse_endpoint_list(server_endpoints, f"{source}: server_endpoints",
                                  allow_empty=collective)
    _check_servers(len(servers), collective, f"{source}: server_endpoints", servers)
    workers = parse_endpoint_list(worker_endpoints, f"{source}: worker_endpoints")
    reject_duplicates([(f"{source}: server_endpoints", e) for e in servers] +
                       [(f"{source}: worker_endpoints", e) for e in workers])
    count = len(servers) if role == SERVER else len(workers)
    index = _check_index(index, f"{source}: current_id", count, role)
    return ClusterConfig(role=role, index=index, servers=servers, workers=workers, source=source,
                         collective=collective)


def from_tf_config(tf_config: Any, task_type: Optional[str] = None,
                   task_index: Optional[int] = None, collective: bool = False) -> ClusterConfig:
    """A config from TF_CONFIG (a JSON string or an already parsed dict).

    ``task_type`` / ``task_index`` override the ``task`` entry when given.
    """
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
    reject_duplicates([(f"TF_CONFIG['cluster'][{j!r}]", e) for j, eps in jobs.items() for e in eps])
    for single in ("chief", "evaluator"):
        if len(jobs.get(single, ())) > 1:
            raise ValueError(f"TF_CONFIG['cluster'][{single!r}] lists {len(jobs[single])} hosts "
                             f"{list(jobs[single])}; expected at most one")
    if not jobs.get("ps") and not collective:
        raise ValueError(f"TF_CONFIG['cluster'] has no 'ps' hosts (jobs: {sorted(jobs)}); tfpsx "
                         "needs at least one parameter server (or tfpsx.init(is_collective=True) "
                         "for all-reduce among the workers alone)")
    _check_servers(len(jobs.get("ps", ())), collective, "TF_CONFIG['cluster']['ps']",
                   jobs.get("ps"))
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
    # TF keeps the evaluator outside the training cluster; Kubeflow lists it. Both go.
    outside = ttype == "evaluator" and not jobs.get("evaluator")
    if not jobs.get(ttype) and not outside:
        raise ValueError(f"TF_CONFIG['task']['type'] is {ttype!r} but TF_CONFIG['cluster'] has no "
                         f"{ttype!r} hosts (jobs: {sorted(jobs)})")
    tindex = _check_index(tindex, "TF_CONFIG['task']['index']",
                          1 if outside else len(jobs[ttype]), ttype)

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
    return ClusterConfig(role=role, index=index, servers=jobs.get("ps", ()), workers=workers,
                         has_chief_job=has_chief, evaluators=jobs.get("evaluator", ()),
                         source="TF_CONFIG", collective=collective)


def from_env(env: Optional[Mapping[str, str]] = None, role: Optional[str] = None,
             rank: Optional[int] = None, server_endpoints: Any = None,
             worker_endpoints: Any = None, collective: bool = False) -> ClusterConfig:
    """A config from TFPSX_* variables; the arguments override single variables."""
    env = os.environ if env is None else env

    def get(name, override):
        if override is not None:
            return override, f"argument for {name}"
        return settings.raw(name, env), name

    role_value, role_src = get(ENV_ROLE, role)
    sched_value, sched_src = get(ENV_SCHED_ADDR, None)
    servers_value, servers_src = get(ENV_SERVER_ENDPOINTS, server_endpoints)
    workers_value, workers_src = get(ENV_WORKER_ENDPOINTS, worker_endpoints)
    rank_value, rank_src = get(ENV_RANK, rank)
    if role_value is None:
        raise ValueError(f"{ENV_ROLE} is not set; expected one of {', '.join(ROLES)} "
                         "(set it, or TF_CONFIG, or pass a role maker to tfpsx.init())")
    role_value = _check_role(role_value, role_src, ROLES + (EVALUATOR,))
    if role_value == EVALUATOR:
        # Outside the training cluster (as TF defines it): it reads the chief's
        # checkpoints and joins nothing, so it needs no endpoints and no scheduler.
        index = 0 if rank_value is None else parse_int(rank_value, rank_src)
        servers = (() if servers_value is None
                   else parse_endpoint_list(servers_value, servers_src))
        workers = (() if workers_value is None
                   else parse_endpoint_list(workers_value, workers_src))
        return ClusterConfig(role=EVALUATOR, index=index, servers=servers, workers=workers,
                             source="env", collective=collective)

    if sched_value is not None:
        given = [n for n, v in ((ENV_SERVER_ENDPOINTS, servers_value),
                                (ENV_WORKER_ENDPOINTS, workers_value)) if v is not None]
        if given:
            raise ValueError(f"conflicting cluster sources: {ENV_SCHED_ADDR}={sched_value!r} asks a "
                             f"scheduler to assign endpoints, but {', '.join(given)} also set; "
                             "use one or the other")
        address = parse_endpoint(sched_value, sched_src)
        num_s = settings.raw(ENV_SERVER_NUM, env)
        num_w = settings.raw(ENV_WORKER_NUM, env)
        if num_s is None or num_w is None:
            missing = [n for n, v in ((ENV_SERVER_NUM, num_s), (ENV_WORKER_NUM, num_w)) if v is None]
            raise ValueError(f"{ENV_SCHED_ADDR} is set but {', '.join(missing)} is not; expected "
                             "the number of servers and workers the scheduler waits for")
        # The scheduler serves collective jobs (no servers) as any other.
        server_num = parse_int(num_s, ENV_SERVER_NUM,
                               minimum=0 if collective or role_value == SCHEDULER else 1)
        if role_value != SCHEDULER:
            _check_servers(server_num, collective, ENV_SERVER_NUM)
        info = SchedulerInfo(address=address,
                             server_num=server_num,
                             worker_num=parse_int(num_w, ENV_WORKER_NUM, minimum=1),
                             token=settings.raw(ENV_TOKEN, env))
        index = None
        if rank_value is not None:
            # A worker may join the running job up to the scheduler's maximum.
            most = settings.raw("TFPSX_MAX_WORKER_NUM", env)
            count = (info.server_num if role_value == SERVER else
                     info.worker_num if most is None else
                     max(info.worker_num, parse_int(most, "TFPSX_MAX_WORKER_NUM", minimum=1)))
            index = (None if role_value == SCHEDULER
                     else _check_index(rank_value, rank_src, count, role_value))
        return ClusterConfig(role=role_value, index=index, scheduler=info, source="env",
                             collective=collective)

    if role_value == SCHEDULER:
        raise ValueError(f"{ENV_ROLE}=scheduler needs {ENV_SCHED_ADDR} (host:port to serve on), "
                         f"{ENV_SERVER_NUM} and {ENV_WORKER_NUM}")
    if servers_value is None and not collective:
        raise ValueError(f"{ENV_SERVER_ENDPOINTS} is not set; expected comma-separated host:port "
                         f"of every server (or {ENV_SCHED_ADDR} to use a scheduler)")
    if workers_value is None:
        raise ValueError(f"{ENV_WORKER_ENDPOINTS} is not set; expected comma-separated host:port "
                         f"of every worker (or {ENV_SCHED_ADDR} to use a scheduler)")
    servers = (() if servers_value is None else
               parse_endpoint_list(servers_value, servers_src, allow_empty=collective))
    _check_servers(len(servers), collective, servers_src, servers)
    workers = parse_endpoint_list(workers_value, workers_src)
    reject_duplicates([(servers_src, e) for e in servers] + [(workers_src, e) for e in workers])
    if rank_value is None:
        raise ValueError(f"{ENV_RANK} is not set; expected this {role_value}'s index")
    count = len(servers) if role_value == SERVER else len(workers)
    index = _check_index(rank_value, rank_src, count, role_value)
    for name, expected in ((ENV_SERVER_NUM, len(servers)), (ENV_WORKER_NUM, len(workers))):
        if settings.raw(name, env) is not None:
            declared = parse_int(env[name], name, minimum=0 if collective else 1)
            if declared != expected:
                raise ValueError(f"{name}={declared} disagrees with the {expected} endpoint(s) "
                                 "listed; fix one of them")
    return ClusterConfig(role=role_value, index=index, servers=servers, workers=workers,
                         source="env", collective=collective)


def from_flags(argv: Sequence[str], collective: bool = False) -> ClusterConfig:
    """A config from TF's classic between-graph flags.

    ``--ps_hosts h:p,... --worker_hosts h:p,... --job_name ps|worker --task_index N``;
    other arguments are left alone.
    """
    parser = argparse.ArgumentParser(add_help=False)
    for flag in ("--ps_hosts", "--worker_hosts", "--job_name", "--task_index"):
        parser.add_argument(flag, default=None)
    known, _ = parser.parse_known_args(list(argv))
    if collective and known.ps_hosts is None:
        known.ps_hosts = ""
    missing = [f"--{k}" for k, v in vars(known).items() if v is None]
    if missing:
        raise ValueError(f"classic flags: missing {', '.join(missing)}; expected --ps_hosts, "
                         "--worker_hosts, --job_name (ps|worker) and --task_index")
    if known.job_name not in ("ps", "worker"):
        raise ValueError(f"--job_name: unknown job {known.job_name!r}; expected 'ps' or 'worker'")
    return from_user(SERVER if known.job_name == "ps" else WORKER, known.task_index,
                     known.ps_hosts, known.worker_hosts, source="flags", collective=collective)


def resolve(env: Optional[Mapping[str, str]] = None, collective: bool = False) -> ClusterConfig:
    """Resolves the cluster from the environment: TF_CONFIG, else TFPSX_* variables.

    Raises:
      ValueError: nothing describes a cluster, both sources do, or a value is malformed.
    """
    env = os.environ if env is None else env
    tf_config = env.get("TF_CONFIG", "")
    tfpsx_vars = [n for n in CLUSTER_ENV_VARS if settings.raw(n, env) is not None]
    if tf_config.strip():
        if tfpsx_vars:
            raise ValueError(f"conflicting cluster sources: TF_CONFIG is set and so are "
                             f"{', '.join(tfpsx_vars)}; set only one of them")
        return from_tf_config(tf_config, collective=collective)
    if tfpsx_vars:
        return from_env(env, collective=collective)
    raise ValueError("no cluster configured: set TF_CONFIG, or TFPSX_ROLE with "
                     "TFPSX_SERVER_ENDPOINTS/TFPSX_WORKER_ENDPOINTS/TFPSX_RANK (or TFPSX_SCHED_ADDR), "
                     "or pass a role maker to tfpsx.init(); tfpsx-run sets these for you")

"""What a resolved cluster is: :class:`ClusterConfig`, its roles, and endpoint parsing.

Every source (:mod:`tfpsx.cluster.sources`) becomes one validated ``ClusterConfig``.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from typing import Any, Dict, Optional, Sequence, Tuple

SERVER = "server"
WORKER = "worker"
SCHEDULER = "scheduler"
EVALUATOR = "evaluator"
CHIEF = "chief"  # a launcher task and a TF_CONFIG job; in tfpsx it is worker rank 0
ROLES = (SERVER, WORKER, SCHEDULER)
# TF's tf.data service in a local job (tfpsx-run --data_workers; tfpsx.data.service).
DISPATCHER = "dispatcher"
DATA_WORKER = "data_worker"

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
ENV_DATA_SERVICE = "TFPSX_DATA_SERVICE"  # the job's tf.data dispatcher, grpc://host:port
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
      initial_worker_num: the workers the job started with, when a scheduler says so
        (workers beyond it joined the running job).
      collective: a collective job (``tfpsx.init(is_collective=True)``): workers only,
        no parameter servers.
    """
    role: str
    index: Optional[int]
    servers: Tuple[str, ...] = ()
    workers: Tuple[str, ...] = ()
    has_chief_job: bool = False
    evaluators: Tuple[str, ...] = ()
    scheduler: Optional[SchedulerInfo] = None
    source: str = "user"
    initial_worker_num: Optional[int] = None
    collective: bool = False

    @property
    def server_num(self) -> int:
        return self.scheduler.server_num if self.scheduler and not self.servers else len(self.servers)

    @property
    def worker_num(self) -> int:
        return self.scheduler.worker_num if self.scheduler and not self.workers else len(self.workers)

    @property
    def needs_scheduler(self) -> bool:
        """True while ranks and endpoints are still to come from the scheduler."""
        return self.scheduler is not None and (self.index is None or not self.workers)

    @property
    def joined(self) -> bool:
        """This worker joined a running job (a rank beyond the ones it started with)."""
        return (self.role == WORKER and self.initial_worker_num is not None
                and self.index is not None and self.index >= self.initial_worker_num)

    @property
    def is_chief(self) -> bool:
        return self.role == WORKER and self.index == 0

    def dial(self, address: str) -> str:
        """How this process dials ``address``: as listed, or, when it is its own listed
        address and it listens elsewhere (TFPSX_LISTEN_PORT: behind a NAT the listed
        address may not route back to its own host), at ``localhost:<listen port>``."""
        from tfpsx import settings  # a bottom layer: no cycle

        port = settings.get("TFPSX_LISTEN_PORT")
        return f"localhost:{port}" if port and address == self.task_address() else address

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
        spec = {"ps": list(self.servers)} if self.servers else {}
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


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 with or without brackets) is this
    machine's loopback: only processes on this machine reach what listens there."""
    host = host.strip().strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
    reject_duplicates([(what, ep) for ep in endpoints])
    return endpoints


def reject_duplicates(named: Sequence[Tuple[str, str]]) -> None:
    seen: Dict[str, str] = {}
    for what, ep in named:
        if ep in seen:
            where = (f"twice in {what}" if seen[ep] == what else f"in {seen[ep]} and in {what}")
            raise ValueError(f"duplicate endpoint {ep!r}: listed {where}; every task needs its "
                             "own host:port")
        seen[ep] = what


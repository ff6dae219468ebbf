"""The scheduler: assigns ranks to the servers and workers of a bare cluster.

Servers and workers register with their role and the address they will serve TF on; the
scheduler gives ranks in a stable order (servers 0..S-1, workers 0..W-1; a node that asks
for a rank with TFPSX_RANK gets it, the others get the lowest free one; a retry with the
same node id gets the same rank), answers every node with the full cluster once all have
registered, runs barriers, watches heartbeats, and ends the job when every worker has
finished (or died).

It is not where the model lives: servers and workers talk TF to each other directly. With
``TFPSX_SCHED_STATE`` (``tfpsx-run`` sets it) it journals who is who
(:mod:`tfpsx.control.journal`), and a scheduler restarted with that file takes the job
back; meanwhile servers keep serving and workers keep training (their heartbeats fail,
logged, and are retried; see :mod:`tfpsx.control.sched_client`).

Run it as ``tfpsx-scheduler`` (or ``python -m tfpsx.control.scheduler``) with ``TFPSX_ROLE=scheduler
TFPSX_SCHED_ADDR=host:port TFPSX_SERVER_NUM=S TFPSX_WORKER_NUM=W`` [``TFPSX_TOKEN``], or
from a script with ``tfpsx.init(); tfpsx.run_scheduler()``.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import sys
import threading
import time
from concurrent import futures
from typing import Dict, List, Optional

import grpc
import portpicker

from tfpsx import cluster as _cluster
from tfpsx import errors, settings
from tfpsx.control.journal import Journal
from tfpsx.control.ports import listening, port_taken
from tfpsx.control.proto import scheduler_pb2 as pb
from tfpsx.control.proto import scheduler_pb2_grpc as pb_grpc
from tfpsx.control.tls import TlsConfig

logger = logging.getLogger("tfpsx")

REGISTERED, FINISHED, DEAD = "registered", "finished", "dead"
_MAX_LONG_POLL = 10.0  # seconds one long-poll call may be held


@dataclasses.dataclass
class _Node:
    role: str
    rank: int
    address: str
    node_id: str
    state: str = REGISTERED
    last_seen: float = 0.0

    def proto(self) -> pb.Node:
        return pb.Node(role=self.role, rank=self.rank, address=self.address,
                       node_id=self.node_id, state=self.state)

    def name(self) -> str:
        return f"{self.role} rank {self.rank} ({self.address})"


class SchedulerService(pb_grpc.SchedulerServicer):
    """The scheduler's state and RPCs. Thread-safe; one condition guards everything."""

    def __init__(self, server_num: int, worker_num: int, token: Optional[str] = None,
                 heartbeat_timeout: float = 60.0, journal: Optional[Journal] = None,
                 restart_wait: float = 0.0, max_worker_num: Optional[int] = None):
        # nums: the nodes the job starts with; limits: how many it admits (workers beyond
        # worker_num join the running job: elastic async and GEO).
        self.nums = {_cluster.SERVER: server_num, _cluster.WORKER: worker_num}
        self.limits = dict(self.nums)
        if max_worker_num is not None:
            if max_worker_num < worker_num:
                raise ValueError(f"TFPSX_MAX_WORKER_NUM={max_worker_num} is below "
                                 f"TFPSX_WORKER_NUM={worker_num}; expected at least that")
            self.limits[_cluster.WORKER] = max_worker_num
        self.token = token
        self.heartbeat_timeout = heartbeat_timeout
        # When every worker died and none finished (a lost server takes them all), the
        # job is kept this long for them to be started again (see job_over).
        self.restart_wait = restart_wait
        self._all_died_at: Optional[float] = None
        self._cv = threading.Condition()
        self.nodes: Dict[str, _Node] = {}
        self._ranks: Dict[str, Dict[int, str]] = {_cluster.SERVER: {}, _cluster.WORKER: {}}
        self._barriers: Dict[int, set] = {}
        self.started = time.monotonic()
        self.first_registration: Optional[float] = None
        self.ready_at: Optional[float] = None
        self.failure: Optional[str] = None
        self.journal = journal
        if journal is not None:
            self._resume(journal.load())

    # ------------------------------------------------------------------ journal
    def _resume(self, nodes) -> None:
        """Takes back the job a previous scheduler journaled (its nodes keep their ranks;
        the living ones get a fresh heartbeat window)."""
        if not nodes:
            return
        now = time.monotonic()
        for n in nodes:
            node = _Node(role=n["role"], rank=int(n["rank"]), address=n["address"],
                         node_id=n["node_id"], state=n["state"], last_seen=now)
            self.nodes[node.node_id] = node
            self._ranks[node.role][node.rank] = node.node_id
        self.first_registration = now
        if self.ready():
            self.ready_at = now
        logger.info("took back the job journaled in %s: %s", self.journal.path,
                    ", ".join(f"{n.name()} {n.state}" for n in self.nodes.values()))

    def _save(self) -> None:
        """Journals the nodes (called with the condition held, after every change)."""
        if self.journal is not None:
            self.journal.save([dataclasses.asdict(n) for n in self.nodes.values()])

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _refuse(context, code, message: str):
        """Logs a refused call here too (the node that made it may log nowhere we see),
        then fails it with ``code``."""
        logger.error("refused a call from %s: %s: %s", context.peer(), code.name, message)
        context.abort(code, message)

    def _check(self, context, token: str, node_id: Optional[str] = None) -> Optional[_Node]:
        if self.token is not None and not hmac.compare_digest(token.encode(), self.token.encode()):
            self._refuse(context, grpc.StatusCode.UNAUTHENTICATED,
                          "wrong or missing token: this scheduler requires the TFPSX_TOKEN it "
                          "was started with")
        if node_id is None:
            return None
        node = self.nodes.get(node_id)
        if node is None:
            self._refuse(context, grpc.StatusCode.NOT_FOUND,
                          f"node id {node_id!r} never registered with this scheduler")
        return node

    def ready(self) -> bool:
        """Every rank the job starts with is registered (joiners come on top)."""
        return all(set(range(n)) <= set(self._ranks[r]) for r, n in self.nums.items())

    def missing(self) -> str:
        parts = []
        for role, num in self.nums.items():
            free = [r for r in range(num) if r not in self._ranks[role]]
            if free:
                parts.append(f"{role} rank{'s' if len(free) > 1 else ''} "
                             f"{', '.join(map(str, free))} ({num - len(free)} of {num} {role}s "
                             "registered)")
        return "; ".join(parts)

    def _by_role(self, role: str) -> List[_Node]:
        return [self.nodes[self._ranks[role][r]] for r in sorted(self._ranks[role])]

    def _dead(self) -> List[pb.Node]:
        return [n.proto() for n in self.nodes.values() if n.state == DEAD]

    def job_over(self) -> bool:
        """Every worker finished or died (the condition held). A job whose workers all
        died, none finished, is not over for ``restart_wait`` seconds: an orchestrator
        may be starting them (and the lost server) again; a server that registers again
        meanwhile waits with them instead of ending."""
        workers = self._by_role(_cluster.WORKER)
        over = self.ready_at is not None and all(n.state in (FINISHED, DEAD) for n in workers)
        all_died = over and all(n.state == DEAD for n in workers)
        if not all_died or self.restart_wait <= 0:
            if self._all_died_at is not None and not over:
                logger.info("a worker is back after %.1f s: the job goes on",
                            time.monotonic() - self._all_died_at)
            self._all_died_at = None
            return over
        now = time.monotonic()
        if self._all_died_at is None:
            self._all_died_at = now
            logger.warning("every worker died and none finished; keeping the job %g s "
                           "(TFPSX_RESTART_WAIT) for them to be started again",
                           self.restart_wait)
        return now - self._all_died_at >= self.restart_wait

    def _wait(self, predicate, seconds: float) -> bool:
        """Waits on the condition (held) until predicate() or ``seconds`` pass."""
        deadline = time.monotonic() + max(0.0, min(seconds, _MAX_LONG_POLL))
        while not predicate():
            left = deadline - time.monotonic()
            if left <= 0 or self.failure:
                return predicate()
            self._cv.wait(left)
        return True

    # ------------------------------------------------------------------ RPCs
    def Register(self, request, context):
        self._check(context, request.token)
        role, node_id = request.role, request.node_id
        if role not in self.nums:
            self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT,
                          f"role {role!r} cannot register; expected 'server' or 'worker'")
        if not node_id:
            self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "node_id is empty")
        try:
            address = _cluster.parse_endpoint(request.address, "address")
        except ValueError as e:
            if not request.address.endswith(":0"):
                self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            address = f"{request.address[:-2]}:{portpicker.pick_unused_port()}"
        with self._cv:
            now = time.monotonic()
            node = self.nodes.get(node_id)
            if node is not None:
                if node.role != role:
                    self._refuse(context, grpc.StatusCode.FAILED_PRECONDITION,
                                  f"node id {node_id!r} registered as {node.role} rank "
                                  f"{node.rank}; it cannot re-register as a {role}")
                node.last_seen = now
                if node.state == DEAD:  # restarted (a worker by hand, a node after a blip)
                    node.state = REGISTERED
                    logger.warning("%s (node %s), reported dead, registered again: alive, "
                                   "same rank", node.name(), node_id)
                    self._save()
                    self._cv.notify_all()
                else:
                    logger.info("re-registration of %s (node %s): same rank", node.name(),
                                node_id)
                return pb.RegisterReply(rank=node.rank, address=node.address)
            taken = self._ranks[role]
            num = self.limits[role]
            limit_name = f"{role}_num" if num == self.nums[role] else "TFPSX_MAX_WORKER_NUM"
            if len(taken) >= num:
                holders = ", ".join(self.nodes[taken[r]].address for r in sorted(taken))
                message = (f"too many {role}s: {limit_name} is {num} and ranks 0..{num - 1} are "
                           f"taken ({holders}); refused {address} (node {node_id})")
                self._refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, message)
            for other in self.nodes.values():
                if other.address == address:
                    self._refuse(context, grpc.StatusCode.ALREADY_EXISTS,
                                  f"address {address} is already {other.name()}; each node "
                                  "needs its own host:port")
            rank = request.requested_rank
            if rank >= 0:
                if rank >= num:
                    self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT,
                                  f"requested {role} rank {rank} is out of range for "
                                  f"{limit_name} {num}; expected 0..{num - 1}")
                if rank in taken:
                    self._refuse(context, grpc.StatusCode.ALREADY_EXISTS,
                                  f"{role} rank {rank} is already taken by "
                                  f"{self.nodes[taken[rank]].address}")
                first_free = min(set(range(num)) - set(taken))
                if rank >= self.nums[role] and rank != first_free:
                    # Joiners' ranks follow one another: every rank below one is a worker.
                    self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT,
                                  f"requested {role} rank {rank} joins the job but rank "
                                  f"{first_free} is free; a joining {role} takes the next "
                                  "rank (leave the rank unset)")
            else:
                rank = min(set(range(num)) - set(taken))
            node = _Node(role=role, rank=rank, address=address, node_id=node_id, last_seen=now)
            self.nodes[node_id] = node
            taken[rank] = node_id
            self.first_registration = self.first_registration or now
            if rank >= self.nums[role]:
                logger.info("%s %s joins the running job as rank %d (%d of at most %d "
                            "%ss)", role, address, rank, len(taken), num, role)
            else:
                logger.info("assigned %s rank %d to %s", role, rank, address)
            self._save()
            if self.ready():
                self.ready_at = now
                logger.info("cluster ready: %d servers, %d workers in %.2f s",
                            self.nums[_cluster.SERVER], self.nums[_cluster.WORKER],
                            now - self.first_registration)
            self._cv.notify_all()
            return pb.RegisterReply(rank=rank, address=address)

    def GetCluster(self, request, context):
        self._check(context, request.token, request.node_id)
        with self._cv:
            ready = self._wait(self.ready, request.wait_seconds)
            if self.failure:
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, self.failure)
            reply = pb.ClusterReply(ready=ready, server_num=self.nums[_cluster.SERVER],
                                    worker_num=self.nums[_cluster.WORKER],
                                    registered=[n.proto() for n in self.nodes.values()],
                                    waited_seconds=time.monotonic() - self.started)
            if ready:
                reply.servers.extend(n.address for n in self._by_role(_cluster.SERVER))
                reply.workers.extend(n.address for n in self._by_role(_cluster.WORKER))
            return reply

    def Heartbeat(self, request, context):
        node = self._check(context, request.token, request.node_id)
        with self._cv:
            if node.state == DEAD:
                logger.warning("heartbeat from %s, which was already reported dead", node.name())
            node.last_seen = time.monotonic()
            return pb.HeartbeatReply(dead=self._dead())

    def Barrier(self, request, context):
        node = self._check(context, request.token, request.node_id)
        if node.role != _cluster.WORKER:
            self._refuse(context, grpc.StatusCode.FAILED_PRECONDITION,
                          f"barriers are for workers; {node.name()} is not one")
        with self._cv:
            arrived = self._barriers.setdefault(request.generation, set())
            if node.node_id not in arrived:
                arrived.add(node.node_id)
                self._cv.notify_all()

            def alive_arrived():
                alive = {n.node_id for n in self._by_role(_cluster.WORKER) if n.state != DEAD}
                return alive <= arrived

            passed = self.ready_at is not None and self._wait(alive_arrived, request.wait_seconds)
            return pb.BarrierReply(passed=passed, arrived=len(arrived),
                                   expected=len(self._ranks[_cluster.WORKER]),
                                   dead=self._dead())

    def Finish(self, request, context):
        node = self._check(context, request.token, request.node_id)
        with self._cv:
            if node.state != FINISHED:
                node.state = FINISHED
                logger.info("%s finished", node.name())
                self._save()
                self._cv.notify_all()
            return self._job_reply()

    def WaitJobEnd(self, request, context):
        self._check(context, request.token, request.node_id)
        with self._cv:
            self._wait(self.job_over, request.wait_seconds)
            return self._job_reply()

    def Status(self, request, context):
        self._check(context, request.token)
        with self._cv:
            return self._job_reply()

    def _job_reply(self) -> pb.JobReply:
        return pb.JobReply(
            over=self.job_over(),
            finished=[n.proto() for n in self.nodes.values()
                      if n.state == FINISHED and n.role == _cluster.WORKER],
            dead=self._dead(), nodes=[n.proto() for n in self.nodes.values()])

    # ------------------------------------------------------------------ monitoring
    def check_heartbeats(self) -> None:
        """Marks nodes silent past the heartbeat timeout dead (call periodically)."""
        with self._cv:
            now = time.monotonic()
            for node in self.nodes.values():
                if node.state == REGISTERED and now - node.last_seen > self.heartbeat_timeout:
                    node.state = DEAD
                    logger.warning("%s is dead: no heartbeat for %.1f s "
                                   "(TFPSX_HEARTBEAT_TIMEOUT=%g)", node.name(),
                                   now - node.last_seen, self.heartbeat_timeout)
                    self._save()
                    self._cv.notify_all()

    def fail(self, message: str) -> None:
        with self._cv:
            self.failure = message
            self._cv.notify_all()


def check_listen_address(address: str, token: Optional[str]) -> None:
    """Refuses to serve beyond this machine without a token.

    On any address but loopback, whoever reaches the scheduler could register as a node,
    take a rank and end the job; TFPSX_TOKEN (the same on every node) makes it refuse
    them. TLS (TFPSX_TLS_*) encrypts the channel but does not ask clients for
    certificates, so it is no substitute.

    Raises:
      ValueError: a non-loopback ``address`` and no token; nothing was started.
    """
    host = address.strip().rsplit(":", 1)[0]
    if not token and not _cluster.is_loopback(host):
        raise ValueError(
            f"scheduler: listen address {address!r} ({_cluster.ENV_SCHED_ADDR}) is reachable "
            f"from other machines and no {_cluster.ENV_TOKEN} is set: anyone who reaches it "
            f"could register as a node or end the job. Set {_cluster.ENV_TOKEN} to a secret "
            "shared by every node of the job (docs/security.md), or listen on 127.0.0.1 for "
            "a job on one machine")


def serve(address: str, server_num: int, worker_num: int, token: Optional[str] = None,
          register_timeout: float = 600.0, heartbeat_timeout: float = 60.0,
          tls: Optional[TlsConfig] = None, server_grace: Optional[float] = None,
          state_file: Optional[str] = None, restart_wait: float = 0.0,
          max_worker_num: Optional[int] = None) -> int:
    """Runs the scheduler until the job ends; returns a process exit code.

    With ``max_worker_num`` above ``worker_num``, workers that register once the job
    runs join it with the next ranks (elastic async and GEO; the job then ends when every
    worker, joiners included, finished or died).

    Returns 0 when every worker finished or died and the servers confirmed the end (or the
    grace ran out); raises ClusterTimeoutError when the cluster was not complete within
    ``register_timeout`` (after telling every waiting node). With ``state_file`` the job
    state is journaled there (and taken back from it when it exists); removed when the
    job ends. When every worker died and none finished (a lost server takes them all),
    the job is kept ``restart_wait`` seconds more for them to be started again (they
    register again and are alive: the job goes on).
    """
    check_listen_address(address, token)
    journal = (Journal(state_file, server_num, worker_num, token) if state_file else None)
    service = SchedulerService(server_num, worker_num, token, heartbeat_timeout, journal,
                               restart_wait=restart_wait, max_worker_num=max_worker_num)
    server = grpc.server(futures.ThreadPoolExecutor(
        max_workers=2 * (server_num + service.limits[_cluster.WORKER]) + 8, thread_name_prefix="tfpsx-sched"))
    pb_grpc.add_SchedulerServicer_to_server(service, server)
    with listening("the scheduler", address):
        bound = (server.add_secure_port(address, tls.server_credentials()) if tls
                 else server.add_insecure_port(address))
    if not bound:  # (grpcio before 1.49 returned 0 instead of raising)
        raise port_taken("the scheduler", address, "gRPC bound no port")
    server.start()
    logger.info("scheduler serving at %s%s for %d servers and %d workers", address,
                " (TLS)" if tls else "", server_num, worker_num)
    grace = heartbeat_timeout if server_grace is None else server_grace
    try:
        while True:
            time.sleep(0.1)
            service.check_heartbeats()
            with service._cv:
                ready, over = service.ready_at is not None, service.job_over()
                missing = service.missing()
                if over:
                    service._cv.notify_all()  # RPCs long-polling for the end (a wait ran out)
            if not ready and time.monotonic() - service.started > register_timeout:
                message = (f"cluster not complete after {register_timeout:g} s "
                           f"(TFPSX_REGISTER_TIMEOUT); missing: {missing}")
                logger.error("scheduler: %s", message)
                service.fail(message)
                time.sleep(1.0)  # lets waiting nodes read the failure
                raise errors.ClusterTimeoutError(message)
            if over:
                break
        with service._cv:
            dead = [n.name() for n in service.nodes.values() if n.state == DEAD]
        logger.info("job over: every worker finished%s; waiting for servers to confirm",
                    f" or died ({', '.join(dead)})" if dead else "")
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            service.check_heartbeats()
            with service._cv:
                if all(n.state in (FINISHED, DEAD) for n in service._by_role(_cluster.SERVER)):
                    break
            time.sleep(0.1)
        if journal is not None:
            journal.remove()
        logger.info("scheduler exiting")
        return 0
    finally:
        server.stop(grace=1.0)


def run_scheduler(config: _cluster.ClusterConfig) -> int:
    """Serves as the scheduler of ``config`` (a resolved ``TFPSX_ROLE=scheduler`` config)
    until the job ends; returns the exit code."""
    if config.role != _cluster.SCHEDULER or config.scheduler is None:
        raise ValueError(f"run_scheduler needs a scheduler config (TFPSX_ROLE=scheduler with "
                         f"TFPSX_SCHED_ADDR), got role {config.role!r} from {config.source}")
    info = config.scheduler
    return serve(info.address, info.server_num, info.worker_num, token=info.token,
                 register_timeout=settings.get("TFPSX_REGISTER_TIMEOUT"),
                 heartbeat_timeout=settings.get("TFPSX_HEARTBEAT_TIMEOUT"),
                 tls=TlsConfig.from_env(), state_file=settings.get("TFPSX_SCHED_STATE"),
                 restart_wait=settings.get("TFPSX_RESTART_WAIT"),
                 max_worker_num=settings.get("TFPSX_MAX_WORKER_NUM"))


def main() -> int:
    """``tfpsx-scheduler``: the scheduler of the cluster the environment describes."""
    logging.basicConfig(format="%(asctime)s tfpsx %(levelname)s: %(message)s",
                        level=logging.INFO)
    config = _cluster.resolve()
    if config.role != _cluster.SCHEDULER:
        print(f"tfpsx-scheduler: TFPSX_ROLE is {config.role!r}; expected 'scheduler'",
              file=sys.stderr)
        return 2
    try:
        check_listen_address(config.scheduler.address, config.scheduler.token)
    except ValueError as e:
        print(f"tfpsx-scheduler: {e}", file=sys.stderr)
        return 2
    return run_scheduler(config)


if __name__ == "__main__":
    sys.exit(main())

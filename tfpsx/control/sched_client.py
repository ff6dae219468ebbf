"""A server's or worker's side of the scheduler protocol (the scheduler itself:
:mod:`tfpsx.control.scheduler`).

The scheduler is not where the model lives, so losing it does not end the job: a failed
heartbeat is logged and retried; a server keeps serving while it waits for a restarted
scheduler (bounded by TFPSX_SCHED_LOSS_TIMEOUT); barriers retry until their own timeout;
a worker's last "finished" is retried for TFPSX_RPC_TIMEOUT, then logged and skipped. A
restarted scheduler that does not know a node (no journal) gets it registered again
with its rank, address and node id.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import List, Optional, Tuple

import grpc
import portpicker

from tfpsx import cluster as _cluster
from tfpsx import errors, settings
from tfpsx.background import BackgroundLoop
from tfpsx.control.channels import FAST_RECONNECT
from tfpsx.control.proto import scheduler_pb2 as pb
from tfpsx.control.proto import scheduler_pb2_grpc as pb_grpc
from tfpsx.control.protocol import Coordinator
from tfpsx.control.tls import TlsConfig
from tfpsx.waits import wait_for

logger = logging.getLogger("tfpsx")
_LONG_POLL = 5.0


def local_address_towards(target: str) -> str:
    """The IP this host uses to reach ``target`` (host:port); no packet is sent."""
    host = target.rsplit(":", 1)[0].strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
            ip = s.getsockname()[0]
        except OSError:
            return socket.gethostname()
    return f"[{ip}]" if family == socket.AF_INET6 else ip


def describe(nodes) -> str:
    return ", ".join(f"{n.role} rank {n.rank} ({n.address})" for n in nodes)


class SchedulerClient:
    """Registers this node, fetches the cluster, heartbeats, barriers, and job end.

    Args:
      info: where the scheduler is and the counts it expects.
      role: "server" or "worker".
      rpc_timeout: seconds a plain call may take.
      tls: TLS files, or None for a plaintext channel.
      node_id: stable id of this process (TFPSX_NODE_ID, else host:pid).
    """

    def __init__(self, info: _cluster.SchedulerInfo, role: str, rpc_timeout: float = 30.0,
                 tls: Optional[TlsConfig] = None, node_id: Optional[str] = None):
        self.info, self.role, self.rpc_timeout = info, role, rpc_timeout
        self.node_id = node_id or settings.raw("TFPSX_NODE_ID") or \
            f"{socket.gethostname()}:{os.getpid()}"
        self.token = info.token or ""
        options = FAST_RECONNECT
        self._channel = (grpc.secure_channel(info.address, tls.channel_credentials(), options)
                         if tls else grpc.insecure_channel(info.address, options))
        self._stub = pb_grpc.SchedulerStub(self._channel)
        self._heartbeat: Optional[BackgroundLoop] = None
        self._heartbeat_failures = 0
        self.dead: List[pb.Node] = []
        self.rank: Optional[int] = None
        self.address: Optional[str] = None

    def _call(self, method: str, request, timeout: Optional[float] = None):
        try:
            return getattr(self._stub, method)(request, timeout=timeout or self.rpc_timeout)
        except grpc.RpcError as e:
            code = e.code()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and \
                    "cluster not complete" not in (e.details() or ""):
                raise errors.ServerUnavailableError(
                    f"scheduler at {self.info.address} did not answer {method} within "
                    f"{timeout or self.rpc_timeout:g} s: {e.details()}") from e
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise errors.ClusterTimeoutError(
                    f"scheduler at {self.info.address}: {e.details()}") from e
            rejected = errors.SchedulerRejectedError(
                f"scheduler at {self.info.address} refused {method} from {self.role} "
                f"(node {self.node_id}): {code.name}: {e.details()}")
            rejected.code = code
            raise rejected from e

    def _call_known(self, method: str, request, timeout: Optional[float] = None):
        """``_call``; a scheduler that does not know this node (restarted without its
        journal) gets it registered again with its rank and address, then the call."""
        try:
            return self._call(method, request, timeout)
        except errors.SchedulerRejectedError as e:
            if getattr(e, "code", None) != grpc.StatusCode.NOT_FOUND or self.rank is None:
                raise
        logger.warning("the scheduler at %s does not know this %s (restarted without its "
                       "journal?): registering again as rank %d at %s", self.info.address,
                       self.role, self.rank, self.address)
        self._call("Register", pb.RegisterRequest(
            role=self.role, node_id=self.node_id, address=self.address, token=self.token,
            requested_rank=self.rank))
        return self._call(method, request, timeout)

    # ------------------------------------------------------------------ registration
    def register(self, address: str, requested_rank: Optional[int],
                 connect_timeout: float) -> Tuple[int, str]:
        """Registers (retrying while the scheduler is not up yet); returns (rank, address)."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=connect_timeout)
        except grpc.FutureTimeoutError:
            raise errors.ClusterTimeoutError(
                f"{self.role} waited {connect_timeout:g} s for the scheduler at "
                f"{self.info.address} (TFPSX_SCHED_ADDR); it is not reachable. Raise the limit "
                "with TFPSX_CONNECT_TIMEOUT.") from None
        reply = self._call("Register", pb.RegisterRequest(
            role=self.role, node_id=self.node_id, address=address, token=self.token,
            requested_rank=-1 if requested_rank is None else requested_rank))
        self.rank, self.address = reply.rank, reply.address
        logger.info("%s registered with the scheduler at %s: rank %d, %s", self.role,
                    self.info.address, reply.rank, reply.address)
        return reply.rank, reply.address

    def wait_cluster(self, timeout: float) -> Tuple[Tuple[str, ...], Tuple[str, ...], int]:
        """Waits until every node registered; returns (servers, workers) in rank order
        (joiners included) and the worker count the job started with."""
        def ask(left: float):  # a long poll: the scheduler answers when ready, or in 5 s
            return self._call("GetCluster", pb.ClusterRequest(
                node_id=self.node_id, token=self.token, wait_seconds=min(_LONG_POLL, left)),
                timeout=self.rpc_timeout + _LONG_POLL)

        reply = wait_for(ask, lambda r: r.ready, timeout, lambda r, _waited: (
            errors.ClusterTimeoutError(
                f"{self.role} rank {self.rank} waited {timeout:g} s for the cluster to "
                f"complete (TFPSX_REGISTER_TIMEOUT); missing: {_missing(r)}; registered: "
                f"{describe(r.registered) or 'none'}")), poll=0)
        return tuple(reply.servers), tuple(reply.workers), reply.worker_num

    # ------------------------------------------------------------------ heartbeats
    def start_heartbeat(self, interval: float) -> None:
        self._heartbeat = BackgroundLoop("heartbeat to the scheduler", self._beat,
                                         interval=interval).start()

    def _beat(self) -> None:
        # A failed beat is logged and retried: the scheduler's timeout decides who is dead.
        try:
            reply = self._call_known("Heartbeat", pb.NodeRequest(node_id=self.node_id,
                                                                 token=self.token))
            if self._heartbeat_failures:
                logger.warning("the scheduler at %s answers again (after %d failed heartbeats)",
                               self.info.address, self._heartbeat_failures)
            self._heartbeat_failures = 0
        except (errors.ServerUnavailableError, errors.SchedulerRejectedError) as e:
            self._heartbeat_failures += 1
            logger.warning("heartbeat to the scheduler failed (%d in a row): %s",
                           self._heartbeat_failures, e)
            return
        # The scheduler's current list: a node started again (same rank) and registered
        # is alive again, and no longer dead here either.
        new = [n for n in reply.dead if n not in self.dead]
        back = [n for n in self.dead if n not in reply.dead]
        if new:
            logger.warning("scheduler reports dead: %s", describe(new))
        if back:
            logger.info("scheduler reports alive again: %s", describe(back))
        self.dead = list(reply.dead)

    def beat_now(self) -> None:
        """One heartbeat now (refreshing :attr:`dead`), besides the periodic ones."""
        self._beat()

    def stop_heartbeat(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop(timeout=5)

    # ------------------------------------------------------------------ job
    def barrier(self, generation: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                reply = self._call_known("Barrier", pb.NodeRequest(
                    node_id=self.node_id, token=self.token, generation=generation,
                    wait_seconds=max(0.0, min(_LONG_POLL, left))),
                    timeout=self.rpc_timeout + _LONG_POLL)
            except errors.ServerUnavailableError as e:
                # The scheduler is down (a restarted one takes the job back): wait for it
                # within the barrier's own bound.
                if time.monotonic() >= deadline:
                    raise errors.ClusterTimeoutError(
                        f"barrier_worker() #{generation} on worker {self.rank} waited "
                        f"{timeout:g} s; the scheduler did not answer: {e}") from e
                logger.warning("barrier %d: %s; retrying", generation, e)
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
                continue
            if reply.passed:
                if reply.dead:
                    logger.warning("barrier %d passed without dead workers: %s", generation,
                                   describe(reply.dead))
                return
            if time.monotonic() >= deadline:
                raise errors.ClusterTimeoutError(
                    f"barrier_worker() #{generation} on worker {self.rank} waited {timeout:g} s; "
                    f"{reply.arrived} of {reply.expected} workers arrived")

    def finish(self, patience: Optional[float] = None) -> Optional[pb.JobReply]:
        """Tells the scheduler this node is done; while it is unreachable, retries for
        ``patience`` seconds (default: the RPC timeout), then logs and returns None (a
        journaling scheduler counts the node dead after TFPSX_HEARTBEAT_TIMEOUT)."""
        deadline = time.monotonic() + (self.rpc_timeout if patience is None else patience)
        while True:
            try:
                return self._call_known("Finish", pb.NodeRequest(node_id=self.node_id,
                                                                 token=self.token))
            except errors.ServerUnavailableError as e:
                if time.monotonic() >= deadline:
                    logger.warning("%s rank %s could not tell the scheduler it finished: %s",
                                   self.role, self.rank, e)
                    return None
                time.sleep(0.5)

    def wait_job_end(self, loss_timeout: float = 600.0) -> pb.JobReply:
        """Blocks until every worker finished or died (heartbeats bound the wait). An
        unreachable scheduler is waited for (this server keeps serving: the model stays)
        up to ``loss_timeout`` seconds (TFPSX_SCHED_LOSS_TIMEOUT).

        Raises:
          ClusterTimeoutError: the scheduler was unreachable for ``loss_timeout`` s.
        """
        lost_since = None
        while True:
            try:
                reply = self._call_known("WaitJobEnd", pb.NodeRequest(
                    node_id=self.node_id, token=self.token, wait_seconds=_LONG_POLL),
                    timeout=self.rpc_timeout + _LONG_POLL)
            except errors.ServerUnavailableError as e:
                now = time.monotonic()
                if lost_since is None:
                    lost_since = now
                    logger.warning("%s rank %s lost the scheduler (%s); serving on (the model "
                                   "stays here) and waiting up to %g s "
                                   "(TFPSX_SCHED_LOSS_TIMEOUT) for a restarted one",
                                   self.role, self.rank, e, loss_timeout)
                if now - lost_since >= loss_timeout:
                    raise errors.ClusterTimeoutError(
                        f"{self.role} rank {self.rank}: the scheduler at {self.info.address} "
                        f"was unreachable for {now - lost_since:.0f} s "
                        f"(TFPSX_SCHED_LOSS_TIMEOUT={loss_timeout:g}); giving up the job") from e
                time.sleep(1.0)
                continue
            if lost_since is not None:
                logger.warning("%s rank %s: the scheduler at %s is back after %.1f s", self.role,
                               self.rank, self.info.address, time.monotonic() - lost_since)
                lost_since = None
            if reply.over:
                return reply

    def status(self) -> pb.JobReply:
        return self._call("Status", pb.NodeRequest(node_id=self.node_id, token=self.token))

    def close(self) -> None:
        self.stop_heartbeat()
        self._channel.close()


def _missing(reply: pb.ClusterReply) -> str:
    parts = []
    for role, num in (("server", reply.server_num), ("worker", reply.worker_num)):
        have = {n.rank for n in reply.registered if n.role == role}
        free = [r for r in range(num) if r not in have]
        if free:
            parts.append(f"{role} rank{'s' if len(free) > 1 else ''} {', '.join(map(str, free))} "
                         f"({len(have)} of {num} {role}s registered)")
    return "; ".join(parts) or "none"


def register_node(config: _cluster.ClusterConfig, connect_timeout: float,
                  register_timeout: float, rpc_timeout: float, heartbeat_interval: float
                  ) -> Tuple[_cluster.ClusterConfig, SchedulerClient]:
    """Registers a server or worker; returns its complete config and the live client."""
    if config.role not in (_cluster.SERVER, _cluster.WORKER):
        raise ValueError(f"TFPSX_ROLE={config.role!r} does not register with a scheduler; "
                         "expected 'server' or 'worker' (the scheduler runs run_scheduler())")
    host = settings.raw("TFPSX_HOST") or local_address_towards(config.scheduler.address)
    port = settings.get("TFPSX_PORT")
    if settings.get("TFPSX_LISTEN_PORT") is not None and not port:
        raise ValueError(
            f"TFPSX_LISTEN_PORT={settings.raw('TFPSX_LISTEN_PORT')} needs TFPSX_PORT (the "
            f"port the others dial, registered with the scheduler), got "
            f"{settings.raw('TFPSX_PORT')!r}; expected a port 1-65535")
    if port is None:
        port = portpicker.pick_unused_port()
    client = SchedulerClient(config.scheduler, config.role, rpc_timeout,
                             tls=TlsConfig.from_env())
    try:
        rank, address = client.register(f"{host}:{port}", config.index, connect_timeout)
        client.start_heartbeat(heartbeat_interval)
        servers, workers, started_with = client.wait_cluster(register_timeout)
    except BaseException:
        client.close()
        raise
    resolved = _cluster.ClusterConfig(role=config.role, index=rank, servers=servers,
                                      workers=workers, scheduler=config.scheduler,
                                      source="scheduler", initial_worker_num=started_with,
                                      collective=config.collective)
    return resolved, client


class SchedulerCoordinator(Coordinator):
    """The job's control plane through the scheduler (heartbeats run since registration)."""

    def __init__(self, config: _cluster.ClusterConfig, client: SchedulerClient):
        self.config, self.client = config, client

    def worker_start(self) -> None:
        # Registered and heartbeating since tfpsx.init(). The servers accept connections
        # now, so they are registered: a fresh beat drops any of them the scheduler had
        # declared dead before (restarted ones), before the server watch reads the list.
        self.client.beat_now()

    def worker_stop(self) -> None:
        self.client.stop_heartbeat()
        self.client.finish()
        self.client.close()

    def barrier(self, generation: int, timeout: float) -> None:
        self.client.barrier(generation, timeout)

    def serve(self, me: str, register_timeout: float, heartbeat_timeout: float,
              connect_timeout: float):
        try:
            reply = self.client.wait_job_end(settings.get("TFPSX_SCHED_LOSS_TIMEOUT"))
            self.client.stop_heartbeat()
            self.client.finish()
        finally:
            self.client.close()
        stopped = sorted(n.rank for n in reply.finished)
        lost = sorted(n.rank for n in reply.dead if n.role == _cluster.WORKER)
        return stopped, lost

    def dead_servers(self):
        return [(n.rank, n.address) for n in list(self.client.dead)
                if n.role == _cluster.SERVER]

    def dead_workers(self):
        return [(n.rank, n.address) for n in list(self.client.dead)
                if n.role == _cluster.WORKER]

    def close(self) -> None:
        self.client.close()

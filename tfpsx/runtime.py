"""The process runtime: one process-wide state machine behind tfpsx's Fleet-style API.

``init()`` resolves the cluster (:mod:`tfpsx.cluster`) and, for a server or worker,
picks the control plane (:mod:`tfpsx.control`: the scheduler, or counters on PS 0); a
worker then goes new -> started (``init_worker``) -> stopped (``stop_worker``), a server
serves until every worker stopped (``run_server``). ``tfpsx/__init__.py`` is a thin
facade over :data:`RUNTIME`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import List, Optional, Tuple

from tfpsx import cluster as _cluster
from tfpsx import errors, metrics, settings
from tfpsx.control import eager_anchor, sched_client
from tfpsx.control.channels import wait_for_servers
from tfpsx.control.counters import CounterCoordinator
from tfpsx.control.peers import PeersOnlyCoordinator
from tfpsx.control.protocol import Coordinator
from tfpsx.control.scheduler import run_scheduler
from tfpsx.control.watchdog import ServerWatch, exit_when_lost, main_thread_activity
from tfpsx.ops import crash_trace, library_info, load_ops

logger = logging.getLogger("tfpsx")


def _ensure_log_handler():
    # tfpsx's progress lines must be visible in a plain script, as TF's own are.
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s tfpsx %(levelname)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


# The job name a worker that joined a running job boots its graph-mode server with.
_JOINER_JOB = "tfpsx_joiner"


@dataclasses.dataclass
class ServerReport:
    """What ``run_server()`` saw before it returned."""
    stopped: List[int]
    lost: List[int]
    seconds: float


class Runtime:
    def __init__(self):
        self.config: Optional[_cluster.ClusterConfig] = None
        self.role_maker: Optional[_cluster.RoleMaker] = None
        self._lock = threading.RLock()
        self._server = None
        self._coord: Optional[Coordinator] = None
        self._watch: Optional[ServerWatch] = None
        self._peer_watch: Optional[ServerWatch] = None  # collective and hybrid workers
        self._barrier_generation = 0
        self._worker_state = "new"  # new -> started -> stopped
        # (job, task, servers, address) this process's eager context is connected to
        # (tfpsx.keras): TF cannot disconnect it, so reset() keeps it.
        self.eager_connection: Optional[tuple] = None

    def reset(self) -> None:
        """Back to a process that never called ``init()`` (for tests): the server watch
        stops, the control-plane client closes, the configuration and the worker state
        go. What TF holds for the process stays: a started ``tf.distribute.Server`` runs
        on, and an eager context connected to a cluster stays connected
        (``eager_connection``)."""
        with self._lock:
            self._stop_watch()
            if self._coord is not None:
                self._coord.close()
            self.config = self.role_maker = self._coord = self._server = None
            self._barrier_generation, self._worker_state = 0, "new"
            metrics.set_identity(None, None)

    # ------------------------------------------------------------------ setup
    def init(self, role_maker: Optional[_cluster.RoleMaker] = None,
             is_collective: bool = False) -> _cluster.ClusterConfig:
        with self._lock:
            if self._worker_state == "started":
                raise RuntimeError("tfpsx.init() called again after init_worker(); call "
                                   "stop_worker() first")
            if role_maker is not None and not isinstance(role_maker, _cluster.RoleMaker):
                raise TypeError(f"tfpsx.init(role_maker=...) expects a tfpsx RoleMaker "
                                f"(TFConfigRoleMaker, EnvRoleMaker, UserDefinedRoleMaker, "
                                f"FlagsRoleMaker), got {role_maker!r}")
            _ensure_log_handler()
            role_maker = role_maker or _cluster.AutoRoleMaker()
            if not isinstance(is_collective, bool):
                raise TypeError(f"tfpsx.init(is_collective=...) expects True or False, got "
                                f"{is_collective!r}")
            config = role_maker.resolve(collective=True) if is_collective else role_maker.resolve()
            self._stop_watch()
            if self._coord is not None:
                self._coord.close()
            self._coord = None
            if config.needs_scheduler and config.role != _cluster.SCHEDULER:
                config, client = sched_client.register_node(
                    config, settings.get("TFPSX_CONNECT_TIMEOUT"),
                    settings.get("TFPSX_REGISTER_TIMEOUT"), settings.get("TFPSX_RPC_TIMEOUT"),
                    settings.get("TFPSX_HEARTBEAT_INTERVAL"))
                self._coord = sched_client.SchedulerCoordinator(config, client)
            elif config.collective and config.role == _cluster.WORKER:
                self._coord = PeersOnlyCoordinator()
            elif config.role in (_cluster.SERVER, _cluster.WORKER):
                self._coord = CounterCoordinator(
                    config, settings.get("TFPSX_RPC_TIMEOUT"),
                    settings.get("TFPSX_HEARTBEAT_INTERVAL"), logger)
            self.config, self.role_maker = config, role_maker
            metrics.set_identity(config.role, config.index)
            self._server = None
            self._barrier_generation, self._worker_state = 0, "new"
            return config

    @property
    def worker_started(self) -> bool:
        """This worker called init_worker() and not yet stop_worker()."""
        return self._worker_state == "started"

    @property
    def has_graph_server(self) -> bool:
        """server_target() started this process's tf.distribute.Server."""
        return self._server is not None

    def require(self, what: str) -> _cluster.ClusterConfig:
        if self.config is None:
            raise errors.NotInitializedError(
                f"tfpsx.{what}() needs the cluster: call tfpsx.init() first")
        return self.config

    def require_role(self, what: str, role: str) -> _cluster.ClusterConfig:
        config = self.require(what)
        if config.role != role:
            raise errors.WrongRoleError(
                f"tfpsx.{what}() is for a {role}, but this process is {config.role} "
                f"{config.index} (from {config.source})")
        return config

    # ------------------------------------------------------------------ worker side
    def session_config(self):
        import tensorflow as tf

        config = self.require("session_config")
        if config.collective:
            # Sessions run on this worker alone; its collectives reach the others through
            # the server init_worker() started, whose group leader is worker 0.
            proto = tf.compat.v1.ConfigProto(
                device_filters=[f"/job:{config.job_name}/task:{config.task_index}"])
            job, task = config.worker_device_job(0)
            proto.experimental.collective_group_leader = f"/job:{job}/replica:0/task:{task}"
            return proto
        # Without device filters a worker's master talks to every task and, measured, hung
        # in 4 of 6 runs; a worker needs only the servers and itself.
        filters = ["/job:ps"]
        if config.role == _cluster.WORKER:
            filters.append(f"/job:{config.job_name}/task:{config.task_index}")
        proto = tf.compat.v1.ConfigProto(device_filters=filters)
        if config.joined:
            # The servers started without this worker's address: the session carries its
            # cluster (TF's dynamic cluster), so each server's worker session for it can
            # reach it (its tensors, its devices). Its own server booted as _JOINER_JOB.
            spec = tf.train.ClusterSpec({"ps": list(config.servers), config.job_name: {
                config.task_index: config.task_address()}})
            proto.cluster_def.CopyFrom(spec.as_cluster_def())
            # Without it the servers give such a session state of its own (measured: "Container
            # ps does not exist"): the model the other workers train would not be there.
            proto.experimental.share_session_state_in_clusterspec_propagation = True
        return proto

    def server_target(self) -> str:
        import tensorflow as tf

        config = self.require_role("server_target", _cluster.WORKER)
        if config.collective:
            # The collective server tfpsx.init_worker() started serves the sessions too.
            if self._worker_state != "started":
                raise RuntimeError("tfpsx.server_target() in a collective job needs "
                                   "tfpsx.init_worker() first (it starts this worker's server)")
            return f"grpc://{config.dial(config.task_address())}"
        with self._lock:
            if self._server is None:
                spec, job, task = config.cluster_spec(), config.job_name, config.task_index
                if config.joined:
                    # Its sessions name it in their own cluster (session_config), which TF
                    # refuses for the name the server booted with: it boots under another.
                    spec, job, task = (tf.train.ClusterSpec({_JOINER_JOB: [
                        config.task_address()]}), _JOINER_JOB, 0)
                from tfpsx import compat

                self._server = tf.distribute.Server(
                    compat.server_def(spec, job, task, settings.get("TFPSX_LISTEN_PORT"),
                                      self.session_config()), start=True)
            return self._server.target

    def init_worker(self, connect_timeout: Optional[float] = None) -> None:
        config = self.require_role("init_worker", _cluster.WORKER)
        with self._lock:
            if self._worker_state == "started":
                return
            start = time.monotonic()
            if config.collective:
                # No servers: the peers meet in the first collective (the strategy's start,
                # bounded by TFPSX_COLLECTIVE_TIMEOUT), which also starts their watch.
                trace = crash_trace.wanted()  # a bad value: named before anything starts
                _enable_collectives(config)
                if trace:
                    _install_crash_trace(config)
                self._coord.worker_start()
                self._worker_state = "started"
                logger.info("worker %d of %d started (collective)", config.index,
                            config.worker_num)
                return
            wait_for_servers(
                {f"ps:{i}": addr for i, addr in enumerate(config.servers)},
                settings.get("TFPSX_CONNECT_TIMEOUT", connect_timeout),
                log=lambda m: logger.info("worker %d %s", config.index, m))
            self._coord.worker_start()
            self._worker_state = "started"
            self._watch = ServerWatch(
                {f"server {i}": a for i, a in enumerate(config.servers)},
                settings.get("TFPSX_HEARTBEAT_TIMEOUT"), settings.get("TFPSX_HEARTBEAT_INTERVAL"),
                self._server_lost,
                reported_dead=lambda: [(f"server {r}", a) for r, a in self._coord.dead_servers()]
            ).start()
            logger.info("worker %d connected to %d server(s) in %.2f s", config.index,
                        config.server_num, time.monotonic() - start)

    def stop_worker(self) -> None:
        config = self.require_role("stop_worker", _cluster.WORKER)
        with self._lock:
            if self._worker_state == "stopped":
                return
            if self._worker_state == "new":
                raise RuntimeError("tfpsx.stop_worker() before tfpsx.init_worker(): the servers "
                                   "never saw this worker start")
            if config.collective:
                self._leave_collective(config)
            # Servers exit once every worker stopped: from here on, a gone server is no loss.
            self._stop_watch()
            self._coord.worker_stop()
            self._worker_state = "stopped"
            logger.info("worker %d stopped", config.index)

    def _leave_collective(self, config: _cluster.ClusterConfig) -> None:
        """A collective rank leaves only when no peer can still need it: a ring
        all-reduce pulls each chunk from the rank before, so a rank whose last collective
        completed may still be read by a peer whose own has not; exiting then fails that
        peer ("Socket closed"). Every rank meets the others first: at the scheduler's
        barrier (a rank reaches it only after its collectives completed), else at a last
        all-reduce of its own, after which the peers' pulls left are that one's few
        bytes: it waits TFPSX_COLLECTIVE_LINGER for them."""
        from tfpsx import compat

        timeout = settings.get("TFPSX_COLLECTIVE_TIMEOUT")
        start = time.monotonic()
        try:
            if isinstance(self._coord, PeersOnlyCoordinator):
                job, task = config.job_name, config.task_index
                compat.collective_barrier(f"/job:{job}/replica:0/task:{task}/device:CPU:0",
                                          config.worker_num, _GOODBYE_GROUP_KEY, timeout)
                linger = settings.get("TFPSX_COLLECTIVE_LINGER")
            else:
                self._barrier_generation += 1
                self._coord.barrier(self._barrier_generation, timeout)
                linger = 0.0
        except Exception as e:  # noqa: BLE001 — named and re-raised
            raise errors.ClusterTimeoutError(
                f"worker {config.index}: tfpsx.stop_worker() could not meet the other "
                f"{config.worker_num - 1} worker(s) of the collective job within "
                f"{time.monotonic() - start:.0f} s (TFPSX_COLLECTIVE_TIMEOUT={timeout:g} s): "
                f"{e}") from e
        self._stop_watch()  # every rank is leaving: a peer gone from now on is no loss
        if linger:
            time.sleep(linger)

    def _stop_watch(self) -> None:
        for watch in (self._watch, self._peer_watch):
            if watch is not None:
                watch.stop()
        self._watch = self._peer_watch = None

    def _server_lost(self, task: str, address: str, why: str) -> None:
        """The server watch lost a server: the worker cannot go on (its share of the
        variables and tables is gone) and TF would block on it forever."""
        config = self.config
        grace = settings.get("TFPSX_LOST_GRACE")
        metrics.emit("server_lost", server=task, address=address, why=why)
        exit_when_lost(
            f"worker {config.index} lost {task} at {address}: {why} "
            f"(TFPSX_HEARTBEAT_TIMEOUT={settings.get('TFPSX_HEARTBEAT_TIMEOUT'):g} s); "
            f"{main_thread_activity()}. The job cannot go on without that server (its share "
            "of the variables and tables is gone): restart it from the last checkpoint. "
            f"This worker exits in {grace:g} s (TFPSX_LOST_GRACE) unless it fails first.",
            grace)

    def watch_peers(self) -> None:
        """A collective (or hybrid) worker watches the other workers (their collective
        servers are up once the first collective ran): a lost one ends this worker within
        the heartbeat timeout, naming it; TF's collectives would wait for it until their
        own timeout (TFPSX_COLLECTIVE_TIMEOUT)."""
        config = self.require_role("watch_peers", _cluster.WORKER)
        with self._lock:
            if self._peer_watch is not None or self._worker_state != "started":
                return
            me = config.index
            self._peer_watch = ServerWatch(
                {f"worker {r}": a for r, a in enumerate(config.workers) if r != me},
                settings.get("TFPSX_HEARTBEAT_TIMEOUT"), settings.get("TFPSX_HEARTBEAT_INTERVAL"),
                self._peer_lost,
                reported_dead=lambda: [(f"worker {r}", a) for r, a in self._coord.dead_workers()]
            ).start()

    def stop_peer_watch(self) -> None:
        """The workers met after their last all-reduce (a hybrid ``fit`` ended): a peer
        that leaves from now on is no loss."""
        with self._lock:
            watch, self._peer_watch = self._peer_watch, None
        if watch is not None:
            watch.stop()

    def _peer_lost(self, task: str, address: str, why: str) -> None:
        config = self.config
        grace = settings.get("TFPSX_LOST_GRACE")
        metrics.emit("peer_lost", peer=task, address=address, why=why)
        from tfpsx import compat

        # The collective in flight fails at once, naming the peer (not at its timeout).
        # (A hybrid worker's all-reduce runs in a session of its own: it ends with the
        # process.)
        if config.collective:
            compat.abort_collectives(f"worker {config.index} lost {task} at {address}: {why}")
        exit_when_lost(
            f"worker {config.index} lost {task} at {address}: {why} "
            f"(TFPSX_HEARTBEAT_TIMEOUT={settings.get('TFPSX_HEARTBEAT_TIMEOUT'):g} s); "
            f"{main_thread_activity()}. An all-reduce cannot go on without every rank: "
            "restart the job from the last checkpoint. "
            f"This worker exits in {grace:g} s (TFPSX_LOST_GRACE) unless it fails first.",
            grace)

    def dead_workers(self) -> List[Tuple[int, str]]:
        """(rank, address) of the workers the control plane declared dead (the scheduler,
        from their heartbeats; empty without one)."""
        return self._coord.dead_workers() if self._coord is not None else []

    def barrier_worker(self, timeout: Optional[float] = None) -> None:
        self.require_role("barrier_worker", _cluster.WORKER)
        if self._worker_state != "started":
            raise RuntimeError("tfpsx.barrier_worker() needs tfpsx.init_worker() first")
        timeout = settings.get("TFPSX_BARRIER_TIMEOUT", timeout)
        self._barrier_generation += 1
        self._coord.barrier(self._barrier_generation, timeout)

    # ------------------------------------------------------------------ server side
    def run_server(self, register_timeout: Optional[float] = None,
                   heartbeat_timeout: Optional[float] = None) -> ServerReport:
        import tensorflow as tf

        config = self.require_role("run_server", _cluster.SERVER)
        register_timeout = settings.get("TFPSX_REGISTER_TIMEOUT", register_timeout)
        heartbeat_timeout = settings.get("TFPSX_HEARTBEAT_TIMEOUT", heartbeat_timeout)
        load_ops()  # before the server starts: a bare tf.distribute.Server cannot run our ops
        info = library_info()
        start = time.monotonic()
        from tfpsx import compat

        self._server = tf.distribute.Server(
            compat.server_def(config.cluster_spec(), "ps", config.index,
                              settings.get("TFPSX_LISTEN_PORT")), start=True)
        # Before any worker's eager context can reach it (workers wait for the anchor):
        # TF's CreateContext race (tfpsx.control.eager_anchor).
        eager_anchor.anchor(self._server.server_def, settings.get("TFPSX_RPC_TIMEOUT"))
        me = f"server {config.index}"
        logger.info("%s serving at %s (tfpsx ops for TF %s, CUDA kernels %s); waiting for %d "
                    "worker(s)", me, config.servers[config.index], info["tf_version"],
                    "in" if info["cuda"] else "not built", config.worker_num)
        stopped, lost = self._coord.serve(me, register_timeout, heartbeat_timeout,
                                          settings.get("TFPSX_CONNECT_TIMEOUT"))
        report = ServerReport(stopped=sorted(stopped), lost=sorted(lost),
                              seconds=time.monotonic() - start)
        if lost:
            logger.warning("%s: job over with lost worker(s) %s", me, report.lost)
        logger.info("%s: all %d workers done after %.1f s; returning", me, config.worker_num,
                    report.seconds)
        return report


    # ------------------------------------------------------------------ scheduler
    def run_scheduler(self) -> int:
        return run_scheduler(self.require_role("run_scheduler", _cluster.SCHEDULER))


RUNTIME = Runtime()


# The collective group of stop_worker's last all-reduce (the training's is another).
_GOODBYE_GROUP_KEY = 0x7467


def _install_crash_trace(config: _cluster.ClusterConfig) -> None:
    """A collective worker runs no tfpsx op, but loads the op library for its crash
    trace (a fatal signal names the native and Python stacks). A library that cannot
    load costs the trace only: a warning names it."""
    try:
        load_ops()
    except errors.OpLibraryError as e:
        logger.warning("worker %d runs without tfpsx's crash trace: %s", config.index, e)


def _enable_collectives(config: _cluster.ClusterConfig) -> None:
    """This worker's collective runtime (an in-process server on its address, the group
    leader worker 0), before any TensorFlow op: TF configures collectives once, at
    program start."""
    from tfpsx import compat

    leader_job, leader_task = config.worker_device_job(0)
    try:
        compat.enable_collectives(config.cluster_spec(), config.job_name, config.task_index,
                                  f"/job:{leader_job}/replica:0/task:{leader_task}",
                                  port=settings.get("TFPSX_LISTEN_PORT"))
    except (RuntimeError, ValueError) as e:
        raise RuntimeError(
            f"tfpsx.init_worker() could not start worker {config.index}'s collectives ({e}): "
            "in a collective job call it right after tfpsx.init(), before any TensorFlow op "
            "runs (TF configures collectives once, at program start)") from e

"""The process runtime: one process-wide state machine behind tfpsx's Fleet-style API.

``init()`` resolves the cluster (:mod:`tfpsx.cluster`) and, for a server or worker,
picks the control plane (:mod:`.control_plane`); a worker then goes new -> started
(``init_worker``) -> stopped (``stop_worker``), a server serves until every worker
stopped (``run_server``, :mod:`.server`). The TF1 plumbing is :mod:`.graph_server`, a
collective worker's start and leave :mod:`.collective`, the liveness watches
:mod:`.watches`. ``tfpsx/__init__.py`` is a thin facade over :data:`RUNTIME`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import List, Optional, Tuple

from tfpsx import cluster as _cluster
from tfpsx import errors, metrics, settings
from tfpsx.control.channels import wait_for_servers
from tfpsx.control.protocol import Coordinator
from tfpsx.control.scheduler import run_scheduler
from tfpsx.control.watchdog import ServerWatch, reset_uncaught
from tfpsx.runtime import collective, control_plane, graph_server, server, watches

logger = logging.getLogger("tfpsx")


class Runtime:
    def __init__(self):
        self.config: Optional[_cluster.ClusterConfig] = None
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
        go, and so do the process-wide handlers strategies installed (``sys.excepthook``'s
        translators of uncaught errors). What TF holds for the process stays: a started
        ``tf.distribute.Server`` runs on, and an eager context connected to a cluster
        stays connected (``eager_connection``)."""
        with self._lock:
            reset_uncaught()
            self._stop_watch()
            if self._coord is not None:
                self._coord.close()
            self.config = self._coord = self._server = None
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
            control_plane.ensure_log_handler()
            role_maker = role_maker or _cluster.AutoRoleMaker()
            if not isinstance(is_collective, bool):
                raise TypeError(f"tfpsx.init(is_collective=...) expects True or False, got "
                                f"{is_collective!r}")
            config = role_maker.resolve(collective=True) if is_collective else role_maker.resolve()
            self._stop_watch()
            if self._coord is not None:
                self._coord.close()
            self._coord = None
            config, self._coord = control_plane.connect(config)
            self.config = config
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
        return graph_server.session_config(self.require("session_config"))

    def server_target(self) -> str:
        config = self.require_role("server_target", _cluster.WORKER)
        if config.collective:
            # The collective server tfpsx.init_worker() started serves the sessions too.
            if self._worker_state != "started":
                raise RuntimeError("tfpsx.server_target() in a collective job needs "
                                   "tfpsx.init_worker() first (it starts this worker's server)")
            return f"grpc://{config.dial(config.task_address())}"
        with self._lock:
            if self._server is None:
                self._server = graph_server.start_graph_server(config)
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
                collective.start(config)
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
            self._watch = watches.watch_servers(config, self._coord.dead_servers)
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
                linger = collective.leave(config, self._coord, self._next_barrier)
                self._stop_watch()  # every rank is leaving: a peer gone from now on is no loss
                if linger:
                    time.sleep(linger)
            # Servers exit once every worker stopped: from here on, a gone server is no loss.
            self._stop_watch()
            self._coord.worker_stop()
            self._worker_state = "stopped"
            logger.info("worker %d stopped", config.index)
            marker = settings.get("TFPSX_STOPPED_FILE")
            if marker:  # (the launcher: killed from now on, it is not started again)
                with open(marker, "w") as f:
                    f.write(f"worker {config.index} stopped\n")

    def _stop_watch(self) -> None:
        for watch in (self._watch, self._peer_watch):
            if watch is not None:
                watch.stop()
        self._watch = self._peer_watch = None

    def watch_peers(self) -> None:
        """A collective (or hybrid) worker watches the other workers (their collective
        servers are up once the first collective ran): a lost one ends this worker within
        the heartbeat timeout, naming it; TF's collectives would wait for it until their
        own timeout (TFPSX_COLLECTIVE_TIMEOUT)."""
        config = self.require_role("watch_peers", _cluster.WORKER)
        with self._lock:
            if self._peer_watch is not None or self._worker_state != "started":
                return
            self._peer_watch = watches.watch_peers(config, self._coord.dead_workers)

    def stop_peer_watch(self) -> None:
        """The workers met after their last all-reduce (a hybrid ``fit`` ended): a peer
        that leaves from now on is no loss."""
        with self._lock:
            watch, self._peer_watch = self._peer_watch, None
        if watch is not None:
            watch.stop()

    def dead_workers(self) -> List[Tuple[int, str]]:
        """(rank, address) of the workers the control plane declared dead (the scheduler,
        from their heartbeats; empty without one)."""
        return self._coord.dead_workers() if self._coord is not None else []

    def barrier_worker(self, timeout: Optional[float] = None) -> None:
        self.require_role("barrier_worker", _cluster.WORKER)
        if self._worker_state != "started":
            raise RuntimeError("tfpsx.barrier_worker() needs tfpsx.init_worker() first")
        self._next_barrier(settings.get("TFPSX_BARRIER_TIMEOUT", timeout))

    def _next_barrier(self, timeout: float) -> None:
        self._barrier_generation += 1
        self._coord.barrier(self._barrier_generation, timeout)

    # ------------------------------------------------------------------ servers, scheduler
    def run_server(self, register_timeout: Optional[float] = None,
                   heartbeat_timeout: Optional[float] = None) -> server.ServerReport:
        config = self.require_role("run_server", _cluster.SERVER)
        self._server, report = server.run_server(config, self._coord, register_timeout,
                                                 heartbeat_timeout)
        return report

    def run_scheduler(self) -> int:
        return run_scheduler(self.require_role("run_scheduler", _cluster.SCHEDULER))


RUNTIME = Runtime()

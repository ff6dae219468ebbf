"""The Fleet-style API: one process-wide state behind tfpsx's public functions."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import List, Optional

from tfpsx import _control, errors
from tfpsx import cluster as _cluster
from tfpsx._loader import load_ops
from tfpsx.role_maker import AutoRoleMaker, RoleMaker

logger = logging.getLogger("tfpsx")

# Defaults of the bounded waits, each overridable by argument or environment variable.
CONNECT_TIMEOUT = ("TFPSX_CONNECT_TIMEOUT", 120.0)     # a worker waiting for its servers
REGISTER_TIMEOUT = ("TFPSX_REGISTER_TIMEOUT", 600.0)   # servers waiting for every worker to start
HEARTBEAT_INTERVAL = ("TFPSX_HEARTBEAT_INTERVAL", 2.0)
HEARTBEAT_TIMEOUT = ("TFPSX_HEARTBEAT_TIMEOUT", 60.0)  # silence after which a worker is lost
BARRIER_TIMEOUT = ("TFPSX_BARRIER_TIMEOUT", 600.0)
RPC_TIMEOUT = ("TFPSX_RPC_TIMEOUT", 30.0)              # one control call


def _setting(value: Optional[float], spec) -> float:
    name, default = spec
    if value is not None:
        return _cluster.parse_float(value, f"argument for {name}")
    return _cluster.env_float(name, default)


def _ensure_log_handler():
    # tfpsx's progress lines must be visible in a plain script, as TF's own are.
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s tfpsx %(levelname)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


@dataclasses.dataclass
class ServerReport:
    """What ``run_server()`` saw before it returned."""
    stopped: List[int]
    lost: List[int]
    seconds: float


class _Fleet:
    def __init__(self):
        self.config: Optional[_cluster.ClusterConfig] = None
        self.role_maker: Optional[RoleMaker] = None
        self._lock = threading.RLock()
        self._server = None
        self._coord = None  # _control.CounterCoordinator or _sched_client.SchedulerCoordinator
        self._barrier_generation = 0
        self._worker_state = "new"  # new -> started -> stopped

    # ------------------------------------------------------------------ setup
    def init(self, role_maker: Optional[RoleMaker] = None) -> _cluster.ClusterConfig:
        with self._lock:
            if self._worker_state == "started":
                raise RuntimeError("tfpsx.init() called again after init_worker(); call "
                                   "stop_worker() first")
            if role_maker is not None and not isinstance(role_maker, RoleMaker):
                raise TypeError(f"tfpsx.init(role_maker=...) expects a tfpsx RoleMaker "
                                f"(TFConfigRoleMaker, EnvRoleMaker, UserDefinedRoleMaker, "
                                f"FlagsRoleMaker), got {role_maker!r}")
            _ensure_log_handler()
            role_maker = role_maker or AutoRoleMaker()
            config = role_maker.resolve()
            if self._coord is not None:
                self._coord.close()
            self._coord = None
            if config.needs_scheduler and config.role != _cluster.SCHEDULER:
                from tfpsx import _sched_client

                config, client = _sched_client.register_node(
                    config, _setting(None, CONNECT_TIMEOUT), _setting(None, REGISTER_TIMEOUT),
                    _setting(None, RPC_TIMEOUT), _setting(None, HEARTBEAT_INTERVAL))
                self._coord = _sched_client.SchedulerCoordinator(config, client)
            elif config.role in (_cluster.SERVER, _cluster.WORKER):
                self._coord = _control.CounterCoordinator(
                    config, _setting(None, RPC_TIMEOUT), _setting(None, HEARTBEAT_INTERVAL),
                    logger)
            self.config, self.role_maker = config, role_maker
            self._server = None
            self._barrier_generation, self._worker_state = 0, "new"
            return config

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
        # Without device filters a worker's master talks to every task and, measured, hung
        # in 4 of 6 runs; a worker needs only the servers and itself.
        filters = ["/job:ps"]
        if config.role == _cluster.WORKER:
            filters.append(f"/job:{config.job_name}/task:{config.task_index}")
        return tf.compat.v1.ConfigProto(device_filters=filters)

    def server_target(self) -> str:
        import tensorflow as tf

        config = self.require_role("server_target", _cluster.WORKER)
        with self._lock:
            if self._server is None:
                self._server = tf.distribute.Server(
                    config.cluster_spec(), job_name=config.job_name,
                    task_index=config.task_index, config=self.session_config(), start=True)
            return self._server.target

    def init_worker(self, connect_timeout: Optional[float] = None) -> None:
        config = self.require_role("init_worker", _cluster.WORKER)
        with self._lock:
            if self._worker_state == "started":
                return
            start = time.monotonic()
            _control.wait_for_servers(
                {f"ps:{i}": addr for i, addr in enumerate(config.servers)},
                _setting(connect_timeout, CONNECT_TIMEOUT),
                log=lambda m: logger.info("worker %d %s", config.index, m))
            self._coord.worker_start()
            self._worker_state = "started"
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
            self._coord.worker_stop()
            self._worker_state = "stopped"
            logger.info("worker %d stopped", config.index)

    def barrier_worker(self, timeout: Optional[float] = None) -> None:
        config = self.require_role("barrier_worker", _cluster.WORKER)
        if self._worker_state != "started":
            raise RuntimeError("tfpsx.barrier_worker() needs tfpsx.init_worker() first")
        timeout = _setting(timeout, BARRIER_TIMEOUT)
        self._barrier_generation += 1
        self._coord.barrier(self._barrier_generation, timeout)

    # ------------------------------------------------------------------ server side
    def run_server(self, register_timeout: Optional[float] = None,
                   heartbeat_timeout: Optional[float] = None) -> ServerReport:
        import tensorflow as tf

        config = self.require_role("run_server", _cluster.SERVER)
        register_timeout = _setting(register_timeout, REGISTER_TIMEOUT)
        heartbeat_timeout = _setting(heartbeat_timeout, HEARTBEAT_TIMEOUT)
        load_ops()  # before the server starts: a bare tf.distribute.Server cannot run our ops
        start = time.monotonic()
        self._server = tf.distribute.Server(config.cluster_spec(), job_name="ps",
                                            task_index=config.index, start=True)
        me = f"server {config.index}"
        logger.info("%s serving at %s; waiting for %d worker(s)", me,
                    config.servers[config.index], config.worker_num)
        stopped, lost = self._coord.serve(me, register_timeout, heartbeat_timeout,
                                          _setting(None, CONNECT_TIMEOUT))
        report = ServerReport(stopped=sorted(stopped), lost=sorted(lost),
                              seconds=time.monotonic() - start)
        if lost:
            logger.warning("%s: job over with lost worker(s) %s", me, report.lost)
        logger.info("%s: all %d workers done after %.1f s; returning", me, config.worker_num,
                    report.seconds)
        return report


FLEET = _Fleet()

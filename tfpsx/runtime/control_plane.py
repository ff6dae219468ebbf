"""Which control plane a process talks to (:mod:`tfpsx.control`): the scheduler when
the job has one (registering assigns this process's rank), counters on PS 0 otherwise,
the peers alone for a collective worker; and tfpsx's log handler."""

from __future__ import annotations

import logging
from typing import Optional, Tuple

from tfpsx import cluster as _cluster
from tfpsx import settings
from tfpsx.control import sched_client
from tfpsx.control.counters import CounterCoordinator
from tfpsx.control.peers import PeersOnlyCoordinator
from tfpsx.control.protocol import Coordinator

logger = logging.getLogger("tfpsx")


def connect(config: _cluster.ClusterConfig
            ) -> Tuple[_cluster.ClusterConfig, Optional[Coordinator]]:
    """(the configuration, completed by the scheduler where there is one; its
    coordinator, None for a scheduler or an evaluator)."""
    if config.needs_scheduler and config.role != _cluster.SCHEDULER:
        config, client = sched_client.register_node(
            config, settings.get("TFPSX_CONNECT_TIMEOUT"),
            settings.get("TFPSX_REGISTER_TIMEOUT"), settings.get("TFPSX_RPC_TIMEOUT"),
            settings.get("TFPSX_HEARTBEAT_INTERVAL"))
        return config, sched_client.SchedulerCoordinator(config, client)
    if config.collective and config.role == _cluster.WORKER:
        return config, PeersOnlyCoordinator()
    if config.role in (_cluster.SERVER, _cluster.WORKER):
        return config, CounterCoordinator(config, settings.get("TFPSX_RPC_TIMEOUT"),
                                          settings.get("TFPSX_HEARTBEAT_INTERVAL"), logger)
    return config, None


def ensure_log_handler() -> None:
    """tfpsx's progress lines must be visible in a plain script, as TF's own are."""
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s tfpsx %(levelname)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False

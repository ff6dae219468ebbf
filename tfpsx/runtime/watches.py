"""A worker's liveness watches and what a loss does: a lost server or peer ends the
worker within the heartbeat timeout, naming it (TF would block on it forever, or until
its collectives' own timeout)."""

from __future__ import annotations

from typing import Callable, List, Tuple

from tfpsx import cluster as _cluster
from tfpsx import metrics, settings
from tfpsx.control.watchdog import ServerWatch, exit_when_lost, main_thread_activity


def watch_servers(config: _cluster.ClusterConfig,
                  reported_dead: Callable[[], List[Tuple[int, str]]]) -> ServerWatch:
    """Starts the watch of every parameter server (``reported_dead``: (index, address)
    of the servers the control plane declared dead)."""
    return ServerWatch(
        {f"server {i}": a for i, a in enumerate(config.servers)},
        settings.get("TFPSX_HEARTBEAT_TIMEOUT"), settings.get("TFPSX_HEARTBEAT_INTERVAL"),
        lambda task, address, why: server_lost(config, task, address, why),
        reported_dead=lambda: [(f"server {r}", a) for r, a in reported_dead()]).start()


def watch_peers(config: _cluster.ClusterConfig,
                reported_dead: Callable[[], List[Tuple[int, str]]]) -> ServerWatch:
    """Starts the watch of every other worker (a collective or hybrid worker; their
    collective servers are up once the first collective ran)."""
    me = config.index
    return ServerWatch(
        {f"worker {r}": a for r, a in enumerate(config.workers) if r != me},
        settings.get("TFPSX_HEARTBEAT_TIMEOUT"), settings.get("TFPSX_HEARTBEAT_INTERVAL"),
        lambda task, address, why: peer_lost(config, task, address, why),
        reported_dead=lambda: [(f"worker {r}", a) for r, a in reported_dead()]).start()


def server_lost(config: _cluster.ClusterConfig, task: str, address: str, why: str) -> None:
    """The server watch lost a server: the worker cannot go on (its share of the
    variables and tables is gone) and TF would block on it forever."""
    grace = settings.get("TFPSX_LOST_GRACE")
    metrics.emit("server_lost", server=task, address=address, why=why)
    exit_when_lost(
        f"worker {config.index} lost {task} at {address}: {why} "
        f"(TFPSX_HEARTBEAT_TIMEOUT={settings.get('TFPSX_HEARTBEAT_TIMEOUT'):g} s); "
        f"{main_thread_activity()}. The job cannot go on without that server (its share "
        "of the variables and tables is gone): restart it from the last checkpoint. "
        f"This worker exits in {grace:g} s (TFPSX_LOST_GRACE) unless it fails first.",
        grace)


def peer_lost(config: _cluster.ClusterConfig, task: str, address: str, why: str) -> None:
    """The peer watch lost a worker: an all-reduce cannot go on without every rank."""
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

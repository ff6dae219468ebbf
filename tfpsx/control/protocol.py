"""The control plane's protocol: what the process runtime asks of a coordinator.

Two implementations: :class:`tfpsx.control.counters.CounterCoordinator` (counters on PS 0,
no scheduler) and :class:`tfpsx.control.sched_client.SchedulerCoordinator` (the
scheduler). Every call is bounded and raises ``ClusterTimeoutError`` /
``ServerUnavailableError`` naming what it waited for.
"""

from __future__ import annotations

import abc
from typing import List, Tuple


class Coordinator(abc.ABC):
    """One process's side of the job's control plane."""

    @abc.abstractmethod
    def worker_start(self) -> None:
        """A worker joined the job (after its servers accepted connections)."""

    @abc.abstractmethod
    def worker_stop(self) -> None:
        """A worker is done; servers return once every worker is (or was lost)."""

    @abc.abstractmethod
    def barrier(self, generation: int, timeout: float) -> None:
        """Blocks until every (live) worker reached barrier ``generation``."""

    @abc.abstractmethod
    def serve(self, me: str, register_timeout: float, heartbeat_timeout: float,
              connect_timeout: float) -> Tuple[List[int], List[int]]:
        """A server's wait for the job end; returns (stopped workers, lost workers)."""

    def dead_servers(self) -> List[Tuple[int, str]]:
        """(rank, address) of servers the control plane already declared dead (the
        scheduler does, from its heartbeats); empty where it cannot tell."""
        return []

    def dead_workers(self) -> List[Tuple[int, str]]:
        """(rank, address) of workers declared dead, as :meth:`dead_servers`."""
        return []

    @abc.abstractmethod
    def close(self) -> None:
        """Releases channels and threads; safe to call twice."""

"""The control plane of a collective job started without a scheduler (TF_CONFIG or
TFPSX_* endpoints, no parameter servers).

There are no servers to report to: a worker's start and stop concern only its peers,
which meet in the collectives themselves (bounded by TFPSX_COLLECTIVE_TIMEOUT and the
peer watch). Barriers need a place every worker can reach; without servers that is the
scheduler (``tfpsx-run``'s default)."""

from __future__ import annotations

from typing import List, Tuple

from tfpsx.control.protocol import Coordinator


class PeersOnlyCoordinator(Coordinator):
    """Collective workers without a scheduler: nothing to register or count."""

    def worker_start(self) -> None:
        pass

    def worker_stop(self) -> None:
        pass

    def barrier(self, generation: int, timeout: float) -> None:
        raise RuntimeError(
            "tfpsx.barrier_worker() in a collective job without a scheduler: there is no "
            "server to meet at; start the job with the scheduler (tfpsx-run's default, or "
            "TFPSX_SCHED_ADDR)")

    def serve(self, me: str, register_timeout: float, heartbeat_timeout: float,
              connect_timeout: float) -> Tuple[List[int], List[int]]:
        raise RuntimeError(f"{me}: a collective job has no servers to serve")

    def close(self) -> None:
        pass

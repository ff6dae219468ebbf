"""GEO's round: its phases, the caches' locks around them, and what a round moved.

A **round** is a sequence of phases (:func:`round_phases`): in the background
communicator (Paddle's GeoCommunicator) a push and the pull right after it; in the
deterministic schedule (``geo_sync_in_train_thread=True``) push, every worker meets,
pull, every worker meets again (with a worker cache, which reads the PS on a miss, they
meet first too).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import List, Tuple

from tfpsx import metrics
from tfpsx.modes.geo.copies import GeoTable
from tfpsx.modes.geo.rule import GeoVariable

PUSH, PULL, BARRIER = "push", "pull", "barrier"

logger = logging.getLogger("tfpsx")


class GeoCounters(metrics.Counters):
    """What the GEO communicator did on this worker (``metrics.snapshot()["geo"]``)."""
    GROUP = "geo"
    # sync_seconds: total time spent in push + pull; round_waits / round_wait_seconds:
    # the training thread waited for a background round in flight (GeoSchedule).
    # The tables' traffic against async's (counted when a fit or session ends,
    # count_trained): trained_rows, the rows the training steps' lookups held (each
    # step's distinct rows, summed); hot_rows, those of them read and trained on the PS;
    # async_table_bytes, what async would have moved for trained_rows (a row read and
    # its gradient sent, each with its key); hot_table_bytes, what the hot rows moved so;
    # table_bytes, what the rounds moved for the tables, both ways.
    # geo_table_choice="auto" (tfpsx.modes.geo.choice): tables_async, the tables that
    # train async now; table_switches, the switches between rounds and async.
    # geo_pull_ahead: pulls_ahead, the rounds whose pull brought only the changed rows
    # among those the worker read ahead (the others pulled every changed row).
    FIELDS = ("pushes", "rows_sent", "rows_received", "bytes_sent", "bytes_received",
              "sync_seconds", "round_waits", "round_wait_seconds", "trained_rows",
              "hot_rows", "async_table_bytes", "hot_table_bytes", "table_bytes",
              "tables_async", "table_switches", "pulls_ahead")

    @property
    def mean_sync_seconds(self) -> float:
        return self.sync_seconds / self.pushes if self.pushes else 0.0

    @property
    def table_bytes_vs_async(self) -> float:
        """The tables' bytes (rounds and hot rows) per byte async would have moved for the
        same rows; 0.0 before a step was counted."""
        if not self.async_table_bytes:
            return 0.0
        return (self.table_bytes + self.hot_table_bytes) / self.async_table_bytes


def row_trip_bytes(dim: int) -> int:
    """What async moves for a row a step: read (its key up, ``dim`` floats down) and its
    gradient sent (the key and ``dim`` floats up)."""
    return 2 * (8 + 4 * dim)


def count_trained(counters: GeoCounters, worker: int, trained: List[Tuple[int, int, int]],
                  steps: int) -> None:
    """Adds the rows this worker's steps trained since the last count, ``(rows, hot rows,
    dim)`` per table, to ``counters``, and logs what the tables moved against what
    async would have moved for the same rows (docs/modes.md: a round saves a row's
    traffic only when a worker's K steps meet the row again)."""
    rows = sum(r for r, _, _ in trained)
    if rows <= 0:
        return
    counters.add(trained_rows=rows, hot_rows=sum(h for _, h, _ in trained),
                 async_table_bytes=sum(r * row_trip_bytes(d) for r, _, d in trained),
                 hot_table_bytes=sum(h * row_trip_bytes(d) for _, h, d in trained))
    mb = 1e-6
    logger.info("GEO on worker %d, %d local steps: its tables moved %.1f MB (rounds %.1f MB, "
                "hot rows on the PS %.1f MB; a worker cache's fetches not counted), %.2fx "
                "the %.1f MB async would have moved for the rows they trained (a row read "
                "and its gradient sent a step). A round saves a row's traffic only when a "
                "worker's K steps meet the row again (docs/modes.md, GEO at N workers).",
                worker, steps,
                (counters.table_bytes + counters.hot_table_bytes) * mb,
                counters.table_bytes * mb, counters.hot_table_bytes * mb,
                counters.table_bytes_vs_async, counters.async_table_bytes * mb)


def round_phases(deterministic: bool, cached: bool) -> Tuple[str, ...]:
    """One sync round's phases, in order.

    Background: push, then pull (one round trip less: the pull may follow in the same
    step). Deterministic: push, every worker meets (every push is in), pull, they meet
    again (nobody pushes before everyone pulled); with a worker cache they also meet
    first (a cache reads the PS on a miss: no push may land while another worker still
    runs its local steps)."""
    if not deterministic:
        return (PUSH, PULL)
    return ((BARRIER,) if cached else ()) + (PUSH, BARRIER, PULL, BARRIER)


@contextlib.contextmanager
def caches_locked(tables: List[GeoTable]):
    """Holds the sync locks of the worker caches among ``tables`` (a round's push must
    not run beside a stager's eviction push of the same rows)."""
    with contextlib.ExitStack() as stack:
        for t in tables:
            if t.cached:
                stack.enter_context(t.local.sync_lock)
        yield


def dense_size(dense: List[GeoVariable]) -> Tuple[int, int]:
    """(rows, bytes) a round moves for the dense copies, each way (float32)."""
    rows = sum(int(v.local.shape[0]) if v.local.shape.rank else 1 for v in dense)
    return rows, sum(4 * int(v.local.shape.num_elements()) for v in dense)


def count_round(counters: GeoCounters, start: float, dense: Tuple[int, int],
                sent: Tuple[int, int], received: Tuple[int, int]) -> None:
    """Adds one round to ``counters``: ``sent`` / ``received`` are the tables' (rows,
    bytes); ``dense`` the dense copies' (:func:`dense_size`), moved each way."""
    counters.add(pushes=1, rows_sent=dense[0] + int(sent[0]), bytes_sent=dense[1] + int(sent[1]),
                 rows_received=dense[0] + int(received[0]),
                 bytes_received=dense[1] + int(received[1]),
                 table_bytes=int(sent[1]) + int(received[1]),
                 sync_seconds=time.monotonic() - start)

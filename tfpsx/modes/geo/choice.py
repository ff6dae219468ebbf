"""GEO's choice, table by table, between rounds and async (a strategy's
``geo_table_choice="auto"``, the rule for many workers' default): a table runs rounds
only while they move fewer bytes than async would for the same rows, decided from GEO's
own traffic counters as the job runs.

A round saves a row's traffic only when a worker's K steps meet the row again, and its
pull brings every row the other workers changed (docs/modes.md, "When GEO pays"). So a
table starts async (every row read and trained on the PS, no round moves it), and each
round the chief counts what async moves for it, ``async = trained rows x``
:func:`~tfpsx.modes.geo.round.row_trip_bytes`, and what a round would move: ``N x`` the
distinct rows a worker's steps trained in the round (:mod:`.distinct`, counted on the
chief; its push, and the others' pushes it would pull) ``x`` a row's wire bytes: at
most what a round moves (rows several workers train are pulled once). Where that
estimate stays under ``TRY_BELOW`` x async over a window, the table tries rounds: its
copy takes the PS's rows, and the rounds' bytes are measured (``(pushed + pulled rows)
x`` a row's wire bytes ``+`` its hot rows' async traffic). A window of rounds that
moved more than async sends it back to async, and it tries again after
TFPSX_GEO_RECHECK_SECONDS at the earliest. Windows: ``FIRST_WINDOW`` rounds after the
round left out (the job's first, or a trial's first: its copy's first rows), then
``WINDOW`` rounds.

The decision is the job's: the chief writes it on PS 0 (a bit per table that runs
rounds, in the order the tables are built: :data:`~tfpsx.modes.state.GEO_TABLE_CHOICE`), every
worker reads it with each round and follows, and each switch is logged and counted
(``metrics.snapshot()["geo"]``: ``tables_async``, ``table_switches``).

Switching is safe at any round, on any worker first: a row trained async is right in
any mode (GEO's hot rows are such rows). A table that tries rounds registers this
worker's changed-key reader on the PS and copies the PS's rows (a catch-up round), and
only then do its lookups read the copy. One that goes back to async pushes what its
copy trained (its next round), then rounds move nothing for it; the PS keeps marking its
changed keys for this worker until the next trial (up to one entry a key trained
meanwhile). Background rounds only: deterministic rounds
(``geo_sync_in_train_thread=True``) keep every table in rounds, since the workers would
switch at different steps.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, List, Optional, Sequence, Tuple

from tfpsx import settings

logger = logging.getLogger("tfpsx")

ROUNDS, ASYNC = "rounds", "async"
# What a table's round does: push and pull (PULL; CATCH_UP, a table back to rounds);
# push what the copy trained before the table went async, no pull (SKIP); nothing (IDLE).
PULL, SKIP, IDLE, CATCH_UP = "pull", "skip", "idle", "catch_up"
# Rounds counted before a decision, after the round left out; then every WINDOW rounds.
FIRST_WINDOW = 2
WINDOW = 8
# An async table tries rounds when its estimate is under this share of async's bytes
# (an upper bound: rows that several workers train are pulled once).
TRY_BELOW = 1.0
MAX_TABLES = 63  # bits of the job's int64 on PS 0


@dataclasses.dataclass
class TableTraffic:
    """One table's measures, for the choice: its name, a row's bytes in a round (its key
    and the values and slots as they travel) and in async (read and gradient sent)."""
    name: str
    round_row_bytes: int
    async_row_bytes: int
    fixed: bool = False        # always rounds (a table with a worker cache)
    state: str = ASYNC         # ROUNDS or ASYNC
    catching: bool = False     # trying rounds: the next round copies the PS's rows
    flushed: bool = True       # async, and its copy holds nothing unpushed
    failed: Optional[float] = None  # when its last trial of rounds ended (the clock)
    skip: int = 1              # rounds left out of the window (the first, a trial's first)
    geo_bytes: float = 0.0     # this window: the rounds' bytes (or their estimate)
    async_bytes: float = 0.0   # this window: what async would have moved
    rounds: int = 0            # rounds in this window
    checked: bool = False      # a window was decided on since the last switch
    last_ratio: Optional[float] = None  # geo / async of the last window decided on

    def __post_init__(self):
        if self.fixed:
            self.state, self.flushed = ROUNDS, False


class TableChoice:
    """Which of a worker's GEO tables run rounds and which train async (the module doc).

    Args:
      tables: each table's :class:`TableTraffic`, in the order the tables were built
        (every worker's is the same).
      workers: N, the job's workers (the rule's).
      is_chief: this worker decides for the job.
      counters: :class:`~tfpsx.modes.geo.round.GeoCounters` (``tables_async``,
        ``table_switches``).
      recheck_seconds: how long after a failed trial of rounds a table may try again
        (default: TFPSX_GEO_RECHECK_SECONDS).
      clock: the chief's clock (tests).
    """

    def __init__(self, tables: Sequence[TableTraffic], workers: int, is_chief: bool,
                 counters=None, recheck_seconds: Optional[float] = None,
                 clock: Callable[[], float] = time.monotonic):
        if len(tables) > MAX_TABLES:
            raise ValueError(f"GEO: geo_table_choice='auto' chooses for at most {MAX_TABLES} "
                             f"tables; the model has {len(tables)}: name "
                             "geo_table_choice='rounds' for this job")
        self.tables = list(tables)
        self.workers, self.is_chief, self.counters = int(workers), is_chief, counters
        self.recheck_seconds = (settings.get("TFPSX_GEO_RECHECK_SECONDS")
                                if recheck_seconds is None else recheck_seconds)
        self._clock = clock
        self._totals = [(0, 0)] * len(self.tables)  # trained (rows, hot) at the last round
        if counters is not None:
            counters.add(tables_async=sum(t.state == ASYNC for t in self.tables))

    def actions(self) -> Tuple[str, ...]:
        """What each table does in the next round: PULL (rounds: push, pull), CATCH_UP
        (trying rounds: the copy takes the PS's rows), SKIP (back to async: the push of
        what its copy trained, no pull) or IDLE (async: nothing)."""
        return tuple(CATCH_UP if t.catching else
                     (IDLE if t.flushed else SKIP) if t.state == ASYNC else PULL
                     for t in self.tables)

    def mask(self) -> int:
        """This worker's choice now: a bit per table that runs rounds (a cached one's
        left clear)."""
        return sum(1 << i for i, t in enumerate(self.tables)
                   if t.state == ROUNDS and not t.fixed)

    def observe(self, actions: Sequence[str], pushed: Sequence[int], pulled: Sequence[int],
                distinct: Sequence[float], trained: Sequence[Tuple[int, int]]) -> List[int]:
        """One round ran ``actions``: per table the rows it pushed and pulled, the distinct
        rows this worker's steps trained, and ``(rows, hot rows)`` they held, since the
        last round. Returns the tables whose catch-up completed (their lookups read their
        copy from now)."""
        caught = []
        for i, (t, action, out, got, seen, (rows, hot)) in enumerate(
                zip(self.tables, actions, pushed, pulled, distinct, trained)):
            if action == CATCH_UP:
                t.catching, t.skip = False, 1
                caught.append(i)
                continue
            if action in (SKIP, IDLE):
                t.flushed = True
            if t.skip > 0:
                t.skip -= 1
                continue
            if action == PULL:
                t.geo_bytes += (out + got) * t.round_row_bytes + hot * t.async_row_bytes
            elif action == IDLE:  # what a round would move: N x the distinct rows
                t.geo_bytes += self.workers * seen * t.round_row_bytes
            else:
                continue  # (its push of the copy's rest)
            t.async_bytes += rows * t.async_row_bytes
            t.rounds += 1
        return caught

    def decide(self) -> Optional[int]:
        """The chief, after :meth:`observe`: the job's new choice (a bit per table that
        runs rounds) when a table's window ended and its choice changes; else None."""
        if not self.is_chief:
            return None
        mask, changed, now = self.mask(), False, self._clock()
        for i, t in enumerate(self.tables):
            if t.fixed or t.rounds < (WINDOW if t.checked else FIRST_WINDOW) \
                    or not t.async_bytes:
                continue
            ratio, rounds, told = t.geo_bytes / t.async_bytes, t.rounds, t.checked
            t.last_ratio, t.checked = ratio, True
            t.geo_bytes = t.async_bytes = 0.0
            t.rounds = 0
            if t.state == ROUNDS and ratio > 1.0:
                mask &= ~(1 << i)
                changed = True
                t.failed = now
                logger.info("GEO: table %r trains async from now: its rounds moved %.2fx the "
                            "bytes async would have for the same rows over its last %d "
                            "rounds (geo_table_choice='auto'; it may try rounds again in "
                            "TFPSX_GEO_RECHECK_SECONDS=%g; docs/modes.md, When GEO pays)",
                            t.name, ratio, rounds, self.recheck_seconds)
            elif t.state == ASYNC and ratio < TRY_BELOW and (
                    t.failed is None or now - t.failed >= self.recheck_seconds):
                mask |= 1 << i
                changed = True
                logger.info("GEO: table %r tries rounds: they would move at most %.2fx the "
                            "bytes async moves for the same rows (estimated over %d rounds: "
                            "%d workers x the distinct rows a worker trained; "
                            "geo_table_choice='auto')", t.name, ratio, rounds, self.workers)
            elif not told and t.failed is None:
                logger.info("GEO: table %r %s: %s %.2fx the bytes async %s for the same "
                            "rows over its first %d rounds (geo_table_choice='auto'; "
                            "docs/modes.md, When GEO pays)", t.name,
                            "trains async" if t.state == ASYNC else "runs rounds",
                            "rounds would move at most" if t.state == ASYNC else
                            "its rounds moved", ratio,
                            "moves" if t.state == ASYNC else "would have", rounds)
        return mask if changed else None

    def after_round(self, actions: Sequence[str], pushed: Sequence[int],
                    pulled: Sequence[int], distinct: Sequence[float],
                    totals: Sequence[Tuple[int, int]], write: Callable[[int], None],
                    read: Callable[[], Optional[int]]) -> Tuple[List[int], List[int]]:
        """A round ran ``actions`` (:meth:`actions`): the front-end gives what it moved
        per table, the distinct rows trained since the last round, and ``totals``, each
        table's ``(rows, hot rows)`` trained so far; the chief ``write`` s a new choice
        for the job (PS 0), every worker ``read`` s the job's (None: not set up yet) and
        adopts it. Returns (the tables whose lookups read the PS from now, those whose
        lookups read their copy from now)."""
        trained = [(r - r0, h - h0) for (r, h), (r0, h0) in zip(totals, self._totals)]
        self._totals = list(totals)
        caught = self.observe(actions, pushed, pulled, distinct, trained)
        new = self.decide()
        if new is not None:
            write(new)
        mask = read()
        switched = self.adopt(mask) if mask is not None else []
        # A catch-up that completed in the round whose choice sends the table back to
        # async (a worker that read the chief's trial late): its lookups stay on the PS.
        caught = [i for i in caught if self.tables[i].state == ROUNDS]
        return [i for i, state in switched if state == ASYNC], caught

    def adopt(self, mask: int) -> List[Tuple[int, str]]:
        """The job's choice (read from PS 0): the tables whose state changes here, as
        ``(index, new state)``. A table going async reads the PS from now; one trying
        rounds first catches up (its next round), then reads its copy."""
        switched = []
        for i, t in enumerate(self.tables):
            if t.fixed:
                continue
            want = ROUNDS if mask >> i & 1 else ASYNC
            if want == t.state:
                continue
            t.state, t.catching, t.flushed = want, want == ROUNDS, False
            t.skip, t.checked = 0, False
            t.geo_bytes = t.async_bytes = 0.0
            t.rounds = 0
            switched.append((i, want))
            if self.counters is not None:
                self.counters.add(table_switches=1,
                                  tables_async=1 if want == ASYNC else -1)
            if not self.is_chief:
                logger.info("GEO: table %r %s (the chief's choice, geo_table_choice='auto')",
                            t.name, "trains async" if want == ASYNC else "tries rounds")
        return switched

"""GEO's choice, table by table, between rounds and async (a strategy's
``geo_table_choice="auto"``, the rule for many workers' default): a table whose rounds
move more bytes than async would for the same rows trains async, re-checked as the job
runs, from GEO's own traffic counters.

A round saves a row's traffic only when a worker's K steps meet the row again, and its
pull brings every row the other workers changed (docs/modes.md, "When GEO pays"): on a
table whose rows rarely repeat within a round, a round moves more than async. Each round
the chief counts, per table, what the round moved against what async would have moved
for the rows its steps trained since the last round: ``geo = (pushed + pulled rows) x a
row's wire bytes + the hot rows' async traffic``, ``async = trained rows x``
:func:`~tfpsx.modes.geo.round.row_trip_bytes`.

After ``FIRST_WINDOW`` rounds (the first round left out: until a row's rate shows, GEO's
contention estimate trains it on the PS), the chief decides: a table whose ``geo``
exceeds ``async`` trains async. A table trained async is re-checked every
TFPSX_GEO_RECHECK_SECONDS: it runs rounds again for a window (its first round pulls
what its copy missed, left out), and trains async again if they still cost more. The
decision is the job's: the chief writes it on PS 0 (a bit per table, in the order the
tables are built: :data:`~tfpsx.modes.state.GEO_TABLE_CHOICE`), every worker reads it
with each round and follows, and each switch is logged and counted
(``metrics.snapshot()["geo"]``: ``tables_async``, ``table_switches``).

Switching is safe at any round, on any worker first: a row trained async is right in
any mode (GEO's hot rows are such rows). A table that goes async reads and trains every
row on the PS from then on; the next round still pushes what its copy trained before,
and its rounds pull nothing (the PS keeps the keys changed for this worker: up to one
entry a key the job trains meanwhile). Back to rounds, the next pull brings all of them
(a catch-up), and only then do lookups read the copy again. In the background rounds
only: deterministic rounds (``geo_sync_in_train_thread=True``) keep every table in
rounds, since the workers would switch at different steps.
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
# Rounds measured before a decision, after the round left out (the job's first, or a
# re-check's catch-up); then a table in rounds is checked again every WINDOW rounds.
FIRST_WINDOW = 2
WINDOW = 8
MAX_TABLES = 63  # bits of the job's int64 on PS 0


@dataclasses.dataclass
class TableTraffic:
    """One table's measures, for the choice: its name, a row's bytes in a round (its key
    and the values and slots as they travel) and in async (read and gradient sent)."""
    name: str
    round_row_bytes: int
    async_row_bytes: int
    fixed: bool = False        # always rounds (a table with a worker cache)
    state: str = ROUNDS        # ROUNDS or ASYNC
    catching: bool = False     # back to rounds: the next round pulls what it missed
    flushed: bool = False      # async, and a round pushed what its copy trained before
    since: float = 0.0         # when it went async (the chief's clock)
    skip: int = 1              # rounds left out of the window (the first, a catch-up)
    geo_bytes: float = 0.0     # this window: the rounds' bytes
    async_bytes: float = 0.0   # this window: what async would have moved
    rounds: int = 0            # rounds in this window
    last_ratio: Optional[float] = None  # geo / async of the last window decided on
    checked: bool = False      # a window was decided on since the job's start or re-check


class TableChoice:
    """Which of a worker's GEO tables run rounds and which train async (the module doc).

    Args:
      tables: each table's :class:`TableTraffic`, in the order the tables were built
        (every worker's is the same).
      is_chief: this worker decides for the job.
      counters: :class:`~tfpsx.modes.geo.round.GeoCounters` (``tables_async``,
        ``table_switches``).
      recheck_seconds: how long a table trains async before the chief has it run rounds
        again for a window (default: TFPSX_GEO_RECHECK_SECONDS).
      clock: the chief's clock (tests).
    """

    def __init__(self, tables: Sequence[TableTraffic], is_chief: bool, counters=None,
                 recheck_seconds: Optional[float] = None,
                 clock: Callable[[], float] = time.monotonic):
        if len(tables) > MAX_TABLES:
            raise ValueError(f"GEO: geo_table_choice='auto' chooses for at most {MAX_TABLES} "
                             f"tables; the model has {len(tables)}: name "
                             "geo_table_choice='rounds' for this job")
        self.tables = list(tables)
        self.is_chief = is_chief
        self.counters = counters
        self.recheck_seconds = (settings.get("TFPSX_GEO_RECHECK_SECONDS")
                                if recheck_seconds is None else recheck_seconds)
        self._clock = clock
        self._totals = [(0, 0)] * len(self.tables)  # trained (rows, hot) at the last round

    def actions(self) -> Tuple[str, ...]:
        """What each table does in the next round: PULL (rounds: push, pull), SKIP
        (async: the push of what its copy trained before, no pull; the PS keeps the
        changed keys), IDLE (async, pushed: nothing) or CATCH_UP (back to rounds: push,
        and a pull of everything changed since the table went async)."""
        return tuple(CATCH_UP if t.catching else
                     (IDLE if t.flushed else SKIP) if t.state == ASYNC else PULL
                     for t in self.tables)

    def all_async(self) -> bool:
        """Every table trains async (none catching up): no copy needs a round."""
        return all(t.state == ASYNC and not t.fixed for t in self.tables)

    def mask(self) -> int:
        """This worker's choice now: a bit per table trained async."""
        return sum(1 << i for i, t in enumerate(self.tables) if t.state == ASYNC)

    def observe(self, actions: Sequence[str], pushed: Sequence[int], pulled: Sequence[int],
                trained: Sequence[Tuple[int, int]]) -> List[int]:
        """One round ran ``actions``: per table the rows it pushed, the rows it pulled,
        and ``(rows, hot rows)`` the training steps held since the last round. Returns
        the tables whose catch-up completed (their lookups read their copy again)."""
        caught = []
        for i, (t, action, out, got, (rows, hot)) in enumerate(
                zip(self.tables, actions, pushed, pulled, trained)):
            if action == CATCH_UP:
                t.catching = False
                caught.append(i)
            t.flushed = action in (SKIP, IDLE) and t.state == ASYNC
            if action != PULL or t.skip > 0:
                t.skip -= action == PULL
                continue  # (a catch-up, the contention estimate's warm-up, async)
            t.geo_bytes += (out + got) * t.round_row_bytes + hot * t.async_row_bytes
            t.async_bytes += rows * t.async_row_bytes
            t.rounds += 1
        return caught

    def decide(self) -> Optional[int]:
        """The chief, after :meth:`observe`: the job's new choice (a bit per async table)
        when a table's window ended and its choice changes, or an async table's re-check
        is due; else None."""
        if not self.is_chief:
            return None
        mask, changed, now = self.mask(), False, self._clock()
        for i, t in enumerate(self.tables):
            if t.fixed:
                continue
            if t.state == ASYNC:
                if now - t.since >= self.recheck_seconds:
                    mask &= ~(1 << i)
                    changed = True
                    logger.info("GEO: table %r runs rounds again for %d rounds, to re-check "
                                "whether they pay now (it trained async for %.0f s; "
                                "TFPSX_GEO_RECHECK_SECONDS=%g)", t.name, FIRST_WINDOW,
                                now - t.since, self.recheck_seconds)
                continue
            if t.rounds < (WINDOW if t.checked else FIRST_WINDOW) or not t.async_bytes:
                continue
            ratio, rounds, told = t.geo_bytes / t.async_bytes, t.rounds, t.checked
            t.last_ratio, t.checked = ratio, True
            t.geo_bytes = t.async_bytes = 0.0
            t.rounds = 0
            if ratio > 1.0:
                mask |= 1 << i
                changed = True
            elif told:
                continue  # (still rounds: said once)
            logger.info(
                "GEO: table %r %s: its rounds moved %.2fx the bytes async would have for "
                "the same rows over its last %d rounds (geo_table_choice='auto'; the job's "
                "choice, every worker follows; docs/modes.md, When GEO pays)", t.name,
                "trains async from now" if ratio > 1.0 else "runs rounds", ratio, rounds)
        return mask if changed else None

    def after_round(self, actions: Sequence[str], pushed: Sequence[int],
                    pulled: Sequence[int], totals: Sequence[Tuple[int, int]],
                    write: Callable[[int], None],
                    read: Callable[[], Optional[int]]) -> Tuple[List[int], List[int]]:
        """A round ran ``actions`` (:meth:`actions`): the front-end gives what it moved
        per table and ``totals``, each table's ``(rows, hot rows)`` trained so far; the
        chief ``write`` s a new choice for the job (PS 0), every worker ``read`` s the
        job's (None: not set up yet) and adopts it. Returns (the tables whose lookups
        read the PS from now, those whose lookups read their copy again)."""
        trained = [(r - r0, h - h0) for (r, h), (r0, h0) in zip(totals, self._totals)]
        self._totals = list(totals)
        caught = self.observe(actions, pushed, pulled, trained)
        new = self.decide()
        if new is not None:
            write(new)
        mask = read()
        switched = self.adopt(mask) if mask is not None else []
        return [i for i, state in switched if state == ASYNC], caught

    def adopt(self, mask: int) -> List[Tuple[int, str]]:
        """The job's choice (read from PS 0): the tables whose state changes here, as
        ``(index, new state)``. A table going async reads the PS from now; one going back
        to rounds first catches up (its next round), then reads its copy."""
        switched = []
        for i, t in enumerate(self.tables):
            want = ASYNC if mask >> i & 1 and not t.fixed else ROUNDS
            if want == t.state:
                continue
            t.state, t.catching, t.flushed = want, want == ROUNDS, False
            t.since, t.skip, t.checked = self._clock(), 0, False
            t.geo_bytes = t.async_bytes = 0.0
            t.rounds = 0
            switched.append((i, want))
            if self.counters is not None:
                self.counters.add(table_switches=1,
                                  tables_async=1 if want == ASYNC else -1)
            if not self.is_chief:
                logger.info("GEO: table %r %s (the chief's choice, geo_table_choice='auto')",
                            t.name, "trains async" if want == ASYNC else "runs rounds again")
        return switched

"""GEO's choice between rounds and async, table by table (tfpsx.modes.geo.choice), driven
round by round with a job's counters: tables start async, the chief sends one to rounds
when its estimate (N x the distinct rows a worker trained) is under async's bytes, and
back to async when the rounds it measures cost more; every worker adopts the job's
choice read back from PS 0. The expected figures are worked out by hand from the
counters given (a row's round bytes and async trip bytes)."""

import logging

import pytest

from tfpsx.modes.geo.choice import (ASYNC, CATCH_UP, FIRST_WINDOW, IDLE, PULL, ROUNDS, SKIP,
                                    WINDOW, TableChoice, TableTraffic)
from tfpsx.modes.geo.round import GeoCounters

ROW, TRIP, N = 100, 50, 4  # a row's bytes in a round (one way), in async; workers


class Job:
    """A chief and a worker, each with its choice; PS 0's choice is ``self.mask``."""

    def __init__(self, recheck=300.0):
        self.now, self.mask, self.writes = 0.0, 0, []
        self.counters = [GeoCounters(), GeoCounters()]
        self.choices = [TableChoice([TableTraffic("reused", ROW, TRIP),
                                     TableTraffic("spread", ROW, TRIP),
                                     TableTraffic("cached", ROW, TRIP, fixed=True)],
                                    N, is_chief=w == 0, counters=self.counters[w],
                                    recheck_seconds=recheck, clock=lambda: self.now)
                        for w in range(2)]
        self.totals = [[(0, 0)] * 3 for _ in range(2)]

    def write(self, mask):
        self.mask = mask
        self.writes.append(mask)

    def round(self, w, pushed, pulled, distinct, trained):
        """Worker ``w`` runs a round: per table rows pushed, pulled, distinct rows trained
        and (rows, hot) trained."""
        choice = self.choices[w]
        actions = choice.actions()
        self.totals[w] = [(r + dr, h + dh) for (r, h), (dr, dh) in zip(self.totals[w], trained)]
        moved = [(p if a in (PULL, CATCH_UP) else 0) for p, a in zip(pulled, actions)]
        return actions, choice.after_round(actions, pushed, moved, distinct, self.totals[w],
                                           self.write, lambda: self.mask)


# A round of each table while async: 100 rows trained; "reused" saw 10 distinct rows
# (estimate 4 x 10 x 100 = 4,000 bytes against 5,000: 0.8x), "spread" 90 (7.2x).
ASYNC_ROUND = ([0, 0, 5], [0, 0, 5], [10.0, 90.0, 0.0], [(100, 0), (100, 0), (100, 0)])


def test_tables_start_async_and_the_chief_sends_the_one_whose_rows_repeat_to_rounds(caplog):
    job = Job()
    chief = job.choices[0]
    assert [t.state for t in chief.tables] == [ASYNC, ASYNC, ROUNDS]
    assert chief.actions() == (IDLE, IDLE, PULL)
    assert job.counters[0].tables_async == 2
    with caplog.at_level(logging.INFO, "tfpsx"):
        for r in range(1 + FIRST_WINDOW):  # the first round is left out
            actions, (to_ps, to_copy) = job.round(0, *ASYNC_ROUND)
            assert actions == (IDLE, IDLE, PULL)
            assert job.writes == ([] if r < FIRST_WINDOW else [0b001])
    said = caplog.text
    assert "table 'reused' tries rounds: they would move at most 0.80x" in said, said
    assert "table 'spread' trains async: rounds would move at most 7.20x" in said, said
    assert "cached" not in said  # a cached table always runs rounds
    # It catches up at its next round (the copy takes the PS's rows), then reads its
    # copy; the worker adopts the job's choice at its next round, whatever its counters.
    assert chief.tables[0].state == ROUNDS and chief.actions() == (CATCH_UP, IDLE, PULL)
    _, (to_ps, to_copy) = job.round(0, [0, 0, 0], [7, 0, 0], [0.0] * 3, [(0, 0)] * 3)
    assert to_copy == [0] and chief.actions() == (PULL, IDLE, PULL)
    actions, _ = job.round(1, [0, 0, 0], [0, 0, 0], [99.0] * 3, [(1, 0)] * 3)
    assert actions == (IDLE, IDLE, PULL) and job.choices[1].actions()[0] == CATCH_UP
    for counters in job.counters:
        assert (counters.tables_async, counters.table_switches) == (1, 1)


def test_rounds_that_cost_more_than_async_send_the_table_back_until_the_recheck(caplog):
    job = Job(recheck=60.0)
    chief = job.choices[0]
    for _ in range(1 + FIRST_WINDOW):
        job.round(0, *ASYNC_ROUND)
    job.round(0, [0, 0, 0], [0, 0, 0], [0.0] * 3, [(0, 0)] * 3)  # (the catch-up)
    # Measured: 30 + 30 rows a round (6,000 bytes) + 10 hot rows (500) for 100 trained
    # (5,000): 1.3x. The round after the catch-up is left out of the window.
    costly = ([30, 0, 0], [30, 0, 0], [0.0] * 3, [(100, 10), (0, 0), (0, 0)])
    with caplog.at_level(logging.INFO, "tfpsx"):
        for _ in range(1 + FIRST_WINDOW):
            actions, (to_ps, _) = job.round(0, *costly)
            assert actions[0] == PULL
    assert job.mask == 0 and to_ps == [0] and chief.tables[0].last_ratio == pytest.approx(1.3)
    assert "table 'reused' trains async from now: its rounds moved 1.30x" in caplog.text
    # Back to async: a round pushes what its copy trained, then rounds move nothing.
    assert chief.actions()[0] == SKIP
    job.round(0, *ASYNC_ROUND)
    assert chief.actions()[0] == IDLE
    # The estimate says rounds would pay, but not before TFPSX_GEO_RECHECK_SECONDS.
    for _ in range(WINDOW):
        job.round(0, *ASYNC_ROUND)
    assert job.mask == 0
    job.now = 61.0
    for _ in range(WINDOW):
        job.round(0, *ASYNC_ROUND)
        if job.mask:
            break
    assert job.mask == 0b001 and chief.actions()[0] == CATCH_UP
    assert (job.counters[0].tables_async, job.counters[0].table_switches) == (1, 3)


def test_a_catch_up_in_the_round_whose_choice_ends_the_trial_leaves_the_table_on_the_ps():
    """A worker reads the chief's trial late: its catch-up completes in the round that
    reads the trial's end. The table goes back to async there, so its lookups must stay
    on the PS (before: listed both to the PS and to its copy, the flag ended on the
    copy while the table counted as async, and its copy's steps were never pushed)."""
    job = Job()
    worker = job.choices[1]
    job.mask = 0b001  # the chief's trial of "reused"
    actions, (to_ps, to_copy) = job.round(1, *ASYNC_ROUND)
    assert (to_ps, to_copy) == ([], []) and worker.actions()[0] == CATCH_UP
    job.mask = 0  # the trial ended before this worker's next round
    actions, (to_ps, to_copy) = job.round(1, [0, 0, 0], [7, 0, 0], [0.0] * 3, [(0, 0)] * 3)
    assert actions[0] == CATCH_UP
    assert to_ps == [0] and to_copy == [], (to_ps, to_copy)
    assert worker.tables[0].state == ASYNC and worker.actions()[0] == SKIP


def test_no_choice_before_the_chief_sets_it_up_and_too_many_tables_are_refused():
    job = Job()
    worker = job.choices[1]
    actions = worker.actions()
    assert worker.after_round(actions, [1, 1, 1], [1, 1, 1], [1.0] * 3, [(5, 0)] * 3,
                              job.write, lambda: None) == ([], [])
    assert job.writes == []  # (a worker never writes)
    with pytest.raises(ValueError, match="at most 63 tables; the model has 64: name "
                                         "geo_table_choice='rounds'"):
        TableChoice([TableTraffic(f"t{i}", ROW, TRIP) for i in range(64)], N, is_chief=True)

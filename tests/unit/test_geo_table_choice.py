"""GEO's choice between rounds and async, table by table (tfpsx.modes.geo.choice), driven
round by round with a job's counters: the chief decides from its traffic against async's,
every worker adopts the job's choice read back, and an async table runs rounds again for
a window when its re-check is due. The expected figures are worked out by hand from the
counters given (a row's round bytes and async trip bytes)."""

import logging

import pytest

from tfpsx.modes.geo.choice import (ASYNC, CATCH_UP, FIRST_WINDOW, PULL, ROUNDS, SKIP, WINDOW,
                                    TableChoice, TableTraffic)
from tfpsx.modes.geo.round import GeoCounters

ROW, TRIP = 100, 50  # a row's bytes in a round (one way), and in async (read + gradient)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class Job:
    """A chief and a worker, each with its choice; PS 0's choice is ``self.mask``."""

    def __init__(self, recheck=300.0):
        self.clock, self.mask, self.writes = Clock(), 0, []
        self.counters = [GeoCounters(), GeoCounters()]
        self.choices = [TableChoice([TableTraffic("cheap", ROW, TRIP),
                                     TableTraffic("costly", ROW, TRIP),
                                     TableTraffic("cached", ROW, TRIP, fixed=True)],
                                    is_chief=w == 0, counters=self.counters[w],
                                    recheck_seconds=recheck, clock=self.clock)
                        for w in range(2)]
        self.totals = [[(0, 0)] * 3 for _ in range(2)]

    def write(self, mask):
        self.mask = mask
        self.writes.append(mask)

    def round(self, w, pushed, pulled, trained):
        """Worker ``w`` runs a round: per table rows pushed, pulled, (rows, hot) trained."""
        choice = self.choices[w]
        actions = choice.actions()
        self.totals[w] = [(r + dr, h + dh) for (r, h), (dr, dh) in zip(self.totals[w], trained)]
        moved = [(p if a != SKIP else 0) for p, a in zip(pulled, actions)]
        return actions, choice.after_round(actions, pushed, moved, self.totals[w], self.write,
                                           lambda: self.mask)


def test_the_chief_sends_the_table_whose_rounds_cost_more_to_async_and_every_worker_follows(
        caplog):
    job = Job()
    # cheap: 10 + 10 rows a round (2,000 bytes) for 100 trained rows (5,000 async bytes);
    # costly: 60 + 60 rows (12,000 bytes) + 10 hot rows (500) for 100 (5,000): 2.5x.
    per_round = ([10, 60, 5], [10, 60, 5], [(100, 0), (100, 10), (100, 0)])
    with caplog.at_level(logging.INFO, "tfpsx"):
        for r in range(1 + FIRST_WINDOW):  # the first round is left out
            actions, (to_ps, to_copy) = job.round(0, *per_round)
            assert actions == (PULL, PULL, PULL)
            assert job.writes == ([] if r < FIRST_WINDOW else [0b010])
        assert to_ps == [1] and to_copy == []  # the chief read its own choice back
    said = caplog.text
    assert "table 'costly' trains async from now: its rounds moved 2.50x" in said, said
    assert "table 'cheap' runs rounds: its rounds moved 0.40x" in said, said
    assert "cached" not in said  # a cached table always runs rounds
    chief = job.choices[0]
    assert [t.state for t in chief.tables] == [ROUNDS, ASYNC, ROUNDS]
    assert chief.actions() == (PULL, SKIP, PULL)
    assert chief.tables[1].last_ratio == pytest.approx(2.5)
    # The worker adopts the job's choice at its next round, whatever its own counters.
    actions, (to_ps, to_copy) = job.round(1, [0, 0, 0], [0, 0, 0], [(0, 0)] * 3)
    assert actions == (PULL, PULL, PULL) and to_ps == [1]
    assert job.choices[1].actions() == (PULL, SKIP, PULL)
    for counters in job.counters:
        assert (counters.tables_async, counters.table_switches) == (1, 1)
    # A table in rounds is checked again every WINDOW rounds; still cheap: nothing said.
    writes = len(job.writes)
    for _ in range(WINDOW):
        job.round(0, *per_round)
    assert len(job.writes) == writes and chief.tables[0].last_ratio == pytest.approx(0.4)


def test_an_async_table_is_rechecked_and_goes_back_to_rounds_when_they_pay(caplog):
    job = Job(recheck=60.0)
    costly = ([0, 60, 0], [0, 60, 0], [(0, 0), (100, 10), (0, 0)])
    for _ in range(1 + FIRST_WINDOW):
        job.round(0, *costly)
    assert job.mask == 0b010
    # While async the table pulls nothing and no window is measured; before the re-check
    # is due nothing changes.
    job.clock.now = 59.0
    actions, _ = job.round(0, [0, 0, 0], [0, 999, 0], [(0, 0), (100, 100), (0, 0)])
    assert actions[1] == SKIP and job.mask == 0b010
    with caplog.at_level(logging.INFO, "tfpsx"):
        job.clock.now = 61.0
        job.round(0, [0, 0, 0], [0, 0, 0], [(0, 0), (100, 100), (0, 0)])
    assert job.mask == 0 and "table 'costly' runs rounds again for" in caplog.text
    chief = job.choices[0]
    # Back to rounds: the next round catches up (its pull left out), lookups read the
    # copy once it ran; then a window of rounds that now pay keeps it in rounds.
    assert chief.actions()[1] == CATCH_UP and chief.tables[1].state == ROUNDS
    _, (to_ps, to_copy) = job.round(0, [0, 5, 0], [0, 5000, 0], [(0, 0), (100, 0), (0, 0)])
    assert to_copy == [1] and chief.actions()[1] == PULL
    for _ in range(FIRST_WINDOW):
        job.round(0, [0, 10, 0], [0, 10, 0], [(0, 0), (100, 0), (0, 0)])
    assert job.mask == 0 and chief.tables[1].last_ratio == pytest.approx(0.4)
    assert (job.counters[0].tables_async, job.counters[0].table_switches) == (0, 2)


def test_no_choice_before_the_chief_sets_it_up_and_too_many_tables_are_refused():
    job = Job()
    worker = job.choices[1]
    actions = worker.actions()
    assert worker.after_round(actions, [1, 1, 1], [1, 1, 1], [(5, 0)] * 3, job.write,
                              lambda: None) == ([], [])
    assert job.writes == []  # (a worker never writes)
    with pytest.raises(ValueError, match="at most 63 tables; the model has 64: name "
                                         "geo_table_choice='rounds'"):
        TableChoice([TableTraffic(f"t{i}", ROW, TRIP) for i in range(64)], is_chief=True)

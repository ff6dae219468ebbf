"""The modes' protocols (tfpsx.modes) in one process, no cluster: GEO's round and schedule
driven by a recording executor, the staleness wait over a clock vector."""

import threading
import time

import numpy as np
import pytest

from tfpsx import errors
from tfpsx.testing import wait_until
from tfpsx.modes import BARRIER, DONE, PULL, PUSH, GeoSchedule, round_phases, wait_for_slowest
from tfpsx.modes.geo import MIN_ROUNDS_PER_EPOCH


def test_a_round_is_push_then_pull_and_deterministic_rounds_meet_between():
    assert round_phases(deterministic=False, cached=False) == (PUSH, PULL)
    assert round_phases(deterministic=False, cached=True) == (PUSH, PULL)
    assert round_phases(deterministic=True, cached=False) == (PUSH, BARRIER, PULL, BARRIER)
    # A worker cache reads the PS on a miss: they also meet before anyone pushes.
    assert round_phases(deterministic=True, cached=True) == \
        (BARRIER, PUSH, BARRIER, PULL, BARRIER)


class Recorder:
    """The executor: records each round's phases, with the steps the schedule counted."""

    def __init__(self, cached=False):
        self.rounds, self.barriers, self.cached = [], 0, cached
        self.schedule = None
        self.block = threading.Event()
        self.fail = None

    def run_round(self, phases):
        if self.fail:
            raise self.fail
        self.entered = True
        if self.slow:
            self.block.wait(10)
        self.rounds.append((self.schedule.pushed, phases))

    slow = False
    entered = False  # a round started

    def barrier(self):
        self.barriers += 1

    def make(self, k, deterministic, **kwargs):
        self.schedule = GeoSchedule(k, deterministic, self.run_round,
                                    cached=lambda: self.cached, barrier=self.barrier, **kwargs)
        return self.schedule


def test_deterministic_rounds_run_every_k_steps_then_a_final_round_without_barriers():
    rec = Recorder()
    s = rec.make(3, deterministic=True)
    s.start(0)
    assert rec.barriers == 1  # nobody trains before every worker copied the global model
    for step in range(1, 11):
        s.step_done(step)
        s.step_done(step)  # an eval run between steps: no step, no round
    assert s.end(10)
    det = (PUSH, BARRIER, PULL, BARRIER)
    assert rec.rounds == [(3, det), (6, det), (9, det), (10, (PUSH, PULL))]


def test_no_final_round_when_every_step_was_pushed():
    rec = Recorder()
    s = rec.make(5, deterministic=True)
    s.start(0)
    for step in range(1, 11):
        s.step_done(step)
    assert s.end(10)
    assert [pushed for pushed, _ in rec.rounds] == [5, 10]


def test_a_front_end_that_rounds_in_its_step_reports_them_and_gets_the_final_round():
    rec = Recorder(cached=True)
    s = rec.make(4, deterministic=True, rounds_in_step=True)
    s.start(0)
    in_step = []
    for step in range(1, 10):
        s.step_done(step)
        if s.due(step, s.pushed):  # what the front-end's step decides by
            assert s.phases() == (BARRIER, PUSH, BARRIER, PULL, BARRIER)
            s.ran_in_step(step)
            in_step.append(step)
    assert in_step == [4, 8] and rec.rounds == []  # the step ran them
    s.end(9)
    assert rec.rounds == [(9, (PUSH, PULL))]


def test_a_k_that_leaves_too_few_rounds_per_epoch_is_warned_of_once(caplog):
    rec = Recorder()
    s = rec.make(100, deterministic=True)
    assert MIN_ROUNDS_PER_EPOCH == 8
    with caplog.at_level("WARNING", logger="tfpsx"):
        assert s.check_epoch(None) is None  # unknown length: nothing said
        assert s.check_epoch(800) is None  # 8 rounds
        warning = s.check_epoch(250)
        assert s.check_epoch(250) == warning
    assert warning == ("GEO: k_steps=100 leaves 2 round(s) in an epoch of 250 local steps on "
                       "this worker; with fewer than 8 rounds per epoch GEO loses model "
                       "quality against async (docs/modes.md, 'GEO at N workers'): "
                       "k_steps <= 31 keeps 8")
    assert [r.getMessage() for r in caplog.records] == [warning]  # once


def test_k_steps_auto_takes_eight_rounds_of_the_first_fits_epoch_and_keeps_it(caplog):
    from tfpsx.modes.geo import auto_k_steps
    # 8 rounds an epoch and K x N <= 40 in deterministic rounds, <= 20 in background ones;
    # no epoch length: 10 within the same bound
    cases = [(32, 2), (250, 1), (250, 8), (5, 2), (100_000, 1), (None, 2), (None, 8),
             (10_000, 64)]
    assert [auto_k_steps(e, n, deterministic=True) for e, n in cases] == \
        [4, 31, 5, 1, 40, 10, 5, 1]
    assert [auto_k_steps(e, n, deterministic=False) for e, n in cases] == \
        [4, 20, 2, 1, 20, 10, 2, 1]
    rec = Recorder()
    s = rec.make(10, deterministic=True, auto_workers=1)
    with caplog.at_level("INFO", logger="tfpsx"):
        s.fit_length(250)
        s.fit_length(40)  # a later fit: K stays (a compiled step holds it); 1 round: warned
    assert s.k_steps == 31 and s.lag == 31
    assert "GEO: k_steps='auto' is 31 (8 rounds in an epoch of 250 local steps; K x 1 " \
           "workers at most 40 in deterministic rounds)" in caplog.text
    assert "k_steps=31 leaves 1 round(s) in an epoch of 40" in caplog.text
    s.start(0)
    for step in range(1, 63):
        s.step_done(step)
    assert [pushed for pushed, _ in rec.rounds] == [31, 62]
    fixed = Recorder().make(10, deterministic=True)
    fixed.fit_length(250)
    assert fixed.k_steps == 10  # a given K is kept


@pytest.mark.parametrize("in_step", [False, True])
def test_a_second_training_after_one_that_ended_off_k_rounds_k_steps_on(in_step):
    """One schedule for both front-ends: after a final round at a step that is no
    multiple of K, the next round comes K steps after it (not at the next multiple)."""
    rec = Recorder()
    s = rec.make(5, deterministic=True, rounds_in_step=in_step)
    rounds = []
    for start, stop in [(0, 8), (8, 16)]:
        s.start(start)
        for step in range(start + 1, stop + 1):
            s.step_done(step)
            if in_step and s.due(step, s.pushed):
                s.ran_in_step(step)
                rounds.append(step)
        s.end(stop)
    rounds += [pushed for pushed, _ in rec.rounds]
    assert sorted(rounds) == [5, 8, 13, 16]


def test_the_background_communicator_is_woken_once_k_steps_are_unpushed():
    rec = Recorder()
    traced = []
    s = rec.make(10, deterministic=False, first_round=lambda: traced.append(True))
    s.start(0)
    assert s.running and rec.barriers == 0
    wait_until(lambda: traced)  # its first wake-up traces, it does not sync
    for step in range(1, 10):
        s.step_done(step)
    time.sleep(0.05)
    assert rec.rounds == []
    s.step_done(10)
    wait_until(lambda: rec.rounds)
    assert rec.rounds == [(10, (PUSH, PULL))]
    s.step_done(13)
    assert s.end(13) and not s.running
    assert rec.rounds[-1] == (13, (PUSH, PULL))  # the final round


def test_while_every_table_trains_async_rounds_run_k_steps_and_a_gap_in_seconds_apart(
        monkeypatch):
    """geo_table_choice="auto" with every table async (quiet): a round moves nothing, so
    the next starts once K steps ran and TFPSX_GEO_QUIET_ROUND_SECONDS passed since the
    last one started; once a table runs rounds, every K steps again."""
    monkeypatch.setenv("TFPSX_GEO_QUIET_ROUND_SECONDS", "2")
    now, quiet = [100.0], [True]
    rec = Recorder()
    s = rec.make(2, deterministic=False, quiet=lambda: quiet[0], clock=lambda: now[0])
    s.start(0)
    s.step_done(1)
    assert not s.may_round(1)  # (K steps first)
    s.step_done(2)  # the first round: none ran before
    wait_until(lambda: len(rec.rounds) == 1)
    assert rec.rounds == [(2, (PUSH, PULL))]
    for step in range(3, 9):  # 6 steps, 1.5 s: no round
        now[0] += 0.25
        s.step_done(step)
    time.sleep(0.05)
    assert len(rec.rounds) == 1 and not s.may_round(8)
    now[0] += 0.5  # 2 s since the last round started
    assert s.may_round(9)
    # Keras asked before reading its exact count, and was told no: a later clock does
    # not ask for a round with the estimate it did not refresh.
    s.step_done(9, may_round=False)
    time.sleep(0.05)
    assert len(rec.rounds) == 1
    s.step_done(9, may_round=True)
    wait_until(lambda: len(rec.rounds) == 2)
    assert rec.rounds[-1] == (9, (PUSH, PULL))
    quiet[0] = False  # a table tries rounds: every K steps, whatever the clock says
    s.step_done(10)
    s.step_done(11)
    wait_until(lambda: len(rec.rounds) == 3)
    assert rec.rounds[-1] == (11, (PUSH, PULL))
    assert s.end(11) and len(rec.rounds) == 3


def test_a_quiet_round_not_started_yet_does_not_hold_the_next_step(monkeypatch):
    """A quiet round is asked for long after the last one (0.5 s of steps): the next
    step does not wait for it as for a round asked for K steps ago that never started
    (before: counted from the last round's start, and the worker stalled until it ran)."""
    from tfpsx.background import BackgroundLoop
    from tfpsx.modes.geo import schedule as schedule_module

    class Held(BackgroundLoop):
        def start(self):  # the communicator's thread does not run until the test says
            return self

    monkeypatch.setattr(schedule_module, "BackgroundLoop", Held)
    monkeypatch.setenv("TFPSX_RPC_TIMEOUT", "1")
    monkeypatch.setenv("TFPSX_GEO_QUIET_ROUND_SECONDS", "2")
    now = [0.0]
    rec = Recorder()
    s = rec.make(2, deterministic=False, quiet=lambda: True, clock=lambda: now[0])
    s.start(0)
    s.step_done(2)  # the first round: asked for, its thread held
    BackgroundLoop.start(s._loop)
    wait_until(lambda: len(rec.rounds) == 1)
    s._loop._stop.set()  # (no more rounds run: asked for, never started)
    for step in range(3, 23):  # 0.1 s a step: the gap has passed at step 22
        now[0] += 0.1
        s.step_done(step)
    assert s._requested
    started = time.monotonic()
    s.step_done(23)  # 21 steps past the last round, 1 past the one asked for: no wait
    assert time.monotonic() - started < 0.5
    with pytest.raises(errors.ClusterTimeoutError, match="asked for at local step 22 "
                                                         "had not ended at local step 24"):
        s.step_done(24)  # K steps after it was asked for: this worker waits for it


def test_no_background_round_starts_without_k_steps_left_after_its_pull():
    """Keras fit knows the steps it has left: a background round starts only with K
    steps left beyond the round's own length (the steps trained while the last one ran;
    K before any), else the final round pushes them; without the count, every K steps."""
    def schedule(rec, k):
        traced = []
        s = rec.make(k, deterministic=False, first_round=lambda: traced.append(True))
        s.start(0)
        wait_until(lambda: traced)
        return s

    rec = Recorder()
    s = schedule(rec, 10)
    for step in range(1, 26):  # 15 left at step 10: fewer than K + K
        s.step_done(step, steps_left=25 - step)
    time.sleep(0.05)
    assert s.end(25) and [pushed for pushed, _ in rec.rounds] == [25]

    rec = Recorder()
    rec.slow = True  # each round runs until the test lets it end

    def blocked_round(step, left):
        rec.block, rec.entered = threading.Event(), False
        s.step_done(step, steps_left=left)
        wait_until(lambda: rec.entered)

    s = schedule(rec, 10)
    for step in range(1, 10):
        s.step_done(step, steps_left=40 - step)
    blocked_round(10, 30)  # 30 left: K + K
    for step in range(11, 15):  # trained while it runs
        s.step_done(step, steps_left=40 - step)
    rec.block.set()
    wait_until(lambda: s.lag == 4)
    for step in range(15, 20):
        s.step_done(step, steps_left=40 - step)
    blocked_round(20, 20)  # 20 left: K + 4
    for step in range(21, 26):
        s.step_done(step, steps_left=40 - step)
    rec.block.set()
    wait_until(lambda: s.lag == 5)
    for step in range(26, 41):  # at 30, 10 left: fewer than K + 5
        s.step_done(step, steps_left=40 - step)
    time.sleep(0.05)
    assert s.end(40) and [pushed for pushed, _ in rec.rounds] == [10, 20, 40]

    # A round asked for while the communicator is busy is checked again when it would
    # start: here its first wake-up (Keras's tracing) runs long.
    rec = Recorder()
    tracing = threading.Event()
    s = rec.make(10, deterministic=False, first_round=lambda: tracing.wait(10))
    s.start(0)
    for step in range(1, 11):
        s.step_done(step, steps_left=100)  # asks for a round at 10 (the loop is busy)
    s.step_done(18, steps_left=2)  # when that round can start, 2 are left
    tracing.set()
    time.sleep(0.1)
    assert s.end(20) and [pushed for pushed, _ in rec.rounds] == [20]

    rec = Recorder()
    s = schedule(rec, 10)
    for step in range(1, 46):  # the steps left unknown: every K steps
        s.step_done(step)
        if step % 10 == 0:
            wait_until(lambda: len(rec.rounds) == step // 10)
    assert s.end(45)
    assert [pushed for pushed, _ in rec.rounds] == [10, 20, 30, 40, 45]


def test_a_round_longer_than_k_steps_holds_the_step_that_is_due_next_until_it_ends(caplog):
    """Rounds stay K steps apart: a worker trains at most K steps beside a round in
    flight (its pull lands within K steps), then waits for it, says so once and counts it."""
    from tfpsx.modes.geo import GeoCounters
    rec = Recorder()
    rec.slow = True
    counters = GeoCounters()
    s = rec.make(5, deterministic=False, counters=counters)
    s.start(0)
    for step in range(1, 6):
        s.step_done(step)
    wait_until(lambda: rec.entered)  # the round of step 5 runs until the test ends it
    for step in range(6, 10):  # fewer than K steps beside it: no wait
        s.step_done(step)
    assert counters.round_waits == 0
    threading.Timer(0.3, rec.block.set).start()
    began = time.monotonic()
    with caplog.at_level("INFO", logger="tfpsx"):
        s.step_done(10)  # K steps beside it: waits until it ends, then asks for the next
    assert time.monotonic() - began >= 0.2 and rec.rounds[0][0] == 5
    assert counters.round_waits == 1 and counters.round_wait_seconds >= 0.2
    assert "GEO: the round started at local step 5 still ran 5 steps later (k_steps=5): " \
           "this worker waits for a round in flight" in caplog.text
    wait_until(lambda: len(rec.rounds) == 2)
    for step in range(11, 15):
        s.step_done(step)
    assert s.end(14) and [pushed for pushed, _ in rec.rounds] == [5, 10, 14]


def _stuck_round(monkeypatch, k):
    """A background schedule of K=k whose round of step k runs until the test ends it
    (rec.block), under TFPSX_RPC_TIMEOUT=0.3 s."""
    monkeypatch.setenv("TFPSX_RPC_TIMEOUT", "0.3")
    rec = Recorder()
    rec.slow = True
    s = rec.make(k, deterministic=False)
    s.start(0)
    s.step_done(k)
    wait_until(lambda: rec.entered)
    return rec, s


def test_a_round_stuck_beside_k_steps_fails_the_step_within_the_rpc_timeout(monkeypatch):
    rec, s = _stuck_round(monkeypatch, 2)
    s.step_done(3)
    began = time.monotonic()
    with pytest.raises(errors.ClusterTimeoutError,
                       match=r"the round started at local step 2 still ran at local step 4 "
                             r"after TFPSX_RPC_TIMEOUT=0.3 s"):
        s.step_done(4)
    assert time.monotonic() - began < 3
    rec.block.set()
    assert s.end(4)


def test_a_failed_communicator_fails_the_next_step_and_sends_nothing_more():
    rec = Recorder()
    s = rec.make(2, deterministic=False)
    s.start(0)
    rec.fail = errors.ServerUnavailableError("server 0 is gone")
    s.step_done(2)
    wait_until(lambda: s._loop.error is not None)
    with pytest.raises(errors.BackgroundTaskError, match="GEO communicator failed: server 0"):
        s.step_done(3)
    rec.fail = None
    assert s.end(5, raise_failure=False) is False
    assert rec.rounds == []


def test_a_round_failing_while_training_ends_fails_the_end_and_sends_nothing_more(caplog):
    """The round in flight when training ends fails (a server went away): its pushes are
    lost, so the end raises it (graph mode's raise_failure=False too: no step saw it),
    logs it, and sends no final round as if nothing failed."""
    entered, release = threading.Event(), threading.Event()
    rounds = []

    def run_round(phases):
        entered.set()
        release.wait(10)
        raise errors.ServerUnavailableError("server 0 is gone")

    s = GeoSchedule(2, False, run_round, cached=lambda: False, barrier=lambda: None)
    s.start(0)
    s.step_done(1)
    s.step_done(2)
    assert entered.wait(5)
    s.step_done(3)  # the round still runs: nothing raised yet
    threading.Timer(0.2, release.set).start()
    with caplog.at_level("ERROR", logger="tfpsx"):
        with pytest.raises(errors.BackgroundTaskError,
                           match="GEO communicator failed: server 0 is gone"):
            s.end(3, raise_failure=False)
    assert "GEO communicator failed while stopping: server 0 is gone" in caplog.text
    assert rounds == []


def test_a_round_asked_for_before_the_communicator_first_runs_is_not_lost(monkeypatch):
    """Keras's first wake (the copy's first round) and the round asked for at K steps
    merge when the communicator's thread has not run yet: the round still runs, and the
    worker trains on past 2K steps."""
    from tfpsx.background import BackgroundLoop
    from tfpsx.modes.geo import schedule as schedule_module

    class Held(BackgroundLoop):
        def start(self):  # the thread starts when the test says
            return self

    monkeypatch.setattr(schedule_module, "BackgroundLoop", Held)
    monkeypatch.setenv("TFPSX_RPC_TIMEOUT", "2")
    rec, firsts = Recorder(), []
    s = rec.make(2, deterministic=False, first_round=lambda: firsts.append(1))
    s.start(0)
    s.step_done(1)
    s.step_done(2)  # asks for a round: its wake merges with the first's
    BackgroundLoop.start(s._loop)
    wait_until(lambda: rec.rounds == [(2, (PUSH, PULL))])
    assert firsts == [1]
    for step in (3, 4, 5):
        s.step_done(step)
    assert s.end(5) and [pushed for pushed, _ in rec.rounds][-1] == 5


def test_k_steps_auto_is_the_jobs_k_whatever_a_workers_epoch_gives(caplog):
    """k_steps="auto" in Keras: each worker's epoch would give its own K (a joiner's is
    shorter); the chief's is the job's (on PS 0 there: a dict here) and every worker
    takes it."""
    job = {}

    def job_k(own):
        return job.setdefault("k", own)  # the chief writes first; the others read

    chief, joiner = Recorder(), Recorder()
    c = chief.make("auto", False, auto_workers=2)
    j = joiner.make("auto", False, auto_workers=2)
    with caplog.at_level("INFO", logger="tfpsx"):
        c.fit_length(400, job_k=job_k)   # 400 // 8 = 50, within 20 // 2 = 10: 10
        j.fit_length(24, job_k=job_k)    # alone: 24 // 8 = 3
    assert c.k_steps == j.k_steps == 10
    assert "the job's K, chosen by the chief (this worker's epoch would give 3)" in caplog.text


def test_a_session_created_again_restarts_the_communicator_without_the_old_failure():
    """TF's MonitoredSession closed the session under a round (after an error) and made
    a new one: that round's failure was the closed session's; the next rounds run."""
    rec = Recorder()
    s = rec.make(2, deterministic=False)
    s.start(0)
    rec.fail = RuntimeError("Attempted to use a closed Session.")
    s.step_done(2)
    wait_until(lambda: s._loop.error is not None)
    rec.fail = None
    s.restart(3)
    s.step_done(4)
    s.step_done(5)
    wait_until(lambda: rec.rounds)
    assert s.end(6) and [pushed for pushed, _ in rec.rounds] == [5, 6]


def test_a_stuck_round_ends_training_within_the_rpc_timeout(monkeypatch):
    rec, s = _stuck_round(monkeypatch, 1)
    start = time.monotonic()
    with pytest.raises(errors.ClusterTimeoutError, match="TFPSX_RPC_TIMEOUT=0.3 s"):
        s.end(2)
    assert time.monotonic() - start < 3
    rec.block.set()


def test_staleness_waits_for_the_slowest_and_names_it_when_the_bound_runs_out():
    assert wait_for_slowest(np.array([5, 4, 3]), None, 0, 2, 1.0) is False
    reads = iter([np.array([6, 4, 5]), np.array([6, 5, 5])])
    assert wait_for_slowest(np.array([6, 3, 5]), lambda: next(reads), 0, 1, 5.0) is True
    # A finished worker's clock (DONE) is never the slowest.
    assert wait_for_slowest(np.array([9, DONE, 8]), None, 0, 1, 1.0) is False
    with pytest.raises(errors.ClusterTimeoutError,
                       match=r"worker 0 at step 9 waited 0.1 s .* worker\(s\) \[2\] at step 3"):
        wait_for_slowest(np.array([9, 8, 3]), lambda: np.array([9, 8, 3]), 0, 2, 0.1)


def test_a_round_asked_for_but_not_started_holds_the_worker_k_steps_on(caplog):
    """The communicator's thread may not run for a while on a loaded machine (here it is
    busy with its first wake-up): the round asked for at step K then has not started when
    K more steps have run. The worker waits for it there, as for a round in flight, so
    a round never pushes more than ~2K steps from one stale snapshot."""
    from tfpsx.modes.geo import GeoCounters
    rec = Recorder()
    busy, entered = threading.Event(), threading.Event()

    def first_wake():
        entered.set()
        busy.wait(10)

    counters = GeoCounters()
    s = rec.make(5, deterministic=False, first_round=first_wake, counters=counters)
    s.start(0)
    wait_until(entered.is_set)
    for step in range(1, 10):  # the round asked for at 5 cannot start
        s.step_done(step)
    assert rec.rounds == [] and counters.round_waits == 0
    threading.Timer(0.3, busy.set).start()
    began = time.monotonic()
    with caplog.at_level("INFO", logger="tfpsx"):
        s.step_done(10)  # 2K steps since the last round: waits until that round ended
    assert time.monotonic() - began >= 0.2
    assert rec.rounds == [(10, (PUSH, PULL))] and counters.round_waits == 1
    assert "GEO: the round asked for at local step 5 had not ended 10 steps later" \
        in caplog.text
    for step in range(11, 15):
        s.step_done(step)
    assert s.end(14) and [pushed for pushed, _ in rec.rounds] == [10, 14]


def test_an_exact_saves_barrier_settles_the_round_in_flight_then_pushes_the_rest():
    """At an exact save's barrier (tfpsx.data.splits(exact_saves=True)) a worker's
    background round in flight ends first, then its steps since that round's start go in
    a round of their own: every step it trained is pushed (its positions committed by the
    round) before it acks; with every step pushed, nothing runs; deterministic rounds,
    which meet every worker inside a step, cannot settle (refused with exact saves)."""
    rec = Recorder()
    rec.slow = True
    s = rec.make(4, deterministic=False)
    s.start(0)
    for step in range(1, 5):
        s.step_done(step)  # the round of steps 1-4, held in flight
    wait_until(lambda: rec.entered)
    s.step_done(5)
    s.step_done(6)
    threading.Timer(0.2, rec.block.set).start()
    began = time.monotonic()
    assert s.settle(6) == 2  # waited for the round in flight, then pushed steps 5-6
    assert time.monotonic() - began >= 0.15
    assert rec.rounds == [(4, (PUSH, PULL)), (6, (PUSH, PULL))]
    assert s.settle(6) == 0 and len(rec.rounds) == 2  # all pushed: no round
    s.step_done(7)  # the next round comes K steps after the settled one
    assert not s._requested
    assert s.end(7) and rec.rounds[-1] == (7, (PUSH, PULL))
    with pytest.raises(ValueError, match="geo_sync_in_train_thread=True"):
        Recorder().make(4, deterministic=True).settle(3)

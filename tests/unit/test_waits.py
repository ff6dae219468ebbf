"""tfpsx.waits.bounded_wait: the one bounded wait (a condition polled until it holds, or
the error that names what was waited for)."""

import time

import pytest

from tfpsx import errors
from tfpsx.waits import bounded_wait, wait_for


def test_a_condition_that_holds_returns_at_once_and_one_that_comes_returns_the_wait():
    assert bounded_wait(lambda: True, 1.0, lambda w: AssertionError()) < 0.01
    ready_at = time.monotonic() + 0.2
    waited = bounded_wait(lambda: time.monotonic() >= ready_at, 5.0,
                          lambda w: AssertionError("not reached"), poll=0.01)
    assert 0.15 <= waited < 2.0


def test_past_the_bound_the_error_names_what_and_how_long():
    began = time.monotonic()
    with pytest.raises(errors.ClusterTimeoutError, match=r"waited 0\.\d s for worker 3"):
        bounded_wait(lambda: False, 0.3, lambda w: errors.ClusterTimeoutError(
            f"waited {w:.1f} s for worker 3"), poll=0.05)
    assert 0.3 <= time.monotonic() - began < 2.0


def test_a_check_that_raises_ends_the_wait_with_its_error():
    calls = []

    def check():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the background task failed")

    with pytest.raises(RuntimeError, match="the background task failed"):
        bounded_wait(lambda: False, 10.0, lambda w: AssertionError("timed out"), poll=0.01,
                     check=check)


def test_wait_for_returns_the_value_that_is_done_and_names_the_last_one_read():
    values = iter([[0, 0], [3, 0], [3, 5]])
    assert wait_for(lambda left: next(values), all, 5.0,
                    lambda v, w: AssertionError(v), poll=0.001) == [3, 5]
    # a value already read is tested first: no read when it is done
    assert wait_for(lambda left: pytest.fail("read"), all, 5.0,
                    lambda v, w: AssertionError(v), first=[1]) == [1]
    reads = iter(range(1000))
    with pytest.raises(errors.ClusterTimeoutError, match=r"workers \[1\] missing, last read \d+"):
        wait_for(lambda left: next(reads), lambda v: False, 0.2,
                 lambda v, w: errors.ClusterTimeoutError(f"workers [1] missing, last read {v}"),
                 poll=0.01)


def test_wait_for_gives_a_long_poll_the_time_left_and_reports_while_it_waits():
    lefts, reports = [], []

    def read(left):
        lefts.append(left)
        time.sleep(min(left, 0.3))  # a long poll blocks at most what is left
        return len(lefts)

    with pytest.raises(TimeoutError):
        wait_for(read, lambda v: False, 1.5, lambda v, w: TimeoutError(v), poll=0,
                 report=(0.5, lambda v, w: reports.append((v, w))))
    assert lefts[0] == 1.5 and all(b < a for a, b in zip(lefts, lefts[1:])), lefts
    assert lefts[-1] < 0.5
    assert reports and all(w >= 0.5 for _, w in reports), reports  # (min(1 s, every))

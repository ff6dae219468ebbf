"""tfpsx.waits.bounded_wait: the one bounded wait (a condition polled until it holds, or
the error that names what was waited for)."""

import time

import pytest

from tfpsx import errors
from tfpsx.waits import bounded_wait


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

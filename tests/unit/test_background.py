"""The one background-thread helper: rounds on wake / interval, errors reach the owner."""

import threading
import time

import pytest

from tfpsx.background import BackgroundLoop
from tfpsx.errors import BackgroundTaskError


@pytest.mark.timeout(30)
def test_wake_runs_one_round_each_and_stop_joins():
    rounds = []
    done = threading.Event()

    def step():
        rounds.append(1)
        if len(rounds) == 2:
            done.set()

    loop = BackgroundLoop("test loop", step).start()
    loop.wake()
    time.sleep(0.2)
    assert len(rounds) == 1
    loop.wake()
    assert done.wait(5)
    assert loop.stop(timeout=5)
    loop.check()  # no error


@pytest.mark.timeout(30)
def test_a_failing_round_ends_the_loop_and_check_raises_it_chained():
    def step():
        raise OSError("the PS went away")

    loop = BackgroundLoop("GEO communicator", step, interval=0.01).start()
    deadline = time.monotonic() + 5
    while loop.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(BackgroundTaskError, match="GEO communicator failed: the PS went away") \
            as info:
        loop.check()
    assert isinstance(info.value.__cause__, OSError)
    assert loop.stop(timeout=5)


@pytest.mark.timeout(30)
def test_interval_zero_runs_back_to_back_until_the_step_says_stop():
    count = [0]

    def step():
        count[0] += 1
        return count[0] < 50

    loop = BackgroundLoop("busy loop", step, interval=0).start()
    assert loop.stop(timeout=5) or count[0] >= 50
    loop.check()


@pytest.mark.timeout(30)
def test_a_round_failing_while_the_loop_stops_is_kept_and_logged(caplog):
    """A round in flight when the owner stops the loop (GEO's communicator when fit ends)
    and then fails: its error is kept for the owner and logged, not dropped."""
    entered, release = threading.Event(), threading.Event()

    def step():
        entered.set()
        release.wait(10)
        raise OSError("server 0 is gone")

    loop = BackgroundLoop("test loop", step, final_round_matters=True).start()
    loop.wake()
    assert entered.wait(5)
    threading.Timer(0.2, release.set).start()
    with caplog.at_level("ERROR", logger="tfpsx"):
        assert loop.stop(timeout=5)
    assert "test loop failed while stopping: server 0 is gone" in caplog.text
    assert not loop.reported
    with pytest.raises(BackgroundTaskError, match="test loop failed: server 0 is gone"):
        loop.check()
    assert loop.reported

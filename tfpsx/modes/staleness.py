"""Bounded staleness, once for both front-ends: after each step a worker ticks its clock
in a per-worker vector on PS 0 and waits while it is more than ``max_staleness`` steps
ahead of the slowest (a finished worker's clock is :data:`~tfpsx.modes.group.DONE`)."""

from __future__ import annotations

from tfpsx import errors
from tfpsx.modes.group import add_to_entry, leave
from tfpsx.waits import wait_for


def tick(clocks, me: int):
    """The op counting one step of worker ``me`` in the clock vector."""
    return add_to_entry(clocks, me, 1)


def finish(clocks, me: int):
    """The op marking worker ``me`` done: it holds nobody back."""
    return leave(clocks, me)


def wait_for_slowest(clocks, read_clocks, me: int, max_staleness: int, timeout: float) -> bool:
    """Waits while worker ``me`` is more than ``max_staleness`` steps ahead of the slowest
    worker; ``clocks`` is the clock vector after this worker's tick, ``read_clocks()``
    reads it again. Returns whether it had to wait (graph mode and Keras alike).

    Raises:
      ClusterTimeoutError: ``timeout`` passed (TFPSX_STALENESS_TIMEOUT), naming the slowest.
    """
    def near(c) -> bool:
        return c[me] - c.min() <= max_staleness

    def error(c, _waited):
        slow = [int(w) for w in (c == c.min()).nonzero()[0]]
        return errors.ClusterTimeoutError(
            f"bounded staleness: worker {me} at step {c[me]} waited {timeout:g} s "
            f"(TFPSX_STALENESS_TIMEOUT) for worker(s) {slow} at step {c.min()} "
            f"(max_staleness={max_staleness}); are they alive?")

    if near(clocks):
        return False
    wait_for(lambda _left: read_clocks(), near, timeout, error, poll=0.005, first=clocks)
    return True

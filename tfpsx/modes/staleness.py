"""Bounded staleness, once for both front-ends: after each step a worker ticks its clock
in a per-worker vector on PS 0 and waits while it is more than ``max_staleness`` steps
ahead of the slowest (a finished worker's clock is :data:`~tfpsx.modes.group.DONE`)."""

from __future__ import annotations

import time

from tfpsx import errors
from tfpsx.modes.group import add_to_entry, leave


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
    deadline = time.monotonic() + timeout
    waited = False
    while clocks[me] - clocks.min() > max_staleness:
        waited = True
        if time.monotonic() > deadline:
            slow = [int(w) for w in (clocks == clocks.min()).nonzero()[0]]
            raise errors.ClusterTimeoutError(
                f"bounded staleness: worker {me} at step {clocks[me]} waited "
                f"{timeout:g} s (TFPSX_STALENESS_TIMEOUT) for worker(s) {slow} at "
                f"step {clocks.min()} (max_staleness={max_staleness}); are they alive?")
        time.sleep(0.005)
        clocks = read_clocks()
    return waited

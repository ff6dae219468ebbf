"""One helper for tfpsx's background threads: GEO's communicator, the chief's sync
update, heartbeats.

A :class:`BackgroundLoop` runs a step function in a daemon thread until it is stopped.
An exception from the step ends the loop; the thread that owns the loop sees it, chained,
as :class:`tfpsx.errors.BackgroundTaskError` the next time it calls :meth:`check` (e.g.
after every training step), so a failure in the background is never silent.

Example:
  >>> loop = BackgroundLoop("GEO communicator", sync_once)          # runs on wake()
  >>> loop.start(); loop.wake(); ...; loop.check(); loop.stop(timeout=30)
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

from tfpsx.errors import BackgroundTaskError

logger = logging.getLogger("tfpsx")


class BackgroundLoop:
    """Runs ``step()`` in a daemon thread.

    Args:
      what: what the loop does, for its thread name and its error messages.
      step: called once per round; returning False ends the loop normally.
      interval: seconds between rounds; None runs one round per :meth:`wake`; 0 runs
        rounds back to back (a step that blocks on its own, like a queue take).
      final_round_matters: a round that fails while the loop stops is logged as an
        error (GEO's communicator: its round's pushes are lost); else only kept in
        :attr:`error` (a heartbeat in flight when the job ends).
    """

    def __init__(self, what: str, step: Callable[[], Optional[bool]],
                 interval: Optional[float] = None, final_round_matters: bool = False):
        self.what, self._step, self._interval = what, step, interval
        self._final_round_matters = final_round_matters
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.error: Optional[BaseException] = None
        self.reported = False  # check() raised the error to the owner

    def start(self) -> "BackgroundLoop":
        if self._thread is None:
            name = "tfpsx-" + "-".join(self.what.lower().split())
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()
        return self

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def wake(self) -> None:
        """Asks for a round (loops with ``interval=None``). Wakes the thread has not
        taken yet merge into one: a step that must run once per request reads what is
        asked of it from its owner's state, not from the number of wakes."""
        self._wake.set()

    def _wait(self) -> bool:
        """Waits for the next round; False when the loop is to end."""
        if self._interval is None:
            self._wake.wait()
            self._wake.clear()
        elif self._interval > 0:
            self._stop.wait(self._interval)
        return not self._stop.is_set()

    def _run(self) -> None:
        while self._wait():
            try:
                if self._step() is False:
                    return
            except BaseException as e:  # noqa: BLE001 — handed to the owner by check()
                # Kept while stopping too: the owner's stop (a GEO communicator's last
                # round at the end of fit) must not take a failed round for a done one.
                self.error = e
                if not self._stop.is_set():
                    logger.error("%s failed: %s", self.what, e)
                elif self._final_round_matters:
                    logger.error("%s failed while stopping: %s", self.what, e)
                return

    def check(self) -> None:
        """Raises ``BackgroundTaskError`` (the step's exception chained) if the loop failed."""
        if self.error is not None:
            self.reported = True
            raise BackgroundTaskError(f"{self.what} failed: {self.error}") from self.error

    def stop(self, timeout: Optional[float] = None) -> bool:
        """Ends the loop after the round in progress; True when the thread has ended."""
        self._stop.set()
        self._wake.set()
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

"""How a graph-mode training session closes: what stops before TF's close, its bound,
and where a failure of either goes.

TF's ``MonitoredSession`` closes its session at the end, and on an Aborted or
Unavailable error, after which it creates a new one with the same creator. TF's close
waits for every run of the session and deletes the session's state on this worker's
server (its iterators, which wait for their input threads); a background run on the
session is cut off part way. Measured: a GEO round so cut off lost the table rows it had
taken (a copy apart from the PS in 300-500 rows), and a close hung for 4 minutes while
the old iterator's input thread sat in a take of a split from PS 0 through the server
that was deleting the session.

So a session a creator makes (:class:`SessionCloser`) first runs the stops (GEO's
communicator ends its round in flight, the inputs' iterators take no more splits and
give back what they held), then TF's close bounded by TFPSX_SESSION_CLOSE_TIMEOUT.
TF's ``_CoordinatedSession.close`` swallows what the close raises, so a failure is
logged and kept: the creator's next session creation raises it (after an error, the
job then fails with it rather than go on with a stopped communicator). At the end no
session follows: the error in the log is what says so (the hooks' ``end``, the final
checkpoint and the last commits ran before the close).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, List, Optional

from tfpsx import errors, settings
from tfpsx.control import splits
from tfpsx.waits import bounded_wait

logger = logging.getLogger("tfpsx")


class SessionCloser:
    """Wraps the close of the sessions a creator makes (the module doc).

    Args:
      stops: called in order before TF's close of the creator's latest session, each
        whatever the others raise.
    """

    def __init__(self, stops: List[Callable[[], None]]):
        self._stops = list(stops)
        self._latest = None  # the session last made: only its close stops anything
        self.failure: Optional[BaseException] = None

    def check(self) -> None:
        """Raises the failure of an earlier close, once (before a session is created)."""
        failure, self.failure = self.failure, None
        if failure is not None:
            raise failure

    def wrap(self, session):
        """``session``, whose ``close`` now stops first (once) and is bounded."""
        self._latest = session
        if not self._stops:
            return session

        def close():
            # Once: a later close (TF's own when the session is collected, from whichever
            # thread collects it) is TF's alone. Measured: run again, it stopped the next
            # session's communicator while the collecting thread held a lock its round
            # needed (30 s, until the bound).
            if session.__dict__.pop("close", None) is None:
                return type(session).close(session)  # (another thread closes it)
            self._close(session)

        session.close = close
        return session

    def _close(self, session) -> None:
        failures = []
        # A session that is not the latest (one whose creation failed after it was made,
        # which TF does not close: collected later) stops nothing: the hooks and inputs
        # run on the latest.
        if session is self._latest:
            for stop in self._stops:
                try:
                    stop()
                except BaseException as e:  # (the others still stop)
                    failures.append(e)
        try:
            close_within(session)
        except BaseException as e:
            failures.append(e)
        if failures:
            for e in failures:
                logger.error("closing the training session: %s", e)
            if session is self._latest:  # (another's close fails no creation)
                self.failure = self.failure or failures[0]
            raise failures[0]


def close_within(session) -> None:
    """TF's close of ``session``, bounded by TFPSX_SESSION_CLOSE_TIMEOUT (the module
    doc); past it, a ClusterTimeoutError (TF's close goes on in a daemon thread)."""
    done, failed = threading.Event(), []

    def close():
        try:
            type(session).close(session)
        except BaseException as e:  # (raised in the caller's thread)
            failed.append(e)
        finally:
            done.set()

    threading.Thread(target=close, name="tfpsx-session-close", daemon=True).start()
    timeout = settings.get("TFPSX_SESSION_CLOSE_TIMEOUT")
    bounded_wait(done.is_set, timeout, lambda waited: errors.ClusterTimeoutError(
        f"TF's close of the training session did not end within "
        f"TFPSX_SESSION_CLOSE_TIMEOUT={timeout:g} s (it waits for the session's runs and "
        "for this worker's server to delete the session's iterators); is a parameter "
        "server alive?"), poll=0.01)
    if failed:
        raise failed[0]


def closing_stops(hooks, reads_splits: bool) -> List[Callable[[], None]]:
    """What stops before TF closes a training session: the hooks' ``session_closing``
    (GEO's communicator), in order, then, when the graph reads ``tfpsx.data.splits``
    (``reads_splits``), each of the process's inputs' ``abandon``."""
    stops = [h.session_closing for h in hooks if hasattr(h, "session_closing")]
    inputs = splits.registered().values() if reads_splits else ()
    return stops + [source.abandon for source in inputs if hasattr(source, "abandon")]

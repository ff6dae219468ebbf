"""The bounded waits of tfpsx: poll something until it holds or the bound runs out, then
raise the error that names what was waited for, its bound and who did not answer.

:func:`wait_for` reads a value until it is done (the error gets the last one read: the
workers still missing, the servers without an anchor); :func:`bounded_wait` polls a
condition. A read may be a long poll that blocks for the seconds it is given (the
scheduler's RPCs): it gets what is left of the bound.

Example:
  >>> bounded_wait(lambda: var.initialized(), timeout,
  ...              lambda waited: ClusterTimeoutError(f"waited {waited:.0f} s for ..."))

Loops that are not waits for a condition stay loops of their own: retries of a call
that failed (``SchedulerClient.finish``, its barrier while the scheduler is restarted),
the scheduler's server-side long polls, the launcher's grace before it kills what it
started, a wait on a thread's Event (the worker cache's stager).
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Tuple, TypeVar

T = TypeVar("T")
_UNREAD = object()


def wait_for(read: Callable[[float], T], done: Callable[[T], bool], timeout: float,
             error: Callable[[T, float], BaseException], poll: float = 0.05,
             check: Optional[Callable[[], None]] = None, first=_UNREAD,
             report: Optional[Tuple[float, Callable[[T, float], None]]] = None) -> T:
    """Reads a value (``read(seconds left of the bound)``) every ``poll`` seconds until
    ``done(value)``; returns that value. ``first``, when given, is the value already read
    (tested before the first read). ``check()``, if given, runs before each poll and may
    raise (a failed background task, a lost peer). ``report=(every, log)`` calls
    ``log(value, waited)`` after min(1 s, ``every``) of waiting and then every ``every``
    seconds (what a long start-up waits for). Past ``timeout`` seconds the exception
    ``error(last value, seconds waited)`` is raised: it names what was waited for, its
    bound and who did not answer."""
    start = time.monotonic()
    deadline = start + timeout
    next_report = start + min(1.0, report[0]) if report else None
    value = read(timeout) if first is _UNREAD else first
    while not done(value):
        if check is not None:
            check()
        now = time.monotonic()
        if now > deadline:
            raise error(value, now - start)
        if next_report is not None and now >= next_report:
            report[1](value, now - start)
            next_report = now + report[0]
        if poll:
            time.sleep(min(poll, max(0.0, deadline - now)) or poll)
        value = read(max(0.0, deadline - time.monotonic()))
    return value


def bounded_wait(ready: Callable[[], bool], timeout: float,
                 error: Callable[[float], BaseException], poll: float = 0.05,
                 check: Optional[Callable[[], None]] = None) -> float:
    """Calls ``ready()`` every ``poll`` seconds until it returns True; returns the seconds
    waited (0.0 when it held at once). ``check`` and the error as :func:`wait_for`'s,
    the error given only the seconds waited."""
    start = time.monotonic()
    wait_for(lambda _left: ready(), bool, timeout, lambda _v, waited: error(waited), poll,
             check)
    return time.monotonic() - start

"""One bounded wait for tfpsx: poll a condition until it holds or the bound runs out, then
raise the error that names what was waited for, its bound and who did not answer.

Example:
  >>> bounded_wait(lambda: var.initialized(), timeout,
  ...              lambda waited: ClusterTimeoutError(f"waited {waited:.0f} s for ..."))
"""

from __future__ import annotations

import time
from typing import Callable, Optional


def bounded_wait(ready: Callable[[], bool], timeout: float,
                 error: Callable[[float], BaseException], poll: float = 0.05,
                 check: Optional[Callable[[], None]] = None) -> float:
    """Calls ``ready()`` every ``poll`` seconds until it returns True; returns the seconds
    waited (0.0 when it held at once). ``check()``, if given, runs before each poll and may
    raise (a failed background task, a lost peer). Past ``timeout`` seconds the exception
    ``error(seconds waited)`` is raised: it names what was waited for and its bound."""
    start = time.monotonic()
    deadline = start + timeout
    while not ready():
        if check is not None:
            check()
        now = time.monotonic()
        if now > deadline:
            raise error(now - start)
        time.sleep(min(poll, max(0.0, deadline - now)) or poll)
    return time.monotonic() - start

"""Test helpers for tfpsx jobs: start every role of a script as local processes.

Example:
  >>> from tfpsx.testing import LocalCluster
  >>> with LocalCluster("train.py", server_num=1, worker_num=2, timeout=120) as c:
  ...     c.start()
  ...     codes = c.wait()          # {("worker", 0): 0, ...}; raises on the deadline
"""

import time

from tfpsx.launcher.local import LocalCluster, kill_process_group, pick_ports


def wait_until(predicate, seconds: float = 10.0, what: str = "the condition") -> None:
    """Polls ``predicate()`` until it is true; fails (AssertionError naming ``what``)
    after ``seconds`` (a background thread's effect, in a test)."""
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"{what} did not happen within {seconds:g} s"
        time.sleep(0.005)


__all__ = ["LocalCluster", "pick_ports", "kill_process_group", "wait_until"]

"""Test helpers for tfpsx jobs: start every role of a script as local processes.

Example:
  >>> from tfpsx.testing import LocalCluster
  >>> with LocalCluster("train.py", server_num=1, worker_num=2, timeout=120) as c:
  ...     c.start()
  ...     codes = c.wait()          # {("worker", 0): 0, ...}; raises on the deadline
"""


from tfpsx.launcher.local import LocalCluster, kill_process_group, pick_ports
from tfpsx.waits import bounded_wait


def wait_until(predicate, seconds: float = 10.0, what: str = "the condition") -> None:
    """Polls ``predicate()`` until it is true; fails (AssertionError naming ``what``)
    after ``seconds`` (a background thread's effect, in a test)."""
    bounded_wait(predicate, seconds, lambda _waited: AssertionError(
        f"{what} did not happen within {seconds:g} s"), poll=0.005)


__all__ = ["LocalCluster", "pick_ports", "kill_process_group", "wait_until"]

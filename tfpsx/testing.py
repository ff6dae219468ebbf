"""Test helpers for tfpsx jobs: start every role of a script as local processes.

Example:
  >>> from tfpsx.testing import LocalCluster
  >>> with LocalCluster("train.py", server_num=1, worker_num=2, timeout=120) as c:
  ...     c.start()
  ...     codes = c.wait()          # {("worker", 0): 0, ...}; raises on the deadline
"""

from tfpsx.launcher.local import LocalCluster, kill_process_group, pick_ports

__all__ = ["LocalCluster", "pick_ports", "kill_process_group"]

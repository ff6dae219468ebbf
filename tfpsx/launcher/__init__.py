"""The launcher: :class:`~tfpsx.launcher.local.LocalCluster` (every role of a job as local
processes on free 127.0.0.1 ports, killed by PID when done) and ``tfpsx-run``
(:mod:`~tfpsx.launcher.run`), its command line."""

from tfpsx.launcher.local import LocalCluster, kill_process_group, pick_ports

__all__ = ["LocalCluster", "pick_ports", "kill_process_group"]

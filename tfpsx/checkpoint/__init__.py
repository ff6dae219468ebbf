"""Incremental checkpoints of tfpsx tables: full exports every M saves, deltas between.

- :mod:`tfpsx.checkpoint.parts`: the on-disk parts and chains, written atomically;
- :mod:`tfpsx.checkpoint.saver`: :class:`IncrementalSaver`, a TF1 ``Saver`` over them
  (``tfpsx.MonitoredTrainingSession(incremental_checkpoints=M)``).
"""

from tfpsx.checkpoint.saver import IncrementalSaver, graph_tables

__all__ = ["IncrementalSaver", "graph_tables"]

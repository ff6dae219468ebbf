"""Metrics: counter groups (:mod:`~tfpsx.metrics.counters`) and where they go
(:mod:`~tfpsx.metrics.sinks`: JSON lines per process; TensorBoard later).

Example (a training script)::

  tfpsx.metrics.emit("eval", step=1000, loss=0.41)   # -> metrics.worker.0.jsonl
"""

from tfpsx.metrics.counters import Counters, snapshot
from tfpsx.metrics.sinks import emit, path, read, set_identity

__all__ = ["Counters", "snapshot", "emit", "read", "path", "set_identity"]

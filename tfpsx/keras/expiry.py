"""``ExpireByDataTime``: rows a stream has not seen for a span of its data time leave the
tables (and, through the next published delta, the served model).

Online training keeps a row while its id still appears in the data. Wall time is the
wrong clock for that: a job that was down for a day, or that catches up on a backlog,
would expire every row at once (or none). The stream's data time is the right one
(``tfpsx.data.stream(..., data_time=...)``: each file's time from its path).

A row records the step of the table's layer that last wrote it. The callback, on the
chief every ``every_steps`` batches, notes (the stream's data time, each layer's step)
and evicts from each table the rows last written at or before the newest noted step
whose data time is at least ``seconds`` older than the stream's now
(``ShardedTable.evict(min_step=...)``: on the servers, every shard). An eviction is a
removal for incremental checkpoints, so the next published delta removes the rows from
serving. The stream's data time is that of the newest lease the chief took, a split or
two ahead of its steps: a row expires up to that much late, never early.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional, Tuple

import keras

from tfpsx import compat
from tfpsx.control import splits as input_splits
from tfpsx.keras.layers import DynamicEmbedding
from tfpsx.keras.strategy import ParameterServerStrategy
from tfpsx.runtime import RUNTIME

logger = logging.getLogger("tfpsx")


class ExpireByDataTime(keras.callbacks.Callback):
    """Evicts the rows a stream has not seen for ``seconds`` of its data time (see the
    module doc), on the chief.

    Args:
      seconds: how long, in the stream's data time, a row may go unseen.
      input: the stream's name (``tfpsx.data.stream(..., name=...)``), which must have
        a ``data_time``.
      every_steps: the chief's batches between two checks.

    Raises:
      ValueError: a bad argument; at the first check, an input that is not a stream
        with a data time (named).
    """

    def __init__(self, seconds: float, input: str = "input", every_steps: int = 100):
        super().__init__()
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0:
            raise ValueError(f"ExpireByDataTime: seconds must be a number > 0 (of the "
                             f"stream's data time), got {seconds!r}")
        if isinstance(every_steps, bool) or not isinstance(every_steps, int) or every_steps < 1:
            raise ValueError(f"ExpireByDataTime: every_steps must be an int >= 1, got "
                             f"{every_steps!r}")
        self.seconds, self.input, self.every_steps = float(seconds), input, every_steps
        self._batches = 0
        self._noted: Dict[str, List[Tuple[float, int]]] = {}  # table -> (data time, step)
        self.evicted: Dict[str, int] = {}  # table -> rows evicted so far

    def _is_chief(self) -> bool:
        return RUNTIME.config is None or RUNTIME.config.is_chief

    def on_train_batch_end(self, batch, logs=None):
        self._batches += 1
        if self._batches % self.every_steps == 0 and self._is_chief():
            self.check()

    def _data_time(self) -> Optional[float]:
        source = input_splits.registered().get(self.input)
        if source is None or not hasattr(source, "data_time") or \
                getattr(source, "_data_time_of", None) is None:
            known = sorted(input_splits.registered())
            raise ValueError(f"ExpireByDataTime: input {self.input!r} is not a stream with a "
                             f"data time (tfpsx.data.stream(..., data_time=..., "
                             f"name={self.input!r})); this process's inputs: {known}")
        return source.data_time

    def check(self) -> Dict[str, int]:
        """Notes where the stream stands and evicts what expired; returns the rows
        evicted now, by table."""
        now = self._data_time()
        if now is None:  # no lease yet
            return {}
        strategy = getattr(self.model, "distribute_strategy", None)
        layers = [layer for layer in compat.flatten_layers(self.model)
                  if isinstance(layer, DynamicEmbedding) and layer.table is not None]
        out = {}
        cutoff = now - self.seconds
        for layer in layers:
            step_var = layer._step
            value = (strategy.job_value(step_var)
                     if isinstance(strategy, ParameterServerStrategy) else step_var)
            noted = self._noted.setdefault(layer.table.name, [])
            noted.append((now, int(value.numpy())))
            old = [i for i, (t, _) in enumerate(noted) if t <= cutoff]
            if not old:
                continue
            last = old[-1]
            min_step = noted[last][1] + 1  # rows written at or before it: unseen since
            del noted[:last]  # (the newest expired note stays: later cutoffs start there)
            gone = int(layer.table.evict(min_step=min_step).numpy())
            if gone:
                out[layer.table.name] = gone
                self.evicted[layer.table.name] = self.evicted.get(layer.table.name, 0) + gone
                logger.info("ExpireByDataTime: table %s: %d row(s) unseen since data time "
                            "%.0f (%.0f s before the stream's %.0f) evicted", layer.table.name,
                            gone, cutoff, self.seconds, now)
        return out

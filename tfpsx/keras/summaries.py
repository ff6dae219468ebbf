"""``TrainingSummaries``: a ``fit``'s TensorBoard scalars, tfpsx's traffic included.

Every ``every_steps`` training steps it writes, with ``tf.summary``:

* ``train/loss`` (the loss Keras reports) and ``train/examples_per_sec`` (of this
  worker's steps since the last write, or the job's with ``examples_per_step``);
* ``geo/*`` in GEO: per sync since the last write, the rows and bytes sent and received
  and the seconds a sync took; ``geo/syncs`` in all;
* ``staleness/waits``: the steps this worker waited for the slowest;
* per ``DynamicEmbedding`` table (every ``table_every`` writes: it reads the parameter
  servers): ``tables/<name>/size`` and, with a worker cache, ``.../cache_hit_rate`` and
  ``.../cache_size``;
* per input of ``tfpsx.data.splits`` (with the tables' cadence: it reads PS 0):
  ``input/<name>/epoch`` (the job's first open epoch), ``.../splits_done``,
  ``.../splits_leased``, ``.../splits_left`` (of that epoch), ``.../leases_returned``
  (the job's, by dead, restarted or abandoning workers) and ``.../worker_leases`` (this
  worker's).

``scalars({...}, step)`` writes other values (an evaluation's AUC) to the same run.
TensorFlow 2.21 no longer ships TensorBoard: install ``tensorboard`` to read the files
(``pip install tensorboard``), as ``tf.summary`` needs it from TF 2.22 on.

Example::

  summaries = tfpsx.keras.TrainingSummaries("logs/tb", strategy=strategy)
  model.fit(data, callbacks=strategy.callbacks() + [summaries])
"""

from __future__ import annotations

import importlib.util
import time
from typing import Dict

import keras
import tensorflow as tf

from tfpsx import compat, metrics, settings
from tfpsx.control import splits as input_splits
from tfpsx.keras.layers import DynamicEmbedding


class TrainingSummaries(keras.callbacks.Callback):
    """Writes a ``fit``'s scalars to the TensorBoard run ``logdir`` (see the module doc).

    Args:
      logdir: the run's folder.
      strategy: the ``tfpsx.keras.ParameterServerStrategy`` (for staleness waits);
        None without one.
      every_steps: steps between writes.
      examples_per_step: examples a step stands for (the global batch: per-worker batch x
        workers); default: this worker's batch size as Keras counts it (``logs["size"]``
        is not always given, so 0 means "do not write examples/s").
      table_every: writes between reads of the tables' sizes and caches.
    """

    def __init__(self, logdir: str, strategy=None, every_steps: int = 50,
                 examples_per_step: int = 0, table_every: int = 10):
        super().__init__()
        if importlib.util.find_spec("tensorboard") is None:
            # (tf.summary's implementation lives there)
            raise ImportError(
                "tfpsx.keras.TrainingSummaries writes with tf.summary, which needs the "
                "tensorboard package (TensorFlow 2.21 no longer installs it): pip install "
                "tensorboard (or tfpsx[tensorboard])")
        self.logdir = str(logdir)
        self.every = settings.parse_int(every_steps, "TrainingSummaries(every_steps=...)",
                                        minimum=1)
        self.examples_per_step = settings.parse_int(
            examples_per_step, "TrainingSummaries(examples_per_step=...)", minimum=0)
        self.table_every = settings.parse_int(table_every, "TrainingSummaries(table_every=...)",
                                              minimum=1)
        self._strategy = strategy
        self._writer = None
        self.step = 0
        self._writes = 0
        self._last = (0, time.perf_counter(), {})

    # ------------------------------------------------------------------ writing
    def writer(self):
        if self._writer is None:
            self._writer = tf.summary.create_file_writer(self.logdir)
        return self._writer

    def scalars(self, values: Dict[str, float], step: int) -> None:
        """Writes ``values`` ({tag: number}) at ``step`` now."""
        with self.writer().as_default(step=int(step)):
            for tag, value in values.items():
                tf.summary.scalar(tag, float(value))
        self._writer.flush()

    # ------------------------------------------------------------------ fit
    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        if self.step % self.every == 0:
            self.scalars(self._collect(logs or {}), self.step)

    def on_train_end(self, logs=None):
        if self.step > self._last[0]:  # the steps since the last write
            self.scalars(self._collect(logs or {}), self.step)
        if self._writer is not None:
            self._writer.flush()

    def _collect(self, logs) -> Dict[str, float]:
        now = time.perf_counter()
        steps, then, geo_then = self._last
        geo = metrics.snapshot().get("geo", {})
        self._last = (self.step, now, geo)
        out = {}
        if "loss" in logs:
            out["train/loss"] = float(logs["loss"])
        if self.examples_per_step and now > then:
            out["train/examples_per_sec"] = (self.step - steps) * self.examples_per_step / (
                now - then)
        syncs = geo.get("pushes", 0) - geo_then.get("pushes", 0)
        if geo:
            out["geo/syncs"] = geo.get("pushes", 0)
        if syncs > 0:
            for name in ("rows_sent", "rows_received", "bytes_sent", "bytes_received",
                         "sync_seconds"):
                out[f"geo/{name}_per_sync"] = (geo.get(name, 0) - geo_then.get(name, 0)) / syncs
        if self._strategy is not None:
            out["staleness/waits"] = float(self._strategy.staleness_waits)
        self._writes += 1
        if self._writes % self.table_every == 1 or self.table_every == 1:
            out.update(self._tables())
            out.update(input_splits.input_scalars())
        return out

    def _tables(self) -> Dict[str, float]:
        out = {}
        for layer in compat.flatten_layers(self.model):
            if not isinstance(layer, DynamicEmbedding) or layer.table is None:
                continue
            stats = layer.table.stats()
            name = layer.table.name
            out[f"tables/{name}/size"] = float(stats["size"])
            if "cache_hit_rate" in stats:
                out[f"tables/{name}/cache_hit_rate"] = float(stats["cache_hit_rate"])
                out[f"tables/{name}/cache_size"] = float(stats["cache_size"])
        return out

"""``DynamicTable``: the user-facing table, sharded over the parameter servers.

Example (graph mode, on a worker after ``tfpsx.init()``)::

  emb = tfpsx.embedding.DynamicTable(
      "user", dim=16, initializer=tfpsx.embedding.normal(stddev=0.05),
      optimizer=tfpsx.embedding.Adagrad(learning_rate=0.1))
  looked = emb.lookup_unique(ids)              # ids: any int shape
  loss = model(looked.embeddings)              # ids' shape + [16]
  train_op = emb.minimize(loss, [looked], step=global_step)

Eager / tf.function: pass the tape, then apply the gradients::

  with tf.GradientTape() as tape:
      looked = emb.lookup_unique(ids, tape=tape)
      loss = model(looked.embeddings)
  emb.apply_gradients(looked, tape.gradient(loss, looked.unique_rows), step=step)

The table is sharded over the PS tasks of the resolved cluster by ``key mod S``; each
shard is a ``TfpsxHashTable`` resource on ``/job:ps/task:i`` named ``<name>/part_<i>``.
Lookups deduplicate ids first, so each distinct id crosses the network once. Without a
cluster (no ``tfpsx.init()``), the table is one local shard, for development. How it
trains (directly, GEO, sync) is its updater's business (:mod:`tfpsx.embedding.updaters`).
"""

from __future__ import annotations

import logging
import weakref
from typing import Dict, List, Optional, Sequence

import tensorflow as tf

from tfpsx import compat
from tfpsx.embedding.cache import CacheOptions, WorkerCache
from tfpsx.embedding.initializers import Initializer
from tfpsx.embedding.saveable import TableSaveable, refuse_whole_save
from tfpsx.embedding.sharding import EmbeddingLookup, ShardedTable
from tfpsx.embedding.storage import Backend
from tfpsx.embedding.updaters import TableUpdater, updater_for
from tfpsx.runtime import RUNTIME

logger = logging.getLogger("tfpsx")


def _default_devices(shards: Optional[int]) -> List[Optional[str]]:
    config = RUNTIME.config
    if config is not None and config.servers and config.role in ("worker", "server"):
        count = config.server_num if shards is None else shards
        if count > config.server_num:
            raise ValueError(f"DynamicTable: {count} shards but the cluster has only "
                             f"{config.server_num} parameter servers")
        return [f"/job:ps/task:{i}" for i in range(count)]
    return [None] * (1 if shards is None else shards)


class DynamicTable(ShardedTable, compat.Trackable):
    """A growable int64 -> float32[dim] table, sharded over the parameter servers.

    Args:
      name: the table's name; shard i is ``<name>/part_<i>`` on its PS. Two tables with
        the same name on one PS must have the same dim and optimizer.
      dim: row width (> 0).
      initializer: a new key's row (``zeros()``, ``constant(v)``, ``uniform(lo, hi)``,
        ``normal(mean, stddev)``); deterministic in ``seed`` and the key.
      optimizer: the server-side optimizer (``SGD``, ``Adagrad``, ``Adam``, ``Ftrl`` or
        their names); its slots are stored with the rows. None: no training.
      shards: how many shards; default: the cluster's server count after
        ``tfpsx.init()``, else 1 (a local table).
      devices: one device per shard; default ``/job:ps/task:i`` in a cluster, none locally.
      seed: the initializer's seed.
      min_frequency: admission: a key gets a stored, trained row only after it was looked
        up this many times; until then lookups return its initial row.
      capacity: rows to reserve, over all shards (each takes its share): the shards
        size their index and map and fault in the rows' memory when they are created,
        so inserting up to that many keys neither rehashes nor page-faults (inserts
        of new keys run ~2x faster in ``benchmarks/embedding_ops.py``). A hint: the
        table still grows past it; ignored for a shard that already exists.
      cache_size: rows to keep in a cache on this worker (None: no cache). Lookups of
        cached rows stay local, misses are fetched from the PS in one call per shard,
        the cached rows train on the worker and sync with the PS every ``flush_steps``
        updates, on eviction and at the end of training (see
        :mod:`tfpsx.embedding.cache`). Not with sync training.
      cache_policy: which cached rows go first when the cache is full:
        ``tfpsx.embedding.LFU()`` (least often looked up; or ``"lfu"``) or ``LRU()``
        (least recently; or ``"lru"``).
      flush_steps: updates between two syncs of the cache with the PS (in GEO mode the
        mode's K steps instead).
      cache_admit_after: a missed row enters the cache at its K-th sighting among recent
        misses (default 1: at once); the rows not admitted train on the PS as without a
        cache, so a long tail of rare ids does not churn the hot rows out.
      updater: how the table trains (default: the training mode of the enclosing
        ``tfpsx.model_scope``, else the server-side optimizer on each shard).
      backend: creates the shards (default: the C++ hash table).

    Raises:
      ValueError: a bad dim, optimizer, shard count, device list or cache option, or
        a cache with sync training.
    """

    def __init__(self, name: str, dim: int, initializer: Initializer = None, optimizer=None,
                 shards: Optional[int] = None, devices: Optional[Sequence[str]] = None,
                 seed: int = 0, min_frequency: int = 1, capacity: Optional[int] = None,
                 cache_size: Optional[int] = None, cache_policy: str = "lfu",
                 flush_steps: int = 100, cache_admit_after: int = 1,
                 updater: Optional[TableUpdater] = None, backend: Optional[Backend] = None):
        self.cache_options = CacheOptions.parse(name, cache_size, cache_policy, flush_steps,
                                                cache_admit_after)
        if devices is None:
            devices = _default_devices(shards)
        devices = list(devices)
        if shards is not None and len(devices) != shards:
            raise ValueError(f"DynamicTable {name!r}: {shards} shards but {len(devices)} "
                             f"devices {devices}")
        super().__init__(name, dim, devices, initializer=initializer, optimizer=optimizer,
                         seed=seed, min_frequency=min_frequency, capacity=capacity,
                         backend=backend)
        self._saveable_graphs: "weakref.WeakSet" = weakref.WeakSet()
        self.updater = updater or updater_for(self)
        if self.cache_options is not None and not self.updater.supports_cache:
            raise ValueError(
                f"DynamicTable {name!r}: cache_size={cache_size} with "
                f"{type(self.updater).__name__}: sync training aggregates every step's "
                "gradients of every row, and a cache trains its rows locally between "
                "syncs; use async or GEO training with a cache, or no cache with sync")
        self.updater.attach(self)

    @property
    def cache(self) -> Optional[WorkerCache]:
        """This worker's cache of the table (``cache_size``), or None."""
        return getattr(self.updater, "cache", None)

    def _require_cache(self, what: str) -> WorkerCache:
        if self.cache is None:
            raise ValueError(f"DynamicTable {self.name!r}: {what} needs a worker cache; "
                             "create the table with cache_size=N")
        return self.cache

    def prefetch(self, ids, step=None):
        """Gets the next batch's rows ready while this step runs. With a worker cache
        (``cache_size``): fetches the rows the cache lacks into its staging table (see
        :meth:`tfpsx.embedding.cache.WorkerCache.prefetch`; returns the op, None in eager
        mode). Without one, on a table with a disk tier (``backend=TieredBackend(...)``):
        the servers bring the rows of ``ids`` that are on disk into RAM, reading without
        the shards' locks (see :meth:`ShardedTable.prefetch`; returns the rows brought
        back, an int64 scalar)."""
        if self.cache is None and any(hasattr(s, "prefetch") for s in self.shards):
            return super().prefetch(ids)
        if self.cache is None:
            raise ValueError(f"DynamicTable {self.name!r}: prefetch needs a worker cache "
                             "(create the table with cache_size=N) or a disk tier "
                             "(backend=tfpsx.embedding.TieredBackend(...))")
        return self.cache.prefetch(ids, step)

    def flush_cache(self, step=None):
        """Syncs the worker cache with the PS now: its trained rows' deltas go out, the
        rows other workers changed come in (training does it at its end); needs
        ``cache_size``. Returns the op (None in eager mode)."""
        return self._require_cache("flush_cache").flush(step)

    def stats(self) -> Dict[str, tf.Tensor]:
        """The PS shards' counters (``ShardedTable.stats``), and with a worker cache its
        counters as ``cache_<name>`` (``cache_hit_rate``, ``cache_rows_fetched``, ...)."""
        out = super().stats()
        if self.cache is not None:
            out.update({f"cache_{k}": v for k, v in self.cache.stats().items()})
        return out

    def _before_shard_ops(self) -> None:
        # A default tf.compat.v1.train.Saver (and MonitoredTrainingSession's) saves what
        # the graph's SAVEABLE_OBJECTS holds, as for TF's own MutableHashTable. Not in a
        # tf.function: its export ops would run on every call.
        if tf.executing_eagerly():
            return
        graph = tf.compat.v1.get_default_graph()
        if graph.building_function or graph in self._saveable_graphs:
            return
        self._saveable_graphs.add(graph)
        graph.add_to_collection(tf.compat.v1.GraphKeys.SAVEABLE_OBJECTS, self.saveable())

    def saveable(self):
        """A TF1 SaveableObject for ``tf.compat.v1.train.Saver``, named after the table
        (tensors ``<name>-keys``, ``-values``, ``-slots``, ``-freq``, ``-step``)."""
        return TableSaveable(self)

    # ------------------------------------------------------------------ lookups
    def lookup_unique(self, ids, train: bool = True, step=None, tape=None) -> EmbeddingLookup:
        source = self.updater.lookup_source(self)
        if source is not self:
            return source.lookup_unique(ids, train=train, step=step, tape=tape)
        return super().lookup_unique(ids, train=train, step=step, tape=tape)

    def lookup(self, ids, train: bool = False, step=None,
               dedup: Optional[bool] = None) -> tf.Tensor:
        source = self.updater.lookup_source(self)
        if source is not self:
            return source.lookup(ids, train=train, step=step, dedup=dedup)
        return super().lookup(ids, train=train, step=step, dedup=dedup)

    lookup_unique.__doc__ = ShardedTable.lookup_unique.__doc__
    lookup.__doc__ = ShardedTable.lookup.__doc__

    # ------------------------------------------------------------------ training
    def apply_gradients(self, looked: EmbeddingLookup, grads, step=None):
        """Trains the rows of ``looked`` with their gradients: on each shard's server-side
        optimizer, or as the mode of the enclosing ``model_scope`` says (GEO: this
        worker's copy; sync: the PS accumulators). Returns the op (None in eager mode).

        Args:
          looked: what ``lookup_unique`` returned.
          grads: d(loss)/d(``looked.unique_rows``): ``[unique ids, dim]``, or
            ``IndexedSlices`` of it (rows of one id are summed).
          step: the training step (the rows' last-update step; Adam's bias correction).

        Raises:
          ValueError: no optimizer, no gradient, or a gradient of another shape (a
            transposed ``[dim, n]`` or flattened one would train the wrong rows): the
            message names the table, the shape given and ``[unique ids, dim]``. With
            shapes known only when the graph runs, an assert fails the run instead,
            before any row changes.
        """
        if self.optimizer is None:
            raise ValueError(f"DynamicTable {self.name!r} has no optimizer; pass "
                             "optimizer=tfpsx.embedding.Adagrad(...) (or SGD, Adam, Ftrl)")
        grads = self._row_gradients(looked.unique_keys, grads)
        if looked.hot is not None:  # GEO's hot rows train on the PS
            return self.updater.apply_gradients(self, looked.unique_keys, grads, step,
                                                hot=looked.hot)
        return self.updater.apply_gradients(self, looked.unique_keys, grads, step)

    def minimize(self, loss, lookups: Sequence[EmbeddingLookup], step=None):
        """Graph mode: the op that applies d(loss)/d(rows) of ``lookups``."""
        grads = tf.gradients(loss, [l.unique_rows for l in lookups])
        return tf.group([self.apply_gradients(l, g, step) for l, g in zip(lookups, grads)])

    # ------------------------------------------------------------------ checkpoints
    def _serialize_to_tensors(self):
        refuse_whole_save(self, "tf.train.Checkpoint")
        return self.export()

    def _restore_from_tensors(self, restored_tensors):
        return self.import_rows(restored_tensors, clear=True)

"""A served table: a tfpsx table's rows in stock TensorFlow objects.

:class:`ServingTable` holds, per shard of the trained table, a
``tf.lookup.experimental.DenseHashTable`` (key -> row index) and a ``tf.Variable`` of the
rows, and looks ids up as the table does: a stored key gets its row, any other key the
initializer's row (:mod:`tfpsx.serving.initializers`). Both objects are saved in the
SavedModel's checkpoint (``variables/``), not as constants in ``saved_model.pb`` (a graph
proto is limited to 2 GB); shard i of the trained table becomes shard i here, so an
export copies one shard's rows at a time.
"""

from __future__ import annotations

import uuid
from typing import List, Optional, Sequence

import numpy as np
import tensorflow as tf

from tfpsx.checkpoint.pages import INT64_MIN, page_ranges
from tfpsx.embedding.storage import on_device
from tfpsx.serving.initializers import initial_rows

_MAX_LOAD = 0.8  # DenseHashTable's default max_load_factor: it rehashes above it


class _NamedDenseHashTable(tf.lookup.experimental.DenseHashTable):
    """A DenseHashTable with a shared name of our choosing. An anonymous table cannot
    serve: TF Serving (and any TF1 ``saved_model.loader``) runs the table's creation op
    in every session call, so a restored anonymous table is never the one looked up
    (measured: every id missed). TF's default name for a table made eagerly,
    ``table_<n>``, repeats across processes, so two exported models loaded in one
    process would share (and overwrite) each other's table."""

    def __init__(self, shared_name: str, **kwargs):
        self._fixed_shared_name = shared_name
        super().__init__(**kwargs)

    def _create_resource(self):
        self._shared_name = self._fixed_shared_name
        return super()._create_resource()


def _reserved_keys(keys: np.ndarray, count: int) -> List[int]:
    """``count`` int64 values that are not in ``keys``, the smallest first."""
    present = set(keys[keys < INT64_MIN + count + len(keys) + 1].tolist())
    out, candidate = [], INT64_MIN
    while len(out) < count:
        if candidate not in present:
            out.append(candidate)
        candidate += 1
    return out


class ServingShard(tf.Module):
    """One shard: its keys in a hash table of row indices, its rows in a variable."""

    def __init__(self, name: str, keys, rows, dim: int):
        super().__init__(name=None)
        keys = np.asarray(keys, np.int64).reshape([-1])
        self.size = len(keys)
        # DenseHashTable reserves two keys (empty, deleted) that may be neither stored nor
        # looked up; a third free value stands in for an id equal to one of them.
        self.empty_key, self.deleted_key, self.stand_in = _reserved_keys(keys, 3)
        buckets = 1 << max(4, int(np.ceil(np.log2(max(1, self.size) / _MAX_LOAD + 1))))
        self.index = _NamedDenseHashTable(
            f"tfpsx_serving/{name}/{uuid.uuid4().hex}", key_dtype=tf.int64,
            value_dtype=tf.int64, default_value=-1, empty_key=self.empty_key,
            deleted_key=self.deleted_key, initial_num_buckets=buckets)
        if self.size:
            self.index.insert(tf.constant(keys), tf.range(self.size, dtype=tf.int64))
        # A shard without rows keeps one unused row: a gather needs something to read.
        self.rows = tf.Variable(tf.reshape(tf.convert_to_tensor(rows, tf.float32), [-1, dim])
                                if self.size else tf.zeros([1, dim]), name="rows")

    def find(self, keys: tf.Tensor):
        """(rows ``[n, dim]``, found ``[n]``); rows of missing keys are undefined."""
        reserved = tf.logical_or(tf.equal(keys, self.empty_key),
                                 tf.equal(keys, self.deleted_key))
        index = self.index.lookup(tf.where(reserved, tf.constant(self.stand_in, tf.int64), keys))
        found = tf.greater_equal(index, 0)
        return tf.gather(self.rows, tf.maximum(index, 0)), found


class ServingTable(tf.Module):
    """A trained table for serving: its shards' rows, and its initializer for other ids.

    Args:
      name: the trained table's name (for the objects' names).
      dim: the row width.
      initializer: the table's ``tfpsx.embedding.Initializer`` (its kind, a and b).
      seed: the table's seed.
      shards: per shard, (keys, rows) as arrays; shard i must hold exactly the keys with
        ``key mod len(shards) == i`` (the trained table's partition).
    """

    def __init__(self, name: str, dim: int, initializer, seed: int,
                 shards: Sequence = ()):
        super().__init__(name=None)
        self.table_name, self.dim, self.seed = name, int(dim), int(seed)
        self.init_kind = initializer.kind
        self.init_a, self.init_b = float(initializer.a), float(initializer.b)
        self.shards: List[ServingShard] = []
        for keys, rows in shards:
            self.add_shard(keys, rows)

    def add_shard(self, keys, rows) -> None:
        """Adds the next shard (call in shard order, then no more after the first lookup)."""
        self.shards.append(ServingShard(f"{self.table_name}/part_{len(self.shards)}",
                                        keys, rows, self.dim))

    @property
    def size(self) -> int:
        return sum(s.size for s in self.shards)

    def initial_rows(self, keys: tf.Tensor) -> tf.Tensor:
        return initial_rows(keys, self.init_kind, self.init_a, self.init_b, self.seed, self.dim)

    def lookup(self, ids) -> tf.Tensor:
        """The rows (ids' shape + [dim]) of int64 ids: stored, or initial for other ids."""
        ids = tf.convert_to_tensor(ids)
        rows, _ = self.find(tf.reshape(tf.cast(ids, tf.int64), [-1]))
        return tf.reshape(rows, tf.concat([tf.shape(ids), [self.dim]], axis=0))

    def find(self, keys: tf.Tensor):
        """(rows ``[n, dim]``, found ``[n]``) of a key vector: the table's ``find``."""
        count = len(self.shards)
        if count == 0:
            return self.initial_rows(keys), tf.zeros(tf.shape(keys), tf.bool)
        if count == 1:
            rows, found = self.shards[0].find(keys)
        else:
            shard = tf.cast(tf.math.floormod(keys, count), tf.int32)
            parts = tf.dynamic_partition(keys, shard, count)
            positions = tf.dynamic_partition(tf.range(tf.size(keys)), shard, count)
            results = [s.find(k) for s, k in zip(self.shards, parts)]
            rows = tf.dynamic_stitch(positions, [r for r, _ in results])
            found = tf.dynamic_stitch(positions, [f for _, f in results])
            rows = tf.reshape(rows, [-1, self.dim])
        # The initializer runs for the missing ids only (few, when serving).
        missing = tf.where(tf.logical_not(found))
        rows = tf.tensor_scatter_nd_update(rows, missing,
                                           self.initial_rows(tf.gather_nd(keys, missing)))
        return rows, found


def _shard_rows(table, i: int):
    """(keys, values) of shard ``i``, as arrays, read in pages (a shard with a disk tier:
    a 32nd of its ram_bytes; one in RAM: one page), so that its server holds a page of
    rows at a time, not the shard."""
    shard = table.shards[i]
    with on_device(shard.device):
        bounds = shard.page_bounds(False).numpy()
    got = [table.export_range(i, lo, hi) for lo, hi in page_ranges(bounds)]
    return (np.concatenate([p["keys"].numpy() for p in got]),
            np.concatenate([p["values"].numpy() for p in got]))


def from_trained(table, source: Optional[object] = None) -> ServingTable:
    """A :class:`ServingTable` of a tfpsx table's rows, exported shard by shard.

    Args:
      table: a ``tfpsx.embedding.ShardedTable`` (for the name, dim, initializer, seed).
      source: the ``ShardedTable`` whose rows to copy (default: ``table``; GEO's
        worker copy is another).
    """
    source = table if source is None else source
    served = ServingTable(table.name, table.dim, source.initializer, source.seed)
    count = source.num_shards
    for i in range(count):
        keys, values = _shard_rows(source, i)
        if count > 1 and keys.size and not np.all(np.mod(keys, count) == i):
            raise ValueError(f"table {table.name!r}: shard {i} of {count} holds keys that "
                             "are not its own (key mod shards); cannot serve it shard by shard")
        served.add_shard(keys, values)
        del keys, values
    return served


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
    """One shard: its rows in a ``DenseHashTable`` (key -> the row and a last column of
    1, the "found" flag: a missing key's default row has 0 there).

    The rows are the table's values, not indices into a variable, so that a delta
    (:meth:`apply`) can insert, overwrite and remove rows in place with stock ops. A
    bucket costs ``8 + 4 (dim + 1)`` bytes where an index into a variable of rows cost
    16 a bucket plus ``4 dim`` a row (dim 16 at the table's mean load: about 1.4x),
    the price of a served model that follows training without a reload.
    """

    def __init__(self, name: str, keys, rows, dim: int):
        super().__init__(name=None)
        keys = np.asarray(keys, np.int64).reshape([-1])
        self.dim = int(dim)
        self.size = len(keys)  # rows of the export (a delta applied since is not counted)
        # DenseHashTable reserves two keys (empty, deleted) that can be neither stored nor
        # looked up: they are chosen among those the base does not hold; a delta that
        # holds one is refused (apply), and an id equal to one is served its initial row.
        self.empty_key, self.deleted_key = _reserved_keys(keys, 2)
        buckets = 1 << max(4, int(np.ceil(np.log2(max(1, len(keys)) / _MAX_LOAD + 1))))
        self.index = _NamedDenseHashTable(
            f"tfpsx_serving/{name}/{uuid.uuid4().hex}", key_dtype=tf.int64,
            value_dtype=tf.float32, default_value=tf.zeros([self.dim + 1]),
            empty_key=self.empty_key, deleted_key=self.deleted_key,
            initial_num_buckets=buckets)
        if len(keys):
            self.index.insert(tf.constant(keys), _flagged(
                tf.reshape(tf.convert_to_tensor(rows, tf.float32), [-1, self.dim])))

    def _reserved(self, keys: tf.Tensor) -> tf.Tensor:
        return tf.logical_or(tf.equal(keys, self.empty_key), tf.equal(keys, self.deleted_key))

    def find(self, keys: tf.Tensor):
        """(rows ``[n, dim]``, found ``[n]``); rows of missing keys are undefined."""
        reserved = self._reserved(keys)
        stored = self.index.lookup(tf.where(reserved, tf.zeros_like(keys), keys))
        found = tf.logical_and(tf.greater(stored[:, self.dim], 0.5), tf.logical_not(reserved))
        return stored[:, :self.dim], found

    def check_keys(self, keys: tf.Tensor, what: str) -> tf.Tensor:
        """An op failing (InvalidArgumentError, naming the key) when ``keys`` holds one
        of this shard's two reserved keys, which a DenseHashTable cannot store."""
        bad = tf.boolean_mask(keys, self._reserved(keys))
        return tf.debugging.Assert(
            tf.equal(tf.size(bad), 0),
            [f"{what}: the served table cannot hold key(s)", bad[:3],
             f"(reserved as the hash table's empty and deleted keys {self.empty_key}, "
             f"{self.deleted_key} when its base was exported; export a new base)"],
            summarize=3)

    def apply(self, keys: tf.Tensor, rows: tf.Tensor, removed: tf.Tensor) -> List:
        """The ops of a delta: ``removed`` keys removed, then ``keys`` given ``rows``
        (inserted or overwritten)."""
        gone = self.index.remove(removed)
        with tf.control_dependencies([gone]):
            put = self.index.insert(keys, _flagged(rows))
        return [gone, put]


def _flagged(rows: tf.Tensor) -> tf.Tensor:
    """``rows`` ``[n, dim]`` with the "found" column of ones."""
    return tf.concat([rows, tf.ones([tf.shape(rows)[0], 1], tf.float32)], axis=1)


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
        """Rows the export wrote (a delta applied since is not counted)."""
        return sum(s.size for s in self.shards)

    def initial_rows(self, keys: tf.Tensor) -> tf.Tensor:
        return initial_rows(keys, self.init_kind, self.init_a, self.init_b, self.seed, self.dim)

    def lookup(self, ids) -> tf.Tensor:
        """The rows (ids' shape + [dim]) of int64 ids: stored, or initial for other ids."""
        ids = tf.convert_to_tensor(ids)
        rows, _ = self.find(tf.reshape(tf.cast(ids, tf.int64), [-1]))
        return tf.reshape(rows, tf.concat([tf.shape(ids), [self.dim]], axis=0))

    def _partition(self, keys: tf.Tensor):
        """(per shard, keys' positions): ``key mod shards`` as the trained table's."""
        count = len(self.shards)
        shard = tf.cast(tf.math.floormod(keys, count), tf.int32)
        return shard, tf.dynamic_partition(tf.range(tf.size(keys)), shard, count)

    def delta_checks(self, keys: tf.Tensor, removed: tf.Tensor, what: str) -> List:
        """Ops failing (InvalidArgumentError) on a delta this table cannot take: a key
        one of its shards reserved (:meth:`ServingShard.check_keys`); run them before
        any write of the delta (:meth:`apply`)."""
        if not self.shards:  # (an export gives each trained shard one)
            return [tf.debugging.Assert(
                tf.equal(tf.size(keys) + tf.size(removed), 0),
                [f"{what}: table {self.table_name!r} has no shard in this export"])]
        if len(self.shards) == 1:
            return [self.shards[0].check_keys(keys, what)]
        shard, _ = self._partition(keys)
        parts = tf.dynamic_partition(keys, shard, len(self.shards))
        return [s.check_keys(k, what) for s, k in zip(self.shards, parts)]

    def apply(self, keys: tf.Tensor, rows: tf.Tensor, removed: tf.Tensor) -> List:
        """The write ops of a delta of this table (after its :meth:`delta_checks`):
        ``removed`` keys removed, then ``keys`` (int64 ``[n]``) given ``rows``
        (``[n, dim]``, absolute values), each shard its own keys. (A list, not a
        ``tf.group``: that pins a no-op to each input's device, which a model exported
        on a cluster's worker would carry into a server that has no such device.)"""
        rows = tf.reshape(rows, [-1, self.dim])
        count = len(self.shards)
        if count == 0:
            return []
        if count == 1:
            return self.shards[0].apply(keys, rows, removed)
        shard, _ = self._partition(keys)
        gone_shard, _ = self._partition(removed)
        parts = zip(tf.dynamic_partition(keys, shard, count),
                    tf.dynamic_partition(rows, shard, count),
                    tf.dynamic_partition(removed, gone_shard, count))
        return [w for s, (k, r, g) in zip(self.shards, parts) for w in s.apply(k, r, g)]

    def find(self, keys: tf.Tensor):
        """(rows ``[n, dim]``, found ``[n]``) of a key vector: the table's ``find``."""
        count = len(self.shards)
        if count == 0:
            return self.initial_rows(keys), tf.zeros(tf.shape(keys), tf.bool)
        if count == 1:
            rows, found = self.shards[0].find(keys)
        else:
            shard, positions = self._partition(keys)
            parts = tf.dynamic_partition(keys, shard, count)
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


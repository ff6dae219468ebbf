"""A table sharded over devices: keys partitioned by ``key mod S``, one storage shard per
device, every operation written once through :meth:`ShardedTable.on_shards`.

``ShardedTable`` is mode-free: it reads, writes and applies its server-side optimizer and
knows nothing of GEO or sync. :class:`tfpsx.embedding.DynamicTable` adds training
through a mode's updater and checkpoints; GEO's worker-local copies are plain
``ShardedTable`` s.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Sequence

import tensorflow as tf

from tfpsx.embedding import checks as _checks
from tfpsx.embedding import optimizers as _optimizers
from tfpsx.embedding.checks import EXPORT_FIELDS
from tfpsx.embedding.initializers import Initializer, normal
from tfpsx.embedding.storage import (COMBINE, HASH_TABLE, Backend, ShardSpec, TableStorage,
                                     on_device)
from tfpsx.ops import bindings

INT64_MIN = -(2 ** 63)
STATS_FIELDS = ("size", "admitted", "evicted", "pending_admission", "bytes_used",
                "bytes_reserved")


@dataclasses.dataclass
class EmbeddingLookup:
    """What ``lookup_unique`` returns: the rows of the distinct ids and the embeddings."""
    unique_keys: tf.Tensor    # [u] int64
    unique_rows: tf.Tensor    # [u, dim]: differentiate the loss with respect to this
    indices: tf.Tensor        # [n] position of each id in unique_keys
    embeddings: tf.Tensor     # ids' shape + [dim]
    # [u] bool: the rows read from (and trained on) the PS rather than a GEO worker's
    # copy (GEO's hot rows, tfpsx.modes.geo.hot_rows.HotRows); None: no such split.
    hot: Optional[tf.Tensor] = None


def as_step(step) -> tf.Tensor:
    """An int64 step tensor (0 when None)."""
    return tf.constant(0, tf.int64) if step is None else tf.cast(step, tf.int64)


def _check_int(value, minimum: int, message: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{message}, got {value!r}")


class ShardedTable:
    """An int64 -> float32[dim] table in ``len(devices)`` shards (see the module doc).

    Args:
      name: shard i is ``<name>/part_<i>`` on ``devices[i]``.
      dim, initializer, optimizer, seed, min_frequency, capacity: as in
        :class:`tfpsx.embedding.DynamicTable`.
      devices: one device per shard (None: the current device).
      backend: creates the shards (default: the C++ hash table).
    """

    def __init__(self, name: str, dim: int, devices: Sequence[Optional[str]],
                 initializer: Optional[Initializer] = None, optimizer=None, seed: int = 0,
                 min_frequency: int = 1, capacity: Optional[int] = None,
                 backend: Optional[Backend] = None):
        if not isinstance(name, str) or not name:
            raise ValueError(f"DynamicTable: name must be a non-empty string, got {name!r}")
        what = f"DynamicTable {name!r}"
        _check_int(dim, 1, f"{what}: dim must be a positive int")
        _check_int(min_frequency, 1, f"{what}: min_frequency must be an int >= 1")
        if capacity is not None:
            _check_int(capacity, 0, f"{what}: capacity must be None or an int >= 0 (rows to "
                                    "reserve)")
        initializer = initializer or normal()
        if not isinstance(initializer, Initializer):
            raise ValueError(f"{what}: initializer must come from tfpsx.embedding.zeros/"
                             f"constant/uniform/normal, got {initializer!r}")
        devices = list(devices)
        if not devices:
            raise ValueError(f"{what}: needs at least one shard")
        self.name, self.dim, self.seed, self.min_frequency = name, dim, int(seed), min_frequency
        self.capacity, self.initializer = capacity or 0, initializer
        self.optimizer = _optimizers.resolve(optimizer)
        self.devices = devices
        slot_init = tuple(self.optimizer.slot_init) if self.optimizer else ()
        self.num_slots = len(slot_init)
        per_shard = -(-self.capacity // len(devices))
        backend = backend or HASH_TABLE
        self.shards: List[TableStorage] = [
            backend.create(ShardSpec(f"{name}/part_{i}", dim, initializer, slot_init,
                                     self.seed, min_frequency, per_shard), device)
            for i, device in enumerate(devices)]

    @property
    def row_width(self) -> int:
        """Floats of a row with its optimizer slots: ``dim * (1 + slots)``."""
        return self.dim * (1 + self.num_slots)

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    def handles(self) -> List[tf.Tensor]:
        """One resource handle per shard (creates the shards on first run)."""
        self._before_shard_ops()
        return [shard.handle() for shard in self.shards]

    # ------------------------------------------------------------------ the per-shard helper
    def _before_shard_ops(self) -> None:
        """Called before any shard op is built (subclasses register checkpoints here)."""

    def partition(self, keys):
        """(per-shard keys, per-shard positions in ``keys``) of a 1-D key vector."""
        if self.num_shards == 1:
            return [keys], [tf.range(tf.size(keys))]
        shard = tf.cast(tf.math.floormod(keys, self.num_shards), tf.int32)
        return (tf.dynamic_partition(keys, shard, self.num_shards),
                tf.dynamic_partition(tf.range(tf.size(keys)), shard, self.num_shards))

    def on_shards(self, fn: Callable, keys=None, rows: Sequence = ()) -> list:
        """``fn(i, shard, shard_keys, *shard_rows)`` for every shard, under its device.

        ``keys`` (a 1-D int64 vector, optional) is partitioned over the shards and each of
        ``rows`` (tensors with one row per key) gathered to match; without keys ``fn``
        gets ``(i, shard)``. Returns the per-shard results, in shard order."""
        return self._map(fn, keys, rows)[0]

    def stitched(self, fn: Callable, keys) -> tf.Tensor:
        """Per-shard rows of ``fn(i, shard, shard_keys)`` merged back into ``keys``' order."""
        per_shard, positions = self._map(fn, keys, ())
        return per_shard[0] if self.num_shards == 1 else tf.dynamic_stitch(positions, per_shard)

    def _map(self, fn, keys, rows):
        self._before_shard_ops()
        parts, positions = self.partition(keys) if keys is not None else (None, None)
        out = []
        for i, shard in enumerate(self.shards):
            args = []
            if keys is not None:
                args.append(parts[i])
                args.extend(r if self.num_shards == 1 else tf.gather(r, positions[i])
                            for r in rows)
            with on_device(shard.device):
                out.append(fn(i, shard, *args))
        return out, positions

    @staticmethod
    def _group(ops):
        return tf.group(ops) if not tf.executing_eagerly() else None

    # ------------------------------------------------------------------ lookups
    def _keys(self, ids) -> tf.Tensor:
        ids = tf.convert_to_tensor(ids)
        if not ids.dtype.is_integer:
            raise TypeError(f"DynamicTable {self.name!r}: ids must be integers (int32 or "
                            f"int64), got {ids.dtype.name}")
        return tf.cast(ids, tf.int64)

    def rows(self, keys, train: bool, step=None) -> tf.Tensor:
        """Rows ``[n, dim]`` of a key vector: found (or initial), or with ``train``
        inserted (subject to admission) and counted."""
        step = as_step(step)
        if train:
            return self.stitched(lambda i, s, k: s.find_or_insert(k, step), keys)
        return self.stitched(lambda i, s, k: s.find(k)[0], keys)

    def lookup_unique(self, ids, train: bool = True, step=None, tape=None) -> EmbeddingLookup:
        """Looks ids up once per distinct id.

        Args:
          ids: integer tensor of any shape.
          train: insert missing keys (subject to admission) and count frequencies; False
            reads only (missing keys get their initial row, nothing is stored).
          step: the training step recorded as a new row's last-update step.
          tape: a GradientTape to watch ``unique_rows`` on (eager training).
        """
        keys = self._keys(ids)
        unique, index = tf.unique(tf.reshape(keys, [-1]))
        unique_rows = tf.reshape(self.rows(unique, train, step), [-1, self.dim])
        if tape is not None:
            tape.watch(unique_rows)
        embeddings = tf.reshape(tf.gather(unique_rows, index),
                                tf.concat([tf.shape(keys), [self.dim]], axis=0))
        return EmbeddingLookup(unique, unique_rows, index, embeddings)

    def lookup(self, ids, train: bool = False, step=None,
               dedup: Optional[bool] = None) -> tf.Tensor:
        """Rows of ``ids`` (ids' shape + [dim]); read-only unless ``train``.

        Args:
          ids: integer tensor of any shape.
          train: as in ``lookup_unique`` (training lookups always deduplicate, so that each
            distinct id is counted and inserted once per batch).
          step: as in ``lookup_unique``.
          dedup: look each distinct id up once (unique, find, gather back). Default: yes
            when a shard lives on a parameter server, where it cuts the rows sent; no for
            a local table, whose kernel serves a repeated id from cache faster than the
            unique + gather back would cost (measured in benchmarks/embedding_ops.py).
        """
        if dedup is None:
            dedup = any(device is not None for device in self.devices)
        if train or dedup:
            return self.lookup_unique(ids, train=train, step=step).embeddings
        keys = self._keys(ids)
        rows = self.rows(tf.reshape(keys, [-1]), train=False)
        return tf.reshape(rows, tf.concat([tf.shape(keys), [self.dim]], axis=0))

    # ------------------------------------------------------------------ writes
    # Every write checks its input whole before any shard op is built from it (see
    # checks.py): a bad input changes no shard.
    @property
    def _what(self) -> str:
        return f"DynamicTable {self.name!r}"

    def _key_vector(self, keys) -> tf.Tensor:
        keys = self._keys(keys)
        return keys if keys.shape.rank == 1 else tf.reshape(keys, [-1])

    def _keys_and_rows(self, op: str, name: str, keys, rows, width: Optional[int] = None):
        keys = self._keys(keys)
        rows = _checks.rows_like_keys(f"{self._what}: {op}", name, width or self.dim, keys,
                                      rows)
        return tf.reshape(keys, [-1]), rows

    def insert(self, keys, values, step=None):
        """Sets the rows of ``keys`` (any shape) to ``values`` (keys' shape + [dim])."""
        step = as_step(step)
        keys, values = self._keys_and_rows("insert", "values", keys, values)
        return self._group(self.on_shards(lambda i, s, k, v: s.insert(k, v, step), keys, [values]))

    def accumulate(self, keys, deltas, step=None, skip_reader: int = -1, wire_dtype=None,
                   combine: str = "sum", with_slots: bool = False, slot_wire_dtype=None):
        """row += delta for ``keys`` (any shape; deltas: keys' shape + [dim]); the keys
        count as changed for every changed-key reader but ``skip_reader`` (a worker's
        own push, when its pull need not bring it back). ``wire_dtype``: the deltas
        travel to the shards in it (bfloat16, float16) and are added as float32.
        ``combine``: how pushes of several workers to one row add up (``skip_reader``
        is the pusher; :data:`tfpsx.embedding.storage.COMBINE`; the keys of a combined
        push must be unique, as a GEO push's are). ``with_slots``: deltas of ``[value |
        optimizer slots]`` (:attr:`row_width` floats), every one whole (``"sum"``);
        ``slot_wire_dtype``: the slots travel in it (None: as the values)."""
        if combine not in COMBINE:
            raise ValueError(f"{self._what}: accumulate: combine={combine!r}; expected one "
                             f"of {', '.join(COMBINE)}")
        if combine != "sum" and skip_reader < 0:
            raise ValueError(f"{self._what}: accumulate: combine={combine!r} counts the "
                             f"other pushes since the pusher's last pull, so it needs the "
                             f"pusher's reader as skip_reader (>= 0), got {skip_reader}")
        if with_slots and combine != "sum":
            raise ValueError(f"{self._what}: accumulate: with_slots adds every delta whole; "
                             f"combine={combine!r} is not supported with it (expected 'sum')")
        step = as_step(step)
        keys, deltas = self._keys_and_rows("accumulate", "deltas", keys, deltas,
                                           self.row_width if with_slots else self.dim)
        if with_slots and self.row_width > self.dim and slot_wire_dtype is not None and \
                slot_wire_dtype != (wire_dtype or tf.float32):
            parts = [deltas[:, :self.dim] if wire_dtype is None else
                     tf.cast(deltas[:, :self.dim], wire_dtype),
                     tf.cast(deltas[:, self.dim:], slot_wire_dtype)]
        else:
            parts = [deltas if wire_dtype is None else tf.cast(deltas, wire_dtype)]

        def add(i, shard, shard_keys, *shard_parts):
            shard_parts = [tf.cast(p, tf.float32) for p in shard_parts]
            shard_deltas = shard_parts[0] if len(shard_parts) == 1 else tf.concat(shard_parts, 1)
            return shard.accumulate(shard_keys, shard_deltas, step,
                                    skip_reader=skip_reader, combine=combine,
                                    with_slots=with_slots)

        return self._group(self.on_shards(add, keys, parts))

    def apply(self, keys, grads, step=None):
        """The server-side optimizer on the rows of unique ``keys`` (a vector; grads
        ``[n, dim]`` or ``IndexedSlices`` of it)."""
        if self.optimizer is None:
            raise ValueError(f"{self._what} has no optimizer; pass "
                             "optimizer=tfpsx.embedding.Adagrad(...) (or SGD, Adam, Ftrl)")
        grads = self._row_gradients(self._keys(keys), grads, "apply")
        return self.apply_checked(self._key_vector(keys), grads, step)

    def apply_checked(self, keys, grads, step=None):
        """:meth:`apply` of an int64 key vector and float32 ``[n, dim]`` gradients
        checked already (a part of checked ones: GEO's split between the PS and the
        copy, whose checks would run again every step)."""
        step = as_step(step)
        return self._group(self.on_shards(
            lambda i, s, k, g: s.apply(self.optimizer, k, g, step), keys, [grads]))

    def _row_gradients(self, keys, grads, op: str = "apply_gradients") -> tf.Tensor:
        """``grads`` of the unique ``keys`` checked (``[n, dim]``, or ``IndexedSlices``
        of it: summed per row) as ``[n, dim]`` float32."""
        if grads is None:
            raise ValueError(f"{self._what}: {op}: the gradient is None; does the loss depend "
                             "on lookup_unique(...).unique_rows?")
        return _checks.row_gradients(f"{self._what}: {op}", self.dim, keys, grads)

    def remove(self, keys) -> tf.Tensor:
        return tf.add_n(self.on_shards(lambda i, s, k: s.remove(k), self._key_vector(keys)))

    def size(self) -> tf.Tensor:
        return tf.add_n(self.on_shards(lambda i, s: s.size()))

    def stats(self) -> Dict[str, tf.Tensor]:
        """Counters summed over the shards, int64 scalars by name: ``size`` (rows held),
        ``admitted`` and ``evicted`` (rows, since the shards were created),
        ``pending_admission`` (keys seen but not admitted yet), ``bytes_used`` (the rows'
        records, key, metadata, value and slots, plus the index) and ``bytes_reserved``
        (all the memory the table holds: the index and every block of row memory it
        mapped, including chunks not filled yet and reserved ``capacity``)."""
        total = tf.add_n(self.on_shards(lambda i, s: s.stats()))
        return {name: total[j] for j, name in enumerate(STATS_FIELDS)}

    def tier_stats(self) -> Dict[str, tf.Tensor]:
        """A tiered table's disk tier (``TieredBackend``), summed over the shards, int64
        scalars by name: ``ram_bytes`` (what counts against the shards' budgets),
        ``disk_rows``, ``disk_bytes``, ``bytes_written`` (spills and compactions),
        ``bytes_spilled`` (of rows moved to disk), ``bytes_read``, ``read_calls``,
        ``rows_spilled``, ``rows_faulted`` (read back), ``segments``, ``index_bytes``."""
        if not all(hasattr(s, "tier_stats") for s in self.shards):
            raise ValueError(f"{self._what} keeps its rows in RAM: it has no disk tier "
                             "(create it with backend=tfpsx.embedding.TieredBackend(...))")
        total = tf.add_n(self.on_shards(lambda i, s: s.tier_stats()))
        return {name: total[j] for j, name in enumerate(bindings.TIER_STATS_FIELDS)}

    def prefetch(self, ids) -> tf.Tensor:
        """Asks the shards with a disk tier (``TieredBackend``) to bring the rows of
        ``ids`` that are on disk into RAM ahead of the step that uses them: a prefetch
        reads without the shard's lock, so on a server it overlaps the step running
        before (another thread, another core), and the step then finds its rows in RAM.
        A hint: the rows stay in RAM until the next prefetch, and a batch's rows that do
        not fit in a tenth of a shard's ``ram_bytes`` come in with their operation.
        int64 scalar: the rows brought back (0 where no shard has a disk tier)."""
        keys = tf.reshape(self._keys(ids), [-1])
        if not any(hasattr(s, "prefetch") for s in self.shards):
            return tf.constant(0, tf.int64)
        return tf.add_n(self.on_shards(
            lambda i, s, k: s.prefetch(k) if hasattr(s, "prefetch")
            else tf.constant(0, tf.int64), keys))

    def evict(self, min_step=None, keep_top_n=None) -> tf.Tensor:
        """Evicts rows last updated before ``min_step`` (TTL) and/or keeps the top-N most
        frequent rows per shard (``keep_top_n`` >= 0); returns how many rows went."""
        min_step, keep = _checks.evict_args(self._what, min_step, keep_top_n)
        min_step = tf.constant(INT64_MIN, tf.int64) if min_step is None else min_step
        keep = tf.constant(-1, tf.int64) if keep is None else keep
        return tf.add_n(self.on_shards(lambda i, s: s.evict(min_step, keep)))

    def export(self, since_step=None) -> Dict[str, tf.Tensor]:
        """Every row (or those updated at ``since_step`` or later: a delta export), all
        shards merged: keys, values [n, dim], slots [n, num_slots, dim], freq, step."""
        since = tf.constant(INT64_MIN, tf.int64) if since_step is None else tf.cast(since_step, tf.int64)
        parts = self.on_shards(lambda i, s: s.export(since))
        return {name: tf.concat([p[j] for p in parts], axis=0)
                for j, name in enumerate(EXPORT_FIELDS)}

    def checkpoint_export(self, full) -> Dict[str, tf.Tensor]:
        """An incremental checkpoint's part of this table, all shards merged.

        ``full`` (a bool, or a bool tensor): every row, as ``export()``, and each shard
        tracks its writes from then on. Otherwise a delta: the rows written (inserted,
        updated, counted by a lookup, imported) and the keys removed (``removed``) since
        the previous ``checkpoint_export``. ``complete`` is False when some shard has no
        full export as its base (a restarted server, or a clearing import since): the
        delta is then unusable, save a full one. Each call starts the next delta.
        """
        full = tf.convert_to_tensor(full, tf.bool)
        parts = self.on_shards(lambda i, s: s.checkpoint_export(full))
        out = {name: tf.concat([p[j] for p in parts], axis=0)
               for j, name in enumerate(EXPORT_FIELDS + ("removed",))}
        out["complete"] = tf.reduce_all(tf.stack([p[-1] for p in parts]))
        return out

    # A paged export (tfpsx.checkpoint.pages): shards with a disk tier export in key
    # ranges, so that a full checkpoint or a serving export takes a page of their RAM.
    @property
    def paged(self) -> bool:
        """Whether this table's checkpoints read its shards in pages (a disk tier:
        TieredBackend)."""
        return all(s.paged for s in self.shards)

    def page_bounds(self, arm) -> List[tf.Tensor]:
        """Per shard, int64 ``[m]``: the keys splitting it into m + 1 pages (a 32nd of its
        ``ram_bytes`` of rows each). ``arm``: a paged full checkpoint starts (each shard
        tracks its writes from now on; :meth:`checkpoint_export`'s ``full``)."""
        arm = tf.convert_to_tensor(arm, tf.bool)
        return self.on_shards(lambda i, s: s.page_bounds(arm))

    def export_range(self, shard: int, lo, hi, delta: bool = False) -> Dict[str, tf.Tensor]:
        """Shard ``shard``'s rows with ``lo <= key <= hi`` (one page), as :meth:`export`;
        ``delta``: of the delta :meth:`delta_begin` began."""
        self._before_shard_ops()
        with on_device(self.shards[shard].device):
            rows = self.shards[shard].export_range(lo, hi, delta=delta)
        return dict(zip(EXPORT_FIELDS, rows))

    def delta_begin(self) -> Dict[str, object]:
        """A delta checkpoint in pages begins (:meth:`checkpoint_export` with ``full``
        false, its rows read afterwards by ``export_range(..., delta=True)``): removed
        (all shards), complete, and per shard its page bounds."""
        got = self.on_shards(lambda i, s: s.delta_begin())
        return {"removed": tf.concat([g[0] for g in got], axis=0),
                "complete": tf.reduce_all(tf.stack([g[1] for g in got])),
                "bounds": [g[2] for g in got]}

    @property
    def page_rows(self) -> Optional[int]:
        """Rows a restore imports at a time (a page of the smallest shard's), or None
        (all at once) for a table in RAM."""
        return min(s.page_rows() for s in self.shards) if self.paged else None

    def apply_checkpoint(self, rows: Dict[str, tf.Tensor], full: bool):
        """Applies one part of :meth:`checkpoint_export`: a full one replaces the
        table's rows; a delta removes ``rows["removed"]``, then writes its rows."""
        removed = self._key_vector(rows["removed"])
        fields = {f: rows[f] for f in EXPORT_FIELDS}
        if full:
            return self.import_rows(fields, clear=True)
        gone = self.remove(removed)
        with tf.control_dependencies([gone] if not tf.executing_eagerly() else []):
            return self.import_rows(fields, clear=False)

    def import_rows(self, rows: Dict[str, tf.Tensor], clear: bool = True):
        """Loads exported rows (from any shard count) into this table's shards.

        ``rows`` needs every field ``export()`` returns: keys ``[n]`` (integers), values
        ``[n, dim]``, slots ``[n, num_slots, dim]`` (this table's optimizer's slot count)
        or empty (``[0]``, or ``[n, 0, dim]`` as a table without an optimizer exports:
        the slots then start from the optimizer's initial values), freq and step ``[n]``
        (integers). Slots of another slot count are refused; another optimizer's slots of
        the same count cannot be told apart and are loaded as they are.

        Raises:
          ValueError: a missing or unknown field, a wrong dtype or shape (naming the table,
            the field, the shape given and the one expected), before any shard changes.
            In a graph, what only the running graph knows is checked by asserts that every
            shard's import waits for: the run fails with the same message, and no shard
            changes.
        """
        checked = _checks.import_rows(self._what, self.dim, self.num_slots, rows)
        columns = [checked[f] for f in EXPORT_FIELDS[1:]]
        return self._group(self.on_shards(
            lambda i, s, k, v, sl, f, st: s.import_rows(k, v, sl, f, st, clear),
            checked["keys"], columns))

"""The storage seam of a table: one shard's backend, behind one interface.

A :class:`TableStorage` is one shard of one table on one device: it knows how to find,
insert, accumulate, apply an optimizer, remove, count, evict, export and import rows and
track changed keys, and nothing about sharding or training modes. A :class:`Backend`
creates shards (TFRA's ``KVCreator`` shape). Today's backend is
:class:`HashTableBackend` (the ``TfpsxHashTable`` resource of the C++ core), which also
holds worker caches (:mod:`tfpsx.embedding.cache`); a GPU store plugs in as a further
backend.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
from typing import Optional, Sequence, Tuple

import tensorflow as tf

from tfpsx import graph_state
from tfpsx.embedding.initializers import Initializer
from tfpsx.ops import bindings


def on_device(device: Optional[str]):
    """``tf.device(device)``, or no change for None (a local shard stays where the
    surrounding placement puts it)."""
    return tf.device(device) if device else contextlib.nullcontext()


# How ``accumulate`` adds the pushes of several workers to one row (the pusher is
# ``skip_reader``; the others: the c pushes of the row since the pusher last took its
# changed keys): "sum": every delta whole; "mean": the row moves to the mean of the
# pushes (exact when they started from one value: GEO's rounds with barriers); "scaled":
# delta / (1 + c) (GEO's background communicator). See :mod:`tfpsx.embedding.row_copy`
# and :mod:`tfpsx.modes.geo.rule`.
COMBINE = ("sum", "mean", "scaled")


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """What a backend needs to create one shard."""
    shared_name: str           # e.g. "user/part_0": every client naming it reaches it
    dim: int
    initializer: Initializer
    slot_init: Tuple[float, ...]
    seed: int
    min_frequency: int
    capacity: int              # rows to reserve in this shard (0: none)


class TableStorage(abc.ABC):
    """One shard. Keys are int64 vectors, rows float32 ``[n, dim]``, steps int64 scalars;
    methods return tensors (graph mode) or values (eager) and run on ``device``."""

    def __init__(self, spec: ShardSpec, device: Optional[str]):
        self.spec, self.device = spec, device

    @abc.abstractmethod
    def find(self, keys, with_slots: bool = False) -> Tuple[tf.Tensor, tf.Tensor]:
        """(rows, found): a missing key gets its initial row, nothing is stored.
        ``with_slots``: rows of ``[value | optimizer slots]`` (``dim * (1 + slots)``
        floats; a missing key's slots at their initial values)."""

    @abc.abstractmethod
    def find_or_insert(self, keys, step) -> tf.Tensor:
        """Rows, inserting missing keys (subject to admission) and counting frequencies."""

    @abc.abstractmethod
    def insert(self, keys, values, step, with_slots: bool = False):
        """Sets the rows of ``keys``; ``with_slots``: rows of ``[value | optimizer
        slots]``, written whole."""

    @abc.abstractmethod
    def accumulate(self, keys, deltas, step, skip_reader: int = -1, combine: str = "sum",
                   with_slots: bool = False):
        """row += delta; a missing key starts from its initial row; marked changed for
        every changed-key reader but ``skip_reader``. ``combine`` (one of
        :data:`COMBINE`): how the pushes of several workers to one row add up.
        ``with_slots``: deltas of ``[value | optimizer slots]``, summed."""

    @abc.abstractmethod
    def apply(self, optimizer, keys, grads, step):
        """The server-side ``optimizer`` (a :class:`SparseOptimizer`) on unique ``keys``."""

    @abc.abstractmethod
    def remove(self, keys) -> tf.Tensor:
        """Removes keys; returns how many were present."""

    @abc.abstractmethod
    def size(self) -> tf.Tensor:
        ...

    @abc.abstractmethod
    def stats(self) -> tf.Tensor:
        """[size, admitted, evicted, pending_admission, bytes_used, bytes_reserved]
        (int64; see ``ShardedTable.stats``)."""

    @abc.abstractmethod
    def evict(self, min_step, keep_top_n) -> tf.Tensor:
        """Rows last updated before ``min_step``, then all but the ``keep_top_n`` most
        frequent (int64 minimum / -1: skip); returns how many went."""

    @abc.abstractmethod
    def export(self, since_step) -> Sequence[tf.Tensor]:
        """(keys, values, slots, freq, step) of the rows updated at ``since_step`` or later."""

    @abc.abstractmethod
    def page_bounds(self, arm: bool, max_rows: int = 0) -> tf.Tensor:
        """int64 [m]: keys splitting the shard into m + 1 pages for ``export_range``
        (tfpsx.checkpoint.pages); ``arm``: a paged full checkpoint starts."""

    @abc.abstractmethod
    def export_range(self, lo, hi, delta: bool = False) -> Sequence[tf.Tensor]:
        """(keys, values, slots, freq, step) of the rows with ``lo <= key <= hi``."""

    # Whether full checkpoints and deltas read this shard in pages (a disk tier's do).
    paged = False

    @abc.abstractmethod
    def checkpoint_export(self, full) -> Sequence[tf.Tensor]:
        """(keys, values, slots, freq, step, removed, complete): every row (``full``), or
        the rows written and keys removed since the previous call, for incremental
        checkpoints; ``complete`` is False when no full export is the delta's base."""

    @abc.abstractmethod
    def import_rows(self, keys, values, slots, freq, step, clear: bool):
        """Writes exported rows back (``clear``: replacing the shard's contents)."""

    @abc.abstractmethod
    def take_changed(self, reader) -> tf.Tensor:
        """Keys changed since ``reader``'s last call; its first call registers it."""

    @abc.abstractmethod
    def take_changed_among(self, reader, keys) -> tf.Tensor:
        """Of the keys changed since ``reader``'s last take, those among ``keys``; the
        others stay marked for a later take (its first call registers it)."""

    def cache_find(self, keys, step) -> Tuple[tf.Tensor, tf.Tensor]:
        """(rows, found) as ``find``; a present key's frequency is counted and its step
        set (a worker cache's LFU / LRU bookkeeping). Nothing is inserted."""
        raise NotImplementedError(f"{type(self).__name__} cannot hold a worker cache")

    def cache_victims(self, count, by_step) -> tf.Tensor:
        """Keys of the ``count`` rows a cache evicts first (lowest frequency, or with
        ``by_step`` the oldest step), not removed."""
        raise NotImplementedError(f"{type(self).__name__} cannot hold a worker cache")


class Backend(abc.ABC):
    """Creates the shards of tables (one backend serves many tables)."""

    @abc.abstractmethod
    def create(self, spec: ShardSpec, device: Optional[str]) -> TableStorage:
        ...


class HashTableStorage(TableStorage):
    """A shard in a ``TfpsxHashTable`` resource: created on first use on its device, found
    again by every client (and graph) that names the same ``shared_name`` there."""

    def __init__(self, spec: ShardSpec, device: Optional[str]):
        super().__init__(spec, device)
        self._eager_handle = None

    def handle(self) -> tf.Tensor:
        """The resource handle, made once per graph (and once for eager code)."""
        if tf.executing_eagerly():
            if self._eager_handle is None:
                self._eager_handle = self._make_handle()
            return self._eager_handle
        # The same spec on the same device is the same handle op in a graph.
        handles = graph_state.of().table_handles
        key = (self.spec, self.device)
        if key not in handles:
            handles[key] = self._make_handle()
        return handles[key]

    # (directory, ram_bytes) of a disk tier; ("", 0): all in RAM.
    _tier: Tuple[str, int] = ("", 0)

    def _make_handle(self) -> tf.Tensor:
        s = self.spec
        # Made once and used by every later op: it must not inherit the control
        # dependencies of whichever op happened to need it first.
        with tf.control_dependencies(None), on_device(self.device):
            return bindings.table_handle(
                s.shared_name, s.dim, s.slot_init, s.initializer.kind, s.initializer.a,
                s.initializer.b, s.seed, s.min_frequency, s.capacity, *self._tier)

    def _run(self, op, *args, **kwargs):
        handle = self.handle()
        with on_device(self.device):
            return op(handle, *args, **kwargs)

    def find(self, keys, with_slots: bool = False):
        return self._run(bindings.table_find, keys, with_slots=with_slots)

    def find_or_insert(self, keys, step):
        return self._run(bindings.table_find_or_insert, keys, step)

    def insert(self, keys, values, step, with_slots: bool = False):
        return self._run(bindings.table_insert, keys, values, step, with_slots=with_slots)

    def accumulate(self, keys, deltas, step, skip_reader: int = -1, combine: str = "sum",
                   with_slots: bool = False):
        return self._run(bindings.table_accumulate, keys, deltas, step,
                         skip_reader=skip_reader, combine=combine, with_slots=with_slots)

    def apply(self, optimizer, keys, grads, step):
        return self._run(bindings.table_apply, optimizer.name, keys, grads,
                         optimizer.hyperparameters(), step)

    def remove(self, keys):
        return self._run(bindings.table_remove, keys)

    def size(self):
        return self._run(bindings.table_size)

    def stats(self):
        return self._run(bindings.table_stats)

    def evict(self, min_step, keep_top_n):
        return self._run(bindings.table_evict, min_step, keep_top_n)

    def export(self, since_step):
        return self._run(bindings.table_export, since_step)

    def page_bounds(self, arm: bool, max_rows: int = 0) -> tf.Tensor:
        """int64 [m]: keys splitting the shard into m + 1 pages of about ``max_rows``
        rows (0: a 32nd of ``ram_bytes`` of rows for a shard with a disk tier; one in RAM
        is one page); ``arm``: a paged full checkpoint starts (the shard tracks its
        writes from now on, as after a full checkpoint export)."""
        return self._run(bindings.table_page_bounds, max_rows, arm)

    def export_range(self, lo, hi, delta: bool = False):
        """(keys, values, slots, freq, step) of the rows with ``lo <= key <= hi``;
        ``delta``: of the delta a disk tier's ``delta_begin`` began, read where they are
        now."""
        return self._run(bindings.table_export_range, lo, hi, delta=delta)

    def checkpoint_export(self, full):
        return self._run(bindings.table_checkpoint_export, full)

    def import_rows(self, keys, values, slots, freq, step, clear: bool):
        return self._run(bindings.table_import, keys, values, slots, freq, step, clear)

    def take_changed(self, reader):
        return self._run(bindings.table_take_changed, reader)

    def take_changed_among(self, reader, keys):
        return self._run(bindings.table_take_changed_among, reader, keys)

    def cache_find(self, keys, step):
        return self._run(bindings.table_cache_find, keys, step)

    def cache_victims(self, count, by_step):
        return self._run(bindings.table_cache_victims, count, by_step)


class HashTableBackend(Backend):
    """Shards in the C++ core's growing hash table (the default backend)."""

    def create(self, spec: ShardSpec, device: Optional[str]) -> TableStorage:
        return HashTableStorage(spec, device)


HASH_TABLE = HashTableBackend()


# A page of a paged checkpoint: this fraction of a tiered shard's ram_bytes of rows
# (TieredTable::kPageFraction in the core).
PAGE_FRACTION = 32


class TieredStorage(HashTableStorage):
    """A shard whose rows beyond a RAM budget live on its server's local disk."""

    def __init__(self, spec: ShardSpec, device: Optional[str], directory: str, ram_bytes: int):
        super().__init__(spec, device)
        self._tier = (directory, ram_bytes)

    def tier_stats(self) -> tf.Tensor:
        """int64 [len(bindings.TIER_STATS_FIELDS)]: the shard's disk tier."""
        return self._run(bindings.table_tier_stats)

    def prefetch(self, keys) -> tf.Tensor:
        """Brings the disk rows of ``keys`` into RAM ahead of their step, reading without
        the shard's lock; int64 scalar: the rows brought back."""
        return self._run(bindings.table_prefetch, keys)

    # A paged checkpoint (tfpsx.checkpoint.pages): a shard's rows in key ranges of a 32nd
    # of ram_bytes, so that saving it takes a page of RAM, not the shard's size.
    paged = True

    def delta_begin(self, max_rows: int = 0) -> Sequence[tf.Tensor]:
        """(removed, complete, bounds): a delta checkpoint in pages begins (as
        ``checkpoint_export(False)``, its rows left where they are); ``bounds`` split the
        written keys into pages of ``max_rows`` (0: a 32nd of ram_bytes of rows)."""
        return self._run(bindings.table_delta_begin, max_rows)

    def page_rows(self) -> int:
        """Rows of a page, as the ops' default (TieredTable::PageRows: a
        ``PAGE_FRACTION``-th of ram_bytes of records)."""
        record = 20 + 4 * self.spec.dim * (1 + len(self.spec.slot_init))
        return max(1, self._tier[1] // PAGE_FRACTION // record)

    def cache_find(self, keys, step):
        raise ValueError(f"table shard {self.spec.shared_name!r} has a disk tier "
                         "(TieredBackend): it cannot hold a worker cache, which keeps its "
                         "rows in RAM by design; give the cache the default backend")

    cache_victims = cache_find


class TieredBackend(Backend):
    """Shards larger than RAM: each keeps its hot rows in RAM within ``ram_bytes`` and the
    rest in ``directory/<table>/part_<i>`` on the local disk of the server that holds it.

    Rows move whole (value, optimizer slots, frequency, step): a lookup of a row on disk
    brings it back, in one batched read per op; when RAM passes 90% of ``ram_bytes`` the
    least recently updated rows go to disk, down to 75%. ``ram_bytes`` counts the RAM
    table, the index of the disk rows (4.2-8 bytes a key) and its bookkeeping. The files
    belong to the server process: a restarted server discards them and restores its
    checkpoint. See docs/tables.md ("Tables larger than RAM").

    Args:
      directory: a folder on each server's local disk (created when missing).
      ram_bytes: the RAM budget of each shard, in bytes (at least a few MB: a shard
        says the least it works with when created, and ops fail with the size a batch
        needs when one batch's rows would not fit in a tenth of it).

    Example::

        table = tfpsx.embedding.DynamicTable(
            "user", dim=16, optimizer=tfpsx.embedding.Adagrad(0.05),
            backend=tfpsx.embedding.TieredBackend("/mnt/ssd/tfpsx", ram_bytes=2 << 30))
    """

    def __init__(self, directory: str, ram_bytes: int):
        if not isinstance(directory, str) or not directory:
            raise ValueError(f"TieredBackend: directory must be a non-empty path, got "
                             f"{directory!r}")
        if isinstance(ram_bytes, bool) or not isinstance(ram_bytes, int) or ram_bytes <= 0:
            raise ValueError(f"TieredBackend: ram_bytes must be a positive int (bytes of RAM "
                             f"per shard), got {ram_bytes!r}")
        self.directory, self.ram_bytes = directory, ram_bytes

    def create(self, spec: ShardSpec, device: Optional[str]) -> TableStorage:
        return TieredStorage(spec, device, self.directory, self.ram_bytes)

    def __repr__(self) -> str:
        return f"TieredBackend({self.directory!r}, ram_bytes={self.ram_bytes})"

"""Python bindings of the tfpsx ops: the only code that calls the op library.

One function per op, named after it, with the op's inputs as arguments (tensors or
values TF converts). The ops themselves are declared in ``custom_ops/cc/ops/``; their
names carry the fixed ``Tfpsx`` prefix, since renaming an op breaks saved graphs.
Higher layers never touch the loaded module: tables go through
:mod:`tfpsx.embedding.storage`, the PS-0 counters through :mod:`tfpsx.control.counters`.
"""

from __future__ import annotations

from typing import Sequence

from tfpsx.ops.loader import load_ops

# ----------------------------------------------------------------------------- counters
# A shared counter and member set on a parameter server (the control plane without a
# scheduler: started/stopped workers, barriers, heartbeats).


def counter_handle(shared_name: str):
    return load_ops().tfpsx_counter_handle_op(shared_name=shared_name)


def counter_add(handle, delta):
    return load_ops().tfpsx_counter_add(handle, delta)


def counter_read(handle):
    return load_ops().tfpsx_counter_read(handle)


def counter_mark(handle, member):
    return load_ops().tfpsx_counter_mark(handle, member)


def counter_members(handle):
    return load_ops().tfpsx_counter_members(handle)


# ----------------------------------------------------------------------------- tables
# A dynamic embedding table shard (int64 key -> float32 row of dim, optimizer slots and
# metadata beside it) on the device the handle op runs on.


def table_handle(shared_name: str, dim: int, slot_init: Sequence[float], initializer: str,
                 init_a: float, init_b: float, seed: int, min_frequency: int, capacity: int,
                 tier_directory: str = "", tier_ram_bytes: int = 0):
    """Creates (on first run) or finds the table ``shared_name`` on the current device;
    with ``tier_directory``, its rows beyond ``tier_ram_bytes`` of RAM live on disk."""
    return load_ops().tfpsx_hash_table_handle_op(
        shared_name=shared_name, dim=dim, num_slots=len(slot_init), slot_init=list(slot_init),
        initializer=initializer, init_a=init_a, init_b=init_b, seed=seed,
        min_frequency=min_frequency, capacity=capacity, tier_directory=tier_directory,
        tier_ram_bytes=tier_ram_bytes)


def table_find(handle, keys, with_slots: bool = False):
    """(rows, found): a missing key gets its initial row and found=False; with_slots:
    rows of [value | optimizer slots]."""
    return load_ops().tfpsx_hash_table_find(handle, keys, with_slots=with_slots)


def table_cache_find(handle, keys, step):
    """(rows, found) like ``table_find``; a present key is touched (frequency counted,
    step set): a worker cache's lookup."""
    return load_ops().tfpsx_hash_table_cache_find(handle, keys, step)


def table_cache_victims(handle, count, by_step):
    """Keys of the ``count`` rows to evict first (LFU, or LRU with ``by_step``), kept."""
    return load_ops().tfpsx_hash_table_cache_victims(handle, count, by_step)


def table_find_or_insert(handle, keys, step):
    return load_ops().tfpsx_hash_table_find_or_insert(handle, keys, step)


def table_insert(handle, keys, values, step, with_slots: bool = False):
    return load_ops().tfpsx_hash_table_insert(handle, keys, values, step,
                                              with_slots=with_slots)


def table_accumulate(handle, keys, deltas, step, skip_reader: int = -1, combine: str = "sum",
                     with_slots: bool = False):
    return load_ops().tfpsx_hash_table_accumulate(handle, keys, deltas, step,
                                                  skip_reader=skip_reader, combine=combine,
                                                  with_slots=with_slots)


def optimizer_registry():
    """The server-side optimizers the library was built with, in registration order:
    ``[(name, num_slots, (hyperparameter, ...)), ...]`` (the C++ registry, the one source
    of truth the Python specs are checked against)."""
    import tensorflow as tf

    ops = load_ops()
    # A graph and in-process session of its own: the same in eager code, in a graph
    # being built and in a process with eager execution disabled.
    with tf.Graph().as_default() as graph:
        fetches = ops.tfpsx_optimizer_registry()
        with tf.compat.v1.Session(graph=graph) as session:
            names, slots, hparams = session.run(fetches)
    return [(n.decode(), int(k), tuple(h.decode().split(",")) if h else ())
            for n, k, h in zip(names, slots, hparams)]


def table_apply(handle, optimizer: str, keys, grads, hparams, step):
    """The server-side optimizer ``optimizer`` applied to the rows of (unique) ``keys``;
    ``hparams`` in the optimizer's order (see :mod:`tfpsx.embedding.optimizers`)."""
    return load_ops().tfpsx_hash_table_apply(handle, keys, grads, hparams, step,
                                             optimizer=optimizer)


def table_remove(handle, keys):
    return load_ops().tfpsx_hash_table_remove(handle, keys)


def table_prefetch(handle, keys):
    return load_ops().tfpsx_hash_table_prefetch(handle, keys)


def table_size(handle):
    return load_ops().tfpsx_hash_table_size(handle)


def table_stats(handle):
    """[size, admitted, evicted, pending_admission, bytes_used, bytes_reserved]: what the
    rows held take (records and index) and all the table holds (index and every block of
    row memory it mapped)."""
    return load_ops().tfpsx_hash_table_stats(handle)


# The fields of ``table_tier_stats``, in order.
TIER_STATS_FIELDS = ("ram_bytes", "disk_rows", "disk_bytes", "bytes_written", "bytes_spilled",
                     "bytes_read", "read_calls", "rows_spilled", "rows_faulted", "segments",
                     "index_bytes")


def table_tier_stats(handle):
    """A tiered table's disk tier, int64 in ``TIER_STATS_FIELDS`` order (zeros in RAM)."""
    return load_ops().tfpsx_hash_table_tier_stats(handle)


def table_evict(handle, min_step, keep_top_n):
    return load_ops().tfpsx_hash_table_evict(handle, min_step, keep_top_n)


def table_export(handle, since_step):
    """(keys, values, slots, freq, step) of the rows updated at ``since_step`` or later."""
    return load_ops().tfpsx_hash_table_export(handle, since_step)


def table_page_bounds(handle, max_rows, arm):
    """int64 [m]: keys splitting the table into m + 1 pages of about ``max_rows`` rows
    (0: a tiered table's default; a table in RAM is then one page); ``arm``: a paged
    full checkpoint starts (tracking armed as by a full checkpoint export)."""
    return load_ops().tfpsx_hash_table_page_bounds(handle, max_rows, arm)


def table_export_range(handle, lo, hi, delta: bool = False):
    """(keys, values, slots, freq, step) of the rows with ``lo <= key <= hi``, sorted;
    ``delta``: of the keys of the delta ``table_delta_begin`` began."""
    return load_ops().tfpsx_hash_table_export_range(handle, lo, hi, delta=delta)


def table_delta_begin(handle, max_rows):
    """(removed, complete, bounds): a tiered table's delta checkpoint in pages begins
    (its marks taken, the written keys kept); read each page with
    ``table_export_range(..., delta=True)``."""
    return load_ops().tfpsx_hash_table_delta_begin(handle, max_rows)


def table_checkpoint_export(handle, full):
    """(keys, values, slots, freq, step, removed, complete): all rows when ``full`` (and
    tracking armed), else the rows written and keys removed since the previous call;
    ``complete`` is False when no full export is its base (save a full one)."""
    return load_ops().tfpsx_hash_table_checkpoint_export(handle, full)


def table_import(handle, keys, values, slots, freq, step, clear: bool):
    return load_ops().tfpsx_hash_table_import(handle, keys, values, slots, freq, step,
                                              clear=clear)


def table_take_changed(handle, reader):
    """Keys changed since ``reader``'s previous call (its first call registers it)."""
    return load_ops().tfpsx_hash_table_take_changed(handle, reader)


def table_take_changed_among(handle, reader, keys):
    """Of the keys changed since ``reader``'s previous take, those among ``keys``
    (sorted); the others stay marked."""
    return load_ops().tfpsx_hash_table_take_changed_among(handle, reader, keys)


# ---------------------------------------------------------------- GEO's row routing
# (tfpsx.modes.geo.hot_rows: a table's batch split between the PS and the worker's copy
# by its async flag and hot mask; with the flag on the inputs are forwarded, not copied.)


def geo_split_keys(on_ps, keys, hot):
    """(hot_out, ps_keys, tail_keys, at_hot, at_tail, held) of unique ``keys``; ``held``
    is int64 [keys, the PS's keys]."""
    return load_ops().tfpsx_geo_split_keys(on_ps, keys, hot)


def geo_split_rows(on_ps, keys, rows, hot):
    """(ps_keys, ps_rows, tail_keys, tail_rows) of unique ``keys`` and one row each."""
    return load_ops().tfpsx_geo_split_rows(on_ps, keys, rows, hot)


def geo_stitch_rows(on_ps, ps_rows, tail_rows, at_hot, at_tail):
    """The rows of ``geo_split_keys``' keys, in their order."""
    return load_ops().tfpsx_geo_stitch_rows(on_ps, ps_rows, tail_rows, at_hot, at_tail)


# ---------------------------------------------------------------- the data plane
# (custom_ops/cc/ops/split_ops.cc; the Python side is tfpsx.control.splits, tfpsx.data)
SPLIT_STATS_FIELDS = ("first_open", "splits", "done", "leased", "left", "leases_returned")


def split_handle(shared_name: str):
    return load_ops().tfpsx_split_coordinator_handle_op(shared_name=shared_name)


def split_configure(handle, digest, seed, files, starts, ends, lease_ms):
    return load_ops().tfpsx_split_configure(handle, digest, seed, files, starts, ends, lease_ms)


def split_take(handle, worker, epoch):
    """(status, key, epoch, file, start, resume, end)."""
    return load_ops().tfpsx_split_take(handle, worker, epoch)


def split_commit(handle, keys, offsets):
    return load_ops().tfpsx_split_commit(handle, keys, offsets)


def split_renew(handle, worker, release: bool = False):
    return load_ops().tfpsx_split_renew(handle, worker, release)


def split_give_back(handle, worker, keys):
    return load_ops().tfpsx_split_give_back(handle, worker, keys)


def split_barrier(handle, action, worker, value):
    """(generation, up, waiting) of the input's exact-save barrier after ``action``
    (0 state, 1 begin for ``value`` ms, 2 ``worker`` acks generation ``value``, 3 end
    generation ``value``)."""
    return load_ops().tfpsx_split_barrier(handle, action, worker, value)


STREAM_CONFIGURE, STREAM_APPEND, STREAM_FILES, STREAM_STOP = 0, 1, 2, 3


def split_stream(handle, action, digest, seed, lease_ms, names, files, starts, ends, start):
    """A stream input's coordinator (action STREAM_*): (value, file names)."""
    return load_ops().tfpsx_split_stream(handle, action, digest, seed, lease_ms, names, files,
                                         starts, ends, start)


def split_stats(handle):
    return load_ops().tfpsx_split_stats(handle)


def split_export(handle):
    return load_ops().tfpsx_split_export(handle)


def split_import(handle, state):
    return load_ops().tfpsx_split_import(handle, state)


def read_split(path, start, resume, end, max_bytes, format: str = "text"):
    """(records, ends, next) of one split's chunk."""
    return load_ops().tfpsx_read_split(path, start, resume, end, max_bytes, format=format)

"""The worker cache of a table: the hot rows on the worker, the rest on the PS.

``DynamicTable(..., cache_size=N)`` keeps up to N rows of the table in a hash table on
this worker (the C++ core's table, with the table's optimizer and slots) and a snapshot
``old`` of each beside it:

* a training lookup reads cached rows locally; the misses are fetched from the PS shards
  in one batched call per shard (none when every id hits) and enter the cache, with
  ``old`` = the fetched row. Rows staged by :meth:`WorkerCache.prefetch` are taken
  instead of fetching;
* gradients train the cached rows locally (the table's optimizer, on the worker);
* every ``flush_steps`` updates, between two steps (``tfpsx.MonitoredTrainingSession``
  and Keras ``fit`` do it; a loop of your own calls :meth:`WorkerCache.flush`), and at
  the end of training, the cache syncs with the PS as a copy of the table's rows
  (:mod:`tfpsx.embedding.row_copy`, which GEO's tables sync by too): the trained rows
  are pushed as ``local - old`` and the cached rows other workers changed are pulled
  back. In async every update reaches the PS whole; in GEO mode the mode's
  communicator runs the sync every K steps, and the PS combines the pushes of a row that
  several workers trained from the same value as it does for GEO's tables;
* when a training lookup finds more than N rows cached, the excess and a 1/16 margin are
  evicted (least frequently looked up first: ``"lfu"``, or least recently: ``"lru"``),
  their deltas pushed first, so nothing trained is lost. A batch with more distinct ids
  than N is served whole (the cache holds it for the step, then evicts).

* admission (``cache_admit_after=K``, default 1: every miss enters): a missed row enters
  the cache at its K-th sighting among recent misses (a count-min sketch on the worker,
  halved every ``10 * cache_size`` missed ids, TinyLFU's aging). A row not admitted is
  served from the PS for the step and its gradient goes to the PS's optimizer directly,
  as without a cache: the one-off ids of a long tail pass by instead of evicting hot
  rows (each eviction pushes a delta, each admission inserts twice).

Hot rows so train as in GEO (local updates, synced every ``flush_steps``), cold rows as the
table's mode does. The cached rows' optimizer slots are the worker's: an evicted row's
slots are dropped, and a fetched row's start from the optimizer's initial values (as GEO's
worker copy under the earlier rule). With ``share_slots`` (GEO's rule for many workers)
a row travels with its slots instead: fetched, staged, synced and evicted as ``[value |
slots]``, summed on the PS (:mod:`tfpsx.embedding.row_copy`). Counters (hit rate, rows
fetched and flushed, evictions, bytes) are in :meth:`WorkerCache.stats`,
``DynamicTable.stats()`` and the training logs.
"""

from __future__ import annotations

import threading
from typing import Dict, Optional

import tensorflow as tf

from tfpsx import graph_state
from tfpsx.embedding.cache.admission import AdmissionSketch
from tfpsx.embedding.cache.options import CacheOptions
from tfpsx.embedding.cache.sync import FlushSchedule, track_eager
from tfpsx.embedding.row_copy import (RowCopy, global_rows, push_rows, row_bytes, set_rows,
                                     table_pull, table_push, table_readers)
from tfpsx.embedding.sharding import EmbeddingLookup, ShardedTable, as_step
from tfpsx.embedding.storage import on_device

COUNTER_FIELDS = ("lookups", "hits", "rows_fetched", "bytes_fetched", "rows_flushed",
                  "bytes_flushed", "evictions", "rows_refreshed", "prefetched", "flushes",
                  "not_admitted")
_STATE = ("registered", "clock", "updates", "sketched")


# The cache's methods build graph code already (no Python control flow on tensors):
# AutoGraph need not convert them when a tf.function (a Keras train step) calls them.
_graph_code = tf.autograph.experimental.do_not_convert


def _after(deps, fn):
    """``fn()`` after ``deps`` (graph and tf.function; eager code runs in order)."""
    deps = [d for d in tf.nest.flatten(deps) if d is not None]
    if tf.executing_eagerly() or not deps:
        return fn()
    with tf.control_dependencies(deps):
        return fn()


def _when(pred, fn):
    """Runs the ops of ``fn()`` only when ``pred`` holds; returns a bool tensor to wait on.
    Only for worker-local ops: a PS op under a ``tf.cond`` makes every step wait one
    more round trip for the predicate (the cond lowers to switches on both sides)."""
    def run():
        return _after(fn(), lambda: tf.constant(True))
    return tf.cond(pred, run, lambda: tf.constant(False))


def _unless_empty(keys, fn, empty):
    """``fn()``, which must handle empty ``keys``; eager code skips it when they are
    empty (one RPC less), graphs always run it (see :func:`_when`)."""
    if tf.executing_eagerly() and int(tf.size(keys)) == 0:
        return empty()
    return fn()


class WorkerCache(ShardedTable):
    """The cache of ``table`` on this worker (see the module doc); the cached rows are
    this one-shard table's, trained by the table's optimizer.

    Args:
      table: the sharded PS table.
      options: a :class:`CacheOptions`.
      device: this worker's device (None: the current one, for a local table).
      reader: this worker's id in the PS shards' changed-key sets.
      scale: the push's n (1: rows push their whole delta, see combine).
      flush_in_step: sync every ``options.flush_steps`` updates, between steps (False:
        GEO mode's communicator syncs).
      wire: the dtype rows travel in to and from the PS (None: float32).
      slot_wire: with ``share_slots``, the dtype their slots travel in (None: ``wire``).
      combine: how the PS adds the syncs of several workers' caches to one row
        (:mod:`tfpsx.embedding.row_copy`: "sum" in async, whole updates as async; GEO's
        own in GEO mode).
      share_slots: rows travel with their optimizer slots both ways (fetched, synced
        and evicted), summed on the PS: GEO's rule for many workers
        (``geo_table_rule="shared_slots"``), where a cached row's steps keep async's
        size instead of restarting from the optimizer's initial slots at every fetch.
      copy_type: the class of :attr:`copy`, the cached rows as a copy of the table's
        (:class:`~tfpsx.embedding.row_copy.RowCopy` or a subclass: GEO mode's adds what
        its front-end tracks of the copy); the cache syncs it by
        :mod:`tfpsx.embedding.row_copy`'s functions only.
    """

    def __init__(self, table: ShardedTable, options: CacheOptions, device: Optional[str],
                 reader: int, scale: float = 1.0, flush_in_step: bool = True,
                 wire: Optional[tf.DType] = None, combine: str = "sum",
                 share_slots: bool = False, copy_type: type = RowCopy,
                 slot_wire: Optional[tf.DType] = None):
        name = f"{table.name}/cache_w{reader}"
        like = dict(initializer=table.initializer, seed=table.seed, devices=[device])
        super().__init__(name, table.dim, optimizer=table.optimizer, **like)
        # With shared slots, old and the staged rows keep the slots a row came with.
        slots = dict(optimizer=table.optimizer if share_slots else None)
        self.old = ShardedTable(f"{name}/old", table.dim, **slots, **like)
        self.staged = ShardedTable(f"{name}/staged", table.dim, **slots, **like)
        self.table, self.options, self.device = table, options, device
        self.scale, self.flush_in_step = scale, flush_in_step
        self.copy = copy_type(table, self, self.old, device, reader, cached=True, wire=wire,
                              slot_wire=slot_wire, combine=combine, share_slots=share_slots)
        # The floats of a row as it travels (with its slots when they are shared).
        self._width = table.row_width if share_slots else table.dim
        # Evict down to this many rows when a lookup finds more than options.size.
        self.evict_to = max(0, options.size - max(1, options.size // 16))
        self.sketch = AdmissionSketch(options.size) if options.admit_after > 1 else None
        self.schedule = FlushSchedule(options.flush_steps, own=flush_in_step)
        # A row's bytes flushed (as the wire carries them), and fetched (float32: a miss
        # reads the PS's row, with its slots when they are shared, as a lookup does)
        self._row_bytes, self._fetch_row_bytes = row_bytes(self.copy), 8 + 4 * self._width
        self._eager_registered = False
        self.apply_ops = []  # the update ops built in graphs
        # Staged by an input pipeline (tfpsx.keras's RowFeeder): training lookups find
        # every row cached and run no PS op; the pipeline fetches, evicts and syncs.
        self.fed = False
        # Held by whatever pushes this cache's deltas outside a step (evictions and
        # syncs of a feeder, GEO's communicator, the final flush): two pushes of one
        # row's delta at once would add it twice.
        self.sync_lock = threading.RLock()

    # ------------------------------------------------------------------ state
    def _vars(self):
        """(state [registered, clock, updates, sketched], counters, the admission sketch
        or None): worker-local variables (``graph_state.worker_local``)."""
        def made(state):
            if state is None:
                track_eager(self)
            else:
                state.worker_caches.append(self)
        return graph_state.worker_local(self, "worker_cache", self.name, self.device,
                                        self._make_vars, made)

    def _make_vars(self, collections):
        made = [tf.compat.v1.Variable(tf.zeros([n], tf.int64), trainable=False,
                                      collections=collections, name=name)
                for n, name in ((len(_STATE), "tfpsx_cache_state"),
                                (len(COUNTER_FIELDS), "tfpsx_cache_counters"))]
        sketch = self.sketch.variable(collections) if self.sketch is not None else None
        return (*made, sketch)

    def _count(self, **values):
        """Adds to the counters (int scalars by name)."""
        counters = self._vars()[1]
        delta = [tf.cast(values.get(f, 0), tf.int64) for f in COUNTER_FIELDS]
        return counters.assign_add(tf.stack(delta))

    def _tick(self, field: str):
        """state[field] += 1; returns the new value."""
        state = self._vars()[0]
        one_hot = tf.one_hot(_STATE.index(field), len(_STATE), dtype=tf.int64)
        return state.assign_add(one_hot)[_STATE.index(field)]

    @_graph_code
    def stats(self) -> Dict[str, tf.Tensor]:
        """The cache's counters by name (int64 scalars), plus ``size`` (rows cached) and
        ``hit_rate`` (float): ``hits`` / ``lookups``, both counting the ids of training
        lookups (an id twice in a batch is two lookups). ``rows_fetched`` counts the
        rows training lookups waited for from the PS, ``prefetched`` those a prefetch
        staged, ``rows_flushed`` the deltas pushed (syncs and evictions),
        ``rows_refreshed`` the rows pulled back; ``bytes_*`` their keys and values."""
        counters = self._vars()[1].read_value()
        out = {f: counters[i] for i, f in enumerate(COUNTER_FIELDS)}
        out["size"] = self.shards[0].size()
        out["hit_rate"] = tf.math.divide_no_nan(tf.cast(out["hits"], tf.float64),
                                                tf.cast(out["lookups"], tf.float64))
        return out

    # ------------------------------------------------------------------ lookups
    @_graph_code
    def lookup_unique(self, ids, train: bool = True, step=None, tape=None) -> EmbeddingLookup:
        keys = self._keys(ids)
        unique, index, counts = tf.unique_with_counts(tf.reshape(keys, [-1]))
        unique_rows = tf.reshape(self.rows(unique, train, step, counts), [-1, self.dim])
        if tape is not None:
            tape.watch(unique_rows)
        embeddings = tf.reshape(tf.gather(unique_rows, index),
                                tf.concat([tf.shape(keys), [self.dim]], axis=0))
        return EmbeddingLookup(unique, unique_rows, index, embeddings)

    lookup_unique.__doc__ = ShardedTable.lookup_unique.__doc__

    @_graph_code
    def rows(self, keys, train: bool, step=None, counts=None) -> tf.Tensor:
        """Rows of unique ``keys``: cached ones locally, the misses from the PS (a
        training lookup caches them, after evicting what exceeds the cache's size).
        ``counts``: how many ids of the batch each key stands for (the hit rate counts
        ids; default one each)."""
        step = as_step(step)
        local = self.shards[0]
        with on_device(self.device):
            if not train:
                cached, found = local.find(keys)
                return self._merge(cached, found, keys, train, step)
            self._register_eagerly()
            state = self._vars()[0]
            registered = _when(tf.equal(state[0], 0), self._register)
            if self.fed:  # the feeder evicts, between its stagings
                return _after(registered, lambda: self._fed_rows(keys))
            evicted = _after(registered, lambda: self._evict_over(step))
            return _after(evicted, lambda: self._train_rows(keys, step, counts))

    def _fed_rows(self, keys):
        """A training lookup of rows :meth:`stage` cached: local only (the staging
        counted the lookups and hits)."""
        cached, found = self.shards[0].cache_find(keys, self._tick("clock"))
        staged = tf.debugging.assert_equal(
            tf.reduce_all(found), True, message=(
                f"worker cache of table {self.table.name!r}: a training step found ids the "
                "input pipeline did not stage; the cache is fed by fit's dataset "
                "(tfpsx.keras.ParameterServerStrategy wraps it), so a step must not read "
                "batches from another source"))
        return _after([staged], lambda: tf.identity(cached))

    def _train_rows(self, keys, step, counts):
        clock = self._tick("clock")
        local = self.shards[0]
        cached, found = local.cache_find(keys, clock)
        rows, miss, fetched, from_ps = self._merge(cached, found, keys, True, step, parts=True)
        if counts is None:
            counts = tf.ones_like(keys, tf.int32)
        counts = tf.cast(counts, tf.int64)
        admit, rejected, admitted = miss, tf.constant(0), []
        if self.options.admit_after > 1:
            seen, admitted = self._sightings(miss, tf.boolean_mask(counts, tf.logical_not(found)))
            enter = seen >= self.options.admit_after
            admit, fetched = tf.boolean_mask(miss, enter), tf.boolean_mask(fetched, enter)
            rejected = tf.size(miss) - tf.size(admit)

        def cache_misses():
            # old first: a round running beside the step (Keras) pushes and pulls only
            # the rows local holds, so a row is never in local without its old.
            old = set_rows(self.copy, self.old, admit, fetched)
            return [_after(old, lambda: set_rows(self.copy, self, admit, fetched, clock)),
                    self.staged.shards[0].remove(miss)]

        inserted = _when(tf.size(miss) > 0, cache_misses)
        counted = self._count(lookups=tf.reduce_sum(counts),
                              hits=tf.reduce_sum(tf.boolean_mask(counts, found)),
                              rows_fetched=from_ps,
                              bytes_fetched=tf.cast(from_ps, tf.int64) * self._fetch_row_bytes,
                              not_admitted=rejected)
        return _after([inserted, counted] + admitted, lambda: tf.identity(rows))

    def _sightings(self, keys, counts):
        """Adds ``counts`` sightings of ``keys`` to the admission sketch; returns (each
        key's estimated recent sightings, this one included; the ops to wait on). The
        sketch halves once ``sketch_window`` missed ids went in since it last did."""
        sketch = self._vars()[2]
        seen = self.sketch.add(sketch, keys, counts)
        state = self._vars()[0]
        field = _STATE.index("sketched")
        total = _after(seen, lambda: state.scatter_nd_add(
            [[field]], [tf.reduce_sum(tf.cast(counts, tf.int64))])[field])

        def halve():
            return [self.sketch.halve(sketch),
                    state.scatter_nd_update([[field]], tf.zeros([1], tf.int64))]

        aged = _when(total >= self.sketch.window, halve)
        return seen, [aged]

    def _merge(self, cached, found, keys, train, step, parts=False):
        """The cached rows with the misses' rows put in (staged, or fetched); with
        ``parts`` also (the missing keys, their rows as they travel: with their slots
        when shared, how many came from the PS)."""
        missing = tf.logical_not(found)
        miss = tf.boolean_mask(keys, missing)
        fetched, from_ps = _unless_empty(miss, lambda: self._fetch(miss, train, step),
                                         lambda: (tf.zeros([0, self._width]), tf.constant(0)))
        rows = tf.tensor_scatter_nd_update(cached, tf.where(missing), fetched[:, :self.dim])
        return (rows, miss, fetched, from_ps) if parts else rows

    def _fetch(self, miss, train, step):
        """(rows of the missing keys as they travel: staged by a prefetch, else from the
        PS shards; how many came from the PS)."""
        shared = self.copy.share_slots
        staged_rows, staged = self.staged.shards[0].find(miss, with_slots=shared)
        need_mask = tf.logical_not(staged)
        need = tf.boolean_mask(miss, need_mask)
        got = _unless_empty(need, lambda: global_rows(self.copy, need, train, step),
                            lambda: tf.zeros([0, self._width]))
        return tf.tensor_scatter_nd_update(staged_rows, tf.where(need_mask), got), tf.size(need)

    @_graph_code
    def prefetch(self, ids, step=None):
        """Fetches the rows of ``ids`` (the next batch's) that the cache lacks into a
        staging table, so that their lookup need not wait for the PS: run it while the
        current step runs (graph mode: in the same ``session.run``; ``tf.function``:
        right after this step's lookup). Each call replaces what the previous one staged.
        Returns the op (None in eager mode)."""
        step = as_step(step)
        with on_device(self.device):
            keys, _ = tf.unique(tf.reshape(self._keys(ids), [-1]))
            _, found = self.shards[0].find(keys)
            miss = tf.boolean_mask(keys, tf.logical_not(found))
            rows = _unless_empty(miss, lambda: global_rows(self.copy, miss, True, step),
                                 lambda: tf.zeros([0, self._width]))
            n = tf.size(miss)
            slots = (tf.reshape(rows[:, self.dim:], [n, self.num_slots, self.dim])
                     if self.copy.share_slots else tf.zeros([0]))
            staged = self.staged.import_rows(
                {"keys": miss, "values": rows[:, :self.dim], "slots": slots,
                 "freq": tf.ones([n], tf.int64), "step": tf.zeros([n], tf.int64)}, clear=True)
            counted = self._count(prefetched=n)
        return self._group([staged, counted])

    @_graph_code
    def stage(self, ids, step=None):
        """Caches the rows of ``ids`` (a batch a training step will look up) that the
        cache lacks: fetched from the PS shards, inserted with ``old`` = the fetched row.
        Run by a stager ahead of the step (:mod:`tfpsx.embedding.cache.staging`), which
        makes the step's lookups local (:attr:`fed`). Counts the batch's lookups and
        hits. Returns (the batch's unique keys: what :meth:`evict_except` must keep, the
        rows cached then)."""
        self._register_eagerly()
        with on_device(self.device):
            unique, _, counts = tf.unique_with_counts(tf.reshape(self._keys(ids), [-1]))
            clock = self._vars()[0][_STATE.index("clock")]
            _, found = self.shards[0].find(unique)
            miss = tf.boolean_mask(unique, tf.logical_not(found))
            rows = global_rows(self.copy, miss, True, as_step(step))
            old = set_rows(self.copy, self.old, miss, rows)  # old first (see _train_rows)
            inserted = [old, _after(old, lambda: set_rows(self.copy, self, miss, rows, clock))]
            counts, n = tf.cast(counts, tf.int64), tf.size(miss)
            counted = self._count(lookups=tf.reduce_sum(counts),
                                  hits=tf.reduce_sum(tf.boolean_mask(counts, found)),
                                  rows_fetched=n, prefetched=n,
                                  bytes_fetched=tf.cast(n, tf.int64) * self._fetch_row_bytes)
        return _after(inserted + [counted],
                      lambda: (tf.identity(unique), self.shards[0].size()))

    @_graph_code
    def evict_except(self, keep):
        """Evicts down to ``evict_to`` rows when more than the cache's size are held,
        never the keys of ``keep`` (those of batches staged and not yet trained): the
        victims' deltas go to the PS first. Returns the op (None in eager mode)."""
        with on_device(self.device):
            done = self._evict_over(as_step(None), keep=keep)
        return self._group(done)

    # ------------------------------------------------------------------ updates
    @_graph_code
    def apply(self, keys, grads, step=None):
        """Trains the cached rows of unique ``keys`` (all cached by this step's lookup)
        with the table's optimizer on the worker. Returns the op (None in eager mode).

        The sync with the PS every ``flush_steps`` updates runs between steps, never in
        one (a PS op in the step would cost every step a round trip): eager code syncs
        here; ``tfpsx.MonitoredTrainingSession`` and Keras ``fit`` sync between steps
        when :meth:`updates` says one is due; a loop of your own runs :meth:`flush`."""
        with on_device(self.device):
            clock = self._vars()[0][_STATE.index("clock")]
            direct = None
            if self.options.admit_after > 1:
                # Rows the lookup did not admit train on the PS, as without a cache.
                keys = tf.reshape(self._keys(keys), [-1])
                _, cached = self.shards[0].find(keys)
                cold = tf.logical_not(cached)
                cold_keys, cold_grads = tf.boolean_mask(keys, cold), tf.boolean_mask(grads, cold)
                direct = _unless_empty(cold_keys, lambda: self.table.apply(
                    cold_keys, cold_grads, as_step(step)), lambda: None)
                keys, grads = tf.boolean_mask(keys, cached), tf.boolean_mask(grads, cached)
            applied = super().apply(keys, grads, clock)
            counted = _after([applied, direct], lambda: self._tick("updates"))
        if tf.executing_eagerly():
            self.flush_if_due(step)
            return None
        op = self._group([o for o in (applied, direct, counted) if o is not None])
        self.apply_ops.append(op)  # a graph's driver tells training runs by them
        return op

    def updates(self) -> tf.Tensor:
        """How many updates (``apply`` calls) the cache has run (int64 scalar)."""
        return self._vars()[0][_STATE.index("updates")]

    def flush_due(self, updates: int) -> bool:
        """Whether ``flush_steps`` updates ran since the last sync (a cache GEO mode
        syncs never is); ``updates``: the value of :meth:`updates`."""
        return self.schedule.due(updates)

    def flushed(self, updates: int) -> None:
        """Records that the cache synced after ``updates`` updates."""
        self.schedule.flushed(updates)

    def flush_if_due(self, step=None) -> bool:
        """Eager: syncs when due; returns whether it did."""
        updates = int(self.updates())
        if not self.flush_due(updates):
            return False
        self.flush(step)
        self.flushed(updates)
        return True

    @_graph_code
    def flush(self, step=None):
        """Syncs with the PS now: pushes every trained row's delta, pulls the cached rows
        other workers changed. Training runs it at its end. Returns the op (None in eager
        mode)."""
        self._register_eagerly()
        with on_device(self.device):
            state = self._vars()[0]
            registered = _when(tf.equal(state[0], 0), self._register)
            done = _after(registered, lambda: self._sync(as_step(step)))
        return self._group([done])

    def _sync(self, step):
        push, pushed = table_push(self.copy, self.scale, step)
        pull, pulled = table_pull(self.copy, after=[push])
        counted = self._count(rows_flushed=pushed,
                              bytes_flushed=tf.cast(pushed, tf.int64) * self._row_bytes,
                              rows_refreshed=pulled, flushes=1)
        return [push, pull, counted]

    def register(self):
        """Registers this worker's readers of changed keys, of the cache and of every PS
        shard, so that the first sync pulls every row others changed since. Training runs
        it before the first step (``tfpsx.MonitoredTrainingSession``'s hook; eager code
        and ``tf.function`` s when first tracing or running a lookup). Returns the op
        (None in eager mode)."""
        ops = table_readers(self.copy)
        return self._group([_after(ops, self._mark_registered)])

    def _register_eagerly(self):
        """:meth:`register`, once, when the outermost context is eager (also while a
        ``tf.function`` traces: it runs before the function does)."""
        with tf.init_scope():
            if tf.executing_eagerly() and not self._eager_registered:
                self._eager_registered = True
                with on_device(self.device):
                    self.register()

    def _register(self):
        """In a graph without a driver that registered (a session of your own): this
        worker's reader of the cache's own changes, before its first row is cached. Its
        readers of the PS shards' changes then register at the first sync's pull (whose
        first take returns nothing): a cached row that others change only before it is
        refreshed at the next change after it."""
        with on_device(self.device):
            op = self.shards[0].take_changed(tf.constant(0, tf.int64))
        return _after(op, self._mark_registered)

    def _mark_registered(self):
        state = self._vars()[0]
        return state.scatter_nd_update([[_STATE.index("registered")]], [1])

    def _evict_over(self, step, keep=None):
        """Evicts down to ``evict_to`` rows when more than the cache's size are held:
        the victims' deltas go to the PS first (an empty push when none are due); the
        keys of ``keep`` stay."""
        size = self.shards[0].size()
        count = tf.where(size > self.options.size, size - self.evict_to, tf.zeros_like(size))
        if keep is None:
            victims = self.shards[0].cache_victims(count, self.options.policy.by_step)
        else:
            keep = tf.sort(tf.reshape(tf.cast(keep, tf.int64), [-1]))
            extra = tf.where(count > 0, tf.cast(tf.size(keep), count.dtype), tf.zeros_like(count))
            ranked = self.shards[0].cache_victims(count + extra, self.options.policy.by_step)
            kept = (tf.searchsorted(keep, ranked, side="right")
                    > tf.searchsorted(keep, ranked, side="left"))
            victims = tf.boolean_mask(ranked, tf.logical_not(kept))[:count]
        push, pushed = _unless_empty(victims, lambda: push_rows(self.copy, victims, self.scale,
                                                                step, keep_old=False),
                                     lambda: (None, tf.constant(0)))

        def remove():
            return [self.shards[0].remove(victims), self.old.shards[0].remove(victims)]

        gone = _after(push, remove)
        counted = self._count(evictions=tf.size(victims), rows_flushed=pushed,
                              bytes_flushed=tf.cast(pushed, tf.int64) * self._row_bytes)
        return [push, gone, counted]

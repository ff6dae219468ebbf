"""GEO's rule for table rows, written once: GEO mode's tables and the worker cache
(:mod:`tfpsx.embedding.cache`) both sync by it.

A worker holds a copy ``local`` of some rows of a sharded table and a snapshot ``old``:

* push: the rows changed in ``local`` since the last push: ``delta = (local - old) / n``;
  ``old += delta``; the PS rows ``+= delta``;
* pull: the rows any worker changed on the PS since this worker's last pull (each shard
  keeps a changed-key set per reader): ``local += global - old``; ``old = global``.

GEO mode pushes table rows with n = 1: a row's whole delta, what async would have
applied, k steps late (averaging by N, GEO's rule for dense weights, would train a row
that one worker alone touched N times slower, and keep pushing the rest of its delta at
every sync). With n = 1 the copy keeps nothing unpushed, so a worker's own push is not
marked for its own pull (value-neutral, and half the rows a pull brought on 2 workers).

Whole deltas overshoot on a hot row: when several workers trained it from the same
value between two syncs, each delta is a full move (each worker's optimizer saw only its
share of the gradients), and their sum is several moves (measured at 4 workers on the
Criteo job: the model after the final sync had log loss 1.29 where each worker's copy
had 0.50). So the PS combines the parallel pushes of a row (``GeoTable.combine``, the
PS's ``accumulate(combine=...)``); the parallel pushes of a row, for its pusher: the c
pushes of it by others since the pusher last pulled it (the PS counts them in its
changed-key sets). A row no other worker pushed meanwhile moves by its whole delta.

* ``"mean"`` (deterministic GEO: every worker pushes, they meet, they pull): the row
  moves to the mean of the round's deltas, exact in any order, since every push of a
  round started from the value of the last one (the PS keeps the others' move since
  the pusher's pull: it adds (delta - their move) / (1 + c));
* ``"scaled"`` (GEO's background communicator): a push adds delta / (1 + c). Its
  pushes start from different values (a worker pulled before or after another's push),
  and the mean would drag a row back towards each pusher's stale copy (measured, 1 PS +
  4 workers, 300k rows, k=10, one run each: final AUC 0.734 against 0.766 scaled and
  0.763 summed); scaled, a hot row that every worker trains moves by about the mean of
  their deltas once the syncs interleave (1 + 1/2 + 1/3 + 1/4 = 2.08 deltas for four
  pushes from one value, not 4).

The pusher's copy keeps its whole delta in ``old``; a combined row is in its next pull
(others changed it), which brings the PS's value. A summed push (``"sum"``) is not
counted: the combined pushes neither see it nor are seen by it. A cache's eviction push
sums: its row leaves the copy in the middle of a round, and a worker that fetches it
afterwards trains on top of it (a sequential delta, not a parallel one). An async worker
cache's syncs sum too: async applies every update whole, and a cache delivers the same
updates, later.

**Shared slots** (``GeoTable(share_slots=True)``, a strategy's ``geo_table_rule=
"shared_slots"``): a row travels as ``[value | optimizer slots]`` both ways, the PS sums
every push whole, and ``old`` keeps the slots of the last pull too. The PS's slots then
hold every worker's share (Adagrad's accumulator: every worker's squared gradients, as in
async), each pull brings them back, and a worker's local steps keep async's size; with
local slots a worker's accumulator sees ~1/N of a hot row's gradients and its steps are
~sqrt(N) times async's, which the average then scales back by N. Measured with
``benchmarks/geo_scale.py`` (docs/modes.md): the better rule while K x N is small, worse
than the average at K=10 from 8 workers.

**Hot rows** (:class:`HotRows`, a strategy's ``geo_hot_count``): an id seen at least
``hot_count`` times in a worker's batch is read from the PS and trained there by the
PS's optimizer (async), not in the copy; the rest of the batch trains the copy (GEO).
Such a row is trained by every worker at nearly every step: a round would add N x K
steps computed from one stale value, which no combine gets right (the sum overshoots,
the mean undershoots), while async's per-step traffic for a few hot rows is small. The
PS marks the async update changed for every reader, this worker's too: its next pull
brings it (``local += global - old`` then holds the global value plus the copy's own
unpushed delta, as for any row). An id is hot by contention too (a strategy's
``geo_hot_per_round``, :mod:`tfpsx.embedding.contention`): when the N workers would
train it more often in a round than a round's sum stays right for, whatever its count in
one batch.

GEO mode copies every row the worker looks up (``cached=False``): the pull brings every
changed row. A cache holds a bounded set (``cached=True``): the pull brings only the rows
it holds (the others are fetched fresh on their next miss). A pull's writes are not
marked for the copy's own reader (0), so a push takes only the rows this worker trained
since the last one (before, a pulled row came along, and one whose float32 residue
``(local + (global - old)) - global`` was not exactly zero was pushed back); it still
skips a row whose delta is zero. The functions build ops in graph
mode and run in eager mode or ``tf.function``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import tensorflow as tf

from tfpsx.embedding.contention import Contention
from tfpsx.embedding.sharding import EmbeddingLookup, ShardedTable, as_step


@dataclasses.dataclass
class GeoTable:
    """A table in GEO: the sharded PS table, this worker's copy and its snapshot."""
    global_: ShardedTable
    local: ShardedTable
    old: ShardedTable
    device: str            # this worker's device, where local and old live
    reader: int            # this worker's id in the PS shards' changed-key sets
    cached: bool = False   # local holds a bounded set of rows (a worker cache)
    wire: Optional[tf.DType] = None  # rows travel in this dtype (None: float32)
    combine: str = "sum"  # how the PS adds parallel pushes of a row (module doc)
    # The rows travel with their optimizer slots ([value | slots], summed on the PS;
    # ``old`` then holds row_width floats a row): the workers share the optimizer state.
    share_slots: bool = False
    # Every row of ``local`` equals ``old``'s: take_global made them so, and the copy has
    # not trained since (the front-end clears it before the copy trains again). The
    # next take_global then moves only the rows changed on the PS.
    local_is_old: bool = False
    # ``old`` has a changed-key reader (:func:`track_snapshot`), and it holds every row
    # written into the snapshot since the last take: take_global copies into the copy
    # only those rows (and the copy's unpushed ones), not all. The front-end clears it
    # when a fit fails (a round that failed part way may have written one side only);
    # the next take then copies every row and trusts the reader again.
    old_tracked: bool = False
    snapshot_reader: bool = False  # track_snapshot registered the reader

    def __post_init__(self):
        if self.share_slots:  # shared slots add every push whole (the module doc)
            self.combine = "sum"


class HotRows:
    """The rows a GEO worker's training step looks up and trains: an id seen at least
    ``hot_count`` times in the batch (0: no such rule), or one that ``contention`` finds
    too contended for a round, on the PS (async); the others in the copy (see the module
    doc). The table's ``lookup_source`` in GEO with ``geo_hot_count`` or
    ``geo_hot_per_round``."""

    def __init__(self, t: GeoTable, hot_count: int, contention: Optional[Contention] = None):
        self.geo, self.hot_count, self.contention = t, hot_count, contention

    def _hot(self, unique, counts) -> tf.Tensor:
        """Which of a batch's unique keys (seen ``counts`` times) train on the PS."""
        hot = (counts >= self.hot_count if self.hot_count
               else tf.zeros(tf.shape(counts), tf.bool))
        contended = self.contention.hot(unique) if self.contention else None
        return hot if contended is None else tf.logical_or(hot, contended)

    def lookup_unique(self, ids, train: bool = True, step=None, tape=None) -> EmbeddingLookup:
        if not train:  # evaluation reads the copy, as GEO's lookups do
            return self.geo.local.lookup_unique(ids, train=False, step=step, tape=tape)
        local, global_ = self.geo.local, self.geo.global_
        keys = local._keys(ids)
        unique, index, counts = tf.unique_with_counts(tf.reshape(keys, [-1]))
        hot = self._hot(unique, counts)
        at_hot = tf.cast(tf.where(hot)[:, 0], tf.int32)
        at_tail = tf.cast(tf.where(tf.logical_not(hot))[:, 0], tf.int32)
        hot_rows = ShardedTable.rows(global_, tf.gather(unique, at_hot), True, step)
        # A worker cache's rows() caches what it fetches (its counts: the batch's ids).
        tail_keys = tf.gather(unique, at_tail)
        tail_rows = (local.rows(tail_keys, True, step, tf.gather(counts, at_tail))
                     if self.geo.cached else local.rows(tail_keys, True, step))
        unique_rows = tf.reshape(tf.dynamic_stitch([at_hot, at_tail], [hot_rows, tail_rows]),
                                 [-1, local.dim])
        if tape is not None:
            tape.watch(unique_rows)
        embeddings = tf.reshape(tf.gather(unique_rows, index),
                                tf.concat([tf.shape(keys), [local.dim]], axis=0))
        return EmbeddingLookup(unique, unique_rows, index, embeddings, hot=hot)

    def lookup(self, ids, train: bool = False, step=None, dedup=None) -> tf.Tensor:
        if train:
            return self.lookup_unique(ids, train=True, step=step).embeddings
        return self.geo.local.lookup(ids, train=False, step=step, dedup=dedup)

    def apply(self, keys, grads, hot, step):
        """Trains the hot rows of ``keys`` on the PS, the others in the copy; returns the
        op (None in eager mode)."""
        grads = tf.convert_to_tensor(grads)
        tail = tf.logical_not(hot)
        ops = [ShardedTable.apply(self.geo.global_, tf.boolean_mask(keys, hot),
                                  tf.boolean_mask(grads, hot), step),
               self.geo.local.apply(tf.boolean_mask(keys, tail), tf.boolean_mask(grads, tail),
                                    step)]
        ops = [op for op in ops if op is not None]
        return tf.group(ops) if ops else None


def local_rows(table: ShardedTable, keys, with_slots: bool = False):
    """Rows of a one-shard worker table (missing keys: their initial rows); with_slots:
    with their optimizer slots."""
    return table.shards[0].find(keys, with_slots=with_slots)[0]


def set_rows(t: GeoTable, table: ShardedTable, keys, rows, step=None):
    """The rows of ``keys`` in a worker table (``t.local`` or ``t.old``) become ``rows``
    (as they travel: with the slots when ``t.share_slots``), exactly, stamped with
    ``step`` (a cache's clock; default 0). A table's changed-key readers see them as
    an insert's rows."""
    if not t.share_slots:
        return table.shards[0].insert(keys, rows, as_step(step))
    return table.shards[0].insert(keys, rows, as_step(step), with_slots=True)


def global_rows(t: GeoTable, keys, train: bool, step=None):
    """Rows of unique ``keys`` from the PS shards as they travel to a copy: ``[n, dim]``,
    or with ``t.share_slots`` ``[n, row_width]`` (each row with its optimizer slots).
    ``train``: new keys are inserted (subject to admission) and counted first, as a
    training lookup's are."""
    if not t.share_slots:
        return t.global_.rows(keys, train, step)
    if not train:
        return t.global_.stitched(lambda i, s, k: s.find(k, with_slots=True)[0], keys)
    step = as_step(step)

    def with_slots(i, shard, shard_keys):
        inserted = shard.find_or_insert(shard_keys, step)
        deps = [] if tf.executing_eagerly() else [inserted]
        with tf.control_dependencies(deps):
            return shard.find(shard_keys, with_slots=True)[0]

    return t.global_.stitched(with_slots, keys)


def nonzero_rows(keys, deltas):
    """(keys, deltas) without the rows whose delta is all zeros."""
    moved = tf.reduce_any(tf.not_equal(deltas, 0.0), axis=1)
    return tf.boolean_mask(keys, moved), tf.boolean_mask(deltas, moved)


def combine_for(deterministic: bool) -> str:
    """How a GEO table's round pushes combine on the PS (see the module doc)."""
    return "mean" if deterministic else "scaled"


def push_rows(t: GeoTable, keys, n: float, step, keep_old: bool = True):
    """The push of ``keys`` (rows of the local copy): delta = (local - old) / n, old +=
    delta (not with ``keep_old=False``: rows about to leave the copy), the PS shards +=
    delta, combined with other workers' pushes of the row by ``t.combine`` (n = 1).
    Returns (op, rows pushed)."""
    zero = tf.constant(0, tf.int64)
    with tf.compat.v1.device(t.device):
        delta = local_rows(t.local, keys, t.share_slots) - local_rows(t.old, keys,
                                                                       t.share_slots)
        if n != 1:
            delta = delta / n
        keys, delta = nonzero_rows(keys, delta)
        if t.wire is not None:
            # What the PS will add, rounded to the wire's precision: old follows it, so
            # the rounding stays in local - old and travels with the next push.
            delta = tf.cast(tf.cast(delta, t.wire), tf.float32)
        bump_old = (t.old.shards[0].accumulate(keys, delta, zero, with_slots=t.share_slots)
                    if keep_old else None)
    # With n = 1 the copy holds nothing unpushed after the push (old = local): its next
    # pull need not bring this push back (the shards mark it for the others only).
    if n != 1:
        skip, combine = -1, "sum"
    else:  # an eviction (not keep_old) sums: see the module doc
        skip, combine = t.reader, (t.combine if keep_old else "sum")
    pushed = t.global_.accumulate(keys, delta, step, skip_reader=skip, wire_dtype=t.wire,
                                  combine=combine, with_slots=t.share_slots)
    return tf.group([op for op in (bump_old, pushed) if op is not None]), tf.size(keys)


def table_push(t: GeoTable, n: float, step):
    """The rows changed in the local copy since the last push (see the module doc).
    Returns (op, rows pushed)."""
    with tf.compat.v1.device(t.device):
        keys = t.local.shards[0].take_changed(tf.constant(0, tf.int64))
    return push_rows(t, keys, n, step)


def table_pull(t: GeoTable, after=()):
    """After the ops ``after``: the rows any worker changed on the PS since this worker's
    last pull (a cache: those it holds); local += global - old, old = global. Returns
    (op, rows pulled)."""
    me = tf.constant(t.reader, tf.int64)
    zero = tf.constant(0, tf.int64)
    got_keys, got_rows = [], []

    def changed_rows(i, shard):
        changed = shard.take_changed(me)
        if t.cached:
            with tf.compat.v1.device(t.device):
                changed = tf.boolean_mask(changed, t.local.shards[0].find(changed)[1])
        got_keys.append(changed)
        found = shard.find(changed, with_slots=t.share_slots)[0]
        got_rows.append(found if t.wire is None else tf.cast(found, t.wire))

    with tf.control_dependencies(list(after)):
        t.global_.on_shards(changed_rows)
    with tf.compat.v1.device(t.device):
        keys, rows = tf.concat(got_keys, 0), tf.cast(tf.concat(got_rows, 0), tf.float32)
        # Not marked for the local copy's own reader (0): a pulled row is not trained, and
        # its next push carries only what this worker trained since (local - old).
        moved = t.local.shards[0].accumulate(
            keys, rows - local_rows(t.old, keys, t.share_slots), zero, skip_reader=0,
            with_slots=t.share_slots)
        with tf.control_dependencies([moved]):
            pull = set_rows(t, t.old, keys, rows)
    return pull, tf.size(keys)


def take_global(t: GeoTable, refresh_all: bool = False) -> None:
    """After the last round, eagerly: this worker's copy becomes the global table (local
    = old = the PS rows; local keeps its optimizer slots), moving only what it must.

    ``old`` holds every row the PS had at this worker's last pull (a pull brings every
    changed row; the rows present at registration were imported), so only the rows
    changed on the PS since (the other workers' last pushes) come over, exact; then
    local takes old's values, on the worker (a push leaves float32's rounding of old +
    (local - old) in local - old). ``refresh_all`` brings every row's value instead,
    exact, in float32 (not its slots, step or frequency): when ``old`` is not the PS's
    (a wire dtype's pulls brought rounded rows; rows evicted on the PS). Copying the
    whole PS table with its slots on every worker instead was about three quarters of a
    GEO job's bytes (measured: benchmarks/time_to_auc.py's Criteo job). A cache holds a
    bounded set of rows: those, read fresh. When ``t.local_is_old`` (a take since which
    the copy did not train: an ``evaluate`` or ``predict`` after ``fit``), only the rows
    changed on the PS come over, into both."""
    me, zero = tf.constant(t.reader, tf.int64), tf.constant(0, tf.int64)
    # Cleared until this take completes: one stopped part way (an error) leaves rows of
    # local and old apart whose PS changes it consumed; the next take copies all again.
    only_changed, t.local_is_old = t.local_is_old, False

    def fresh(keys):
        if not t.share_slots:
            return t.global_.rows(keys, train=False)
        return t.global_.stitched(lambda i, s, k: s.find(k, with_slots=True)[0], keys)

    if t.cached:
        with tf.device(t.device):
            keys = t.local.export()["keys"]
        rows = fresh(keys)
    elif refresh_all:
        changed = t.global_.on_shards(lambda i, shard: shard.take_changed(me))
        with tf.device(t.device):
            keys = tf.unique(tf.concat([t.old.export()["keys"]] + changed, 0))[0]
        rows = fresh(keys)
    else:
        def changed_rows(i, shard):
            keys = shard.take_changed(me)
            return keys, shard.find(keys, with_slots=t.share_slots)[0]

        parts = t.global_.on_shards(changed_rows)
        with tf.device(t.device):
            keys = tf.concat([k for k, _ in parts], 0)
            rows = tf.concat([r for _, r in parts], 0)
    with tf.device(t.device):
        set_rows(t, t.old, keys, rows)
        if not (t.cached or refresh_all or only_changed):
            if t.old_tracked:
                # The rows written into old since the last take, and those the copy
                # trained since its last push (none after a fit's final round).
                written = t.old.shards[0].take_changed(zero)
                trained = t.local.shards[0].take_changed(zero)
                keys = tf.unique(tf.concat([keys, written, trained], 0))[0]
                rows = local_rows(t.old, keys, t.share_slots)
            else:
                snapshot = t.old.export()
                keys, rows = snapshot["keys"], snapshot["values"]
                if t.share_slots:  # [value | slots], as find(with_slots) reads them
                    slots = snapshot["slots"]
                    rows = tf.concat([rows, tf.reshape(slots, [tf.shape(slots)[0], -1])], 1)
        set_rows(t, t.local, keys, rows)  # with share_slots the slots too
        if t.snapshot_reader:
            # local = old on every row now: nothing is pending for the next take, nor
            # for the next push (the inserts above marked their rows for both readers).
            t.old.shards[0].take_changed(zero)
            t.local.shards[0].take_changed(zero)
            t.old_tracked = True
    t.local_is_old = not t.cached


def track_snapshot(t: GeoTable) -> None:
    """Registers a changed-key reader (0) on ``t.old``, eagerly, when ``t.local`` and
    ``t.old`` hold the same rows (a fresh copy, or one just imported from the PS). The
    copy can then differ from its snapshot only on rows written into the snapshot since
    (pushes and pulls write both) or trained since the last push (the copy's own reader
    0), so take_global copies those rows, not every row: on a
    copy of 1.9M rows the export of the whole snapshot took 1.0-1.2 s of the 1.7-2.0 s
    take. The reader's list costs up to ~32 bytes a distinct row written (it compacts at
    twice its distinct keys; a vector's capacity up to twice that), until the next take."""
    with tf.device(t.device):
        t.old.shards[0].take_changed(tf.constant(0, tf.int64))
    t.old_tracked = t.snapshot_reader = True


def copy_trains(t: GeoTable) -> None:
    """The copy is about to train (a fit starts): the next take_global copies the rows
    where it can differ from its snapshot, not only the PS's changes."""
    t.local_is_old = False


def distrust_snapshot(t: GeoTable) -> None:
    """A fit failed: a round may have failed part way (a push's rows taken from the
    copy's reader, their write into the snapshot cancelled), so the next take_global
    copies every row, then trusts the snapshot's reader again."""
    t.old_tracked = t.local_is_old = False


def table_readers(t: GeoTable) -> list:
    """Registers this worker's changed-key readers: of its local copy (reader 0) and of
    every PS shard (reader = worker index). A table tracks changes only for readers it
    knows, so this runs before anyone pushes."""
    zero, me = tf.constant(0, tf.int64), tf.constant(t.reader, tf.int64)
    with tf.compat.v1.device(t.device):
        ops = [t.local.shards[0].take_changed(zero)]
    return ops + t.global_.on_shards(lambda i, shard: shard.take_changed(me))

"""GEO's copy of a table (:class:`GeoTable`): a :class:`~tfpsx.embedding.row_copy.RowCopy`
that knows when it equals its snapshot, and :func:`take_global`, which makes it the global
table after the last round (Keras ``fit``'s end: the model is then the job's).

Three flags say how much a take must copy: ``local_is_old`` (the copy has not trained
since the last take: only the PS's changes come over), ``old_tracked`` (the snapshot's
changed-key reader holds every row written into it since the last take: only those and
the copy's unpushed rows come over) and ``snapshot_reader`` (that reader exists). The
front-end moves them by :func:`track_snapshot` (after the copy is imported),
:func:`copy_trains` (a fit starts) and :func:`distrust_snapshot` (a fit failed).
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from tfpsx.embedding.row_copy import RowCopy, local_rows, set_rows


@dataclasses.dataclass
class GeoTable(RowCopy):
    """A table in GEO: the sharded PS table, this worker's copy and its snapshot, and
    whether the copy equals the snapshot (the module doc)."""
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
    # geo_table_choice="auto" (:mod:`.choice`): the job chooses for this table, and
    # whether it trains async now (lookups read the PS; set by the front-end as the job
    # chooses; a chosen table starts async, its reader on the PS not registered).
    chosen: bool = False
    trains_async: bool = False


def copy_apply(t: GeoTable, keys, grads, step):
    """The copy's apply of gradients checked already (a table's apply_gradients checked
    them): a worker cache's own ``apply`` (its clock as the rows' step, the rows it does
    not hold sent to the PS, its counts), else the copy's without checking them again
    (an assert a step)."""
    if t.cached:
        return t.local.apply(keys, grads, step)
    return t.local.apply_checked(keys, grads, step)


def local_reader(t: GeoTable) -> list:
    """Registers the copy's own changed-key reader (0) only: a table that starts async
    (:mod:`.choice`) registers its reader on the PS when it tries rounds
    (:func:`copy_global`)."""
    with tf.compat.v1.device(t.device):
        return [t.local.shards[0].take_changed(tf.constant(0, tf.int64))]


def copy_global(t: GeoTable):
    """A table that tries rounds (:mod:`.choice`'s catch-up): this worker's reader of
    the PS's changed keys is registered (or emptied), then the copy and its snapshot
    take every PS row (with its slots when they travel: old holds them too), and the
    copy's own reader forgets the import. A row the PS changes meanwhile is marked for
    the next pull. Returns the op (None in eager mode, where it ran)."""
    me, zero = tf.constant(t.reader, tf.int64), tf.constant(0, tf.int64)
    registered = t.global_.on_shards(lambda i, shard: shard.take_changed(me))
    deps = [] if tf.executing_eagerly() else registered
    with tf.control_dependencies(deps):
        rows = t.global_.export()
    with tf.compat.v1.device(t.device):
        imported = [t.local.import_rows(rows, clear=True),
                    t.old.import_rows(rows if t.share_slots else
                                      dict(rows, slots=tf.zeros([0], tf.float32)), clear=True)]
        deps = [] if tf.executing_eagerly() else imported
        with tf.control_dependencies(deps):
            forgot = t.local.shards[0].take_changed(zero)
    return None if tf.executing_eagerly() else tf.group(forgot)


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


def drop_unpushed(tables, resets, positions) -> tuple:
    """GEO's rule when a worker's training session is created again (graph mode, after an
    error): its steps since the last round leave the model, as a dead worker's do, since
    its new input reads their examples again from their committed positions. Their
    pending ``positions`` (:class:`~tfpsx.modes.positions.PendingPositions`) are dropped;
    each table copy takes the PS's rows by its op in ``resets`` (:func:`copy_global`, or
    a catch-up; None for a worker cache's copy, which is bounded and keeps its rows); a
    table that trains async has those steps on the PS already. Returns (the reset ops to
    run, the names of the tables that keep those steps and so train them twice)."""
    positions.take()  # (dropped)
    ops = [op for t, op in zip(tables, resets) if op is not None and not t.trains_async]
    twice = ([t.global_.name for t in tables if t.cached] +
             [t.global_.name for t in tables if t.trains_async and not t.cached])
    return ops, twice

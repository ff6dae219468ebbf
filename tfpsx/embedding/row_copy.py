"""A worker's copy of some rows of a sharded table, synced with the PS shards by the
difference from a snapshot: the mechanism GEO mode's tables (:mod:`tfpsx.modes.geo`)
and the worker cache (:mod:`tfpsx.embedding.cache`) both sync by. Which ``n`` and which
combine a copy syncs with is its owner's choice (GEO's: :mod:`tfpsx.modes.geo.rule`; a
cache in async: n = 1, summed); this module knows no mode.

A worker holds a copy ``local`` of some rows of a sharded table and a snapshot ``old``:

* push: the rows changed in ``local`` since the last push: ``delta = (local - old) / n``;
  ``old += delta``; the PS rows ``+= delta``;
* pull: the rows any worker changed on the PS since this worker's last pull (each shard
  keeps a changed-key set per reader): ``local += global - old``; ``old = global``.

With n = 1 the copy keeps nothing unpushed, so a worker's own push is not marked for its
own pull (value-neutral, and half the rows a pull brought on 2 workers).

The PS can combine the parallel pushes of a row (:attr:`RowCopy.combine`, the PS's
``accumulate(combine=...)``); the parallel pushes of a row, for its pusher: the c pushes
of it by others since the pusher last pulled it (the PS counts them in its changed-key
sets). A row no other worker pushed meanwhile moves by its whole delta. GEO's combines
(``"mean"``, ``"scaled"``) and why are :mod:`tfpsx.modes.geo.rule`'s. The pusher's copy
keeps its whole delta in ``old``; a combined row is in its next pull (others changed
it), which brings the PS's value. A summed push (``"sum"``, the default) is not counted:
the combined pushes neither see it nor are seen by it. A cache's eviction push sums: its
row leaves the copy in the middle of a round, and a worker that fetches it afterwards
trains on top of it (a sequential delta, not a parallel one). An async worker cache's
syncs sum too: async applies every update whole, and a cache delivers the same updates,
later.

With ``share_slots`` a row travels as ``[value | optimizer slots]`` both ways, the PS
sums every push whole, and ``old`` keeps the slots of the last pull too (GEO's shared
slots: :mod:`tfpsx.modes.geo.rule`).

On the wire (:func:`to_wire`) the values travel in ``wire`` and the slots in ``slot_wire``
(float32 by default; GEO narrows the slots to bfloat16). A push's rows are rounded to
what the wire carries before ``old`` follows them, so the rounding stays in ``local -
old`` for the row's next push. A pull's slots travel less the optimizer's initial values
(a narrowed accumulator near its start would lose what was added to it).

A copy of every row the worker looks up (``cached=False``, GEO mode's): the pull brings
every changed row. A cache holds a bounded set (``cached=True``): the pull brings only
the rows it holds (the others are fetched fresh on their next miss). A pull's writes are
not marked for the copy's own reader (0), so a push takes only the rows this worker
trained since the last one (before, a pulled row came along, and one whose float32
residue ``(local + (global - old)) - global`` was not exactly zero was pushed back); it
still skips a row whose delta is zero. The functions build ops in graph mode and run in
eager mode or ``tf.function``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import tensorflow as tf

from tfpsx.embedding.sharding import ShardedTable, as_step


@dataclasses.dataclass
class RowCopy:
    """This worker's copy of some rows of the sharded PS table, and its snapshot."""
    global_: ShardedTable
    local: ShardedTable
    old: ShardedTable
    device: str            # this worker's device, where local and old live
    reader: int            # this worker's id in the PS shards' changed-key sets
    cached: bool = False   # local holds a bounded set of rows (a worker cache)
    wire: Optional[tf.DType] = None  # rows travel in this dtype (None: float32)
    # With ``share_slots``: the slots travel in this dtype (None: as the values, ``wire``).
    slot_wire: Optional[tf.DType] = None
    combine: str = "sum"  # how the PS adds parallel pushes of a row (module doc)
    # The rows travel with their optimizer slots ([value | slots], summed on the PS;
    # ``old`` then holds row_width floats a row): the workers share the optimizer state.
    share_slots: bool = False

    def __post_init__(self):
        if self.share_slots:  # shared slots add every push whole (the module doc)
            self.combine = "sum"


def wire_dtypes(t: RowCopy):
    """(the values' dtype, the slots' dtype) of a row as it travels; the slots' is None
    where none travel (no slots shared, or an optimizer without any)."""
    values = t.wire or tf.float32
    if not t.share_slots or t.global_.row_width == t.global_.dim:
        return values, None
    return values, t.slot_wire or values


def narrow(t: RowCopy) -> bool:
    """Whether a part of a row travels narrower than float32 (a push is then rounded,
    and old follows the rounding)."""
    return any(d not in (None, tf.float32) for d in wire_dtypes(t))


def row_bytes(t: RowCopy) -> int:
    """A row's bytes as it travels, one way: its key, its values and (``share_slots``)
    its slots, each in its wire dtype."""
    values, slots = wire_dtypes(t)
    dim = t.global_.dim
    return 8 + dim * values.size + (0 if slots is None else
                                    (t.global_.row_width - dim) * slots.size)


def _slot_start(t: RowCopy) -> np.ndarray:
    """A new row's slots (the optimizer's initial values, slot after slot, ``dim`` each)."""
    return np.repeat(np.asarray(t.global_.optimizer.slot_init, np.float32), t.global_.dim)


def to_wire(t: RowCopy, rows, pull: bool = False) -> list:
    """``rows`` (float32, ``[values | slots]`` with shared slots) as they travel: one
    tensor, or the values and the slots apart in their own dtypes. A push sends deltas;
    a pull (``pull``) sends the slots less their initial values: an Adagrad accumulator
    near its start (0.1) narrowed to bfloat16 would lose the increments below its
    rounding (2^-9 of it), and with them what the other workers' gradients added; less
    0.1, the rounding is 2^-9 of what was added (docs/design-notes/geo.md, "Fewer bytes
    a row")."""
    values, slots = wire_dtypes(t)
    if slots is None or slots == values == tf.float32:
        return [tf.cast(rows, values)]
    dim = t.global_.dim
    slot_rows = rows[:, dim:] - _slot_start(t) if _offset(t, pull) else rows[:, dim:]
    return [tf.cast(rows[:, :dim], values), tf.cast(slot_rows, slots)]


def _offset(t: RowCopy, pull: bool) -> bool:
    """Whether the slots travel less their initial values (a pull's, narrowed)."""
    return pull and wire_dtypes(t)[1] != tf.float32


def from_wire(t: RowCopy, parts, pull: bool = False) -> tf.Tensor:
    """The float32 rows of :func:`to_wire`'s parts."""
    parts = [tf.cast(p, tf.float32) for p in parts]
    if len(parts) == 1:
        return parts[0]
    return tf.concat([parts[0], parts[1] + _slot_start(t) if _offset(t, pull) else parts[1]],
                     1)


def local_rows(table: ShardedTable, keys, with_slots: bool = False):
    """Rows of a one-shard worker table (missing keys: their initial rows); with_slots:
    with their optimizer slots."""
    return table.shards[0].find(keys, with_slots=with_slots)[0]


def set_rows(t: RowCopy, table: ShardedTable, keys, rows, step=None):
    """The rows of ``keys`` in a worker table (``t.local`` or ``t.old``) become ``rows``
    (as they travel: with the slots when ``t.share_slots``), exactly, stamped with
    ``step`` (a cache's clock; default 0). A table's changed-key readers see them as
    an insert's rows."""
    if not t.share_slots:
        return table.shards[0].insert(keys, rows, as_step(step))
    return table.shards[0].insert(keys, rows, as_step(step), with_slots=True)


def global_rows(t: RowCopy, keys, train: bool, step=None):
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


def push_rows(t: RowCopy, keys, n: float, step, keep_old: bool = True):
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
        if narrow(t):
            # What the PS will add, rounded to the wire's precision: old follows it, so
            # the rounding stays in local - old and travels with the next push.
            delta = from_wire(t, to_wire(t, delta))
        bump_old = (t.old.shards[0].accumulate(keys, delta, zero, with_slots=t.share_slots)
                    if keep_old else None)
    # With n = 1 the copy holds nothing unpushed after the push (old = local): its next
    # pull need not bring this push back (the shards mark it for the others only).
    if n != 1:
        skip, combine = -1, "sum"
    else:  # an eviction (not keep_old) sums: see the module doc
        skip, combine = t.reader, (t.combine if keep_old else "sum")
    pushed = t.global_.accumulate(keys, delta, step, skip_reader=skip, wire_dtype=t.wire,
                                  combine=combine, with_slots=t.share_slots,
                                  slot_wire_dtype=wire_dtypes(t)[1])
    return tf.group([op for op in (bump_old, pushed) if op is not None]), tf.size(keys)


def table_push(t: RowCopy, n: float, step):
    """The rows changed in the local copy since the last push (see the module doc).
    Returns (op, rows pushed)."""
    with tf.compat.v1.device(t.device):
        keys = t.local.shards[0].take_changed(tf.constant(0, tf.int64))
    return push_rows(t, keys, n, step)


def table_pull(t: RowCopy, after=(), among=None):
    """After the ops ``after``: the rows any worker changed on the PS since this worker's
    last pull (a cache: those it holds); local += global - old, old = global. With
    ``among`` (a 1-D int64 tensor): only the changed rows among those keys; the other
    changed rows stay marked on the PS for a later pull, their copy rows as they were
    (exact for a row the copy does not read meanwhile: its pushes add up on the PS, and
    the pull that brings it gives ``local`` what a pull every round would have). Returns
    (op, rows pulled)."""
    me = tf.constant(t.reader, tf.int64)
    zero = tf.constant(0, tf.int64)
    got_keys, got_rows = [], []

    def changed_rows(i, shard, *wanted):
        changed = (shard.take_changed_among(me, wanted[0]) if wanted else
                   shard.take_changed(me))
        if t.cached:
            with tf.compat.v1.device(t.device):
                changed = tf.boolean_mask(changed, t.local.shards[0].find(changed)[1])
        got_keys.append(changed)
        got_rows.append(to_wire(t, shard.find(changed, with_slots=t.share_slots)[0],
                                pull=True))

    with tf.control_dependencies(list(after)):
        t.global_.on_shards(changed_rows, keys=among)
    with tf.compat.v1.device(t.device):
        keys = tf.concat(got_keys, 0)
        rows = from_wire(t, [tf.concat(part, 0) for part in zip(*got_rows)], pull=True)
        # Not marked for the local copy's own reader (0): a pulled row is not trained, and
        # its next push carries only what this worker trained since (local - old).
        moved = t.local.shards[0].accumulate(
            keys, rows - local_rows(t.old, keys, t.share_slots), zero, skip_reader=0,
            with_slots=t.share_slots)
        with tf.control_dependencies([moved]):
            pull = set_rows(t, t.old, keys, rows)
    return pull, tf.size(keys)


def table_readers(t: RowCopy) -> list:
    """Registers this worker's changed-key readers: of its local copy (reader 0) and of
    every PS shard (reader = worker index). A table tracks changes only for readers it
    knows, so this runs before anyone pushes."""
    zero, me = tf.constant(0, tf.int64), tf.constant(t.reader, tf.int64)
    with tf.compat.v1.device(t.device):
        ops = [t.local.shards[0].take_changed(zero)]
    return ops + t.global_.on_shards(lambda i, shard: shard.take_changed(me))

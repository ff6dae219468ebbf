"""GEO's hot rows (:class:`HotRows`, a strategy's ``geo_hot_count`` and
``geo_hot_per_round``): the rows a round cannot sum right train on the PS, async.

An id seen at least ``hot_count`` times in a worker's batch is read from the PS and
trained there by the PS's optimizer (async), not in the copy; the rest of the batch
trains the copy (GEO). Such a row is trained by every worker at nearly every step: a
round would add N x K steps computed from one stale value, which no combine gets right
(the sum overshoots, the mean undershoots), while async's per-step traffic for a few hot
rows is small. The PS marks the async update changed for every reader, this worker's
too: its next pull brings it (``local += global - old`` then holds the global value plus
the copy's own unpushed delta, as for any row). An id is hot by contention too (a
strategy's ``geo_hot_per_round``, :mod:`.contention`): when the N workers would train it
more often in a round than a round's sum stays right for, whatever its count in one
batch.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple, Optional

import tensorflow as tf

from tfpsx import graph_state
from tfpsx.embedding.sharding import EmbeddingLookup, ShardedTable
from tfpsx.modes.geo.contention import Contention
from tfpsx.modes.geo.copies import GeoTable, copy_apply
from tfpsx.ops import bindings


class Route(NamedTuple):
    """How a training step's lookup split a chosen table's batch (:meth:`HotRows._chosen_rows`),
    for the step's apply: the flag it read, the keys it sent to the PS, and ``held``
    (int64 [keys, the PS's keys], the step's count for GEO's traffic figures)."""
    on_ps: tf.Tensor
    ps_keys: tf.Tensor
    held: tf.Tensor


def route_of(hot) -> Optional[Route]:
    """The :class:`Route` of the lookup whose hot mask is ``hot``, or None (eager code, no
    mask, or a mask not of a chosen table's lookup: one the step built itself)."""
    if hot is None or tf.executing_eagerly():
        return None
    state = graph_state.peek()
    return None if state is None else state.geo_routes.get(hot.ref())


@contextlib.contextmanager
def switch_merge_conds():
    """The tf.conds built within are TF1's (Switch / Merge) in a TF1 graph: on a
    cluster's worker, TF2's (an If op, its branches functions called each step) cost
    word2vec's GEO workers 16.6-18.2 ms of CPU per 1,000 examples where the same conds
    as Switch / Merge cost 13.8-14.5, async's 11.8-14.5 (1 PS + 4 workers,
    benchmarks/time_to_auc.py, docs/design-notes/geo.md). A ``tf.function``'s conds
    (Keras) stay TF2's: it has no others. The switch is TF's process-wide flag: a TF1
    graph built in another thread meanwhile would get TF1 conds too (they run the
    same; graph mode builds its graph in one thread)."""
    graph = tf.compat.v1.get_default_graph()
    if tf.executing_eagerly() or graph.building_function or \
            not tf.compat.v1.control_flow_v2_enabled():
        yield
        return
    tf.compat.v1.disable_control_flow_v2()
    try:
        yield
    finally:
        tf.compat.v1.enable_control_flow_v2()


class HotRows:
    """The rows a GEO worker's training step looks up and trains: an id seen at least
    ``hot_count`` times in the batch (0: no such rule), or one that ``contention`` finds
    too contended for a round, on the PS (async); the others in the copy (see the module
    doc). The table's ``lookup_source`` in GEO with ``geo_hot_count`` or
    ``geo_hot_per_round``."""

    def __init__(self, t: GeoTable, hot_count: int, contention: Optional[Contention] = None,
                 on_ps=None, distinct=None):
        self.geo, self.hot_count, self.contention = t, hot_count, contention
        # geo_table_choice="auto": a bool variable, True while the table trains async
        # (every row read and trained on the PS, evaluations read the PS too), and the
        # count of the distinct rows trained (DistinctRows: the choice's estimate).
        self.on_ps, self.distinct = on_ps, distinct

    def _hot(self, unique, counts) -> tf.Tensor:
        """Which of a batch's unique keys (seen ``counts`` times) train on the PS, by the
        rules (hot count, contention): while the table runs rounds."""
        hot = (counts >= self.hot_count if self.hot_count
               else tf.zeros(tf.shape(counts), tf.bool))
        contended = self.contention.hot(unique) if self.contention else None
        return hot if contended is None else tf.logical_or(hot, contended)

    def lookup_unique(self, ids, train: bool = True, step=None, tape=None) -> EmbeddingLookup:
        local = self.geo.local
        if not train and self.on_ps is None:  # evaluation reads the copy, as GEO's do
            return local.lookup_unique(ids, train=False, step=step, tape=tape)
        keys = local._keys(ids)
        unique, index, counts = tf.unique_with_counts(tf.reshape(keys, [-1]))
        if self.on_ps is None:
            hot = self._hot(unique, counts)
            unique_rows = self._rows(unique, hot, counts, train, step)
        else:
            with switch_merge_conds():
                hot, unique_rows = self._chosen_rows(unique, counts, train, step)
        if tape is not None:
            tape.watch(unique_rows)
        embeddings = tf.reshape(tf.gather(unique_rows, index),
                                tf.concat([tf.shape(keys), [local.dim]], axis=0))
        return EmbeddingLookup(unique, unique_rows, index, embeddings,
                               hot=hot if train else None)

    def _chosen_rows(self, unique, counts, train: bool, step):
        """(which keys are hot, the rows of ``unique``) of a table the job chooses for
        (``on_ps``): while it trains async, every key is hot and its rows are the PS's
        as async reads them; else as :meth:`_rows`. Evaluations read the same way.

        The split and the stitch are ops of their own (``bindings.geo_split_keys``,
        ``geo_stitch_rows``, run inline): with the flag on they forward the keys and
        the PS's rows. The rules that find the hot keys, the copy's lookup and the
        chief's count of distinct rows stay in TF1 conds, dead while the flag is on (a
        dead node is not handed to the executor's thread pool, as a table op run with
        no key would be). Before, conds around the split and the stitch too ran 74
        nodes a table-step against async's 39 (then 44, with the train op on the PS:
        :meth:`apply`; benchmarks/geo_step_ops.py, which now builds the step through
        the table's updater: 55 with its count of the rows held, which the split op
        gives, :class:`Route`); word2vec's workers at 1 PS + 8, the
        two interleaved: 24.0 and 27.3 ms of CPU per 1,000 examples against 23.1 and
        22.0 (docs/design-notes/geo.md). The split of
        an all-hot batch with TF's masks, gathers and a stitch cost 17 against async's
        12 at 4 workers, TF2 If ops 15-18.
        """
        local, global_ = self.geo.local, self.geo.global_
        on_ps = tf.convert_to_tensor(self.on_ps)
        if train and self.distinct is not None:
            # (the choice's estimate, while the table trains async)
            with tf.control_dependencies([tf.cond(on_ps, lambda: self._mark(unique),
                                                  lambda: tf.constant(False))]):
                unique = tf.identity(unique)
        if train and (self.hot_count or self.contention is not None):
            # (the rules read only while the table runs rounds: the op reads no mask
            # while the flag is on)
            hot = tf.cond(on_ps, lambda: tf.zeros([0], tf.bool),
                          lambda: self._hot(unique, counts))
        else:  # (no rule, or an evaluation: no key hot, every key from the copy)
            hot = tf.zeros([0], tf.bool)
        hot, ps_keys, tail_keys, at_hot, at_tail, held = bindings.geo_split_keys(on_ps, unique,
                                                                                 hot)
        if train and not tf.executing_eagerly():  # (the step's apply takes them)
            graph_state.of().geo_routes[hot.ref()] = Route(on_ps, ps_keys, held)
        with tf.compat.v1.device(self.geo.device):
            ps_rows = tf.reshape(ShardedTable.rows(global_, ps_keys, train, step),
                                 [-1, local.dim])
        # (the stitch checks the copy's rows against the PS's width)
        tail_rows = tf.cond(on_ps, lambda: tf.zeros([0, local.dim]),
                            lambda: local.rows(tail_keys, train, step))
        return hot, bindings.geo_stitch_rows(on_ps, ps_rows, tail_rows, at_hot, at_tail)

    def _mark(self, unique):
        with tf.control_dependencies([self.distinct.mark(unique)]):
            return tf.constant(True)

    def _rows(self, unique, hot, counts, train: bool, step) -> tf.Tensor:
        """The rows of ``unique`` keys: the ``hot`` ones from the PS, the others from the
        copy."""
        local, global_ = self.geo.local, self.geo.global_
        at_hot = tf.cast(tf.where(hot)[:, 0], tf.int32)
        at_tail = tf.cast(tf.where(tf.logical_not(hot))[:, 0], tf.int32)
        hot_rows = ShardedTable.rows(global_, tf.gather(unique, at_hot), train, step)
        # A worker cache's rows() caches what it fetches (its counts: the batch's ids).
        tail_keys = tf.gather(unique, at_tail)
        tail_rows = (local.rows(tail_keys, train, step, tf.gather(counts, at_tail))
                     if self.geo.cached else local.rows(tail_keys, train, step))
        return tf.reshape(tf.dynamic_stitch([at_hot, at_tail], [hot_rows, tail_rows]),
                          [-1, local.dim])

    def lookup(self, ids, train: bool = False, step=None, dedup=None) -> tf.Tensor:
        if train or self.on_ps is not None:
            return self.lookup_unique(ids, train=train, step=step).embeddings
        return self.geo.local.lookup(ids, train=False, step=step, dedup=dedup)

    def apply(self, keys, grads, hot, step):
        """Trains the hot rows of ``keys`` on the PS, the others in the copy; returns the
        op (None in eager mode). A table the job chooses for trains every row on the PS
        while it trains async, as async does (one op of this worker picks what the PS's
        apply gets, :meth:`_chosen_apply`)."""
        # (``grads`` were checked against ``keys`` by the table's apply_gradients: the
        # parts are not checked again, which cost a step an assert each)
        grads = tf.convert_to_tensor(grads)
        if self.on_ps is None:
            tail = tf.logical_not(hot)
            ps_keys, ps_grads = tf.boolean_mask(keys, hot), tf.boolean_mask(grads, hot)
            local = copy_apply(self.geo, tf.boolean_mask(keys, tail),
                               tf.boolean_mask(grads, tail), step)
        else:
            with switch_merge_conds():
                ps_keys, ps_grads, copied = self._chosen_apply(keys, grads, hot, step)
            # The copy's part (a cond on this worker) runs before the PS's gradients
            # leave it, not beside the PS's apply: a step whose train op is all PS ops
            # is grouped on the PS, and one worker op in the group ends each step with
            # the PS telling this worker (a control edge: one more RPC a step).
            with tf.control_dependencies([copied]):
                ps_grads = tf.identity(ps_grads)
            local = None
        ops = [ShardedTable.apply_checked(self.geo.global_, ps_keys, ps_grads, step), local]
        ops = [op for op in ops if op is not None]
        return tf.group(ops) if ops else None

    def _chosen_apply(self, keys, grads, hot, step):
        """(keys and gradients for the PS's apply, the copy's apply op) of a table the
        job chooses for: every key on the PS while it trains async
        (``bindings.geo_split_rows`` forwards them, the copy's apply gets none); else the
        hot keys, the copy's apply the others."""
        route = route_of(hot)
        on_ps = tf.convert_to_tensor(self.on_ps) if route is None else route.on_ps
        ps_keys, ps_grads, tail_keys, tail_grads = bindings.geo_split_rows(on_ps, keys, grads,
                                                                           hot)
        if route is not None:
            # The step's lookup split the same keys by the same flag and mask: its keys
            # on the PS are the apply's (sent once a step, as async's; and one read of
            # the flag a step, which a round may set meanwhile).
            ps_keys = route.ps_keys

        def copy_apply():
            with tf.control_dependencies(
                    [self.geo.local.apply_checked(tail_keys, tail_grads, step)]):
                return tf.constant(True)

        # (a TF1 cond, as the copy's lookup, :meth:`_chosen_rows`)
        return ps_keys, ps_grads, tf.cond(on_ps, lambda: tf.constant(False), copy_apply)


class AsyncRows:
    """The lookups of a table the job chooses for, in a step traced while the table
    trains async (a front-end that traces its step again when the job's choice changes:
    Keras's): every row read and trained on the PS, exactly as async's step, and the
    distinct rows of training lookups counted for the choice's estimate. Its lookups
    have no ``hot``: :class:`~tfpsx.modes.geo.tables.GeoTableUpdater` trains their rows
    on the PS. (:class:`HotRows`'s step serves both states through split ops and
    conds of this worker's: with conds alone, on the Criteo job, 0.84-0.93x async's
    examples/s; a PS-only step like this one ran at async's in the same session, one
    run. With it the job ran at 0.92x, medians of 2: the rest is the rounds and the
    machine's noise, docs/modes.md.)"""

    def __init__(self, t: GeoTable, distinct=None):
        self.geo, self.distinct = t, distinct

    def lookup_unique(self, ids, train: bool = True, step=None, tape=None) -> EmbeddingLookup:
        looked = ShardedTable.lookup_unique(self.geo.global_, ids, train=train, step=step,
                                            tape=tape)
        if train and self.distinct is not None:
            # (a stateful op: a tf.function runs it; graph mode never builds this source)
            self.distinct.mark(looked.unique_keys)
        return looked

    def lookup(self, ids, train: bool = False, step=None, dedup=None) -> tf.Tensor:
        if train:
            return self.lookup_unique(ids, train=True, step=step).embeddings
        return ShardedTable.lookup(self.geo.global_, ids, train=False, step=step, dedup=dedup)

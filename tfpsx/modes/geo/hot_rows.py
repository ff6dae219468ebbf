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

from typing import Optional

import tensorflow as tf

from tfpsx.embedding.sharding import EmbeddingLookup, ShardedTable
from tfpsx.modes.geo.contention import Contention
from tfpsx.modes.geo.copies import GeoTable


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
        """Which of a batch's unique keys (seen ``counts`` times) train on the PS."""
        hot = (counts >= self.hot_count if self.hot_count
               else tf.zeros(tf.shape(counts), tf.bool))
        if self.on_ps is None:
            contended = self.contention.hot(unique) if self.contention else None
            return hot if contended is None else tf.logical_or(hot, contended)
        if self.contention is not None and self.contention.active():
            # None while the table trains async (every key is hot then): the estimate
            # cost a word2vec worker ~8% of its examples/s (a tf.cond of this worker's
            # ops only).
            hot = tf.logical_or(hot, tf.cond(
                tf.convert_to_tensor(self.on_ps), lambda: tf.zeros(tf.shape(unique), tf.bool),
                lambda: self.contention.hot(unique)))
        return tf.logical_or(hot, self._all(unique))

    def _all(self, unique) -> tf.Tensor:
        """The table trains async now: every key, else none."""
        return tf.fill(tf.shape(unique), tf.convert_to_tensor(self.on_ps))

    def lookup_unique(self, ids, train: bool = True, step=None, tape=None) -> EmbeddingLookup:
        local = self.geo.local
        if not train and self.on_ps is None:  # evaluation reads the copy, as GEO's do
            return local.lookup_unique(ids, train=False, step=step, tape=tape)
        keys = local._keys(ids)
        unique, index, counts = tf.unique_with_counts(tf.reshape(keys, [-1]))
        if train and self.distinct is not None:
            with tf.control_dependencies([self.distinct.mark(unique)]):
                unique = tf.identity(unique)
        # Evaluation reads the copy, or the PS while the table trains async. (One path
        # for both: a tf.cond between them, whose branches hold the PS's ops, cost a
        # word2vec worker 13% of its examples/s on a cluster, measured.)
        hot = self._hot(unique, counts) if train else self._all(unique)
        unique_rows = self._rows(unique, hot, counts, train, step)
        if tape is not None:
            tape.watch(unique_rows)
        embeddings = tf.reshape(tf.gather(unique_rows, index),
                                tf.concat([tf.shape(keys), [local.dim]], axis=0))
        return EmbeddingLookup(unique, unique_rows, index, embeddings,
                               hot=hot if train else None)

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
        op (None in eager mode)."""
        grads = tf.convert_to_tensor(grads)
        tail = tf.logical_not(hot)
        ops = [ShardedTable.apply(self.geo.global_, tf.boolean_mask(keys, hot),
                                  tf.boolean_mask(grads, hot), step),
               self.geo.local.apply(tf.boolean_mask(keys, tail), tf.boolean_mask(grads, tail),
                                    step)]
        ops = [op for op in ops if op is not None]
        return tf.group(ops) if ops else None

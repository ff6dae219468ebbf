"""sync, once for both front-ends: each step applies the average of
``replicas_to_aggregate`` workers' gradients, once.

The pieces both front-ends build a sync step from: the checked ``replicas_to_aggregate``;
the tables' path (:class:`TableAccumulators`: per-shard accumulators stamped with the
worker's local step, the chief's one apply; :class:`SyncTableUpdater` sends a table's
row gradients there); per-worker token queues (:func:`token_queues`,
:func:`release_tokens`, :func:`take_token`: a worker takes only its own token, so no
worker supplies two gradients of one step). A finished worker leaves the group
(:data:`tfpsx.modes.group.DONE`).
"""

from __future__ import annotations

from typing import Protocol

import tensorflow as tf

from tfpsx.embedding.updaters import TableUpdater


class SyncState(Protocol):
    """What a table joins in sync (graph mode's ``SyncMode``, Keras's ``KerasSync``)."""

    def push(self, table, keys, grads):
        """The op sending a table's row gradients to the step's aggregation."""


def replicas_to_aggregate(strategy, workers: int, what: str) -> int:
    """The strategy's replicas_to_aggregate (default: every worker), checked."""
    replicas = strategy.replicas_to_aggregate
    replicas = workers if replicas is None else replicas
    if isinstance(replicas, bool) or not isinstance(replicas, int) or \
            not 1 <= replicas <= workers:
        raise ValueError(f"{what}: sync needs replicas_to_aggregate in 1..{workers} (the "
                         f"cluster's worker count), got {replicas!r}")
    return replicas


class TableAccumulators:
    """The sync path of tables, for graph mode and Keras alike: each table shard's row
    gradients go into a SparseConditionalAccumulator on that shard's PS, stamped with the
    worker's local step (stale ones are dropped); the chief takes ``replicas`` of them,
    sums each key's rows, divides by ``replicas`` and applies the table's server-side
    optimizer once."""

    def __init__(self):
        self.entries = []   # (table, shard index, SparseConditionalAccumulator)
        self.pushes = []    # the push ops of the current graph

    def push(self, table, keys, grads, local_step):
        """The op that sends a table's row gradients to its shards' accumulators."""
        def to_accumulator(i, shard, shard_keys, shard_grads):
            serial = sum(1 for t, s, _ in self.entries if t is table and s == i)
            acc = tf.compat.v1.SparseConditionalAccumulator(
                tf.float32, shape=tf.TensorShape([None, table.dim]), reduction_type="SUM",
                shared_name=f"{table.name}/part_{i}/sync_grads_{serial}")
            self.entries.append((table, i, acc))
            return acc.apply_grad(shard_keys, shard_grads, local_step=local_step)

        push = tf.group(*table.on_shards(to_accumulator, keys, [grads]), name="table_sync_push")
        self.pushes.append(push)
        return push

    def apply(self, replicas, step) -> list:
        """The chief's ops: take ``replicas`` (an int or int32 tensor) gradients per shard
        and apply them once."""
        updates = []
        for table, i, acc in self.entries:
            shard = table.shards[i]
            with tf.compat.v1.device(shard.device):
                taken = acc.take_indexed_slices_grad(replicas)
                # A key may come from several workers (the accumulator keeps each
                # gradient's rows): one summed row per key, then one optimizer step.
                keys, where = tf.unique(taken.indices)
                grads = tf.math.unsorted_segment_sum(taken.values, where, tf.size(keys))
                updates.append(shard.apply(table.optimizer, keys,
                                           grads / tf.cast(replicas, tf.float32), step))
        return updates

    def set_global_step(self, step) -> list:
        """Gradients stamped before ``step`` are stale from now on."""
        return [acc.set_global_step(step) for _, _, acc in self.entries]


def token_queues(total: int, prefix: str):
    """One token queue per worker (on the current device): the chief puts one token per
    step into each, a worker takes its own, so no worker can supply two gradients of one
    step (TF's SyncReplicasOptimizer shares one queue: a fast worker could)."""
    return [tf.queue.FIFOQueue(-1, tf.int64, shapes=[], shared_name=f"{prefix}_{w}",
                               name=f"{prefix}_{w}") for w in range(total)]


def release_tokens(queues, token):
    """One ``token`` into each worker's queue, unless 2 wait there already: the queue of a
    dead backup worker (fewer replicas than workers) must not grow by one every step."""
    return tf.group(*[q.enqueue_many(tf.fill([tf.cast(q.size() < 2, tf.int32)], token))
                      for q in queues])


def take_token(queue):
    """This worker's token (waits for it), then any older ones a straggler left; the
    newest step among them. Only this worker dequeues its queue: size-then-dequeue does
    not race."""
    first = queue.dequeue()
    with tf.control_dependencies([first]):
        rest = queue.dequeue_many(queue.size())
    return tf.maximum(first, tf.reduce_max(rest))  # max of none: int64 min


class SyncTableUpdater(TableUpdater):
    """Row gradients go to the sync accumulators of ``mode`` (graph mode's ``SyncMode`` or
    Keras's ``KerasSync``: a :class:`SyncState`)."""

    #: A cache's rows train locally between syncs: no per-step aggregation of them.
    supports_cache = False

    def __init__(self, mode: "SyncState"):
        super().__init__()
        self._mode = mode

    def attach(self, table) -> None:
        pass

    def apply_gradients(self, table, keys, grads, step):
        return self._mode.push(table, keys, grads)

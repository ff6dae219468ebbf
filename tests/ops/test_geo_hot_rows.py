"""GEO's hot rows (tfpsx.embedding.geo_rule.HotRows, a strategy's geo_hot_count), in
one process: an id seen at least hot_count times in a worker's batch is read from and
trained on the PS (async), the rest of the batch trains the worker's copy, and the
copy's next pull brings the PS's async moves."""

import numpy as np
import tensorflow as tf

from tfpsx import embedding as E
from tfpsx.embedding import geo_rule
from tfpsx.embedding.sharding import ShardedTable

DIM = 2
_names = iter(range(10 ** 6))


def geo_pair(reader=1, hot_count=2):
    n = next(_names)
    g = ShardedTable(f"hot_g{n}", DIM, [None, None], initializer=E.normal(stddev=0.1),
                     optimizer=E.Adagrad(0.5), seed=3)
    copy = dict(initializer=g.initializer, seed=g.seed, devices=[None])
    t = geo_rule.GeoTable(g, ShardedTable(f"hot_l{n}", DIM, optimizer=g.optimizer, **copy),
                          ShardedTable(f"hot_o{n}", DIM, **copy), None, reader,
                          combine="sum")
    geo_rule.table_readers(t)
    return t, geo_rule.HotRows(t, hot_count)


def rows_of(table, keys):
    return table.shards[0].find(tf.constant(keys, tf.int64))[0].numpy() \
        if len(table.shards) == 1 else table.rows(tf.constant(keys, tf.int64), False).numpy()


def test_a_batchs_hot_ids_read_and_train_on_the_ps_the_rest_on_the_copy():
    t, hot = geo_pair(hot_count=2)
    # The PS and the copy hold different values for both keys: a read shows its source.
    t.global_.insert(tf.constant([7, 9], tf.int64), tf.constant([[1., 1.], [2., 2.]]))
    t.local.insert(tf.constant([7, 9], tf.int64), tf.constant([[-1., -1.], [-2., -2.]]))
    t.old.insert(tf.constant([7, 9], tf.int64), tf.constant([[-1., -1.], [-2., -2.]]))
    ids = tf.constant([[7, 9], [7, 3]], tf.int64)  # 7 twice (hot), 9 and 3 once
    with tf.GradientTape() as tape:
        looked = hot.lookup_unique(ids, train=True, step=1, tape=tape)
        loss = tf.reduce_sum(looked.embeddings)
    assert looked.unique_keys.numpy().tolist() == [7, 9, 3]
    assert looked.hot.numpy().tolist() == [True, False, False]
    np.testing.assert_allclose(looked.unique_rows.numpy()[:2], [[1., 1.], [-2., -2.]])
    np.testing.assert_allclose(looked.embeddings.numpy()[0], [[1., 1.], [-2., -2.]])
    grads = tape.gradient(loss, looked.unique_rows)
    hot.apply(looked.unique_keys, grads, looked.hot, step=1)
    # 7 moved on the PS (its Adagrad), not in the copy; 9 and 3 in the copy only.
    assert (rows_of(t.global_, [7]) < 1.).all()
    np.testing.assert_allclose(rows_of(t.local, [7]), [[-1., -1.]])
    assert (rows_of(t.local, [9]) < -2.).all()
    np.testing.assert_allclose(rows_of(t.global_, [9]), [[2., 2.]])
    # A push moves only the copy's rows; the pull brings 7's async move home: the copy
    # then holds the PS's value of every row it shares (its own deltas pushed).
    geo_rule.table_push(t, 1.0, None)
    geo_rule.table_pull(t)
    np.testing.assert_allclose(rows_of(t.local, [7, 9, 3]), rows_of(t.global_, [7, 9, 3]),
                               rtol=1e-6)


def test_two_workers_hot_rows_meet_on_the_ps_at_every_step():
    """Worker B's next step reads the move worker A's step just made to a hot row (no
    round between them), as async's would."""
    a, hot_a = geo_pair(reader=1)
    b = geo_rule.GeoTable(a.global_, ShardedTable("hot_b_l", DIM, optimizer=a.global_.optimizer,
                                                  initializer=a.global_.initializer, seed=3,
                                                  devices=[None]),
                          ShardedTable("hot_b_o", DIM, initializer=a.global_.initializer,
                                       seed=3, devices=[None]), None, 2, combine="sum")
    geo_rule.table_readers(b)
    hot_b = geo_rule.HotRows(b, 2)
    ids = tf.constant([5, 5, 6], tf.int64)
    looked = hot_a.lookup_unique(ids, train=True, step=1)
    hot_a.apply(looked.unique_keys, tf.ones([2, DIM]), looked.hot, step=1)
    seen_by_b = hot_b.lookup_unique(ids, train=True, step=1)
    np.testing.assert_allclose(seen_by_b.unique_rows.numpy()[0], rows_of(a.global_, [5])[0])
    assert not np.allclose(seen_by_b.unique_rows.numpy()[0], looked.unique_rows.numpy()[0])
    # An evaluation reads the copy, whole.
    np.testing.assert_allclose(hot_b.lookup(ids).numpy()[2], rows_of(b.local, [6])[0])


def test_a_table_with_a_worker_cache_follows_the_rule_for_many_workers():
    """GEO's updater gives a cached table the job's rule: its rows travel with their
    slots (summed on the PS), and its hot ids read and train on the PS (HotRows over
    the cache; tests/ops/test_worker_cache.py drives both)."""
    from tfpsx.modes.geo import GeoTableUpdater

    class Mode:
        worker_index, worker_num, worker_device = 0, 4, "/job:localhost/replica:0/task:0"
        tables, wire_dtype, in_train_thread, share_slots, hot_count = [], None, True, True, 4
        named = frozenset()

    table = E.DynamicTable("hot_cached", DIM, optimizer=E.Adagrad(0.1), cache_size=16)
    updater = GeoTableUpdater(Mode())
    updater.attach(table)
    (t,) = Mode.tables
    assert t.cached and t.share_slots and t.combine == "sum"
    assert t.old.num_slots == 1  # old keeps the slots a row came with
    source = updater.lookup_source(table)
    assert isinstance(source, geo_rule.HotRows) and source.hot_count == 4
    assert source.geo.local is updater.cache

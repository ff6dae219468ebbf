"""The ops of GEO's choice between rounds and async (geo_table_choice="auto"), in one
process: while a table trains async every row is read from and trained on the PS, an
evaluation reads the PS too; a worker counts the distinct rows its steps trained
(linear counting, against numpy's count); a table that tries rounds registers its reader
on the PS and its copy takes the PS's rows, slots included; then its lookups read the
copy, and the next pull brings what the PS changed since. The expected values are the
rows put on the PS here, and Adagrad's step worked out in numpy."""

import numpy as np
import pytest
import tensorflow as tf

from tfpsx import embedding as E
from tfpsx.embedding import row_copy
from tfpsx.embedding.sharding import ShardedTable
from tfpsx.modes import geo
from tfpsx.modes.geo.copies import copy_global, local_reader
from tfpsx.modes.geo.distinct import DistinctRows
from tfpsx.modes.geo.tables import async_flag

DIM, LR = 2, 0.5
_names = iter(range(10 ** 6))


def chosen_pair():
    """A GEO table the job chooses for (shared slots), as a worker starts it: async, only
    its copy's own reader registered."""
    n = next(_names)
    g = ShardedTable(f"choice_g{n}", DIM, [None, None], initializer=E.zeros(),
                     optimizer=E.Adagrad(LR, initial_accumulator_value=0.1))
    copy = dict(initializer=g.initializer, devices=[None])
    t = geo.GeoTable(g, ShardedTable(f"choice_l{n}", DIM, optimizer=g.optimizer, **copy),
                     ShardedTable(f"choice_o{n}", DIM, optimizer=g.optimizer, **copy), None,
                     1, share_slots=True, chosen=True, trains_async=True)
    local_reader(t)
    return t


def rows_of(table, keys):
    return table.rows(tf.constant(keys, tf.int64), False).numpy()


def test_an_async_table_reads_and_trains_every_row_on_the_ps_then_tries_rounds():
    t = chosen_pair()
    flag = async_flag(t)
    assert bool(flag.numpy())  # a table the job chooses for starts async
    t.global_.insert(tf.constant([4, 5], tf.int64), tf.constant([[1., 1.], [2., 2.]]))
    hot = geo.HotRows(t, 4, None, flag)
    ids = tf.constant([4, 5, 4], tf.int64)
    with tf.GradientTape() as tape:
        looked = hot.lookup_unique(ids, train=True, step=1, tape=tape)
        loss = tf.reduce_sum(looked.embeddings)
    assert looked.hot.numpy().tolist() == [True, True]  # every row, seen once or not
    np.testing.assert_allclose(looked.unique_rows.numpy(), [[1., 1.], [2., 2.]])
    hot.apply(looked.unique_keys, tape.gradient(loss, looked.unique_rows), looked.hot, 1)
    # Adagrad on the PS: acc = 0.1 + g^2, row -= LR g / sqrt(acc); 4's gradient is 2.
    moved = {4: 1. - LR * 2. / np.sqrt(0.1 + 4.), 5: 2. - LR * 1. / np.sqrt(0.1 + 1.)}
    np.testing.assert_allclose(rows_of(t.global_, [4, 5]), [[moved[4]] * 2, [moved[5]] * 2],
                               rtol=1e-6)
    assert int(t.local.size()) == 0  # the copy neither read nor trained
    # An evaluation reads the PS while async, the copy once the table runs rounds.
    np.testing.assert_allclose(hot.lookup(tf.constant([5], tf.int64)).numpy(),
                               [[moved[5]] * 2], rtol=1e-6)

    # It tries rounds: the copy and its snapshot take the PS's rows with their slots.
    copy_global(t)
    for table in (t.local, t.old):
        np.testing.assert_allclose(rows_of(table, [4, 5]), [[moved[4]] * 2, [moved[5]] * 2],
                                   rtol=1e-6)
    slots = t.old.shards[0].find(tf.constant([4], tf.int64), with_slots=True)[0].numpy()
    np.testing.assert_allclose(slots[0, DIM:], [0.1 + 4.] * DIM, rtol=1e-6)
    flag.assign(False)
    t.local.insert(tf.constant([5], tf.int64), tf.constant([[7., 7.]]))  # (a copy's step)
    np.testing.assert_allclose(hot.lookup(tf.constant([5], tf.int64)).numpy(), [[7., 7.]])
    looked = hot.lookup_unique(tf.constant([5], tf.int64), train=True, step=2)
    assert looked.hot.numpy().tolist() == [False]
    # Its reader on the PS is registered: a change after the copy is in the next pull.
    t.global_.insert(tf.constant([4], tf.int64), tf.constant([[9., 9.]]))
    pulled = row_copy.table_pull(t)[1]
    assert int(pulled) == 1
    np.testing.assert_allclose(rows_of(t.local, [4]), [[9., 9.]])


def test_the_distinct_rows_a_worker_trained_are_counted_between_rounds():
    rng = np.random.default_rng(5)
    counter = DistinctRows(f"distinct{next(_names)}", None, width=1 << 16)
    # Ids as the examples make them (hashes: random 63-bit keys), some repeating.
    vocabulary = rng.integers(0, 2 ** 63 - 1, 20_000)
    batches = [rng.choice(vocabulary, 3_000) for _ in range(5)]
    for keys in batches:
        counter.mark(tf.constant(np.unique(keys), tf.int64))
    exact, got = len(np.unique(np.concatenate(batches))), float(counter.take())
    assert abs(got - exact) < 0.02 * exact, (got, exact)
    assert float(counter.take()) == 0.0  # a take clears the count
    counter.mark(tf.constant(vocabulary[:2], tf.int64))
    assert abs(float(counter.take()) - 2.0) < 0.01


def test_the_distinct_rows_are_of_k_steps_scaled_by_the_steps_since_the_last_take():
    """Rounds further apart than K steps (every table async): the count marks the
    lookups of the first K steps after a take, and the take scales by the steps over K;
    a round after fewer than K steps is not scaled."""
    rng = np.random.default_rng(7)
    k = [3]
    counter = DistinctRows(f"distinct{next(_names)}", None, width=1 << 16,
                           steps=lambda: k[0])
    batches = [rng.integers(0, 2 ** 63 - 1, 500) for _ in range(12)]  # distinct ids
    for keys in batches:
        counter.mark(tf.constant(keys, tf.int64))
    # 3 lookups marked (1,500 ids) of 12: 4 rounds of K would move 4 x 1,500
    got = float(counter.take())
    assert abs(got - 4 * 1_500) < 0.02 * 6_000, got
    for keys in batches[:2]:
        counter.mark(tf.constant(keys, tf.int64))
    assert abs(float(counter.take()) - 1_000) < 0.02 * 1_000
    with pytest.raises(ValueError, match="steps must be >= 0, got -1"):
        k[0] = -1
        counter.mark(tf.constant([1], tf.int64))
    # A step that looks the table up twice (a graph's two lookups, the same ids): after
    # the first take, 6 steps at K=3 mark the first 3 steps' batches, scaled by 2 (a
    # count of the first 3 lookups, 1.5 steps, scaled by 4, would read 4,000).
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        counter = DistinctRows(f"distinct{next(_names)}", None, width=1 << 16,
                               steps=lambda: 3)
        ids = tf.compat.v1.placeholder(tf.int64, [None])
        step = tf.group(counter.mark(ids), counter.mark(tf.identity(ids)))
        take = counter.take()
        sess.run(tf.compat.v1.local_variables_initializer())
        sess.run(take)  # (a round: the next marks the first 3 steps)
        for keys in batches[:6]:
            sess.run(step, {ids: keys})
        got = sess.run(take)
        assert abs(got - 2 * 3 * 500) < 0.02 * 3_000, got


def test_graph_mode_a_chosen_table_trains_on_the_ps_then_its_copy_as_its_flag_says():
    """The same step in a TF1 graph (the split and stitch ops of the flag, the hot
    count's rule in a TF1 cond), run with the flag True, then False: one graph trains the PS
    while async, then the copy, with the hot count's rows on the PS; the distinct rows
    are counted only while async."""
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        t = chosen_pair()
        flag = async_flag(t)
        counter = DistinctRows(f"distinct{next(_names)}", None, width=1 << 10)
        hot = geo.HotRows(t, 2, None, flag, counter)
        ids = tf.compat.v1.placeholder(tf.int64, [None])
        looked = hot.lookup_unique(ids, train=True, step=1)
        loss = tf.reduce_sum(looked.embeddings)
        grads = tf.gradients(loss, looked.unique_rows)[0]
        train = hot.apply(looked.unique_keys, grads, looked.hot, 1)
        evaluate = hot.lookup(ids)
        value = tf.compat.v1.placeholder(tf.bool, [])
        set_flag = flag.assign(value)
        sess.run([tf.compat.v1.global_variables_initializer(),
                  tf.compat.v1.local_variables_initializer()])
        sess.run(t.global_.insert(tf.constant([4, 5], tf.int64),
                                  tf.constant([[1., 1.], [2., 2.]])))
        rows = lambda table, keys: sess.run(  # noqa: E731
            table.rows(tf.constant(keys, tf.int64), False))

        got, hot_keys, _ = sess.run([looked.unique_rows, looked.hot, train], {ids: [4, 5, 4]})
        np.testing.assert_allclose(got, [[1., 1.], [2., 2.]])
        assert hot_keys.tolist() == [True, True]
        moved = {4: 1. - LR * 2. / np.sqrt(0.1 + 4.), 5: 2. - LR * 1. / np.sqrt(0.1 + 1.)}
        np.testing.assert_allclose(rows(t.global_, [4, 5]),
                                   [[moved[4]] * 2, [moved[5]] * 2], rtol=1e-6)
        assert int(sess.run(t.local.size())) == 0
        assert abs(float(sess.run(counter.take())) - 2.0) < 0.01
        np.testing.assert_allclose(sess.run(evaluate, {ids: [5]}), [[moved[5]] * 2],
                                   rtol=1e-6)

        # The table runs rounds: its copy holds 7 (and 5's PS value); 4 is seen twice in
        # the batch (the hot count): it stays on the PS.
        sess.run(set_flag, {value: False})
        assert not bool(sess.run(flag))
        sess.run(t.local.insert(tf.constant([5, 7], tf.int64), tf.constant([[3., 3.], [4., 4.]])))
        got, hot_keys, _ = sess.run([looked.unique_rows, looked.hot, train],
                                    {ids: [4, 7, 4, 5]})
        np.testing.assert_allclose(got, [[moved[4]] * 2, [4., 4.], [3., 3.]], rtol=1e-6)
        assert hot_keys.tolist() == [True, False, False]
        ps_4 = moved[4] - LR * 2. / np.sqrt(0.1 + 4. + 4.)  # its second step, on the PS
        np.testing.assert_allclose(rows(t.global_, [4, 5]), [[ps_4] * 2, [moved[5]] * 2],
                                   rtol=1e-6)
        # The copy's rows (inserted with no slots: Adagrad's initial accumulator 0.1)
        np.testing.assert_allclose(rows(t.local, [7, 5]),
                                   [[4. - LR / np.sqrt(1.1)] * 2, [3. - LR / np.sqrt(1.1)] * 2],
                                   rtol=1e-6)
        assert float(sess.run(counter.take())) == 0.0  # not counted while in rounds
        np.testing.assert_allclose(sess.run(evaluate, {ids: [7]}),
                                   [[4. - LR / np.sqrt(1.1)] * 2], rtol=1e-6)

"""GEO's pull of the rows a worker will read (``geo_pull_ahead``), in one process: a pull
among given keys brings only the changed rows among them, leaves the other changed rows
marked on the PS for a later pull, and a later pull of a row brings everything the others
pushed to it since this worker last pulled it. The reference is numpy's arithmetic on the
rows each worker trained, not the product's own pull."""

import numpy as np
import tensorflow as tf

from tfpsx import embedding as E
from tfpsx.embedding import row_copy
from tfpsx.embedding.sharding import ShardedTable
from tfpsx.modes import geo
from tfpsx.modes.geo.copies import copy_global

DIM = 3
KEYS = np.arange(100, 128, 2, dtype=np.int64)  # 14 rows over 2 shards
_names = iter(range(10 ** 6))


def rows_of(table, keys):
    return table.stitched(lambda i, shard, k: shard.find(k)[0], tf.constant(keys)).numpy()


def worker(g, reader):
    """A worker's copy of ``g`` (the earlier rule: rows without slots), its readers
    registered and its copy taking the PS's rows."""
    copy = dict(initializer=g.initializer, seed=g.seed, devices=[None], optimizer=g.optimizer)
    t = geo.GeoTable(g, ShardedTable(f"ahead_l{next(_names)}", DIM, **copy),
                     ShardedTable(f"ahead_o{next(_names)}", DIM, **copy), None, reader)
    row_copy.table_readers(t)
    copy_global(t)
    return t


def train(t, keys, grads):
    """One SGD step (learning rate 0.5) of the copy on ``keys``: each row moves by
    -0.5 x its gradient, whatever its value (the reference needs no model)."""
    t.local.apply(tf.constant(keys), tf.constant(grads, tf.float32))


def push(t):
    ops, (rows, _) = geo.push_ops([], [t], 1.0)
    tf.group(ops)
    return int(rows)


def pull(t, among=None):
    ops, (rows, _) = geo.pull_ops([], [t], among=None if among is None else
                                  [tf.constant(np.asarray(among, np.int64))])
    tf.group(ops)
    return int(rows)


def test_a_pull_among_keys_brings_their_changes_and_leaves_the_rest_for_later():
    rng = np.random.default_rng(3)
    start = rng.normal(size=(len(KEYS), DIM)).astype(np.float32)
    g = ShardedTable(f"ahead_g{next(_names)}", DIM, [None, None], initializer=E.zeros(),
                     optimizer=E.SGD(0.5))
    g.insert(tf.constant(KEYS), tf.constant(start))
    a, b, c = worker(g, 1), worker(g, 2), worker(g, 3)  # c pulls every changed row
    ps = start.copy()                       # numpy: the PS rows, by KEYS' index
    b_rows = start.copy()                   # numpy: what b's copy should hold

    # a trains rows 0-9 and pushes them.
    g1 = rng.normal(size=(10, DIM)).astype(np.float32)
    train(a, KEYS[:10], g1)
    assert push(a) == 10
    ps[:10] -= 0.5 * g1
    np.testing.assert_allclose(rows_of(g, KEYS), ps, rtol=1e-6)

    # b will read rows 5-11 and a key the table never held: only 5-9 changed.
    assert pull(b, among=list(KEYS[5:12]) + [999]) == 5
    b_rows[5:10] = ps[5:10]
    np.testing.assert_allclose(rows_of(b.local, KEYS), b_rows, rtol=1e-6)
    assert pull(b, among=KEYS[5:12]) == 0  # taken: nothing changed since

    # a trains rows 0-2 again; b trains row 12 itself (its own, pushed later).
    g2 = rng.normal(size=(3, DIM)).astype(np.float32)
    train(a, KEYS[:3], g2)
    assert push(a) == 3
    ps[:3] -= 0.5 * g2
    g3 = rng.normal(size=(1, DIM)).astype(np.float32)
    train(b, KEYS[12:13], g3)
    b_rows[12] -= 0.5 * g3[0]

    # b will read rows 0, 1 (repeated) and 12: rows 0 and 1 bring both of a's pushes.
    assert pull(b, among=[KEYS[1], KEYS[0], KEYS[12], KEYS[1]]) == 2
    b_rows[:2] = ps[:2]
    np.testing.assert_allclose(rows_of(b.local, KEYS), b_rows, rtol=1e-6)

    # b pushes its row 12; a pull of every changed row brings the rest: rows 2-4.
    assert push(b) == 1
    ps[12] -= 0.5 * g3[0]
    assert pull(b) == 3
    b_rows[2:5] = ps[2:5]
    np.testing.assert_allclose(rows_of(b.local, KEYS), b_rows, rtol=1e-6)
    np.testing.assert_allclose(rows_of(b.local, KEYS), ps, rtol=1e-6)

    # c, which pulled nothing until now, gets every row a and b changed at once:
    # the same rows a pull every round would have given it.
    assert pull(c) == 11
    np.testing.assert_allclose(rows_of(c.local, KEYS), ps, rtol=1e-6)
    # a's own pushes are not marked for it; b's row 12 is.
    assert pull(a, among=KEYS) == 1
    np.testing.assert_allclose(rows_of(a.local, KEYS), ps, rtol=1e-6)


def test_a_pull_among_keys_of_a_table_with_shared_slots_brings_the_slots_too():
    """The rule for many workers: a row travels with its Adagrad accumulator (bfloat16
    on the wire, less its initial 0.1); a pull among keys brings both, the rest stays."""
    g = ShardedTable(f"ahead_s{next(_names)}", DIM, [None, None], initializer=E.zeros(),
                     optimizer=E.Adagrad(0.3), seed=1)
    g.insert(tf.constant(KEYS), tf.constant(np.ones((len(KEYS), DIM), np.float32)))

    def shared(reader):
        copy = dict(initializer=g.initializer, seed=g.seed, devices=[None],
                    optimizer=g.optimizer)
        t = geo.GeoTable(g, ShardedTable(f"ahead_sl{next(_names)}", DIM, **copy),
                         ShardedTable(f"ahead_so{next(_names)}", DIM, **copy), None, reader,
                         share_slots=True, slot_wire=tf.bfloat16)
        row_copy.table_readers(t)
        copy_global(t)
        return t

    a, b = shared(1), shared(2)
    train(a, KEYS[:6], np.full((6, DIM), 2.0, np.float32))
    assert push(a) == 6
    assert pull(b, among=KEYS[4:]) == 2
    with_slots = lambda t, k: t.stitched(  # noqa: E731
        lambda i, s, kk: s.find(kk, with_slots=True)[0], tf.constant(k)).numpy()
    # Adagrad from accumulator 0.1: acc = 0.1 + 4 = 4.1, value 1 - 0.3 * 2 / sqrt(4.1)
    value = 1 - 0.3 * 2 / np.sqrt(4.1)
    np.testing.assert_allclose(with_slots(b.local, KEYS[4:6]),
                               np.tile([[value] * DIM + [4.1] * DIM], (2, 1)), rtol=2e-3)
    np.testing.assert_allclose(with_slots(b.local, KEYS[:4]),
                               np.tile([[1.0] * DIM + [0.1] * DIM], (4, 1)), rtol=1e-6)
    assert pull(b) == 4
    np.testing.assert_allclose(with_slots(b.local, KEYS[:6]),
                               np.tile([[value] * DIM + [4.1] * DIM], (6, 1)), rtol=2e-3)


def test_the_read_ahead_holds_the_ids_of_the_batches_fit_trains_next():
    """ReadAhead (tfpsx.keras.read_ahead) under a real Keras fit, 2 epochs, 2 steps an
    execution, Keras's look at a batch before it: at each execution's end the window
    from the next local step holds exactly the ids of the batches fit trains next (the
    reference: the ids of the data's batches in order, by numpy); a window longer than
    the input was read is None."""
    import time

    import keras

    import tfpsx.keras
    from tfpsx.keras.read_ahead import ReadAhead

    rng = np.random.default_rng(0)
    ids = rng.integers(0, 500, size=(96, 3)).astype(np.int64)
    y = rng.normal(size=(96, 1)).astype(np.float32)
    batch, window = 8, 5
    inputs = keras.Input((3,), dtype="int64")
    emb = tfpsx.keras.DynamicEmbedding(2, table_name=f"ahead_k{next(_names)}",
                                       initializer=E.zeros(), optimizer=E.SGD(0.1))
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Flatten()(emb(inputs))))
    model.compile("sgd", "mse", steps_per_execution=2)
    reader = ReadAhead(depth=window + 3)
    data = reader.wrap(tf.data.Dataset.from_tensor_slices((ids, y)).batch(batch))
    per_epoch = len(ids) // batch
    want = [np.unique(ids[i * batch:(i + 1) * batch]) for i in range(per_epoch)] * 2
    checked = []

    class Check(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            assert reader.begin(self.model, [emb.table], first_step=100)

        def on_train_batch_end(self, step, logs=None):
            time.sleep(0.05)  # (a real step's time: tf.data reads ahead meanwhile)
            done = self.model.optimizer.iterations.numpy() + 0  # steps trained this fit
            got = reader.window(100 + done, window)
            upcoming = want[done:done + window]
            if got is None:
                return  # (the input was not read that far yet: an epoch's end)
            assert len(upcoming) == window, (done, len(upcoming))
            np.testing.assert_array_equal(got[0], np.unique(np.concatenate(upcoming)))
            checked.append(done)

    model.fit(data, epochs=2, verbose=0, shuffle=False, callbacks=[Check()])
    reader.end()
    assert reader.window(100, 1) is None
    # the executions' ends within an epoch where the next 5 batches lie in it: 2, 4, 6
    # of each epoch (the input was read that far while the steps ran)
    assert len(checked) >= 4, checked


def test_the_read_ahead_runs_only_a_functional_models_id_handling():
    """A subclassed model has no sub-model from its inputs to its embedding layers'
    inputs: reading its ids would run the whole model in tf.data's thread (dense weights
    read from the parameter servers there), so the read-ahead declines (every round
    then pulls every changed row)."""
    import keras

    import tfpsx.keras
    from tfpsx.keras.read_ahead import ReadAhead

    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.emb = tfpsx.keras.DynamicEmbedding(2, table_name=f"ahead_s{next(_names)}")
            self.out = keras.layers.Dense(1)

        def call(self, x):
            return self.out(keras.ops.sum(self.emb(x), axis=1))

    model = Subclassed()
    ids = np.arange(12, dtype=np.int64).reshape(4, 3)
    model(ids)
    reader = ReadAhead(depth=4)
    reader.wrap(tf.data.Dataset.from_tensor_slices((ids, np.zeros([4, 1], np.float32))).batch(2))
    assert not reader.begin(model, [model.emb.table], first_step=0)
    assert reader.window(0, 1) is None


def test_graph_modes_reader_keeps_each_batchs_ids_for_the_rounds_window():
    """GeoReadAhead (graph mode): the program records each batch's ids in the order its
    steps train them; a round's window holds the unique ids of the steps it covers, per
    GEO table in the mode's order (the reference: numpy over the recorded batches), a
    worker cache's table none, and None where the program has not recorded that far."""
    import tfpsx
    from tfpsx.modes.geo import GeoTable

    with tf.Graph().as_default():
        a = E.DynamicTable(f"ahead_a{next(_names)}", DIM, devices=[None])
        b = E.DynamicTable(f"ahead_b{next(_names)}", DIM, devices=[None])
        c = E.DynamicTable(f"ahead_c{next(_names)}", DIM, devices=[None])
        reader = tfpsx.GeoReadAhead([b, a])
        assert reader.batches_ahead == 2 * 20 + 4 + 4  # before the mode's k is known
        geo_tables = [GeoTable(t, None, None, None, 0, cached=t is c) for t in (a, b, c)]
        window = reader.bind(geo_tables, k_steps=3)
        assert reader.batches_ahead == 2 * 3 + 4 + 4
        rng = np.random.default_rng(5)
        recorded = [(rng.integers(0, 50, size=(4, 2)), rng.integers(0, 9, size=7).astype(np.uint32))
                    for _ in range(12)]
        for ids_b, ids_a in recorded:
            reader.record({a: ids_a, b: ids_b})
        assert reader.recorded == 12
        got = window(3, 6)
        want_a = np.unique(np.concatenate([r[1] for r in recorded[3:9]]).astype(np.int64))
        want_b = np.unique(np.concatenate([r[0].ravel() for r in recorded[3:9]]))
        np.testing.assert_array_equal(got[0], want_a)
        np.testing.assert_array_equal(got[1], want_b)
        assert got[0].dtype == got[1].dtype == np.int64 and got[2].size == 0
        np.testing.assert_array_equal(  # the next round's, the last step recorded in it
            window(6, 6)[1], np.unique(np.concatenate([r[0].ravel() for r in recorded[6:]])))
        assert window(7, 6) is None  # steps 7 .. 12: step 12 not recorded yet
        assert window(5, 2) is None  # step 5's batch was dropped: its step ran


def test_graph_modes_reader_holds_a_bounded_number_of_batches(caplog):
    """A program that records far ahead, or whose rounds read nothing (no GEO round with
    geo_pull_ahead), keeps at most HELD_WINDOWS x batches_ahead batches: the oldest go,
    with a warning, and a window that would need one is None (a pull of every changed
    row), never a window with a batch missing."""
    import logging

    import tfpsx
    from tfpsx.training.read_ahead import HELD_WINDOWS

    with tf.Graph().as_default():
        a = E.DynamicTable(f"ahead_a{next(_names)}", DIM, devices=[None])
        reader = tfpsx.GeoReadAhead([a])
        window = reader.bind([geo.GeoTable(a, None, None, None, 0)], k_steps=2)
        most = HELD_WINDOWS * reader.batches_ahead
        with caplog.at_level(logging.WARNING, logger="tfpsx"):
            for i in range(most + 5):
                reader.record({a: [i]})
        assert caplog.text.count("the oldest are dropped") == 1, caplog.text
        assert window(4, 3) is None  # steps 0 .. 4 dropped
        np.testing.assert_array_equal(window(5, 3)[0], [5, 6, 7])


def test_graph_modes_reader_names_each_mistake():
    import pytest

    import tfpsx
    from tfpsx.modes.geo import GeoTable

    with tf.Graph().as_default():
        a = E.DynamicTable(f"ahead_a{next(_names)}", DIM, devices=[None])
        b = E.DynamicTable(f"ahead_b{next(_names)}", DIM, devices=[None])
        with pytest.raises(ValueError, match="at least one DynamicTable"):
            tfpsx.GeoReadAhead([])
        with pytest.raises(ValueError, match="must be DynamicTables, got .*'emb'"):
            tfpsx.GeoReadAhead([a, "emb"])
        with pytest.raises(ValueError, match=r"named twice"):
            tfpsx.GeoReadAhead([a, a])
        reader = tfpsx.GeoReadAhead([a])
        with pytest.raises(ValueError, match=r"has one already \(of tables \['ahead_a"):
            tfpsx.GeoReadAhead([b])
        with pytest.raises(ValueError, match=r"map each of the tables \['ahead_a.*got \['ahead_b"):
            reader.record({b: [1, 2]})
        with pytest.raises(ValueError, match=r"map each of the tables .*got list"):
            reader.record([1, 2])
        with pytest.raises(ValueError, match=r"must be integers, got dtype float64"):
            reader.record({a: [1.5, 2.0]})
        assert reader.recorded == 0  # nothing recorded by a call that failed
        # the mode's tables: b is GEO's and not recorded, a is recorded and not GEO's
        with pytest.raises(ValueError, match=r"tables \['ahead_a\d+'\] are not GEO tables.*"
                                             r"GEO tables \['ahead_b\d+'\] are not recorded"):
            reader.bind([GeoTable(b, None, None, None, 0)], k_steps=5)
    with tf.Graph().as_default():  # another graph, another reader
        tfpsx.GeoReadAhead([E.DynamicTable(f"ahead_d{next(_names)}", DIM, devices=[None])])

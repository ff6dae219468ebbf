"""tfpsx.keras.layers.DynamicEmbedding in one process, without a cluster (a local table)."""

import numpy as np
import pytest
import tensorflow as tf
import keras

import tfpsx.keras
from tfpsx import embedding as E

_names = iter(range(10 ** 6))


def layer(dim=4, **kw):
    kw.setdefault("initializer", E.normal(stddev=0.1))
    kw.setdefault("optimizer", E.SGD(0.5))
    return tfpsx.keras.DynamicEmbedding(dim, table_name=f"kl{next(_names)}", **kw)


def test_dense_ids_no_combiner_keep_their_shape_and_are_deterministic():
    emb = layer(seed=3)
    ids = tf.constant([[5, -3, 5], [7, 7, 2 ** 40]], tf.int64)
    out = emb(ids)
    assert out.shape == (2, 3, 4)
    np.testing.assert_array_equal(out[0, 0], out[0, 2])
    twin = tfpsx.keras.DynamicEmbedding(4, table_name=f"kl{next(_names)}", seed=3,
                                        initializer=E.normal(stddev=0.1))
    np.testing.assert_array_equal(twin(ids), out)  # same seed and id: the same row


def test_string_ids_hash_stably():
    emb = layer()
    words = tf.constant([["apple"], ["pear"], ["apple"]])
    out = emb(words)
    assert out.shape == (3, 1, 4)
    np.testing.assert_array_equal(out[0], out[2])
    assert not np.array_equal(out[0], out[1])
    # The documented hash: FarmHash64 of the bytes mod 2^63 - 1.
    key = tf.strings.to_hash_bucket_fast(["apple"], 2 ** 63 - 1)
    np.testing.assert_array_equal(emb.table.lookup(key)[0], out[0, 0])


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_combiners_over_ragged_sparse_and_padded_ids(combiner):
    emb = layer(combiner=combiner, pad_id=-1)
    padded = tf.constant([[1, 2, -1], [3, -1, -1], [-1, -1, -1]], tf.int64)
    emb.build(padded.shape)
    rows = emb.table.lookup(tf.constant([1, 2, 3], tf.int64)).numpy()
    scale = {"sum": lambda n: 1.0, "mean": lambda n: 1.0 / n, "sqrtn": lambda n: n ** -0.5}[combiner]
    want = np.stack([(rows[0] + rows[1]) * scale(2), rows[2] * scale(1), np.zeros(4)])
    np.testing.assert_allclose(emb(padded), want, rtol=1e-6, atol=1e-7)
    ragged = tf.ragged.constant([[1, 2], [3], []], dtype=tf.int64)
    np.testing.assert_allclose(emb(ragged), want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(emb(ragged.to_sparse()), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("keras_optimizer", ["sgd", "adam"])
def test_fit_trains_the_table_through_the_backward_pass(keras_optimizer):
    # With Adam a constant zero gradient for the trigger once let the compiler drop the
    # table's apply: the table must learn whatever trains the Keras weights.
    emb = layer(dim=1, initializer=E.zeros(), optimizer=E.SGD(0.5))
    ids = keras.Input((1,), dtype="int64")
    model = keras.Model(ids, keras.layers.Flatten()(emb(ids)))
    model.compile(keras_optimizer, "mse")
    x = np.array([[1], [2], [1], [2]], np.int64)
    y = np.array([[1.0], [-1.0], [1.0], [-1.0]], np.float32)
    before = model.evaluate(x, y, verbose=0)
    model.fit(x, y, batch_size=4, epochs=30, verbose=0)
    assert model.evaluate(x, y, verbose=0) < 0.01 < before
    np.testing.assert_allclose(emb.table.lookup(tf.constant([1, 2], tf.int64))[:, 0],
                               [1.0, -1.0], atol=0.05)
    # The trigger weight carries no value: only the table learned.
    assert float(emb._trigger.numpy()) == 0.0


def test_a_table_inside_another_layer_trains_from_an_added_loss():
    """The visit counter's shape (tests/cluster/scripts/visits_job.py): a layer that calls
    a DynamicEmbedding in its own call, its loss from add_loss, moves each row by exactly
    +1 a visit (SGD at rate 1 on minus the rows). On TF 2.16 no row moved in Keras's
    fit: the apply's only link to the step, a control dependency into a foldable zero,
    was lost (the stateful op it waits on now keeps it)."""

    class Counter(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.visits = layer(dim=1, initializer=E.zeros(), optimizer=E.SGD(1.0))

        def call(self, inputs):
            out, ids = inputs
            rows = tf.reduce_sum(self.visits(ids))
            self.add_loss(tf.stop_gradient(rows) - rows)
            return out

    x, ids = keras.Input((2,)), keras.Input((), dtype="int64")
    counter = Counter()
    model = keras.Model({"x": x, "id": ids}, counter([keras.layers.Dense(1)(x), ids]))
    model.compile(keras.optimizers.SGD(0.1), "mse")
    data = tf.data.Dataset.from_tensor_slices(
        ({"x": np.ones((8, 2), np.float32), "id": np.arange(8)},
         np.ones((8, 1), np.float32))).batch(4)
    model.fit(data, epochs=2, verbose=0)
    rows = counter.visits.table.export()
    assert sorted(rows["keys"].numpy().tolist()) == list(range(8))
    assert rows["values"].numpy()[:, 0].tolist() == [2.0] * 8  # 2 epochs: 2 visits each


def test_a_subclassed_model_without_a_training_argument_trains_its_table(caplog):
    """Keras's train_step calls a subclassed model's call(inputs) without a training flag
    when its signature has none: the layer inside still trains its table under fit (the
    gradient tape says the call trains), while evaluate and predict insert nothing."""
    emb = layer(dim=1, initializer=E.zeros(), optimizer=E.SGD(0.5))

    class Model(keras.Model):
        def __init__(self):
            super().__init__()
            self.emb = emb

        def call(self, inputs):  # no training argument
            return keras.ops.reshape(self.emb(inputs), (-1, 1))

    model = Model()
    model.compile("sgd", "mse")
    x = np.array([[1], [2], [1], [2]], np.int64)
    y = np.array([[1.0], [-1.0], [1.0], [-1.0]], np.float32)
    with caplog.at_level("WARNING"):
        model.fit(x, y, batch_size=4, epochs=30, verbose=0)
    assert "Gradients do not exist" not in caplog.text, caplog.text
    assert int(emb.table.size()) == 2
    np.testing.assert_allclose(emb.table.lookup(tf.constant([1, 2], tf.int64))[:, 0],
                               [1.0, -1.0], atol=0.05)
    unseen = np.array([[7], [8]], np.int64)
    model.evaluate(unseen, y[:2], verbose=0)
    model.predict(unseen, verbose=0)
    assert int(emb.table.size()) == 2  # reads of new ids insert nothing


def test_save_and_load_model_round_trip(tmp_path):
    emb = layer(dim=2, combiner="mean", pad_id=-1, optimizer=E.Adagrad(0.3))
    ids = keras.Input((3,), dtype="int64")
    model = keras.Model(ids, keras.layers.Dense(1)(emb(ids)))
    model.compile("adam", "mse")
    x = np.random.default_rng(0).integers(-1, 20, size=(64, 3))
    y = np.random.default_rng(1).normal(size=(64, 1)).astype(np.float32)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    want, size = model.predict(x, verbose=0), int(emb.table.size())
    # The loaded model must read its rows from the file: in this process the same table
    # name is the same resource, so the original goes first.
    for shard in emb.table.shards:
        tf.raw_ops.DestroyResourceOp(resource=shard.handle(), ignore_lookup_error=False)
    loaded = keras.models.load_model(path)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), want, rtol=1e-6, atol=1e-6)
    twin = loaded.layers[1]
    assert isinstance(twin, tfpsx.keras.DynamicEmbedding)
    assert twin.get_config()["optimizer"] == {"name": "adagrad", "learning_rate": 0.3,
                                              "epsilon": 0.0, "initial_accumulator_value": 0.1}
    assert int(twin.table.size()) == size > 0


def test_checkpoint_tracks_the_table(tmp_path):
    emb = layer(dim=2)
    emb(tf.constant([[1, 2]], tf.int64))
    emb.table.insert([1, 2], [[1.0, 1.0], [2.0, 2.0]])
    ckpt = tf.train.Checkpoint(layer=emb)
    path = ckpt.save(str(tmp_path / "c"))
    emb.table.insert([1], [[9.0, 9.0]])
    ckpt.restore(path)
    np.testing.assert_array_equal(emb.table.lookup(tf.constant([1], tf.int64)), [[1.0, 1.0]])


def test_bad_inputs_are_clear():
    with pytest.raises(TypeError, match="integer or string ids, got float32"):
        layer()(tf.constant([[1.5]]))
    with pytest.raises(ValueError, match="combiner must be None or one of sum, mean, sqrtn, "
                                         "got 'max'"):
        layer(combiner="max")
    with pytest.raises(ValueError, match="ragged or sparse ids need a combiner"):
        layer()(tf.ragged.constant([[1, 2], [3]], dtype=tf.int64))
    with pytest.raises(ValueError, match="pad_id=0 needs a combiner"):
        layer(pad_id=0)
    with pytest.raises(ValueError, match="dim must be a positive int, got 0"):
        tfpsx.keras.DynamicEmbedding(0)


def test_incremental_checkpoint_callback_saves_deltas_and_restores_bit_exact(tmp_path):
    name = f"kinc{next(_names)}"

    def build(dim=2, table=name):
        emb = tfpsx.keras.DynamicEmbedding(dim, table_name=table, combiner="mean", pad_id=-1,
                                           initializer=E.normal(stddev=0.1),
                                           optimizer=E.Adagrad(0.3))
        ids = keras.Input((3,), dtype="int64")
        model = keras.Model(ids, keras.layers.Dense(1)(emb(ids)))
        model.compile("adam", "mse")
        return model, emb

    def rows(emb):
        got = {k: v.numpy() for k, v in emb.table.export().items()}
        order = np.argsort(got["keys"])
        return {k: v[order].tobytes() for k, v in got.items()}

    rng = np.random.default_rng(0)
    x = rng.integers(-1, 200, size=(256, 3))
    y = rng.normal(size=(256, 1)).astype(np.float32)
    model, emb = build()
    cb = tfpsx.keras.IncrementalCheckpoint(tmp_path / "ck", full_every=2)
    saves = []
    record = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda *_: saves.append(dict(cb.last_save)))
    model.fit(x, y, batch_size=32, epochs=4, verbose=0, callbacks=[cb, record])
    assert [s["kind"] for s in saves] == ["full", "delta", "full", "delta"], saves
    assert 0 < saves[1]["rows"] <= saves[0]["rows"]
    want_rows, want_pred = rows(emb), model.predict(x, verbose=0)
    # Training goes on past the checkpoint (new ids too), then the process is lost.
    model.fit(x + 300, y, batch_size=32, epochs=1, verbose=0)
    assert rows(emb) != want_rows
    # Another model of the same layers (the same local table) restores the last save.
    again, emb2 = build()
    step = tfpsx.keras.IncrementalCheckpoint(tmp_path / "ck").restore(again)
    assert step == 4 * 8
    assert rows(emb2) == want_rows
    np.testing.assert_array_equal(again.predict(x, verbose=0), want_pred)
    # A checkpoint of another model is refused before anything changes.
    other, emb3 = build(dim=3, table=f"kinc{next(_names)}")
    before = rows(emb3)
    with pytest.raises(ValueError, match=r"has no table\(s\) \['kinc"):
        tfpsx.keras.IncrementalCheckpoint(tmp_path / "ck").restore(other)
    assert rows(emb3) == before

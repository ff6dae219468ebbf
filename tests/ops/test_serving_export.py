"""tfpsx.export_serving: trained models as SavedModels that run without tfpsx.

Each export is loaded in a fresh process that never imports tfpsx (tests/serving_check.py,
with TF2's loader and the TF1 loader TF Serving mirrors) and must predict what the trained
model predicts, for ids seen in training and ids never seen.
"""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpsx
import tfpsx.keras
from tfpsx import embedding as E
from tfpsx.serving import initializers, tfpsx_ops
from tfpsx.serving.table import from_trained

CHECK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                     "serving_check.py")
_names = iter(range(10 ** 6))


def name(prefix="sv"):
    return f"{prefix}{next(_names)}"


def served(path, inputs, tmp_path):
    """The outputs of ``serving_default`` in a fresh process without tfpsx, by both loaders:
    {"tf2": {output name: array}, "tf1": {...}} (a TF1 session's graph optimizations may
    round a value differently from TF2's function runtime: a last-bit difference)."""
    feed, got = str(tmp_path / "feed.npz"), str(tmp_path / "got.npz")
    np.savez(feed, **{k: np.asarray(v) for k, v in inputs.items()})
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, CHECK, path, feed, got], capture_output=True,
                          text=True, timeout=180, env=dict(env, TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0 and "SERVED" in proc.stdout, proc.stdout + proc.stderr[-4000:]
    out = dict(np.load(got))
    return {loader: {k[4:]: v for k, v in out.items() if k.startswith(loader + "/")}
            for loader in ("tf2", "tf1")}


def assert_served(got, name, want, atol=1e-6):
    """Both loaders' output ``name`` is ``want`` to ``atol``."""
    for loader, outputs in got.items():
        assert list(outputs) == [name], (loader, list(outputs))
        np.testing.assert_allclose(outputs[name], want, rtol=0, atol=atol, err_msg=loader)


# ----------------------------------------------------------------------------- initializer
KEYS = np.concatenate([np.random.default_rng(0).integers(-2 ** 63, 2 ** 63 - 1, 50_000),
                       np.arange(-500, 500), [-2 ** 63, 2 ** 63 - 1]]).astype(np.int64)


@pytest.mark.parametrize("init,dim,seed", [
    (E.zeros(), 3, 0), (E.constant(0.37), 5, 1), (E.uniform(-0.3, 0.7), 7, 1234567),
    (E.uniform(-1e-3, 2.5), 4, -42)])
def test_initial_rows_in_stock_ops_are_the_tables_bit_for_bit(init, dim, seed):
    table = E.DynamicTable(name(), dim, initializer=init, seed=seed)
    want = table.lookup(tf.constant(KEYS)).numpy()  # a table holding nothing: initial rows
    got = initializers.initial_rows(tf.constant(KEYS), init.kind, init.a, init.b, seed,
                                    dim).numpy()
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("init,dim,seed", [(E.normal(0.1, 0.05), 16, 1234567),
                                           (E.normal(-1.0, 3.0), 5, -7), (E.normal(), 1, 0)])
def test_normal_initial_rows_match_to_one_rounding_of_the_c_library(init, dim, seed):
    """logf / cosf / sinf of the C library are not correctly rounded; the stock-op rows use
    correctly rounded ones (see tfpsx/serving/initializers.py): a few values differ by
    a rounding step or two, bounded by ~2.4e-7 x (|mean| + 6 x stddev)."""
    table = E.DynamicTable(name(), dim, initializer=init, seed=seed)
    want = table.lookup(tf.constant(KEYS)).numpy()
    got = initializers.initial_rows(tf.constant(KEYS), init.kind, init.a, init.b, seed,
                                    dim).numpy()
    assert np.abs(got - want).max() <= 2.4e-7 * (abs(init.a) + 6 * init.b)
    assert np.mean(got != want) < 0.02
    assert abs(np.mean(want) - init.a) < 0.05 * init.b + 1e-3  # a sane draw, not zeros


# ----------------------------------------------------------------------------- tables
def test_a_served_table_holds_the_rows_of_every_shard_and_initial_rows_else(tmp_path):
    table = E.DynamicTable(name(), 3, initializer=E.uniform(-1, 1), seed=5,
                               devices=[None, None, None])
    keys = np.arange(-40, 40, dtype=np.int64)
    table.insert(keys, np.arange(240, dtype=np.float32).reshape(80, 3))
    serving = from_trained(table)
    assert [s.size for s in serving.shards] == [27, 26, 27]  # key mod 3
    # Ids DenseHashTable reserves (the smallest int64 values) are served too.
    query = tf.constant(np.concatenate([keys, [999, -2 ** 63, -2 ** 63 + 1, -2 ** 63 + 2]]))
    np.testing.assert_array_equal(serving.lookup(query), table.lookup(query))
    np.testing.assert_array_equal(serving.lookup(tf.reshape(query, [2, -1])),
                                  table.lookup(tf.reshape(query, [2, -1])))


# ----------------------------------------------------------------------------- Keras
def ctr_model(init_ids=E.normal(0.0, 0.3), init_words=E.uniform(-0.2, 0.2)):
    ids = keras.Input((3,), dtype="int64", name="ids")
    words = keras.Input((2,), dtype="string", name="words")
    dense = keras.Input((4,), name="features")
    e_ids = tfpsx.keras.DynamicEmbedding(4, table_name=name(), combiner="mean", pad_id=-1,
                                         initializer=init_ids, seed=7,
                                         optimizer=E.Adagrad(0.3))(ids)
    e_sum = tfpsx.keras.DynamicEmbedding(2, table_name=name(), combiner="sqrtn", pad_id=-1,
                                         optimizer=E.SGD(0.1))(ids)
    e_words = tfpsx.keras.DynamicEmbedding(3, table_name=name(), initializer=init_words,
                                           optimizer=E.Adam(0.01))(words)
    x = keras.layers.Concatenate()([e_ids, e_sum, keras.layers.Flatten()(e_words), dense])
    hidden = keras.layers.Dense(8, activation="relu")(x)
    hidden = keras.layers.BatchNormalization()(hidden)
    model = keras.Model({"ids": ids, "words": words, "features": dense},
                        keras.layers.Dense(1, activation="sigmoid", name="score")(hidden))
    model.compile("adam", "binary_crossentropy")
    return model


def ctr_data(seed, n, vocab=50, unseen=False):
    rng = np.random.default_rng(seed)
    lo = 1000 if unseen else -1
    ids = rng.integers(lo, lo + vocab, (n, 3))
    words = rng.choice(["zz", "yy", "xx"] if unseen else ["a", "b", "c", "d"], (n, 2))
    return {"ids": ids.astype(np.int64), "words": words.astype(bytes),
            "features": rng.normal(size=(n, 4)).astype(np.float32)}


def as_tensors(x):
    return {k: tf.constant(v) for k, v in x.items()}


@pytest.mark.heavy
def test_a_trained_keras_model_serves_without_tfpsx(tmp_path):
    model = ctr_model()
    x = ctr_data(0, 512)
    y = (x["features"][:, :1] > 0).astype(np.float32)
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(64), epochs=2, verbose=0)
    seen, unseen = ctr_data(1, 40), ctr_data(2, 40, unseen=True)
    query = {k: np.concatenate([seen[k], unseen[k]]) for k in seen}
    query["ids"][::7] = -1  # padding everywhere in a row: that row's combiners give zeros
    query["ids"][5] = [-1, -1, -1]
    want = model.predict(as_tensors(query), verbose=0)

    base = tmp_path / "models" / "ctr"
    path = tfpsx.export_serving(model, base)
    assert path == str(base / "1") and os.path.isfile(os.path.join(path, "saved_model.pb"))
    assert tfpsx_ops(path) == {}
    assert os.listdir(base) == ["1"]  # no temporary folder left
    assert_served(served(path, query, tmp_path), "score", want)
    # The next export is the next version.
    assert tfpsx.export_serving(model, base) == str(base / "2")


@pytest.mark.heavy
def test_the_rows_are_in_the_checkpoint_not_in_the_graph(tmp_path):
    emb = tfpsx.keras.DynamicEmbedding(32, table_name=name(), optimizer=None)
    ids = keras.Input((1,), dtype="int64", name="ids")
    model = keras.Model(ids, keras.layers.Flatten(name="emb")(emb(ids)))
    keys = np.arange(20_000, dtype=np.int64)
    emb.table.insert(keys, np.random.default_rng(0).normal(size=(20_000, 32)))
    path = tfpsx.export_serving(model, tmp_path / "m")
    rows_bytes = 20_000 * 32 * 4
    assert os.path.getsize(os.path.join(path, "saved_model.pb")) < rows_bytes / 20
    data = sum(os.path.getsize(os.path.join(path, "variables", f))
               for f in os.listdir(os.path.join(path, "variables")))
    assert data > rows_bytes
    query = {"ids": np.array([[0], [19_999], [123], [-5], [10 ** 12]], np.int64)}
    want = model.predict(query["ids"], verbose=0)
    for outputs in served(path, query, tmp_path).values():
        np.testing.assert_array_equal(outputs["emb"][:3], want[:3])  # stored rows: copied
        np.testing.assert_allclose(outputs["emb"][3:], want[3:], rtol=0, atol=1e-7)  # initial


class TwoTower(keras.Model):
    """A subclassed model: ragged user history, sparse item ids."""

    def __init__(self, combiner):
        super().__init__()
        self.history = tfpsx.keras.DynamicEmbedding(4, table_name=name(), combiner=combiner,
                                                    optimizer=E.SGD(0.2))
        self.items = tfpsx.keras.DynamicEmbedding(4, table_name=name(), combiner="sum",
                                                  optimizer=E.SGD(0.2))

    def call(self, inputs):
        return tf.reduce_sum(self.history(inputs["history"]) * self.items(inputs["item"]),
                             axis=-1, keepdims=True)


@pytest.mark.heavy
@pytest.mark.parametrize("combiner", [pytest.param("sum", marks=pytest.mark.slow), "mean",
                                      pytest.param("sqrtn", marks=pytest.mark.slow)])
def test_a_subclassed_model_with_ragged_and_sparse_ids_serves(tmp_path, combiner):
    model = TwoTower(combiner)
    history = tf.ragged.constant([[1, 2, 3], [4], [], [2, 2]], dtype=tf.int64)
    item = tf.sparse.from_dense(tf.constant([[5, 0], [6, 7], [0, 0], [8, 0]], tf.int64))
    model({"history": history, "item": item})
    for layer in (model.history, model.items):  # some training
        layer.table.insert([1, 2, 5, 6], np.full((4, 4), 0.5, np.float32))
    want = model({"history": history, "item": item}).numpy()
    inputs = {"history": tf.RaggedTensorSpec([None, None], tf.int64, ragged_rank=1),
              "item": tf.SparseTensorSpec([None, 2], tf.int64)}
    path = tfpsx.export_serving(model, tmp_path / "tt", inputs=inputs)
    query = {"history_values": history.flat_values.numpy(),
             "history_row_lengths": history.row_lengths().numpy(),
             "item_indices": item.indices.numpy(), "item_values": item.values.numpy(),
             "item_dense_shape": item.dense_shape.numpy()}
    assert_served(served(path, query, tmp_path), "output_0", want)


@pytest.mark.heavy
def test_a_model_without_tables_exports_as_it_is(tmp_path):
    x = keras.Input((3,), name="x")
    model = keras.Model(x, keras.layers.Dense(2, name="out")(x))
    path = tfpsx.export_serving(model, tmp_path / "plain", version=7)
    assert path.endswith(os.path.join("plain", "7"))
    query = {"x": np.ones((2, 3), np.float32)}
    assert_served(served(path, query, tmp_path), "out", model.predict(query["x"], verbose=0))
    # From inside a TF1 job's graph context too: the export builds in a thread of its own.
    with tf.Graph().as_default():
        assert tfpsx.export_serving(model, tmp_path / "plain").endswith("8")


def test_bad_input_is_a_clear_error(tmp_path):
    x = keras.Input((3,), name="x")
    model = keras.Model(x, keras.layers.Dense(2)(x))
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(ValueError, match="is a file; the path must be a folder"):
        tfpsx.export_serving(model, a_file)
    for bad in (0, -1, "3", 2.0, True):
        with pytest.raises(ValueError, match="version must be a positive int"):
            tfpsx.export_serving(model, tmp_path / "m", version=bad)
    tfpsx.export_serving(model, tmp_path / "m", version=3)
    with pytest.raises(FileExistsError, match="exists already"):
        tfpsx.export_serving(model, tmp_path / "m", version=3)
    assert tfpsx.export_serving(model, tmp_path / "m").endswith("4")  # the next free one
    with pytest.raises(ValueError, match="is not built"):
        tfpsx.export_serving(keras.Sequential([keras.layers.Dense(1)]), tmp_path / "n")
    with pytest.raises(ValueError, match="pass inputs="):
        unbuilt_inputs = TwoTower("sum")
        unbuilt_inputs({"history": tf.ragged.constant([[1]], dtype=tf.int64),
                        "item": tf.sparse.from_dense(tf.constant([[1]], tf.int64))})
        tfpsx.export_serving(unbuilt_inputs, tmp_path / "n")
    with pytest.raises(TypeError, match="expected a Keras model or a tf.compat.v1.Session"):
        tfpsx.export_serving(object(), tmp_path / "n")


# ----------------------------------------------------------------------------- TF1 graphs
def graph_model():
    """A TF1 graph: a 2-shard table read by training lookups (find-or-insert), a 1-shard
    table read by find, resource and ref variables, a v2 cond (a function library)."""
    ids = tf.compat.v1.placeholder(tf.int64, [None, 3], name="ids")
    x = tf.compat.v1.placeholder(tf.float32, [None, 4], name="x")
    y = tf.compat.v1.placeholder(tf.float32, [None], name="y")
    emb = E.DynamicTable(name("g"), 4, initializer=E.normal(0, 0.3),
                             optimizer=E.Adagrad(0.3), devices=[None, None])
    looked = emb.lookup_unique(ids)
    bias = E.DynamicTable(name("g"), 1, initializer=E.uniform(-0.1, 0.1), devices=[None])
    w = tf.compat.v1.get_variable(name("w"), [16, 1],
                                  initializer=tf.compat.v1.glorot_uniform_initializer())
    v = tf.compat.v1.get_variable(name("v"), [1], initializer=tf.zeros_initializer(),
                                  use_resource=False)
    hidden = tf.concat([tf.reshape(looked.embeddings, [-1, 12]), x], 1)
    logit = tf.squeeze(tf.matmul(hidden, w), 1) + v + tf.reshape(bias.lookup(ids[:, :1]), [-1])
    logit = tf.cond(tf.reduce_sum(x) > 1e9, lambda: logit * 2.0, lambda: logit)
    pred = tf.sigmoid(logit, name="pred")
    loss = tf.reduce_mean(tf.square(pred - y))
    step = tf.compat.v1.train.get_or_create_global_step()
    train = tf.group(
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss, global_step=step),
        emb.minimize(loss, [looked], step=step))
    return ids, x, y, pred, train


@pytest.mark.heavy
def test_a_trained_tf1_graph_serves_without_tfpsx(tmp_path):
    rng = np.random.default_rng(0)
    with tf.Graph().as_default() as graph:
        ids, x, y, pred, train = graph_model()
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for _ in range(20):
                sess.run(train, {ids: rng.integers(0, 30, (32, 3)),
                                 x: rng.normal(size=(32, 4)), y: rng.random(32)})
            graph.finalize()  # as a MonitoredSession leaves it
            query = {"ids": np.concatenate([rng.integers(0, 30, (5, 3)),
                                            rng.integers(100, 200, (5, 3))]),
                     "x": rng.normal(size=(10, 4)).astype(np.float32)}
            want = sess.run(pred, {ids: query["ids"], x: query["x"]})
            path = tfpsx.export_serving(sess, tmp_path / "g", inputs={"ids": ids, "x": x},
                                        outputs={"pred": pred})
            assert graph.finalized
    assert tfpsx_ops(path) == {}
    assert_served(served(path, query, tmp_path), "pred", want)


@pytest.mark.heavy
def test_a_graph_with_a_sparse_placeholder_serves_its_components(tmp_path):
    with tf.Graph().as_default():
        ids = tf.compat.v1.sparse_placeholder(tf.int64, [None, 4], name="ids")
        emb = E.DynamicTable(name("g"), 3, initializer=E.uniform(-1, 1))
        rows = emb.lookup(ids.values)
        pooled = tf.math.unsorted_segment_sum(rows, ids.indices[:, 0], ids.dense_shape[0])
        with tf.compat.v1.Session() as sess:
            sess.run(emb.insert([1, 2], [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]))
            feed = tf.compat.v1.SparseTensorValue([[0, 0], [0, 3], [2, 1]], [1, 2, 77], [3, 4])
            want = sess.run(pooled, {ids: feed})
            path = tfpsx.export_serving(sess, tmp_path / "sp", inputs={"ids": ids},
                                        outputs={"pooled": pooled})
    query = {"ids_indices": np.array(feed.indices, np.int64),
             "ids_values": np.array(feed.values, np.int64),
             "ids_dense_shape": np.array(feed.dense_shape, np.int64)}
    assert_served(served(path, query, tmp_path), "pooled", want)
    np.testing.assert_array_equal(want[1], [0, 0, 0])


def test_a_graph_export_names_what_it_cannot_serve(tmp_path):
    with tf.Graph().as_default():
        ids, x, y, pred, train = graph_model()
        loss = tf.reduce_mean(tf.square(pred - y))
        update = tf.compat.v1.assign_add(
            tf.compat.v1.get_variable(name("c"), [], use_resource=False), 1.0)
        inputs = {"ids": ids, "x": x}
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            with pytest.raises(ValueError, match="depend on placeholder 'y', which is not in "
                                                 "inputs="):
                tfpsx.export_serving(sess, tmp_path / "g", inputs=inputs, outputs={"l": loss})
            with pytest.raises(ValueError, match="depend on AssignAdd op"):
                tfpsx.export_serving(sess, tmp_path / "g", inputs=inputs,
                                     outputs={"u": update})
            with pytest.raises(ValueError, match="needs inputs=.* and outputs="):
                tfpsx.export_serving(sess, tmp_path / "g", outputs={"pred": pred})
            with pytest.raises(ValueError, match="expected a tensor of the session's graph"):
                tfpsx.export_serving(sess, tmp_path / "g", inputs=inputs,
                                     outputs={"pred": np.ones(1)})
        with pytest.raises(ValueError, match="monitored session is closed"):
            done = tf.compat.v1.train.MonitoredSession()
            done.close()
            tfpsx.export_serving(done, tmp_path / "g", inputs=inputs, outputs={"p": pred})
    assert not os.path.exists(tmp_path / "g")  # nothing written by a failed export

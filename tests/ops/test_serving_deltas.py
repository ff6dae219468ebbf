"""A served model that follows training by deltas (tfpsx.serving.publish, delta and
follower.py): a Keras model trained with ``IncrementalCheckpoint(publisher=Publisher(...))``
publishes a base and deltas; a fresh process that never imports tfpsx
(tests/serving_follow_check.py) follows them with stock TF and must predict exactly
what a full export taken at the same step predicts.
"""

import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpsx
import tfpsx.keras
from tfpsx import embedding as E
from tfpsx.keras.checkpoint import IncrementalCheckpoint
from tfpsx.serving import Publisher, publish
from serving_follow_check import follow

_names = iter(range(10 ** 6))


def name(prefix="dl"):
    return f"{prefix}{next(_names)}"


def model_and_tables():
    ids = keras.Input((3,), dtype="int64", name="ids")
    words = keras.Input((2,), dtype="string", name="words")
    dense = keras.Input((4,), name="features")
    e_ids = tfpsx.keras.DynamicEmbedding(4, table_name=name(), combiner="mean", pad_id=-1,
                                         initializer=E.uniform(-0.3, 0.3), seed=7,
                                         optimizer=E.Adagrad(0.3))
    e_words = tfpsx.keras.DynamicEmbedding(3, table_name=name(), optimizer=E.SGD(0.1))
    x = keras.layers.Concatenate()([e_ids(ids), keras.layers.Flatten()(e_words(words)), dense])
    hidden = keras.layers.BatchNormalization()(keras.layers.Dense(8, activation="relu")(x))
    model = keras.Model({"ids": ids, "words": words, "features": dense},
                        keras.layers.Dense(1, activation="sigmoid", name="score")(hidden))
    model.compile("adam", "binary_crossentropy")
    return model, e_ids, e_words


def data(seed, n, lo=-1, vocab=60):
    rng = np.random.default_rng(seed)
    x = {"ids": rng.integers(lo, lo + vocab, (n, 3)).astype(np.int64),
         "words": rng.choice(["a", "b", "c", "d", "e"], (n, 2)).astype(bytes),
         "features": rng.normal(size=(n, 4)).astype(np.float32)}
    return x, (x["features"][:, :1] > 0).astype(np.float32)


def fit(model, callback, seed, n=256, lo=-1):
    x, y = data(seed, n, lo)
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(32), epochs=1, verbose=0,
              callbacks=[callback])


@pytest.mark.heavy
@pytest.mark.budget(60, why="three fits through a dozen saves, then three processes that "
                    "import TensorFlow (the check, a follower SIGKILLed, one started again)")
def test_a_base_and_its_deltas_serve_what_a_full_export_at_the_same_step_serves(tmp_path):
    model, e_ids, _ = model_and_tables()
    served = tmp_path / "served"
    ckpt = IncrementalCheckpoint(str(tmp_path / "ckpt"), full_every=100, save_freq=3,
                                 publisher=Publisher(str(served)))
    fit(model, ckpt, 0)  # 8 batches: saves after 3 and 6, and at the end
    assert publish.published(str(served))["bases"] == [1]
    assert publish.published(str(served))["deltas"] == [2, 3]
    # Rows that a later delta removes (as an eviction would): written, published, removed.
    extra = np.arange(10_000, 10_040, dtype=np.int64)
    e_ids.table.insert(extra, np.full((40, 4), 0.5, np.float32))
    fit(model, ckpt, 1)
    e_ids.table.remove(extra[:30])
    # Evicted too (the least frequent rows: the 10 extras no step looked up).
    assert int(e_ids.table.evict(keep_top_n=int(e_ids.table.size()) - 10)) == 10
    fit(model, ckpt, 2, lo=500)  # new ids too: rows inserted since the base
    last = ckpt.last_publish["sequence"]
    got = publish.published(str(served))
    assert got["bases"] == [1] and got["deltas"] == list(range(2, last + 1)) and \
        not got["partial"]
    manifests = [json.load(open(served / "deltas" / str(s) / publish.MANIFEST))
                 for s in got["deltas"]]
    assert sum(m["removed"] for m in manifests) == 40
    assert [m["base"] for m in manifests] == [1] * len(manifests)
    assert manifests[-1]["global_step"] == int(model.optimizer.iterations.numpy())

    full = tfpsx.export_serving(model, tmp_path / "full")
    query, _ = data(9, 64, lo=-1, vocab=700)
    query["ids"][:8, 0] = extra[24:32]  # removed and evicted ones: initial rows
    out = follow(served, full, query, tmp_path)
    assert out["unregistered_ops"] == [] and out["tfpsx_ops"] == []
    assert (out["base"], out["base_sequence"], out["applied"], out["sequence"]) == (
        1, 1, last - 1, last)
    assert out["base_diff"] > 0  # the base alone is behind the trained model
    assert out["diff"] == 0.0  # base + every delta: exactly the full export
    assert out["duplicate"] == "refused"
    assert (out["duplicate_sequence"], out["duplicate_diff"]) == (last, 0.0)
    assert out["tf1_applied"] == list(range(2, last + 1)) and out["tf1_diff"] == 0.0
    assert (out["restarted_sequence"], out["restarted_diff"]) == (last, 0.0)
    assert out["tfpsx_imported"] is False

    # follower.py as a server runs it: SIGKILLed once it applied a delta, started again,
    # it reloads the base and replays every delta (--once: then says where it is).
    import signal
    import subprocess
    import sys
    import time

    from serving_follow_check import FOLLOWER

    env = dict({k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
               TF_CPP_MIN_LOG_LEVEL="2")
    log = tmp_path / "follower.log"
    with open(log, "w") as out_file:
        proc = subprocess.Popen([sys.executable, FOLLOWER, "--model_dir", str(served),
                                 "--poll_seconds", "0.2"], stdout=out_file,
                                stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        while "applied delta 2" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    again = subprocess.run([sys.executable, FOLLOWER, "--model_dir", str(served), "--once"],
                           capture_output=True, text=True, timeout=120, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout.strip().splitlines()[-1]) == {"base": 1,
                                                                "applied_sequence": last}


@pytest.mark.heavy
@pytest.mark.budget(45, why="three fits of which three saves export a base each, then a "
                    "follower process that imports TensorFlow and loads two models")
def test_a_new_base_every_full_save_and_a_restarted_publisher_continues_the_sequence(
        tmp_path):
    model, _, _ = model_and_tables()
    served = tmp_path / "served"
    ckpt = IncrementalCheckpoint(str(tmp_path / "ckpt"), full_every=2, save_freq=4,
                                 publisher=Publisher(str(served)))
    fit(model, ckpt, 0)  # saves after 4 and 8 batches: a base, a delta
    assert publish.published(str(served)) == {"bases": [1], "deltas": [2], "partial": []}
    fit(model, ckpt, 1)  # a full save (base 3), a delta (4)
    assert publish.published(str(served)) == {"bases": [1, 3], "deltas": [2, 4],
                                              "partial": []}
    # A chief killed while writing delta 5: its folder without DONE.
    partial = served / "deltas" / "5"
    partial.mkdir()
    (partial / publish.MANIFEST).write_text("{}")
    # The chief started again: a new callback (its first save is full: a base), which
    # removes the partial delta and takes its sequence; the oldest base (keep_bases=2)
    # goes with its deltas.
    again = IncrementalCheckpoint(str(tmp_path / "ckpt"), full_every=2, save_freq=4,
                                  publisher=Publisher(str(served)))
    fit(model, again, 2)
    assert publish.published(str(served)) == {"bases": [3, 5], "deltas": [4, 6],
                                              "partial": []}
    full = tfpsx.export_serving(model, tmp_path / "full")
    query, _ = data(9, 32)
    out = follow(served, full, query, tmp_path)
    assert (out["base"], out["base_sequence"], out["sequence"], out["diff"]) == (5, 5, 6, 0.0)


@pytest.mark.heavy
def test_a_publish_that_fails_makes_the_next_publish_a_base(tmp_path, caplog):
    model, _, _ = model_and_tables()
    served = tmp_path / "served"
    ckpt = IncrementalCheckpoint(str(tmp_path / "ckpt"), full_every=100, save_freq=4,
                                 publisher=Publisher(str(served)))
    fit(model, ckpt, 0)
    assert publish.published(str(served))["deltas"] == [2]
    # The next delta cannot be written: a file where its folder goes.
    os.rename(served / "deltas", served / "deltas.away")
    (served / "deltas").write_text("")
    try:
        with caplog.at_level("ERROR", logger="tfpsx"):
            fit(model, ckpt, 1, n=128)  # one save: its publish fails, training goes on
        assert "publish to" in caplog.text and "next save is full" in caplog.text
    finally:
        os.remove(served / "deltas")
        os.rename(served / "deltas.away", served / "deltas")
    fit(model, ckpt, 2, n=128)
    assert ckpt.last_publish["kind"] == "base" and ckpt.last_publish["sequence"] == 3
    assert publish.published(str(served))["bases"] == [1, 3]


def test_a_delta_out_of_order_or_with_a_reserved_key_changes_nothing(tmp_path):
    model, e_ids, _ = model_and_tables()
    model.predict({k: tf.constant(v) for k, v in data(0, 8)[0].items()}, verbose=0)
    e_ids.table.insert(np.arange(5, dtype=np.int64), np.ones((5, 4), np.float32))
    path = tfpsx.export_serving(model, tmp_path / "m")
    loaded = tf.saved_model.load(path)
    apply = loaded.signatures["apply_delta"]
    specs = apply.structured_input_signature[1]
    feed = {k: tf.zeros([0 if d is None else d for d in s.shape], s.dtype)
            for k, s in specs.items()}
    keys = f"table_{e_ids.table.name}_keys"
    assert keys in specs, sorted(specs)
    rows = keys[:-len("keys")] + "rows"
    query = {"ids": tf.constant([[0, 1, 2]], tf.int64),
             "words": tf.constant([[b"a", b"b"]]),
             "features": tf.zeros([1, 4])}
    before = loaded.signatures["serving_default"](**query)["score"].numpy()
    for sequence, key in ((2, 0), (1, -2 ** 63)):  # out of order; the empty key
        bad = dict(feed, sequence=tf.constant(sequence, tf.int64),
                   **{keys: tf.constant([key], tf.int64), rows: tf.fill([1, 4], 9.0)})
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match="out of order" if sequence == 2 else "cannot hold key"):
            apply(**bad)
        assert int(loaded.signatures["applied_sequence"]()["applied_sequence"]) == 0
        np.testing.assert_array_equal(
            loaded.signatures["serving_default"](**query)["score"].numpy(), before)


def test_a_publisher_that_is_not_one_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="publisher=.*expected a tfpsx.serving.Publisher"):
        IncrementalCheckpoint(str(tmp_path / "ckpt"), publisher=str(tmp_path / "models"))
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        Publisher(str(tmp_path / "file"))
    with pytest.raises(ValueError, match="keep_bases"):
        Publisher(str(tmp_path / "m"), keep_bases=0)


def test_saves_by_time_publish_as_training_goes(tmp_path):
    """save_seconds: a save (and a publish) at the first batch end that long after the
    last: an online job's freshness, whatever its batches' pace."""
    import time as _time

    model, _, _ = model_and_tables()
    served = tmp_path / "served"
    ckpt = IncrementalCheckpoint(str(tmp_path / "ckpt"), full_every=100, save_seconds=0.3,
                                 publisher=Publisher(str(served)))
    x, y = data(0, 640)
    slow = keras.callbacks.LambdaCallback(on_train_batch_end=lambda *_, **__: _time.sleep(0.1))
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(32), epochs=1, verbose=0,
              callbacks=[slow, ckpt])  # 20 batches, 2 s or more
    got = publish.published(str(served))
    # every 3-4 batches, and the end's: 5 or more publishes, far fewer than 20
    assert got["bases"] == [1] and 4 <= len(got["deltas"]) <= 10, got
    with pytest.raises(ValueError, match="save_seconds"):
        IncrementalCheckpoint(str(tmp_path / "c2"), save_seconds=0)


@pytest.mark.heavy
@pytest.mark.budget(40, why="a graph trained through four saves, a full export, then a "
                    "follower process that imports TensorFlow and loads two models")
def test_a_graph_jobs_saves_publish_a_base_and_deltas_that_serve_what_its_export_serves(
        tmp_path):
    """Graph mode: IncrementalSaver(publisher=Publisher(..., inputs=, outputs=)): a
    two-shard table and a one-shard one, a resource and a ref variable; the base and its
    deltas, followed without tfpsx, serve exactly a full export of the last step."""
    from test_serving_export import graph_model
    from tfpsx.checkpoint import IncrementalSaver

    rng = np.random.default_rng(0)
    served = tmp_path / "served"
    with tf.Graph().as_default() as graph:
        ids, x, y, pred, train = graph_model()
        publisher = Publisher(str(served), inputs={"ids": ids, "x": x},
                              outputs={"pred": pred})
        saver = IncrementalSaver(full_every=100, publisher=publisher)
        step = tf.compat.v1.train.get_global_step()
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for _ in range(4):
                for _ in range(5):
                    sess.run(train, {ids: rng.integers(0, 60, (32, 3)),
                                     x: rng.normal(size=(32, 4)), y: rng.random(32)})
                saver.save(sess, str(tmp_path / "ckpt" / "model"), global_step=step)
            graph.finalize()  # as a MonitoredSession leaves it
            full = tfpsx.export_serving(sess, tmp_path / "full", inputs={"ids": ids, "x": x},
                                        outputs={"pred": pred})
    assert publish.published(str(served)) == {"bases": [1], "deltas": [2, 3, 4],
                                              "partial": []}
    query = {"ids": np.concatenate([rng.integers(0, 60, (6, 3)),
                                    rng.integers(100, 200, (4, 3))]),
             "x": rng.normal(size=(10, 4)).astype(np.float32)}
    out = follow(served, full, query, tmp_path)
    assert (out["base"], out["sequence"], out["applied"]) == (1, 4, 3), out
    assert out["base_diff"] > 0 and out["diff"] == 0.0 and out["tf1_diff"] == 0.0, out
    assert out["unregistered_ops"] == [] and out["tfpsx_imported"] is False, out


@pytest.mark.heavy
@pytest.mark.budget(60, why="two chief processes (one killed mid-delta), each importing "
                    "TensorFlow, fitting and exporting, then a follower process")
def test_a_chief_killed_mid_delta_leaves_it_partial_and_its_restart_goes_on(tmp_path):
    """The chief process dies (exit 137) at its delta's DONE marker, after the delta's
    files were renamed into place: no follower applies it; started again, the chief
    restores its checkpoint, removes the partial delta and publishes a base under its
    sequence, then deltas; a follower serves exactly the restarted job's export."""
    import subprocess
    import sys

    job = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "serving_publish_job.py")
    ckpt, served, full = tmp_path / "ckpt", tmp_path / "served", tmp_path / "full"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    first = subprocess.run([sys.executable, job, str(ckpt), str(served), "0",
                            "--die_at_done"], capture_output=True, text=True, timeout=180,
                           env=env)
    assert first.returncode == 137, first.stdout + first.stderr[-3000:]
    assert publish.published(str(served)) == {"bases": [1], "deltas": [], "partial": [2]}
    assert (served / "deltas" / "2" / publish.MANIFEST).exists()  # complete but for DONE
    again = subprocess.run([sys.executable, job, str(ckpt), str(served), "1", "--export",
                            str(full)], capture_output=True, text=True, timeout=180, env=env)
    assert again.returncode == 0, again.stdout + again.stderr[-3000:]
    assert "removing the partial delta" in again.stderr, again.stderr[-3000:]
    assert publish.published(str(served)) == {"bases": [1, 2], "deltas": [3, 4],
                                              "partial": []}
    query, _ = data(9, 32)
    out = follow(served, full / "1", query, tmp_path)
    assert (out["base"], out["sequence"], out["diff"], out["tf1_diff"]) == (2, 4, 0.0, 0.0)

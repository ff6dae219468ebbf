"""Side-car evaluation: tfpsx.evaluate_checkpoints over the chief's checkpoints, both
layouts (tfpsx's checkpoint.json, TF's own), the chief's end-of-training mark in both
front-ends, and its bounds."""

import os
import threading
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpsx
from tfpsx.checkpoint import evaluation
from tfpsx.errors import ClusterTimeoutError
from tfpsx.training.hooks import TrainingDoneHook

pytestmark = pytest.mark.timeout(120)


def test_every_checkpoint_until_the_marked_last_one_tf_layout(tmp_path):
    """A chief (thread) saves TF checkpoints slowly; the evaluator sees each and returns
    after the marked last one, with TensorBoard scalars and metrics records."""
    v = tf.Variable(0.0)
    ckpt = tf.train.Checkpoint(v=v)
    manager = tf.train.CheckpointManager(ckpt, str(tmp_path / "ckpt"), max_to_keep=10)

    def chief():
        for step in (10, 20, 30):
            v.assign(float(step))
            manager.save(checkpoint_number=step)
            time.sleep(0.6)
        evaluation.mark_training_done(tmp_path / "ckpt", 30)

    def evaluate(path, step):
        loaded = tf.Variable(-1.0)
        tf.train.Checkpoint(v=loaded).restore(path).expect_partial()
        return {"value": float(loaded.numpy()), "twice": 2 * step}

    thread = threading.Thread(target=chief)
    thread.start()
    os.environ["TFPSX_METRICS_DIR"] = str(tmp_path / "metrics")
    try:
        records = tfpsx.evaluate_checkpoints(tmp_path / "ckpt", evaluate,
                                             summary_dir=str(tmp_path / "tb"),
                                             poll_seconds=0.05, timeout=30)
    finally:
        del os.environ["TFPSX_METRICS_DIR"]
        thread.join()
    assert [(r["step"], r["value"], r["twice"]) for r in records] == [
        (10, 10.0, 20), (20, 20.0, 40), (30, 30.0, 60)]
    sink = tfpsx.metrics.read(str(tmp_path / "metrics"), None, None, "evaluation")
    assert [r["step"] for r in sink] == [10, 20, 30]
    events = [e for f in os.listdir(tmp_path / "tb")
              for e in tf.compat.v1.train.summary_iterator(str(tmp_path / "tb" / f))]
    tags = {(val.tag, e.step) for e in events for val in e.summary.value}
    assert ("eval/value", 30) in tags and ("eval/twice", 10) in tags


def test_no_checkpoint_and_no_end_is_a_named_timeout(tmp_path):
    (tmp_path / "ckpt").mkdir()
    began = time.monotonic()
    with pytest.raises(ClusterTimeoutError, match=r"waited 1 s for a new checkpoint in .*ckpt"
                       r".*last evaluated: none.*TFPSX_EVAL_TIMEOUT"):
        tfpsx.evaluate_checkpoints(tmp_path / "ckpt", lambda p, s: {}, poll_seconds=0.05,
                                   timeout=1)
    assert time.monotonic() - began < 10


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(TypeError, match="evaluate must be callable"):
        tfpsx.evaluate_checkpoints(tmp_path, "auc", timeout=1)
    with pytest.raises(ValueError, match="either data .* or evaluate"):
        tfpsx.keras.evaluate_checkpoints(keras.Sequential(), tmp_path)
    evaluation.mark_training_done(tmp_path, 5)
    with pytest.raises(ValueError, match="ended .step 5. without a checkpoint"):
        tfpsx.evaluate_checkpoints(tmp_path, lambda p, s: {}, timeout=5)


def test_a_graph_mode_chief_marks_its_last_checkpoint(tmp_path):
    """TF's MonitoredTrainingSession ends its saver hook before TrainingDoneHook: the
    mark names the final checkpoint's step, which the evaluator then reads."""
    directory = str(tmp_path / "ckpt")
    evaluation.mark_training_done(directory, 999)  # a previous run's: a new session clears it
    with tf.Graph().as_default():
        step = tf.compat.v1.train.get_or_create_global_step()
        w = tf.compat.v1.get_variable("w", [], initializer=tf.zeros_initializer())
        train = tf.group(step.assign_add(1), w.assign_add(0.5))
        hooks = [TrainingDoneHook(directory), tf.compat.v1.train.StopAtStepHook(last_step=7)]
        with tf.compat.v1.train.MonitoredTrainingSession(
                checkpoint_dir=directory, hooks=hooks, save_checkpoint_steps=3,
                save_summaries_steps=None, log_step_count_steps=None) as sess:
            assert evaluation.training_done(directory) is None
            while not sess.should_stop():
                sess.run(train)
    assert evaluation.training_done(directory) == 7

    def evaluate(path, at):
        with tf.Graph().as_default():
            w = tf.compat.v1.get_variable("w", [])
            saver = tf.compat.v1.train.Saver([w])
            with tf.compat.v1.Session() as sess:
                saver.restore(sess, path)
                return {"w": sess.run(w)}

    records = tfpsx.evaluate_checkpoints(directory, evaluate, timeout=10)
    assert [(r["step"], r["w"]) for r in records] == [(7, 3.5)]


def test_keras_incremental_checkpoints_are_evaluated_into_a_local_model(tmp_path):
    """The chief's IncrementalCheckpoint marks the end of fit (saving the batches since
    its last save first); the evaluator restores tables and weights into its own model."""

    def build():
        ids = keras.Input((2,), dtype="int64", name="ids")
        rows = tfpsx.keras.DynamicEmbedding(4, optimizer=tfpsx.embedding.SGD(0.5),
                                            initializer=tfpsx.embedding.zeros(), name="emb")(ids)
        out = keras.layers.Dense(1, name="out")(keras.layers.Flatten(name="flat")(rows))
        model = keras.Model(ids, out, name="m")  # names, as in an evaluator process
        model.compile(keras.optimizers.SGD(0.1), "mse")
        return model

    rng = np.random.default_rng(0)
    x = rng.integers(0, 50, size=(256, 2))
    y = (x[:, :1] % 3).astype("float32")
    keras.utils.set_random_seed(1)
    trained = build()
    directory = str(tmp_path / "ckpt")
    trained.fit(x, y, batch_size=32, epochs=1, verbose=0,
                callbacks=[tfpsx.keras.IncrementalCheckpoint(directory, save_freq=3)])
    assert evaluation.training_done(directory) == 8  # 8 batches: the 8th saved at the end
    keras.utils.set_random_seed(2)
    evaluator = build()
    evaluator(tf.constant(x[:1]))
    records = tfpsx.keras.evaluate_checkpoints(evaluator, directory, data=(x, y), timeout=10)
    assert [r["step"] for r in records] == [8]
    np.testing.assert_allclose(records[0]["loss"], trained.evaluate(x, y, verbose=0),
                               rtol=1e-5)
    np.testing.assert_allclose(evaluator.predict(x, verbose=0), trained.predict(x, verbose=0),
                               rtol=1e-5, atol=1e-6)


_DYING_CHIEF = """
import sys, time
import tensorflow as tf
v = tf.Variable(1.0)
tf.train.CheckpointManager(tf.train.Checkpoint(v=v), sys.argv[1], 3).save(checkpoint_number=4)
print("SAVED", flush=True)
time.sleep(300)
"""


@pytest.mark.heavy
def test_a_chief_killed_with_sigkill_ends_the_wait_with_a_named_error(tmp_path):
    """The chief (a real process) saves once and is killed before it marks the end: the
    evaluator evaluates that checkpoint, then gives up within its bound, naming it."""
    import signal
    import subprocess
    import sys

    directory = str(tmp_path / "ckpt")
    chief = subprocess.Popen([sys.executable, "-c", _DYING_CHIEF, directory],
                             stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    try:
        assert chief.stdout.readline().strip() == "SAVED"
        chief.send_signal(signal.SIGKILL)
        chief.wait(timeout=30)
        began = time.monotonic()
        seen = []
        with pytest.raises(ClusterTimeoutError, match=r"waited 2 s for a new checkpoint in "
                           r".*ckpt.*last evaluated: .*ckpt-4\).*the chief died"):
            tfpsx.evaluate_checkpoints(directory, lambda p, s: seen.append(s) or {"s": s},
                                       poll_seconds=0.05, timeout=2)
        assert seen == [4] and time.monotonic() - began < 10
    finally:
        if chief.poll() is None:
            chief.kill()
            chief.wait(timeout=30)

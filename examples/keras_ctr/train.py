"""A Wide&Deep click model trained with Keras 3 ``model.fit`` on a tfpsx cluster.

Dense features feed a wide (linear) part; a string user id and a padded multi-hot list of
tags go through ``tfpsx.keras.DynamicEmbedding`` layers (growing tables sharded over the
parameter servers, trained by their server-side Adagrad) into a deep MLP. The clicks
come from a planted model, so the eval loss shows what was learned (a model that learned
nothing predicts the base rate: log loss ~0.69).

  tfpsx-run --server_num 1 --worker_num 2 examples/keras_ctr/train.py --mode geo --k_steps 100
  python examples/keras_ctr/train.py --mode local        # one process, no cluster

Modes: async, sync, geo, staleness (tfpsx.keras.ParameterServerStrategy) and local (the
same model code without a strategy; under tfpsx-run, every worker trains alone: the
ceiling the PS modes are measured against). Every worker emits a "keras_ctr" metrics
record (examples/s of its training loop, eval loss of its model).
"""

import contextlib
import os
import time

import keras
import tensorflow as tf
from absl import app, flags

import tfpsx
from clicks import FEATURES, WIDTH, click_data

flags.DEFINE_enum("mode", "geo", ["async", "sync", "geo", "staleness", "local"], "training mode")
flags.DEFINE_integer("k_steps", 100, "geo: local steps between syncs")
flags.DEFINE_integer("max_staleness", 4, "staleness: steps a worker may run ahead")
flags.DEFINE_integer("examples", 65536, "training examples in all (each worker: its part)")
flags.DEFINE_integer("batch_size", 256, "batch size per worker")
flags.DEFINE_integer("epochs", 2, "epochs over each worker's part")
flags.DEFINE_integer("hidden", 256, "width of the deep part's first layer")
flags.DEFINE_integer("users", 5000, "distinct user ids")
flags.DEFINE_integer("verbose", 2, "Keras fit verbosity")
flags.DEFINE_integer("steps_per_execution", 1, "Keras compile's steps_per_execution")
FLAGS = flags.FLAGS

DIM = 16


def build_model():
    """The model: plain Keras 3 plus two tfpsx DynamicEmbedding layers."""
    x = keras.Input((FEATURES,), name="x")
    user = keras.Input((1,), dtype="string", name="user")
    tags = keras.Input((WIDTH,), dtype="int64", name="tags")
    table_opt = tfpsx.embedding.Adagrad(0.1)
    user_emb = keras.layers.Flatten()(tfpsx.keras.DynamicEmbedding(
        DIM, optimizer=table_opt, initializer=tfpsx.embedding.normal(stddev=0.05),
        name="user_emb")(user))
    tags_emb = tfpsx.keras.DynamicEmbedding(
        DIM, optimizer=table_opt, combiner="mean", pad_id=-1,
        initializer=tfpsx.embedding.normal(stddev=0.05), name="tags_emb")(tags)
    deep = keras.layers.Concatenate()([x, user_emb, tags_emb])
    deep = keras.layers.Dense(FLAGS.hidden, activation="relu")(deep)
    deep = keras.layers.Dense(FLAGS.hidden // 2, activation="relu")(deep)
    logit = keras.layers.Add()([keras.layers.Dense(1)(deep), keras.layers.Dense(1)(x)])
    model = keras.Model({"x": x, "user": user, "tags": tags},
                        keras.layers.Activation("sigmoid")(logit))
    model.compile(keras.optimizers.Adam(0.002), "binary_crossentropy",
                  steps_per_execution=FLAGS.steps_per_execution)
    return model


def main(argv):
    del argv
    tf.get_logger().setLevel("ERROR")
    local = FLAGS.mode == "local"
    # Under tfpsx-run (or Kubeflow): a cluster; run by hand without one: one process.
    cluster = bool(os.environ.get("TF_CONFIG") or tfpsx.settings.raw("TFPSX_ROLE"))
    me, workers = 0, 1
    strategy = None
    if cluster:
        tfpsx.init()
        if tfpsx.is_server():
            tfpsx.run_server()
            return 0
        tfpsx.init_worker()
        me, workers = tfpsx.worker_index(), tfpsx.worker_num()
        if not local:
            configs = {"geo": {"k_steps": FLAGS.k_steps},
                       "staleness": {"max_staleness": FLAGS.max_staleness}}.get(FLAGS.mode, {})
            strategy = tfpsx.keras.ParameterServerStrategy(tfpsx.DistributedStrategy(
                a_sync=FLAGS.mode != "sync", a_sync_configs=configs))
    else:
        tfpsx.metrics.set_identity("local", 0)

    features, label = click_data(1, FLAGS.examples, FLAGS.users)
    data = tf.data.Dataset.from_tensor_slices((features, label))
    # Each worker its part, the same size everywhere (sync never waits for a straggler's
    # extra batch). The local ceiling trains the same part per worker, alone.
    data = tfpsx.data.shard(data, workers, me) if cluster else data
    examples = FLAGS.epochs * int(data.cardinality())
    data = data.batch(FLAGS.batch_size).cache()
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = build_model()

    start = time.perf_counter()
    history = model.fit(data, epochs=FLAGS.epochs, verbose=FLAGS.verbose, shuffle=False,
                        callbacks=strategy.callbacks() if strategy else None)
    seconds = time.perf_counter() - start

    if strategy is not None:
        tfpsx.barrier_worker()  # every worker's last update is in
    eval_x, eval_y = click_data(99, 8192, FLAGS.users)
    eval_loss = float(model.evaluate({k: tf.constant(v) for k, v in eval_x.items()}, eval_y,
                                     batch_size=2048, verbose=0))
    report = {"worker": me, "mode": FLAGS.mode, "k_steps": FLAGS.k_steps, "seconds": seconds,
              "examples_per_sec": examples / seconds, "eval_loss": eval_loss,
              "train_loss": float(history.history["loss"][-1])}
    if strategy is not None and strategy.counters is not None:
        report["pushes"] = int(strategy.counters.pushes)
    print(f"worker {me}: {FLAGS.mode} {report['examples_per_sec']:.0f} examples/s, "
          f"eval loss {eval_loss:.4f}", flush=True)
    tfpsx.metrics.emit("keras_ctr", **report)
    if cluster:
        tfpsx.stop_worker()
    return 0


if __name__ == "__main__":
    app.run(main)

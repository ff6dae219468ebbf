"""The keras_ctr model in tf-keras (Keras 2) with TF's own ParameterServerStrategy (async):
the peer row of benchmarks/keras_modes.py.

It runs in its own virtualenv (tensorflow-cpu and ``tf-keras`` installed with
``--no-deps``, ``TF_USE_LEGACY_KERAS=1``): Keras 3 has no parameter-server training.
This process is the coordinator (TF's ``ClusterCoordinator`` behind ``model.fit``); it
starts 1 PS and 2 workers as ``tf.distribute.Server`` processes on free 127.0.0.1 ports
(each ends itself after --timeout) and kills them by PID at the end. Tables are dense
``Embedding`` s: users hashed into twice as many buckets as there are users, tags one row
each (the mean of the non-padded ones, as the tfpsx layer's combiner="mean"). Writes {"examples_per_sec", "eval_loss", ...} as
JSON to --out.

  TF_USE_LEGACY_KERAS=1 .venv-tfkeras/bin/python benchmarks/keras_tfkeras_pss.py --out r.json
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples", "keras_ctr"))

from clicks import FEATURES, TAGS, WIDTH, click_data  # noqa: E402


def serve(job: str, index: int, cluster: dict, timeout: float) -> None:
    import tensorflow as tf

    threading.Timer(timeout, lambda: os._exit(3)).start()  # never outlive the benchmark
    tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=job, task_index=index,
                         protocol="grpc", start=True).join()


def build_model(tf, users: int, hidden: int):
    keras = tf.keras
    x = keras.Input((FEATURES,), name="x")
    user = keras.Input((1,), dtype="string", name="user")
    tags = keras.Input((WIDTH,), dtype="int64", name="tags")
    buckets = 2 * users
    user_emb = keras.layers.Flatten()(keras.layers.Embedding(buckets, 16)(
        keras.layers.Hashing(buckets)(user)))
    rows = keras.layers.Embedding(TAGS + 1, 16)(tf.maximum(tags, 0))
    valid = tf.expand_dims(tf.cast(tags >= 0, tf.float32), -1)  # -1 pads
    tags_emb = tf.reduce_sum(rows * valid, 1) / tf.maximum(tf.reduce_sum(valid, 1), 1.0)
    deep = keras.layers.Concatenate()([x, user_emb, tags_emb])
    deep = keras.layers.Dense(hidden, activation="relu")(deep)
    deep = keras.layers.Dense(hidden // 2, activation="relu")(deep)
    logit = keras.layers.Add()([keras.layers.Dense(1)(deep), keras.layers.Dense(1)(x)])
    model = keras.Model({"x": x, "user": user, "tags": tags},
                        keras.layers.Activation("sigmoid")(logit))
    return model


def coordinate(args) -> dict:
    import portpicker
    import tensorflow as tf

    ports = [portpicker.pick_unused_port() for _ in range(4)]
    cluster = {"chief": [f"127.0.0.1:{ports[0]}"], "ps": [f"127.0.0.1:{ports[1]}"],
               "worker": [f"127.0.0.1:{p}" for p in ports[2:]]}
    procs = [subprocess.Popen([sys.executable, __file__, "--serve", job, str(i),
                               json.dumps(cluster), str(args.timeout)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for job, i in (("ps", 0), ("worker", 0), ("worker", 1))]
    try:
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(cluster), task_type="chief", task_id=0, rpc_layer="grpc")
        strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
        features, label = click_data(1, args.examples, args.users)
        per_worker = args.examples // 2
        steps_per_epoch = 2 * (per_worker // args.batch_size)

        def dataset_fn(context):
            data = tf.data.Dataset.from_tensor_slices((features, label))
            data = data.shard(context.num_input_pipelines, context.input_pipeline_id)
            return data.take(per_worker).batch(args.batch_size).cache().repeat()

        with strategy.scope():
            model = build_model(tf, args.users, args.hidden)
            model.compile(tf.keras.optimizers.Adam(0.002), "binary_crossentropy",
                          steps_per_execution=1)
        creator = tf.keras.utils.experimental.DatasetCreator(dataset_fn)
        model.fit(creator, epochs=1, steps_per_epoch=10, verbose=0)  # trace, connect
        start = time.perf_counter()
        model.fit(creator, epochs=args.epochs, steps_per_epoch=steps_per_epoch, verbose=0)
        seconds = time.perf_counter() - start
        eval_x, eval_y = click_data(99, 8192, args.users)
        local = build_model(tf, args.users, args.hidden)
        local.compile(loss="binary_crossentropy")
        local.set_weights(model.get_weights())
        eval_loss = float(local.evaluate({k: tf.constant(v) for k, v in eval_x.items()},
                                         eval_y, batch_size=2048, verbose=0))
        examples = args.epochs * steps_per_epoch * args.batch_size
        return {"examples_per_sec": examples / seconds, "eval_loss": eval_loss,
                "seconds": seconds, "tf_version": tf.__version__,
                "keras_version": __import__("tf_keras").__version__}
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def main(argv=None):
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--serve":
        _, job, index, cluster, timeout = sys.argv[1:6]
        serve(job, int(index), json.loads(cluster), float(timeout))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--examples", type=int, default=262144)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch_size", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--users", type=int, default=5000)
    p.add_argument("--timeout", type=float, default=900)
    args = p.parse_args(argv)
    try:
        result = coordinate(args)
    except Exception as e:  # noqa: BLE001 — how the peer fails is a finding to record
        result = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())

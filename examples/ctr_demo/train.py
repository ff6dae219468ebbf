"""A small CTR model trained between-graph on a tfpsx cluster (graph mode, TF1 style).

Each worker builds the same graph. ``tfpsx.model_scope(strategy)`` puts the variables on
the parameter servers (GEO: plus a local copy on each worker) and the computation on the
worker; ``tfpsx.distributed_optimizer`` makes Adagrad the strategy's update (GEO by
default: 10 local steps between syncs, the sync in a background thread); worker 0 (the
chief) initializes the variables inside ``tfpsx.MonitoredTrainingSession``. The data is
generated: clicks drawn from a planted logistic model over 8 categorical fields (an
embedding table) and 8 dense features, so the loss has somewhere to fall to.

Run it with:  tfpsx-run --server_num 1 --worker_num 2 examples/ctr_demo/train.py [--mode async]
"""

import argparse
import sys
import time

import numpy as np
import tensorflow as tf

import tfpsx

FIELDS, VOCAB, DENSE, EMB = 8, 1000, 8, 8


def make_data(seed: int, rows: int, fields: int = FIELDS, vocab: int = VOCAB,
              bias: float = -0.5):
    """Clicks from a fixed planted model (same for every worker); rows differ by seed.
    (benchmarks/_soak_job.py draws its data here too, with other sizes.)"""
    truth = np.random.default_rng(1234)
    id_weight = truth.normal(0, 1.0, size=vocab).astype(np.float32)
    dense_weight = truth.normal(0, 0.5, size=DENSE).astype(np.float32)
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=(rows, fields)).astype(np.int64)
    dense = rng.normal(size=(rows, DENSE)).astype(np.float32)
    logit = id_weight[ids].sum(axis=1) / np.sqrt(fields) + dense @ dense_weight + bias
    clicks = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    return ids, dense, clicks


def _dense(x, units, name):
    # tf.compat.v1.layers is gone with Keras 3; two variables do the same.
    with tf.compat.v1.variable_scope(name):
        kernel = tf.compat.v1.get_variable(
            "kernel", [x.shape[-1], units],
            initializer=tf.compat.v1.glorot_uniform_initializer())
        bias = tf.compat.v1.get_variable("bias", [units], initializer=tf.zeros_initializer())
    return tf.matmul(x, kernel) + bias


def build_model(ids, dense, clicks):
    embedding = tf.compat.v1.get_variable(
        "embedding", [VOCAB, EMB], initializer=tf.compat.v1.random_normal_initializer(0, 0.05))
    x = tf.concat([tf.reshape(tf.nn.embedding_lookup(embedding, ids), [-1, FIELDS * EMB]),
                   dense], axis=1)
    hidden = tf.nn.relu(_dense(x, 32, "hidden"))
    logit = tf.squeeze(_dense(hidden, 1, "out"), axis=1)
    return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=clicks, logits=logit))


def global_eval_loss(feed):
    """The eval loss of the model on the parameter servers (in GEO, the shared model
    rather than this worker's copy): a graph that reaches the PS variables by name."""
    with tf.Graph().as_default():
        with tfpsx.model_scope():  # async placement: the PS variables themselves
            tf.compat.v1.train.get_or_create_global_step()
            ids = tf.compat.v1.placeholder(tf.int64, [None, FIELDS])
            dense = tf.compat.v1.placeholder(tf.float32, [None, DENSE])
            clicks = tf.compat.v1.placeholder(tf.float32, [None])
            loss = build_model(ids, dense, clicks)
        with tf.compat.v1.Session(tfpsx.server_target(), config=tfpsx.session_config()) as s:
            return s.run(loss, {ids: feed[0], dense: feed[1], clicks: feed[2]})


def main(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=600, help="global steps to train")
    parser.add_argument("--batch_size", type=int, default=256)
    parser.add_argument("--learning_rate", type=float, default=0.1)
    parser.add_argument("--log_every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1, help="graph-level seed of the model's init")
    parser.add_argument("--mode", choices=["async", "geo"], default="geo")
    parser.add_argument("--k_steps", type=int, default=10, help="GEO: local steps per sync")
    args = parser.parse_args(argv)

    tf.get_logger().setLevel("ERROR")  # TF1 deprecation notices drown the progress lines
    tfpsx.init()
    if tfpsx.is_server():
        tfpsx.run_server()
        return 0

    tfpsx.init_worker()
    index = tfpsx.worker_index()
    ids_np, dense_np, clicks_np = make_data(seed=100 + index, rows=50_000)
    eval_data = make_data(seed=7, rows=5_000)  # same for all workers
    strategy = tfpsx.DistributedStrategy(
        a_sync=True, a_sync_configs={"k_steps": args.k_steps if args.mode == "geo" else 0})

    with tf.Graph().as_default():
        tf.compat.v1.set_random_seed(args.seed)
        with tfpsx.model_scope(strategy):
            global_step = tf.compat.v1.train.get_or_create_global_step()
            ids = tf.compat.v1.placeholder(tf.int64, [None, FIELDS])
            dense = tf.compat.v1.placeholder(tf.float32, [None, DENSE])
            clicks = tf.compat.v1.placeholder(tf.float32, [None])
            loss = build_model(ids, dense, clicks)
            optimizer = tfpsx.distributed_optimizer(
                tf.compat.v1.train.AdagradOptimizer(args.learning_rate), strategy)
            train_op = optimizer.minimize(loss, global_step=global_step)

        eval_feed = {ids: eval_data[0], dense: eval_data[1], clicks: eval_data[2]}
        start, local_steps = time.time(), 0
        with tfpsx.MonitoredTrainingSession(last_step=args.steps) as sess:
            first_loss = sess.run(loss, feed_dict=eval_feed)
            print(f"worker {index}: {strategy.mode} training; eval loss before training "
                  f"{first_loss:.4f}", flush=True)
            rng = np.random.default_rng(index)
            while not sess.should_stop():
                rows = rng.integers(0, len(clicks_np), size=args.batch_size)
                _, step = sess.run([train_op, global_step], feed_dict={
                    ids: ids_np[rows], dense: dense_np[rows], clicks: clicks_np[rows]})
                local_steps += 1
                # The step may have ended training (StopAtStepHook): no more runs then.
                if local_steps % args.log_every == 0 and not sess.should_stop():
                    print(f"worker {index}: global step {step}, eval loss "
                          f"{sess.run(loss, feed_dict=eval_feed):.4f}", flush=True)
        seconds = time.time() - start
    tfpsx.barrier_worker()  # every worker's last push is in
    final_loss = global_eval_loss(eval_data)
    sync = ""
    if hasattr(optimizer, "counters"):
        c = optimizer.counters
        sync = (f"; GEO: {c.pushes} syncs, {c.bytes_sent / 1e6:.1f} MB sent, "
                f"{1000 * c.mean_sync_seconds:.1f} ms per sync")
    print(f"worker {index}: {local_steps} local steps in {seconds:.1f} s "
          f"({local_steps / seconds:.0f} steps/s); final eval loss {final_loss:.4f} "
          f"(from {first_loss:.4f}){sync}", flush=True)
    tfpsx.stop_worker()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""A small CTR model trained between-graph on a tfpsx cluster (graph mode, TF1 style).

Each worker builds the same graph; ``replica_device_setter`` puts the variables on the
parameter servers and the computation on the worker; worker 0 (the chief) initializes
the variables inside ``MonitoredTrainingSession``. The data is generated: clicks drawn
from a planted logistic model over 8 categorical fields (hashed into an embedding
table) and 8 dense features, so the loss has somewhere to fall to.

Run it with:  tfpsx-run --no_scheduler --server_num 1 --worker_num 2 examples/ctr_demo/train.py
"""

import argparse
import sys
import time

import numpy as np
import tensorflow as tf

import tfpsx

FIELDS, VOCAB, DENSE, EMB = 8, 1000, 8, 8


def make_data(seed: int, rows: int):
    """Clicks from a fixed planted model (same for every worker); rows differ by seed."""
    truth = np.random.default_rng(1234)
    id_weight = truth.normal(0, 1.0, size=VOCAB).astype(np.float32)
    dense_weight = truth.normal(0, 0.5, size=DENSE).astype(np.float32)
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, size=(rows, FIELDS)).astype(np.int64)
    dense = rng.normal(size=(rows, DENSE)).astype(np.float32)
    logit = id_weight[ids].sum(axis=1) / np.sqrt(FIELDS) + dense @ dense_weight - 0.5
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


def main(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=600, help="global steps to train")
    parser.add_argument("--batch_size", type=int, default=256)
    parser.add_argument("--learning_rate", type=float, default=0.1)
    parser.add_argument("--log_every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1, help="graph-level seed of the model's init")
    args = parser.parse_args(argv)

    tf.get_logger().setLevel("ERROR")  # TF1 deprecation notices drown the progress lines
    tfpsx.init()
    if tfpsx.is_server():
        tfpsx.run_server()
        return 0

    tfpsx.init_worker()
    index = tfpsx.worker_index()
    ids_np, dense_np, clicks_np = make_data(seed=100 + index, rows=50_000)
    eval_ids, eval_dense, eval_clicks = make_data(seed=7, rows=5_000)  # same for all workers

    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(args.seed)
        # tf.compat.v1.device, not tf.device: TF 2.x's tf.device rejects device functions.
        with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
                cluster=tfpsx.cluster_spec(),
                worker_device=f"/job:{tfpsx.cluster_config().job_name}/task:"
                              f"{tfpsx.cluster_config().task_index}")):
            global_step = tf.compat.v1.train.get_or_create_global_step()
            ids = tf.compat.v1.placeholder(tf.int64, [None, FIELDS])
            dense = tf.compat.v1.placeholder(tf.float32, [None, DENSE])
            clicks = tf.compat.v1.placeholder(tf.float32, [None])
            loss = build_model(ids, dense, clicks)
            train_op = tf.compat.v1.train.AdagradOptimizer(args.learning_rate).minimize(
                loss, global_step=global_step)

        hooks = [tf.compat.v1.train.StopAtStepHook(last_step=args.steps)]
        eval_feed = {ids: eval_ids, dense: eval_dense, clicks: eval_clicks}
        start, local_steps, first_loss = time.time(), 0, None
        if not tfpsx.is_chief():
            # Start after the chief has initialized the variables: TF's non-chief session
            # would otherwise poll for them only every 30 s.
            tfpsx.barrier_worker()
        with tf.compat.v1.train.MonitoredTrainingSession(
                master=tfpsx.server_target(), is_chief=tfpsx.is_chief(), hooks=hooks,
                config=tfpsx.session_config(), log_step_count_steps=0) as sess:
            first_loss = sess.run(loss, feed_dict=eval_feed)
            print(f"worker {index}: eval loss before training {first_loss:.4f}", flush=True)
            if tfpsx.is_chief():
                tfpsx.barrier_worker()  # the others start now: nobody trained before this eval
            rng = np.random.default_rng(index)
            while not sess.should_stop():
                rows = rng.integers(0, len(clicks_np), size=args.batch_size)
                _, step = sess.run([train_op, global_step], feed_dict={
                    ids: ids_np[rows], dense: dense_np[rows], clicks: clicks_np[rows]})
                local_steps += 1
                if local_steps % args.log_every == 0:
                    print(f"worker {index}: global step {step}, eval loss "
                          f"{sess.run(loss, feed_dict=eval_feed):.4f}", flush=True)
        seconds = time.time() - start
        # The monitored session refuses runs once the stop step is reached; the variables
        # live on the servers, so a plain session reads the final state.
        with tf.compat.v1.Session(tfpsx.server_target(), config=tfpsx.session_config()) as sess:
            final_loss = sess.run(loss, feed_dict=eval_feed)
    print(f"worker {index}: {local_steps} local steps in {seconds:.1f} s "
          f"({local_steps / seconds:.0f} steps/s); final eval loss {final_loss:.4f} "
          f"(from {first_loss:.4f})", flush=True)
    tfpsx.stop_worker()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

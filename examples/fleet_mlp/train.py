"""An MLP on in-memory data in the shape of Paddle Fleet's parameter-server tutorial:
``fleet.init()``, ``fleet.distributed_optimizer(optimizer, strategy).minimize(loss)``,
``is_server()`` -> ``run_server()``, ``is_worker()`` -> ``init_worker()``, the training
loop, ``stop_worker()``. Here ``fleet`` is tfpsx::

  tfpsx-run --server_num 1 --worker_num 2 examples/fleet_mlp/train.py [--mode async|geo|sync]
  tfpsx-run --server_num 0 --worker_num 2 examples/fleet_mlp/train.py --mode collective

The collective mode is Fleet's ``fleet.init(is_collective=True)``: no servers, every
weight on every worker, gradients averaged by all-reduce each step.

The data: 20,000 rows of 16 features per worker, labelled by a fixed two-layer network
(the same for every worker), so the accuracy has somewhere to climb to.
"""

import argparse
import sys

import numpy as np
import tensorflow as tf

import tfpsx as fleet

FEATURES, HIDDEN = 16, 64


def dataset(rows, seed):
    truth = np.random.default_rng(7)
    w1 = truth.normal(size=(FEATURES, 8)).astype(np.float32)
    w2 = truth.normal(size=8).astype(np.float32)
    x = np.random.default_rng(seed).normal(size=(rows, FEATURES)).astype(np.float32)
    y = (np.tanh(x @ w1) @ w2 > 0).astype(np.float32)
    return x, y


def mlp(x):
    h = x
    for i, units in enumerate((HIDDEN, HIDDEN, 1)):
        with tf.compat.v1.variable_scope(f"fc{i}"):
            w = tf.compat.v1.get_variable("w", [h.shape[-1], units],
                                          initializer=tf.compat.v1.glorot_uniform_initializer())
            b = tf.compat.v1.get_variable("b", [units], initializer=tf.zeros_initializer())
        h = tf.matmul(h, w) + b
        if units != 1:
            h = tf.nn.relu(h)
    return tf.squeeze(h, 1)


def main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["async", "geo", "sync", "collective"], default="async")
    p.add_argument("--steps", type=int, default=1500, help="global steps")
    p.add_argument("--batch_size", type=int, default=64)
    args = p.parse_args(argv)
    tf.get_logger().setLevel("ERROR")

    collective = args.mode == "collective"
    # The role maker: TF_CONFIG, TFPSX_* or the scheduler (tfpsx-run).
    fleet.init(is_collective=collective)
    strategy = (fleet.DistributedStrategy(collective=True) if collective else
                fleet.DistributedStrategy(
                    a_sync=args.mode != "sync",
                    a_sync_configs={"k_steps": 20 if args.mode == "geo" else 0}))

    if fleet.is_server():
        fleet.run_server()  # serves until every worker called stop_worker()
        return 0

    fleet.init_worker()
    index = fleet.worker_index()
    x_train, y_train = dataset(20000, seed=1 + index)
    x_test, y_test = dataset(5000, seed=99)
    with tf.Graph().as_default():
        with fleet.model_scope(strategy):
            step = tf.compat.v1.train.get_or_create_global_step()
            x = tf.compat.v1.placeholder(tf.float32, [None, FEATURES])
            y = tf.compat.v1.placeholder(tf.float32, [None])
            logits = mlp(x)
            loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=y,
                                                                          logits=logits))
            accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.cast(logits > 0, tf.float32), y),
                                              tf.float32))
            optimizer = fleet.distributed_optimizer(tf.compat.v1.train.AdamOptimizer(0.003),
                                                    strategy)
            train_op = optimizer.minimize(loss, global_step=step)
        rng = np.random.default_rng(index)
        with fleet.MonitoredTrainingSession(last_step=args.steps) as sess:
            while not sess.should_stop():
                rows = rng.integers(0, len(y_train), args.batch_size)
                _, at = sess.run([train_op, step], {x: x_train[rows], y: y_train[rows]})
                if at % 500 == 0 and not sess.should_stop():
                    print(f"worker {index}: step {at} loss "
                          f"{sess.run(loss, {x: x_test, y: y_test}):.4f}", flush=True)
        if not collective:  # (collective: every worker holds the same weights already)
            fleet.barrier_worker()  # every worker's last update is in
        with tf.compat.v1.Session(fleet.server_target(), config=fleet.session_config()) as s:
            acc = s.run(accuracy, {x: x_test, y: y_test})
    print(f"FLEET_MLP worker {index} ({args.mode}): test accuracy {acc:.4f}", flush=True)
    fleet.stop_worker()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

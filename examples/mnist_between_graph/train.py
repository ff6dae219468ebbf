"""Between-graph MNIST as TF1 users wrote it: ClusterSpec, tf.distribute.Server,
replica_device_setter, MonitoredTrainingSession. No tfpsx import: tfpsx only supplies the
cluster, through the classic flags or TF_CONFIG::

  tfpsx-run --no_scheduler --config tf_config --server_num 1 --worker_num 2 \\
      --server_grace 5 examples/mnist_between_graph/train.py
  python train.py --ps_hosts h:p --worker_hosts h:p,h:p --job_name worker --task_index 0

The digits are generated (no download): ten fixed 28x28 stroke patterns, shifted by a
few pixels and drawn faintly over noise, as many as MNIST's 60,000.
"""

import argparse
import json
import os
import time

import numpy as np
import tensorflow as tf

tf.compat.v1.disable_eager_execution()

p = argparse.ArgumentParser()
p.add_argument("--ps_hosts", default=None, help="comma-separated host:port (else TF_CONFIG)")
p.add_argument("--worker_hosts", default=None)
p.add_argument("--job_name", default=None, choices=[None, "ps", "worker"])
p.add_argument("--task_index", type=int, default=0)
p.add_argument("--train_steps", type=int, default=600, help="global steps")
p.add_argument("--batch_size", type=int, default=100)
p.add_argument("--learning_rate", type=float, default=0.05)
p.add_argument("--checkpoint_dir", default=None)
FLAGS = p.parse_args()

if FLAGS.ps_hosts:
    cluster = {"ps": FLAGS.ps_hosts.split(","), "worker": FLAGS.worker_hosts.split(",")}
    job_name, task_index = FLAGS.job_name, FLAGS.task_index
else:
    config = json.loads(os.environ["TF_CONFIG"])
    cluster, job_name, task_index = (config["cluster"], config["task"]["type"],
                                     config["task"]["index"])
spec = tf.train.ClusterSpec(cluster)
server = tf.distribute.Server(spec, job_name=job_name, task_index=task_index)
if job_name == "ps":
    server.join()


def digits(count, seed):
    """Ten fixed stroke patterns (the same for every worker), shifted and noisy."""
    patterns = np.random.default_rng(0).random((10, 28, 28)) > 0.8
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, count)
    images = np.empty((count, 28, 28), np.float32)
    for i, label in enumerate(labels):
        shifted = np.roll(patterns[label], rng.integers(-2, 3, 2), axis=(0, 1))
        images[i] = 0.5 * shifted + 0.8 * rng.random((28, 28))
    return images.reshape(count, 784), labels.astype(np.int64)


def dense(inputs, units, name):
    """tf.compat.v1.layers.dense's variables (that API is gone with Keras 3)."""
    with tf.compat.v1.variable_scope(name):
        kernel = tf.compat.v1.get_variable(
            "kernel", [inputs.shape[-1], units],
            initializer=tf.compat.v1.glorot_uniform_initializer())
        bias = tf.compat.v1.get_variable("bias", [units], initializer=tf.zeros_initializer())
    return tf.matmul(inputs, kernel) + bias


is_chief = task_index == 0
train_x, train_y = digits(60000 // len(cluster["worker"]), seed=1 + task_index)
test_x, test_y = digits(10000, seed=99)

with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
        worker_device=f"/job:worker/task:{task_index}", cluster=spec)):
    global_step = tf.compat.v1.train.get_or_create_global_step()
    x = tf.compat.v1.placeholder(tf.float32, [None, 784])
    y = tf.compat.v1.placeholder(tf.int64, [None])
    hidden = tf.nn.relu(dense(x, 128, "hidden"))
    logits = dense(hidden, 10, "logits")
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(y, logits)
    accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1), y), tf.float32))
    train_op = tf.compat.v1.train.AdagradOptimizer(FLAGS.learning_rate).minimize(
        loss, global_step=global_step)

# A worker sees the servers and itself only (without this filter a worker can hang
# waiting for the other workers' devices).
session_config = tf.compat.v1.ConfigProto(
    device_filters=["/job:ps", f"/job:worker/task:{task_index}"])
hooks = [tf.compat.v1.train.StopAtStepHook(last_step=FLAGS.train_steps)]
rng = np.random.default_rng(task_index)
start, local = time.time(), 0
with tf.compat.v1.train.MonitoredTrainingSession(
        master=server.target, is_chief=is_chief, checkpoint_dir=FLAGS.checkpoint_dir,
        hooks=hooks, config=session_config, save_summaries_steps=None,
        log_step_count_steps=None) as sess:
    while not sess.should_stop():
        rows = rng.integers(0, len(train_y), FLAGS.batch_size)
        _, step = sess.run([train_op, global_step], {x: train_x[rows], y: train_y[rows]})
        local += 1
        if local % 100 == 0 and not sess.should_stop():
            print(f"worker {task_index}: global step {step}", flush=True)
with tf.compat.v1.Session(server.target, config=session_config) as sess:
    acc = sess.run(accuracy, {x: test_x, y: test_y})  # the model on the servers
print(f"MNIST worker {task_index}: {local} local steps in {time.time() - start:.1f} s; "
      f"test accuracy {acc:.4f}", flush=True)

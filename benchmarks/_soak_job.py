"""The job of benchmarks/fault_soak.py: a small CTR model (a DynamicTable of ids, a
dense layer), async, graph mode, checkpointed incrementally by the chief; trains to
``--steps`` global steps. At the end the chief emits a ``soak`` metrics record with the
global model's eval loss (labels drawn from a planted logistic model: the loss has a
floor, ~0.5, so relative differences mean something).

  tfpsx-run ... benchmarks/_soak_job.py --checkpoint_dir D --steps S [--step_delay s]
"""

import argparse
import importlib.util
import os
import sys
import time

import numpy as np
import tensorflow as tf

import tfpsx

FIELDS, VOCAB, DIM = 4, 5000, 8


def _load_ctr_demo():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples",
                        "ctr_demo", "train.py")
    spec = importlib.util.spec_from_file_location("ctr_demo_train", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ctr_demo = _load_ctr_demo()
DENSE = ctr_demo.DENSE


def make_data(seed: int, rows: int):
    """The CTR demo's planted clicks (examples/ctr_demo), 4 fields of 5,000 ids."""
    return ctr_demo.make_data(seed, rows, fields=FIELDS, vocab=VOCAB, bias=0.0)


def model(table, ids, dense, clicks, step, train):
    """(loss, the lookup); ``train``: lookups insert and count (training), else read."""
    looked = table.lookup_unique(ids, train=train, step=step)
    x = tf.concat([tf.reshape(looked.embeddings, [-1, FIELDS * DIM]), dense], axis=1)
    with tf.compat.v1.variable_scope("model", reuse=tf.compat.v1.AUTO_REUSE):
        w = tf.compat.v1.get_variable("w", [FIELDS * DIM + DENSE, 1],
                                      initializer=tf.zeros_initializer())
        b = tf.compat.v1.get_variable("b", [], initializer=tf.zeros_initializer())
    logit = tf.squeeze(tf.matmul(x, w), 1) + b
    loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=clicks, logits=logit))
    return loss, looked


def main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint_dir", required=True)
    p.add_argument("--steps", type=int, default=15000)
    p.add_argument("--save_steps", type=int, default=500)
    p.add_argument("--step_delay", type=float, default=0.0)
    args = p.parse_args(argv)
    tfpsx.init()
    if tfpsx.is_server():
        tfpsx.run_server()
        return 0
    tfpsx.init_worker()
    me = tfpsx.worker_index()
    ids_np, dense_np, clicks_np = make_data(100 + me, 200_000)  # no overfitting at the end
    eval_data = make_data(7, 20_000)
    strategy = tfpsx.DistributedStrategy(a_sync=True)
    with tf.Graph().as_default():
        with tfpsx.model_scope(strategy):
            step = tf.compat.v1.train.get_or_create_global_step()
            ids = tf.compat.v1.placeholder(tf.int64, [None, FIELDS])
            dense = tf.compat.v1.placeholder(tf.float32, [None, DENSE])
            clicks = tf.compat.v1.placeholder(tf.float32, [None])
            table = tfpsx.embedding.DynamicTable(
                "soak_ids", DIM, optimizer=tfpsx.embedding.Adagrad(0.1),
                initializer=tfpsx.embedding.normal(stddev=0.01))
            loss, looked = model(table, ids, dense, clicks, step, train=True)
            opt = tfpsx.distributed_optimizer(tf.compat.v1.train.AdagradOptimizer(0.1), strategy)
            train = tf.group(opt.minimize(loss, global_step=step), table.minimize(loss, [looked]))
            eval_loss, _ = model(table, ids, dense, clicks, step, train=False)
        eval_feed = {ids: eval_data[0], dense: eval_data[1], clicks: eval_data[2]}
        rng = np.random.default_rng(me * 1000 + int(time.time()))
        with tfpsx.MonitoredTrainingSession(
                checkpoint_dir=args.checkpoint_dir, save_checkpoint_steps=args.save_steps,
                incremental_checkpoints=5, last_step=args.steps) as sess:
            start = sess.run(step)
            print(f"worker {me}: training from global step {start}", flush=True)
            while not sess.should_stop():
                rows = rng.integers(0, len(clicks_np), 256)
                sess.run(train, {ids: ids_np[rows], dense: dense_np[rows],
                                 clicks: clicks_np[rows]})
                if args.step_delay:
                    time.sleep(args.step_delay)
        if me == 0:
            # The model on the PS after the chief's last step (async: the other worker
            # may still push a step or two; the loss floor makes that immaterial).
            with tf.compat.v1.Session(tfpsx.server_target(),
                                      config=tfpsx.session_config()) as s:
                value, at = s.run([eval_loss, step], eval_feed)
            tfpsx.metrics.emit("soak", eval_loss=float(value), global_step=int(at),
                               start_step=int(start))
            print(f"worker 0: final eval loss {value:.4f} at global step {at}", flush=True)
    tfpsx.stop_worker()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The word2vec example's model in plain TF async: the baseline tfpsx is compared with.

What a user writes without tfpsx: a vocabulary built up front, two [vocab, dim]
``tf.Variable``s on the parameter server (``tf.gather`` runs there, so only rows travel),
``tf.compat.v1.train.AdagradOptimizer`` applying IndexedSlices on the PS every step.
Sampling, objective, learning rate and evaluation are the example's own (imported from
examples/word2vec/train.py, flags included); tfpsx only launches the cluster, places the
variables and runs the session. Emits the example's word2vec metrics record with mode
"tf_async". Run by benchmarks/geo_vs_async.py:

  tfpsx-run --server_num 1 --worker_num 2 benchmarks/word2vec_tf_async.py --steps 2000
"""

import os
import sys
import time

import numpy as np
import tensorflow as tf
from absl import app

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples", "word2vec"))

import train as w2v  # noqa: E402  (the example: its flags, Corpus and evaluate)

import tfpsx  # noqa: E402

FLAGS = w2v.FLAGS


def main(argv):
    del argv
    tf.get_logger().setLevel("ERROR")
    tfpsx.init()
    if tfpsx.is_server():
        tfpsx.run_server()
        return 0
    tfpsx.init_worker()
    me = tfpsx.worker_index()
    corpus = w2v.Corpus(FLAGS.corpus, FLAGS.window)
    vocab = np.array(sorted(corpus.ids.values()), np.int64)  # word id -> row: its rank
    rng = np.random.default_rng(FLAGS.seed + me)
    strategy = tfpsx.DistributedStrategy(a_sync=True)

    with tf.Graph().as_default():
        with tfpsx.model_scope(strategy):
            global_step = tf.compat.v1.train.get_or_create_global_step()
            init = tf.compat.v1.random_normal_initializer(stddev=0.1)
            w_in = tf.compat.v1.get_variable("w2v_in", [len(vocab), FLAGS.dim],
                                             initializer=init)
            w_out = tf.compat.v1.get_variable("w2v_out", [len(vocab), FLAGS.dim],
                                              initializer=init)
            center = tf.compat.v1.placeholder(tf.int64, [None], name="center")
            targets = tf.compat.v1.placeholder(tf.int64, [None, 1 + FLAGS.negatives],
                                               name="targets")
            logits = tf.einsum("bd,bkd->bk", tf.gather(w_in, center), tf.gather(w_out, targets))
            labels = tf.one_hot(tf.zeros_like(center, tf.int32), 1 + FLAGS.negatives)
            per_pair = tf.reduce_sum(
                tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits), axis=1)
            opt = tfpsx.distributed_optimizer(
                tf.compat.v1.train.AdagradOptimizer(FLAGS.learning_rate), strategy)
            train_op = opt.minimize(tf.reduce_sum(per_pair), global_step=global_step)
            loss = tf.reduce_mean(per_pair)
            probe = w2v.Probe(corpus)  # the example's eval pairs, rows gathered on the PS
            probe_rows = [tf.gather(w_in, np.searchsorted(vocab, probe.ids_in)),
                          tf.gather(w_out, np.searchsorted(vocab, probe.ids_out))]

        batches = []
        for _ in range(FLAGS.steps):
            c, ctx = corpus.pairs(rng, FLAGS.batch_size)
            negs = corpus.negatives(rng, (FLAGS.batch_size, FLAGS.negatives))
            t = np.concatenate([ctx[:, None], negs], axis=1)
            batches.append((np.searchsorted(vocab, c), np.searchsorted(vocab, t)))
        losses, points = [], []
        probing = me == 0 and FLAGS.eval_every > 0
        with tfpsx.MonitoredTrainingSession() as sess:
            start = time.perf_counter()
            paused = 0.0  # the example's timeline: evaluations left out
            for i, (c, t) in enumerate(batches, 1):
                if FLAGS.max_seconds and time.perf_counter() - start - paused > FLAGS.max_seconds:
                    break
                _, value = sess.run([train_op, loss], {center: c, targets: t})
                losses.append(value)
                if probing and i % FLAGS.eval_every == 0:
                    began = time.perf_counter()
                    points.append({"seconds": began - start - paused, "step": i,
                                   "loss": probe.loss(*sess.run(probe_rows))})
                    paused += time.perf_counter() - began
            seconds = time.perf_counter() - start - paused
        tfpsx.barrier_worker()
        with tf.compat.v1.Session(tfpsx.server_target(), config=tfpsx.session_config()) as s:
            values_in, values_out = s.run([w_in, w_out])
            if probing:
                points.append({"seconds": seconds, "step": len(losses),
                               "loss": probe.loss(*s.run(probe_rows))})
    eval_loss, gap = w2v.evaluate({"keys": vocab, "values": values_in},
                                  {"keys": vocab, "values": values_out}, corpus, FLAGS.dim)
    report = {"worker": me, "mode": "tf_async", "k_steps": 0, "steps": len(losses),
              "seconds": seconds, "examples_per_sec": len(losses) * FLAGS.batch_size / seconds,
              "train_loss": float(np.mean(losses[-50:])), "eval_loss": eval_loss,
              "similarity_gap": gap, "vocab_rows": int(len(vocab)), "points": points}
    tfpsx.metrics.emit("word2vec", **report)
    tfpsx.stop_worker()
    return 0


if __name__ == "__main__":
    app.run(main)

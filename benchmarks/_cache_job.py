"""The job of benchmarks/embedding_cache.py: a CTR-like model over Zipf(1.1) ids, async.

Each example has FIELDS ids drawn from Zipf(1.1) over a vocabulary of --vocab (hot ids
spread over the key space), a click from a planted logistic model over the ids'
weights; the model is a DynamicTable (Adagrad on the PS; with --cache_size the
worker cache trains it locally; with --local_table every worker trains one of its own on
itself) and a linear layer on the PS. Graph mode, async,
between-graph, started by the benchmark with TFPSX_* env (no launcher: its cluster
specs route through delay proxies). Every worker emits one "cache_bench" metrics record:
examples/s of its training loop, lookup latency of one batch (median ms, read-only: the
cache's rows, or a PS round trip), and, on worker 0 after every worker's last flush, the
eval loss of the global model (PS rows) on held-out examples.
"""

import argparse
import statistics
import sys
import time

import numpy as np
import tensorflow as tf

import tfpsx
from tfpsx import embedding as E

FIELDS, DIM = 8, 16


def zipf_ids(rng, cdf, ranks, shape):
    draw = np.minimum(np.searchsorted(cdf, rng.random(shape)), len(cdf) - 1)
    return ranks[draw]


def make_data(seed: int, rows: int, vocab: int):
    """(ids [rows, FIELDS] int64, clicks [rows]) from the planted model."""
    truth = np.random.default_rng(77)
    ranks = truth.permutation(vocab).astype(np.int64)
    cdf = np.cumsum(np.arange(1, vocab + 1, dtype=np.float64) ** -1.1)
    cdf /= cdf[-1]
    rng = np.random.default_rng(seed)
    ids = zipf_ids(rng, cdf, ranks, (rows, FIELDS))
    # An id's planted weight is a function of the id (no vocab-sized array per worker).
    weight = np.sin(ids * 0.61803) * 1.5
    logit = weight.sum(axis=1) / np.sqrt(FIELDS) - 0.3
    clicks = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    return ids, clicks


def global_eval_loss(strategy, eval_ids, eval_clicks, lr) -> float:
    """The loss of the global model (the PS's rows and weights: the same shards and
    variables by name, no cache) on held-out examples."""
    with tf.Graph().as_default():
        with tfpsx.model_scope(strategy):
            ids = tf.compat.v1.placeholder(tf.int64, [None, FIELDS])
            emb = E.DynamicTable("ctr", DIM, initializer=E.normal(stddev=0.01),
                                     optimizer=E.Adagrad(lr))
            w = tf.compat.v1.get_variable("w", [FIELDS * DIM, 1])
            b = tf.compat.v1.get_variable("b", [])
            logit = tf.squeeze(tf.matmul(tf.reshape(emb.lookup(ids), [-1, FIELDS * DIM]), w),
                               1) + b
            loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
                labels=tf.constant(eval_clicks), logits=logit))
        with tf.compat.v1.Session(tfpsx.server_target(), config=tfpsx.session_config()) as s:
            return float(s.run(loss, {ids: eval_ids}))


def traced_step(sess, fetch, feed, path):
    """Runs one step with a full trace and writes it (chrome://tracing, Perfetto)."""
    from tensorflow.python.client import timeline

    meta = tf.compat.v1.RunMetadata()
    opts = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    sess.run(fetch, feed, options=opts, run_metadata=meta)
    with open(path, "w") as f:
        f.write(timeline.Timeline(meta.step_stats).generate_chrome_trace_format())


def main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=1_000_000)
    p.add_argument("--cache_size", type=int, default=0, help="0: no cache")
    p.add_argument("--admit_after", type=int, default=1, help="the cache's cache_admit_after")
    p.add_argument("--local_table", action="store_true",
                   help="each worker trains a table of its own, on itself: no PS rows at all "
                        "(the ceiling of any cache on this machine; no global eval loss)")
    p.add_argument("--flush_steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--trace", default=None,
                   help="folder: each worker writes a Chrome trace of its middle step there")
    args = p.parse_args(argv)

    tfpsx.init()
    if tfpsx.is_server():
        tfpsx.run_server()
        return 0
    tfpsx.init_worker()
    me = tfpsx.worker_index()
    ids_np, clicks_np = make_data(100 + me, args.steps * args.batch, args.vocab)
    eval_ids, eval_clicks = make_data(999, 20_000, args.vocab)
    strategy = tfpsx.DistributedStrategy(a_sync=True)
    with tf.Graph().as_default():
        with tfpsx.model_scope(strategy):
            step = tf.compat.v1.train.get_or_create_global_step()
            ids = tf.compat.v1.placeholder(tf.int64, [None, FIELDS])
            clicks = tf.compat.v1.placeholder(tf.float32, [None])
            where = {"devices": [f"/job:worker/task:{me}"]} if args.local_table else {}
            emb = E.DynamicTable(f"ctr_w{me}" if args.local_table else "ctr", DIM,
                                     initializer=E.normal(stddev=0.01),
                                     optimizer=E.Adagrad(args.lr),
                                     cache_size=args.cache_size or None,
                                     flush_steps=args.flush_steps,
                                     cache_admit_after=args.admit_after, **where)
            w = tf.compat.v1.get_variable("w", [FIELDS * DIM, 1],
                                          initializer=tf.zeros_initializer())
            b = tf.compat.v1.get_variable("b", [], initializer=tf.zeros_initializer())

            def logits(rows):
                return tf.squeeze(tf.matmul(tf.reshape(rows, [-1, FIELDS * DIM]), w), 1) + b

            looked = emb.lookup_unique(ids, step=step)
            loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
                labels=clicks, logits=logits(looked.embeddings)))
            opt = tfpsx.distributed_optimizer(tf.compat.v1.train.AdagradOptimizer(args.lr),
                                              strategy)
            train = tf.group(opt.minimize(loss, global_step=step),
                             emb.minimize(loss, [looked], step=step))
            read = emb.lookup(ids)  # read-only: the cache's rows, or the PS's
        latencies = []
        with tfpsx.MonitoredTrainingSession() as sess:
            feed = {ids: ids_np[:args.batch], clicks: clicks_np[:args.batch]}
            sess.run(train, feed)  # warm-up: first runs register the graph partitions
            start = time.perf_counter()
            for s in range(1, args.steps):
                lo = s * args.batch
                feed = {ids: ids_np[lo:lo + args.batch], clicks: clicks_np[lo:lo + args.batch]}
                if args.trace and s == args.steps // 2:
                    traced_step(sess, train, feed, f"{args.trace}/trace_w{me}.json")
                else:
                    sess.run(train, feed)
            seconds = time.perf_counter() - start
            for s in range(20):
                lo = (s * 7 % args.steps) * args.batch
                t0 = time.perf_counter()
                sess.run(read, {ids: ids_np[lo:lo + args.batch]})
                latencies.append((time.perf_counter() - t0) * 1000)
    tfpsx.barrier_worker()  # every worker's final flush is in
    report = {"worker": me, "examples_per_sec": (args.steps - 1) * args.batch / seconds,
              "lookup_ms": statistics.median(latencies)}
    if me == 0 and not args.local_table:
        report["eval_loss"] = global_eval_loss(strategy, eval_ids, eval_clicks, args.lr)
    tfpsx.barrier_worker()
    tfpsx.metrics.emit("cache_bench", **report)
    tfpsx.stop_worker()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

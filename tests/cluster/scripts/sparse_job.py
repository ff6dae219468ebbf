"""A DynamicTable trained on 2 PS shards; emits one "sparse" metrics record per worker with
the global rows.

  sparse_job.py --mode geo --k_steps K --syncs T [--cache_size N]
      k-step GEO (SGD), syncing in the training thread (deterministic); with a worker
      cache of N rows instead of the whole worker copy.
      The earlier GEO rule unless --geo_rule default (training_job.geo_rule_configs);
      [--geo_hot_count H] [--dense_bias --geo_dense async]: ids seen H+ times in a batch
      train on the PS; a dense bias beside the table, async on the PS.
  sparse_job.py --mode async --syncs T --cache_size N [--flush_steps F]
      async (SGD) for T steps per worker, through a worker cache of N rows.
  sparse_job.py --mode sync --syncs T
      sync (Adagrad) for T global steps; every worker trains on the same batch, so each
      step's update is deterministic whichever worker's gradients it aggregates.
"""
import argparse
import sys

import numpy as np
import tensorflow as tf

import tfpsx
from tfpsx import embedding as E
from training_job import add_geo_rule_flags, geo_rule_configs

VOCAB, BATCH, DIM, LR = 40, 6, 2, 0.1


def batches(worker: int, count: int):
    """Ids worker ``worker`` trains on, in order: a few of the vocab, with repeats."""
    rng = np.random.default_rng(500 + worker)
    for _ in range(count):
        yield rng.integers(0, VOCAB // 2 + 10 * worker, size=BATCH).astype(np.int64)


def targets(ids):
    ids = np.asarray(ids, np.float32)
    return np.stack([ids / 10.0, -ids / 20.0], axis=-1).astype(np.float32)


def main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["geo", "async", "sync"], default="geo")
    p.add_argument("--k_steps", type=int, default=3)
    p.add_argument("--syncs", type=int, default=4)
    p.add_argument("--cache_size", type=int, default=0)
    p.add_argument("--flush_steps", type=int, default=100)
    add_geo_rule_flags(p)
    p.add_argument("--dense_bias", action="store_true",
                   help="a dense bias beside the table (GEO: with --geo_dense)")
    args = p.parse_args(argv)
    tfpsx.init()
    if tfpsx.is_server():
        tfpsx.run_server()
        return 0
    tfpsx.init_worker()
    me = tfpsx.worker_index()
    geo, sgd = args.mode == "geo", args.mode != "sync"
    configs = {"k_steps": args.k_steps, "geo_sync_in_train_thread": True,
               **geo_rule_configs(args)}
    strategy = tfpsx.DistributedStrategy(a_sync=sgd, a_sync_configs=configs if geo else {})
    with tf.Graph().as_default():
        with tfpsx.model_scope(strategy):
            step = tf.compat.v1.train.get_or_create_global_step()
            emb = E.DynamicTable("sparse", DIM, initializer=E.zeros(),
                                     optimizer=E.SGD(LR) if sgd else E.Adagrad(LR),
                                     cache_size=args.cache_size or None,
                                     flush_steps=args.flush_steps)
            ids = tf.compat.v1.placeholder(tf.int64, [None])
            want = tf.compat.v1.placeholder(tf.float32, [None, DIM])
            looked = emb.lookup_unique(ids)
            pred = looked.embeddings
            if args.dense_bias:  # a dense weight beside the table (GEO: async on the PS)
                bias = tf.compat.v1.get_variable("bias", [DIM], tf.float32,
                                                 tf.compat.v1.zeros_initializer())
                pred = pred + bias
            loss = tf.reduce_mean(tf.square(pred - want))
            ops = [emb.minimize(loss, [looked])]
            if args.dense_bias:
                opt = tfpsx.distributed_optimizer(
                    tf.compat.v1.train.GradientDescentOptimizer(LR))
                ops.append(opt.minimize(loss, var_list=[bias]))
            train_op = tf.group(*ops, name="user_group")
            exported_rows = emb.export()  # the PS shards' rows, read at the end
            dense_values = {"bias": bias} if args.dense_bias else {}
        runs = 0
        counters = None
        if sgd:
            steps = args.k_steps * args.syncs if geo else args.syncs
            with tfpsx.MonitoredTrainingSession() as sess:
                print("session ready", flush=True)
                for batch in batches(me, steps):
                    sess.run(train_op, {ids: batch, want: targets(batch)})
            if geo:
                counters = tfpsx.metrics.snapshot()["geo"]
        else:
            batch = next(batches(0, 1))
            with tfpsx.MonitoredTrainingSession(last_step=args.syncs) as sess:
                print("session ready", flush=True)
                while not sess.should_stop():
                    sess.run(train_op, {ids: batch, want: targets(batch)})
                    runs += 1
        tfpsx.barrier_worker()
        exported = {}
        with tf.compat.v1.Session(tfpsx.server_target(), config=tfpsx.session_config()) as s:
            rows, global_step, dense = s.run([exported_rows, step, dense_values])
            exported = {int(k): v.tolist() for k, v in zip(rows["keys"], rows["values"])}
    report = {"worker": me, "rows": exported, "global_step": int(global_step), "runs": runs}
    if args.dense_bias:
        report.update(bias=dense["bias"].tolist(), bias_device=bias.device)
    if counters is not None:
        report.update({name: counters[name] for name in (
            "pushes", "rows_sent", "rows_received", "bytes_sent", "bytes_received",
            "trained_rows", "hot_rows", "async_table_bytes", "hot_table_bytes",
            "table_bytes")})
    tfpsx.metrics.emit("sparse", **report)
    tfpsx.stop_worker()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

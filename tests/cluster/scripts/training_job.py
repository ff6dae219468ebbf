"""A linear regression trained between-graph with tfpsx.model_scope /
distributed_optimizer / MonitoredTrainingSession; emits one "training" metrics record per worker.

  training_job.py --mode async|geo [--k_steps K] [--deterministic] [--syncs T]
                  [--steps S] [--checkpoint_dir D] [--save_steps N] [--incremental M]
                  [--partitioned]
                  [--table] [--export DIR] [--abort_once_at STEP]

--export DIR: after training (every worker's pushes in) the chief exports the inference
(x -> pred) with tfpsx.export_serving to DIR/model/1, from a session on its server, with
DIR/feed.npz and DIR/predictions.npy (that session's predictions) beside it.

--abort_once_at STEP: the chief's session run fails once with the AbortedError TF raises
when a connection to a server breaks, at the first run that ends at global step >= STEP
(TF's MonitoredSession then creates its session again; the "aborted" metrics record says
at which step).
"""
import argparse
import os
import sys
import time

import numpy as np
import tensorflow as tf

import tfpsx

# GEO's rule, key by key: "earlier" (the default here: the numpy references of these
# tests model it) and "many" (the rule for many workers) name its keys; "default"
# names none (tfpsx chooses by the worker count). A key's own flag overrides either.
def add_geo_rule_flags(p):
    p.add_argument("--geo_rule", choices=["earlier", "many", "default"], default="earlier")
    p.add_argument("--geo_table_rule", default=None)
    p.add_argument("--geo_dense", default=None)
    p.add_argument("--geo_hot_count", type=int, default=None)
    p.add_argument("--geo_hot_per_round", type=int, default=None)
    p.add_argument("--geo_table_choice", default=None)


def geo_rule_configs(args) -> dict:
    from tfpsx.modes.geo import GEO_EARLIER, GEO_FOR_MANY
    configs = dict({"earlier": GEO_EARLIER, "many": GEO_FOR_MANY}.get(args.geo_rule, {}))
    configs.update({k: getattr(args, k) for k in GEO_EARLIER if getattr(args, k) is not None})
    return configs


DIM, BATCH, LR = 6, 16, 0.05
W_TRUE = np.linspace(-1.0, 1.0, DIM).astype(np.float32)
WIDE_SCALE = 0.1


def wide_ids(x):
    """With a tiered table (--table_ram_bytes): an id per feature value (to 1/1000), per
    feature: ~30k ids over a job, the "wide" table's rows."""
    return (tf.cast(tf.floor(x * 1000.0), tf.int64)
            + tf.range(DIM, dtype=tf.int64) * 10 ** 7)


def batches(worker: int, count: int):
    """The batches worker ``worker`` trains on, in order (tests rebuild them)."""
    rng = np.random.default_rng(1000 + worker)
    for _ in range(count):
        x = rng.normal(size=(BATCH, DIM)).astype(np.float32)
        y = (x @ W_TRUE + 0.3).astype(np.float32)
        yield x, y


class AbortOnceHook(tf.compat.v1.train.SessionRunHook):
    """Fails one run as a broken connection to a server does (see --abort_once_at)."""

    def __init__(self, step: int):
        self._at, self._done = step, False

    def begin(self):
        self._step = tf.compat.v1.train.get_global_step()

    def before_run(self, run_context):
        return None if self._done else tf.compat.v1.train.SessionRunArgs(self._step)

    def after_run(self, run_context, run_values):
        if not self._done and run_values.results >= self._at:
            self._done = True
            tfpsx.metrics.emit("aborted", global_step=int(run_values.results))
            raise tf.errors.AbortedError(None, None, "the test's broken connection to a server")


def main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="async")
    p.add_argument("--k_steps", type=lambda v: v if v == "auto" else int(v), default=0)
    add_geo_rule_flags(p)
    p.add_argument("--max_staleness", type=int, default=2)
    p.add_argument("--replicas", type=int, default=None, help="sync: replicas_to_aggregate")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--syncs", type=int, default=4, help="GEO deterministic: k-step rounds")
    p.add_argument("--steps", type=int, default=300, help="last global step (StopAtStepHook)")
    p.add_argument("--checkpoint_dir", default=None)
    p.add_argument("--save_steps", type=int, default=None)
    p.add_argument("--incremental", type=int, default=None,
                   help="incremental checkpoints: a full table export every N saves")
    p.add_argument("--step_delay", type=float, default=0.0)
    p.add_argument("--slow_worker", type=int, default=None,
                   help="only this worker sleeps --step_delay after each step")
    p.add_argument("--partitioned", action="store_true")
    p.add_argument("--table", action="store_true",
                   help="add a per-id bias from a DynamicTable (id: the sign of x[0])")
    p.add_argument("--table_ram_bytes", type=int, default=0,
                   help="with --table: the tables on the PS's disk beyond this RAM, and a "
                        "wide table of ~30k ids beside the bias table (most rows on disk)")
    p.add_argument("--table_dir", default="", help="with --table_ram_bytes: its folder")
    p.add_argument("--export", default=None)
    p.add_argument("--abort_once_at", type=int, default=None)
    p.add_argument("--no_final_barrier", action="store_true",
                   help="a worker may have been killed: do not wait for everyone at the end")
    args = p.parse_args(argv)

    tfpsx.init()
    if tfpsx.is_server():
        tfpsx.run_server()
        return 0
    tfpsx.init_worker()
    me = tfpsx.worker_index()
    configs = {"k_steps": args.k_steps, **(geo_rule_configs(args) if args.k_steps else {})}
    if args.deterministic:
        configs["geo_sync_in_train_thread"] = True
    if args.mode == "staleness":
        configs = {"max_staleness": args.max_staleness}
    if args.mode == "sync":
        configs = {} if args.replicas is None else {"replicas_to_aggregate": args.replicas}
    strategy = tfpsx.DistributedStrategy(a_sync=args.mode != "sync", a_sync_configs=configs)
    with tf.Graph().as_default():
        with tfpsx.model_scope(strategy):
            global_step = tf.compat.v1.train.get_or_create_global_step()
            x = tf.compat.v1.placeholder(tf.float32, [None, DIM])
            y = tf.compat.v1.placeholder(tf.float32, [None])
            partitioner = (tfpsx.variable_partitioner(min_slice_bytes=8)
                           if args.partitioned else None)
            w = tf.compat.v1.get_variable("w", [DIM, 1], initializer=tf.zeros_initializer(),
                                          partitioner=partitioner)
            b = tf.compat.v1.get_variable("b", [], initializer=tf.zeros_initializer())
            w_value = tf.convert_to_tensor(w) if args.partitioned else w
            pred = tf.squeeze(tf.matmul(x, w_value), 1) + b
            tier = (tfpsx.embedding.TieredBackend(args.table_dir, args.table_ram_bytes)
                    if args.table and args.table_ram_bytes else None)
            if args.table:
                emb = tfpsx.embedding.DynamicTable(
                    "bias", 1, initializer=tfpsx.embedding.zeros(),
                    optimizer=tfpsx.embedding.SGD(LR), backend=tier)
                looked = emb.lookup_unique(tf.cast(x[:, 0] > 0, tf.int64))
                pred += tf.squeeze(looked.embeddings, 1)
            if tier:  # a wide table of ~30k ids: more rows than its shard's RAM, most on disk
                wide = tfpsx.embedding.DynamicTable(
                    "wide", 8, initializer=tfpsx.embedding.zeros(),
                    optimizer=tfpsx.embedding.Adagrad(LR), backend=tier)
                looked_wide = wide.lookup_unique(wide_ids(x))
                pred += WIDE_SCALE * tf.reduce_sum(
                    tf.reshape(looked_wide.embeddings, [-1, DIM * 8]), 1)
            loss = tf.reduce_mean(tf.square(pred - y))
            opt = tfpsx.distributed_optimizer(tf.compat.v1.train.GradientDescentOptimizer(LR),
                                              strategy)
            train_op = opt.minimize(loss, global_step=global_step)
            if args.table:
                train_op = tf.group(train_op, emb.minimize(loss, [looked]))
            if tier:
                train_op = tf.group(train_op, wide.minimize(loss, [looked_wide]))
        placement = {v.op.name: v.device for v in tf.compat.v1.global_variables()
                     + tf.compat.v1.local_variables()}
        eval_x, eval_y = next(batches(99, 1))
        local_steps = 0
        fixed = args.mode == "geo" and args.deterministic
        hooks = ([AbortOnceHook(args.abort_once_at)]
                 if args.abort_once_at is not None and me == 0 else [])
        with tfpsx.MonitoredTrainingSession(
                hooks=hooks,
                checkpoint_dir=args.checkpoint_dir, save_checkpoint_steps=args.save_steps,
                incremental_checkpoints=args.incremental,
                last_step=None if fixed else args.steps) as sess:
            ready = time.time()
            print(f"session ready at {ready:.3f}", flush=True)
            start_step = sess.run(global_step)
            count = args.k_steps * args.syncs if fixed else 10 ** 9
            for bx, by in batches(me, count):
                if sess.should_stop():
                    break
                sess.run(train_op, {x: bx, y: by})
                local_steps += 1
                if args.step_delay and args.slow_worker in (None, me):
                    time.sleep(args.step_delay)
        report = {"worker": me, "local_steps": local_steps, "start_step": int(start_step),
                  "ready": ready, "placement": placement}
        if hasattr(opt, "waits"):  # StalenessOptimizer
            report["staleness_waits"] = opt.waits
        if hasattr(opt, "counters"):
            report["pushes"] = opt.counters.pushes
            report["rows_sent"] = opt.counters.rows_sent
        if not args.no_final_barrier:
            tfpsx.barrier_worker()  # every push is in before anyone reads the global state
        with tf.compat.v1.Session(tfpsx.server_target(), config=tfpsx.session_config()) as s:
            globals_ = {v.op.name: v for v in tf.compat.v1.global_variables()}
            w_global = (tf.concat([globals_[n] for n in sorted(globals_) if n.startswith("w/")], 0)
                        if args.partitioned else globals_["w"])
            g_w, g_b, g_step = s.run([w_global, globals_["b"], global_step])
            eval_pred = tf.squeeze(tf.matmul(eval_x, w_global), 1) + globals_["b"]
            if args.table:  # the model's per-id bias, from the table's PS shards
                eval_ids = tf.constant((eval_x[:, 0] > 0).astype(np.int64))
                eval_pred += tf.squeeze(emb.lookup(eval_ids), 1)
            if tier:
                eval_pred += WIDE_SCALE * tf.reduce_sum(tf.reshape(
                    wide.lookup(wide_ids(tf.constant(eval_x))), [-1, DIM * 8]), 1)
            eval_loss = s.run(tf.reduce_mean(tf.square(eval_pred - eval_y)))
            if args.export and me == 0:
                os.makedirs(args.export, exist_ok=True)
                np.save(os.path.join(args.export, "predictions.npy"), s.run(pred, {x: eval_x}))
                np.savez(os.path.join(args.export, "feed.npz"), x=eval_x)
                tfpsx.export_serving(s, os.path.join(args.export, "model"), inputs={"x": x},
                                     outputs={"pred": pred})
        report.update({"global_w": g_w.ravel().tolist(), "global_b": float(g_b),
                       "global_step": int(g_step), "eval_loss": float(eval_loss)})
    tfpsx.metrics.emit("training", **report)
    tfpsx.stop_worker()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

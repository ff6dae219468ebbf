"""Graph mode's visit counter (tests/cluster/test_data_plane.py): a TF1 model fed by
tfpsx.data.splits through tfpsx.data.next_batch, trained in a MonitoredTrainingSession,
beside a table "visits" (dim 1, SGD at learning rate 1, rows from 0) whose row of an
example moves by exactly +1 each time a step that holds it is in the model. The chief
writes the final rows to <out>/visits.npz (ids, counts) once every worker is done.

  graph_visits_job.py --out DIR [--mode async|geo|sync|hybrid|collective] [--epochs E]
      [--batch B]
      [--checkpoint DIR --save_steps S] [--die_after W:S] [--abort_after W:S]
      [--step_delay SEC]
      (the examples: DIR/data/part-*.txt, as visits_job.write_files writes them)
"""
import argparse
import os
import signal
import sys
import time

import numpy as np
import tensorflow as tf

import tfpsx
from tfpsx import embedding as E
from tfpsx import graph_state
from visits_job import FEATURES, parse


def differs_from_ps(copies) -> int:
    """GEO, once every worker's last round ran: this worker pulls once more, and counts
    the rows of its copies that differ from the PS's. None should: every row a worker
    trained was pushed, and every row another pushed was marked for this worker's pull
    (a row the copy lacks counts as its initial row, zeros)."""
    from tfpsx.embedding import row_copy
    pulls = [row_copy.table_pull(t)[0] for t in copies]
    rows = [(t.local.export(), t.global_.export()) for t in copies]
    with tf.compat.v1.Session(tfpsx.server_target(), config=tfpsx.session_config()) as s:
        s.run(pulls)
        differ = 0
        for local, ps in s.run(rows):
            mine = dict(zip(local["keys"].tolist(), local["values"]))
            differ += int(sum(np.any(row != mine.get(key, 0.0))
                              for key, row in zip(ps["keys"].tolist(), ps["values"])))
    return differ


class AbortOnceHook(tf.compat.v1.train.SessionRunHook):
    """Fails this worker's run once, after ``steps`` local training runs, with the
    AbortedError of a broken connection to a server: TF's MonitoredSession then creates
    the session again (its local variables, GEO's copies among them, initialized anew)."""

    def __init__(self, steps: int):
        self._left = steps

    def after_run(self, run_context, run_values):
        self._left -= 1
        if self._left == 0:
            tfpsx.metrics.emit("aborted", worker=tfpsx.worker_index())
            raise tf.errors.AbortedError(None, None, "the test's broken connection to a server")


def main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=["async", "geo", "sync", "hybrid", "collective"],
                   default="async")
    p.add_argument("--examples", type=int, default=6000, help="(collective: the counter)")
    p.add_argument("--k_steps", type=int, default=5)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch", type=int, default=50)
    p.add_argument("--chief_batch", type=int, default=None,
                   help="the chief's batch size (sync: its data ends first with a larger)")
    p.add_argument("--split_bytes", type=int, default=20000)
    p.add_argument("--exact", action="store_true", help="splits(exact_saves=True)")
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--save_steps", type=int, default=20)
    p.add_argument("--die_after", default=None, help="W:S")
    p.add_argument("--abort_after", default=None,
                   help="W:S: worker W's run fails once (AbortedError) after S local steps")
    p.add_argument("--step_delay", type=float, default=0.0)
    args = p.parse_args(argv)

    collective = args.mode == "collective"
    tfpsx.init(is_collective=collective)
    if tfpsx.is_server():
        tfpsx.run_server()
        return 0
    tfpsx.init_worker()
    me = tfpsx.worker_index()
    # (GEO: the rule that sums the workers' +1s; sync: the sum of a step's gradients)
    strategy = tfpsx.DistributedStrategy(
        a_sync=args.mode != "sync",
        a_sync_configs={"geo": {"k_steps": args.k_steps, "geo_table_rule": "shared_slots"},
                        "sync": {"sync_reduction": "sum"}}.get(args.mode, {}),
        # hybrid: w all-reduced among the workers (each holds it), the table async
        dense="allreduce" if args.mode == "hybrid" else "ps", collective=collective)
    files = os.path.join(args.out, "data", "part-*.txt")
    local_steps = 0
    with tf.Graph().as_default():
        batch = args.chief_batch if me == 0 and args.chief_batch else args.batch
        data = tfpsx.data.splits(files, parse, batch, split_bytes=args.split_bytes,
                                 seed=11, epochs=args.epochs,
                                 exact_saves=args.exact).repeat(args.epochs)
        features, label = tfpsx.data.next_batch(data)
        with tfpsx.model_scope(strategy):
            step = tf.compat.v1.train.get_or_create_global_step()
            w = tf.compat.v1.get_variable("w", [FEATURES, 1],
                                          initializer=tf.zeros_initializer())
            logits = tf.matmul(features["x"], w)
            loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
                labels=label, logits=logits))
            opt = tfpsx.distributed_optimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                              strategy)
        if collective:  # no servers, no tables: the counter is a dense weight of each rank
            with tfpsx.model_scope(strategy):
                counts = tf.compat.v1.get_variable("counts", [args.examples, 1],
                                                   initializer=tf.zeros_initializer())
                rows = tf.reduce_sum(tf.gather(counts, tf.reshape(features["id"], [-1])))
                # the mean over the world size of the ranks' gradients (a rank whose data
                # ended adds zeros) at learning rate 0.1: each visit +1
                train = opt.minimize(loss - 10.0 * tfpsx.worker_num() * rows,
                                     global_step=step)
        else:
            with tfpsx.model_scope(strategy):
                visits = E.DynamicTable("visits", 1, optimizer=E.SGD(1.0), initializer=E.zeros())
                looked = visits.lookup_unique(tf.reshape(features["id"], [-1]), step=step)
                train = tf.group(opt.minimize(loss, global_step=step),
                                 # -row: each trained visit moves its row by +1
                                 visits.minimize(-tf.reduce_sum(looked.unique_rows *
                                                                tf.cast(tf.reshape(
                                                                    tf.math.bincount(
                                                                        tf.cast(looked.indices,
                                                                                tf.int32)),
                                                                    [-1, 1]), tf.float32)),
                                                 [looked], step=step))
        # GEO: this worker's table copies (see differs_from_ps)
        copies = list(graph_state.peek().mode.tables) if args.mode == "geo" else []
        marker = os.path.join(args.out, f"died.{me}")
        dies = args.die_after and int(args.die_after.split(":")[0]) == me
        aborts = args.abort_after and int(args.abort_after.split(":")[0]) == me
        hooks = [AbortOnceHook(int(args.abort_after.split(":")[1]))] if aborts else []
        with tfpsx.MonitoredTrainingSession(checkpoint_dir=args.checkpoint, hooks=hooks,
                                            save_checkpoint_steps=args.save_steps,
                                            incremental_checkpoints=2 if args.checkpoint
                                            else None) as sess:
            while not sess.should_stop():
                sess.run(train)
                local_steps += 1
                if dies and local_steps >= int(args.die_after.split(":")[1]) and \
                        not os.path.exists(marker):
                    open(marker, "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)
                if args.step_delay:
                    time.sleep(args.step_delay)
        if not collective:  # (a collective job's ranks end their sessions together)
            tfpsx.barrier_worker()
        if copies:
            tfpsx.metrics.emit("geo_copy", worker=me, differs=differs_from_ps(copies))
            tfpsx.barrier_worker()  # (before the chief reads the PS's rows)
        if args.mode in ("hybrid", "collective"):  # each worker's own copy of w (and counts)
            with tf.compat.v1.Session(tfpsx.server_target(),
                                      config=tfpsx.session_config()) as s:
                np.savez(os.path.join(args.out, f"dense.{me}.npz"),
                         *s.run([w] + ([counts] if collective else [])))
                if collective and me == 0:
                    np.savez(os.path.join(args.out, "visits.npz"),
                             ids=np.arange(args.examples),
                             counts=np.round(s.run(counts)[:, 0]))
        if me == 0 and not collective:
            with tf.compat.v1.Session(tfpsx.server_target(),
                                      config=tfpsx.session_config()) as s:
                rows = s.run(visits.export())
            np.savez(os.path.join(args.out, "visits.npz"), ids=rows["keys"],
                     counts=rows["values"][:, 0])
    tfpsx.metrics.emit("visits", worker=me, batches=local_steps,
                       input=tfpsx.data.input_stats())
    tfpsx.stop_worker()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

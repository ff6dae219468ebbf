"""What graph mode's GEO step costs for a table that trains async (geo_table_choice="auto",
its flag on), against async's step, in one process (the tables on this CPU, no cluster):
the nodes the executor runs for one table's lookup and apply, and their CPU a step.
GEO's step serves both of the table's states (tfpsx.modes.geo.HotRows: graph mode
cannot trace its step again when the choice changes): split and stitch ops that forward
the keys and rows while the flag is on, and the copy's path in TF1 conds, dead then.

  python benchmarks/geo_step_ops.py [--batch 512] [--dim 64] [--steps 2000] [--rounds 3]
"""

import argparse
import statistics
import time

import tensorflow as tf

from tfpsx import embedding as E
from tfpsx.modes import geo


class _Mode:
    """GEO's mode as a table's updater sees it (tfpsx.modes.geo.GeoState): a non-chief
    worker of 8 under the rule for many workers (geo_table_choice="auto", the hot count
    4, contention at 10 a round, K=2), this process's device."""
    worker_index, worker_num, worker_device = 1, 8, "/job:localhost/replica:0/task:0"
    wire_dtype, slot_wire_dtype, in_train_thread, share_slots = None, tf.bfloat16, False, True
    hot_count, hot_per_round, table_choice, retraces, named = 4, 10, True, False, frozenset()

    def __init__(self):
        self.tables, self.updaters = [], []

    def local_train_op(self, op):
        pass

    def round_steps(self):
        return 2


def build(kind: str, batch: int, dim: int):
    """(graph, the step's op, its initializer): one table's lookup of ``batch`` ids, a
    loss, and the apply of its gradients, as async's (the table's own) or GEO's (the
    table's updater, as a worker's step builds it: HotRows with the table's flag on, it
    trains async, and the count of the rows the step held)."""
    graph = tf.Graph()
    with graph.as_default():
        table = E.DynamicTable("ps", dim, initializer=E.normal(stddev=0.1),
                               optimizer=E.Adagrad(0.5), seed=3)
        ids = tf.random.uniform([batch], 0, 20 * batch, dtype=tf.int64)
        if kind == "async":
            source = table
        else:
            updater = geo.GeoTableUpdater(_Mode())
            updater.attach(table)
            source = updater.lookup_source(table)
            assert isinstance(source, geo.HotRows)
        looked = source.lookup_unique(ids, train=True, step=None)
        loss = tf.reduce_sum(tf.square(looked.embeddings))
        grads = tf.gradients(loss, looked.unique_rows)[0]
        op = (table.apply(looked.unique_keys, grads, None) if kind == "async"
              else updater.apply_gradients(table, looked.unique_keys, grads, None, looked.hot))
        init = [tf.compat.v1.global_variables_initializer(),
                tf.compat.v1.local_variables_initializer()]
    return graph, op, init


def measure(kind: str, args) -> dict:
    graph, op, init = build(kind, args.batch, args.dim)
    with tf.compat.v1.Session(graph=graph) as session:
        session.run(init)
        for _ in range(200):  # warm-up: the table's rows exist
            session.run(op)
        traced = tf.compat.v1.RunMetadata()
        session.run(op, options=tf.compat.v1.RunOptions(
            trace_level=tf.compat.v1.RunOptions.FULL_TRACE), run_metadata=traced)
        nodes = sum(len(d.node_stats) for d in traced.step_stats.dev_stats)
        cpu = []
        for _ in range(args.rounds):
            start = time.process_time()
            for _ in range(args.steps):
                session.run(op)
            cpu.append((time.process_time() - start) / args.steps * 1e3)
    return {"nodes": nodes, "cpu_ms": statistics.median(cpu)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=512, help="ids a step (word2vec's pairs)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    tf.compat.v1.disable_eager_execution()
    got = {kind: measure(kind, args) for kind in ("async", "geo")}
    print(f"one table, {args.batch} ids a step, dim {args.dim}, medians of {args.rounds} x "
          f"{args.steps} steps")
    print("| step | nodes run | CPU a step (ms) |\n| --- | ---: | ---: |")
    for kind, name in (("async", "async"), ("geo", "GEO, the table trains async")):
        print(f"| {name} | {got[kind]['nodes']} | {got[kind]['cpu_ms']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

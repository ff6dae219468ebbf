"""Incremental vs full table checkpoints, side by side in one process (graph mode).

One table of ``--rows`` keys (10M by default), dim ``--dim`` (16) with Adagrad (one slot
vector per row), on 4 local shards. Between saves a training step updates ``--changed``
of the rows (1%: lookups and Adagrad updates of random existing keys) and inserts as many
new keys again (a growing table). Timed, each ``--rounds`` times on the same data:

- ``tf.compat.v1.train.Saver`` (the table's full TableSaveable: what a checkpoint costs
  without tfpsx.checkpoint);
- IncrementalSaver's full save (its first save);
- IncrementalSaver's delta save (every save after it);
- restore of the chain (full + every delta) into a fresh graph, checked bit-exact against
  a full export of the moment of the last save.

Target (issue 12): a delta save at least 20x faster than a full save at 1% changed.

  python benchmarks/incremental_checkpoint.py [--rows 10000000] [--dim 16] [--rounds 3]
"""

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import tensorflow as tf

from tfpsx import embedding as E
from tfpsx.checkpoint import IncrementalSaver

NAME = "bench_incremental"


def build(dim: int, shards: int = 4):
    step = tf.compat.v1.train.get_or_create_global_step()
    table = E.DynamicTable(NAME, dim, optimizer=E.Adagrad(0.05),
                               initializer=E.normal(stddev=0.01), devices=[None] * shards)
    ids = tf.compat.v1.placeholder(tf.int64, [None])
    looked = table.lookup_unique(ids, step=step)
    train = tf.group(table.apply_gradients(looked, 0.01 * tf.ones_like(looked.unique_rows),
                                           step=step), step.assign_add(1))
    values = tf.compat.v1.placeholder(tf.float32, [None, dim])
    fill = table.insert(ids, values, step=step)
    return table, ids, train, values, fill


def sorted_rows(sess, table):
    rows = sess.run(table.export())
    order = np.argsort(rows["keys"], kind="stable")
    return {k: v[order] for k, v in rows.items()}


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--changed", type=float, default=0.01, help="fraction of rows per save")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    work = tempfile.mkdtemp(prefix="tfpsx-bench-ckpt-")
    result = {"rows": args.rows, "dim": args.dim, "changed": args.changed}
    try:
        with tf.Graph().as_default():
            table, ids, train, values, fill = build(args.dim)
            plain = tf.compat.v1.train.Saver(var_list=[table.saveable()])
            inc = IncrementalSaver(full_every=10 ** 6, max_to_keep=100)
            always_full = IncrementalSaver(full_every=1, max_to_keep=1)
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                keys = rng.permutation(np.int64(args.rows) * 4)[:args.rows].astype(np.int64)
                for chunk in np.array_split(keys, max(1, args.rows // 1_000_000)):
                    sess.run(fill, {ids: chunk, values: rng.normal(
                        0, 0.01, (len(chunk), args.dim)).astype(np.float32)})
                changed = int(args.rows * args.changed)
                fresh = iter(np.arange(np.int64(args.rows) * 4, np.int64(args.rows) * 5))

                def one_step_of_changes():
                    half = changed // 2  # updates of existing rows and new rows
                    batch = np.concatenate([rng.choice(keys, half, replace=False),
                                            np.fromiter(fresh, np.int64, changed - half)])
                    for part in np.array_split(batch, max(1, len(batch) // 65536)):
                        sess.run(train, {ids: part})

                step, last = [0], [None]

                def save(saver, name):
                    step[0] += 1
                    path = saver.save(sess, f"{work}/{name}", global_step=step[0],
                                      write_meta_graph=False)
                    return path, saver.last_save

                times = {"tf_saver_full": [], "incremental_full": [], "incremental_delta": []}
                for _ in range(args.rounds):  # full saves, as the table grows
                    one_step_of_changes()
                    times["incremental_full"].append(timed(lambda: save(always_full, "full")))
                # A chain to restore through: its full save, then a delta per round.
                one_step_of_changes()
                save(inc, "inc")
                assert inc.last_save["kind"] == "full"
                for r in range(args.rounds):
                    one_step_of_changes()
                    times["tf_saver_full"].append(
                        timed(lambda: plain.save(sess, f"{work}/plain", global_step=r,
                                                 write_meta_graph=False)))
                    start = time.perf_counter()
                    last[0], info = save(inc, "inc")
                    times["incremental_delta"].append(time.perf_counter() - start)
                    assert info["kind"] == "delta", info
                    delta_rows = info["rows"]
                want = sorted_rows(sess, table)
                size = len(want["keys"])
        with tf.Graph().as_default():
            table, *_ = build(args.dim, shards=4)
            restorer = IncrementalSaver(full_every=10 ** 6)
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                restore_s = timed(lambda: restorer.restore(sess, last[0]))
                got = sorted_rows(sess, table)
        exact = all(np.array_equal(want[k], got[k]) for k in want)
        med = {k: statistics.median(v) for k, v in times.items()}
        result.update({
            "table_rows_at_end": size, "delta_rows": delta_rows,
            "seconds": {k: [round(x, 3) for x in v] for k, v in times.items()},
            "median_s": {k: round(v, 3) for k, v in med.items()},
            "delta_speedup_vs_incremental_full": round(med["incremental_full"] /
                                                      med["incremental_delta"], 1),
            "delta_speedup_vs_tf_saver": round(med["tf_saver_full"] /
                                              med["incremental_delta"], 1),
            "restore_chain_s": round(restore_s, 3), "restore_parts": 1 + args.rounds,
            "restore_bit_exact": exact})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"table: {result['table_rows_at_end']:,} rows x dim {args.dim} (+1 Adagrad slot); "
          f"{args.changed:.0%} changed per save ({result['delta_rows']:,} rows in a delta)")
    print(f"{'save':<34}{'median s':>10}   all")
    for k, label in (("tf_saver_full", "tf.compat.v1.train.Saver (full)"),
                     ("incremental_full", "IncrementalSaver full"),
                     ("incremental_delta", "IncrementalSaver delta")):
        print(f"{label:<34}{result['median_s'][k]:>10.3f}   {result['seconds'][k]}")
    print(f"delta vs full: {result['delta_speedup_vs_incremental_full']}x faster "
          f"(vs TF's Saver: {result['delta_speedup_vs_tf_saver']}x); target >= 20x")
    print(f"restore of full + {args.rounds} deltas: {result['restore_chain_s']:.2f} s, "
          f"bit-exact: {result['restore_bit_exact']}")
    print(json.dumps(result))
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""What a GEO round can save on the Criteo job, whatever its speed: the table rows each
mode moves, counted by replaying the job's id stream (issue 40's "GEO reaches the target
sooner at 4 workers").

A GEO round saves the traffic of a row only when a worker's K local steps meet it more
than once: async reads the row and sends its gradient at every step that holds it, a
round pushes it once. The pull then brings every row the other workers pushed. This
replays the ids of the Criteo-format files (``examples/criteo/make_data.py``; worker w of
N takes every N-th line, batches of ``--batch``) through GEO's rule for many workers as
the product decides it: ids seen ``geo_hot_count`` times in a batch and ids too contended
for a round (the product's own ``tfpsx.modes.geo.contention.Contention``, run on each
worker's batches of the replay's own ids, where the product hashes the strings) train
on the PS every step, as in async; the rest train the copy. No shuffle (the job shuffles within
a 20,000-line buffer; the lines are drawn independently, so that changes little). Per worker and
step it counts, in rows (a table row one way; GEO's rule sends a row with its Adagrad
slots, so twice the floats):

- async: the rows of the step, read and their gradients sent (2 each);
- GEO, the rule: the hot rows as async, plus per round the copy's rows pushed (the union
  over its K steps, 2 widths) and the rows pulled (every row another worker pushed, and
  every hot row any worker trained on the PS, 2 widths);
- GEO, the earlier rule (rows averaged, no slots, no hot rows): every row of the copy,
  pushed once a round, and the others' pushes pulled (1 width each).

"reuse" is a copy row's steps in a round per row pushed: what a round saves on the push.

    python benchmarks/geo_round_traffic.py --data 'data/bench-criteo-1000000/train-*' \\
        --workers 2,4,8 --k 10,100,auto
"""

from __future__ import annotations

import argparse
import glob
import sys
import time
from typing import Dict, List

import numpy as np

import tensorflow as tf

from tfpsx.modes.geo import auto_hot_per_round, auto_k_steps
from tfpsx.modes.geo.contention import DEFAULT_WIDTH, Contention

CAT_FROM, CAT_FIELDS = 14, 26  # a line: label, 13 integers, 26 categorical values


def read_ids(patterns: str, limit: int) -> np.ndarray:
    """The field-aware categorical ids of the files' lines, [lines, 26] int64 (one id per
    (field, value), as the model's "C<f>=<value>" strings; the empty value is an id)."""
    files = sorted(f for p in patterns.split(",") for f in glob.glob(p))
    if not files:
        sys.exit(f"--data: {patterns!r} matches no file; make_data.py writes them")
    vocab: List[Dict[str, int]] = [{} for _ in range(CAT_FIELDS)]
    rows = []
    for path in files:
        with open(path) as f:
            for line in f:
                cols = line.rstrip("\n").split("\t")[CAT_FROM:]
                rows.append([vocab[i].setdefault(v, len(vocab[i])) for i, v in enumerate(cols)])
                if len(rows) == limit:
                    break
        if len(rows) == limit:
            break
    ids = np.asarray(rows, np.int64)
    offset = np.cumsum([0] + [len(v) for v in vocab[:-1]])
    return ids + offset


class Worker:
    """One worker's hot rows: geo_hot_count, and the product's own contention estimate
    (:class:`tfpsx.modes.geo.contention.Contention`, run eagerly on this worker's batches,
    its variables worker-local as in a job)."""

    _made = 0

    def __init__(self, n: int, k: int, bound: int, hot_count: int, width: int):
        Worker._made += 1
        self.hot_count = hot_count
        self.contention = Contention(f"replay{Worker._made}", "/cpu:0", n, lambda: k, bound,
                                     width)

    def split(self, batch: np.ndarray):
        """(copy rows, hot rows) of a batch's ids."""
        u, count = np.unique(batch, return_counts=True)
        hot = count >= self.hot_count
        contended = self.contention.hot(tf.constant(u, tf.int64))  # None: K x N in bound
        if contended is not None:
            hot |= contended.numpy()
        return u[~hot], u[hot]


def replay(ids: np.ndarray, n: int, k: int, batch: int, bound: int, hot_count: int,
           width: int) -> Dict[str, float]:
    """Rows a step and worker, averaged over the workers and the epoch's whole rounds."""
    steps = len(ids) // n // batch
    rounds = steps // k
    parts = [ids[w::n][: steps * batch].reshape(steps, batch * CAT_FIELDS) for w in range(n)]
    workers = [Worker(n, k, bound, hot_count, width) for _ in range(n)]
    total = dict(copy_steps=0, hot_steps=0, pushed=0, pulled=0, hot_pulled=0,
                 earlier_pushed=0, earlier_pulled=0)
    for r in range(rounds):
        pushed, hot, seen = [], [], []  # per worker: its round's copy, hot and all rows
        for w, worker in enumerate(workers):
            copy_rows, hot_rows = [], []
            for s in range(r * k, (r + 1) * k):
                c, h = worker.split(parts[w][s])
                copy_rows.append(c)
                hot_rows.append(h)
                total["copy_steps"] += len(c)
                total["hot_steps"] += len(h)
            pushed.append(np.unique(np.concatenate(copy_rows)))
            hot.append(np.unique(np.concatenate(hot_rows)))
            seen.append(np.union1d(pushed[-1], hot[-1]))
        hot_all = np.unique(np.concatenate(hot))
        for w in range(n):
            others = np.unique(np.concatenate([pushed[v] for v in range(n) if v != w]))
            total["pushed"] += len(pushed[w])
            total["pulled"] += len(np.union1d(others, hot_all))
            total["hot_pulled"] += len(np.setdiff1d(hot_all, others))
            # the earlier rule: no hot rows, every row of the round pushed and pulled
            total["earlier_pushed"] += len(seen[w])
            total["earlier_pulled"] += len(np.unique(np.concatenate(
                [seen[v] for v in range(n) if v != w])))
    per = float(n * rounds * k)
    out = {key: value / per for key, value in total.items()}
    out["step_rows"] = out["copy_steps"] + out["hot_steps"]
    out["async"] = 2 * out["step_rows"]
    out["rule"] = 2 * out["hot_steps"] + 2 * out["pushed"] + 2 * out["pulled"]
    out["earlier"] = out["earlier_pushed"] + out["earlier_pulled"]
    out["reuse"] = out["copy_steps"] / out["pushed"] if out["pushed"] else float("nan")
    out["steps"], out["rounds"] = steps, rounds
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="data/bench-criteo-1000000/train-*",
                   help="Criteo-format files (globs, comma-separated)")
    p.add_argument("--lines", type=int, default=1_000_000, help="lines read, at most")
    p.add_argument("--workers", default="2,4,8")
    p.add_argument("--k", default="10,100,auto", help="k_steps values; 'auto': the product's")
    p.add_argument("--batch", type=int, default=512, help="examples a step and worker")
    p.add_argument("--hot_count", type=int, default=4, help="geo_hot_count")
    p.add_argument("--deterministic", action="store_true",
                   help="the bounds of deterministic rounds (default: background ones)")
    p.add_argument("--width", type=int, default=DEFAULT_WIDTH, help="the estimate's buckets")
    args = p.parse_args(argv)
    start = time.time()
    ids = read_ids(args.data, args.lines)
    print(f"{len(ids):,} lines, {len(np.unique(ids)):,} ids ({time.time() - start:.0f} s)")
    bound = auto_hot_per_round(args.deterministic)
    print(f"rows a step and worker (a table row one way); contention bound {bound}")
    print("| N | K | steps | rows of a step | on the PS (hot) | copy reuse | pushed | pulled "
          "(hot among them) | async | GEO, the rule | / async | GEO, earlier rule | / async |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
          "| ---: |")
    for n in (int(x) for x in args.workers.split(",")):
        steps = len(ids) // n // args.batch
        for k_arg in args.k.split(","):
            k = (auto_k_steps(steps, n, deterministic=args.deterministic)
                 if k_arg == "auto" else int(k_arg))
            r = replay(ids, n, k, args.batch, bound, args.hot_count, args.width)
            print(f"| {n} | {k}{' (auto)' if k_arg == 'auto' else ''} | {steps} | "
                  f"{r['step_rows']:,.0f} | {r['hot_steps']:,.0f} | {r['reuse']:.2f} | "
                  f"{r['pushed']:,.0f} | {r['pulled']:,.0f} ({r['hot_pulled']:,.0f}) | "
                  f"{r['async']:,.0f} | {r['rule']:,.0f} | {r['rule'] / r['async']:.2f} | "
                  f"{r['earlier']:,.0f} | {r['earlier'] / r['async']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

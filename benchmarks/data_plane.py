"""The data plane (tfpsx.data.splits) against the static cut (tfpsx.data.shard), side by
side in one run:

1. A straggler: 1 PS + 4 Keras async workers, one of them 3x slower (its steps sleep 3x
   as long), one epoch of the visit-counter job (tests/cluster/scripts/visits_job.py).
   The epoch's time is the last worker's fit; the ideal is every batch over the workers'
   summed rates (each worker's batches over its own fit time: what it could train had the
   work been shared as they go). Static: every worker a fixed quarter.
2. Throughput without faults: the Criteo job (examples/criteo/train.py, async, 1 PS + 2
   workers, generated data), --input splits against --input static, interleaved.
3. What reading one split of a large file reads: a 4 MiB split in the middle of a 1 GiB
   text file, bytes read by the process (/proc/self/io) against the split's.
4. What exact saves cost (tfpsx.data.splits(exact_saves=True): a barrier around each of
   the chief's saves): the visit-counter job, 1 PS + 3 Keras async workers, an
   incremental checkpoint every 20 of the chief's batches, with and without, interleaved:
   the epoch's time (the last worker's fit).

    python benchmarks/data_plane.py [--rounds 2] [--skip criteo,read,exact]
        [--criteo_rows 1000000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "cluster", "scripts")
sys.path.insert(0, SCRIPTS)
RUN = [sys.executable, "-m", "tfpsx.launcher.run"]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = SCRIPTS + os.pathsep + env.get("PYTHONPATH", "")
    return env


def metrics(log_dir: str, role: str, index: int, event: str) -> list:
    path = os.path.join(log_dir, f"metrics.{role}.{index}.jsonl")
    with open(path) as f:
        return [r for r in map(json.loads, f) if r.get("event") == event]


def straggler(input_kind: str, examples: int, workers: int, delay: float, slow: float,
              data: str) -> dict:
    out = tempfile.mkdtemp(prefix="tfpsx_bench_straggler_")
    os.symlink(data, os.path.join(out, "data"))
    logs = os.path.join(out, "logs")
    proc = subprocess.run(
        RUN + ["--log_dir", logs, "--server_num", "1", "--worker_num", str(workers),
               "--timeout", "600", os.path.join(SCRIPTS, "visits_job.py"), "--out", out,
               "--input", input_kind, "--examples", str(examples), "--step_delay",
               str(delay), "--slow_worker", str(workers - 1), "--slow_factor", str(slow),
               "--split_bytes", "10000"], env=_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{input_kind} run failed:\n{proc.stderr[-3000:]}")
    rows = [metrics(logs, "worker", i, "visits")[-1] for i in range(workers)]
    batches = sum(r["batches"] for r in rows)
    rates = [r["batches"] / r["seconds"] for r in rows]
    epoch = max(r["seconds"] for r in rows)
    ideal = batches / sum(rates)
    return {"epoch_s": epoch, "ideal_s": ideal, "ratio": epoch / ideal,
            "batches": [r["batches"] for r in rows]}


def exact_saves(exact: bool, examples: int, data: str) -> dict:
    out = tempfile.mkdtemp(prefix="tfpsx_bench_exact_")
    os.symlink(data, os.path.join(out, "data"))
    logs = os.path.join(out, "logs")
    proc = subprocess.run(
        RUN + ["--log_dir", logs, "--server_num", "1", "--worker_num", "3", "--timeout",
               "600", os.path.join(SCRIPTS, "visits_job.py"), "--out", out, "--input",
               "splits", "--examples", str(examples), "--split_bytes", "10000",
               "--checkpoint", os.path.join(out, "ckpt"), "--save_every", "20"]
        + ["--exact"] * exact, env=_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"exact={exact} run failed:\n{proc.stderr[-3000:]}")
    rows = [metrics(logs, "worker", i, "visits")[-1] for i in range(3)]
    with open(os.path.join(logs, "workerlog.0")) as f:
        barriers = [float(line.rsplit("up ", 1)[1].split(" ms")[0]) for line in f
                    if "exact save: the barrier was up" in line]
    return {"epoch_s": max(r["seconds"] for r in rows),
            "batches": sum(r["batches"] for r in rows), "barriers_ms": barriers}


def criteo(input_kind: str, data: str, split_bytes: int) -> float:
    logs = tempfile.mkdtemp(prefix="tfpsx_bench_criteo_")
    proc = subprocess.run(
        RUN + ["--log_dir", logs, "--server_num", "1", "--worker_num", "2", "--timeout",
               "900", os.path.join(ROOT, "examples", "criteo", "train.py"), "--train_data",
               os.path.join(data, "train-*"), "--mode", "async", "--epochs", "1",
               "--input", input_kind, "--split_bytes", str(split_bytes), "--verbose", "0"],
        env=_env(), capture_output=True,
        text=True)
    if proc.returncode != 0:
        sys.exit(f"criteo {input_kind} failed:\n{proc.stderr[-3000:]}")
    return metrics(logs, "worker", 0, "criteo")[-1]["examples_per_sec"]


def read_cost() -> dict:
    """Bytes read to read one 4 MiB split in the middle of a 1 GiB file."""
    import tensorflow as tf
    from tfpsx.ops import bindings

    path = os.path.join(tempfile.mkdtemp(prefix="tfpsx_bench_read_"), "big.txt")
    line = b"x" * 99 + b"\n"
    with open(path, "wb") as f:
        block = line * (1 << 14)  # 1.6 MB
        while f.tell() < 1 << 30:
            f.write(block)
    with open(path, "rb") as f:  # drop it from this process's page-cache accounting
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)

    def read_bytes():
        with open("/proc/self/io") as f:
            return {k: int(v) for k, v in (l.split(": ") for l in f)}["rchar"]

    start, size = 600 << 20, 4 << 20
    bindings.read_split(tf.constant(path), 0, 0, 100, 100)  # (loads the op: not counted)
    before = read_bytes()
    records = 0
    at = start
    while at != -1:
        got, _, nxt = bindings.read_split(tf.constant(path), start, at, start + size, 4 << 20)
        records += int(tf.size(got))
        at = int(nxt)
    read = read_bytes() - before
    os.remove(path)
    return {"file_bytes": 1 << 30, "split_bytes": size, "read_bytes": read,
            "records": records}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--skip", default="",
                   help="parts to skip: straggler, criteo, read, exact")
    p.add_argument("--split_bytes", type=int, default=1 << 20,
                   help="the Criteo job's --split_bytes (200,000 lines: 48 MiB)")
    p.add_argument("--criteo_rows", type=int, default=200000,
                   help="the Criteo job's training lines (generated once into data/)")
    args = p.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    if "straggler" not in skip:
        import visits_job
        data = os.path.join(tempfile.mkdtemp(prefix="tfpsx_bench_data_"), "data")
        examples = 30000
        visits_job.write_files(data, examples)
        print("1 PS + 4 Keras async workers, worker 3 steps 3x slower, one epoch of "
              f"{examples:,} examples (batches of 50)")
        print("| input | round | epoch (s) | ideal (s) | epoch / ideal | batches per worker |")
        print("| --- | ---: | ---: | ---: | ---: | --- |")
        for r in range(args.rounds):
            for kind in ("splits", "shard"):
                got = straggler(kind, examples, 4, 0.02, 3.0, data)
                print(f"| {kind} | {r + 1} | {got['epoch_s']:.1f} | {got['ideal_s']:.1f} | "
                      f"{got['ratio']:.2f} | {got['batches']} |", flush=True)
    if "criteo" not in skip:
        data = os.path.join(ROOT, "data", f"bench-criteo-{args.criteo_rows}")
        if not os.path.exists(os.path.join(data, "planted.json")):
            subprocess.run([sys.executable, os.path.join(ROOT, "examples", "criteo",
                                                         "make_data.py"), "--out", data,
                            "--train_rows", str(args.criteo_rows), "--eval_rows", "10000",
                            "--files", "4"], check=True)
        rates = {"splits": [], "static": []}
        for r in range(args.rounds):
            for kind in ("static", "splits"):
                rates[kind].append(criteo(kind, data, args.split_bytes))
                print(f"criteo async 1 PS + 2 workers, --input {kind}, round {r + 1}: "
                      f"{rates[kind][-1]:,.0f} examples/s", flush=True)
        ratio = statistics.median(rates["splits"]) / statistics.median(rates["static"])
        print(f"splits / static examples/s (medians): {ratio:.3f}")
    if "exact" not in skip:
        import visits_job
        data = os.path.join(tempfile.mkdtemp(prefix="tfpsx_bench_data_"), "data")
        examples = 30000
        visits_job.write_files(data, examples)
        print(f"1 PS + 3 Keras async workers, {examples:,} examples, a checkpoint every 20 "
              "of the chief's batches")
        print("| saves | round | epoch (s) | batches | barrier up (ms, median / max) |")
        print("| --- | ---: | ---: | ---: | --- |")
        epochs = {False: [], True: []}
        for r in range(args.rounds):
            for exact in (False, True):
                got = exact_saves(exact, examples, data)
                epochs[exact].append(got["epoch_s"])
                up = got["barriers_ms"]
                shown = (f"{statistics.median(up):.0f} / {max(up):.0f} ({len(up)} saves)"
                         if up else "-")
                print(f"| {'exact' if exact else 'default'} | {r + 1} | {got['epoch_s']:.1f} "
                      f"| {got['batches']} | {shown} |", flush=True)
        print(f"exact / default epoch time (medians): "
              f"{statistics.median(epochs[True]) / statistics.median(epochs[False]):.3f}")
    if "read" not in skip:
        got = read_cost()
        print(f"a {got['split_bytes'] >> 20} MiB split of a {got['file_bytes'] >> 30} GiB text "
              f"file: {got['records']:,} lines, {got['read_bytes'] / (1 << 20):.1f} MiB read "
              f"({got['read_bytes'] / got['split_bytes']:.2f}x the split)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

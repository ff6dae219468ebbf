"""Freshness of a served model that follows an online job: from a row's update on the
servers to a follower serving it.

The Criteo example online (docs/criteo.md, "Online"): ``land_data.py`` lands a folder
of ``--rows`` rows every ``--every`` seconds; ``tfpsx-run`` runs ``train.py --mode async
--input stream`` on 1 PS + 2 workers, saving and publishing every ``--save_seconds``
(``IncrementalCheckpoint(save_seconds=...)``, a base every 5th save); in this process a
follower (``tfpsx/serving/follower.py``, loaded from its file: stock TF) polls every
``--poll`` seconds and notes when it applied each sequence. After ``--seconds`` the job
gets SIGTERM.

A delta k holds the rows updated between save k-1 and save k (each save's time: its
manifest's ``created``, right after the save's export); a row updated at u is served
from the moment the follower applied k. Updates are taken as spread evenly over the
interval (the job trains without pause under the landing load), weighted by the
delta's rows: the freshness of every update, its median and p95.

Target (issue 63): with --save_seconds 30, a median <= 45 s.

  python benchmarks/online_freshness.py [--seconds 240] [--save_seconds 30]
"""

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "criteo")
FOLLOWER = os.path.join(ROOT, "tfpsx", "serving", "follower.py")
RUN = [sys.executable, "-m", "tfpsx.launcher.run"]


def manifest(models: str, sequence: int) -> dict:
    base = os.path.join(models, str(sequence), "assets.extra", "tfpsx_manifest.json")
    path = base if os.path.exists(base) else os.path.join(models, "deltas", str(sequence),
                                                          "manifest.json")
    with open(path) as f:
        return json.load(f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=240)
    p.add_argument("--save_seconds", type=float, default=30)
    p.add_argument("--every", type=float, default=5, help="seconds between landed folders")
    p.add_argument("--rows", type=int, default=40_000, help="rows a folder")
    p.add_argument("--poll", type=float, default=1.0, help="the follower's poll (s)")
    args = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="tfpsx_bench_online_")
    online, models = os.path.join(work, "online"), os.path.join(work, "models")
    writer = subprocess.Popen([sys.executable, os.path.join(EXAMPLE, "land_data.py"), "--out",
                               online, "--hours", "0", "--every", str(args.every), "--rows",
                               str(args.rows)], stdout=subprocess.DEVNULL,
                              start_new_session=True)
    job = None
    applied = {}  # sequence -> wall time the follower applied (or loaded) it
    stop = threading.Event()
    try:
        while not os.path.exists(os.path.join(online, "h00000", "_SUCCESS")):
            assert writer.poll() is None, "land_data.py exited"
            time.sleep(0.2)
        job = subprocess.Popen(
            RUN + ["--server_num", "1", "--worker_num", "2", "--log_dir",
                   os.path.join(work, "logs"), "--timeout", str(args.seconds + 300),
                   os.path.join(EXAMPLE, "train.py"), "--mode", "async", "--input", "stream",
                   "--train_data", os.path.join(online, "*", "train-*.txt"),
                   "--checkpoint_dir", os.path.join(work, "ckpt"), "--save_seconds",
                   str(args.save_seconds), "--publish_dir", models, "--verbose", "0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        spec = importlib.util.spec_from_file_location("follower", FOLLOWER)
        follower = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(follower)
        deadline = time.monotonic() + 240
        while not (os.path.isdir(models) and follower._bases(models)):
            assert job.poll() is None and time.monotonic() < deadline, job.stderr.read()
            time.sleep(0.2)
        f = follower.Follower(models)
        applied[f.applied] = time.time()

        def follow():
            while not stop.is_set():
                while f.step() is not None:
                    applied[f.applied] = time.time()
                time.sleep(args.poll)

        thread = threading.Thread(target=follow, daemon=True)
        thread.start()
        time.sleep(args.seconds)
        job.send_signal(signal.SIGTERM)
        _, err = job.communicate(timeout=180)
        time.sleep(2 * args.poll + 1)  # the last delta applied
        stop.set()
        thread.join(30)
        if job.returncode != 0:
            sys.exit(f"the job exited with {job.returncode}: {err[-3000:]}")
    finally:
        for proc in (writer, job):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
    sequences = sorted(applied)
    per_delta, samples = [], []
    rng = np.random.default_rng(0)
    for prev, seq in zip(sequences, sequences[1:]):
        m, before = manifest(models, seq), manifest(models, prev)
        if m["kind"] != "delta" or seq != prev + 1:
            continue
        start, end, served = before["created"], m["created"], applied[seq]
        per_delta.append({"sequence": seq, "rows": m["rows"], "interval_s": end - start,
                          "publish_to_served_s": served - end,
                          "oldest_update_s": served - start})
        updates = rng.uniform(start, end, max(1, min(m["rows"], 10_000)))
        samples.extend((served - updates).tolist())
    shutil.rmtree(work, ignore_errors=True)
    if not samples:
        sys.exit(f"no delta was followed: applied {applied}")
    result = {"save_seconds": args.save_seconds, "deltas": len(per_delta),
              "median_s": float(np.median(samples)), "p95_s": float(np.percentile(samples, 95)),
              "max_s": float(np.max(samples)),
              "publish_to_served_median_s": float(np.median(
                  [d["publish_to_served_s"] for d in per_delta])),
              "per_delta": per_delta}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Collective mode: 1 vs 2 workers on a dense model, side by side in one run, and the
communication each mode needs as the job grows.

A 64-512-512-512-1 MLP (about 560k dense weights) regressing a planted function, Keras 3
fit under tfpsx.keras.CollectiveStrategy, Adam, the same global batch (256) however many
workers: 1 worker takes batches of 256, 2 workers 128 each and all-reduce their gradients
(the same arithmetic: the tests check it equals one process to 1e-5). Each twice: with
TF's own thread pools (the workers share this machine's cores) and with one thread per
worker (as if each worker had a core of its own: what is left is the all-reduce's cost).
Runs interleaved
and repeated; per setup the median wall time until the eval loss first reaches the target
(the best eval loss any setup reached in the budget, plus 2%), examples/s, and the bytes
one worker sends per step. Then a projection from those bytes: a ring all-reduce moves
2 (N - 1) / N x D bytes per worker and step; a PS step moves D up (gradients) and D down
(weights) per worker, and N x 2 D through the servers, for N from 8 to 64.

With ``--criteo``: hybrid vs async vs GEO (and each worker alone, the no-sync ceiling)
on the Criteo-format job over the emulated 1 ms / 1 Gbit/s network, time to target AUC
as the realistic-scale benchmark measures it (benchmarks/time_to_auc.py: the same job,
runs interleaved; the hybrid's all-reduce goes through delay proxies of the same link).

  python benchmarks/collective_scaling.py [--rounds 3] [--examples 65536] [--epochs 4]
  python benchmarks/collective_scaling.py --criteo [--rounds 2]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "benchmarks", "_collective_job.py")


def run(setup, args) -> dict:
    workers, threads = setup
    with tempfile.TemporaryDirectory() as logs:
        proc = subprocess.run(
            [sys.executable, "-m", "tfpsx.launcher.run", "--server_num", "0", "--worker_num",
             str(workers), "--log_dir", logs, "--timeout", "1200", JOB,
             "--examples", str(args.examples), "--epochs", str(args.epochs),
             "--threads", str(threads)],
            capture_output=True, text=True, timeout=1300)
        if proc.returncode != 0:
            raise RuntimeError(f"{workers} worker(s) failed:\n{proc.stdout[-3000:]}"
                               f"{proc.stderr[-3000:]}")
        line = next(x for x in proc.stdout.splitlines() if "COLLECTIVE_RESULT " in x)
        return json.loads(line.split("COLLECTIVE_RESULT ", 1)[1])


def _name(setup) -> str:
    workers, threads = setup
    cores = "TF's threads" if not threads else f"{threads} thread{'s' * (threads > 1)} each"
    return f"{workers} worker{'s' * (workers > 1)} ({cores})"


def time_to(result: dict, target: float):
    return next((at for at, loss in result["epochs"] if loss <= target), None)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--examples", type=int, default=65536)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--criteo", action="store_true",
                   help="hybrid vs async vs GEO on the Criteo-format job (time_to_auc.py)")
    args = p.parse_args(argv)
    if args.criteo:
        sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
        import time_to_auc

        return time_to_auc.main(["--networks", "1ms", "--rounds", str(args.rounds),
                                 "--modes", "async,geo100,hybrid,hybrid_geo100,local",
                                 "--out", os.path.join(ROOT, "build", "bench", "hybrid.md")])
    setups = [(1, 0), (2, 0), (1, 1), (2, 1)]
    results = {s: [] for s in setups}
    for r in range(args.rounds):
        for setup in (setups if r % 2 == 0 else list(reversed(setups))):
            res = run(setup, args)
            results[setup].append(res)
            print(f"  round {r + 1}: {_name(setup)}: {res['examples_per_sec']:8.0f} examples/s,"
                  f" eval loss by epoch {[round(l, 4) for _, l in res['epochs']]}", flush=True)
    best = min(loss for rs in results.values() for res in rs for _, loss in res["epochs"])
    target = best * 1.02
    dense = results[setups[0]][0]["dense_params"]
    print(f"\ncollective_scaling: a {dense:,}-weight MLP, global batch 256, "
          f"{args.examples} examples x {args.epochs} epochs, median of {args.rounds} rounds; "
          f"target eval loss {target:.5f} (the best reached + 2%)")
    print("| workers | examples/s | time to target (s) | final eval loss | sent per step and worker |")
    print("| --- | --- | --- | --- | --- |")
    medians = {}
    for setup, rs in results.items():
        w = setup[0]
        times = [t for t in (time_to(res, target) for res in rs) if t is not None]
        rate = statistics.median(res["examples_per_sec"] for res in rs)
        final = statistics.median(res["epochs"][-1][1] for res in rs)
        sent = 2 * (w - 1) / w * dense * 4
        medians[setup] = (rate, statistics.median(times) if len(times) * 2 > len(rs) else None)
        tta = f"{medians[setup][1]:.1f}" if medians[setup][1] is not None else "not reached"
        print(f"| {_name(setup)} | {rate:,.0f} | {tta} | {final:.5f} | {sent / 1e6:.2f} MB |")
    for threads in (0, 1):
        one, two = medians[(1, threads)], medians[(2, threads)]
        if one[1] and two[1]:
            print(f"\n{_name((2, threads))}: the target in {two[1] / one[1]:.2f}x the time of "
                  f"{_name((1, threads))} ({two[0] / one[0]:.2f}x its examples/s)")
    d = dense * 4
    print(f"\nprojection from D = {d / 1e6:.2f} MB of dense gradients per step:")
    print("| workers N | ring all-reduce, per worker | PS, per worker | PS, through the servers |")
    print("| --- | --- | --- | --- |")
    for n in (8, 16, 32, 64):
        print(f"| {n} | {2 * (n - 1) / n * d / 1e6:.2f} MB | {2 * d / 1e6:.2f} MB | "
              f"{n * 2 * d / 1e6:.1f} MB (split over the servers) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

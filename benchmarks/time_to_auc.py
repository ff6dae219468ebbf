"""Wall time to a target AUC: every mode on the Criteo-format job, side by side, over
emulated networks.

The job is examples/criteo (Wide&Deep over a DynamicEmbedding table, Keras 3 fit) on
generated data (examples/criteo/make_data.py, made once into data/bench-criteo-<rows>),
1 PS + 2 workers started with TFPSX_* env, every process behind a userspace delay proxy
(benchmarks/netem.py; the PS's proxy is also a link of the given bandwidth and counts
its bytes). Modes: sync, async, GEO at several k, async and GEO with a worker cache,
and "local" (each worker trains alone on its half: the no-sync ceiling). Runs are
interleaved over the rounds (machine drift hits all alike); figures are medians.

Per mode:
* the chief's evaluation every --eval_every steps on --eval_rows held-out rows: AUC
  against training seconds (the evaluation pauses excluded; process start and connect
  too: every mode pays those alike);
* time to target: the first evaluation at or above the target AUC, which is
  --target_fraction (99%) of the best final AUC any cluster mode reached in the run;
* AUC at equal time: each mode's AUC at the time the fastest cluster mode finished;
* examples/s (both workers, fit's time), bytes through the PS's link per step and
  worker, the final AUC of the global model.

It writes a markdown table (--out, default build/bench/time_to_auc.md) and two PNG
plots with matplotlib (pip install matplotlib): AUC against seconds per mode, and
examples/s against GEO's k.

  python benchmarks/time_to_auc.py [--networks 1ms] [--modes async,geo100,local]
      [--rounds 2] [--train_rows 1000000] [--epochs 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Dict, List, Optional

import tfpsx
from _proxied import ROOT, run_job

EXAMPLE = os.path.join(ROOT, "examples", "criteo")
NETWORKS = {"loopback": (0.0, None), "1ms": (0.0005, 1e9 / 8), "5ms": (0.0025, 1e9 / 8)}
MODES = {
    "sync": ["--mode", "sync"],
    "async": ["--mode", "async"],
    "geo10": ["--mode", "geo", "--k_steps", "10"],
    "geo100": ["--mode", "geo", "--k_steps", "100"],
    "geo400": ["--mode", "geo", "--k_steps", "400"],
    "async_cache": ["--mode", "async", "--cache_size", "CACHE"],
    # The cache's ceiling: every row stays on the worker once fetched, never synced
    # before the end (dense weights still async on the PS): no cache design goes faster.
    "async_cache_ceiling": ["--mode", "async", "--cache_size", "100000000",
                            "--cache_flush_steps", "1000000000"],
    "geo100_bf16": ["--mode", "geo", "--k_steps", "100", "--geo_wire_dtype", "bfloat16"],
    "geo100_cache": ["--mode", "geo", "--k_steps", "100", "--cache_size", "CACHE"],
    "local": ["--mode", "local"],
}


def data_dir(rows: int) -> str:
    """Generated data of ``rows`` training rows (made on first use)."""
    out = os.path.join(ROOT, "data", f"bench-criteo-{rows}")
    if not os.path.exists(os.path.join(out, "planted.json")):
        subprocess.run([sys.executable, os.path.join(EXAMPLE, "make_data.py"), "--out", out,
                        "--train_rows", str(rows), "--eval_rows", "30000", "--files", "4"],
                       check=True)
    return out


def run(mode: str, network: str, args) -> dict:
    one_way, rate = NETWORKS[network]
    data = data_dir(args.train_rows)
    extra = [str(args.cache_size) if a == "CACHE" else a for a in MODES[mode]]
    cmd = [sys.executable, os.path.join(EXAMPLE, "train.py"), "--train_data",
           os.path.join(data, "train-*"), "--eval_data", os.path.join(data, "eval.txt"),
           "--epochs", str(args.epochs), "--batch_size", str(args.batch_size), "--verbose", "0",
           "--eval_every", str(args.eval_every), "--eval_rows", str(args.eval_rows)] + extra
    with run_job(cmd, one_way=one_way, rate=rate, timeout=args.timeout) as job:
        reports = [tfpsx.metrics.read(job.logs, "worker", i, "criteo")[-1] for i in range(2)]
        steps = reports[0]["steps_per_epoch"] * args.epochs
        # The chief's rate counts every worker's examples (equal steps on each).
        return {"examples_per_sec": reports[0]["examples_per_sec"], "auc": reports[0]["auc"],
                "points": reports[0]["points"], "seconds": reports[0]["seconds"],
                "bytes_per_step": (job.server_bytes / max(1, steps * 2)
                                   if job.server_bytes else None)}


def time_to(points: List[dict], target: float) -> Optional[float]:
    for p in points:
        if p["auc"] >= target:
            return p["seconds"]
    return None


def auc_at(points: List[dict], seconds: float) -> Optional[float]:
    before = [p for p in points if p["seconds"] <= seconds]
    return before[-1]["auc"] if before else None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--networks", default="1ms", help=f"comma list of {list(NETWORKS)}")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {list(MODES)}")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--train_rows", type=int, default=1_000_000)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch_size", type=int, default=512)
    p.add_argument("--cache_size", type=int, default=100_000)
    p.add_argument("--eval_every", type=int, default=100)
    p.add_argument("--eval_rows", type=int, default=10_000)
    p.add_argument("--target_fraction", type=float, default=0.99)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", default=os.path.join(ROOT, "build", "bench", "time_to_auc.md"))
    args = p.parse_args(argv)
    networks, modes = args.networks.split(","), args.modes.split(",")
    for name, got, known in (("--networks", networks, NETWORKS), ("--modes", modes, MODES)):
        bad = [x for x in got if x not in known]
        if bad:
            p.error(f"{name}: unknown {bad}; expected some of {list(known)}")
    configs = [(m, n) for n in networks for m in modes]
    results: Dict[tuple, List[dict]] = {c: [] for c in configs}
    for r in range(args.rounds):
        for config in (configs if r % 2 == 0 else configs[::-1]):
            got = run(*config, args)
            results[config].append(got)
            print(f"  round {r + 1}: {config[1]:8s} {config[0]:13s} "
                  f"{got['examples_per_sec']:8.0f} examples/s, final auc {got['auc']:.4f}, "
                  f"{got['seconds']:.1f} s", flush=True)
    lines = [f"time_to_auc: examples/criteo Wide&Deep, {args.train_rows} generated rows, "
             f"{args.epochs} epoch(s), batch {args.batch_size} per worker, 1 PS + 2 workers, "
             f"medians of {args.rounds} interleaved rounds", ""]
    plots = {}
    for network in networks:
        med = {}
        for mode in modes:
            runs = results[(mode, network)]
            med[mode] = {k: statistics.median(x[k] for x in runs)
                         for k in ("examples_per_sec", "auc", "seconds")}
            b = [x["bytes_per_step"] for x in runs if x["bytes_per_step"]]
            med[mode]["bytes_per_step"] = statistics.median(b) if b else None
            med[mode]["points"] = runs[len(runs) // 2]["points"]
        cluster = [m for m in modes if m != "local"]
        best = max(med[m]["auc"] for m in cluster) if cluster else max(
            v["auc"] for v in med.values())
        target = args.target_fraction * best
        equal = min(med[m]["seconds"] for m in cluster) if cluster else None
        for mode in modes:
            ts = [time_to(x["points"], target) for x in results[(mode, network)]]
            ts = [t for t in ts if t is not None]
            med[mode]["to_target"] = statistics.median(ts) if len(ts) * 2 > len(
                results[(mode, network)]) else None
            med[mode]["at_equal"] = auc_at(med[mode]["points"], equal) if equal else None
        base = med.get("async", {}).get("to_target")
        one_way, rate = NETWORKS[network]
        link = "no delay" if not one_way else f"{2000 * one_way:g} ms RTT"
        if rate:
            link += f", {8 * rate / 1e9:g} Gbit/s at the PS"
        lines += [f"**{network}** ({link}): target AUC {target:.4f} "
                  f"({100 * args.target_fraction:g}% of the best final {best:.4f}); equal "
                  f"time {equal or 0:.1f} s", "",
                  "| mode | time to target (s) | vs async | AUC at equal time | final AUC | "
                  "examples/s | x ceiling | bytes / step / worker |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        ceiling = med.get("local", {}).get("examples_per_sec")
        for mode in modes:
            m = med[mode]
            t, eq, b = m["to_target"], m["at_equal"], m["bytes_per_step"]
            cells = ["not reached" if t is None else f"{t:.1f}",
                     "-" if t is None or not base else f"{base / t:.2f}x",
                     "-" if eq is None else f"{eq:.4f}", f"{m['auc']:.4f}",
                     f"{m['examples_per_sec']:.0f}",
                     "-" if not ceiling else f"{m['examples_per_sec'] / ceiling:.2f}",
                     "-" if not b else f"{b / 1e3:.1f} kB"]
            lines.append(f"| {mode} | " + " | ".join(cells) + " |")
        lines.append("")
        plots[network] = med
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump({n: {m: {k: v for k, v in d.items()} for m, d in med.items()}
                   for n, med in plots.items()}, f, indent=1)
    print("\n".join(lines))
    write_plots(plots, os.path.splitext(args.out)[0])
    return 0


def write_plots(plots, prefix: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: plots skipped (pip install matplotlib)")
        return
    def save(fig, ax, title, path):
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)

    for network, med in plots.items():
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for mode, m in med.items():
            pts = m["points"]
            ax.plot([p["seconds"] for p in pts], [p["auc"] for p in pts], marker=".", label=mode)
        ax.set_xlabel("training seconds (evaluation pauses excluded)")
        ax.set_ylabel("eval AUC (the chief's model)")
        save(fig, ax, f"examples/criteo, 1 PS + 2 workers, {network}",
             f"{prefix}_{network}_auc.png")
        geo = sorted((int(mode[3:]), m["examples_per_sec"])  # geoK modes, no variants
                     for mode, m in med.items() if mode.startswith("geo") and mode[3:].isdigit())
        if geo:
            fig, ax = plt.subplots(figsize=(6, 4))
            ax.plot([k for k, _ in geo], [r for _, r in geo], marker="o", label="GEO")
            for mode, style in (("async", "--"), ("local", ":")):
                if mode in med:
                    ax.axhline(med[mode]["examples_per_sec"], linestyle=style, label=mode)
            ax.set_xscale("log")
            ax.set_xlabel("k (local steps between syncs)")
            ax.set_ylabel("examples/s (2 workers)")
            save(fig, ax, f"GEO's speed against k, {network}", f"{prefix}_{network}_k.png")
    print(f"plots: {prefix}_*.png")


if __name__ == "__main__":
    sys.exit(main())

"""Wall time to a target quality: every mode of a job side by side, over emulated networks.

Jobs (benchmarks/_tta_jobs.py): ``criteo`` (examples/criteo, Wide&Deep over a
DynamicEmbedding table, Keras 3 fit, eval AUC) and ``word2vec`` (examples/word2vec,
skip-gram over two DynamicTable tables of a 100,000-word vocabulary, graph mode, eval
loss; with ``tf_async``, the same model in plain TF async, as a peer). 1 PS + 2 workers
(``--servers``, ``--workers``)
started with TFPSX_* env, every process behind a userspace delay proxy
(benchmarks/netem.py; each proxy is also its process's link of the given bandwidth and
counts its bytes; every process's cluster lists the proxies, TFPSX_LISTEN_PORT). Modes: sync, async, GEO at several k, async and GEO with a worker cache,
the hybrid mode (criteo: the table async or GEO on the PS, the dense weights all-reduced
among the workers through proxies of the same delay and bandwidth; with a worker cache
and its ceiling too), and "local" (each worker trains alone on its half: the no-sync ceiling). Runs are
interleaved over the rounds (machine drift hits all alike); figures are medians.

Per mode:
* the chief's evaluation every --eval_every steps: quality against training seconds
  (the evaluation pauses excluded; process start and connect too: every mode pays
  those alike);
* time to target: the first evaluation at or past the target, which is
  --target_fraction (99%) of the best final quality any cluster mode reached in the run
  (a loss: the best divided by the fraction);
* time to async's final quality (what async reached by its end, in its worst round: a
  target async meets when a faster mode's best is out of its reach in the budget);
* quality at equal time: each mode's at the time the fastest cluster mode finished;
* examples/s (every worker's), bytes per step and worker through the PS's link (and,
  hybrid, the workers' all-reduce links), the
  final quality of the global model.

It writes a markdown table (--out, default build/bench/time_to_auc[_<job>].md) and two
PNG plots with matplotlib (pip install matplotlib): quality against seconds per mode,
and examples/s against GEO's k.

  python benchmarks/time_to_auc.py [--job criteo|word2vec] [--networks 1ms]
      [--modes async,geo100,local] [--rounds 2] [--train_rows 1000000] [--epochs 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Dict, List, Optional

from _proxied import ROOT
from _tta_jobs import JOBS, add_flags

NETWORKS = {"loopback": (0.0, None), "1ms": (0.0005, 1e9 / 8), "5ms": (0.0025, 1e9 / 8)}


def time_to(points: List[dict], target: float, higher: bool) -> Optional[float]:
    for p in points:
        if (p["value"] >= target) if higher else (p["value"] <= target):
            return p["seconds"]
    return None


def value_at(points: List[dict], seconds: float) -> Optional[float]:
    before = [p for p in points if p["seconds"] <= seconds]
    return before[-1]["value"] if before else None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", default="criteo", choices=list(JOBS))
    p.add_argument("--networks", default="1ms", help=f"comma list of {list(NETWORKS)}")
    p.add_argument("--modes", default=None,
                   help="comma list (default: all of the job's); criteo: "
                        f"{list(JOBS['criteo'].MODES)}; word2vec: {list(JOBS['word2vec'].MODES)}")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--eval_every", type=int, default=None,
                   help="steps between the chief's evaluations (criteo 100, word2vec 50)")
    p.add_argument("--target_fraction", type=float, default=0.99)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", default=None, help="default build/bench/time_to_auc[_<job>].md")
    add_flags(p)
    args = p.parse_args(argv)
    if args.eval_every is None:
        args.eval_every = 100 if args.job == "criteo" else 50
    job = JOBS[args.job](args)
    out = args.out or os.path.join(ROOT, "build", "bench", "time_to_auc.md" if args.job ==
                                   "criteo" else f"time_to_auc_{args.job}.md")
    networks = args.networks.split(",")
    modes = args.modes.split(",") if args.modes else list(job.MODES)
    for name, got, known in (("--networks", networks, NETWORKS), ("--modes", modes, job.MODES)):
        bad = [x for x in got if x not in known]
        if bad:
            p.error(f"{name}: unknown {bad}; expected some of {list(known)}")
    configs = [(m, n) for n in networks for m in modes]
    results: Dict[tuple, List[dict]] = {c: [] for c in configs}
    for r in range(args.rounds):
        for mode, network in (configs if r % 2 == 0 else configs[::-1]):
            got = job.run(mode, *NETWORKS[network])
            results[(mode, network)].append(got)
            cpu = got.get("cpu_ms_per_1k")
            print(f"  round {r + 1}: {network:8s} {mode:20s} "
                  f"{got['examples_per_sec']:8.0f} examples/s, final {job.quality} "
                  f"{got['final']:.4f}, {got['seconds']:.1f} s"
                  + ("" if cpu is None else f", workers' CPU {cpu:.1f} ms / 1k examples"),
                  flush=True)
    lines = [f"time_to_auc: {job.title()}, medians of {args.rounds} "
             "interleaved rounds", ""]
    plots = {}
    for network in networks:
        med = summarize(job, {m: results[(m, network)] for m in modes}, args.target_fraction)
        lines += table(job, network, med)
        plots[network] = med
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.splitext(out)[0] + ".json", "w") as f:
        json.dump(plots, f, indent=1)
    print("\n".join(lines))
    write_plots(job, plots, os.path.splitext(out)[0])
    return 0


def summarize(job, runs_by_mode: Dict[str, List[dict]], fraction: float) -> Dict[str, dict]:
    """Medians per mode, the target, each mode's time to it and quality at equal time."""
    higher = job.higher_is_better
    med = {}
    for mode, runs in runs_by_mode.items():
        med[mode] = {k: statistics.median(x[k] for x in runs)
                     for k in ("examples_per_sec", "final", "seconds")}
        for key in ("bytes_per_step", "cpu_ms_per_1k"):
            got = [x[key] for x in runs if x.get(key)]
            med[mode][key] = statistics.median(got) if got else None
        med[mode]["points"] = runs[len(runs) // 2]["points"]
    cluster = [m for m in med if m != "local"] or list(med)
    finals = [med[m]["final"] for m in cluster]
    best = max(finals) if higher else min(finals)
    target = fraction * best if higher else best / fraction
    equal = min(med[m]["seconds"] for m in cluster)
    # Also: how soon each mode reaches what async reached by its end in every round (a
    # target async meets, when a faster mode's best is out of async's reach in the budget).
    async_final = None
    if "async" in runs_by_mode:
        finals = [x["final"] for x in runs_by_mode["async"]]
        async_final = min(finals) if higher else max(finals)
    for mode, runs in runs_by_mode.items():
        for key, goal in (("to_target", target), ("to_async", async_final)):
            if goal is None:
                med[mode][key] = None
                continue
            ts = [t for t in (time_to(x["points"], goal, higher) for x in runs) if t is not None]
            med[mode][key] = statistics.median(ts) if len(ts) * 2 > len(runs) else None
        med[mode]["at_equal"] = value_at(med[mode]["points"], equal)
    med["_"] = {"best": best, "target": target, "equal": equal, "async_final": async_final}
    return med


def table(job, network: str, med: Dict[str, dict]) -> List[str]:
    """The markdown lines of one network's results."""
    info = med["_"]
    modes = [m for m in med if m != "_"]
    base = med.get("async", {}).get("to_target")
    base_async = med.get("async", {}).get("to_async")
    one_way, rate = NETWORKS[network]
    link = "no delay" if not one_way else f"{2000 * one_way:g} ms RTT"
    if rate:
        link += f", {8 * rate / 1e9:g} Gbit/s at every process"
    q = job.quality
    lines = [f"**{network}** ({link}): target {q} {info['target']:.4f} (the best final "
             f"{info['best']:.4f}, {'times' if job.higher_is_better else 'divided by'} the "
             f"target fraction); equal time {info['equal']:.1f} s", "",
             f"| mode | time to target (s) | vs async | time to async's final (s) | vs async | "
             f"{q} at equal time | final {q} | examples/s | x ceiling | bytes / step / worker | "
             "workers' CPU / 1k examples |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    ceiling = med.get("local", {}).get("examples_per_sec")
    for mode in modes:
        m = med[mode]
        t, eq, b, cpu = m["to_target"], m["at_equal"], m["bytes_per_step"], m["cpu_ms_per_1k"]
        ta = m["to_async"]
        cells = ["not reached" if t is None else f"{t:.1f}",
                 "-" if t is None or not base else f"{base / t:.2f}x",
                 "not reached" if ta is None else f"{ta:.1f}",
                 "-" if ta is None or not base_async else f"{base_async / ta:.2f}x",
                 "-" if eq is None else f"{eq:.4f}", f"{m['final']:.4f}",
                 f"{m['examples_per_sec']:.0f}",
                 "-" if not ceiling else f"{m['examples_per_sec'] / ceiling:.2f}",
                 "-" if not b else f"{b / 1e3:.1f} kB",
                 "-" if not cpu else f"{cpu:.0f} ms"]
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return lines + [""]


def write_plots(job, plots, prefix: str) -> None:
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
        med = {m: v for m, v in med.items() if m != "_"}
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for mode, m in med.items():
            pts = m["points"]
            ax.plot([p["seconds"] for p in pts], [p["value"] for p in pts], marker=".",
                    label=mode)
        ax.set_xlabel("training seconds (evaluation pauses excluded)")
        ax.set_ylabel(f"{job.quality} (the chief's view of the shared model)")
        save(fig, ax, f"examples/{job.name}, {job.args.servers} PS + "
                  f"{job.args.workers} workers, {network}",
             f"{prefix}_{network}_{'auc' if job.name == 'criteo' else 'loss'}.png")
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
            ax.set_ylabel(f"examples/s ({job.args.workers} workers)")
            save(fig, ax, f"GEO's speed against k, {network}", f"{prefix}_{network}_k.png")
    print(f"plots: {prefix}_*.png")


if __name__ == "__main__":
    sys.exit(main())

"""Plots runs of benchmarks/geo_scale.py (their --json files): final AUC against the
number of workers, one line per schedule and rule (matplotlib).

  python benchmarks/plot_geo_scale.py before.json rule.json --out docs/img/geo_scale.png
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List, Tuple


def label(run: dict) -> str:
    """What a run trained with, in words."""
    if run["mode"] == "async":
        return "async"
    k = (f"k={run['k_max']} (fewer if under {run['min_rounds']} rounds)" if "k_max" in run
         else f"k={run['k']}")
    parts = [f"GEO {k}", f"rows {run['rule']}"]
    parts.append("dense async" if run.get("async_part") == "dense" else f"dense {run['dense']}")
    if run.get("hot_share") is not None:
        parts.append("hot ids on the PS")
    if run.get("hot_per_round"):
        bound = run["hot_per_round"]
        parts.append("contended rows on the PS" if bound == "auto" else
                     f"rows over {bound} steps a round on the PS")
    if run.get("latency"):
        parts.append(f"background (pull {run['latency']} steps late)")
    return ", ".join(parts)


def lines(runs: List[dict]) -> Dict[str, List[Tuple[int, float]]]:
    """label -> [(workers, auc)], sorted by workers (a label's last run at an N wins)."""
    got: Dict[str, Dict[int, float]] = {}
    for run in runs:
        got.setdefault(label(run), {})[run["n"]] = run["auc"]
    return {name: sorted(points.items()) for name, points in got.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="geo_scale.py --json files")
    p.add_argument("--out", required=True, help="the PNG to write")
    args = p.parse_args(argv)
    runs = []
    for path in args.runs:
        with open(path) as f:
            runs += json.load(f)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_geo_scale: needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 1
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, points in sorted(lines(runs).items()):
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="o", label=name, linestyle="--" if name == "async" else "-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("workers (N)")
    ax.set_ylabel("eval AUC after one epoch")
    ax.set_title("GEO against async at N workers (benchmarks/geo_scale.py)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

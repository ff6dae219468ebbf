"""The worker cache: async training on 1 PS + 2 workers over a Zipf(1.1) id stream,
with and without ``cache_size``, on loopback, behind a 1 ms delay proxy, and behind the
same proxy as a 1 Gbit/s link at the PS.

One run, the same data for every configuration (benchmarks/_cache_job.py: 8 ids per
example from Zipf(1.1) over 1M ids, a DynamicEmbedding of dim 16 with Adagrad, a linear
layer; graph mode, async). Configurations are interleaved over the rounds, so machine
drift hits all alike. For each: examples/s summed over the workers' training loops, the
eval loss of the global model (the PS's rows) on held-out examples, and the median time
of one read-only lookup of a batch (the cache's rows, or a PS round trip).

Tables: "none" (every lookup and update goes to the PS), "cache" (the worker cache, every
miss admitted), "admit2" (the cache with ``cache_admit_after=2``: a miss enters at its
second recent sighting, the rest of the tail trains on the PS), and "local": every worker trains a table of its own on itself, no PS rows at all. "local" is
not a way to train (nothing is shared, so it has no global loss); it is the ceiling of any
cache on this machine: a cache that always hit and never synced would run at its speed.

Networks: "loopback"; "+1ms" puts a userspace proxy (benchmarks/netem.py) in front of
every process, 0.5 ms each way (every request waits 1 ms more for its reply; a PS
fetching a worker's push dials the worker's proxy); "+1ms 1Gb" also makes every proxy a
1 Gbit/s link per direction, shared by its connections (each process's NIC). Figures
measured before 2026-11-26 had only the servers' proxies on the path (pushes skipped
them): not comparable with later runs.

Targets (issue 13): the cache >= 2x examples/s at a final loss within 2%, and a larger
gain with the delay.

  python benchmarks/embedding_cache.py [--rounds 2] [--steps 300] [--cache_size 50000]
      [--trace DIR]
"""

import argparse
import os
import statistics
import sys

import tfpsx
from _proxied import run_job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "benchmarks", "_cache_job.py")
ONE_WAY = 0.0005


NETWORKS = {"loopback": (0.0, None), "+1ms": (ONE_WAY, None),
            "+1ms 1Gb": (ONE_WAY, 1e9 / 8)}  # (one-way delay s, PS link bytes/s)
TABLES = ("none", "cache", "admit2", "local")


def run(table: str, network: str, args) -> dict:
    """One job; returns {examples_per_sec, eval_loss (None for "local"), lookup_ms}."""
    one_way, rate = NETWORKS[network]
    cmd = [sys.executable, JOB, "--steps", str(args.steps), "--batch", str(args.batch),
           "--cache_size", str(args.cache_size if table in ("cache", "admit2") else 0),
           "--flush_steps", str(args.flush_steps),
           "--admit_after", "2" if table == "admit2" else "1"]
    if table == "local":
        cmd.append("--local_table")
    if args.trace:
        trace = os.path.join(args.trace, f"{table}_{network.replace(' ', '_')}")
        os.makedirs(trace, exist_ok=True)
        cmd += ["--trace", trace]
    with run_job(cmd, one_way=one_way, rate=rate, timeout=args.timeout) as job:
        reports = [tfpsx.metrics.read(job.logs, "worker", i, "cache_bench")[-1]
                   for i in range(2)]
        # the caches' counters, as the training hook emitted them at the end
        caches = [records[-1] for records in
                  (tfpsx.metrics.read(job.logs, "worker", i, "cache") for i in range(2))
                  if records]
    got = {"examples_per_sec": sum(r["examples_per_sec"] for r in reports),
           "eval_loss": reports[0].get("eval_loss"),
           "lookup_ms": statistics.mean(r["lookup_ms"] for r in reports)}
    if caches:
        got["cache"] = {k: statistics.mean(c[k] / (1 if k == "hit_rate" else args.steps)
                                           for c in caches)
                        for k in ("hit_rate", "rows_fetched", "evictions", "not_admitted")}
    return got


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=300, help="training steps per worker")
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--cache_size", type=int, default=50_000, help="5%% of the 1M ids")
    p.add_argument("--flush_steps", type=int, default=20)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--networks", default=",".join(NETWORKS),
                   help=f"comma-separated, of {', '.join(NETWORKS)}")
    p.add_argument("--trace", default=None,
                   help="folder: Chrome traces of one step per worker and configuration")
    args = p.parse_args(argv)
    networks = args.networks.split(",")
    bad = [n for n in networks if n not in NETWORKS]
    if bad:
        p.error(f"--networks: unknown {bad}; expected some of {list(NETWORKS)}")
    configs = [(t, n) for n in networks for t in TABLES]
    results = {c: [] for c in configs}
    for r in range(args.rounds):
        for config in (configs if r % 2 == 0 else configs[::-1]):
            got = run(*config, args)
            results[config].append(got)
            loss = "  n/a " if got["eval_loss"] is None else f"{got['eval_loss']:.4f}"
            print(f"  round {r + 1}: {config[0]:6s} {config[1]:9s} "
                  f"{got['examples_per_sec']:9.0f} examples/s, eval loss {loss}, "
                  f"lookup {got['lookup_ms']:.2f} ms" + (
                      "" if "cache" not in got else
                      ", hit rate {hit_rate:.3f}, per step: {rows_fetched:.0f} rows fetched, "
                      "{evictions:.0f} evicted, {not_admitted:.0f} not admitted".format(
                          **got["cache"])), flush=True)

    def med(config, key):
        values = [x[key] for x in results[config] if x[key] is not None]
        return statistics.median(values) if values else None

    print(f"\n{'network':10s} {'table':>6s} {'examples/s':>11s} {'gain':>6s} {'eval loss':>10s} "
          f"{'loss vs none':>12s} {'lookup ms':>10s}")
    for network in networks:
        none = ("none", network)
        for table in TABLES:
            config = (table, network)
            rate, loss = med(config, "examples_per_sec"), med(config, "eval_loss")
            vs = ("" if loss is None else
                  f"{(loss / med(none, 'eval_loss') - 1) * 100:+.1f}%")
            print(f"{network:10s} {table:>6s} {rate:11.0f} "
                  f"{rate / med(none, 'examples_per_sec'):5.2f}x "
                  f"{'n/a' if loss is None else f'{loss:.4f}':>10s} {vs:>12s} "
                  f"{med(config, 'lookup_ms'):10.2f}")


if __name__ == "__main__":
    main()

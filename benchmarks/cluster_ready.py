"""Time from the last process start to "cluster ready", scheduler path.

Starts 1 scheduler + 2 servers + 4 workers as separate processes on 127.0.0.1 (the
way tfpsx-run does), and measures, per round, from the moment the last process was
started until every server and worker has the full cluster from tfpsx.init(). Target on
the 2-core machine: under 2 s.

  python benchmarks/cluster_ready.py [--rounds 5] [--servers 2] [--workers 4]
"""

import argparse
import os
import re
import statistics
import sys
import tempfile
import time

from tfpsx.testing import LocalCluster

HERE = os.path.dirname(os.path.abspath(__file__))


def one_round(servers: int, workers: int, timeout: float = 60.0):
    with LocalCluster(os.path.join(HERE, "_ready_node.py"), servers, workers,
                      config_mode="scheduler", log_dir=tempfile.mkdtemp(prefix="tfpsx-bench-"),
                      timeout=timeout) as c:
        for task in c.tasks():
            c.start_task(*task)
        last_start = time.time()
        nodes = [t for t in c.tasks() if t[0] != "scheduler"]
        deadline = time.monotonic() + timeout
        ready = {}
        while len(ready) < len(nodes):
            if time.monotonic() > deadline:
                raise TimeoutError(f"cluster not ready in {timeout} s:\n{c.logs()}")
            for task in nodes:
                m = re.search(r"^READY ([\d.]+)", c.log(*task), re.M)
                if m:
                    ready[task] = float(m.group(1))
            time.sleep(0.02)
        sched = re.search(r"cluster ready: .* in ([\d.]+) s", c.log("scheduler", 0))
        return max(ready.values()) - last_start, float(sched.group(1)) if sched else float("nan")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--target", type=float, default=2.0)
    args = p.parse_args(argv)
    results = []
    print(f"cluster_ready: 1 scheduler + {args.servers} servers + {args.workers} workers, "
          f"{args.rounds} rounds, {os.cpu_count()} cores")
    for r in range(args.rounds):
        total, sched = one_round(args.servers, args.workers)
        results.append(total)
        print(f"  round {r}: last start -> every node has the cluster {total:.3f} s "
              f"(scheduler: first to last registration {sched:.3f} s)", flush=True)
    median = statistics.median(results)
    verdict = "meets" if median < args.target else "MISSES"
    print(f"cluster_ready: median {median:.3f} s, min {min(results):.3f}, max {max(results):.3f}; "
          f"{verdict} the {args.target:g} s target (ratio {median / args.target:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

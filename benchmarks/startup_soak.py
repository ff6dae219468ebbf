"""Start-up soak: many fresh jobs in a row, counting the parameter servers that die.

Each job is a whole `tfpsx-run` (scheduler, servers, workers) of an example, trained
briefly: ``--kind keras`` runs examples/keras_ctr (Keras 3 ``fit``; the modes in turn:
async, geo, sync, staleness), ``--kind graph`` examples/ctr_demo (graph mode, async and
geo). Cluster shapes cycle through 1-2 servers and 2-4 workers. Every process runs with
glibc's ``MALLOC_PERTURB_`` (``--perturb``; 0 turns it off), which fills freed memory so
that a use-after-free crashes at once instead of by chance. A server death is a job whose
launcher reports a server exiting on a signal or whose logs hold tfpsx's crash trace
(``fatal SIG...``); it is reported with the first lines of that trace.

Written for issue 25 (a PS SIGSEGV in TF's eager CreateContext at Keras start-up, about 1
start in 25 before the fix; docs/eager-anchor.md). Not a test: `make bench` runs a short
one, the issue's figure is 200 Keras and 100 graph starts:

  python benchmarks/startup_soak.py --kind keras --jobs 200
  python benchmarks/startup_soak.py --kind graph --jobs 100
"""

import argparse
import glob
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = [(1, 2), (2, 3), (1, 4), (2, 2), (1, 3), (2, 4)]
KINDS = {
    "keras": (os.path.join(ROOT, "examples", "keras_ctr", "train.py"),
              [["--mode", "async"], ["--mode", "geo", "--k_steps", "20"], ["--mode", "sync"],
               ["--mode", "staleness"]],
              ["--examples", "8192", "--epochs", "1", "--batch_size", "256", "--verbose", "0"]),
    "graph": (os.path.join(ROOT, "examples", "ctr_demo", "train.py"),
              [["--mode", "async"], ["--mode", "geo"]],
              ["--steps", "60", "--log_every", "1000"]),
}
DEATH = re.compile(r"server \d+ exited with code -\d+|fatal SIG[A-Z]+")


def run_job(index: int, kind: str, work: str, args) -> dict:
    script, modes, common = KINDS[kind]
    servers, workers = SHAPES[index % len(SHAPES)]
    mode = modes[index % len(modes)]
    logs = os.path.join(work, f"job{index:04d}")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    if args.perturb:
        env["MALLOC_PERTURB_"] = str(args.perturb)
    cmd = [sys.executable, "-m", "tfpsx.launcher.run", "--log_dir", logs,
           "--server_num", str(servers), "--worker_num", str(workers),
           "--timeout", str(args.timeout), script, *mode, *common]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=args.timeout + 60, cwd=work)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:  # the launcher's own --timeout failed to act
        rc, out = "hung", f"{e.stdout or ''}{e.stderr or ''}"
    text = out + "".join(open(p, errors="replace").read()
                         for p in glob.glob(os.path.join(logs, "*log*")))
    deaths = sorted(set(DEATH.findall(text)))
    trace = []
    if deaths:
        at = text.find("*** tfpsx: fatal")
        trace = text[at:].splitlines()[:8] if at >= 0 else []
    return {"job": index, "kind": kind, "mode": " ".join(mode), "servers": servers,
            "workers": workers, "rc": rc, "seconds": round(time.monotonic() - start, 1),
            "server_death": bool(deaths), "evidence": deaths, "trace": trace,
            "logs": logs}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kind", choices=sorted(KINDS), default="keras")
    p.add_argument("--jobs", type=int, default=20, help="job starts in all")
    p.add_argument("--parallel", type=int, default=1,
                   help="jobs at once (2 loads a 2-core machine as a busy CI does)")
    p.add_argument("--perturb", type=int, default=165, help="MALLOC_PERTURB_ (0: off)")
    p.add_argument("--timeout", type=int, default=300, help="seconds per job (tfpsx-run)")
    p.add_argument("--work_dir", default=None, help="where job logs go (a temp folder)")
    p.add_argument("--out", default=None, help="a JSON file for every job's record")
    args = p.parse_args()
    if args.jobs < 1 or args.parallel < 1:
        p.error(f"--jobs and --parallel must be >= 1, got {args.jobs} and {args.parallel}")
    work = args.work_dir or tempfile.mkdtemp(prefix="tfpsx-startup-soak-")
    os.makedirs(work, exist_ok=True)
    print(f"{args.jobs} {args.kind} job starts, {args.parallel} at a time, "
          f"MALLOC_PERTURB_={args.perturb or 'off'}; logs in {work}", flush=True)
    records, start = [], time.monotonic()
    with ThreadPoolExecutor(args.parallel) as pool:
        jobs = pool.map(lambda i: run_job(i, args.kind, work, args), range(args.jobs))
        for r, n in zip(jobs, itertools.count(1)):
            records.append(r)
            flag = ("SERVER DIED " + "; ".join(r["evidence"]) if r["server_death"]
                    else "ok" if r["rc"] == 0 else "failed (no server death)")
            print(f"[{n}/{args.jobs}] job {r['job']} {r['mode']} {r['servers']} PS "
                  f"{r['workers']} workers: rc {r['rc']} in {r['seconds']} s: {flag}", flush=True)
            for line in r["trace"]:
                print("    " + line, flush=True)
    deaths = [r for r in records if r["server_death"]]
    failed = [r for r in records if r["rc"] != 0 and not r["server_death"]]
    print(f"\n{args.kind}: {len(records)} job starts in {time.monotonic() - start:.0f} s; "
          f"server deaths: {len(deaths)}; other failures: {len(failed)}")
    for r in failed:
        print(f"  job {r['job']} ({r['mode']}, {r['servers']} PS {r['workers']} workers) "
              f"rc {r['rc']}: logs in {r['logs']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
    return 1 if deaths or failed else 0


if __name__ == "__main__":
    sys.exit(main())

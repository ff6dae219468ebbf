"""The worker cache: async training on 1 PS + 2 workers over a Zipf(1.1) id stream,
with and without ``cache_size``, on loopback and behind a 1 ms delay proxy.

One run, the same data for every configuration (benchmarks/_cache_job.py: 8 ids per
example from Zipf(1.1) over 1M ids, a DynamicEmbedding of dim 16 with Adagrad, a linear
layer; graph mode, async). Configurations are interleaved over the rounds, so machine
drift hits all alike. For each: examples/s summed over the workers' training loops, the
eval loss of the global model (the PS's rows) on held-out examples, and the median time
of one read-only lookup of a batch (the cache's rows, or a PS round trip). "delay" puts a
userspace proxy (benchmarks/netem.py) in front of every server, 0.5 ms each way: every
request a worker or the PS sends waits 1 ms more for its reply.

Targets (issue 13): the cache >= 2x examples/s at a final loss within 2%, and a larger
gain with the delay.

  python benchmarks/embedding_cache.py [--rounds 2] [--steps 300] [--cache_size 50000]
"""

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile

import portpicker

import tfpsx
from netem import DelayProxy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "benchmarks", "_cache_job.py")
ONE_WAY = 0.0005


def run(cache_size: int, one_way: float, args) -> dict:
    """One job; returns {examples_per_sec, eval_loss, lookup_ms}."""
    ports = [portpicker.pick_unused_port() for _ in range(3)]
    real = [f"127.0.0.1:{p}" for p in ports]  # ps, worker 0, worker 1
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as logs:
        seen = list(real)
        if one_way > 0:
            proxies = [stack.enter_context(DelayProxy(("127.0.0.1", p), one_way))
                       for p in ports]
            seen = [proxy.address for proxy in proxies]
        base = dict(os.environ, TFPSX_METRICS_DIR=logs, TF_CPP_MIN_LOG_LEVEL="2",
                    PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        # Each process dials the others through their proxies; its own entry is real.
        envs = [dict(base, TFPSX_ROLE="server", TFPSX_RANK="0", TFPSX_SERVER_ENDPOINTS=real[0],
                     TFPSX_WORKER_ENDPOINTS=",".join(seen[1:]))]
        for i in range(2):
            workers = [real[1 + j] if j == i else seen[1 + j] for j in range(2)]
            envs.append(dict(base, TFPSX_ROLE="worker", TFPSX_RANK=str(i),
                             TFPSX_SERVER_ENDPOINTS=seen[0],
                             TFPSX_WORKER_ENDPOINTS=",".join(workers)))
        cmd = [sys.executable, JOB, "--steps", str(args.steps), "--batch", str(args.batch),
               "--cache_size", str(cache_size), "--flush_steps", str(args.flush_steps)]
        procs = []
        try:
            for i, env in enumerate(envs):
                procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, text=True))
            outputs = [p.communicate(timeout=args.timeout)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(p.returncode for p in procs):
            raise RuntimeError(f"cache_size={cache_size} one_way={one_way} failed: "
                               + "\n".join(o[-3000:] for o in outputs))
        reports = [tfpsx.metrics.read(logs, "worker", i, "cache_bench")[-1] for i in range(2)]
    return {"examples_per_sec": sum(r["examples_per_sec"] for r in reports),
            "eval_loss": reports[0]["eval_loss"],
            "lookup_ms": statistics.mean(r["lookup_ms"] for r in reports)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=300, help="training steps per worker")
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--cache_size", type=int, default=50_000, help="5%% of the 1M ids")
    p.add_argument("--flush_steps", type=int, default=20)
    p.add_argument("--timeout", type=float, default=900)
    args = p.parse_args(argv)
    configs = [(0, 0.0), (args.cache_size, 0.0), (0, ONE_WAY), (args.cache_size, ONE_WAY)]
    results = {c: [] for c in configs}
    for r in range(args.rounds):
        for config in (configs if r % 2 == 0 else configs[::-1]):
            got = run(*config, args)
            results[config].append(got)
            cache, delay = config
            print(f"  round {r + 1}: {'cache' if cache else 'no cache':8s} "
                  f"{'+1 ms RTT' if delay else 'loopback':9s} "
                  f"{got['examples_per_sec']:9.0f} examples/s, eval loss "
                  f"{got['eval_loss']:.4f}, lookup {got['lookup_ms']:.2f} ms", flush=True)

    def med(config, key):
        return statistics.median(x[key] for x in results[config])

    print(f"\n{'network':10s} {'cache':>8s} {'examples/s':>11s} {'gain':>6s} {'eval loss':>10s} "
          f"{'loss vs none':>12s} {'lookup ms':>10s}")
    for delay in (0.0, ONE_WAY):
        none = (0, delay)
        for config in (none, (args.cache_size, delay)):
            rate, loss = med(config, "examples_per_sec"), med(config, "eval_loss")
            print(f"{'+1 ms RTT' if delay else 'loopback':10s} {config[0]:8d} {rate:11.0f} "
                  f"{rate / med(none, 'examples_per_sec'):5.2f}x {loss:10.4f} "
                  f"{(loss / med(none, 'eval_loss') - 1) * 100:+11.1f}% "
                  f"{med(config, 'lookup_ms'):10.2f}")


if __name__ == "__main__":
    main()

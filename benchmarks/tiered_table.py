"""A table larger than RAM (tfpsx.embedding.TieredBackend) against the same table all in
RAM: training steps/s, resident memory, disk I/O, checkpoint and restore times.

One process per (backend, dim), the same work in each (side by side, interleaved over
--rounds): a one-shard table with Adagrad is filled with --fill x ram_bytes of rows
(keys scrambled, so that no order of the keys helps the disk), then trained by lookup +
apply steps of --batch ids from two streams:
- "zipf": Zipf(1.1) ranks over the filled ids (truncated to them), 1% of each batch new
  ids (a CTR stream);
- "uniform": ids uniform over the filled ones (the worst case: every row equally cold).
Then a full export of the table (a checkpoint's rows) and an import of it (a restore).
Last, the store against RocksDB behind the same interface (tiered_store_peer.cc, built by
`make tier-peer`), in the table core: the same steps, RAM table and policy.

Reported per stream: steps/s (tiered / in RAM: the ratio), the table's resident memory
(the process's peak RSS less its RSS before the table existed, against ram_bytes), disk
bytes written per byte moved to disk, and read / write I/O per step (the tier's
counters); the export and import times against the disk's own sequential bandwidth
(dd with fdatasync to write, O_DIRECT to read).

  python benchmarks/tiered_table.py [--ram_mb 64] [--fill 10] [--dims 16,64]
      [--steps 300] [--batch 4096] [--rounds 1] [--dir build/bench/tier]
"""

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIX = 0x9E3779B97F4A7C15  # odd: i -> i * MIX mod 2^64 is a bijection (scrambled keys)


def status_kb(field):
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def child(args):
    """One backend, one dim: fill, two streams, export, import; prints a JSON line."""
    import numpy as np
    import tensorflow as tf

    from tfpsx import embedding as E
    from tfpsx.checkpoint import IncrementalSaver
    from tfpsx.ops import bindings

    tf.compat.v1.disable_eager_execution()
    record = 20 + 4 * 2 * args.dim  # key, step, freq, value, Adagrad's slot
    ram = args.ram_mb << 20
    rows = int(args.fill * ram / record)
    backend = (E.TieredBackend(args.dir, ram_bytes=ram) if args.backend != "ram" else None)
    table = E.DynamicTable("bench", args.dim, optimizer=E.Adagrad(0.05), devices=[None],
                           initializer=E.normal(stddev=0.01), backend=backend)
    step = tf.compat.v1.train.get_or_create_global_step()
    ids = tf.compat.v1.placeholder(tf.int64, [None])
    looked = table.lookup_unique(ids, step=step)
    grads = 0.01 * tf.sin(looked.unique_rows)
    with tf.control_dependencies([table.apply_gradients(looked, grads, step=step)]):
        train = step.assign_add(1)
    ahead = tf.compat.v1.placeholder(tf.int64, [None])
    prefetch = table.prefetch(ahead) if backend else None
    # A checkpoint as a job takes one: a full part of IncrementalSaver (a tiered table's
    # read in pages, a table in RAM whole), and its restore.
    saver = IncrementalSaver(full_every=2, tables=[table])
    tier = table.shards[0].tier_stats() if backend else tf.zeros([11], tf.int64)

    def scrambled(i):
        return (np.asarray(i, np.uint64) * np.uint64(MIX)).view(np.int64)

    rng = np.random.default_rng(7)
    fresh = [rows]

    # Zipf(1.1) over the filled ids: the inverse of its CDF on the finite support
    # (numpy's zipf draws from an unbounded one, and its draws past the last id, ~20% at
    # 2M ids, wrapped modulo the ids would make a fifth of the stream uniform).
    cdf = np.cumsum(np.arange(1, rows + 1, dtype=np.float64) ** -1.1)

    def batch(stream):
        if stream == "uniform":
            return scrambled(rng.integers(0, rows, args.batch))
        ranks = np.searchsorted(cdf, rng.random(args.batch) * cdf[-1])
        new = args.batch // 100
        ranks[:new] = np.arange(fresh[0], fresh[0] + new)  # ids never seen
        fresh[0] += new
        return scrambled(ranks)

    # Every feed made before the table: their memory is not the table's.
    feeds = {stream: [batch(stream) for _ in range(20 + args.steps)]
             for stream in ("zipf", "uniform")}
    cdf = None  # freed before the table: its memory is not the table's
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(train, {ids: scrambled(np.arange(rows, rows + 16))})  # TF's first-run costs
        base_kb = status_kb("VmRSS")
        t0 = time.perf_counter()
        fill_batch = max(1, min(8192, int(0.08 * ram / (record + 8))))
        for at in range(0, rows, fill_batch):
            sess.run(train, {ids: scrambled(np.arange(at, min(rows, at + fill_batch)))})
        out = {"rows": rows, "fill_s": time.perf_counter() - t0, "streams": {},
               "fill_peak_kb": status_kb("VmHWM") - base_kb}
        for stream in ("zipf", "uniform"):
            for f in feeds[stream][:20]:  # warm: the stream's hot rows in RAM
                sess.run(train, {ids: f})
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM from here: the stream's peak
            before = sess.run(tier)
            stream_feeds = feeds[stream][20:]
            t0 = time.perf_counter()
            if args.backend == "prefetch":
                # The next batch's rows asked for while this one trains (another thread:
                # a session runs ops of concurrent calls in parallel), as a worker's
                # input pipeline or a GEO round that knows its next keys would.
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    sess.run(prefetch, {ahead: stream_feeds[0]})
                    for i, f in enumerate(stream_feeds):
                        coming = (pool.submit(sess.run, prefetch, {ahead: stream_feeds[i + 1]})
                                  if i + 1 < len(stream_feeds) else None)
                        sess.run(train, {ids: f})
                        if coming is not None:
                            coming.result()
            else:
                for f in stream_feeds:
                    sess.run(train, {ids: f})
            took = time.perf_counter() - t0
            delta = dict(zip(bindings.TIER_STATS_FIELDS, (sess.run(tier) - before).tolist()))
            out["streams"][stream] = {
                "steps_per_s": args.steps / took,
                "peak_kb": status_kb("VmHWM") - base_kb,
                "rss_kb": status_kb("VmRSS") - base_kb,
                "accounted": int(sess.run(tier)[0]),
                "tier": delta,
            }
        def timed(fn):
            """(seconds, the process's peak RSS during fn less its RSS before)."""
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            before, t0 = status_kb("VmRSS"), time.perf_counter()
            fn()
            return time.perf_counter() - t0, status_kb("VmHWM") - before

        prefix = os.path.join(args.dir, "ckpt", "model")
        out["export_s"], out["export_peak_kb"] = timed(
            lambda: saver.save(sess, prefix, global_step=0))
        out["table_bytes"] = int(saver.last_save["rows"] * record)
        out["pages"] = saver.last_save["pages"]
        # A delta after 50 Zipf steps (a tiered table's in pages too), then a restore of
        # the chain (the full part and the delta).
        for f in feeds["zipf"][20:70]:
            sess.run(train, {ids: f})
        out["delta_s"], out["delta_peak_kb"] = timed(
            lambda: saver.save(sess, prefix, global_step=1))
        out["delta_rows"], out["delta_pages"] = saver.last_save["rows"], saver.last_save["pages"]
        out["import_s"], out["import_peak_kb"] = timed(lambda: saver.restore(sess, prefix + "-1"))
        out["end_tier"] = dict(zip(bindings.TIER_STATS_FIELDS, sess.run(tier).tolist()))
        out["peak_kb"] = status_kb("VmHWM") - base_kb
    print("RESULT " + json.dumps(out))


def run_child(backend, dim, args):
    directory = os.path.join(args.dir, f"{backend}_{dim}")
    shutil.rmtree(directory, ignore_errors=True)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--backend", backend,
           "--dim", str(dim), "--ram_mb", str(args.ram_mb), "--fill", str(args.fill),
           "--steps", str(args.steps), "--batch", str(args.batch), "--dir", directory]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    shutil.rmtree(directory, ignore_errors=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{backend} dim {dim} failed (rc {proc.returncode}):\n"
                       f"{proc.stderr[-3000:]}")


PEER_STORES = ("ours", "ours_prefetch", "rocksdb", "ram")


def run_peer(store, dim, args):
    """One run of the store peer (tiered_store_peer.cc): ours, rocksdb or ram; None when
    the binary was built without RocksDB."""
    directory = os.path.join(args.dir, f"peer_{store}_{dim}")
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    cmd = [args.peer, store, directory, str(args.ram_mb), str(args.fill), str(dim),
           str(args.steps), str(args.batch)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    shutil.rmtree(directory, ignore_errors=True)
    if proc.returncode == 2 and "unknown store" in proc.stderr:
        return None
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"peer {store} dim {dim} failed (rc {proc.returncode}):\n"
                       f"{proc.stderr[-3000:]}")


def peer_lines(args, dims):
    """The store against RocksDB behind the same interface, and the RAM table alone."""
    if not os.path.exists(args.peer):
        return ["", f"(No store peer: {args.peer} is not built; `make tier-peer` builds it.)"]
    results = {}
    for _ in range(args.rounds):
        for dim in dims:
            for store in PEER_STORES:
                results.setdefault((store, dim), []).append(run_peer(store, dim, args))
    lines = ["", "The store against RocksDB, in the table core without TensorFlow "
             "(benchmarks/tiered_store_peer.cc: the same RAM table, steps and spill policy; "
             "only where the rows go differs; the same Zipf stream; ours_prefetch: the next "
             "batch prefetched by a second thread, its reads without the table's lock):", "",
             "| dim | store | steps/s | / in RAM | rows faulted a step | rows in RAM | "
             "store's RAM count / ram_bytes | peak RSS / ram_bytes | written / spilled |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for dim in dims:
        base = statistics.median(r["steps_per_s"] for r in results[("ram", dim)])
        for store in PEER_STORES:
            runs = [r for r in results[(store, dim)] if r is not None]
            if not runs:
                lines.append(f"| {dim} | {store} | not built with RocksDB (librocksdb-dev) "
                             "| | | | | | |")
                continue
            sps = statistics.median(r["steps_per_s"] for r in runs)
            last = runs[-1]
            ram = args.ram_mb << 20
            tier = store != "ram"
            lines.append(
                f"| {dim} | {store} | {sps:.1f} | {sps / base:.2f} | "
                f"{last['faulted_per_step']:.0f} | {last['ram_rows']} | "
                + (f"{last['tier_ram_bytes'] / ram:.2f} | {last['peak_rss_kb'] * 1024 / ram:.2f} "
                   f"| {last['written_per_spilled']:.2f} |" if tier else "| | |"))
    return lines


def disk_bandwidth(directory, mb=1024):
    """(write MB/s with fdatasync, read MB/s with O_DIRECT) of `directory`'s disk."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "dd.test")
    speeds = []
    for cmd in (["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={mb}", "conv=fdatasync"],
                ["dd", f"if={path}", "of=/dev/null", "bs=1M", "iflag=direct"]):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, timeout=600)
        speeds.append(mb / (time.perf_counter() - t0))
    os.remove(path)
    return speeds


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backend", default="tiered", help=argparse.SUPPRESS)
    p.add_argument("--dim", type=int, default=16, help=argparse.SUPPRESS)
    p.add_argument("--dims", default="16,64")
    p.add_argument("--ram_mb", type=int, default=64, help="the shard's ram_bytes, MiB")
    p.add_argument("--fill", type=float, default=10, help="rows filled, x ram_bytes")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--dir", default=os.path.join(ROOT, "build", "bench", "tier"))
    p.add_argument("--out", default=os.path.join(ROOT, "build", "bench", "tiered_table.md"))
    p.add_argument("--peer", default=os.path.join(ROOT, "build", "native", "tiered_store_peer"),
                   help="the store peer's binary (make tier-peer)")
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    write_mb, read_mb = disk_bandwidth(args.dir)
    results = {}
    for _ in range(args.rounds):
        for dim in [int(d) for d in args.dims.split(",")]:
            for backend in ("ram", "tiered", "prefetch"):
                results.setdefault((backend, dim), []).append(run_child(backend, dim, args))
    lines = [f"# Tiered table vs all in RAM ({time.strftime('%Y-%m-%d')})", "",
             f"ram_bytes {args.ram_mb} MiB per shard, table {args.fill:g}x that, batch "
             f"{args.batch}, {args.steps} steps per stream, {args.rounds} round(s) (median); "
             f"disk: {write_mb:.0f} MB/s sequential write (fdatasync), {read_mb:.0f} MB/s "
             "read (O_DIRECT)", "",
             "RSS: the process's peak during the stream less its RSS before the table "
             "existed (after TF's first run); in RAM the same, over the table's rows' bytes.",
             "",
             "Prefetch: the next batch's rows asked for (table.prefetch) while a step "
             "trains, from another thread.", "",
             "| dim | stream | steps/s RAM | steps/s tiered | ratio | with prefetch | ratio | "
             "tiered peak RSS / "
             "ram_bytes | tier's own count / ram_bytes | RAM's peak RSS / rows' bytes | "
             "written / spilled | read per step | read calls per step | written per step |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
             "| ---: | ---: | ---: |"]
    ckpt = []
    for dim in [int(d) for d in args.dims.split(",")]:
        ram, tiered = results[("ram", dim)], results[("tiered", dim)]
        ahead = results[("prefetch", dim)]
        for stream in ("zipf", "uniform"):
            r = statistics.median(x["streams"][stream]["steps_per_s"] for x in ram)
            t = statistics.median(x["streams"][stream]["steps_per_s"] for x in tiered)
            a = statistics.median(x["streams"][stream]["steps_per_s"] for x in ahead)
            last = tiered[-1]["streams"][stream]
            io = last["tier"]
            steps = args.steps
            lines.append(
                f"| {dim} | {stream} | {r:.1f} | {t:.1f} | {t / r:.2f} | {a:.1f} | {a / r:.2f} | "
                f"{last['peak_kb'] * 1024 / (args.ram_mb << 20):.2f} | "
                f"{last['accounted'] / (args.ram_mb << 20):.2f} | "
                f"{ram[-1]['streams'][stream]['peak_kb'] * 1024 / ram[-1]['table_bytes']:.2f} | "
                f"{io['bytes_written'] / max(1, io['bytes_spilled']):.2f} | "
                f"{io['bytes_read'] / steps / 1e3:.0f} kB | {io['read_calls'] / steps:.0f} | "
                f"{io['bytes_written'] / steps / 1e3:.0f} kB |")
        tr, rr = tiered[-1], ram[-1]
        mb = tr["table_bytes"] / 1e6
        ram_b, record = args.ram_mb << 20, 20 + 4 * 2 * dim
        ckpt.append(f"| {dim} | {mb:.0f} MB | {rr['export_s']:.1f} s | {tr['export_s']:.1f} s "
                    f"({mb / tr['export_s']:.0f} MB/s, {tr['pages']} pages) | "
                    f"{rr['export_peak_kb'] * 1024 / tr['table_bytes']:.2f} | "
                    f"{tr['export_peak_kb'] * 1024 / ram_b:.2f} | {rr['import_s']:.1f} s | "
                    f"{tr['import_s']:.1f} s ({mb / tr['import_s']:.0f} MB/s) | "
                    f"{rr['import_peak_kb'] * 1024 / tr['table_bytes']:.2f} | "
                    f"{tr['import_peak_kb'] * 1024 / ram_b:.2f} | "
                    f"{tr['delta_rows']} rows: {rr['delta_s']:.2f} s / {tr['delta_s']:.2f} s "
                    f"({tr['delta_pages']} pages) | "
                    f"{rr['delta_peak_kb'] * 1024 / max(1, rr['delta_rows'] * record):.2f} | "
                    f"{tr['delta_peak_kb'] * 1024 / ram_b:.2f} | "
                    f"{tr['end_tier']['disk_rows']} of {tr['rows']} | "
                    f"{tr['end_tier']['index_bytes'] / max(1, tr['end_tier']['disk_rows']):.1f} |")
    lines += ["", "Checkpoint (a full part of IncrementalSaver: a tiered table's read in pages), "
              "then, after 50 Zipf steps, a delta (in pages too), and a restore of the chain "
              "(full part and delta, imported in pages for the tiered table); 'added peak': "
              "the process's peak RSS during it less its RSS before, against the table's "
              "bytes (in RAM; for the delta, its rows' bytes) and against ram_bytes "
              "(tiered):", "",
              "| dim | rows | save RAM | save tiered | added peak, RAM / table | added peak, "
              "tiered / ram_bytes | restore RAM | restore tiered | added peak, RAM / table | "
              "added peak, tiered / ram_bytes | delta: rows, RAM / tiered | delta added peak, "
              "RAM / its rows | delta added peak, tiered / ram_bytes | rows on disk after | "
              "index bytes per disk row |",
              "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
              "---: | ---: | ---: | ---: |"] + ckpt
    lines += peer_lines(args, [int(d) for d in args.dims.split(",")])
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
        f.write("\n<!-- raw: " + json.dumps({f"{b}_{d}": v for (b, d), v in results.items()})
                + " -->\n")


if __name__ == "__main__":
    main()

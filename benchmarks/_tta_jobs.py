"""The jobs of benchmarks/time_to_auc.py: how each runs a mode over a network and what
it reports.

Each job runs 1 PS + 2 workers (--servers, --workers) through ``_proxied.run_job``
(every process behind a delay proxy, its link; each proxy counts its bytes) and returns,
per run: the chief's quality points against training seconds (evaluation pauses left
out), the final quality of the shared model, examples/s of both workers, bytes between
the processes per step and worker (both directions).

* ``criteo``: examples/criteo (Wide&Deep over a DynamicEmbedding table, Keras 3 fit) on
  generated Criteo-format rows; quality: eval AUC (higher is better).
* ``word2vec``: examples/word2vec (skip-gram with negative sampling over two
  DynamicTable tables, graph mode) on a generated corpus of a 100,000-word vocabulary;
  quality: the loss on fixed eval pairs (lower is better). ``tf_async`` is the same
  model in plain TF async (``tf.Variable`` tables of the whole vocabulary on the PS,
  ``AdagradOptimizer``): benchmarks/word2vec_tf_async.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List

import tfpsx
from _proxied import ROOT, run_job


# Both examples take these flags: the modes every job runs.
# GEO's earlier rule, named key by key (geo10 / geo100 name none: tfpsx chooses by the
# worker count, the rule for many workers from 3; docs/modes.md "GEO at N workers").
EARLIER_GEO = ["--geo_table_rule", "average", "--geo_dense", "copies", "--geo_hot_count", "0"]
COMMON_MODES = {
    "sync": ["--mode", "sync"],
    "async": ["--mode", "async"],
    "geo10": ["--mode", "geo", "--k_steps", "10"],
    "geo100": ["--mode", "geo", "--k_steps", "100"],
    "geo400": ["--mode", "geo", "--k_steps", "400"],
}


# The cache's ceiling: every row stays on the worker once fetched and is never synced
# before the end: no cache design goes faster (what it costs the model's quality aside).
CEILING = ["--mode", "async", "--cache_size", "100000000", "--cache_flush_steps", "1000000000"]


def _cpu_ms_per_1k(reports, examples: float) -> float:
    """The workers' CPU (every thread's, while training) per 1,000 of the job's
    ``examples``: what a mode's steps cost them, which examples/s hides where the
    processes share the machine's cores."""
    return 1e6 * sum(r["cpu_seconds"] for r in reports) / max(1.0, examples)


def _bytes_per_step(job, steps: int, workers: int):
    """Bytes per step and worker between the processes: through the servers' and the
    workers' links (what a worker reads, what it pushes) and (the hybrid mode) the
    workers' all-reduce links."""
    total = job.server_bytes + job.worker_bytes + job.dense_bytes
    return total / max(1, steps * workers) if total else None


class CriteoJob:
    name, quality, higher_is_better = "criteo", "auc", True
    EXAMPLE = os.path.join(ROOT, "examples", "criteo")
    MODES = {
        **COMMON_MODES,
        "async_cache": ["--mode", "async", "--cache_size", "CACHE"],
        # (criteo: the dense weights stay async on the PS)
        "async_cache_ceiling": CEILING,
        # GEO's earlier rule (averaged rows, dense copies), beside the default's geo10 / geo100.
        # k_steps="auto": 8 rounds an epoch (at most 100).
        "geo_auto": ["--mode", "geo", "--k_steps", "auto"],
        # k_steps="auto" at 2 workers before K x N <= 20 (background rounds): K = 20.
        "geo20": ["--mode", "geo", "--k_steps", "20"],
        "geo10_earlier": ["--mode", "geo", "--k_steps", "10"] + EARLIER_GEO,
        # The rule without its hot rows by contention (geo_hot_per_round=0).
        "geo10_uncontended": ["--mode", "geo", "--k_steps", "10", "--geo_hot_per_round", "0"],
        "geo100_earlier": ["--mode", "geo", "--k_steps", "100"] + EARLIER_GEO,
        # The rule's parts alone (what each costs a step, what each buys).
        "geo10_dense_async": ["--mode", "geo", "--k_steps", "10", "--geo_table_rule",
                              "shared_slots", "--geo_dense", "async", "--geo_hot_count", "0"],
        "geo10_hot": ["--mode", "geo", "--k_steps", "10", "--geo_table_rule", "shared_slots",
                      "--geo_dense", "copies", "--geo_hot_count", "4"],
        "geo10_bf16": ["--mode", "geo", "--k_steps", "10", "--geo_wire_dtype", "bfloat16"],
        "geo100_bf16": ["--mode", "geo", "--k_steps", "100", "--geo_wire_dtype", "bfloat16"],
        "geo100_fp16": ["--mode", "geo", "--k_steps", "100", "--geo_wire_dtype", "float16"],
        # Every table in rounds (no choice), the slots in bfloat16 (the default) or float32.
        "geo10_rounds": ["--mode", "geo", "--k_steps", "10", "--geo_table_choice", "rounds"],
        "geo10_rounds_f32": ["--mode", "geo", "--k_steps", "10", "--geo_table_choice", "rounds",
                             "--geo_slot_wire_dtype", "float32"],
        # Every table in rounds, each round's pull only the changed rows the worker reads
        # before its next pull lands, every changed row after 8 such rounds.
        "geo10_rounds_ahead": ["--mode", "geo", "--k_steps", "10", "--geo_table_choice",
                               "rounds", "--geo_pull_ahead", "8"],
        "geo10_ahead": ["--mode", "geo", "--k_steps", "10", "--geo_pull_ahead", "8"],
        "geo100_cache": ["--mode", "geo", "--k_steps", "100", "--cache_size", "CACHE"],
        # A worker cache under GEO's rule (from 3 workers: rows with their slots, hot ids on
        # the PS) and under the earlier rule (what a cached table ran before).
        "geo10_cache": ["--mode", "geo", "--k_steps", "10", "--cache_size", "CACHE"],
        "geo10_cache_earlier": ["--mode", "geo", "--k_steps", "10", "--cache_size", "CACHE"]
        + EARLIER_GEO,
        # The hybrid mode: the table on the PS (async / GEO), dense weights all-reduced.
        "hybrid": ["--mode", "async", "--dense", "allreduce"],
        "hybrid_geo100": ["--mode", "geo", "--k_steps", "100", "--dense", "allreduce"],
        # The hybrid mode with a worker cache: no PS op in the step but the cache's misses.
        "hybrid_cache": ["--mode", "async", "--dense", "allreduce", "--cache_size", "CACHE"],
        "hybrid_cache_ceiling": CEILING + ["--dense", "allreduce"],
        "local": ["--mode", "local"],
        # The table on disk beyond --table_ram_bytes per shard (TieredBackend).
        "async_tiered": ["--mode", "async", "--table_ram_bytes", "TIER"],
        "geo_tiered": ["--mode", "geo", "--k_steps", "auto", "--table_ram_bytes", "TIER"],
    }

    def __init__(self, args):
        self.args = args

    def title(self) -> str:
        a = self.args
        return (f"examples/criteo Wide&Deep, {a.servers} PS + {a.workers} workers, "
                f"{a.train_rows} generated rows, {a.epochs} "
                f"epoch(s), batch {a.batch_size} per worker, cache {a.cache_size} rows")

    def data_dir(self) -> str:
        """Generated data of ``--train_rows`` training rows (made on first use)."""
        out = os.path.join(ROOT, "data", f"bench-criteo-{self.args.train_rows}")
        if not os.path.exists(os.path.join(out, "planted.json")):
            subprocess.run([sys.executable, os.path.join(self.EXAMPLE, "make_data.py"),
                            "--out", out, "--train_rows", str(self.args.train_rows),
                            "--eval_rows", "30000", "--files", "4"], check=True)
        return out

    def run(self, mode: str, one_way: float, rate) -> dict:
        a, data = self.args, self.data_dir()
        swap = {"CACHE": str(a.cache_size), "TIER": str(a.table_ram_bytes)}
        extra = [swap.get(x, x) for x in self.MODES[mode]]
        tier_dir = None
        if "TIER" in self.MODES[mode]:  # a folder per job: two jobs never share one
            tier_dir = tempfile.mkdtemp(prefix="tfpsx_tta_tier_")
            extra += ["--table_dir", tier_dir]
        cmd = [sys.executable, os.path.join(self.EXAMPLE, "train.py"), "--train_data",
               os.path.join(data, "train-*"), "--eval_data", os.path.join(data, "eval.txt"),
               "--epochs", str(a.epochs), "--batch_size", str(a.batch_size), "--verbose", "0",
               "--eval_every", str(a.eval_every), "--eval_rows", str(a.eval_rows)] + extra
        try:
            with run_job(cmd, servers=a.servers, workers=a.workers, one_way=one_way, rate=rate,
                         timeout=a.timeout) as job:
                reports = [tfpsx.metrics.read(job.logs, "worker", i, "criteo")[-1]
                           for i in range(a.workers)]
                steps = reports[0]["steps_per_epoch"]
                # (an input leased split by split knows no epoch length: the steps from
                # the examples the workers trained, equal shares)
                steps = (steps * a.epochs if steps else round(
                    reports[0]["examples_per_sec"] * reports[0]["seconds"] /
                    (a.batch_size * a.workers)))
                # The chief's rate counts every worker's examples (equal steps on each).
                return {"examples_per_sec": reports[0]["examples_per_sec"],
                        "final": reports[0]["auc"], "seconds": reports[0]["seconds"],
                        "points": [{"seconds": p["seconds"], "value": p["auc"]}
                                   for p in reports[0]["points"]],
                        "bytes_per_step": _bytes_per_step(job, steps, a.workers),
                        "cpu_ms_per_1k": _cpu_ms_per_1k(
                            reports, reports[0]["examples_per_sec"] * reports[0]["seconds"]),
                        "table": {k: reports[0].get(k) for k in
                                  ("table_rows", "table_ram_bytes", "table_disk_rows")}}
        finally:
            if tier_dir:
                shutil.rmtree(tier_dir, ignore_errors=True)


class Word2vecJob:
    name, quality, higher_is_better = "word2vec", "eval loss", False
    EXAMPLE = os.path.join(ROOT, "examples", "word2vec")
    PLAIN_TF = os.path.join(ROOT, "benchmarks", "word2vec_tf_async.py")
    MODES = {
        **COMMON_MODES,
        # The caches' rows staged STAGE batches per run of the stager (--w2v_stage_batches),
        # synced every 100 steps (the example's default) or 400.
        "async_cache": ["--mode", "async", "--cache_size", "CACHE", "--stage_batches", "STAGE"],
        "async_cache_flush400": ["--mode", "async", "--cache_size", "CACHE",
                                 "--stage_batches", "STAGE", "--cache_flush_steps", "400"],
        "async_cache_ceiling": CEILING + ["--stage_batches", "STAGE"],
        "geo100_cache": ["--mode", "geo", "--k_steps", "100", "--cache_size", "CACHE",
                         "--stage_batches", "STAGE"],
        # GEO's earlier rule, named (word2vec has no dense part).
        "geo100_earlier": ["--mode", "geo", "--k_steps", "100", "--geo_table_rule", "average",
                           "--geo_hot_count", "0"],
        # One batch per run of the stager.
        "async_cache_stage1": ["--mode", "async", "--cache_size", "CACHE"],
        "local": ["--mode", "local"],
        "tf_async": [],
        "geo_auto": ["--mode", "geo", "--k_steps", "auto"],
        "geo50": ["--mode", "geo", "--k_steps", "50"],
        "geo50_bf16": ["--mode", "geo", "--k_steps", "50", "--geo_wire_dtype", "bfloat16"],
        "geo100_bf16": ["--mode", "geo", "--k_steps", "100", "--geo_wire_dtype", "bfloat16"],
        "geo100_uncontended": ["--mode", "geo", "--k_steps", "100", "--geo_hot_per_round", "0"],
        # Every table in rounds (no choice), the slots in bfloat16 (the default) or float32.
        "geo10_rounds": ["--mode", "geo", "--k_steps", "10", "--geo_table_choice", "rounds"],
        "geo10_rounds_f32": ["--mode", "geo", "--k_steps", "10", "--geo_table_choice", "rounds",
                             "--geo_slot_wire_dtype", "float32"],
        # k=100, every table in rounds, with and without the rows too contended for a
        # round on the PS (issue 62: what a large k costs on this job)
        "geo100_rounds": ["--mode", "geo", "--k_steps", "100", "--geo_table_choice", "rounds"],
        "geo100_rounds_uncontended": ["--mode", "geo", "--k_steps", "100",
                                      "--geo_table_choice", "rounds", "--geo_hot_per_round", "0"],
        # The pull of the rows a worker will read (the batches' ids recorded ahead)
        "geo10_rounds_ahead": ["--mode", "geo", "--k_steps", "10", "--geo_table_choice",
                               "rounds", "--geo_pull_ahead", "8"],
        "geo_auto_ahead": ["--mode", "geo", "--k_steps", "auto", "--geo_pull_ahead", "8"],
    }

    def __init__(self, args):
        self.args = args

    def title(self) -> str:
        a = self.args
        return (f"examples/word2vec skip-gram, {a.servers} PS + {a.workers} workers, a "
                f"{a.w2v_topics * a.w2v_per_topic:,}-word "
                f"vocabulary ({a.w2v_sentences * 20:,} tokens), dim 64, batches of 512 pairs, "
                f"{a.w2v_seconds:g} s of training per worker (at most {a.w2v_steps} steps), "
                f"cache {a.w2v_cache_size} rows")

    def corpus(self) -> str:
        a = self.args
        folder = os.path.join(ROOT, "data", f"bench-w2v-{a.w2v_topics}x{a.w2v_per_topic}-"
                                            f"{a.w2v_sentences}")
        path = os.path.join(folder, "corpus.txt")
        if not os.path.exists(path):
            os.makedirs(folder, exist_ok=True)
            subprocess.run([sys.executable, os.path.join(self.EXAMPLE, "make_corpus.py"),
                            "--topics", str(a.w2v_topics), "--per_topic", str(a.w2v_per_topic),
                            "--sentences", str(a.w2v_sentences), "--out", path], check=True)
        return path

    def run(self, mode: str, one_way: float, rate) -> dict:
        a = self.args
        script = self.PLAIN_TF if mode == "tf_async" else os.path.join(self.EXAMPLE, "train.py")
        values = {"CACHE": str(a.w2v_cache_size), "STAGE": str(a.w2v_stage_batches)}
        extra = [values.get(x, x) for x in self.MODES[mode]]
        cmd = [sys.executable, script, "--corpus", self.corpus(), "--steps", str(a.w2v_steps),
               "--max_seconds", str(a.w2v_seconds), "--eval_every", str(a.eval_every)] + extra
        with run_job(cmd, servers=a.servers, workers=a.workers, one_way=one_way, rate=rate,
                     timeout=a.timeout) as job:
            reports = [tfpsx.metrics.read(job.logs, "worker", i, "word2vec")[-1]
                       for i in range(a.workers)]
            steps = max(r["steps"] for r in reports)
            return {"examples_per_sec": sum(r["examples_per_sec"] for r in reports),
                    "final": reports[0]["points"][-1]["loss"],
                    "seconds": reports[0]["seconds"],
                    "points": [{"seconds": p["seconds"], "value": p["loss"]}
                               for p in reports[0]["points"]],
                    "bytes_per_step": _bytes_per_step(job, steps, a.workers),
                    "cpu_ms_per_1k": _cpu_ms_per_1k(reports,
                                                    sum(r["examples"] for r in reports))}


JOBS: Dict[str, type] = {"criteo": CriteoJob, "word2vec": Word2vecJob}


def add_flags(p) -> None:
    """The jobs' own flags."""
    p.add_argument("--servers", type=int, default=1, help="parameter servers")
    p.add_argument("--workers", type=int, default=2, help="workers")
    p.add_argument("--train_rows", type=int, default=1_000_000, help="criteo")
    p.add_argument("--epochs", type=int, default=1, help="criteo")
    p.add_argument("--batch_size", type=int, default=512, help="criteo")
    p.add_argument("--cache_size", type=int, default=100_000, help="criteo")
    p.add_argument("--table_ram_bytes", type=int, default=32 << 20,
                   help="criteo *_tiered modes: RAM per table shard (default: a tenth of the "
                        "default job's table: 1.9M rows, ~320 MB in RAM)")
    p.add_argument("--eval_rows", type=int, default=10_000, help="criteo")
    p.add_argument("--w2v_topics", type=int, default=200, help="word2vec")
    p.add_argument("--w2v_per_topic", type=int, default=500, help="word2vec")
    p.add_argument("--w2v_sentences", type=int, default=50_000, help="word2vec (20 words each)")
    p.add_argument("--w2v_steps", type=int, default=4000,
                   help="word2vec, per worker: the batches sampled (a longer run repeats them)")
    p.add_argument("--w2v_seconds", type=float, default=15,
                   help="word2vec: each worker's training time (every mode the same)")
    p.add_argument("--w2v_cache_size", type=int, default=100_000,
                   help="word2vec: rows per table (the vocabulary: every word is hot)")
    p.add_argument("--w2v_stage_batches", type=int, default=8,
                   help="word2vec: batches a cache's stager stages per run")


def mode_names(job: str) -> List[str]:
    return list(JOBS[job].MODES)

"""Publishing for serving: a delta of the changed rows against a full export, side by
side in one process (Keras, no cluster).

A model of one ``DynamicEmbedding`` table of ``--rows`` keys (10M by default), dim
``--dim`` (16) with Adagrad, and a dense head. ``IncrementalCheckpoint(publisher=...)``
saves and publishes: the first save publishes a base (an ``export_serving``); then, each
round, ``--changed`` of the rows (1%) are written and one save publishes a delta.
Timed each round, interleaved:

- the delta's publish alone (read the part the save wrote, write the bundle), and the
  delta save with its publish (what a job with a publisher pays at a save);
- ``export_serving`` of the model (a full export: what publishing costs without deltas).

Also: the delta's bytes against its changed rows (keys and values: 8 + 4 dim bytes a
row) plus the dense weights; a follower (tfpsx/serving/follower.py, loaded from its
file) applying each delta to the base, timed, while a thread keeps predicting (batches
of 256 ids): its latencies during the apply against those between applies.

Targets (issue 63): a delta within 1.2x the bytes of its rows plus the weights; a delta
of 1% published in under 5% of a full export's time.

  python benchmarks/serving_deltas.py [--rows 10000000] [--dim 16] [--rounds 3]
"""

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import tempfile
import threading
import time

import keras
import numpy as np
import tensorflow as tf

import tfpsx
import tfpsx.keras
from tfpsx import embedding as E
from tfpsx.keras.checkpoint import IncrementalCheckpoint
from tfpsx.serving import Publisher
from tfpsx.serving.keras import delta_weights

FOLLOWER = os.path.join(os.path.dirname(os.path.abspath(tfpsx.__file__)), "serving",
                        "follower.py")


def build(dim: int):
    ids = keras.Input((1,), dtype="int64", name="ids")
    layer = tfpsx.keras.DynamicEmbedding(dim, table_name="bench_serving",
                                         optimizer=E.Adagrad(0.05),
                                         initializer=E.normal(stddev=0.01))
    hidden = keras.layers.Dense(64, activation="relu")(keras.layers.Flatten()(layer(ids)))
    model = keras.Model(ids, keras.layers.Dense(1, name="score")(hidden))
    model.compile("adam", "mse")
    model.predict(tf.zeros([1, 1], tf.int64), verbose=0)  # built
    model.optimizer.build(model.trainable_variables)  # its step names the saves
    return model, layer.table


def write_rows(table, keys: np.ndarray, dim: int, seed: int, chunk: int = 1 << 20):
    rng = np.random.default_rng(seed)
    for at in range(0, len(keys), chunk):
        part = keys[at:at + chunk]
        table.insert(part, rng.normal(size=(len(part), dim)).astype(np.float32))


def pct(values, q):
    return float(np.percentile(values, q)) if values else float("nan")


class Predictor:
    """Predicts batches of 256 ids through a follower's model, in a thread, timing each
    call (ms)."""

    def __init__(self, follower, rows: int):
        self.follower = follower
        self.ids = tf.constant(np.random.default_rng(5).integers(0, rows, (256, 1)), tf.int64)
        self.errors = 0
        self._thread = None

    def _loop(self, until) -> None:
        while not until():
            started = time.monotonic()
            try:
                self.follower.predict(ids=self.ids)
            except Exception:  # noqa: BLE001 — counted: the target is none
                self.errors += 1
            self._times.append(1000 * (time.monotonic() - started))

    def latencies(self, seconds: float):
        self._times = []
        end = time.monotonic() + seconds
        self._loop(lambda: time.monotonic() > end)
        return self._times

    def start(self) -> None:
        self._times, self._stop = [], threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(self._stop.is_set,))
        self._thread.start()

    def stop(self):
        self._stop.set()
        self._thread.join()
        return self._times


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--changed", type=float, default=0.01)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="tfpsx_bench_serving_")
    try:
        model, table = build(args.dim)
        keys = np.arange(args.rows, dtype=np.int64)
        write_rows(table, keys, args.dim, 0)
        served = os.path.join(work, "served")
        ckpt = IncrementalCheckpoint(os.path.join(work, "ckpt"), full_every=10 ** 6,
                                     max_to_keep=2, publisher=Publisher(served))
        ckpt.set_model(model)
        started = time.monotonic()
        ckpt.save(model)
        base = {"save_and_publish_s": time.monotonic() - started,
                "publish_s": ckpt.last_publish["seconds"],
                "bytes": ckpt.last_publish["bytes"]}
        print(f"base: {base}", flush=True)
        spec = importlib.util.spec_from_file_location("follower", FOLLOWER)
        follower = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(follower)
        started = time.monotonic()
        f = follower.Follower(served)
        load_s = time.monotonic() - started
        predictor = Predictor(f, args.rows)
        dense_bytes = sum(model.weights[int(n.rsplit("_", 1)[1])].numpy().nbytes
                          for n in delta_weights(model))
        changed = int(args.rows * args.changed)
        rng = np.random.default_rng(1)
        rounds = []
        for r in range(args.rounds):
            write_rows(table, rng.choice(keys, changed, replace=False), args.dim, 10 + r)
            model.optimizer.iterations.assign_add(1)
            started = time.monotonic()
            ckpt.save(model)
            save_s = time.monotonic() - started
            pub = ckpt.last_publish
            assert pub["kind"] == "delta" and pub["rows"] == changed, pub
            full_dir = os.path.join(work, f"full{r}")
            started = time.monotonic()
            tfpsx.export_serving(model, full_dir)
            full_s = time.monotonic() - started
            shutil.rmtree(full_dir)
            quiet = predictor.latencies(2.0)
            predictor.start()
            started = time.monotonic()
            assert f.catch_up() == 1
            apply_s = time.monotonic() - started
            during = predictor.stop()
            row_bytes = changed * (8 + 4 * args.dim) + dense_bytes
            rounds.append({"delta_publish_s": pub["seconds"], "delta_save_and_publish_s": save_s,
                           "full_export_s": full_s, "delta_bytes": pub["bytes"],
                           "rows_and_weights_bytes": row_bytes,
                           "bytes_ratio": pub["bytes"] / row_bytes,
                           "follower_apply_s": apply_s, "predictions_during_apply": len(during),
                           "predict_p50_ms_during_apply": pct(during, 50),
                           "predict_p99_ms_during_apply": pct(during, 99),
                           "predict_p99_ms_between_applies": pct(quiet, 99),
                           "predict_errors": predictor.errors})
            print(f"round {r}: {rounds[-1]}", flush=True)
        med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        summary = {"rows": args.rows, "dim": args.dim, "changed": changed, "base": base,
                   "medians": med,
                   "publish_vs_full": med["delta_publish_s"] / med["full_export_s"],
                   "save_and_publish_vs_full":
                       med["delta_save_and_publish_s"] / med["full_export_s"],
                   "follower_base_load_s": load_s}
        print(json.dumps(summary, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

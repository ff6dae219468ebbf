"""A Criteo-format CTR job: Wide&Deep or DeepFM, Keras 3 ``fit`` on tfpsx parameter servers.

  python examples/criteo/make_data.py --out data/criteo          # or the real Criteo files
  tfpsx-run --server_num 2 --worker_num 2 examples/criteo/train.py \\
      --train_data 'data/criteo/train-*' --eval_data data/criteo/eval.txt --mode geo
  python examples/criteo/train.py --mode local --train_data ... --eval_data ...   # no cluster
  # online: files that keep landing, published for a stock-TF follower (docs/criteo.md)
  tfpsx-run --server_num 1 --worker_num 2 examples/criteo/train.py --mode async \
      --input stream --train_data 'data/online/*/train-*.txt' --checkpoint_dir ckpt \
      --save_steps 200 --publish_dir models/ctr

The 26 categorical fields go through a ``tfpsx.keras.DynamicEmbedding`` table (ids
made field-aware, hashed, sharded over the parameter servers, trained there by Adagrad);
the 13 counts are ``log1p``-scaled (``criteo_model.py``; reading: ``criteo_data.py``).
Modes: sync, async, geo (``--k_steps``), staleness (``--max_staleness``) on
``tfpsx.keras.ParameterServerStrategy``, and local (the same code without a strategy; under
tfpsx-run every worker then trains alone on its part). Each epoch the chief prints the
eval AUC and log loss; at the end
``final eval: auc <A> logloss <L> examples/s <E>`` (the global model, every worker's
updates in). ``--checkpoint_dir``: the chief saves each epoch (tables incrementally) and a
restarted job resumes from the last one; ``--export_dir``: a SavedModel that serves in
plain TensorFlow; ``--tensorboard_dir``: loss, AUC, examples/s and the PS traffic as
TensorBoard scalars. Under ``tfpsx-run --evaluator`` (or a TF_CONFIG ``evaluator``
task) the evaluator evaluates each checkpoint of ``--checkpoint_dir`` on ``--eval_data``
until the chief's last one.
"""

import contextlib
import json
import os
import sys
import tempfile
import time

import keras
import numpy as np
import tensorflow as tf
from absl import app, flags

import tfpsx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import criteo_data  # noqa: E402
import criteo_model  # noqa: E402
from make_data import auc, logloss  # noqa: E402

flags.DEFINE_string("train_data", None, "Criteo-format training files: paths or globs, "
                    "comma-separated")
flags.DEFINE_string("eval_data", None, "Criteo-format eval files (the chief evaluates them)")
flags.DEFINE_enum("mode", "geo", ["sync", "async", "geo", "staleness", "local"],
                  "training mode")
flags.DEFINE_enum("model", "wide_deep", list(criteo_model.MODELS), "the model")
flags.DEFINE_enum("dense", "ps", ["ps", "allreduce"],
                  "where the dense weights train: on the parameter servers in --mode, or "
                  "all-reduced among the workers every step (the hybrid mode: the tables "
                  "stay on the servers, --mode async or geo)")
flags.DEFINE_string("k_steps", "50", "geo: local steps between syncs, or 'auto' (8 rounds "
                    "an epoch)")


def k_steps():
    """--k_steps as the strategy takes it: an int, or "auto"."""
    if FLAGS.k_steps == "auto":
        return "auto"
    try:
        return int(FLAGS.k_steps)
    except ValueError:
        raise app.UsageError(f"--k_steps: an int >= 1 or 'auto', got {FLAGS.k_steps!r}")
flags.DEFINE_integer("max_staleness", 4, "staleness: steps a worker may run ahead")
flags.DEFINE_enum("geo_wire_dtype", "float32", ["float32", "bfloat16", "float16"],
                  "geo: the dtype table rows travel in")
flags.DEFINE_enum("geo_table_choice", None, ["auto", "rounds"],
                  "geo: 'auto' (each table runs rounds only while they move fewer bytes "
                  "than async) or 'rounds' (every table; default: tfpsx's choice by the "
                  "worker count)")
flags.DEFINE_enum("geo_slot_wire_dtype", None, ["float32", "bfloat16"],
                  "geo: the dtype a row's optimizer slots travel in under shared "
                  "slots (default: tfpsx's)")
flags.DEFINE_enum("geo_table_rule", None, ["average", "shared_slots"],
                  "geo: how the PS adds the workers' pushes of a row (default: tfpsx's "
                  "choice by the worker count; docs/modes.md)")
flags.DEFINE_enum("geo_dense", None, ["copies", "async"],
                  "geo: the dense weights async on the PS or as worker copies synced every "
                  "k_steps (default: tfpsx's choice by the worker count)")
flags.DEFINE_integer("geo_hot_count", None, "geo: ids seen this often in a batch train on "
                     "the PS (0: none; default: tfpsx's choice by the worker count)")
flags.DEFINE_integer("geo_hot_per_round", None, "geo: ids the workers would train this "
                     "often in a round train on the PS (0: none; default: tfpsx's choice by "
                     "the worker count)")
flags.DEFINE_integer("geo_pull_ahead", None, "geo: S >= 1 pulls only the changed rows the "
                     "worker reads before its next pull lands (fit's input read ahead), "
                     "every changed row after S such rounds (default: tfpsx's, 0: every "
                     "changed row each round)")
flags.DEFINE_integer("cache_size", 0, "rows of a worker cache per table (0: none)")
flags.DEFINE_integer("table_ram_bytes", 0, "RAM of each table shard on its server; rows "
                     "beyond it live on the server's disk under --table_dir (0: all in RAM)")
flags.DEFINE_string("table_dir", os.path.join(tempfile.gettempdir(), "tfpsx_tables"),
                    "with --table_ram_bytes: the folder on each server's local disk")
flags.DEFINE_integer("cache_flush_steps", 100, "async / staleness: steps between the worker "
                     "cache's syncs with the PS")
flags.DEFINE_integer("epochs", 1, "epochs over each worker's part of the training data")
flags.DEFINE_integer("batch_size", 512, "examples per batch and worker")
flags.DEFINE_integer("dim", 16, "embedding width")
flags.DEFINE_list("hidden", ["256", "128"], "the deep part's layer widths")
flags.DEFINE_float("learning_rate", 1e-3, "Adam's, for the dense weights")
flags.DEFINE_float("table_learning_rate", 0.05, "Adagrad's, for the tables (on the PS)")
flags.DEFINE_integer("shuffle", 20000, "--input static: lines in the shuffle buffer (0: "
                     "read in order)")
flags.DEFINE_enum("input", "auto", ["auto", "splits", "static", "stream"],
                  "splits: the files leased split by split from PS 0 as each worker goes "
                  "(tfpsx.data.splits: every line trained once an epoch whatever happens, "
                  "its position in the checkpoint); static: each worker its fixed part; "
                  "auto: splits on a cluster with servers, except --dense allreduce; "
                  "stream: --train_data is a pattern of files that keep landing in folders "
                  "with a _SUCCESS marker (examples/criteo/land_data.py), trained as they "
                  "come until SIGTERM (tfpsx.data.stream; one endless epoch)")
flags.DEFINE_integer("split_bytes", 4 << 20, "--input splits: bytes of a file's split")
flags.DEFINE_integer("eval_rows", 0, "evaluate on the first N eval lines (0: all)")
flags.DEFINE_integer("eval_every", 0, "also evaluate every N steps (0: at epoch ends)")
flags.DEFINE_string("checkpoint_dir", None, "the chief saves here each epoch; a restarted "
                    "job resumes from it")
flags.DEFINE_integer("save_steps", 0, "with --checkpoint_dir: also save every N of the "
                     "chief's steps (0: at epoch ends only; a stream's epoch never ends)")
flags.DEFINE_float("save_seconds", 0, "with --checkpoint_dir: also save every N seconds "
                   "(0: not by time): an online job's freshness")
flags.DEFINE_string("publish_dir", None, "with --checkpoint_dir: publish each save for "
                    "serving (tfpsx.serving.Publisher: a base, then deltas of the changed "
                    "rows), which tfpsx/serving/follower.py serves with stock TF")
flags.DEFINE_string("export_dir", None, "a serving SavedModel (plain TF) at the end")
flags.DEFINE_string("tensorboard_dir", None, "TensorBoard scalars (loss, AUC, examples/s, "
                    "PS traffic) from the chief")
flags.DEFINE_integer("summary_steps", 50, "steps between TensorBoard writes")
flags.DEFINE_integer("verbose", 1, "Keras fit verbosity (1: progress bars)")
flags.DEFINE_integer("seed", 1, "shuffling and initialization seed")
FLAGS = flags.FLAGS

PROGRESS = "progress.json"


def strategy_for(mode: str):
    rule = {key: getattr(FLAGS, key) for key in ("geo_table_rule", "geo_dense", "geo_hot_count",
                                                 "geo_hot_per_round", "geo_slot_wire_dtype",
                                                 "geo_table_choice", "geo_pull_ahead")
            if getattr(FLAGS, key) is not None}  # unnamed: tfpsx's defaults
    configs = {"geo": {"k_steps": k_steps(), "geo_wire_dtype": FLAGS.geo_wire_dtype,
                       **rule},
               "staleness": {"max_staleness": FLAGS.max_staleness}}.get(mode, {})
    return tfpsx.keras.ParameterServerStrategy(tfpsx.DistributedStrategy(
        a_sync=mode != "sync", a_sync_configs=configs, dense=FLAGS.dense))


class Evaluation(keras.callbacks.Callback):
    """The chief's evaluation: AUC and log loss of the eval rows, at each epoch end (and
    every ``every`` steps), printed and kept as ``points`` (seconds of training so far,
    evaluation pauses excluded; step; auc; logloss)."""

    def __init__(self, eval_data, labels, every: int, summaries=None):
        super().__init__()
        self.data, self.labels, self.every = eval_data, labels, every
        self.summaries = summaries
        self.points = []
        self._steps = 0
        self._start = None
        self._paused = self._paused_cpu = 0.0

    def on_train_begin(self, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self._steps += 1
        if self.every and self._steps % self.every == 0:
            self.evaluate()

    def on_epoch_end(self, epoch, logs=None):
        a, l = self.evaluate()
        print(f"epoch {epoch + 1}: eval auc {a:.4f} logloss {l:.4f}", flush=True)

    def evaluate(self):
        begun, cpu_begun = time.perf_counter(), time.process_time()
        trained = begun - self._start - self._paused
        p = self.model.predict(self.data, verbose=0).ravel()
        a, l = auc(self.labels, p), logloss(self.labels, p)
        self._paused += time.perf_counter() - begun
        self._paused_cpu += time.process_time() - cpu_begun
        self.points.append({"seconds": trained, "step": self._steps, "auc": a, "logloss": l})
        tfpsx.metrics.emit("criteo_eval", **self.points[-1])
        if self.summaries is not None:
            self.summaries.scalars({"eval/auc": a, "eval/logloss": l}, self._steps)
        return a, l


class Progress(keras.callbacks.Callback):
    """The chief records the epochs done beside its checkpoints (a restarted job reads
    them to resume at the next epoch)."""

    def __init__(self, directory: str, first_epoch: int):
        super().__init__()
        self.directory, self.first = directory, first_epoch

    def on_epoch_end(self, epoch, logs=None):
        path = os.path.join(self.directory, PROGRESS)
        with open(path + ".tmp", "w") as f:
            json.dump({"epochs_done": epoch + 1}, f)
        os.replace(path + ".tmp", path)


def epochs_done(directory) -> int:
    path = os.path.join(directory, PROGRESS) if directory else None
    if not path or not os.path.exists(path):
        return 0
    with open(path) as f:
        return int(json.load(f)["epochs_done"])


def planted_model(patterns: str):
    """make_data.py's planted.json beside a single eval file, if there is one."""
    path = os.path.join(os.path.dirname(patterns), "planted.json")
    if "," in patterns or not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def eval_arrays(patterns: str, rows: int):
    """The eval rows as arrays (the chief predicts them in batches of 4096)."""
    data, _ = criteo_data.dataset(patterns, 1, flag="eval_data")
    data = data.unbatch()
    if rows:
        data = data.take(rows)
    features, labels = [], []
    for x, y in data.batch(8192):
        features.append(x)
        labels.append(y.numpy())
    merged = {k: tf.concat([f[k] for f in features], 0) for k in features[0]}
    return tf.data.Dataset.from_tensor_slices(merged).batch(4096).cache(), \
        np.concatenate(labels)


def evaluator() -> int:
    """The evaluator task: the AUC and log loss of each checkpoint the chief writes, until
    its last one (TensorBoard scalars under --tensorboard_dir/evaluator)."""
    if not FLAGS.checkpoint_dir or not FLAGS.eval_data:
        raise app.UsageError("an evaluator task needs --checkpoint_dir (the chief's "
                             f"checkpoints, got {FLAGS.checkpoint_dir!r}) and --eval_data "
                             f"(got {FLAGS.eval_data!r})")
    keras.utils.set_random_seed(FLAGS.seed)
    model = criteo_model.build(FLAGS.model, FLAGS.dim, [int(h) for h in FLAGS.hidden],
                               FLAGS.table_learning_rate, FLAGS.learning_rate)
    eval_data, labels = eval_arrays(FLAGS.eval_data, FLAGS.eval_rows)

    def evaluate(m):
        p = m.predict(eval_data, verbose=0).ravel()
        return {"auc": auc(labels, p), "logloss": logloss(labels, p)}

    summaries = (os.path.join(FLAGS.tensorboard_dir, "evaluator") if FLAGS.tensorboard_dir
                 else None)
    model(next(iter(eval_data)))  # built: its tables and weights exist to restore into
    for record in tfpsx.keras.evaluate_checkpoints(model, FLAGS.checkpoint_dir,
                                                   evaluate=evaluate, summary_dir=summaries):
        print(f"evaluator: step {record['step']} auc {record['auc']:.4f} "
              f"logloss {record['logloss']:.4f}", flush=True)
    return 0


def table_backend():
    """The tables' backend: on disk beyond --table_ram_bytes per shard, or None (RAM)."""
    if FLAGS.table_ram_bytes < 0:
        raise app.UsageError(f"--table_ram_bytes must be >= 0 (0: all in RAM), got "
                             f"{FLAGS.table_ram_bytes}")
    if not FLAGS.table_ram_bytes:
        return None
    return tfpsx.embedding.TieredBackend(FLAGS.table_dir, FLAGS.table_ram_bytes)


def main(argv):
    del argv
    tf.get_logger().setLevel("ERROR")
    cluster = bool(os.environ.get("TF_CONFIG") or tfpsx.settings.raw("TFPSX_ROLE"))
    me, workers, strategy = 0, 1, None
    if cluster:
        tfpsx.init()
        if tfpsx.is_server():
            tfpsx.run_server()
            return 0
        if tfpsx.is_evaluator():
            return evaluator()
        tfpsx.init_worker()
        me, workers = tfpsx.worker_index(), tfpsx.worker_num()
        if FLAGS.mode != "local":
            strategy = strategy_for(FLAGS.mode)
    else:
        tfpsx.metrics.set_identity("local", 0)
    chief = me == 0
    keras.utils.set_random_seed(FLAGS.seed)
    # (A hybrid step all-reduces a batch of every worker: they read equal parts.)
    use_splits = FLAGS.input == "splits" or (
        FLAGS.input == "auto" and strategy is not None and FLAGS.dense == "ps")
    if FLAGS.input == "stream":  # files as they land, until SIGTERM
        if FLAGS.epochs != 1:
            raise app.UsageError(f"--input stream is one endless epoch: give --epochs 1, got "
                                 f"{FLAGS.epochs}")
        train = tfpsx.data.stream(FLAGS.train_data, criteo_data.parse, FLAGS.batch_size,
                                  split_bytes=FLAGS.split_bytes, poll_seconds=1.0)
        lines, steps = 0, None  # (unknown: no examples/s reported)
    elif use_splits:  # every line once an epoch, leased as each worker goes
        files = criteo_data.files_of(FLAGS.train_data, "train_data")
        train = tfpsx.data.splits(files, criteo_data.parse, FLAGS.batch_size,
                                  split_bytes=FLAGS.split_bytes, seed=FLAGS.seed,
                                  epochs=FLAGS.epochs)
        lines = sum(criteo_data.count_lines(f) for f in files)
        steps = None  # each worker's share of an epoch: as it goes
    else:
        train, steps = criteo_data.dataset(FLAGS.train_data, FLAGS.batch_size, workers, me,
                                           shuffle=FLAGS.shuffle, seed=FLAGS.seed + me)
        train, lines = train.repeat(), steps * FLAGS.batch_size * workers
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = criteo_model.build(FLAGS.model, FLAGS.dim, [int(h) for h in FLAGS.hidden],
                                   FLAGS.table_learning_rate, FLAGS.learning_rate,
                                   cache_size=FLAGS.cache_size or None,
                                   flush_steps=FLAGS.cache_flush_steps,
                                   backend=table_backend())

    callbacks = strategy.callbacks() if strategy else []
    first_epoch = 0
    if FLAGS.publish_dir and not FLAGS.checkpoint_dir:
        raise app.UsageError("--publish_dir publishes the chief's saves: give --checkpoint_dir")
    if FLAGS.save_steps < 0 or FLAGS.save_seconds < 0:
        raise app.UsageError(f"--save_steps and --save_seconds must be >= 0, got "
                             f"{FLAGS.save_steps} and {FLAGS.save_seconds}")
    if FLAGS.checkpoint_dir:
        saver = tfpsx.keras.IncrementalCheckpoint(
            FLAGS.checkpoint_dir, full_every=5,
            save_freq=FLAGS.save_steps or "epoch", save_seconds=FLAGS.save_seconds or None,
            publisher=tfpsx.serving.Publisher(FLAGS.publish_dir) if FLAGS.publish_dir else None)
        stream = FLAGS.input == "stream"  # (its position says where it is, not epochs)
        first_epoch = 0 if stream else epochs_done(FLAGS.checkpoint_dir)
        if chief:
            if saver.restore(model) is not None:
                print(f"resumed from {FLAGS.checkpoint_dir}" +
                      ("" if stream else f" after epoch {first_epoch}"), flush=True)
            callbacks += [saver] + ([] if stream else
                                    [Progress(FLAGS.checkpoint_dir, first_epoch)])
    summaries = None
    if chief and FLAGS.tensorboard_dir:
        summaries = tfpsx.keras.TrainingSummaries(FLAGS.tensorboard_dir, strategy=strategy,
                                                  every_steps=FLAGS.summary_steps,
                                                  examples_per_step=FLAGS.batch_size * workers)
        callbacks.append(summaries)
    if chief and FLAGS.verbose:
        # The progress bar before the evaluation: an epoch's bar ends before its AUC line.
        callbacks.append(keras.callbacks.ProgbarLogger())
    evaluation = None
    if chief and FLAGS.eval_data:
        eval_data, labels = eval_arrays(FLAGS.eval_data, FLAGS.eval_rows)
        evaluation = Evaluation(eval_data, labels, FLAGS.eval_every, summaries)
        callbacks.append(evaluation)

    start, cpu_start = time.perf_counter(), time.process_time()
    model.fit(train, epochs=FLAGS.epochs, steps_per_epoch=steps,
              initial_epoch=min(first_epoch, FLAGS.epochs), shuffle=False,
              verbose=FLAGS.verbose if chief else 0, callbacks=callbacks)
    seconds = time.perf_counter() - start
    # This process's CPU (every thread's) during fit: what the steps cost the worker,
    # which wall time hides where the workers share cores.
    cpu_seconds = time.process_time() - cpu_start
    if evaluation is not None:  # fit's own time: the chief's evaluation pauses excluded
        seconds -= evaluation._paused
        cpu_seconds -= evaluation._paused_cpu
    examples = max(0, FLAGS.epochs - first_epoch) * lines  # the job's, every worker's
    rate = examples / seconds if seconds > 0 else 0.0
    if strategy is not None:
        tfpsx.barrier_worker()  # every worker's last update is in: the global model
    if chief and FLAGS.checkpoint_dir:
        saver.save_if_changed(model)  # (and published) the other workers' last steps
    report = {"worker": me, "mode": FLAGS.mode, "dense": FLAGS.dense, "model": FLAGS.model,
              "k_steps": k_steps(),
              "cache_size": FLAGS.cache_size, "seconds": seconds, "examples_per_sec": rate,
              "cpu_seconds": cpu_seconds,
              "steps_per_epoch": steps,
              "input": FLAGS.input if FLAGS.input == "stream" else
              "splits" if use_splits else "static"}
    if use_splits or FLAGS.input == "stream":
        report["input_stats"] = tfpsx.data.input_stats()
    if strategy is not None and strategy.counters is not None:
        report.update({k: float(v) for k, v in strategy.counters.snapshot().items()})
    if chief:
        # The table on the servers: its rows, and the RAM its shards count (for a tiered
        # table: what counts against --table_ram_bytes) with the rows on their disks.
        table = model.get_layer("embedding").table
        stats = {k: int(v) for k, v in table.stats().items()}
        report.update(table_rows=stats["size"], table_ram_bytes=stats["bytes_used"])
        if FLAGS.table_ram_bytes:
            report["table_disk_rows"] = int(table.tier_stats()["disk_rows"])
    if chief and FLAGS.eval_data:
        p = model.predict(eval_data, verbose=0).ravel()
        a, l = auc(labels, p), logloss(labels, p)
        report.update(auc=a, logloss=l, points=evaluation.points)
        print(f"final eval: auc {a:.4f} logloss {l:.4f} examples/s {rate:.0f}", flush=True)
        planted = planted_model(FLAGS.eval_data)
        if planted and not FLAGS.eval_rows:
            print(f"planted model on the same rows (the best possible): auc "
                  f"{planted['planted_auc']:.4f} logloss {planted['planted_logloss']:.4f}",
                  flush=True)
        if summaries is not None:
            summaries.scalars({"eval/auc": a, "eval/logloss": l}, summaries.step)
    if chief and FLAGS.export_dir:
        path = tfpsx.export_serving(model, FLAGS.export_dir)
        print(f"exported a serving model to {path}", flush=True)
    tfpsx.metrics.emit("criteo", **report)
    if cluster:
        tfpsx.stop_worker()
    return 0


if __name__ == "__main__":
    flags.mark_flags_as_required(["train_data"])
    app.run(main)

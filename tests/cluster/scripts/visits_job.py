"""How many times each example is in the model: Keras fit on a tfpsx cluster, beside a
small model, trains a visit counter (tests/cluster/test_launcher.py, the data plane's
tests).

Every example carries a unique id; a ``DynamicEmbedding`` table "visits" (dim 1, SGD at
learning rate 1, rows starting at 0) is trained on the loss ``-row`` of each example's
id, so a row moves by exactly +1 each time a step that holds the example is applied to
the model. Restored and recovered like the model, its final rows say how many times each
example is in the model: 1 exactly once, 0 a skip, 2 a repeat. The chief writes them to
``<out>/visits.npz`` (ids, counts) once every worker is done; in the hybrid mode each
worker (a collective job's rank: no servers, the counter a dense weight) writes its own
copy of the dense weights to ``<out>/dense.<rank>.npz``.

  visits_job.py --out DIR [--mode async|geo|sync|staleness|hybrid|collective] [--examples N]
      [--epochs E]
      [--batch B]
      [--input shard|splits]             tfpsx.data.shard of arrays (a static cut), or
                                         tfpsx.data.splits of DIR/data/part-*.txt (the
                                         chief of a first run writes them; --split_bytes)
      [--checkpoint DIR --save_every S]  IncrementalCheckpoint every S batches; every
                                         worker calls restore(model) before fit
      [--die_after W:S[,W:S]]            worker W SIGKILLs itself after its S-th batch
                                         (S = end: once its fit ended; stopped: after its
                                         tfpsx.stop_worker()), the first time it runs (a
                                         marker in DIR)
      [--step_delay SEC]
      [--exact]                          --input splits with exact_saves (a save barrier)
      [--input stream]                   tfpsx.data.stream of DIR/stream/h*/part-*.txt (a
                                         folder ready with its _SUCCESS; the test lands
                                         them, write_files(first=...)), until SIGTERM
      [--publish DIR]                    with --checkpoint: a Publisher(DIR)
"""
import argparse
import os
import signal
import sys
import time

import keras
import numpy as np
import tensorflow as tf

import tfpsx
keras.config.disable_traceback_filtering()
from tfpsx import embedding as E

FEATURES = 4


class VisitCounter(keras.layers.Layer):
    """Passes the model's output through; its loss term moves each example's row by +1
    per trained visit (the loss's value stays 0: the reported loss is the model's).

    In a collective job (no servers, no tables) the rows are a dense weight of every
    rank, trained by the model's SGD(0.1) on 10 x the world size x the term: Keras
    scales a rank's loss by 1 / world size and the ranks' gradients are summed (a rank
    whose data ended adds zeros), so a visit still moves its row by exactly +1."""

    def __init__(self, examples=None, world=1, **kwargs):
        super().__init__(**kwargs)
        self.world = world
        if examples is None:
            self.visits = tfpsx.keras.DynamicEmbedding(1, table_name="visits",
                                                       optimizer=E.SGD(1.0),
                                                       initializer=E.zeros())
        else:
            self.counts = self.add_weight(shape=(examples, 1), initializer="zeros",
                                          name="counts")

    def call(self, inputs):
        out, ids = inputs
        if hasattr(self, "visits"):
            rows = tf.reduce_sum(self.visits(ids))
            self.add_loss(tf.stop_gradient(rows) - rows)
        else:
            rows = tf.reduce_sum(tf.gather(self.counts, tf.reshape(ids, [-1])))
            self.add_loss(10.0 * self.world * (tf.stop_gradient(rows) - rows))
        return out


def data(n: int):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(n, FEATURES)).astype(np.float32)
    y = (x @ np.linspace(-1, 1, FEATURES) > 0).astype(np.float32)[:, None]
    return {"x": x, "id": np.arange(n, dtype=np.int64)[:, None]}, y


def write_files(folder: str, n: int, files: int = 4, first: int = 0,
                marker: bool = False) -> None:
    """The examples ``first`` .. ``first + n - 1`` as text: a line "id x0 x1 x2 x3
    label", in ``files`` files (each written aside, then renamed into place); with
    ``marker``, the folder's _SUCCESS last (a stream's hour landed)."""
    features, label = data(first + n)
    os.makedirs(folder, exist_ok=True)
    for f in range(files):
        rows = range(first + f, first + n, files)
        with open(os.path.join(folder, f"part-{f}.txt.tmp"), "w") as out:
            for i in rows:
                out.write(" ".join([str(i)] + [f"{v:.6f}" for v in features["x"][i]] +
                                   [str(int(label[i, 0]))]) + "\n")
        os.replace(os.path.join(folder, f"part-{f}.txt.tmp"), os.path.join(folder, f"part-{f}.txt"))
    if marker:
        open(os.path.join(folder, "_SUCCESS"), "w").close()


def parse(lines):
    cols = tf.strings.to_number(tf.strings.split(lines, " ").to_tensor(), tf.float32)
    ids = tf.cast(tf.strings.to_number(tf.strings.split(lines, " ").to_tensor()[:, :1],
                                       tf.float64), tf.int64)
    return {"x": cols[:, 1:1 + FEATURES], "id": ids}, cols[:, 1 + FEATURES:]


def build(examples=None, world=1):
    x = keras.Input((FEATURES,), name="x")
    ids = keras.Input((1,), dtype="int64", name="id")
    out = keras.layers.Dense(1, activation="sigmoid")(keras.layers.Dense(8, "relu")(x))
    model = keras.Model({"x": x, "id": ids},
                        VisitCounter(examples, world, name="counter")([out, ids]))
    model.compile(keras.optimizers.SGD(0.1), "binary_crossentropy")
    return model


def publisher_of(folder):
    """A tfpsx.serving.Publisher of ``folder`` (None: none)."""
    return tfpsx.serving.Publisher(folder) if folder else None


class DieAfter(keras.callbacks.Callback):
    """SIGKILLs this process after its ``batches``-th batch (None: once its fit ended),
    once (a marker file)."""

    def __init__(self, batches, marker: str):
        super().__init__()
        self.batches, self.marker, self.seen = batches, marker, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.batches is not None and self.seen >= self.batches:
            self._die()

    def on_train_end(self, logs=None):
        if self.batches is None:
            self._die()

    def _die(self):
        if not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


def main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=["async", "geo", "sync", "staleness", "hybrid",
                                      "collective"], default="async")
    p.add_argument("--examples", type=int, default=6000)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch", type=int, default=50)
    p.add_argument("--chief_batch", type=int, default=None,
                   help="the chief's batch size (sync: its data ends first with a larger)")
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--save_every", type=int, default=10)
    p.add_argument("--die_after", default=None, help="W:S")
    p.add_argument("--step_delay", type=float, default=0.0)
    p.add_argument("--slow_worker", type=int, default=None,
                   help="this worker sleeps --slow_factor times --step_delay after each batch")
    p.add_argument("--slow_factor", type=float, default=1.0)
    p.add_argument("--input", choices=["shard", "splits", "stream"], default="shard")
    p.add_argument("--publish", default=None)
    p.add_argument("--split_bytes", type=int, default=20000)
    p.add_argument("--exact", action="store_true", help="splits(exact_saves=True)")
    args = p.parse_args(argv)

    collective = args.mode == "collective"
    tfpsx.init(is_collective=collective)
    if tfpsx.is_server():
        tfpsx.run_server()
        return 0
    tfpsx.init_worker()
    me = tfpsx.worker_index()
    # GEO: the table rule that sums the workers' row changes (the visit counter's +1s
    # add up at any worker count; 'average' would divide them by N); sync: the sum of a
    # step's gradients (the mean would divide them by the workers in the step, fewer at
    # the end of splits leased as each worker goes)
    configs = {"async": {}, "geo": {"k_steps": 5, "geo_table_rule": "shared_slots"},
               "sync": {"sync_reduction": "sum"},
               "staleness": {"max_staleness": 2}, "hybrid": {}, "collective": {}}[args.mode]
    # hybrid: the dense weights all-reduced among the workers, the table async on the PS
    strategy = tfpsx.keras.CollectiveStrategy() if collective else \
        tfpsx.keras.ParameterServerStrategy(
            tfpsx.DistributedStrategy(a_sync=args.mode != "sync", a_sync_configs=configs,
                                      dense="allreduce" if args.mode == "hybrid" else "ps"))
    with strategy.scope():
        model = build(args.examples if collective else None,
                      tfpsx.worker_num() if collective else 1)
    callbacks = strategy.callbacks()
    restored = None
    if args.checkpoint:
        saver = tfpsx.keras.IncrementalCheckpoint(args.checkpoint, full_every=3,
                                                  save_freq=args.save_every,
                                                  publisher=publisher_of(args.publish))
        restored = saver.restore(model)  # on every worker, as docs/recovery.md shows
        callbacks.append(saver)
    dies = dict(spec.split(":") for spec in (args.die_after or "").split(",") if spec)
    die = DieAfter(None if dies.get(str(me)) in ("end", "stopped") else
                   int(dies.get(str(me), 0)), os.path.join(args.out, f"died.{me}"))
    if dies.get(str(me)) not in (None, "stopped"):
        callbacks.append(die)
    if args.step_delay:
        delay = args.step_delay * (args.slow_factor if args.slow_worker == me else 1.0)
        callbacks.append(keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda *_, **__: time.sleep(delay)))
    if args.input == "splits":
        files = os.path.join(args.out, "data", "part-*.txt")
        batch = args.chief_batch if me == 0 and args.chief_batch else args.batch
        train = tfpsx.data.splits(files, parse, batch, split_bytes=args.split_bytes,
                                  seed=7, epochs=args.epochs, exact_saves=args.exact)
    elif args.input == "stream":
        files = os.path.join(args.out, "stream", "h*", "part-*.txt")
        train = tfpsx.data.stream(files, parse, args.batch, split_bytes=args.split_bytes,
                                  poll_seconds=0.2, exact_saves=args.exact)
    else:
        features, label = data(args.examples)
        train = tfpsx.data.shard(tf.data.Dataset.from_tensor_slices((features, label))).batch(
            args.batch)
    batches = []
    callbacks.append(keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda *_, **__: batches.append(1)))
    start = time.time()
    model.fit(train, epochs=args.epochs, verbose=0, callbacks=callbacks)
    seconds = time.time() - start
    if not collective:  # (a collective job's ranks end their fit together)
        tfpsx.barrier_worker()  # every worker's steps are in before the chief reads
    if args.mode in ("hybrid", "collective"):  # each worker's own copy of the weights
        np.savez(os.path.join(args.out, f"dense.{me}.npz"),
                 *[np.asarray(w) for layer in model.layers
                   if isinstance(layer, (keras.layers.Dense, VisitCounter))
                   for w in layer.weights if not isinstance(layer, VisitCounter)
                   or collective])
    if me == 0:
        counter = model.get_layer("counter")
        if collective:
            counts = np.asarray(counter.counts)[:, 0]
            np.savez(os.path.join(args.out, "visits.npz"), ids=np.arange(len(counts)),
                     counts=np.round(counts))
        else:
            rows = counter.visits.table.export()
            np.savez(os.path.join(args.out, "visits.npz"), ids=rows["keys"].numpy(),
                     counts=rows["values"].numpy()[:, 0])
    tfpsx.metrics.emit("visits", worker=me, restored=restored, seconds=seconds,
                       batches=len(batches),
                       rounds=tfpsx.metrics.snapshot().get("geo", {}).get("pushes", 0),
                       input=tfpsx.data.input_stats() if args.input != "shard" else {})
    tfpsx.stop_worker()
    if dies.get(str(me)) == "stopped":
        die._die()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

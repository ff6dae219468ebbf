"""Keras 3 fit on a tfpsx cluster (tests/cluster/test_keras.py); one "keras" metrics record
per worker at the end.

  keras_job.py --mode async|sync|geo|staleness [--k_steps K] [--epochs E]
      a Wide&Deep-like model (dense features, a string-id DynamicEmbedding, a padded
      multi-hot DynamicEmbedding with a mean combiner) on a planted click model.
  keras_job.py --model linear --mode geo --k_steps K --syncs T --deterministic
      the linear regression of training_job.py, plain SGD, T syncs of K steps
      (graph-mode GEO's test schedule).
  keras_job.py --model linear --mode sync --steps S
      sync SGD: every step must average one gradient of each worker.
  --local      the same model code without a cluster (no tfpsx.init, no strategy).
  --uneven     worker 1 gets a third of worker 0's data (no tfpsx.data.shard).
  --save DIR   the chief saves DIR/model.keras and DIR/predictions.npy.
  --export DIR the chief exports DIR/model/1 (tfpsx.export_serving), DIR/feed.npz (ids
               seen in training and never seen) and DIR/predictions.npy (model.predict).
  --publish DIR with --checkpoint and --incremental: the chief's saves are published for
               serving into DIR (IncrementalCheckpoint(publisher=Publisher(DIR))), and once every
               worker's fit ended, its last steps too (the export then serves the same).
  --own_server each worker listens on 0.0.0.0 itself (a user's metrics server) and reports
               the addresses it listens on.
"""
import argparse
import contextlib
import faulthandler
import os
import signal
import socket
import sys
import time

import numpy as np
import keras
import tensorflow as tf

import tfpsx
from tfpsx.control import sockets
import training_job as linear

FEATURES, USERS, TAGS, WIDTH = 8, 200, 100, 4
faulthandler.register(signal.SIGUSR1)  # a hung test's stacks: kill -USR1 <pid>


def click_data(seed: int, n: int):
    """Dense features, a user id string, padded tags (-1) and a planted click label."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype(np.float32)
    users = rng.integers(0, USERS, size=n)
    tags = rng.integers(0, TAGS, size=(n, WIDTH))
    tags[rng.random((n, WIDTH)) < 0.3] = -1
    w = np.linspace(-1.5, 1.5, FEATURES).astype(np.float32)
    user_effect = np.where(users % 3 == 0, 2.0, -1.0)
    valid = tags >= 0
    tag_effect = np.where(valid, np.where(tags % 2 == 0, 1.5, -1.5), 0.0).sum(1) / np.maximum(
        valid.sum(1), 1)
    label = ((x @ w + user_effect + tag_effect) > 0).astype(np.float32)
    user_ids = np.array([f"user-{u}" for u in users], dtype=object)[:, None]
    return {"x": x, "user": user_ids, "tags": tags.astype(np.int64)}, label[:, None]


def wide_and_deep(cache_size=None, cache_table="", user_backend=None, constrain=False):
    cache = {"cache_size": cache_size, "flush_steps": 10} if cache_size else {}

    def cached(name):
        return cache if cache_table in ("", name) else {}

    x = keras.Input((FEATURES,), name="x")
    user = keras.Input((1,), dtype="string", name="user")
    tags = keras.Input((WIDTH,), dtype="int64", name="tags")
    user_emb = keras.layers.Flatten()(tfpsx.keras.DynamicEmbedding(
        8, optimizer=tfpsx.embedding.Adagrad(0.2), initializer=tfpsx.embedding.normal(stddev=0.05),
        name="user_emb", backend=user_backend, **cached("user_emb"))(user))
    tags_emb = tfpsx.keras.DynamicEmbedding(
        8, optimizer=tfpsx.embedding.Adagrad(0.2), combiner="mean", pad_id=-1,
        initializer=tfpsx.embedding.normal(stddev=0.05), name="tags_emb", **cached("tags_emb"))(tags)
    # (constrain: Keras applies a constraint by a read and an assign after each update)
    deep = keras.layers.Dense(16, activation="relu", kernel_constraint=(
        keras.constraints.MaxNorm(3.0) if constrain else None))(
        keras.layers.Concatenate()([x, user_emb, tags_emb]))
    logit = keras.layers.Add()([keras.layers.Dense(1)(deep), keras.layers.Dense(1)(x)])
    model = keras.Model({"x": x, "user": user, "tags": tags}, keras.layers.Activation("sigmoid")(logit))
    model.compile(keras.optimizers.Adam(0.02), "binary_crossentropy", steps_per_execution=2)
    return model


def linear_model():
    x = keras.Input((linear.DIM,))
    out = keras.layers.Dense(1, kernel_initializer="zeros", bias_initializer="zeros")(x)
    model = keras.Model(x, out)
    model.compile(keras.optimizers.SGD(linear.LR), "mse")
    return model


def linear_data(worker: int, steps: int):
    batches = list(linear.batches(worker, steps))
    return (np.concatenate([b[0] for b in batches]),
            np.concatenate([b[1] for b in batches])[:, None])


def export_serving(model, folder: str) -> None:
    """What a served model must predict: held-out clicks, half with ids never seen."""
    features, _ = click_data(99, 512)
    features["user"][::2] = np.array([f"new-user-{i}" for i in range(256)], object)[:, None]
    features["tags"][1::2] += 10_000
    os.makedirs(folder, exist_ok=True)
    np.save(os.path.join(folder, "predictions.npy"),
            model.predict({k: tf.constant(v) for k, v in features.items()}, verbose=0))
    np.savez(os.path.join(folder, "feed.npz"),
             **dict(features, user=features["user"].astype(bytes)))
    tfpsx.export_serving(model, os.path.join(folder, "model"))


def strategy_for(args):
    configs = {}
    if args.mode == "geo":
        configs = {"k_steps": args.k_steps, "geo_sync_in_train_thread": args.deterministic,
                   **linear.geo_rule_configs(args)}
        if args.geo_pull_ahead:
            configs["geo_pull_ahead"] = args.geo_pull_ahead
    if args.mode == "staleness":
        configs = {"max_staleness": args.max_staleness}
    partitioner = "auto"
    if args.partition:  # every weight of 2+ rows cut into that many slices
        partitioner = tf.distribute.experimental.partitioners.FixedShardsPartitioner(
            args.partition)
    elif args.partition_bytes:
        partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
            min_shard_bytes=args.partition_bytes, max_shards=tfpsx.server_num())
    return tfpsx.keras.ParameterServerStrategy(tfpsx.DistributedStrategy(
        a_sync=args.mode != "sync", a_sync_configs=configs), variable_partitioner=partitioner)


def partitioned(strategy):
    """{weight path: the devices of its slices} of the partitioned model weights."""
    mode = strategy._mode
    globals_ = ([v.global_ for v in mode.dense] if strategy.mode == "geo"
                else [v.global_ for v in mode.views.values()])
    return {g.slices[0].shared_name.rsplit("/part_", 1)[0]: g.devices for g in globals_
            if hasattr(g, "slices")}


class PauseAtEpochEnd(keras.callbacks.Callback):
    def __init__(self, seconds):
        super().__init__()
        self.seconds, self.epoch = seconds, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == 0 and batch + 1 == self.params["steps"]:
            print("LAST STEP DONE", flush=True)
            time.sleep(self.seconds)


class LastStepAfterChief(keras.callbacks.Callback):
    """A non-chief worker trains its last batches (one execution of the step) only once
    the chief's fit returned (the chief writes ``path`` then): its last steps land after
    every step of the chief."""

    def __init__(self, path, epochs, timeout=120.0):
        super().__init__()
        self.path, self.epochs, self.timeout, self.epoch = path, epochs, timeout, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        last = batch + (self.model.steps_per_execution or 1) >= self.params["steps"]
        if self.epoch + 1 == self.epochs and last:  # (the last execution's steps)
            deadline = time.monotonic() + self.timeout
            while not os.path.exists(self.path):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"waited {self.timeout:g} s for the chief's fit to "
                                       f"end ({self.path})")
                time.sleep(0.05)


def main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["async", "sync", "geo", "staleness"], default="async")
    p.add_argument("--model", choices=["wide_deep", "linear"], default="wide_deep")
    p.add_argument("--k_steps", type=lambda v: v if v == "auto" else int(v), default=10)
    linear.add_geo_rule_flags(p)
    p.add_argument("--geo_pull_ahead", type=int, default=0)
    p.add_argument("--max_staleness", type=int, default=2)
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--syncs", type=int, default=4)
    p.add_argument("--fit_steps", default="",
                   help="linear model: consecutive fits of these many steps (e.g. 8,8)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--examples", type=int, default=4096)
    p.add_argument("--local", action="store_true")
    p.add_argument("--uneven", action="store_true")
    p.add_argument("--save", default=None)
    p.add_argument("--export", default=None)
    p.add_argument("--publish", default=None)
    p.add_argument("--incremental", type=int, default=None,
                   help="with --checkpoint: tfpsx.keras.IncrementalCheckpoint, a full table "
                        "export every N saves")
    p.add_argument("--checkpoint", default=None,
                   help="the chief saves weights there every epoch (ModelCheckpoint) and, "
                        "when a file is there already, restores it before fit")
    p.add_argument("--step_delay", type=float, default=0.0)
    p.add_argument("--last_step_after_chief", default=None,
                   help="FILE: the chief writes it when its fit returns; the other workers "
                   "train their last batch after it is there")
    p.add_argument("--pause_at_epoch_end", type=float, default=0.0,
                   help="after the first epoch's last step (after every other callback), "
                   "print LAST STEP DONE and sleep this long, so that a test can kill a "
                   "server right before Keras's own wait at the epoch's end")
    p.add_argument("--cache_size", type=int, default=0,
                   help="a worker cache of that many rows on both tables (flushed every 10)")
    p.add_argument("--cache_table", default="", help="the cache on this table only")
    p.add_argument("--table_ram_bytes", type=int, default=0,
                   help="the users' table on the PS's disk beyond this RAM (TieredBackend)")
    p.add_argument("--table_dir", default="", help="with --table_ram_bytes: its folder")
    p.add_argument("--partition", type=int, default=0,
                   help="cut every weight into this many slices (FixedShardsPartitioner)")
    p.add_argument("--own_server", action="store_true")
    p.add_argument("--partition_bytes", type=int, default=0,
                   help="cut weights into slices of at least this many bytes, one per PS")
    p.add_argument("--constrain", action="store_true",
                   help="a MaxNorm constraint on the deep layer's kernel")
    args = p.parse_args(argv)

    me = 0
    if not args.local:
        tfpsx.init()
        if tfpsx.is_server():
            tfpsx.run_server()
            return 0
        tfpsx.init_worker()
        me = tfpsx.worker_index()
    own = None
    if args.own_server:  # the user's own server, on every interface as it asks
        own = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        own.bind(("0.0.0.0", 0))
        own.listen(1)
    strategy = None if args.local else strategy_for(args)
    with contextlib.nullcontext() if strategy is None else strategy.scope():
        backend = (tfpsx.embedding.TieredBackend(args.table_dir, args.table_ram_bytes)
                   if args.table_ram_bytes else None)
        model = (wide_and_deep(args.cache_size, args.cache_table, backend, args.constrain)
                 if args.model == "wide_deep"
                 else linear_model())

    callbacks = [] if strategy is None else strategy.callbacks()
    if args.checkpoint and args.incremental:
        saver = tfpsx.keras.IncrementalCheckpoint(args.checkpoint, full_every=args.incremental,
                                                  publisher=tfpsx.serving.Publisher(args.publish)
                                                  if args.publish else None)
        if me == 0:
            saver.restore(model)  # the job restarts from it, if any (published at fit)
        callbacks.append(saver)  # saves on the chief only
    elif args.checkpoint:
        path = os.path.join(args.checkpoint, "model.weights.h5")
        if me == 0 and os.path.exists(path):
            model.load_weights(path)  # the job restarts from it (published at fit)
        if me == 0:
            callbacks.append(keras.callbacks.ModelCheckpoint(path, save_weights_only=True))
    if args.step_delay:
        callbacks.append(keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda *_, **__: time.sleep(args.step_delay)))
    if args.last_step_after_chief and me != 0:
        callbacks.append(LastStepAfterChief(args.last_step_after_chief, args.epochs))
    if args.pause_at_epoch_end:
        callbacks.append(PauseAtEpochEnd(args.pause_at_epoch_end))
    start = time.time()
    if args.model == "linear":
        steps = args.k_steps * args.syncs if args.mode == "geo" else args.steps
        fits = [int(f) for f in args.fit_steps.split(",")] if args.fit_steps else [steps]
        steps = sum(fits)
        x, y = linear_data(me, steps)
        at = 0
        for n in fits:  # consecutive fits over the steps, in order
            rows = slice(at * linear.BATCH, (at + n) * linear.BATCH)
            history = model.fit(x[rows], y[rows], batch_size=linear.BATCH, epochs=1,
                                shuffle=False, verbose=0, callbacks=callbacks)
            at += n
        local_steps = steps
    else:
        features, label = click_data(1, args.examples)
        data = tf.data.Dataset.from_tensor_slices((features, label))
        if args.uneven:
            half, sixth = args.examples // 2, args.examples // 6
            data = data.take(half) if me == 0 else data.skip(half).take(sixth)
        elif not args.local:
            data = tfpsx.data.shard(data)
        examples = int(data.cardinality())
        held_out = click_data(7, 512)
        if args.checkpoint:
            report_start = float(model.evaluate(
                {k: tf.constant(v) for k, v in held_out[0].items()}, held_out[1], verbose=0))
        history = model.fit(data.batch(64), epochs=args.epochs, verbose=2, shuffle=False,
                            callbacks=callbacks, validation_data=tf.data.Dataset.from_tensor_slices(
                                held_out).batch(256))
        local_steps = args.epochs * -(-examples // 64)
    seconds = time.time() - start
    if args.last_step_after_chief and me == 0:
        with open(args.last_step_after_chief, "w") as f:
            f.write("the chief's fit returned")

    report = {"worker": me, "local_steps": local_steps, "seconds": seconds,
              "train_loss": [float(v) for v in history.history["loss"]]}
    if own is not None:
        port = own.getsockname()[1]
        report["own_server"] = sockets.listening([port]).get(port, [])
    if args.checkpoint:
        report["loss_before_fit"] = report_start
        report["val_loss"] = [float(v) for v in history.history["val_loss"]]
    if strategy is not None:
        report["mode"] = strategy.mode
        report["mode_state"] = list(strategy._mode.state.created)  # (tfpsx.modes.state)
        if strategy.counters is not None:
            report.update({name: int(strategy.counters.snapshot()[name]) for name in (
                "pushes", "rows_sent", "trained_rows", "hot_rows", "async_table_bytes",
                "hot_table_bytes", "table_bytes", "tables_async", "table_switches",
                "pulls_ahead", "rows_received")})
        report["staleness_waits"] = strategy.staleness_waits
        report["caches"] = {
            layer.name: {k: float(v) for k, v in layer.table.cache.stats().items()}
            for layer in model.layers
            if getattr(getattr(layer, "table", None), "cache", None) is not None}
        report["partitioned"] = partitioned(strategy)
        report["kernel_device"] = [l for l in model.layers if isinstance(
            l, keras.layers.Dense)][0].kernel.value.device
        tfpsx.barrier_worker()  # every worker's last push is in before the chief reads
        if args.publish:
            saver.save_if_changed(model)  # the others' last steps, published
        if args.publish and me == 0:
            report["published"] = saver.last_publish
        # The PS tables' optimizer slots (their mean, by table): in GEO they move only
        # when the rows travel with them (geo_table_rule="shared_slots").
        report["tiers"] = {
            layer.name: {k: int(v) for k, v in layer.table.tier_stats().items()}
            for layer in model.layers
            if isinstance(getattr(layer, "backend", None), tfpsx.embedding.TieredBackend)}
        report["ps_slot_means"] = {
            layer.name: float(tf.reduce_mean(layer.table.export()["slots"]))
            for layer in model.layers if getattr(layer, "table", None) is not None}
    iterations = model.optimizer.iterations
    if strategy is not None and strategy.mode == "geo":  # the global step, not this copy's
        mode = strategy._mode
        iterations = mode.step_pairs[0].global_ if mode.step_pairs else mode.global_step()
    report["iterations"] = int(iterations.numpy())
    if args.model == "linear":
        w, b = model.layers[-1].get_weights()
        if strategy is not None and strategy.mode == "geo":  # the global values, not a copy
            mode = strategy._mode
            w, b = (v.global_.numpy() for v in mode.dense)
        report.update(global_w=np.ravel(w).tolist(), global_b=float(np.ravel(b)[0]))
    else:
        features, label = click_data(99, 2048)
        features = {k: tf.constant(v) for k, v in features.items()}
        report["eval_loss"] = float(model.evaluate(features, label, verbose=0))
        if args.save and me == 0:
            os.makedirs(args.save, exist_ok=True)
            # (its tiered table fits in RAM: saved whole, as asked)
            with tfpsx.embedding.whole_table_saves():
                model.save(os.path.join(args.save, "model.keras"))
            np.save(os.path.join(args.save, "predictions.npy"),
                    model.predict(features, verbose=0))
            np.save(os.path.join(args.save, "eval_features.npy"),
                    {k: v.numpy() for k, v in features.items()}, allow_pickle=True)
        if args.export and me == 0:
            export_serving(model, args.export)
    if args.local:
        tfpsx.metrics.set_identity("local", 0)
    tfpsx.metrics.emit("keras", **report)
    if not args.local:
        tfpsx.stop_worker()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

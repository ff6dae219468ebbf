"""Keras 3 fit in a collective job (tests/cluster/test_collective.py).

  collective_job.py --out DIR [--epochs E] [--batch B] [--examples N]
      tfpsx.init(is_collective=True); a small dense regression, plain SGD, each rank
      seeded differently; rank r trains on rows r, r + W, ... (tfpsx.data.shard_arrays).
      Writes DIR/initial.<rank>.npy (the weights right after the model is built),
      DIR/steps.<rank>.npy (the weights after every step) and DIR/final.<rank>.npy.
  collective_job.py --local --out DIR ...
      no cluster: one process from DIR/initial.0.npy on the whole data, batch W * B
      (the concatenation of the ranks' batches); writes DIR/local.npy.
  collective_job.py --graph --out DIR ...
      the same model and steps in TF1 graph mode (tfpsx.distributed_optimizer with
      DistributedStrategy(collective=True), tfpsx.MonitoredTrainingSession); rank 0
      starts from DIR/initial.0.npy, the others from their own seeds; writes
      DIR/graph_final.<rank>.npy.
  --checkpoint DIR   rank 0 saves the weights and the epoch after every epoch and, when
                a checkpoint is there, restores it before fit (the others take its
                weights by the strategy's broadcast) and resumes from its epoch.
  --die_after_epoch N --die_marker FILE   rank 1 SIGKILLs itself once (FILE marks it)
                at the end of epoch N.
  --die_at_end  rank 1 SIGKILLs itself after fit, before stop_worker (rank 0 then waits
                for it in stop_worker).
  --embedding   adds a tfpsx.keras.DynamicEmbedding (refused in a collective job).
  --step_delay  seconds of sleep after every batch (fault tests).
"""
import argparse
import faulthandler
import os
import signal
import sys
import time

import numpy as np

faulthandler.register(signal.SIGUSR1)


def data(n):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    w = rng.normal(size=(8, 1)).astype(np.float32)
    return x, (x @ w + 0.1 * np.sin(3 * x[:, :1])).astype(np.float32)


def flat(model):
    return np.concatenate([np.asarray(w).ravel() for w in model.get_weights()])


def build(keras, embedding=False):
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="tanh")(inputs)
    if embedding:
        import tfpsx

        ids = keras.layers.Lambda(lambda x: keras.ops.cast(x[:, :1] > 0, "int64"))(inputs)
        emb = tfpsx.keras.DynamicEmbedding(4, name="emb")(ids)
        hidden = keras.layers.Concatenate()([hidden, keras.layers.Flatten()(emb)])
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


def main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--examples", type=int, default=512)
    p.add_argument("--workers", type=int, default=2, help="(--local) the job's world size")
    p.add_argument("--local", action="store_true")
    p.add_argument("--embedding", action="store_true")
    p.add_argument("--step_delay", type=float, default=0.0)
    p.add_argument("--graph", action="store_true")
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--die_after_epoch", type=int, default=None)
    p.add_argument("--die_marker", default=None)
    p.add_argument("--die_at_end", action="store_true")
    args = p.parse_args(argv)
    x, y = data(args.examples)

    if args.local:
        import keras

        model = build(keras)
        start = np.load(os.path.join(args.out, "initial.0.npy"))
        shapes = [w.shape for w in model.get_weights()]
        pieces = np.split(start, np.cumsum([int(np.prod(s)) for s in shapes])[:-1])
        model.set_weights([a.reshape(s) for a, s in zip(pieces, shapes)])
        model.fit(x, y, batch_size=args.workers * args.batch, epochs=args.epochs,
                  shuffle=False, verbose=0)
        np.save(os.path.join(args.out, "local.npy"), flat(model))
        return 0

    import tfpsx

    tfpsx.init(is_collective=True)
    tfpsx.init_worker()  # before any TF op: it starts this worker's collectives
    if args.graph:
        return graph(tfpsx, args, x, y)
    import keras

    rank = tfpsx.worker_index()
    strategy = tfpsx.keras.CollectiveStrategy()
    print(f"rank {rank} of {tfpsx.worker_num()}: {strategy!r}", flush=True)
    keras.utils.set_random_seed(100 + rank)  # differently seeded ranks
    with strategy.scope():
        model = build(keras, args.embedding)
    np.save(os.path.join(args.out, f"initial.{rank}.npy"), flat(model))
    steps = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            steps.append(flat(self.model))
            if args.step_delay:
                time.sleep(args.step_delay)

    callbacks = strategy.callbacks() + [Record()]
    initial_epoch = 0
    if args.checkpoint:
        weights = os.path.join(args.checkpoint, "model.weights.h5")
        done = os.path.join(args.checkpoint, "epoch.txt")
        if os.path.exists(done):
            initial_epoch = int(open(done).read())
            if rank == 0:
                model.load_weights(weights)  # the others take it from rank 0 at fit
            print(f"rank {rank} resumes at epoch {initial_epoch}", flush=True)

        class Save(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                if rank == 0:
                    self.model.save_weights(weights)
                    with open(done + ".tmp", "w") as f:
                        f.write(str(epoch + 1))
                    os.replace(done + ".tmp", done)

        callbacks.append(Save())
    if args.die_after_epoch is not None and rank == 1 and not os.path.exists(args.die_marker):
        class Die(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                if epoch + 1 == args.die_after_epoch:
                    time.sleep(1.0)  # rank 0's checkpoint of this epoch is written
                    open(args.die_marker, "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)

        callbacks.append(Die())
    xs, ys = tfpsx.data.shard_arrays(x, y)
    print("TRAINING", flush=True)
    history = model.fit(xs, ys, batch_size=args.batch, epochs=args.epochs, shuffle=False,
                        verbose=2, callbacks=callbacks, initial_epoch=initial_epoch)
    held_out = x[:64]
    np.save(os.path.join(args.out, f"eval.{rank}.npy"),
            np.array(model.evaluate(held_out, y[:64], verbose=0)))
    if rank == 0:  # every rank holds the same model: one exports it
        import tensorflow as tf

        path = tfpsx.export_serving(model, os.path.join(args.out, "export"))
        served = tf.saved_model.load(path).signatures["serving_default"]
        got = list(served(tf.constant(held_out)).values())[0].numpy()
        np.save(os.path.join(args.out, "served.npy"), got)
        np.save(os.path.join(args.out, "predicted.npy"), model.predict(held_out, verbose=0))
    np.save(os.path.join(args.out, f"steps.{rank}.npy"), np.stack(steps))
    np.save(os.path.join(args.out, f"final.{rank}.npy"), flat(model))
    print(f"rank {rank} loss {history.history['loss']}", flush=True)
    if args.die_at_end and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    tfpsx.stop_worker()
    return 0


def graph(tfpsx, args, x, y):
    import tensorflow as tf

    rank = tfpsx.worker_index()
    shapes = [(8, 16), (16,), (16, 1), (1,)]
    start = None
    if rank == 0:
        flat0 = np.load(os.path.join(args.out, "initial.0.npy"))
        start = np.split(flat0, np.cumsum([int(np.prod(s)) for s in shapes])[:-1])
    with tf.Graph().as_default():
        rng = np.random.default_rng(100 + rank)  # differently seeded ranks
        with tf.compat.v1.device(tfpsx.replica_device_setter()):
            weights = [tf.compat.v1.get_variable(
                f"w{i}", initializer=(start[i].reshape(s) if start is not None else
                                      rng.normal(size=s).astype(np.float32)), use_resource=True)
                for i, s in enumerate(shapes)]
            step = tf.compat.v1.train.get_or_create_global_step()
            xb = tf.compat.v1.placeholder(tf.float32, [None, 8])
            yb = tf.compat.v1.placeholder(tf.float32, [None, 1])
            hidden = tf.tanh(xb @ weights[0] + weights[1])
            loss = tf.reduce_mean(tf.square(hidden @ weights[2] + weights[3] - yb))
            opt = tfpsx.distributed_optimizer(tf.compat.v1.train.GradientDescentOptimizer(0.05),
                                              tfpsx.DistributedStrategy(collective=True))
            train = opt.minimize(loss, global_step=step)
        xs, ys = tfpsx.data.shard_arrays(x, y)
        with tfpsx.MonitoredTrainingSession() as sess:
            for _ in range(args.epochs):
                for i in range(0, len(xs), args.batch):
                    sess.run(train, {xb: xs[i:i + args.batch], yb: ys[i:i + args.batch]})
            final = sess.run(weights)
            steps = sess.run(step)
    np.save(os.path.join(args.out, f"graph_final.{rank}.npy"),
            np.concatenate([w.ravel() for w in final]))
    print(f"rank {rank} graph steps {steps}", flush=True)
    tfpsx.stop_worker()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

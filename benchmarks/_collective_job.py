"""One job of benchmarks/collective_scaling.py: a dense MLP regression in Keras 3 fit under
tfpsx.keras.CollectiveStrategy (run by tfpsx-run --server_num 0 --worker_num N). Rank 0
prints one line ``COLLECTIVE_RESULT {json}``: the wall time at the end of every epoch
(since fit began) with the eval loss then, examples/s over all workers, and the dense
gradient bytes of one step."""

import argparse
import json
import sys
import time

import numpy as np


def data(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 64)).astype(np.float32)
    w = np.random.default_rng(0).normal(size=(64, 1)).astype(np.float32)
    return x, (np.tanh(x @ w / 8) + 0.1 * np.sin(2 * x[:, :1])).astype(np.float32)


def main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--examples", type=int, default=65536)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--global_batch", type=int, default=256)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--threads", type=int, default=0, help="TF threads per worker (0: TF's)")
    args = p.parse_args(argv)

    import tensorflow as tf
    import tfpsx

    if args.threads:  # before init_worker creates the eager context
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)

    tfpsx.init(is_collective=True)
    tfpsx.init_worker()
    import keras

    rank, world = tfpsx.worker_index(), tfpsx.worker_num()
    strategy = tfpsx.keras.CollectiveStrategy()
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,))] + [
            keras.layers.Dense(args.hidden, activation="relu") for _ in range(3)] +
            [keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    x, y = data(args.examples, 1)
    xe, ye = data(8192, 2)
    xs, ys = tfpsx.data.shard_arrays(x, y)
    marks = []
    start = [0.0]

    class Mark(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            start[0] = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            at = time.perf_counter() - start[0]
            marks.append((at, float(self.model.evaluate(xe, ye, verbose=0, batch_size=4096))))

    model.fit(xs, ys, batch_size=args.global_batch // world, epochs=args.epochs,
              shuffle=False, verbose=0, callbacks=strategy.callbacks() + [Mark()])
    seconds = time.perf_counter() - start[0]
    dense = sum(int(np.prod(w.shape)) for w in model.trainable_weights)
    if rank == 0:
        print("COLLECTIVE_RESULT " + json.dumps({
            "world": world, "epochs": marks, "seconds": seconds,
            "examples_per_sec": args.epochs * len(xs) * world / seconds,
            "dense_params": dense}), flush=True)
    tfpsx.stop_worker()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

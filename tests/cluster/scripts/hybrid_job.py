"""The hybrid mode (tests/cluster/test_hybrid.py): a DynamicEmbedding table on the
parameter servers, every dense weight all-reduced among the workers.

  hybrid_job.py --out DIR [--tables async|geo] [--epochs E] [--graph]
      A regression on 8 dense features and one id (64 ids); rank r trains on rows r,
      r + W, ... (tfpsx.data.shard_arrays), and a row's id is its index mod 64, so with
      two workers rank 0 sees the even ids only and rank 1 the odd ones. Each rank is
      seeded differently. Writes DIR/initial.<rank>.npy (the dense weights right after
      the model is built), DIR/steps.<rank>.npy (after every step), DIR/final.<rank>.npy
      and, on rank 0 after fit, DIR/rows.npy (the table's 64 rows on the servers) and
      DIR/rows_before.npy (their initial values).
  --die_at_step N   rank 1 SIGKILLs itself at step N (the fault test).
  --graph       the same in TF1 graph mode (tfpsx.distributed_optimizer,
                tfpsx.MonitoredTrainingSession): writes the same files, graph_ prefixed.
"""
import argparse
import faulthandler
import os
import signal
import sys

import numpy as np

faulthandler.register(signal.SIGUSR1)

IDS, DIM = 64, 4


def data(n):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    ids = (np.arange(n) % IDS).astype(np.int64)
    w = rng.normal(size=(8, 1)).astype(np.float32)
    bias = rng.normal(size=(IDS, 1)).astype(np.float32)
    return x, ids, (x @ w + bias[ids]).astype(np.float32)


def dense_weights(model):
    return np.concatenate([np.asarray(w).ravel() for layer in model.layers
                           if layer.name.startswith("dense") for w in layer.get_weights()])


def backend(tfpsx, args):
    """The table's backend: tiered with --table_ram_bytes, else None (RAM)."""
    if not args.table_ram_bytes:
        return None
    return tfpsx.embedding.TieredBackend(args.table_dir, args.table_ram_bytes)


def main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tables", default="async", choices=["async", "geo"])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--examples", type=int, default=512)
    p.add_argument("--die_at_step", type=int, default=None)
    p.add_argument("--graph", action="store_true")
    p.add_argument("--table_ram_bytes", type=int, default=0,
                   help="the table on the PS's disk beyond this RAM (TieredBackend)")
    p.add_argument("--table_dir", default="", help="with --table_ram_bytes: its folder")
    args = p.parse_args(argv)
    import tfpsx

    tfpsx.init()
    if tfpsx.is_server():
        tfpsx.run_server()
        return 0
    tfpsx.init_worker()
    rank = tfpsx.worker_index()
    options = tfpsx.DistributedStrategy(
        a_sync=True, a_sync_configs={"k_steps": 4} if args.tables == "geo" else {},
        dense="allreduce")
    x, ids, y = data(args.examples)
    xs, idss, ys = tfpsx.data.shard_arrays(x, ids, y)
    if args.graph:
        return graph(tfpsx, options, args, rank, xs, idss, ys)
    import keras

    strategy = tfpsx.keras.ParameterServerStrategy(options)
    print(f"rank {rank}: {strategy!r} mode {strategy.mode}", flush=True)
    keras.utils.set_random_seed(100 + rank)  # differently seeded ranks
    with strategy.scope():
        dense_in = keras.Input((8,), name="x")
        id_in = keras.Input((1,), dtype="int64", name="id")
        table = tfpsx.keras.DynamicEmbedding(DIM, name="emb", optimizer=tfpsx.embedding.SGD(0.05),
                                             backend=backend(tfpsx, args))
        emb = keras.layers.Flatten()(table(id_in))
        hidden = keras.layers.Dense(16, activation="tanh", name="dense_1")(
            keras.layers.Concatenate()([dense_in, emb]))
        model = keras.Model([dense_in, id_in], keras.layers.Dense(1, name="dense_2")(hidden))
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    np.save(os.path.join(args.out, f"initial.{rank}.npy"), dense_weights(model))
    all_ids = np.arange(IDS, dtype=np.int64)
    if rank == 0:
        np.save(os.path.join(args.out, "rows_before.npy"), table.table.lookup(all_ids).numpy())
    steps = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            steps.append(dense_weights(self.model))
            if args.die_at_step is not None and rank == 1 and len(steps) == args.die_at_step:
                os.kill(os.getpid(), signal.SIGKILL)

    print("TRAINING", flush=True)
    model.fit({"x": xs, "id": idss[:, None]}, ys, batch_size=args.batch, epochs=args.epochs,
              shuffle=False, verbose=2, callbacks=strategy.callbacks() + [Record()])
    np.save(os.path.join(args.out, f"steps.{rank}.npy"), np.stack(steps))
    np.save(os.path.join(args.out, f"final.{rank}.npy"), dense_weights(model))
    loss = model.evaluate({"x": x, "id": ids[:, None]}, y, verbose=0)
    print(f"rank {rank} eval loss {loss:.5f}", flush=True)
    print(f"rank {rank} mode state {strategy._mode.state.created}", flush=True)
    if rank == 0:
        np.save(os.path.join(args.out, "rows.npy"), table.table.lookup(all_ids).numpy())
    tfpsx.stop_worker()
    return 0


def _dense(tf, x, units, name):
    with tf.compat.v1.variable_scope(name):
        w = tf.compat.v1.get_variable("kernel", [x.shape[-1], units],
                                      initializer=tf.compat.v1.glorot_uniform_initializer())
        b = tf.compat.v1.get_variable("bias", [units], initializer=tf.zeros_initializer())
    return tf.matmul(x, w) + b


def graph(tfpsx, options, args, rank, xs, idss, ys):
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    tf.compat.v1.set_random_seed(100 + rank)
    with tfpsx.model_scope(options):
        x = tf.compat.v1.placeholder(tf.float32, [None, 8])
        i = tf.compat.v1.placeholder(tf.int64, [None])
        y = tf.compat.v1.placeholder(tf.float32, [None, 1])
        table = tfpsx.embedding.DynamicTable("emb", DIM, optimizer=tfpsx.embedding.SGD(0.05),
                                             backend=backend(tfpsx, args))
        looked = table.lookup_unique(i)
        h = tf.tanh(_dense(tf, tf.concat([x, looked.embeddings], 1), 16, "dense_1"))
        out = _dense(tf, h, 1, "dense_2")
        loss = tf.reduce_mean(tf.square(out - y))
        step = tf.compat.v1.train.get_or_create_global_step()
        opt = tfpsx.distributed_optimizer(tf.compat.v1.train.GradientDescentOptimizer(0.05),
                                          options)
        train = tf.group(opt.minimize(loss, global_step=step), table.minimize(loss, [looked]))
    dense = [v for v in tf.compat.v1.trainable_variables() if v.name.startswith("dense")]
    flat = tf.concat([tf.reshape(v, [-1]) for v in dense], 0)
    all_ids = np.arange(IDS, dtype=np.int64)
    rows = table.lookup(tf.constant(all_ids))
    read_step = tf.compat.v1.train.get_global_step()
    steps = []
    n = len(xs) // args.batch
    with tfpsx.MonitoredTrainingSession() as sess:
        np.save(os.path.join(args.out, f"graph_initial.{rank}.npy"), sess.run(flat))
        if rank == 0:
            np.save(os.path.join(args.out, "graph_rows_before.npy"), sess.run(rows))
        for _ in range(args.epochs):
            for b in range(n):
                s = slice(b * args.batch, (b + 1) * args.batch)
                sess.run(train, {x: xs[s], i: idss[s], y: ys[s]})
                if args.die_at_step is not None and rank == 1 and len(steps) + 1 == args.die_at_step:
                    os.kill(os.getpid(), signal.SIGKILL)
                steps.append(sess.run(flat))
        np.save(os.path.join(args.out, f"graph_steps.{rank}.npy"), np.stack(steps))
        np.save(os.path.join(args.out, f"graph_final.{rank}.npy"), steps[-1])
        if rank == 0:
            np.save(os.path.join(args.out, "graph_rows.npy"), sess.run(rows))
        global_step = sess.run(read_step)
    print(f"rank {rank} graph steps {len(steps)} global_step {global_step}", flush=True)
    tfpsx.stop_worker()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

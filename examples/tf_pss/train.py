"""TF's own ParameterServerStrategy custom training loop, as TF's tutorial writes it.

No tfpsx import: it reads TF_CONFIG. The chief is the coordinator, workers and parameter
servers only serve (``server.join()`` never returns), and an optional evaluator evaluates
each checkpoint the chief writes until it has seen the last one. Run it with::

  tfpsx-run --no_scheduler --config tf_config --chief --evaluator \\
      --server_num 1 --worker_num 2 --server_grace 5 examples/tf_pss/train.py

The launcher ends the job when the chief ends and stops the processes that only serve.
"""

import argparse

import numpy as np
import tensorflow as tf

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=200)
p.add_argument("--steps_per_checkpoint", type=int, default=50)
p.add_argument("--checkpoint_dir", default="pss_checkpoints")
args = p.parse_args()

resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
FEATURES = 8
TRUE_W = np.arange(1, FEATURES + 1, dtype=np.float32) / FEATURES


def dataset(seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(4096, FEATURES)).astype(np.float32)
    y = (x @ TRUE_W + 0.5).astype(np.float32)
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(64)


class Linear(tf.Module):
    def __init__(self):
        super().__init__()
        self.w = tf.Variable(tf.zeros([FEATURES]), name="w")
        self.b = tf.Variable(0.0, name="b")

    def __call__(self, x):
        return tf.linalg.matvec(x, self.w) + self.b


if resolver.task_type in ("worker", "ps"):
    server = tf.distribute.Server(resolver.cluster_spec(), job_name=resolver.task_type,
                                  task_index=resolver.task_id,
                                  protocol=resolver.rpc_layer or "grpc", start=True)
    server.join()

elif resolver.task_type == "evaluator":
    # A side-car evaluator: TF's checkpoints_iterator yields each new checkpoint.
    model, step = Linear(), tf.Variable(0, dtype=tf.int64)
    checkpoint = tf.train.Checkpoint(model=model, step=step)
    x, y = next(iter(dataset(seed=99).take(1).unbatch().batch(4096)))
    for path in tf.train.checkpoints_iterator(args.checkpoint_dir, min_interval_secs=0.2,
                                              timeout=600):
        checkpoint.restore(path).expect_partial()
        mse = float(tf.reduce_mean((model(x) - y) ** 2))
        print(f"EVAL step {int(step)} mse {mse:.5f}", flush=True)
        if int(step) >= args.steps:
            break

else:  # the chief: the coordinator
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        model = Linear()
        optimizer = tf.keras.optimizers.SGD(0.05)
        step = tf.Variable(0, dtype=tf.int64)

    per_worker = coordinator.create_per_worker_dataset(
        lambda: strategy.experimental_distribute_dataset(dataset(seed=0)))
    per_worker_iterator = iter(per_worker)

    @tf.function
    def train_step(iterator):
        def replica_fn(batch):
            x, y = batch
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x) - y) ** 2)
            grads = tape.gradient(loss, [model.w, model.b])
            optimizer.apply_gradients(zip(grads, [model.w, model.b]))
            step.assign_add(1)
            return loss
        losses = strategy.run(replica_fn, args=(next(iterator),))
        return strategy.reduce(tf.distribute.ReduceOp.MEAN, losses, axis=None)

    checkpoint = tf.train.Checkpoint(model=model, step=step)
    manager = tf.train.CheckpointManager(checkpoint, args.checkpoint_dir, max_to_keep=3)
    done = 0
    while done < args.steps:
        n = min(args.steps_per_checkpoint, args.steps - done)
        for _ in range(n):
            loss = coordinator.schedule(train_step, args=(per_worker_iterator,))
        coordinator.join()
        done += n
        step.assign(done)
        manager.save(checkpoint_number=done)
        print(f"CHIEF step {done} loss {float(loss.fetch()):.5f}", flush=True)
    print(f"CHIEF done: w {[round(float(v), 2) for v in model.w.numpy()]} b {float(model.b):.2f}",
          flush=True)

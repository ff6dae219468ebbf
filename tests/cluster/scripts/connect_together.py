"""Keras workers whose eager contexts reach the servers at one instant
(tests/cluster/test_eager_anchor.py): the start-up that crashed a parameter server in TF's
CreateContext (docs/eager-anchor.md).

Each worker joins (init_worker), prints READY, waits for the file GO_FILE (the test writes
a start time into it once every worker is READY), sleeps until that instant and then
creates tfpsx.keras.ParameterServerStrategy (the eager connect) at once. It then builds a
Keras model in the scope (shared variables on the servers), fits two steps and runs ops of
many kinds on every server, so each server builds new kernels for this client's context:
a context holding a freed collective executor manager crashes its server there.
"""
import os
import sys
import time

import tfpsx

tfpsx.init()
if tfpsx.is_server():
    report = tfpsx.run_server()
    print(f"RUN_SERVER_RETURNED stopped={report.stopped} lost={report.lost}", flush=True)
    sys.exit(0)

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

tfpsx.init_worker()
print("READY", flush=True)
go = os.environ["GO_FILE"]
deadline = time.monotonic() + 120
while not os.path.exists(go) or not open(go).read().strip():
    if time.monotonic() > deadline:
        sys.exit("no start time in GO_FILE after 120 s")
    time.sleep(0.01)
at = float(open(go).read())
time.sleep(max(0.0, at - time.time()))
print(f"CONNECTING {time.time() - at:.3f} s after the start time", flush=True)
strategy = tfpsx.keras.ParameterServerStrategy()
print(f"CONNECTED {time.time() - at:.3f} s after the start time", flush=True)
with strategy.scope():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
for server in range(tfpsx.server_num()):
    with tf.device(f"/job:ps/task:{server}"):
        x = tf.reshape(tf.range(24, dtype=tf.float32), [4, 6]) + float(tfpsx.worker_index())
        for dtype in (tf.float32, tf.float64, tf.int32, tf.int64, tf.float16, tf.bfloat16):
            y = tf.cast(x, dtype) * tf.cast(2, dtype) + tf.cast(1, dtype)
            _ = tf.reduce_sum(tf.abs(y)).numpy()
        _ = tf.linalg.matmul(x, x, transpose_b=True).numpy()
history = model.fit(tf.ones([8, 6]), tf.ones([8, 1]), batch_size=4, epochs=1, verbose=0,
                    callbacks=strategy.callbacks())
print(f"WORKER_OK {tfpsx.worker_index()} loss {history.history['loss'][-1]:.4f}", flush=True)
tfpsx.stop_worker()

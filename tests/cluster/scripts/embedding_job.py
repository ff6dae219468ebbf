"""Workers share a DynamicTable shard on /job:ps/task:1 (placeholder-fed, so nothing
folds on the worker) and compare rows that two PS processes drew for the same keys."""
import sys

import numpy as np
import tensorflow as tf

import tfpsx
from tfpsx import embedding as E

tfpsx.init()
if tfpsx.is_server():
    tfpsx.run_server()
    sys.exit(0)

tfpsx.init_worker()
me = tfpsx.worker_index()
with tf.Graph().as_default():
    shared = E.DynamicTable("shared", 4, initializer=E.zeros(), devices=["/job:ps/task:1"])
    on_ps0 = E.DynamicTable("det", 4, initializer=E.normal(stddev=1.0), seed=11,
                                devices=["/job:ps/task:0"])
    on_ps1 = E.DynamicTable("det", 4, initializer=E.normal(stddev=1.0), seed=11,
                                devices=["/job:ps/task:1"])
    keys = tf.compat.v1.placeholder(tf.int64, [None])
    push = shared.accumulate(keys, tf.ones([tf.size(keys), 4]))
    read = shared.lookup(keys)
    rows0, rows1 = on_ps0.lookup(keys, train=True), on_ps1.lookup(keys, train=True)
    with tf.compat.v1.Session(tfpsx.server_target(), config=tfpsx.session_config()) as sess:
        sess.run(push, {keys: [100 + me, 500]})
        tfpsx.barrier_worker()
        seen = sess.run(read, {keys: [100, 101, 500]})
        r0, r1 = sess.run([rows0, rows1], {keys: np.arange(50) * 7919})
        tfpsx.barrier_worker()
tfpsx.metrics.emit("embedding", seen=seen[:, 0].tolist(), same_rows=bool((r0 == r1).all()),
                   distinct=bool(len({tuple(r) for r in r0}) == 50))
tfpsx.stop_worker()

"""Runs a tfpsx op placed on /job:ps/task:1 from a worker, fed by a placeholder (so
Grappler cannot fold it on the worker), and reports where it ran and what each PS holds."""

import tensorflow as tf

import tfpsx


def check_placement():
    ops = tfpsx.load_ops()
    graph = tf.Graph()
    with graph.as_default():
        delta = tf.compat.v1.placeholder(tf.int64, [])
        reads = {}
        for task in range(tfpsx.server_num()):
            with tf.compat.v1.device(f"/job:ps/task:{task}"):
                handle = ops.tfpsx_counter_handle_op(shared_name="placement/counter")
                reads[task] = ops.tfpsx_counter_read(handle)
                if task == 1:
                    add = ops.tfpsx_counter_add(handle, delta)
    with tf.compat.v1.Session(tfpsx.server_target(), graph=graph,
                              config=tfpsx.session_config()) as sess:
        options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE,
                                          timeout_in_ms=30000)
        metadata = tf.compat.v1.RunMetadata()
        values = [int(sess.run(add, {delta: d}, options=options, run_metadata=metadata))
                  for d in (3, 4)]
        devices = sorted({dev.device for dev in metadata.step_stats.dev_stats
                          for node in dev.node_stats if node.node_name.startswith("TfpsxCounterAdd")})
        held = {task: int(sess.run(read)) for task, read in reads.items()}
    return {"values": values, "add_devices": devices, "held": held}

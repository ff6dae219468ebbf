"""A plain TF between-graph script that knows nothing of tfpsx: it reads TF_CONFIG."""
import json
import os
import time

import tensorflow as tf

config = json.loads(os.environ["TF_CONFIG"])
spec = tf.train.ClusterSpec(config["cluster"])
task = config["task"]
server = tf.distribute.Server(spec, job_name=task["type"], task_index=task["index"])
if task["type"] == "ps":
    server.join()  # never returns: the launcher stops servers once the workers are done

with tf.Graph().as_default():
    with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
            cluster=spec, worker_device=f"/job:worker/task:{task['index']}")):
        total = tf.compat.v1.get_variable("total", [], tf.float32, tf.zeros_initializer(),
                                          use_resource=True)
        bump = total.assign_add(1.0)
    config_proto = tf.compat.v1.ConfigProto(
        device_filters=["/job:ps", f"/job:worker/task:{task['index']}"])
    with tf.compat.v1.Session(server.target, config=config_proto) as sess:
        if task["index"] == 0:
            sess.run(total.initializer)
        else:
            while not sess.run(tf.compat.v1.is_variable_initialized(total)):
                time.sleep(0.1)
        for _ in range(5):
            value = sess.run(bump)
print(f"PLAIN_TF worker {task['index']} of {len(spec.as_dict()['worker'])}: total {value}",
      flush=True)

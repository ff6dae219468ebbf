"""This worker's TF1 plumbing: the session config a worker's sessions need (device
filters; a joiner's cluster; the collective group leader) and the in-process
``tf.distribute.Server`` its graph-mode sessions run through."""

from __future__ import annotations

from tfpsx import cluster as _cluster
from tfpsx import settings
from tfpsx.control.ports import listening

# The job name a worker that joined a running job boots its graph-mode server with.
JOINER_JOB = "tfpsx_joiner"


def session_config(config: _cluster.ClusterConfig):
    """The ``tf.compat.v1.ConfigProto`` for this process's sessions."""
    import tensorflow as tf

    if config.collective:
        # Sessions run on this worker alone; its collectives reach the others through
        # the server init_worker() started, whose group leader is worker 0.
        proto = tf.compat.v1.ConfigProto(
            device_filters=[f"/job:{config.job_name}/task:{config.task_index}"])
        job, task = config.worker_device_job(0)
        proto.experimental.collective_group_leader = f"/job:{job}/replica:0/task:{task}"
        return proto
    # Without device filters a worker's master talks to every task and, measured, hung
    # in 4 of 6 runs; a worker needs only the servers and itself.
    filters = ["/job:ps"]
    if config.role == _cluster.WORKER:
        filters.append(f"/job:{config.job_name}/task:{config.task_index}")
    proto = tf.compat.v1.ConfigProto(device_filters=filters)
    if config.joined:
        # The servers started without this worker's address: the session carries its
        # cluster (TF's dynamic cluster), so each server's worker session for it can
        # reach it (its tensors, its devices). Its own server booted as JOINER_JOB.
        spec = tf.train.ClusterSpec({"ps": list(config.servers), config.job_name: {
            config.task_index: config.task_address()}})
        proto.cluster_def.CopyFrom(spec.as_cluster_def())
        # Without it the servers give such a session state of its own (measured: "Container
        # ps does not exist"): the model the other workers train would not be there.
        proto.experimental.share_session_state_in_clusterspec_propagation = True
    return proto


def start_graph_server(config: _cluster.ClusterConfig):
    """Starts this worker's ``tf.distribute.Server`` (its sessions' master)."""
    import tensorflow as tf

    from tfpsx import compat

    spec, job, task = config.cluster_spec(), config.job_name, config.task_index
    if config.joined:
        # Its sessions name it in their own cluster (session_config), which TF
        # refuses for the name the server booted with: it boots under another.
        spec, job, task = (tf.train.ClusterSpec({JOINER_JOB: [config.task_address()]}),
                           JOINER_JOB, 0)
    with listening(f"worker {config.index}", config.task_address()):
        return tf.distribute.Server(
            compat.server_def(spec, job, task, settings.get("TFPSX_LISTEN_PORT"),
                              session_config(config)), start=True)

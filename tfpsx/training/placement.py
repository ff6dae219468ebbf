"""Where variables go: on the parameter servers, balanced by bytes, large ones partitioned.

``replica_device_setter`` is TF's, for the resolved cluster, with a greedy by-bytes ps
strategy (TF 2 no longer ships contrib's); a mode's variable creator
(:mod:`tfpsx.training.modes`) adds worker-local copies where it needs them.
"""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from tfpsx.cluster.placement import GreedyByBytes
from tfpsx.runtime import RUNTIME


def replica_device_setter(ps_strategy=None, worker_device: Optional[str] = None):
    """TF's ``replica_device_setter`` for the resolved cluster.

    Variables go to the parameter servers, balanced by byte size (TF's
    ``GreedyLoadBalancingStrategy``), everything else to this worker. Use it with
    ``tf.compat.v1.device(...)``: TF 2.x's ``tf.device`` raises "tf.device does not support
    functions". Large variables: create them with ``variable_partitioner()`` so that their
    slices spread over the servers. ``tfpsx.session_config()`` holds the device filters
    this placement needs (``MonitoredTrainingSession`` applies them).

    Args:
      ps_strategy: a TF ps strategy (default: greedy load balancing by bytes).
      worker_device: default: this worker's ``/job:<job>/task:<i>``.
    """
    config = RUNTIME.require_role("replica_device_setter", "worker")
    if config.collective:
        return worker_device or worker_device_of(config)  # no servers: all on this worker
    if ps_strategy is None:
        ps_strategy = GreedyByBytes(config.server_num)
    return tf.compat.v1.train.replica_device_setter(
        cluster=config.cluster_spec(), worker_device=worker_device or worker_device_of(config),
        ps_strategy=ps_strategy)


def variable_partitioner(min_slice_bytes: int = 256 << 10, max_partitions: Optional[int] = None):
    """A partitioner that cuts a variable along axis 0 into slices of at least
    ``min_slice_bytes``, at most one per parameter server (``max_partitions``).

    Example:
      >>> with tf.compat.v1.variable_scope("emb", partitioner=tfpsx.variable_partitioner()):
      ...     table = tf.compat.v1.get_variable("table", [1_000_000, 64])
    """
    config = RUNTIME.require("variable_partitioner")
    if max_partitions is None:
        max_partitions = config.server_num
    if max_partitions < 1 or min_slice_bytes < 1:
        raise ValueError(f"variable_partitioner: max_partitions ({max_partitions}) and "
                         f"min_slice_bytes ({min_slice_bytes}) must be >= 1")
    return tf.compat.v1.min_max_variable_partitioner(max_partitions=max_partitions,
                                                      min_slice_size=min_slice_bytes)


def worker_device_of(config) -> str:
    """This worker's TF device, ``/job:<job>/task:<i>``."""
    return f"/job:{config.job_name}/task:{config.task_index}"

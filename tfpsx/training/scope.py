"""``model_scope``: where a model's variables and tables go, for a strategy's mode."""

from __future__ import annotations

import contextlib
from typing import Optional

import tensorflow as tf

from tfpsx.runtime import RUNTIME
from tfpsx.training import modes
from tfpsx.modes.strategy import DistributedStrategy


@contextlib.contextmanager
def model_scope(strategy: Optional[DistributedStrategy] = None):
    """Places the variables (and trains the tables) of a model built inside it for
    ``strategy`` (default: async).

    Every mode but the hybrid: ``replica_device_setter()`` (variables on the PS,
    balanced by bytes); hybrid (``dense="allreduce"``): every variable on this worker.
    GEO: each trainable variable is created on the PS under its own name (checkpoints are
    the same as in async mode) and the model reads a local copy ``<name>_geo_local`` on
    this worker; a ``DynamicTable`` built inside trains a worker-local copy table.
    sync: a ``DynamicTable`` built inside aggregates its row gradients on the PS.

    Raises:
      NotInitializedError / WrongRoleError: not a worker of an initialized cluster.
      ValueError: the graph already trains with other options, or options the cluster
        cannot run (e.g. sync's replicas_to_aggregate).
    """
    config = RUNTIME.require_role("model_scope", "worker")
    strategy = strategy or DistributedStrategy()
    mode = modes.mode_for(strategy, config)
    with tf.compat.v1.device(mode.placement()), mode.scope():
        yield

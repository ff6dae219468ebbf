"""``distributed_optimizer``: any ``tf.compat.v1.train`` optimizer, wrapped for a mode.

The mode decides (``Mode.wrap_optimizer``): async returns the optimizer as it is (its
apply ops run on the PS, where the variables are), GEO, sync and bounded staleness wrap
it in a :class:`WrappedOptimizer` subclass that changes only ``apply_gradients``.
"""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from tfpsx.modes.group import refuse_a_late_join
from tfpsx.runtime import RUNTIME
from tfpsx.training import modes
from tfpsx.modes.strategy import DistributedStrategy


def distributed_optimizer(optimizer, strategy: Optional[DistributedStrategy] = None):
    """Wraps a ``tf.compat.v1.train`` optimizer for ``strategy`` (default: async).

    Raises:
      NotInitializedError: before ``tfpsx.init()``.
      ValueError: an optimizer GEO cannot run locally, a strategy that is not a
        ``DistributedStrategy``, a sync ``replicas_to_aggregate`` or SyncReplicasOptimizer
        that does not fit the cluster's worker count.
    """
    config = RUNTIME.require("distributed_optimizer")
    strategy = strategy or DistributedStrategy()
    if not isinstance(strategy, DistributedStrategy):
        raise ValueError("distributed_optimizer: strategy must be a tfpsx.DistributedStrategy, "
                         f"got {type(strategy).__name__}")
    if not isinstance(optimizer, tf.compat.v1.train.Optimizer):
        raise ValueError("distributed_optimizer: optimizer must be a tf.compat.v1.train "
                         f"optimizer (e.g. AdagradOptimizer), got {type(optimizer).__name__}")
    refuse_a_late_join(strategy, config)
    return modes.mode_class(strategy, config).wrap_optimizer(optimizer, strategy, config)

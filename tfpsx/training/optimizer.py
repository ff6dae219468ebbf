"""``distributed_optimizer``: any ``tf.compat.v1.train`` optimizer, wrapped for a mode.

The mode decides (``Mode.wrap_optimizer``): async keeps the optimizer as it is (its
apply ops run on the PS, where the variables are), GEO, sync and bounded staleness wrap
it in a :class:`WrappedOptimizer` subclass that changes only ``apply_gradients``. Around
it, :class:`InputCommitting` adds to the training step the commit of the batch's input
position when the graph reads ``tfpsx.data.splits`` (``tfpsx.data.next_batch``), where
the mode says (:mod:`tfpsx.modes.positions`): after the update, or, in GEO, when the
round that holds the step is pushed.
"""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from tfpsx.modes.group import refuse_a_late_join
from tfpsx.modes.positions import commit_ops, positions_of_graph
from tfpsx.runtime import RUNTIME
from tfpsx.training import modes
from tfpsx.training.modes.base import WrappedOptimizer
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
    wrapped = modes.mode_class(strategy, config).wrap_optimizer(optimizer, strategy, config)
    return InputCommitting(wrapped, strategy)


class InputCommitting(WrappedOptimizer):
    """The mode's optimizer; its training step also commits the input positions of the
    batches the graph took from ``tfpsx.data.splits`` (none: nothing is added)."""

    def __init__(self, optimizer, strategy):
        super().__init__(optimizer, "")
        self._strategy = strategy

    def __getattr__(self, name):  # the mode's optimizer's own (counters, waits, ...)
        if name.startswith("__") or name in ("_opt", "_strategy"):
            raise AttributeError(name)
        return getattr(self._opt, name)

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        train = self._opt.apply_gradients(grads_and_vars, global_step=global_step, name=name)
        positions = positions_of_graph()
        if not positions:
            return train
        if self._strategy.mode == "sync":
            raise ValueError(
                "tfpsx.data.splits with graph-mode sync: a worker's gradient can be dropped "
                "as late (its batch then is not in the model), so its position cannot be "
                "committed with its step; train sync in Keras (tfpsx.keras."
                "ParameterServerStrategy, whose steps wait for their apply), or async or GEO "
                "in graph mode")
        mode = modes.mode_of()
        pending = getattr(mode, "positions", None)  # GEO: committed by the round's push
        with tf.control_dependencies([train]):
            commits = [pending.record(p) if pending is not None else commit_ops(p)
                       for p in positions]
        done = tf.group(train, *commits, name="train_and_commit")
        if hasattr(mode, "train_ops") and train in mode.train_ops:
            mode.train_ops.append(done)  # (GEO counts the runs of either as local steps)
        return done

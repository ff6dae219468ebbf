"""``tfpsx.keras.CollectiveStrategy``: Keras 3 ``model.fit`` with all-reduce among the
workers of a collective job (no parameter servers).

TF's own ``MultiWorkerMirroredStrategy`` + Keras 3 ``fit`` fails on TF 2.21 at the first
step (a ``PerReplica`` value Keras cannot convert). Here every worker runs its own
``fit`` under a one-replica ``tf.distribute`` strategy on its own device that says the
job has ``world size`` replicas in sync: Keras scales each worker's loss by
``1 / world size`` and asks the strategy to sum the gradients, which
:class:`tfpsx.modes.collective.CollectiveGroup` does with TF's collective ops, so every
worker applies the mean gradient of the global batch. A weight takes rank 0's initial
value when it is created (differently seeded ranks start equal);
``strategy.callbacks()`` broadcasts rank 0's weights again when ``fit`` starts (after
a checkpoint restored on rank 0 only). Loss and metrics in the logs are the worker's
own, of its own batches.

Example::

  tfpsx.init(is_collective=True)
  tfpsx.init_worker()              # before any TF op: starts this worker's collectives
  strategy = tfpsx.keras.CollectiveStrategy()
  with strategy.scope():
      model = build_model()
      model.compile(optimizer="adam", loss="binary_crossentropy")
  model.fit(tfpsx.data.shard(dataset).batch(256), epochs=3, callbacks=strategy.callbacks())
  tfpsx.stop_worker()
"""

from __future__ import annotations

from typing import Optional

import keras
import tensorflow as tf

from tfpsx import compat
from tfpsx.control.splits import split_position
from tfpsx.control.watchdog import translate_uncaught
from tfpsx.keras import idle
from tfpsx.keras.variables import fit_variables
from tfpsx.modes import lockstep
from tfpsx.modes.collective import REDUCIBLE, CollectiveGroup, from_rank_0, lost_peer_error
from tfpsx.modes.positions import check_feeds_splits, commit_from_python
from tfpsx.runtime import RUNTIME


class _CollectiveExtended(compat.OneDeviceExtended):
    """One replica on this worker, ``world size`` replicas in sync."""

    def __init__(self, container, device: str, group: CollectiveGroup):
        super().__init__(container, device)
        self.group = group
        self.reduced: Optional[int] = None  # values the training step all-reduces
        self._given = None  # the idle step's summed step (lockstep), while it is traced
        self._applied: list = []  # reads after the step's updates (its commit waits)
        self.shapes: Optional[list] = None  # the fit's trainable variables' shapes

    @property
    def _num_replicas_in_sync(self):
        return self.group.size

    def _create_variable(self, next_creator, **kwargs):
        var = super()._create_variable(next_creator, **kwargs)
        if var.dtype in REDUCIBLE:
            with tf.init_scope():
                var.assign(self.group.broadcast([var.read_value()])[0])
        return var

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        values = [value for value, _ in value_destination_pairs]
        # Keras scales the loss by 1 / world size and asks for the sum: a rank whose
        # data ended adds zeros, a batch of weight 0 (tfpsx.modes.lockstep).
        divide = self.group.size if reduce_op == tf.distribute.ReduceOp.MEAN else 1
        if self._given is not None:  # the idle step: the others' summed step
            tensors = [tf.convert_to_tensor(v) for v in values]
            return lockstep.apply_summed([(t.dtype, t.shape) for t in tensors], self._given,
                                         divide)
        self.reduced = len(values)
        # (the gradients of the model's trainable variables, in order, unless one has
        # none: their static shapes, which a traced gradient may lack)
        shapes = self.shapes if self.shapes and len(self.shapes) == len(values) else None
        return lockstep.reduce_in_step(values, self.group.total_in_step, divide,
                                       "collective all-reduce", shapes)

    def _update(self, var, fn, args, kwargs, group):
        result = super()._update(var, fn, args, kwargs, group)
        self._applied.append(var.read_value())  # (after the update: same resource)
        return result

    def _call_for_each_replica(self, fn, args, kwargs):
        def step(*step_args, **step_kwargs):
            # A batch of tfpsx.data.splits carries its input position: the model never
            # sees it; it is committed once the step's updates are applied on this rank
            # (every rank applies the same step: lockstep).
            position = None
            if step_args:
                data, position = split_position(step_args[0])
                step_args = (data,) + tuple(step_args[1:])
            self._applied = []
            outputs = fn(*step_args, **step_kwargs)
            if position is None or not self._applied:
                return outputs  # (an eval or predict step commits nothing)
            check_feeds_splits(None)
            with tf.control_dependencies(self._applied):
                commit = commit_from_python(position)
            with tf.control_dependencies([commit]):
                return tf.nest.map_structure(
                    lambda t: tf.identity(t) if isinstance(t, tf.Tensor) else t, outputs)

        return super()._call_for_each_replica(step, args, kwargs)

    def take_part_idle(self, model) -> int:
        """After this rank's ``fit`` ended well: it takes part in the steps of the ranks
        still training, idle, applying each with the model's optimizer, until every
        rank's data ended (:mod:`tfpsx.keras.idle`). Returns the steps applied."""
        def total(_, flat):
            with tf.device(self.group.device):
                return self.group.total_in_step(tf.constant(flat)).numpy()

        return idle.take_part_idle(model, self, self._container_strategy(), total,
                                   self.reduced, "collective", f"rank {self.group.rank}",
                                   "ranks")


class CollectiveStrategy(tf.distribute.OneDeviceStrategy):
    """Keras 3 ``fit`` / ``evaluate`` / ``predict`` on a collective job's workers.

    Needs ``tfpsx.init(is_collective=True)`` and ``tfpsx.init_worker()`` first. Build
    and compile the model in ``strategy.scope()``; pass ``strategy.callbacks()`` to
    ``fit``. Feed it with ``tfpsx.data.splits`` (a rank whose data ends first takes part
    in the others' steps with a batch of weight 0 until every rank's ended) or
    ``tfpsx.data.shard``.

    Raises:
      tfpsx.errors.NotInitializedError / WrongRoleError: no cluster, or not a worker.
      ValueError: the job is not collective (it has parameter servers), or the ranks
        disagree on the world size.
      RuntimeError: ``tfpsx.init_worker()`` was not called.
    """

    def __init__(self):
        config = RUNTIME.require_role("keras.CollectiveStrategy", "worker")
        if not config.collective:
            raise ValueError(
                f"tfpsx.keras.CollectiveStrategy() needs a collective job "
                f"(tfpsx.init(is_collective=True), no parameter servers); this one has "
                f"{config.server_num} server(s): use tfpsx.keras.ParameterServerStrategy")
        if not RUNTIME.worker_started:
            raise RuntimeError("tfpsx.keras.CollectiveStrategy() needs tfpsx.init_worker() "
                               "first (it starts this worker's collectives)")
        device = f"/job:{config.job_name}/replica:0/task:{config.task_index}/device:CPU:0"
        group = CollectiveGroup(config.index, config.worker_num, device)
        group.check_world("tfpsx.keras.CollectiveStrategy")
        RUNTIME.watch_peers()  # every peer answered: from now on a lost one is named
        # A collective that fails on a lost peer ends fit() uncaught: named, and the
        # process exits with the code a restart policy retries.
        translate_uncaught(_named_peer_loss)
        super().__init__(device)
        self._extended = _CollectiveExtended(self, device, group)

    @property
    def group(self) -> CollectiveGroup:
        return self._extended.group

    def callbacks(self) -> list:
        """The callbacks to pass to ``fit``: rank 0's weights everywhere when it starts."""
        return [_BroadcastAtStart(self)]

    def __repr__(self):
        return (f"tfpsx.keras.CollectiveStrategy(rank={self.group.rank}, "
                f"world_size={self.group.size})")


def _named_peer_loss(error: BaseException):
    config = RUNTIME.config
    return None if config is None or not config.collective else lost_peer_error(error, config)


class _BroadcastAtStart(keras.callbacks.Callback):
    """Rank 0's model and optimizer variables on every rank when ``fit`` starts."""

    def __init__(self, strategy: CollectiveStrategy):
        super().__init__()
        self._strategy = strategy

    def on_train_begin(self, logs=None):
        self._strategy.extended.shapes = [v.shape for v in self.model.trainable_variables]
        from_rank_0(fit_variables(self.model), lambda variables: (
            self._strategy.group.broadcast([v.value for v in variables])))

    def on_train_end(self, logs=None):
        # An input leased as each rank goes ends the ranks' data at different steps: this
        # rank takes part in the others' steps until every rank's ended.
        applied = self._strategy.extended.take_part_idle(self.model)
        lockstep.log_idle(("collective", f"rank {self._strategy.group.rank}", "ranks"), applied)

"""sync in graph mode: the protocol is :mod:`tfpsx.modes.sync`'s; this module is its
TF1 executor.

* Dense variables: :class:`SyncOptimizer` (what ``distributed_optimizer`` returns in
  sync) builds a training step that pushes the gradients, stamped with the worker's local
  step, into accumulators beside their variables; the wrapped optimizer applies their
  average (the chief, once per step).
* ``DynamicTable`` tables built in ``model_scope(sync)``: their row gradients go into
  their shards' accumulators; the chief applies the average with the table's
  server-side optimizer.

A session hook runs the rest of each step, one ``session.run`` per phase: after every
training run this worker marks its push; the chief waits for the gradients of the step
(polling PS 0), takes and applies their average, bumps the step (and ``global_step``)
in one run; every other worker waits until the step passed its own. A worker that ends
leaves the group; when the chief ends, the others' sessions stop. Every wait is bounded
by TFPSX_SYNC_STEP_TIMEOUT and fails at once, naming the worker, when the scheduler
declares a worker it waits for dead.
"""

from __future__ import annotations

import logging
from typing import Optional

import tensorflow as tf

from tfpsx.embedding.updaters import TableUpdater
from tfpsx.modes.sync import (GradientAccumulators, SyncGroup, SyncTableUpdater,
                              TableAccumulators, replicas_to_aggregate)
from tfpsx.runtime import RUNTIME
from tfpsx.training.hooks import TrainStepDetector
from tfpsx.training.modes.base import Mode, WrappedOptimizer
from tfpsx.training.placement import worker_device_of

logger = logging.getLogger("tfpsx")

__all__ = ["SyncMode", "SyncOptimizer", "SyncTableUpdater"]


class SyncMode(Mode):
    NAME = "sync"

    def __init__(self, strategy, config, graph):
        super().__init__(strategy, config, graph)
        self.worker_device = worker_device_of(config)
        self.tables = TableAccumulators()
        self.dense = []    # (optimizer, variables, GradientAccumulators, push op)
        self.global_step = None
        self._group: Optional[SyncGroup] = None
        self.add_hook(_SyncHook(self))

    def validate(self) -> None:
        self.replicas = replicas_to_aggregate(self.strategy, self.config.worker_num,
                                              "model_scope")

    @classmethod
    def wrap_optimizer(cls, optimizer, strategy, config):
        n = config.worker_num
        if isinstance(optimizer, tf.compat.v1.train.SyncReplicasOptimizer):
            if optimizer._total_num_replicas != n:  # noqa: SLF001 — TF keeps it private
                raise ValueError(
                    f"distributed_optimizer: the SyncReplicasOptimizer was built for "
                    f"total_num_replicas={optimizer._total_num_replicas}, but the cluster has "
                    f"{n} workers; pass the plain optimizer and let tfpsx wrap it")
            optimizer = optimizer._opt  # noqa: SLF001
        replicas_to_aggregate(strategy, n, "distributed_optimizer")
        return SyncOptimizer(optimizer, strategy, config)

    def table_updater(self, table) -> TableUpdater:
        return SyncTableUpdater(self)

    def group(self) -> SyncGroup:
        """The step protocol's variables (made on first use): the step and the pushed
        vector on PS 0, this worker's local step."""
        if self._group is None:
            n = self.config.worker_num
            with tf.compat.v1.device("/job:ps/task:0"):
                step = tf.compat.v1.get_variable(
                    "tfpsx_sync_step", [], tf.int64, initializer=tf.zeros_initializer(),
                    trainable=False, use_resource=True)
                pushed = tf.compat.v1.get_variable(
                    "tfpsx_sync_pushed", [n], tf.int64, initializer=tf.zeros_initializer(),
                    trainable=False, use_resource=True)
            with tf.compat.v1.device(self.worker_device):
                local_step = tf.compat.v1.get_variable(
                    "tfpsx_sync_local_step", initializer=step.read_value(), trainable=False,
                    use_resource=True, collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])
            self._group = SyncGroup(step, pushed, local_step, self.config.index, n,
                                    self.replicas, RUNTIME.dead_workers)
        return self._group

    def push(self, table, keys, grads):
        """The op that sends a table's row gradients to its shards' accumulators."""
        return self.tables.push(table, keys, grads, self.group().local_step.read_value())


class SyncOptimizer(WrappedOptimizer):
    """Sync training for dense variables (see the module doc): ``apply_gradients``
    returns the step's push; the chief's session hook applies each step's average with
    the wrapped optimizer, once, and counts it in ``global_step``."""

    def __init__(self, optimizer, strategy, config):
        super().__init__(optimizer, "Sync")
        self._strategy, self._config = strategy, config

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        if global_step is None:
            raise ValueError("sync training needs a global step: minimize(loss, global_step="
                             "tf.compat.v1.train.get_or_create_global_step())")
        mode = SyncMode.for_graph(self._strategy, self._config)
        pairs = [(g, v) for g, v in grads_and_vars if g is not None]
        if not pairs:
            raise ValueError("sync: no gradients to apply (every gradient is None)")
        group = mode.group()
        variables = [v for _, v in pairs]
        accs = GradientAccumulators(
            [g for g, _ in pairs], lambda i, size: variables[i].device,
            prefix=f"tfpsx_sync/{self.get_name()}_{len(mode.dense)}/grad_")
        with tf.compat.v1.device(mode.worker_device):
            push = tf.group(*accs.push([g for g, _ in pairs], group.local_step.read_value()),
                            name=name or "sync_push")
        mode.dense.append((self._opt, variables, accs, push))
        mode.global_step = global_step
        return push


class _SyncHook(tf.compat.v1.train.SessionRunHook):
    """The step's phases after each training run (see the module doc)."""

    def __init__(self, mode: SyncMode):
        self._mode = mode
        self._built = False
        self._s = 0           # the step this worker trains
        self._stopped = False

    def begin(self):
        # Before the session finalizes the graph: every gradient and table push exists.
        mode = self._mode
        if self._built or not (mode.dense or mode.tables.entries):
            return
        self._built = True
        group = mode.group()
        self._group = group
        self._count = tf.compat.v1.placeholder(tf.int32, [], name="sync_count")
        s = group.local_step.read_value()
        takes = [(opt, variables, accs.take(self._count)) for opt, variables, accs, _ in
                 mode.dense]
        taken = [g for _, _, grads in takes for g in grads]
        accumulators = [a for _, _, a, _ in mode.dense]
        with tf.control_dependencies(taken):
            # Gradients stamped before the next step are stale once this step's are out.
            stale = [op for a in accumulators for op in a.set_global_step(s + 1)]
        with tf.control_dependencies(stale):
            applies = [opt.apply_gradients(list(zip(grads, variables)))
                       for opt, variables, grads in takes]
            applies += mode.tables.apply(self._count, s + 1)  # the step applied, from 1
        with tf.control_dependencies(applies):
            applies += mode.tables.set_global_step(s + 1)
            global_step = (mode.global_step if mode.global_step is not None
                           else tf.compat.v1.train.get_global_step())
            if global_step is not None:
                applies.append(tf.compat.v1.assign_add(global_step, 1))
        self._apply = group.advance(applies)
        self._mark = group.mark_pushed()
        self._join = group.join()
        self._leave = group.leave()
        self._read_pushed = group.pushed.read_value()
        self._read_step = group.step.read_value()
        self._new = tf.compat.v1.placeholder(tf.int64, [], name="sync_new_step")
        self._follow = group.follow(self._new)
        self._chief_init = [a.set_global_step(group.step.read_value())
                            for a in accumulators] + mode.tables.set_global_step(
                                group.step.read_value())
        self._detector = TrainStepDetector([p for *_, p in mode.dense] + mode.tables.pushes)

    def after_create_session(self, session, coord):
        if not self._built:
            return
        self._stopped = False
        if self._group.is_chief:
            session.run(self._chief_init)
        session.run(self._join)
        self._s = int(session.run(self._read_step))

    def after_run(self, run_context, run_values):
        if not self._built or not self._detector.ran_training(run_context):
            return
        session, group = run_context.session, self._group
        session.run(self._mark)

        def read_pushed():
            return session.run(self._read_pushed)

        if group.is_chief:
            count = group.wait_for_gradients(self._s, read_pushed)
            self._s = int(session.run(self._apply, {self._count: count}))
            return
        try:
            new = group.wait_for_step(self._s, lambda: session.run(self._read_step), read_pushed)
        except tf.errors.OutOfRangeError:
            run_context.request_stop()  # the chief ended training: no more sync steps
            return
        session.run(self._follow, {self._new: new})
        self._s = new

    def end(self, session):
        if self._built:
            session.run(self._leave)

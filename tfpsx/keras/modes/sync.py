"""sync on Keras: the protocol is :mod:`tfpsx.modes.sync`'s; this module is its eager /
``tf.function`` executor. The model lives on the parameter servers
(:class:`~tfpsx.keras.modes.async_.OnServers`), and each phase of a step runs inside
every worker's compiled step:

1. the gradient all-reduce (Keras's optimizer calls it) pushes this worker's dense
   gradients and, before them in the backward pass, a table's row gradients, then marks
   the push on PS 0;
2. the chief waits for the step's gradients (a ``py_function``), takes their average,
   which Keras's optimizer applies on the PS (the tables' server-side optimizers apply
   theirs), and bumps the step;
3. every other worker waits (a ``py_function``) until the step passed its own; its
   optimizer applies nothing.

``optimizer.iterations`` is the sync step (every worker's copy is set to it). A worker
whose ``fit`` ends leaves the group; when the chief's ends, the others' epochs end. From
an input leased as each worker goes (``tfpsx.data.splits``), whose data ends at different
steps on different workers, the chief whose data ended first applies the others' steps
until they leave (:meth:`KerasSync.finish_fit`, ``SyncGroup.drain``).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import tensorflow as tf

from tfpsx.control import splits
from tfpsx.modes.positions import COMMITS
from tfpsx.embedding.updaters import TableUpdater
from tfpsx.keras.modes.async_ import OnServers
from tfpsx.keras.modes.base import SHARED_PREFIX
from tfpsx.modes.sync import (GradientAccumulators, SyncGroup, SyncTableUpdater,
                              TableAccumulators, replicas_to_aggregate)
from tfpsx.runtime import RUNTIME
from tfpsx.cluster.placement import GreedyByBytes


def _spec(grad):
    """(sparse, dtype) of a gradient the step all-reduces."""
    return isinstance(grad, tf.IndexedSlices), grad.dtype


class KerasSync(OnServers):
    NAME = "sync"
    supports_cache = SyncTableUpdater.supports_cache  # (no: every step reads the PS)

    def __init__(self, keras_strategy, options, config):
        super().__init__(keras_strategy, options, config)
        self.tables = TableAccumulators(options.sync_reduction)
        self._group: Optional[SyncGroup] = None  # made at the first fit
        # The gradients the traced training step all-reduces, in order: (sparse, dtype)
        # each; the chief's drain applies the others' average to the same.
        self._reduced: Optional[list] = None
        self._drain_count = None  # (while the drain step is traced: its count tensor)

    def validate(self) -> None:
        self.replicas = replicas_to_aggregate(self.options, self.worker_num,
                                              "tfpsx.keras.ParameterServerStrategy")

    # ------------------------------------------------------------------ tables
    def table_updater(self, table) -> TableUpdater:
        return SyncTableUpdater(self)

    def push(self, table, keys, grads):
        """A table's row gradients, to its shards' accumulators (SyncTableUpdater)."""
        return self.record(self.tables.push(table, keys, grads,
                                            self.group().local_step.read_value()))

    def group(self) -> SyncGroup:
        if self._group is None:
            self._group = SyncGroup.create(self.state, self.worker_index, self.worker_num,
                                           self.replicas, RUNTIME.dead_workers)
            # An input's exact save: a worker acks it from its wait for the chief, its
            # earlier steps' positions committed first.
            self._group.while_waiting = lambda: splits.waiting_points(COMMITS.flush)
        return self._group

    # ------------------------------------------------------------------ fit
    def begin_fit(self, model) -> None:
        super().begin_fit(model)
        group = self.group()
        group.join()
        now = group.step.read_value()
        for it in self.iterations:
            it.assign(now)

    def end_fit(self, model) -> None:
        if self._group is not None:
            self._group.leave()
        super().end_fit(model)

    # ------------------------------------------------------------------ the step
    def update(self, extended, var, fn, args, kwargs, group):
        if not self.is_chief:
            return None  # the chief applies every step's average, once
        return super().update(extended, var, fn, args, kwargs, group)  # on the PS

    def reduce(self, extended, reduce_op, value_destination_pairs, options):
        grads = [tf.convert_to_tensor(v) for v, _ in value_destination_pairs]
        group = self.group()
        # One set of accumulators per trace (they are graph objects), one per gradient
        # position (the same model on every worker gives the same order), placed by bytes.
        placer = GreedyByBytes(len(self.ps_devices))
        accs = GradientAccumulators(
            grads, lambda i, nbytes: self.ps_devices[placer.place(nbytes)],
            prefix=f"{SHARED_PREFIX}sync/grad_", reduction=self.options.sync_reduction)
        s = group.local_step.read_value()
        if self._drain_count is not None:  # the chief's drain: the others' gradients only
            (taken,), stale, applied = group.take_step([accs], self.tables,
                                                       self._drain_count, s)
            for op in stale + applied:
                self.record(op)
            return taken
        self._reduced = [_spec(g) for g in grads]
        # The tables' pushes ran in the backward pass, before this all-reduce.
        mark = group.mark_pushed(accs.push(grads, s) + self.take_trace_ops())
        if not group.is_chief:
            self.record(mark)
            return grads  # not applied: update() is the chief's
        with tf.control_dependencies([mark]):
            count = tf.py_function(self._wait_for_gradients, [s], tf.int32,
                                   name="tfpsx_sync_wait_gradients")
        (taken,), stale, applied = group.take_step([accs], self.tables, count, s)
        for op in stale + applied:
            self.record(op)
        return taken

    def after_step(self) -> list:
        group = self.group()
        applied = self.take_trace_ops()
        if group.is_chief:
            new = group.end_step(applied, self.tables, group.local_step.read_value())
            follow = new.op
        else:
            with tf.control_dependencies(applied):
                new = tf.py_function(self._wait_for_step, [group.local_step.read_value()],
                                     tf.int64, name="tfpsx_sync_wait_step")
            follow = group.follow(new)
        with tf.control_dependencies([follow]):
            return [it.assign(new, read_value=False) for it in self.iterations] or [follow]

    # ------------------------------------------------------------------ the drain
    def finish_fit(self, model) -> None:
        """The chief's ``fit`` ended well while workers may still train from an input
        leased as each worker goes: it applies their steps until they leave, so their
        last batches are in the model (and their positions committed by their steps)."""
        if not (self.is_chief and self._group is not None and splits.registered()):
            return
        group = self._group
        group.drain()
        steps = []  # (the compiled step, made at the first step to apply)

        def apply(count) -> int:
            if not steps:
                steps.append(self._drain_step(model))
            steps[0](tf.constant(count, tf.int32))
            return int(group.local_step.read_value())  # (the chief's follows the step)

        group.apply_until_left(int(group.local_step.read_value()),
                               lambda: group.pushed.read_value().numpy(), apply=apply)

    def _drain_step(self, model):
        """A compiled step of the chief that applies ``count`` other workers' gradients
        with the model's optimizer (zeros of its own go in, never pushed)."""
        variables = list(model.trainable_variables)
        if self._reduced is None or len(self._reduced) != len(variables):
            raise ValueError(
                f"sync: the chief's training step all-reduced "
                f"{len(self._reduced or [])} gradient(s) but the model has "
                f"{len(variables)} trainable variable(s) (one without a gradient?); it "
                "cannot apply the steps of the workers still training after its own data "
                "ended: give every trainable variable a gradient, or feed the job with "
                "tfpsx.data.shard (equal parts)")

        def zeros():
            out = []
            for (sparse, dtype), var in zip(self._reduced, variables):
                shape = [int(d) for d in var.shape]
                if sparse:
                    out.append(tf.IndexedSlices(tf.zeros([0] + shape[1:], dtype),
                                                tf.zeros([0], tf.int64), tf.constant(shape)))
                else:
                    out.append(tf.zeros(shape, dtype))
            return out

        @tf.function
        def step(count):
            def replica():
                self._drain_count = count
                try:
                    model.optimizer.apply(zeros(), variables)
                finally:
                    self._drain_count = None
            self.keras_strategy.run(replica)

        return step

    # ------------------------------------------------------------------ the waits
    def _wait_for_gradients(self, step) -> np.int32:
        group = self._group
        return np.int32(self.keras_strategy.reporting(group.wait_for_gradients)(
            int(step), lambda: group.pushed.read_value().numpy()))

    def _wait_for_step(self, local_step) -> np.int64:
        group = self._group
        return np.int64(self.keras_strategy.reporting(group.wait_for_step)(
            int(local_step), lambda: int(group.step.read_value()),
            lambda: group.pushed.read_value().numpy()))

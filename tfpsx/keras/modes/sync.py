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
whose ``fit`` ends leaves the group; when the chief's ends, the others' epochs end.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import tensorflow as tf

from tfpsx.embedding.updaters import TableUpdater
from tfpsx.keras.modes.async_ import OnServers
from tfpsx.keras.modes.base import SHARED_PREFIX
from tfpsx.modes.sync import (GradientAccumulators, SyncGroup, SyncTableUpdater,
                              TableAccumulators, replicas_to_aggregate)
from tfpsx.runtime import RUNTIME
from tfpsx.cluster.placement import GreedyByBytes


class KerasSync(OnServers):
    NAME = "sync"
    supports_cache = SyncTableUpdater.supports_cache  # (no: every step reads the PS)

    def __init__(self, keras_strategy, options, config):
        super().__init__(keras_strategy, options, config)
        self.tables = TableAccumulators()
        self._group: Optional[SyncGroup] = None  # made at the first fit

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
            prefix=f"{SHARED_PREFIX}sync/grad_")
        s = group.local_step.read_value()
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

"""sync on Keras: each step averages the gradients of ``replicas_to_aggregate`` workers
and the chief applies them once, to the model on the parameter servers.

Per step, inside every worker's compiled step:

1. the gradient all-reduce (Keras's optimizer calls it) pushes this worker's dense
   gradients into one ConditionalAccumulator per gradient on the PS, and a table's row
   gradients into its shards' accumulators (graph mode's ``TableAccumulators``), all
   stamped with the worker's sync step; then it marks "pushed step s" in a vector on PS 0;
2. the chief waits (polling that vector, bounded by TFPSX_SYNC_STEP_TIMEOUT) until the
   gradients of step s are in, takes their average and applies it (its optimizer's
   update on the PS; the tables' server-side optimizers) and bumps the sync step;
3. every other worker waits (polling, bounded) until the sync step passed the one it
   pushed for, and goes on from it: no worker supplies two gradients of one step (graph
   mode's per-worker tokens, without a queue: the step itself is the token).

``optimizer.iterations`` is the sync step (every worker's copy is set to it). A worker
whose ``fit`` ends marks itself done: the others go on without it (uneven data never
deadlocks); a worker that dies makes the others fail with ``ClusterTimeoutError`` naming
it.
"""

from __future__ import annotations

import time
from typing import List, Optional

import numpy as np
import tensorflow as tf

from tfpsx import errors, settings
from tfpsx.embedding.updaters import TableUpdater
from tfpsx.keras.modes.async_ import KerasAsync
from tfpsx.keras.modes.base import SHARED_PREFIX, KerasMode
from tfpsx.keras.variables import SharedVariable, initialize
from tfpsx.modes.group import DONE
from tfpsx.modes.sync import SyncTableUpdater, TableAccumulators, replicas_to_aggregate
from tfpsx.runtime import RUNTIME
from tfpsx.training.placement import GreedyByBytes


class KerasSync(KerasAsync):
    NAME = "sync"

    def __init__(self, keras_strategy, options, config):
        super().__init__(keras_strategy, options, config)
        self.tables = TableAccumulators()
        self._state = None      # (step, pushed, local_step), made at the first fit
        self._accumulators = None

    def validate(self) -> None:
        self.replicas = replicas_to_aggregate(self.options, self.worker_num,
                                              "tfpsx.keras.ParameterServerStrategy")

    # ------------------------------------------------------------------ tables
    def table_updater(self, table) -> TableUpdater:
        return SyncTableUpdater(self)

    def push(self, table, keys, grads):
        """A table's row gradients, to its shards' accumulators (SyncTableUpdater)."""
        return self.record(self.tables.push(table, keys, grads,
                                            self.state()[2].read_value()))

    def state(self):
        if self._state is None:
            timeout = settings.get("TFPSX_SESSION_TIMEOUT")
            ps0, w = self.ps_devices[0], self.worker_num
            step = SharedVariable(shared_name=SHARED_PREFIX + "sync/step", shape=[],
                                  dtype=tf.int64, device=ps0, trainable=False, name="sync_step")
            initialize(step, tf.constant(0, tf.int64), self.is_chief, timeout)
            pushed = SharedVariable(shared_name=SHARED_PREFIX + "sync/pushed", shape=[w],
                                    dtype=tf.int64, device=ps0, trainable=False,
                                    name="sync_pushed")
            initialize(pushed, tf.zeros([w], tf.int64), self.is_chief, timeout)
            with tf.device(self.worker_device):
                local_step = tf.Variable(step.read_value(), trainable=False,
                                         name="sync_local_step")
            self._state = (step, pushed, local_step)
        return self._state

    # ------------------------------------------------------------------ fit
    def begin_fit(self, model) -> None:
        KerasMode.begin_fit(self, model)  # not async's global step: the sync step is ours
        step, pushed, local_step = self.state()
        # Like SyncReplicasOptimizer's local step: start at the sync step, so a restarted
        # worker's gradients are not stale.
        now = step.read_value()
        local_step.assign(now)
        for it in self.iterations:
            it.assign(now)
        pushed.scatter_update(tf.IndexedSlices(tf.reshape(now, [1]),
                                               tf.constant([self.worker_index])))

    def end_fit(self, model) -> None:
        if self._state is not None:
            self._state[1].scatter_update(tf.IndexedSlices(tf.constant([DONE], tf.int64),
                                                           tf.constant([self.worker_index])))
        super().end_fit(model)

    # ------------------------------------------------------------------ the step
    def update(self, extended, var, fn, args, kwargs, group):
        if not self.is_chief:
            return None  # the chief applies every step's average, once
        return super().update(extended, var, fn, args, kwargs, group)  # async's: on the PS

    def _accumulators_for(self, grads) -> list:
        # One per gradient position (the same model on every worker gives the same
        # order), on the least loaded PS.
        if self._accumulators is None:
            placer = GreedyByBytes(len(self.ps_devices))
            accs = []
            for i, g in enumerate(grads):
                device = self.ps_devices[placer.place(
                    max(1, g.shape.num_elements() or 1) * g.dtype.size)]
                with tf.device(device):
                    accs.append(tf.compat.v1.ConditionalAccumulator(
                        g.dtype, shape=g.shape, shared_name=f"{SHARED_PREFIX}sync/grad_{i}"))
            self._accumulators = accs
        return self._accumulators

    def reduce(self, extended, reduce_op, value_destination_pairs, options):
        grads = [tf.convert_to_tensor(v) for v, _ in value_destination_pairs]
        _, pushed, local_step = self.state()
        self._accumulators = None  # one set per trace: accumulators are graph objects
        accs = self._accumulators_for(grads)
        s = local_step.read_value()
        pushes = [acc.apply_grad(g, local_step=s) for acc, g in zip(accs, grads)]
        # The tables' pushes ran in the backward pass, before this all-reduce.
        with tf.control_dependencies(pushes + self.take_trace_ops()):
            mark = pushed.scatter_update(tf.IndexedSlices(tf.reshape(s + 1, [1]),
                                                          tf.constant([self.worker_index])))
        if not self.is_chief:
            self.record(mark.op if hasattr(mark, "op") else mark)
            return grads  # not applied: update() is the chief's
        with tf.control_dependencies([mark.op if hasattr(mark, "op") else mark]):
            count = tf.py_function(self._wait_for_gradients, [s], tf.int32,
                                   name="tfpsx_sync_wait_gradients")
        taken = [acc.take_grad(count) for acc in accs]
        for op in self.tables.apply(count, s + 1):
            self.record(op)
        return taken

    def after_step(self) -> list:
        step, pushed, local_step = self.state()
        applied = self.take_trace_ops()
        if self.is_chief:
            with tf.control_dependencies(applied):
                bump = step.assign_add(1, read_value=False)
            with tf.control_dependencies([bump]):
                new = step.read_value()
            stale = [acc.set_global_step(new) for acc in self._accumulators or []]
            stale += self.tables.set_global_step(new)
        else:
            with tf.control_dependencies(applied):
                new = tf.py_function(self._wait_for_step, [local_step.read_value()], tf.int64,
                                     name="tfpsx_sync_wait_step")
            stale = []
        return stale + [local_step.assign(new, read_value=False)] + [
            it.assign(new, read_value=False) for it in self.iterations]

    # ------------------------------------------------------------------ bounded waits
    def _poll(self, ready, timeout_message, step: int, needed=()):
        """Polls ``ready()`` until it answers, bounded by TFPSX_SYNC_STEP_TIMEOUT; a
        worker whose gradients of ``step`` are missing (or one of ``needed``: the chief,
        for a worker waiting on its apply) and that the scheduler declared dead (no
        heartbeat for TFPSX_HEARTBEAT_TIMEOUT) fails the wait at once."""
        timeout = settings.get("TFPSX_SYNC_STEP_TIMEOUT")
        start = time.monotonic()
        deadline, pause, checked = start + timeout, 0.0005, start
        while True:
            result = ready()
            if result is not None:
                return result
            now = time.monotonic()
            if now > deadline:
                raise errors.ClusterTimeoutError(timeout_message(timeout))
            if now - checked > 0.5:
                checked = now
                self._fail_if_dead(step, now - start, needed)
            time.sleep(pause)
            pause = min(0.005, pause * 2)

    def _fail_if_dead(self, step: int, waited: float, needed=()) -> None:
        reported = RUNTIME.dead_workers()
        if not reported:
            return
        waiting_for = set(self._missing(step)) | set(needed)
        dead = [(rank, address) for rank, address in reported if rank in waiting_for]
        if dead:
            names = ", ".join(f"worker {rank} at {address}" for rank, address in dead)
            raise errors.ClusterTimeoutError(
                f"sync: worker {self.worker_index} waited {waited:.1f} s for step {step}, "
                f"which cannot complete: {names} died (the scheduler heard no heartbeat for "
                f"TFPSX_HEARTBEAT_TIMEOUT={settings.get('TFPSX_HEARTBEAT_TIMEOUT'):g} s); "
                "restart the job from its last checkpoint (sync needs every worker)")

    def _missing(self, step: int) -> List[int]:
        pushed = self._state[1].read_value().numpy()
        return [w for w in range(self.worker_num) if pushed[w] < step + 1]

    def _wait_for_gradients(self, step) -> np.int32:
        s, pushed_var = int(step), self._state[1]

        def ready() -> Optional[np.int32]:
            pushed = pushed_var.read_value().numpy()
            active = pushed < DONE
            arrived = int(((pushed >= s + 1) & active).sum())
            required = max(1, min(self.replicas, int(active.sum())))
            return np.int32(arrived) if arrived >= required else None

        return self.keras_strategy.reporting(self._poll)(ready, lambda t: (
            f"sync: the chief waited {t:g} s (TFPSX_SYNC_STEP_TIMEOUT) for the gradients of "
            f"step {s} from worker(s) {self._missing(s)}; is it dead? (lower "
            "replicas_to_aggregate to go on without stragglers)"), s)

    def _wait_for_step(self, local_step) -> np.int64:
        """A worker's wait for the chief to apply the step it pushed for; the new step."""
        step, pushed, _ = self._state
        s = int(local_step)

        def ready() -> Optional[np.int64]:
            now = int(step.read_value())
            if now > s:
                return np.int64(now)
            if int(pushed.read_value()[0]) >= DONE:
                raise tf.errors.OutOfRangeError(
                    None, None, "sync: the chief (worker 0) finished fit(); no more sync steps")
            return None

        return self.keras_strategy.reporting(self._poll)(ready, lambda t: (
            f"sync: worker {self.worker_index} waited {t:g} s (TFPSX_SYNC_STEP_TIMEOUT) for "
            f"the chief to apply step {s}; still missing the gradients of worker(s) "
            f"{self._missing(s)}. Is a worker or the chief dead?"), s, (0,))

"""sync in graph mode: the protocol is :mod:`tfpsx.modes.sync`'s; this module is its
TF1 executor.

* Dense variables: :class:`SyncOptimizer` (what ``distributed_optimizer`` returns in
  sync) builds a training step that pushes the gradients, stamped with the worker's local
  step, into accumulators beside their variables; the wrapped optimizer applies their
  average (the chief, once per step).
* ``DynamicTable`` tables built in ``model_scope(sync)``: their row gradients go into
  their shards' accumulators; the chief applies the average with the table's
  server-side optimizer.

A session hook runs the rest of each step: it feeds the training run the step its
pushes are stamped with and adds the mark of the push to it (a run that trains only
part of the model marks in a run of its own); then the chief's next run waits for the
gradients of the step, takes and applies their average and bumps the step (and
``global_step``); every other worker waits until the step passed its own. The chief's
wait is in the graph, in an accumulator of arrivals (a worker's mark adds one, stamped
with its step, so a straggler's late one is dropped as the gradients are), bounded to
TFPSX_SYNC_ATTEMPT per run: in between, the group is read again (a worker that left, one
the scheduler declared dead). The others wait in their own token queue on PS 0, where the
chief's apply puts the new step (at most two wait: a straggler goes on from the newest),
bounded the same way. A worker that ends
leaves the group; when the chief ends, the others' sessions stop. Every wait is bounded
by TFPSX_SYNC_STEP_TIMEOUT and fails at once, naming the worker, when the scheduler
declares a worker it waits for dead.
"""

from __future__ import annotations

import logging
from typing import Optional

import tensorflow as tf

from tfpsx import compat, settings
from tfpsx.control import splits
from tfpsx.embedding.updaters import TableUpdater
from tfpsx.modes.sync import (GradientAccumulators, SyncGroup, SyncTableUpdater,
                              TableAccumulators, replicas_to_aggregate)
from tfpsx.modes.positions import positions_of_graph
from tfpsx.runtime import RUNTIME
from tfpsx.training.hooks import InputPositionHook, TrainStepDetector
from tfpsx.training.modes.base import GraphStateFactory, Mode, WrappedOptimizer
from tfpsx.training.placement import worker_device_of

logger = logging.getLogger("tfpsx")

__all__ = ["SyncMode", "SyncOptimizer", "SyncTableUpdater"]


class SyncMode(Mode):
    NAME = "sync"

    def __init__(self, strategy, config, graph):
        super().__init__(strategy, config, graph)
        self.worker_device = worker_device_of(config)
        self.tables = TableAccumulators(strategy.sync_reduction)
        self.dense = []    # (optimizer, variables, GradientAccumulators, push op)
        self.global_step = None
        self._group: Optional[SyncGroup] = None
        self._stamp = None
        self._hook = _SyncHook(self)
        self.add_hook(self._hook)

    # An input leased as each worker goes (tfpsx.data.splits) commits a batch once the
    # chief applied its step: after this mode's hook waited for it (COMMITS_AFTER_HOOKS),
    # and not at all when the chief ended before it (last_run_applied).
    COMMITS_AFTER_HOOKS = True

    def last_run_applied(self) -> bool:
        """Whether the last training run's step is in the model."""
        return self._hook.applied

    @property
    def drains(self) -> bool:
        """The chief applies the steps of the workers still training once its own data
        ended: the graph reads an input leased as each worker goes, whose data ends at
        different steps on different workers (SyncGroup.drain)."""
        return bool(positions_of_graph(self.graph))

    def validate(self) -> None:
        self.replicas = replicas_to_aggregate(self.strategy, self.config.worker_num,
                                              "model_scope")

    @classmethod
    def wrap_optimizer(cls, optimizer, strategy, config):
        n = config.worker_num
        if isinstance(optimizer, tf.compat.v1.train.SyncReplicasOptimizer):
            replicas, inner = compat.sync_replicas_parts(optimizer)
            if replicas != n:
                raise ValueError(
                    f"distributed_optimizer: the SyncReplicasOptimizer was built for "
                    f"total_num_replicas={replicas}, but the cluster has "
                    f"{n} workers; pass the plain optimizer and let tfpsx wrap it")
            optimizer = inner
        replicas_to_aggregate(strategy, n, "distributed_optimizer")
        return SyncOptimizer(optimizer, strategy, config)

    def table_updater(self, table) -> TableUpdater:
        return SyncTableUpdater(self)

    def group(self) -> SyncGroup:
        """The step protocol's variables (made on first use): the step and the pushed
        vector on PS 0, this worker's local step."""
        if self._group is None:
            self._group = SyncGroup.create(GraphStateFactory(self.worker_device),
                                           self.config.index, self.config.worker_num,
                                           self.replicas, RUNTIME.dead_workers)
            # An input's exact save: a worker acks it from its wait for the chief, its
            # earlier runs' positions committed first (the input hook's flush).
            self._group.while_waiting = lambda: splits.waiting_points(_flush_commits)
        return self._group

    def stamp(self):
        """The step this worker's pushes are stamped with: fed by the hook each run
        (the local step when not fed)."""
        if self._stamp is None:
            with tf.compat.v1.device(self.worker_device):
                self._stamp = tf.compat.v1.placeholder_with_default(
                    self.group().local_step.read_value(), [], name="tfpsx_sync_stamp")
        return self._stamp

    def push(self, table, keys, grads):
        """The op that sends a table's row gradients to its shards' accumulators."""
        return self.tables.push(table, keys, grads, self.stamp())


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
        variables = [v for _, v in pairs]
        accs = GradientAccumulators(
            [g for g, _ in pairs], lambda i, size: variables[i].device,
            prefix=f"tfpsx_sync/{self.get_name()}_{len(mode.dense)}/grad_",
            reduction=self._strategy.sync_reduction)
        with tf.compat.v1.device(mode.worker_device):
            push = tf.group(*accs.push([g for g, _ in pairs], mode.stamp()),
                            name=name or "sync_push")
        mode.dense.append((self._opt, variables, accs, push))
        mode.global_step = global_step
        return push


class _SyncHook(tf.compat.v1.train.SessionRunHook):
    """The step's phases around each training run (see the module doc)."""

    def __init__(self, mode: SyncMode):
        self._mode = mode
        self._built = False
        self._s = 0           # the step this worker trains
        self._marked = False  # the training run marked its push itself
        self.applied = True   # the last training run's step is in the model

    def begin(self):
        # Before the session finalizes the graph: every gradient and table push exists.
        mode = self._mode
        if self._built or not (mode.dense or mode.tables.entries):
            return
        self._built = True
        group = self._group = mode.group()
        self._stamp = mode.stamp()
        with tf.compat.v1.device("/job:ps/task:0"):
            arrivals = tf.compat.v1.ConditionalAccumulator(
                tf.float32, shape=[], shared_name="tfpsx_sync_arrivals")
        accumulators = [a for _, _, a, _ in mode.dense] + [arrivals]
        new = self._build_apply(arrivals)
        self._build_tokens(new)
        pushes = [p for *_, p in mode.dense] + mode.tables.pushes
        with tf.compat.v1.device("/job:ps/task:0"):
            # An arrival only once this worker's gradients are in (the chief's takes
            # follow the arrivals' and must not wait).
            with tf.control_dependencies(pushes):
                arrive = arrivals.apply_grad(1.0, local_step=self._stamp)
            self._mark = tf.group(group.mark_pushed(pushes, stamp=self._stamp), arrive)
            # (after a training run of its own: its pushes are in)
            self._mark_alone = tf.group(group.mark_pushed(stamp=self._stamp),
                                        arrivals.apply_grad(1.0, local_step=self._stamp))
        self._join, self._leave = group.join(), group.leave()
        self._drain_mark = group.drain()
        self._read_pushed = group.pushed.read_value()
        self._read_step = group.step.read_value()
        now = group.step.read_value()
        self._chief_init = ([a.set_global_step(now) for a in accumulators]
                            + mode.tables.set_global_step(now))
        self._attempt = tf.compat.v1.RunOptions(
            timeout_in_ms=int(1000 * settings.get("TFPSX_SYNC_ATTEMPT")))
        self._detector = TrainStepDetector(pushes)
        self._pushes = {p.name for p in pushes}

    def _build_apply(self, arrivals):
        """The chief's run of a step: waits until ``count`` workers marked it (in the
        arrivals accumulator), takes and applies their average, bumps the step and
        ``global_step``; returns the new step. It stays on the parameter servers (no
        partition on the worker): its step is PS 0's (only the chief bumps it), its
        count is fed there."""
        mode, group = self._mode, self._group
        with tf.compat.v1.device("/job:ps/task:0"):
            self._count = tf.compat.v1.placeholder(tf.int32, [], name="sync_count")
            s = group.step.read_value()
            arrived = arrivals.take_grad(self._count)
        taken, stale, tables = group.take_step([accs for _, _, accs, _ in mode.dense],
                                               mode.tables, self._count, s, after=[arrived])
        with tf.control_dependencies([arrived]):
            stale.append(arrivals.set_global_step(s + 1))
        with tf.control_dependencies(stale):
            applies = [opt.apply_gradients(list(zip(grads, variables)))
                       for (opt, variables, _, _), grads in zip(mode.dense, taken)]
        global_step = (mode.global_step if mode.global_step is not None
                       else tf.compat.v1.train.get_global_step())
        if global_step is not None:
            with tf.control_dependencies(applies + tables):
                applies.append(tf.compat.v1.assign_add(global_step, 1))
        return group.end_step(applies + stale + tables, mode.tables, s, follow=False)

    def _build_tokens(self, new):
        """The chief's run puts the new step into every other worker's token queue
        (unless two wait there: a dead straggler's must not grow by one every step); a
        worker's wait takes its token and any older ones (the newest step)."""
        group = self._group
        with tf.compat.v1.device("/job:ps/task:0"):
            queues = [tf.queue.FIFOQueue(-1, tf.int64, shapes=[],
                                         shared_name=f"tfpsx_sync_token_{w}")
                      for w in range(group.workers)]
            tokens = [q.enqueue_many(tf.fill([tf.cast(q.size() < 2, tf.int32)], new))
                      for w, q in enumerate(queues) if w != group.me]
            with tf.control_dependencies(tokens):
                self._apply = tf.identity(new)
            mine = queues[group.me]
            first = mine.dequeue()
            with tf.control_dependencies([first]):
                rest = mine.dequeue_many(mine.size())
            self._token = tf.maximum(first, tf.reduce_max(rest))

    def after_create_session(self, session, coord):
        if not self._built:
            return
        if self._group.is_chief:
            session.run(self._chief_init)
        session.run(self._join)
        self._s = int(session.run(self._read_step))

    def before_run(self, run_context):
        if not self._built or not self._detector.ran_training(run_context):
            return None
        feed = {self._stamp: self._s}
        # A run of every push marks it too (one round trip less per step).
        self._marked = self._detector.reached(run_context) >= self._pushes
        return tf.compat.v1.train.SessionRunArgs(self._mark if self._marked else None,
                                                 feed_dict=feed)

    def after_run(self, run_context, run_values):
        if not self._built or not self._detector.ran_training(run_context):
            return
        session, group = run_context.session, self._group
        if not self._marked:
            session.run(self._mark_alone, {self._stamp: self._s})

        def read_pushed():
            return session.run(self._read_pushed)

        if group.is_chief:
            self._s = group.wait_for_gradients(
                self._s, read_pushed, take=lambda count: self._apply_attempt(session, count))
            return

        def token():  # one bounded attempt: waits in this worker's token queue
            try:
                return int(session.run(self._token, options=self._attempt))
            except tf.errors.DeadlineExceededError:
                return None

        self.applied = True
        try:
            self._s = group.wait_for_step(self._s, lambda: session.run(self._read_step),
                                          read_pushed, take=token)
        except tf.errors.OutOfRangeError:
            # The chief ended training before it applied this step: no more sync steps,
            # and this run's batch is not in the model (its position is not committed).
            self.applied = False
            run_context.request_stop()

    def end(self, session):
        if not self._built:
            return
        if self._group.is_chief and self._mode.drains:
            self._drain(session)
        session.run(self._leave)

    def _apply_attempt(self, session, count):
        """The chief's run of a step, one bounded attempt (it waits in the arrivals
        accumulator for ``count`` workers): the new step, or None when its bound ran out."""
        try:
            return int(session.run(self._apply, {self._count: count}, options=self._attempt))
        except tf.errors.DeadlineExceededError:
            return None

    def _drain(self, session) -> None:
        """The chief's session ends (its data ended, or it stopped) while others may
        still train from an input leased as each worker goes: it applies their steps
        until they leave, so their last batches are in the model (see SyncGroup.drain)."""
        session.run(self._drain_mark)
        self._s = self._group.apply_until_left(
            self._s, lambda: session.run(self._read_pushed),
            take=lambda count: self._apply_attempt(session, count))


def _flush_commits() -> None:
    """Commits the positions of this worker's applied runs now (the input hook's)."""
    hook = InputPositionHook.active
    if hook is not None:
        hook.flush()

"""sync: each step averages the gradients of ``replicas_to_aggregate`` workers and
applies them once.

* Dense variables: TF's SyncReplicasOptimizer (:class:`SyncOptimizer`) without its two
  hangs: at the end the chief closes the token queue, so a worker blocked on a token
  stops normally, and a step that waits past TFPSX_SYNC_STEP_TIMEOUT (a dead worker)
  raises ``ClusterTimeoutError``. Its tokens are shared: a fast worker can supply two of
  one step's gradients.
* ``DynamicTable`` tables built in ``model_scope(sync)``: a training lookup's row
  gradients go, per shard, into a SparseConditionalAccumulator on that shard's PS
  (stamped with the worker's local step; stale ones are dropped). The chief's update
  thread takes ``replicas_to_aggregate`` gradients per shard, sums the rows of each key,
  divides by ``replicas_to_aggregate`` and applies the table's server-side optimizer
  once, bumps the sync step (and ``global_step``, unless a dense ``SyncOptimizer`` in the
  same graph counts the steps) and puts one token into each worker's own token queue.
  After each training run a worker takes its token (bounded by TFPSX_SYNC_STEP_TIMEOUT)
  before its next step; at the end the chief closes the token queues. Tokens are per
  worker: with ``replicas_to_aggregate`` equal to the worker count every step has one
  gradient from each worker, and a dead worker stops the step, which the others report
  as ``ClusterTimeoutError``. A straggler (fewer replicas than workers) that finds several
  tokens takes them all and goes on from the newest step; at most 2 wait per worker.
* A dead worker, with a scheduler: once the scheduler declares a worker dead (no
  heartbeat for TFPSX_HEARTBEAT_TIMEOUT), no step that needs it can complete. Every
  worker watches for that (:class:`_DeadWorkerWatch`), closes the token queues so that
  blocked steps return at once, and fails with ``ClusterTimeoutError`` naming the dead
  worker and its address, instead of after TFPSX_SYNC_STEP_TIMEOUT. A worker restarted
  before it is declared dead (``tfpsx-run --max_restarts``) takes its part of the steps.
"""

from __future__ import annotations

import logging

import tensorflow as tf

from tfpsx import errors, settings
from tfpsx.background import BackgroundLoop
from tfpsx.embedding.updaters import TableUpdater
from tfpsx.modes.sync import (SyncTableUpdater, TableAccumulators, release_tokens,
                              replicas_to_aggregate, take_token, token_queues)
from tfpsx.runtime import RUNTIME
from tfpsx.training.hooks import TrainStepDetector
from tfpsx.training.modes.base import Mode
from tfpsx.training.placement import worker_device_of

logger = logging.getLogger("tfpsx")


def _step_timeout_options() -> tf.compat.v1.RunOptions:
    return tf.compat.v1.RunOptions(
        timeout_in_ms=int(1000 * settings.get("TFPSX_SYNC_STEP_TIMEOUT")))


class SyncMode(Mode):
    NAME = "sync"

    def __init__(self, strategy, config, graph):
        super().__init__(strategy, config, graph)
        self.total = config.worker_num
        self.worker_device = worker_device_of(config)
        self.tables = TableAccumulators()
        self.dense_sync = False  # a SyncOptimizer counts global_step
        self._steps_vars = None
        self._table_hook = _TableSyncHook(self)
        # What closes the token queues (functions building the ops, called in begin()),
        # and the workers found dead; see _DeadWorkerWatch.
        self.token_closers = []
        self.lost = None
        self._watch = _DeadWorkerWatch(self)

    def validate(self) -> None:
        self.replicas = replicas_to_aggregate(self.strategy, self.config.worker_num, "model_scope")

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
        replicas = replicas_to_aggregate(strategy, n, "distributed_optimizer")
        return SyncOptimizer(optimizer, replicas, strategy, config)

    def table_updater(self, table) -> TableUpdater:
        return SyncTableUpdater(self)

    def hooks(self):
        return [self._table_hook, self._watch] + super().hooks()

    def wrap_session(self, session):
        return _SyncTimeoutMessages(session, self)

    def lost_error(self, waited: str) -> errors.ClusterTimeoutError:
        """The error of a step that cannot complete: the workers found dead, named."""
        names = ", ".join(f"worker {rank} at {address}" for rank, address in self.lost)
        return errors.ClusterTimeoutError(
            f"sync: worker {self.config.index} waited for {waited}, which cannot complete: "
            f"{names} died (the scheduler saw no heartbeat for TFPSX_HEARTBEAT_TIMEOUT="
            f"{settings.get('TFPSX_HEARTBEAT_TIMEOUT'):g} s); restart the job from its last "
            "checkpoint (tfpsx-run --max_restarts restarts a lost worker in place)")

    # ------------------------------------------------------------------ tables
    def steps(self):
        """(sync step on PS 0, this worker's local step): made on the first push."""
        if self._steps_vars is None:
            with tf.compat.v1.device("/job:ps/task:0"):
                counter = tf.compat.v1.get_variable(
                    "tfpsx_table_sync_step", [], tf.int64, initializer=tf.zeros_initializer(),
                    trainable=False, use_resource=True)
            with tf.compat.v1.device(self.worker_device):
                # Like SyncReplicasOptimizer's local step: starts at the sync step (a
                # restarted worker's gradients are not stale), then follows the tokens.
                local_step = tf.compat.v1.get_variable(
                    "tfpsx_table_sync_local_step", initializer=counter.read_value(),
                    trainable=False, use_resource=True,
                    collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])
            self._steps_vars = (counter, local_step)
        return self._steps_vars

    def push(self, table, keys, grads):
        """The op that sends a table's row gradients to its shards' accumulators."""
        _, local_step = self.steps()
        return self.tables.push(table, keys, grads, local_step.read_value())


class SyncOptimizer(tf.compat.v1.train.SyncReplicasOptimizer):
    """Sync training for dense variables: TF's SyncReplicasOptimizer without its hangs
    (see the module doc). Stragglers: with ``replicas_to_aggregate`` < the worker count,
    a step goes on with the first gradients in; late ones for an old step are dropped."""

    def __init__(self, optimizer, replicas_to_aggregate: int, strategy, config):
        super().__init__(optimizer, replicas_to_aggregate=replicas_to_aggregate,
                         total_num_replicas=config.worker_num)
        self._tfpsx_strategy, self._tfpsx_config = strategy, config

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        if global_step is None:
            raise ValueError("sync training needs a global step: minimize(loss, global_step="
                             "tf.compat.v1.train.get_or_create_global_step())")
        mode = SyncMode.for_graph(self._tfpsx_strategy, self._tfpsx_config)
        train_op = super().apply_gradients(grads_and_vars, global_step, name)
        is_chief = self._tfpsx_config.is_chief
        mode.add_hook(self.make_session_run_hook(is_chief))
        mode.add_hook(_SyncEndHook(self, is_chief))
        mode.token_closers.append(
            lambda: self._sync_token_queue.close(cancel_pending_enqueues=True))
        mode.dense_sync = True
        return train_op


class _SyncEndHook(tf.compat.v1.train.SessionRunHook):
    """Bounds every step by TFPSX_SYNC_STEP_TIMEOUT; the chief closes the token queue at
    the end, so no worker waits forever for a token."""

    def __init__(self, opt: SyncOptimizer, is_chief: bool):
        self._opt, self._is_chief = opt, is_chief
        self._bounded = tf.compat.v1.train.SessionRunArgs(None, options=_step_timeout_options())

    def begin(self):
        self._close = self._opt._sync_token_queue.close(  # noqa: SLF001
            cancel_pending_enqueues=True)

    def before_run(self, run_context):
        return self._bounded

    def end(self, session):
        if self._is_chief:
            session.run(self._close)


class _DeadWorkerWatch(tf.compat.v1.train.SessionRunHook):
    """Polls the scheduler's dead workers (every 0.5 s, in a background thread); the
    first time there are some, records them in the mode and closes every token queue, so
    that steps blocked on the dead worker's gradients return now (see the module doc)."""

    def __init__(self, mode: SyncMode):
        self._mode = mode
        self._close = None
        self._loop = None
        self._session = None

    def begin(self):
        if self._mode.token_closers and self._close is None:
            self._close = tf.group(*[build() for build in self._mode.token_closers])

    def after_create_session(self, session, coord):
        if self._close is None or self._loop is not None:
            return
        self._session = session
        self._loop = BackgroundLoop("sync: the watch for dead workers", self._check,
                                    interval=0.5).start()

    def _check(self):
        dead = RUNTIME.dead_workers()
        if not dead:
            return True
        self._mode.lost = dead
        logger.error("sync: %s declared dead by the scheduler; stopping this worker's steps "
                     "(they cannot complete)",
                     ", ".join(f"worker {r} at {a}" for r, a in dead))
        try:
            self._session.run(self._close)
        except tf.errors.OpError:  # already closed (the chief's end), or the session is
            pass
        return False

    def end(self, session):
        if self._loop is not None:
            self._loop.stop(timeout=0)


class _SyncTimeoutMessages:
    """A monitored session whose step timeouts (and steps a dead worker stopped) say
    what a sync step waited for."""

    def __init__(self, session, mode: SyncMode):
        self._session, self._mode = session, mode
        self._workers = mode.total

    def __getattr__(self, name):
        return getattr(self._session, name)

    def __enter__(self):
        self._session.__enter__()
        return self

    def __exit__(self, *exc):
        return self._session.__exit__(*exc)

    def run(self, *args, **kwargs):
        try:
            return self._session.run(*args, **kwargs)
        except (tf.errors.OutOfRangeError, tf.errors.CancelledError,
                tf.errors.DeadlineExceededError) as e:
            if self._mode.lost:
                raise self._mode.lost_error("the other workers' gradients") from e
            if not isinstance(e, tf.errors.DeadlineExceededError):
                raise
            raise errors.ClusterTimeoutError(
                f"a sync step waited TFPSX_SYNC_STEP_TIMEOUT="
                f"{settings.get('TFPSX_SYNC_STEP_TIMEOUT'):g} s for the gradients of the other "
                f"workers (of {self._workers}) or for its token; is a worker dead? Lower "
                "replicas_to_aggregate to go on without stragglers") from e


class _TableSyncHook(tf.compat.v1.train.SessionRunHook):
    """Workers: a token after each training run. Chief: the update thread."""

    def __init__(self, mode: SyncMode):
        self._mode = mode
        self._built = False
        self._loop = None
        self._session = None
        self._timeout = _step_timeout_options()

    def begin(self):
        mode = self._mode
        if self._built or not mode.tables.entries:
            return
        self._built = True
        counter, local_step = mode.steps()
        updates = mode.tables.apply(mode.replicas, counter.read_value())
        global_step = tf.compat.v1.train.get_global_step()
        with tf.compat.v1.device(counter.device):
            queues = token_queues(mode.total, "tfpsx_table_sync_tokens")
            with tf.control_dependencies(updates):
                bump = [counter.assign_add(1)]
                if global_step is not None and not mode.dense_sync:
                    bump.append(tf.compat.v1.assign_add(global_step, 1))
            with tf.control_dependencies(bump):
                self._step_op = release_tokens(queues, counter.read_value())
            self._close = tf.group(*[q.close(cancel_pending_enqueues=True) for q in queues])
            mode.token_closers.append(lambda: self._close)  # the dead-worker watch's too
            newest = take_token(queues[mode.config.index])
        with tf.compat.v1.device(mode.worker_device):
            self._wait = local_step.assign(newest)
        self._chief_init = tf.group(*mode.tables.set_global_step(counter.read_value()))
        self._detector = TrainStepDetector(mode.tables.pushes)

    def after_create_session(self, session, coord):
        if self._built and self._mode.config.is_chief and self._loop is None:
            session.run(self._chief_init)
            self._session = session
            # Each round blocks in the accumulators' take until the gradients are in;
            # the session's close at the end cancels the last, unfinished take.
            self._loop = BackgroundLoop("sync (tables): the chief's update",
                                        self._update, interval=0).start()

    def _update(self):
        try:
            self._session.run(self._step_op)
        except (tf.errors.CancelledError, tf.errors.OutOfRangeError) as e:
            if self._loop.stopping:
                return False
            raise RuntimeError("the update was cancelled before training ended") from e
        return True

    def after_run(self, run_context, run_values):
        if self._loop is not None:
            self._loop.check()
        if not self._built or not self._detector.ran_training(run_context):
            return
        try:
            run_context.session.run(self._wait, options=self._timeout)
        except tf.errors.OutOfRangeError as e:
            if self._mode.lost:
                raise self._mode.lost_error("its token (every worker's gradients)") from e
            run_context.request_stop()  # the chief ended training
        except tf.errors.DeadlineExceededError as e:
            raise errors.ClusterTimeoutError(
                f"sync (tables): worker waited TFPSX_SYNC_STEP_TIMEOUT="
                f"{settings.get('TFPSX_SYNC_STEP_TIMEOUT'):g} s for its token, i.e. for "
                f"{self._mode.replicas} of the {self._mode.total} workers' gradients and "
                "the chief's update; is a worker or the chief dead? Lower "
                "replicas_to_aggregate to go on without stragglers") from e

    def end(self, session):
        if self._built and self._mode.config.is_chief:
            if self._loop is not None:
                self._loop.stop(timeout=0)  # the close below ends its blocked round
            session.run(self._close)

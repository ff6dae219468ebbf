"""Bounded staleness (SSP): async, but no worker runs more than ``max_staleness`` steps
ahead of the slowest.

Every worker's step count is a slot of a clock vector on PS 0; after each step a worker
waits (polling, bounded by TFPSX_STALENESS_TIMEOUT: then ``ClusterTimeoutError`` naming
the slowest workers) while it is too far ahead. A worker that ends sets its clock out of
the way, so finished workers hold nobody back; a dead one does until the timeout.
"""

from __future__ import annotations

import tensorflow as tf

from tfpsx import settings
from tfpsx.modes.staleness import finish, tick, wait_for_slowest
from tfpsx.modes.state import WORKER_CLOCKS
from tfpsx.training.hooks import TrainStepDetector
from tfpsx.training.modes.base import GraphStateFactory, Mode, WrappedOptimizer
from tfpsx.training.placement import worker_device_of


class StalenessMode(Mode):
    NAME = "staleness"

    @classmethod
    def wrap_optimizer(cls, optimizer, strategy, config):
        return StalenessOptimizer(optimizer, strategy, config)


class StalenessOptimizer(WrappedOptimizer):
    """Async training with bounded staleness (see the module doc). ``waits`` counts the
    steps this worker had to wait for the slowest."""

    def __init__(self, optimizer, strategy, config):
        super().__init__(optimizer, "Staleness")
        self._strategy, self._config = strategy, config
        self.max_staleness = strategy.max_staleness
        self._hook = None

    @property
    def waits(self) -> int:
        return self._hook.waits if self._hook is not None else 0

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        mode = StalenessMode.for_graph(self._strategy, self._config)
        train_op = self._opt.apply_gradients(grads_and_vars, global_step, name)
        n, me = self._config.worker_num, self._config.index
        clocks = GraphStateFactory(worker_device_of(self._config)).shared(WORKER_CLOCKS, n)
        with tf.compat.v1.device(clocks.device):
            with tf.control_dependencies([tick(clocks, me)]):
                ticked = clocks.read_value()
            done = finish(clocks, me)
            read = clocks.read_value()
        self._hook = _StalenessHook(train_op, ticked, read, done, self.max_staleness, me)
        mode.add_hook(self._hook)
        return train_op


class _StalenessHook(tf.compat.v1.train.SessionRunHook):
    def __init__(self, train_op, tick, read, done, max_staleness: int, me: int):
        self._tick, self._read, self._done = tick, read, done
        self._detector = TrainStepDetector([train_op])
        self._s, self._me = max_staleness, me
        self._timeout = settings.get("TFPSX_STALENESS_TIMEOUT")
        self.waits = 0  # steps this worker had to wait for the slowest

    def after_run(self, run_context, run_values):
        if not self._detector.ran_training(run_context):
            return
        session = run_context.session
        self.waits += wait_for_slowest(session.run(self._tick), lambda: session.run(self._read),
                                       self._me, self._s, self._timeout)

    def end(self, session):
        session.run(self._done)

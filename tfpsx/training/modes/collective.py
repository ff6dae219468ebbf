"""collective in graph mode: every variable on this worker, gradients averaged over the
workers by all-reduce each step (:mod:`tfpsx.modes.collective`, shared with Keras), rank
0's variables broadcast once every session starts. Sessions run on the worker's own
collective server, which ``tfpsx.init_worker()`` started; every rank initializes its own
variables, rank 0 alone restores and saves checkpoints.
"""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from tfpsx.modes.collective import CollectiveGroup, from_rank_0
from tfpsx.runtime import RUNTIME
from tfpsx.training.modes.base import Mode, WrappedOptimizer
from tfpsx.training.placement import worker_device_of


class CollectiveMode(Mode):
    NAME = "collective"
    EACH_WORKER_INITIALIZES = True

    def __init__(self, strategy, config, graph):
        super().__init__(strategy, config, graph)
        self._group: Optional[CollectiveGroup] = None
        self.add_hook(_BroadcastHook(self))

    def validate(self) -> None:
        if not self.config.collective:
            raise ValueError(
                "DistributedStrategy(collective=True) needs a collective job "
                f"(tfpsx.init(is_collective=True), no parameter servers); this one has "
                f"{self.config.server_num} server(s): train on them with a_sync=... instead")

    def group(self) -> CollectiveGroup:
        """The graph's collective group."""
        if self._group is None:
            self._group = CollectiveGroup(self.config.index, self.config.worker_num,
                                          worker_device_of(self.config) + "/device:CPU:0")
        return self._group

    @classmethod
    def wrap_optimizer(cls, optimizer, strategy, config):
        return AllReduceOptimizer(optimizer, strategy, config)

    def table_updater(self, table):
        raise ValueError(
            f"DistributedStrategy(collective=True): table {table.name!r} grows on the "
            "parameter servers, and a collective job has none (every weight is "
            "all-reduced); use the hybrid mode: parameter servers for the tables, dense "
            "weights all-reduced (DistributedStrategy(dense='allreduce'))")


class AllReduceOptimizer(WrappedOptimizer):
    """The wrapped optimizer applies, on every rank, the gradients averaged over them."""

    def __init__(self, optimizer, strategy, config):
        super().__init__(optimizer, "AllReduce")
        self._strategy, self._config = strategy, config

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        mode = CollectiveMode.for_graph(self._strategy, self._config)
        pairs = [(g, v) for g, v in grads_and_vars if g is not None]
        if not pairs:
            raise ValueError("AllReduceOptimizer: no gradients to apply (every one is None)")
        averaged = mode.group().all_reduce([g for g, _ in pairs], mean=True)
        return self._opt.apply_gradients(list(zip(averaged, [v for _, v in pairs])),
                                         global_step, name)


class _BroadcastHook(tf.compat.v1.train.SessionRunHook):
    """When a session starts (after rank 0 initialized or restored), every rank takes
    rank 0's global variables: differently seeded ranks start equal, and a restart
    resumes from rank 0's checkpoint everywhere."""

    def __init__(self, mode: CollectiveMode):
        self._mode = mode
        self._assign = None

    def begin(self):
        assigns = from_rank_0(tf.compat.v1.global_variables(), lambda variables: (
            self._mode.group().broadcast([v.read_value() for v in variables])))
        if assigns:
            self._assign = tf.group(*assigns, name="tfpsx_broadcast_from_rank_0")

    def after_create_session(self, session, coord):
        if self._assign is not None:
            session.run(self._assign)
        RUNTIME.watch_peers()  # every peer answered: from now on a lost one is named

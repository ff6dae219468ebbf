"""collective in graph mode: every variable on this worker, gradients averaged over the
workers by all-reduce each step (:mod:`tfpsx.modes.collective`, shared with Keras), rank
0's variables broadcast once every session starts. Sessions run on the worker's own
collective server, which ``tfpsx.init_worker()`` started; every rank initializes its own
variables, rank 0 alone restores and saves checkpoints.
"""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from tfpsx import compat, settings
from tfpsx.modes import lockstep
from tfpsx.modes.collective import CollectiveGroup, from_rank_0
from tfpsx.modes.positions import positions_of_graph
from tfpsx.runtime import RUNTIME
from tfpsx.training.modes.base import Mode, WrappedOptimizer
from tfpsx.training.placement import worker_device_of


class CollectiveMode(Mode):
    NAME = "collective"
    EACH_WORKER_INITIALIZES = True

    def __init__(self, strategy, config, graph):
        super().__init__(strategy, config, graph)
        self._group: Optional[CollectiveGroup] = None
        # The idle step of a rank whose data ended (AllReduceOptimizer builds it).
        self.idle: Optional[tuple] = None
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
        group, variables = mode.group(), [v for _, v in pairs]
        specs = [(v.dtype.base_dtype, v.shape) for v in variables]
        if not positions_of_graph():  # equal parts (tfpsx.data.shard): every rank steps
            averaged = group.all_reduce([g for g, _ in pairs], mean=True)
            return self._opt.apply_gradients(list(zip(averaged, variables)), global_step,
                                             name)
        # From tfpsx.data.splits, whose data ends at different steps on different ranks:
        # a rank whose data ended adds zeros, a batch of weight 0 (tfpsx.modes.lockstep).
        # Its idle all-reduce must meet the others' training one; graph mode matches a
        # collective across ranks by the step ids of the session runs that hold it (TF
        # numbers a graph's runs with collectives), which a run of other fetches does
        # not share (measured: "Delete called on non-empty BufRendezvous" in 2 of 3
        # runs), so both run the all-reduce eagerly, through a tf.numpy_function, as
        # the hybrid mode does.
        if not all(shape.is_fully_defined() for _, shape in specs):
            raise ValueError(
                f"collective mode from tfpsx.data.splits: variables "
                f"{[v.name for v in variables if not v.shape.is_fully_defined()]} have no "
                "static shape; a rank whose data ended cannot take part in the others' "
                "steps without it")

        def eager_total(flat):
            with compat.eager_mode(), tf.device(group.device):  # (out of the graph)
                return group.total_in_step(tf.constant(flat)).numpy()

        def total_in_step(flat):
            return tf.numpy_function(eager_total, [flat], flat.dtype, stateful=True,
                                     name="tfpsx_collective_all_reduce")

        averaged = lockstep.reduce_in_step([g for g, _ in pairs], total_in_step, group.size,
                                           "collective all-reduce",
                                           [v.shape for v in variables])
        train = self._opt.apply_gradients(list(zip(averaged, variables)), global_step, name)
        # The idle step (the session hook's end): the same all-reduces, fed zeros and a
        # count of 0, and the optimizer's apply of their sums.
        specs = [(dtype, shape.as_list()) for dtype, shape in specs]
        with tf.name_scope("tfpsx_collective_idle"):
            sums = [tf.compat.v1.placeholder(dtype, [n + 1])
                    for dtype, n in lockstep.flat_sizes(specs)]
            apply = self._opt.apply_gradients(
                list(zip(lockstep.apply_summed(specs, sums, group.size), variables)),
                global_step)
        mode.idle = (specs, eager_total, sums, apply)
        return train


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

    def end(self, session):
        """This rank's data ended: it takes part in the steps of the ranks still
        training until every rank's did (an input leased as each rank goes ends their
        data at different steps; :mod:`tfpsx.modes.lockstep`)."""
        mode = self._mode
        if mode.idle is None:
            return
        specs, eager_total, sums, apply = mode.idle
        lockstep.idle_in_session(session, eager_total, specs, sums, apply,
                                 settings.get("TFPSX_COLLECTIVE_TIMEOUT") + 5,
                                 ("collective", f"rank {mode.config.index}", "ranks"))

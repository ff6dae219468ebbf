"""The hybrid mode in graph mode: ``DynamicTable`` s on the parameter servers (async, or
GEO's worker copies synced every K steps), every variable on this worker with its
gradient averaged over the workers each step (:mod:`tfpsx.modes.hybrid`, shared with
Keras).

``model_scope`` places every variable on this worker (the tables place their shards on
the servers themselves); :class:`HybridOptimizer` averages the dense gradients and
applies them here (``global_step`` counts the job's steps, which every worker runs
together). A session hook starts the dense all-reduce when a session starts (the ports
met on server 0) and gives every worker rank 0's variables; every worker initializes
its own variables, rank 0 alone restores and saves checkpoints (tables included).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import tensorflow as tf

from tfpsx import errors, settings
from tfpsx.control.watchdog import translate_uncaught
from tfpsx.modes import hybrid, lockstep
from tfpsx.modes.collective import lost_peer_error, reducible
from tfpsx.modes.group import set_entry
from tfpsx.modes.state import HYBRID_PORTS
from tfpsx.runtime import RUNTIME
from tfpsx.training.modes.base import GraphStateFactory, Mode, WrappedOptimizer
from tfpsx.training.modes.geo import GeoMode
from tfpsx.training.placement import worker_device_of
from tfpsx.waits import bounded_wait


class _DenseHalf:
    """The dense half of a graph-mode hybrid (a mixin before a :class:`Mode`)."""
    NAME = "hybrid"
    EACH_WORKER_INITIALIZES = True
    REPORTS_STEPS = False  # (GEO's rounds) global_step counts the steps themselves

    def validate(self) -> None:
        super().validate()
        if self.config.collective or not self.config.server_num:
            raise ValueError(
                "hybrid mode (dense='allreduce') keeps the tables on parameter servers, and "
                "this job has none (a collective job): use DistributedStrategy("
                "collective=True) for a model without tables")

    def _init_dense(self) -> None:
        self.bridge: Optional[hybrid.DenseAllReduce] = None
        self.dense_train_ops = []
        # The idle step (a worker whose data ended, in the others' steps): the specs of
        # the values the training step all-reduces, the fed sums, the apply.
        self.idle: Optional[tuple] = None
        self.add_hook(_DenseHook(self))

    def placement(self):
        return worker_device_of(self.config)

    def variable_creator(self):
        return None  # every variable as TF makes it, on this worker

    @classmethod
    def wrap_optimizer(cls, optimizer, strategy, config):
        return HybridOptimizer(optimizer, strategy, config)

    def local_train_op(self, op) -> None:
        self.dense_train_ops.append(op)

    def total(self, flat: np.ndarray) -> np.ndarray:
        if self.bridge is None:
            raise RuntimeError("hybrid mode: a training step ran before the session started "
                               "the dense all-reduce; train in tfpsx.MonitoredTrainingSession")
        return self.bridge.total(flat)


class HybridAsyncMode(_DenseHalf, Mode):
    """Tables async on the servers; dense weights all-reduced."""

    def __init__(self, strategy, config, graph):
        super().__init__(strategy, config, graph)
        self._init_dense()


class HybridGeoMode(_DenseHalf, GeoMode):
    """Tables GEO (each worker's copy, synced every K steps); dense weights all-reduced."""

    def __init__(self, strategy, config, graph):
        super().__init__(strategy, config, graph)
        self._init_dense()

    def local_train_op(self, op) -> None:
        self.train_ops.append(op)  # GEO counts local steps by them


def mode_class(strategy):
    return HybridGeoMode if strategy.mode == "geo" else HybridAsyncMode


class HybridOptimizer(WrappedOptimizer):
    """Applies, on every worker, the dense gradients averaged over the workers."""

    def __init__(self, optimizer, strategy, config):
        super().__init__(optimizer, "Hybrid")
        self._strategy, self._config = strategy, config

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        mode = mode_class(self._strategy).for_graph(self._strategy, self._config)
        pairs = [(g, v) for g, v in grads_and_vars if g is not None]
        if not pairs:
            raise ValueError("HybridOptimizer: no gradients to apply (every one is None)")
        elsewhere = [v.name for _, v in pairs if "/job:ps" in (v.device or "")]
        if elsewhere:
            raise ValueError(
                f"hybrid mode (dense='allreduce'): variables {elsewhere} live on the "
                "parameter servers; the hybrid mode all-reduces dense variables held by "
                "every worker: build the model inside tfpsx.model_scope(strategy)")
        variables = [v for _, v in pairs]
        size = self._config.worker_num
        averaged = hybrid.mean_in_step(
            [g for g, _ in pairs], hybrid.named_peer_loss(mode.total, self._config), size)
        train = self._opt.apply_gradients(list(zip(averaged, variables)), global_step, name)
        mode.local_train_op(train)
        specs = [(v.dtype.base_dtype, v.shape) for v in variables]
        if all(shape.is_fully_defined() for _, shape in specs):
            # A worker whose data ended applies the others' steps with the same optimizer
            # (the session hook's end): their summed step fed, its mean cut and applied.
            specs = [(dtype, shape.as_list()) for dtype, shape in specs]
            sums = [tf.compat.v1.placeholder(dtype, [None], name="tfpsx_hybrid_idle_sum")
                    for dtype, _ in lockstep.flat_sizes(specs)]
            idle = self._opt.apply_gradients(
                list(zip(lockstep.apply_summed(specs, sums, size), variables)), global_step)
            mode.idle = (specs, sums, idle)
        return train


class _DenseHook(tf.compat.v1.train.SessionRunHook):
    """When a session starts: this worker's dense all-reduce (ports met on server 0),
    then rank 0's variables on every worker. When it ends: the workers meet after their
    last all-reduce."""

    def __init__(self, mode: _DenseHalf):
        self._mode = mode

    def begin(self):
        config = self._mode.config
        n = config.worker_num
        ports = GraphStateFactory(worker_device_of(config)).shared(HYBRID_PORTS, n)
        self._initialized = ports.is_initialized()
        self._init = ports.initializer
        self._port = tf.compat.v1.placeholder(tf.int64, [])
        self._write = set_entry(ports, config.index, self._port)
        self._read = ports.read_value()
        # Rank 0's values come through the dense all-reduce when the session starts: fed.
        self._variables = reducible(tf.compat.v1.global_variables())
        self._values = [tf.compat.v1.placeholder(v.dtype.base_dtype, v.shape)
                        for v in self._variables]
        self._assign = tf.group(*[v.assign(x) for v, x in zip(self._variables, self._values)],
                                name="tfpsx_hybrid_from_rank_0")

    def after_create_session(self, session, coord):
        mode, config = self._mode, self._mode.config
        if mode.bridge is None:
            def write(rank, port):  # (only when the ports are met on server 0)
                self._meet_ports(session, config)
                session.run(self._write, {self._port: port})

            hosts = [address.rsplit(":", 1)[0] for address in config.workers]
            mode.bridge = hybrid.start(config.index, hosts, write,
                                       lambda: session.run(self._read))
        RUNTIME.watch_peers()  # every worker answered: from now on a lost one is named
        # A step's all-reduce that lost a peer fails the session.run with a TF error
        # carrying the PeerUnavailableError: uncaught, it is named and the process exits
        # with the code a restart policy retries.
        translate_uncaught(self._named)
        if self._variables:
            values = mode.bridge.broadcast(session.run(self._variables))
            session.run(self._assign, dict(zip(self._values, values)))

    def _named(self, error):
        return lost_peer_error(error, self._mode.config)

    def _meet_ports(self, session, config) -> None:
        """The chief creates the ports vector on server 0; the others wait for it."""
        timeout = settings.get("TFPSX_SESSION_TIMEOUT")
        if config.is_chief:
            if not session.run(self._initialized):
                session.run(self._init)
            return
        bounded_wait(lambda: session.run(self._initialized), timeout,
                     lambda _: errors.ClusterTimeoutError(
                         f"hybrid mode: worker {config.index} waited {timeout:g} s "
                         "(TFPSX_SESSION_TIMEOUT) for the chief (worker 0) to start its "
                         "session; is it running?"))

    def end(self, session):
        mode = self._mode
        bridge = mode.bridge
        if bridge is None:
            return
        if mode.idle is not None:
            # This worker's data ended: it takes part in the steps of the workers still
            # training until every one's did (an input leased as each worker goes).
            specs, sums, op = mode.idle
            lockstep.idle_in_session(
                session, hybrid.named_peer_loss(bridge.total, mode.config), specs, sums, op,
                settings.get("TFPSX_SESSION_TIMEOUT"),
                ("hybrid", f"worker {mode.config.index}", "workers"))
        bridge.meet_at_end()
        RUNTIME.stop_peer_watch()

"""The hybrid mode on Keras: ``DynamicEmbedding`` tables on the parameter servers (async
or GEO, as the tables train in those modes), every other weight on every worker with its
gradient averaged over the workers each step (:mod:`tfpsx.modes.hybrid`, shared with
graph mode).

* Model weights, optimizer slots and ``optimizer.iterations`` are ordinary variables of
  this worker. A model weight takes worker 0's value when it is created, and every
  weight and optimizer variable again when ``fit`` starts (a checkpoint restored on the
  chief reaches everyone), so the workers' dense weights are equal at every step.
* Keras asks the strategy to all-reduce the gradients: the dense ones are averaged over
  the workers (the mean gradient of the global batch; the loss is not scaled); a
  table's rows were pushed to its servers in the backward pass already, each worker's
  own, as in async / GEO.
* ``optimizer.iterations`` counts steps of the job, which every worker runs together.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import tensorflow as tf

from tfpsx.keras import idle
from tfpsx.keras.modes.base import TRIGGER, CreationContext, KerasMode
from tfpsx.keras.modes.geo import KerasGeo
from tfpsx.keras.variables import SharedVariable, fit_variables
from tfpsx.modes import hybrid, lockstep
from tfpsx.modes.collective import REDUCIBLE, from_rank_0
from tfpsx.modes.state import HYBRID_PORTS
from tfpsx.runtime import RUNTIME


class _AllReducedDense:
    """The dense half (a mixin before a :class:`KerasMode`)."""
    NAME = "hybrid"

    def dense_group(self) -> hybrid.DenseAllReduce:
        """This worker's dense all-reduce (started with the strategy)."""
        bridge = getattr(self, "_bridge", None)
        if bridge is None:
            vector = []  # the ports vector on server 0: made only when ports are met

            def ports() -> SharedVariable:
                if not vector:
                    var = self.state.shared(HYBRID_PORTS, self.worker_num)
                    vector.append(var)
                return vector[0]

            def write(rank, port):
                ports().scatter_update(tf.IndexedSlices(tf.constant([port], tf.int64),
                                                        tf.constant([rank])))

            hosts = [address.rsplit(":", 1)[0] for address in self.config.workers]
            bridge = hybrid.start(self.worker_index, hosts, write,
                                  lambda: ports().read_value().numpy())
            self._bridge = bridge
            RUNTIME.watch_peers()  # every worker answered: from now on a lost one is named
        return bridge

    # ------------------------------------------------------------------ variables
    def create_variable(self, extended, next_creator, kwargs, ctx: CreationContext):
        var = extended.create_local(next_creator, kwargs)
        if ctx.is_model_weight(kwargs) and var.dtype in REDUCIBLE:
            with tf.init_scope():  # differently seeded workers start from worker 0's values
                value = self.dense_group().broadcast([var.read_value().numpy()])[0]
                var.assign(value)
        return var

    # ------------------------------------------------------------------ the step
    def reduce(self, extended, reduce_op, value_destination_pairs, options):
        values = [value for value, _ in value_destination_pairs]
        if not values:
            return []
        given = getattr(self, "_given", None)
        if given is not None:  # the idle step (finish_fit): the others' summed step
            return lockstep.apply_summed(
                [(tf.convert_to_tensor(v).dtype, tf.convert_to_tensor(v).shape)
                 for v in values], given, self.worker_num)
        # Every gradient Keras reduces is a dense one's (a table's trigger gives zeros:
        # its rows were pushed in the backward pass).
        self._reduced = len(values)
        return hybrid.mean_in_step(values, self._total, self.worker_num)

    def _total(self, flat):
        return self.keras_strategy.reporting(hybrid.named_peer_loss(
            self.dense_group().total, self.config))(flat)

    def update(self, extended, var, fn, args, kwargs, group):
        return KerasMode.update(self, extended, var, fn, args, kwargs, group)

    # ------------------------------------------------------------------ fit
    def finish_fit(self, model) -> None:
        """This worker's ``fit`` ended well: it takes part in the steps of the workers
        still training, idle, applying their mean (an input leased as each worker goes
        ends their data at different steps), until every worker's ended
        (:mod:`tfpsx.modes.lockstep`)."""
        super().finish_fit(model)
        if getattr(self, "_bridge", None) is None:
            return
        applied = idle.take_part_idle(
            model, self, self.keras_strategy, lambda _, flat: self._total(flat),
            getattr(self, "_reduced", None), "hybrid", f"worker {self.worker_index}",
            "workers")
        lockstep.log_idle(("hybrid", f"worker {self.worker_index}", "workers"), applied)

    def after_fit(self, model, failed: bool) -> None:
        super().after_fit(model, failed)
        if failed or getattr(self, "_bridge", None) is None:
            return
        self._bridge.meet_at_end()
        RUNTIME.stop_peer_watch()

    def broadcast_model(self, model) -> None:
        """Worker 0's model weights and optimizer variables on every worker (``fit``'s
        start: after a restore on the chief)."""
        def broadcast(variables):
            RUNTIME.watch_peers()
            return self.dense_group().broadcast([np.asarray(v.numpy()) for v in variables])

        from_rank_0([v for v in fit_variables(model) if not isinstance(v, SharedVariable)
                     and getattr(v, "name", "") != TRIGGER], broadcast)


class KerasHybridAsync(_AllReducedDense, KerasMode):
    """Hybrid: tables async on the PS (each worker's rows applied there as they come)."""

    def begin_fit(self, model) -> None:
        super().begin_fit(model)
        self.broadcast_model(model)


class KerasHybridGeo(_AllReducedDense, KerasGeo):
    """Hybrid: tables GEO (each worker's copy, synced every K steps); no dense copies:
    GEO's rounds move table rows only."""

    def create_variable(self, extended, next_creator, kwargs, ctx: CreationContext):
        return _AllReducedDense.create_variable(self, extended, next_creator, kwargs, ctx)

    def begin_fit(self, model) -> None:
        super().begin_fit(model)
        self.broadcast_model(model)


def hybrid_class(options) -> Optional[type]:
    """The hybrid mode's class for ``options`` (None when not hybrid; the strategy
    admits the hybrid with async or GEO tables only)."""
    if not options.hybrid:
        return None
    return KerasHybridGeo if options.mode == "geo" else KerasHybridAsync

"""Model weights on the parameter servers, for Keras: async, and the base of sync and
bounded staleness.

:class:`OnServers`: model weights and optimizer slots are shared resources on the
parameter servers (large weights partitioned, read through a per-step view); an
optimizer update runs where its variable lives, and every step reads the current global
values.

:class:`KerasAsync`: nobody waits. ``optimizer.iterations`` is the job's global step: a
counter on PS 0 that every worker's step increments (atomically: Keras increments
iterations by a read and an assign, which would lose steps if the variable itself were
shared), copied into each worker's own.
"""

from __future__ import annotations

from typing import Dict, List

import tensorflow as tf

from tfpsx import settings
from tfpsx.keras.modes.base import SHARED_PREFIX, CreationContext, KerasMode
from tfpsx.keras.partitioned import PartitionedVariable, View, partitions
from tfpsx.keras.variables import SharedVariable, initialize


class OnServers(KerasMode):
    """Model weights and optimizer slots on the parameter servers (see the module doc);
    ``optimizer.iterations`` stays on this worker, in ``iterations``, for the mode to set."""

    def __init__(self, keras_strategy, options, config):
        super().__init__(keras_strategy, options, config)
        self.iterations: List[tf.Variable] = []  # the optimizers' step counts (local copies)
        self.views: Dict[int, View] = {}  # id(local variable) -> the view of a partitioned one
        self._published = False

    def check_model(self, model) -> None:
        steps = getattr(model.optimizer, "gradient_accumulation_steps", None)
        if steps:
            raise ValueError(
                f"{self.NAME}: the optimizer's gradient_accumulation_steps={steps} keeps "
                "accumulators that every worker would update at once on the PS; drop it "
                "(each worker's step already applies its own batch) or use GEO (k_steps > 0)")

    def create_variable(self, extended, next_creator, kwargs, ctx: CreationContext):
        parent = self.views.get(id(kwargs.get("colocate_with"))) if ctx.is_slot(kwargs) else None
        if parent is not None:  # a slot of a partitioned weight: a view too
            return self._slot_view(extended, next_creator, kwargs, ctx, parent)
        slot_of_shared = ctx.is_slot(kwargs) and "/job:ps/" in kwargs["colocate_with"].device
        if slot_of_shared:
            return self.shared(ctx.path, kwargs)
        if ctx.is_model_weight(kwargs):
            global_ = self.global_variable(ctx.path, kwargs)
            if isinstance(global_, SharedVariable):
                return global_
            return self._view(extended, next_creator, kwargs, global_).local
        var = extended.create_local(next_creator, kwargs)
        if ctx.is_iterations():
            self.iterations.append(var)
        return var

    # ------------------------------------------------------------------ partitioned
    def _view(self, extended, next_creator, kwargs, global_: PartitionedVariable) -> View:
        local = extended.create_local(next_creator, dict(kwargs,
                                                         initial_value=global_.read_value()))
        view = View(local, global_)
        self.views[id(local)] = view
        return view

    def _slot_view(self, extended, next_creator, kwargs, ctx, parent: View):
        init = kwargs["initial_value"]
        init = tf.convert_to_tensor(init() if callable(init) else init, kwargs.get("dtype"))
        if init.shape == parent.local.shape:  # slice by slice beside the weight's
            global_ = self.partitioned(ctx.path, kwargs, init, len(parent.global_.slices),
                                       devices=parent.global_.devices)
        else:
            global_ = self.partitioned(ctx.path, kwargs, init, max(1, partitions(
                self.keras_strategy.variable_partitioner, ctx.path, init.shape, init.dtype)))
        view = self._view(extended, next_creator, dict(kwargs, initial_value=init), global_)
        parent.slots.append(view)
        return view.local

    def before_step(self) -> list:
        # Every step reads the current global values of the partitioned weights and of
        # their slots (what an unpartitioned variable on a PS gives a step).
        return [v.refresh() for v in self.views.values()]

    def job_value(self, variable):
        """A partitioned weight's (or its slot's) value in the job's model: its slices
        on the servers, not this worker's view of them, which holds them as this
        worker's last step read them (a checkpoint the chief saves after the others'
        last steps must hold those too); None for any other variable (it lives on the
        servers already)."""
        backend = getattr(variable, "value", variable)  # (a Keras variable's tf.Variable)
        view = self.views.get(id(backend)) or self.views.get(id(variable))
        return None if view is None else view.global_.read_value()

    def refresh_views(self) -> None:
        """Eagerly: the views take the global values (before evaluate / predict / save)."""
        for v in self.views.values():
            v.refresh()
            v.read = None

    def update(self, extended, var, fn, args, kwargs, group):
        view = self.views.get(id(var))
        if view is not None:
            # The update runs on the worker, on the values read at the step's start; what
            # it changed in the weight and its slots is added to their slices.
            result = extended.update_on(self.worker_device, var, fn, args, kwargs, group)
            for v in [view] + view.slots:
                self.record(v.push_change())
            return result
        # The optimizer's math runs beside the variable: only the gradient travels there.
        result = extended.update_on(var.device, var, fn, args, kwargs, group)
        self.applied(var)
        return result

    def publish(self, model) -> None:
        # A restore (load_weights) before the first fit changed the chief's views: the
        # job continues from that model.
        if self._published:  # only before the first fit
            return
        for v in self.views.values():
            if not bool(tf.reduce_all(tf.equal(v.local.read_value(), v.global_.read_value()))):
                v.global_.assign(v.local.read_value())

    def begin_eval(self, model) -> None:
        super().begin_eval(model)
        self.refresh_views()

    def end_fit(self, model) -> None:
        self.refresh_views()  # what the model holds after fit: the global values

    def begin_fit(self, model) -> None:
        super().begin_fit(model)
        self._published = True
        self.refresh_views()


class KerasAsync(OnServers):
    NAME = "async"

    def __init__(self, keras_strategy, options, config):
        super().__init__(keras_strategy, options, config)
        self._global_step = None

    def global_step(self) -> SharedVariable:
        """PS 0's count of every worker's training steps."""
        if self._global_step is None:
            self._global_step = SharedVariable(
                shared_name=SHARED_PREFIX + "global_step", shape=[], dtype=tf.int64,
                device=self.ps_devices[0], trainable=False, name="global_step")
            initialize(self._global_step, tf.constant(0, tf.int64), self.is_chief,
                       settings.get("TFPSX_SESSION_TIMEOUT"))
        return self._global_step

    def job_value(self, variable):
        """``optimizer.iterations``: the job's global step on PS 0 (this worker's copy
        lags the others' steps since its own last one); a partitioned weight's slices
        (:meth:`OnServers.job_value`); None for any other variable."""
        backend = getattr(variable, "value", variable)  # (a Keras variable's tf.Variable)
        if any(it is variable or it is backend for it in self.iterations):
            return self.global_step().read_value()
        return super().job_value(variable)  # (a partitioned weight's slices)

    def publish(self, model) -> None:
        # A restore before the first fit set the chief's step (IncrementalCheckpoint's
        # restore): the job's global step goes on from it.
        published = self._published
        super().publish(model)
        if published or not self.iterations:
            return
        step = self.iterations[0].read_value()
        if int(step) != 0 and int(self.global_step().read_value()) == 0:
            self.global_step().assign(tf.cast(step, tf.int64))

    def begin_fit(self, model) -> None:
        super().begin_fit(model)
        now = self.global_step().read_value()
        for it in self.iterations:
            it.assign(now)

    def after_step(self) -> list:
        step = self.global_step()
        with tf.control_dependencies(self.take_trace_ops()):
            bump = step.assign_add(1, read_value=False)
        with tf.control_dependencies([bump]):
            now = step.read_value()
        return [it.assign(now, read_value=False) for it in self.iterations] or [bump]

"""async on Keras: model weights and optimizer slots are shared resources on the parameter
servers; each worker's optimizer update runs where its variable lives, and every step
reads the current global values. Nobody waits.

``optimizer.iterations`` is the job's global step: a counter on PS 0 that every worker's
step increments (atomically: Keras increments iterations by a read and an assign, which
would lose steps if the variable itself were shared), copied into each worker's own.
"""

from __future__ import annotations

from typing import List

import tensorflow as tf

from tfpsx import settings
from tfpsx.keras.modes.base import SHARED_PREFIX, CreationContext, KerasMode
from tfpsx.keras.variables import SharedVariable, initialize


class KerasAsync(KerasMode):
    NAME = "async"

    def __init__(self, keras_strategy, options, config):
        super().__init__(keras_strategy, options, config)
        self.iterations: List[tf.Variable] = []  # the optimizers' step counts (local copies)
        self._global_step = None

    def check_model(self, model) -> None:
        steps = getattr(model.optimizer, "gradient_accumulation_steps", None)
        if steps:
            raise ValueError(
                f"{self.NAME}: the optimizer's gradient_accumulation_steps={steps} keeps "
                "accumulators that every worker would update at once on the PS; drop it "
                "(each worker's step already applies its own batch) or use GEO (k_steps > 0)")

    def create_variable(self, extended, next_creator, kwargs, ctx: CreationContext):
        slot_of_shared = ctx.is_slot(kwargs) and "/job:ps/" in kwargs["colocate_with"].device
        if ctx.is_model_weight(kwargs) or slot_of_shared:
            return self.shared(ctx.path, kwargs)
        var = extended.create_local(next_creator, kwargs)
        if ctx.is_iterations():
            self.iterations.append(var)
        return var

    def update(self, extended, var, fn, args, kwargs, group):
        # The optimizer's math runs beside the variable: only the gradient travels there.
        result = extended.update_on(var.device, var, fn, args, kwargs, group)
        self.applied(var)
        return result

    def global_step(self) -> SharedVariable:
        """PS 0's count of every worker's training steps."""
        if self._global_step is None:
            self._global_step = SharedVariable(
                shared_name=SHARED_PREFIX + "global_step", shape=[], dtype=tf.int64,
                device=self.ps_devices[0], trainable=False, name="global_step")
            initialize(self._global_step, tf.constant(0, tf.int64), self.is_chief,
                       settings.get("TFPSX_SESSION_TIMEOUT"))
        return self._global_step

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

"""The learning rate of data-parallel training: proportional to the global batch, with a
warm-up (Goyal et al., "Accurate, Large Minibatch SGD", 2017).

With W workers of batch B each, a step averages W * B examples: the gradient's noise
falls, and the learning rate that trained one worker well is too small. The linear
scaling rule multiplies it by the global batch over the batch it was tuned for; the
warm-up ramps it there linearly over the first steps, while the weights are still far
from any minimum and a large step diverges.
"""

from __future__ import annotations

from typing import Optional

import keras


@keras.saving.register_keras_serializable(package="tfpsx")
class ScaledLearningRate(keras.optimizers.schedules.LearningRateSchedule):
    """``base_lr * global_batch / base_batch``, reached linearly over ``warmup_steps``
    from ``base_lr``.

    Args:
      base_lr: the learning rate tuned for batches of ``base_batch`` examples.
      base_batch: that batch size.
      global_batch: the examples of one step over all workers (batch x worker count).
      warmup_steps: steps of the linear ramp (0: the scaled rate from the first step).

    Raises:
      ValueError: a non-positive rate or batch, or a negative warm-up.

    Example::

      lr = tfpsx.keras.ScaledLearningRate(1e-3, base_batch=256,
                                          global_batch=256 * tfpsx.worker_num(),
                                          warmup_steps=500)
      model.compile(optimizer=keras.optimizers.Adam(lr), ...)
    """

    def __init__(self, base_lr: float, base_batch: int, global_batch: int,
                 warmup_steps: int = 0, name: Optional[str] = None):
        checks = (("base_lr", base_lr, (int, float), 0.0, False),
                  ("base_batch", base_batch, (int,), 0, False),
                  ("global_batch", global_batch, (int,), 0, False),
                  ("warmup_steps", warmup_steps, (int,), 0, True))
        for what, value, kinds, low, may_equal in checks:
            if (isinstance(value, bool) or not isinstance(value, kinds) or value < low
                    or (value == low and not may_equal)):
                raise ValueError(f"ScaledLearningRate: {what} must be a number "
                                 f"{'>=' if may_equal else '>'} {low}, got {value!r}")
        self.base_lr, self.base_batch, self.global_batch = float(base_lr), base_batch, global_batch
        self.warmup_steps, self.name = warmup_steps, name
        self.target = self.base_lr * global_batch / base_batch

    def __call__(self, step):
        step = keras.ops.cast(step, "float32")
        if not self.warmup_steps:
            return keras.ops.full_like(step, self.target)
        ramp = keras.ops.minimum(step / float(self.warmup_steps), 1.0)
        return self.base_lr + (self.target - self.base_lr) * ramp

    def get_config(self):
        return {"base_lr": self.base_lr, "base_batch": self.base_batch,
                "global_batch": self.global_batch, "warmup_steps": self.warmup_steps,
                "name": self.name}

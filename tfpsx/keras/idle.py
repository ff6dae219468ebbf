"""Keras's side of a lockstep worker whose data ended (:mod:`tfpsx.modes.lockstep`): after
its ``fit`` it takes part in the steps of the workers still training, idle, applying each
step's all-reduced sum with the model's own optimizer, so that every copy of the weights
stays the same. The collective strategy and the hybrid's dense half share it."""

from __future__ import annotations

from typing import Callable, Optional

import tensorflow as tf

from tfpsx.modes import lockstep


def take_part_idle(model, owner, strategy, total: Callable, reduced: Optional[int],
                   mode: str, who: str, others: str) -> int:
    """Runs ``model``'s idle steps until no worker trains (:func:`lockstep.idle_until_done`);
    returns the steps applied.

    Args:
      owner: what reduces the step's gradients: while an idle step is traced its
        ``_given`` holds the step's sums, which its reduce hands out in place of this
        worker's zeros.
      strategy: the tf.distribute strategy the idle step runs in.
      total: ``total(step, flat)``, the all-reduced sum of a flat array.
      reduced: how many gradients the training step all-reduced (None: not traced).
      mode, who, others: in the error ("collective", "rank 1", "ranks").

    Raises:
      ValueError: the training step all-reduced fewer gradients than the model has
        trainable variables (one without a gradient): an idle step would not meet it.
    """
    variables = list(model.trainable_variables)
    if reduced is not None and reduced != len(variables):
        raise ValueError(
            f"{mode} mode: {who}'s training step all-reduced {reduced} gradient(s) but the "
            f"model has {len(variables)} trainable variable(s) (one without a gradient?); "
            f"it cannot take part in the steps of the {others} still training after its "
            "own data ended: give every trainable variable a gradient, or feed the job "
            "with tfpsx.data.shard (equal parts)")
    specs = [(tf.as_dtype(v.dtype), [int(d) for d in v.shape]) for v in variables]
    steps = []  # (the compiled step, made at the first step to apply)

    def apply(sums) -> None:
        if not steps:
            steps.append(idle_step(model, variables, owner, strategy))
        steps[0]([tf.constant(s) for s in sums])

    return lockstep.idle_until_done(total, specs, apply)


def idle_step(model, variables, owner, strategy):
    """A compiled step applying the others' summed step with the model's optimizer
    (zeros of this worker's go in; ``owner``'s reduce gives the step instead)."""
    @tf.function
    def step(sums):
        def replica():
            owner._given = sums
            try:
                model.optimizer.apply([tf.zeros(v.shape, v.dtype) for v in variables],
                                      variables)
            finally:
                owner._given = None
        strategy.run(replica)

    return step

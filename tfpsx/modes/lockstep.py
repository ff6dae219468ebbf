"""Steps every worker takes together (collective, and the hybrid's dense half), from an
input whose data ends at different steps on different workers, written once for both
front-ends and both modes.

Each step all-reduces the workers' gradients. ``tfpsx.data.splits`` leases the input as
each worker goes, so one worker's data ends while the others still have batches, and
their next all-reduce would wait for it. The way out, as PyTorch DDP's ``Join`` and
Horovod's ``join`` do it: a worker whose data ended goes on taking part, idle, as if it
trained a batch of weight 0.

* Each of a step's all-reduces (one per dtype: the gradients packed flat) carries a 1
  after the values of a worker that trained the step, a 0 after an idle worker's zeros:
  the sum's last element counts the workers that trained it (:func:`reduce_in_step`).
* The step's gradient is the sum over the world size, not over that count (the
  ``divide`` given: the world size for a mean, 1 where Keras scaled the loss by it
  already): every example weighs the same in the model whichever step holds it (the
  default of DDP's ``Join``, ``divide_by_initial_world_size``).
* An idle worker applies the same step with its own optimizer (:func:`idle_until_done`,
  then :func:`apply_summed`), so every copy of the weights stays the same, bit for bit.
* It leaves at the first step no worker trains: a count of 0, which every worker sees in
  the same all-reduce, so all of them leave together.
"""

from __future__ import annotations

import logging
from typing import Callable, List, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tfpsx.modes.collective import layout, packed, unpacked

logger = logging.getLogger("tfpsx")


def reduce_in_step(values: Sequence, total: Callable[[tf.Tensor], tf.Tensor], divide: int,
                   what: str, shapes=None) -> List[tf.Tensor]:
    """Inside a step being built (a ``tf.function`` or a TF1 graph): the sum of ``values``
    over the workers, over ``divide``, by ``total`` (a flat tensor's sum over the
    workers, an op of the step). Values of one dtype travel packed in one all-reduce, a
    1 after them (a worker that trained the step). ``IndexedSlices`` (a sparse
    gradient) are made dense first. ``shapes``: the values' static shapes (their
    variables'), where TF does not know them (a collective's key needs the size)."""
    def reduce_flat(flat):
        one = tf.ones([1], flat.dtype)
        summed = total(tf.concat([flat, one], 0))
        n = flat.shape[0]
        summed.set_shape([None if n is None else n + 1])
        return mean_of(summed, divide)

    return packed(values, reduce_flat, what, shapes)


def mean_of(summed: tf.Tensor, divide: int) -> tf.Tensor:
    """A step's summed flat values (its last element, the count, dropped) over
    ``divide``."""
    values = summed[:-1]
    if divide == 1:
        return values
    by = tf.constant(divide, summed.dtype)
    return values / by if summed.dtype.is_floating else values // by


def flat_sizes(specs: Sequence[Tuple]) -> List[Tuple[tf.DType, int]]:
    """(dtype, flat size) of each of a step's all-reduces, in order, for values of
    ``specs`` ((dtype, static shape) each, in the order the step reduces them)."""
    order = layout([dtype for dtype, _ in specs])
    return [(dtype, sum(int(np.prod(specs[i][1], dtype=np.int64)) for i in members))
            for dtype, members in order]


def idle_until_done(total: Callable[[int, np.ndarray], np.ndarray], specs: Sequence[Tuple],
                    apply: Callable[[List[np.ndarray]], None]) -> int:
    """This worker's data ended (both front-ends, after its last step): it takes part in
    the others' steps idle, zeros and a count of 0 to each of a step's all-reduces
    (``total(i, flat)``: the step's i-th all-reduce of a flat array, the same collective
    the training step runs), and applies each step (``apply(sums)``: the step's summed
    flat arrays, each ending with its count), until a step no worker trains.
    ``specs``: (dtype, static shape) of each value the training step reduces, in order.
    Each all-reduce is bounded (TFPSX_COLLECTIVE_TIMEOUT); a lost worker fails it, named.
    Returns the steps applied."""
    sizes = flat_sizes(specs)
    steps = 0
    while sizes:
        sums = [np.asarray(total(i, np.zeros([n + 1], dtype.as_numpy_dtype)))
                for i, (dtype, n) in enumerate(sizes)]
        if int(round(float(sums[0][-1]))) == 0:
            break
        apply(sums)
        steps += 1
    return steps


def idle_in_session(session, total: Callable[[np.ndarray], np.ndarray], specs, sums, op,
                    timeout: float, who: str) -> int:
    """Graph mode's :func:`idle_until_done`, in a session hook's ``end``: each step applied
    by running ``op`` with the step's sums fed to ``sums`` (placeholders), bounded by
    ``timeout`` seconds a run; ``total(flat)``: the step's all-reduce. Logs what ``who``
    (e.g. ``("collective", "rank 1", "ranks")``) applied. Returns the steps applied."""
    options = tf.compat.v1.RunOptions(timeout_in_ms=int(1000 * timeout))
    applied = idle_until_done(lambda _, flat: total(flat), specs,
                              lambda got: session.run(op, dict(zip(sums, got)),
                                                      options=options))
    log_idle(who, applied)
    return applied


def log_idle(who: Tuple[str, str, str], applied: int) -> None:
    """Logs how ``who`` (e.g. ``("collective", "rank 1", "ranks")``) ended: its data
    ended first and it applied ``applied`` steps of the others, or (0) its data ended at
    the job's last step (last, or with every other's: splits are leased as each reads,
    so that happens too)."""
    mode, one, others = who
    if applied:
        logger.info("%s: %s's data ended first: it applied %d step(s) of the %s still "
                    "training", mode, one, applied, others)
    else:
        logger.info("%s: %s's data ended at the job's last step: no step of the %s to "
                    "apply", mode, one, others)


def apply_summed(specs: Sequence[Tuple], sums: Sequence[tf.Tensor], divide: int
                 ) -> List[tf.Tensor]:
    """The values a step's summed flat arrays (:func:`idle_until_done`'s) give, cut into
    ``specs``' shapes, in order: what the training step's all-reduce gave the workers
    that trained it, computed the same way."""
    order = layout([dtype for dtype, _ in specs])
    return unpacked([list(shape) for _, shape in specs], [mean_of(s, divide) for s in sums],
                    order)


__all__ = ["apply_summed", "flat_sizes", "idle_in_session", "idle_until_done", "mean_of",
           "reduce_in_step"]

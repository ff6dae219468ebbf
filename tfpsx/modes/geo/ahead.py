"""GEO's pull of the rows a worker will read (``geo_pull_ahead=S``), for both
front-ends' background rounds: which rounds pull ahead, how far ahead they must read,
and what the keys sent up cost (docs/modes.md, "A pull of the rows a worker will read").

A round that starts at local step s pulls the changed rows among the ids of the
batches of steps s to s + :func:`window_steps` (its next pull lands before the round
after it, due K steps on, ends: the schedule holds training at 2K; plus the executions
a front-end dispatches ahead), and every changed row after S such rounds, or where the
input was not read that far (the front-end's reader gives None). The ids come from the
front-end (Keras: :mod:`tfpsx.keras.read_ahead`).
"""

from __future__ import annotations

import logging
from typing import Callable, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from tfpsx.modes.geo.choice import IDLE, SKIP
from tfpsx.modes.geo.rule import GEO_AUTO_KN_BACKGROUND

logger = logging.getLogger("tfpsx")

KEY_BYTES = 8  # a key sent up with a pull among keys


def read_ahead_depth(options, workers: int) -> int:
    """The batches the input must read ahead (the ``DistributedStrategy``'s
    ``options``, a job of ``workers``): :func:`window_steps` at the largest K the job
    may run (its ``k_steps``; "auto": at most GEO_AUTO_KN_BACKGROUND // N), one step an
    execution, and room."""
    k = (max(1, GEO_AUTO_KN_BACKGROUND // max(1, workers)) if options.k_auto
         else int(options.k_steps))
    return 2 * k + 8


def window_steps(k_steps: int, per_call: int) -> int:
    """The local steps from a round's start that may read what its pull brings."""
    return 2 * k_steps + 2 * per_call + 2


def key_bytes(tables, among: Optional[Sequence], actions: Optional[Sequence[str]]) -> int:
    """The bytes a round's pull among keys sent up: the keys of the tables whose pull
    took them (not a worker cache's, nor a table that trains async)."""
    if among is None:
        return 0
    return KEY_BYTES * sum(
        int(keys.shape[0]) for t, keys, action in
        zip(tables, among, actions or [None] * len(among))
        if not t.cached and action not in (SKIP, IDLE))


class AheadPulls:
    """Which of a ``fit``'s (or a session's) background rounds pull ahead
    (``geo_pull_ahead=every``), and the window they read (see the module doc)."""

    def __init__(self, every: int, depth: int):
        self.every, self.depth = every, depth
        self.steps = 0    # the window a round reads ahead, in local steps
        self._rounds = 0  # rounds since the last pull of every changed row

    def begin(self, reading: bool, k_steps: int, per_call: int) -> None:
        """Training starts with rounds ``k_steps`` apart and ``per_call`` steps an
        execution; ``reading``: the front-end records the batches' ids. Logged."""
        self.steps = window_steps(k_steps, per_call)
        self._rounds = 0
        if not reading:
            logger.warning("GEO: geo_pull_ahead=%d reads no ids ahead in this fit (its "
                           "input was not given to fit as a dataset Keras distributes, no "
                           "layer of the model looks up a GEO table, or the model is not "
                           "a functional one whose embedding layers' inputs are a "
                           "sub-model's outputs): every round pulls every changed row",
                           self.every)
        elif self.steps > self.depth:
            logger.warning("GEO: geo_pull_ahead=%d: a round's pull needs the ids of %d "
                           "batches ahead (2 x k_steps=%d + 2 x steps_per_execution=%d + "
                           "2), the input reads %d ahead: every round pulls every changed "
                           "row", self.every, self.steps, k_steps, per_call, self.depth)
        else:
            logger.info("GEO: geo_pull_ahead=%d: a round pulls the changed rows among the "
                        "ids of the next %d batches (read ahead), every changed row after "
                        "%d such rounds", self.every, self.steps, self.every)

    def among(self, first_step: int,
              window: Callable[[int, int], Optional[List[np.ndarray]]],
              counters=None) -> Optional[List[tf.Tensor]]:
        """The ids per table whose changed rows the pull of a round that started at
        local step ``first_step`` brings (``window(first, length)``: the front-end's
        recorded ids, or None where it did not read that far), or None: every changed
        row (after ``every`` rounds ahead, or no window). A round ahead is counted in
        ``counters`` (GEO's, ``pulls_ahead``)."""
        self._rounds += 1
        keys = window(first_step, self.steps) if self._rounds <= self.every else None
        if keys is None:
            self._rounds = 0
            return None
        if counters is not None:
            counters.add(pulls_ahead=1)
        return [tf.constant(k, tf.int64) for k in keys]


__all__ = ["AheadPulls", "KEY_BYTES", "key_bytes", "read_ahead_depth", "window_steps"]

"""GEO's pull of the rows a worker will read (``geo_pull_ahead=S``), for both
front-ends' background rounds: which rounds pull ahead, how far ahead they must read,
and what the keys sent up cost (docs/modes.md, "A pull of the rows a worker will read").

A round that starts at local step s pulls the changed rows among the ids of the
batches of steps s to s + :func:`window_steps` (its next pull lands before the round
after it, due K steps on, ends: the schedule holds training at 2K; plus the executions
a front-end dispatches ahead), and every changed row after S such rounds, or where the
input was not read that far (the front-end's reader gives None). The ids come from the
front-end, kept in a :class:`BatchIds` (Keras: :mod:`tfpsx.keras.read_ahead` records
``fit``'s batches; graph mode: :class:`tfpsx.training.read_ahead.GeoReadAhead`, where the
program records its own).
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Callable, List, Optional, Sequence

import numpy as np

from tfpsx.modes.geo.choice import IDLE, SKIP
from tfpsx.modes.geo.rule import GEO_AUTO_KN_BACKGROUND

logger = logging.getLogger("tfpsx")

KEY_BYTES = 8  # a key sent up with a pull among keys


def depth_at(k_steps: int) -> int:
    """The batches an input must read ahead for rounds ``k_steps`` apart:
    :func:`window_steps` at one step an execution, and room."""
    return window_steps(k_steps, 1) + 4


def read_ahead_depth(options, workers: int) -> int:
    """The batches the input must read ahead (the ``DistributedStrategy``'s
    ``options``, a job of ``workers``): :func:`depth_at` the largest K the job may run
    (its ``k_steps``; "auto": at most GEO_AUTO_KN_BACKGROUND // N)."""
    k = (max(1, GEO_AUTO_KN_BACKGROUND // max(1, workers)) if options.k_auto
         else int(options.k_steps))
    return depth_at(k)


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


class BatchIds:
    """The unique ids per table of the batches read ahead of the steps, each with the
    local step that will train it (batches counted in the order the steps take them)."""

    def __init__(self, tables: int = 0, first_step: int = 0):
        self._lock = threading.Lock()
        self._tables = tables
        self._next = first_step  # the local step of the next batch recorded
        self._held_from = first_step  # the first local step whose batch is still held
        self._batches = collections.deque()  # (local step, [unique ids per table])

    def reset(self, tables: int, first_step: int) -> None:
        """Drops what was recorded; the next batch is local step ``first_step``."""
        with self._lock:
            self._batches.clear()
            self._tables, self._next = tables, first_step
            self._held_from = first_step

    def append(self, ids: List[np.ndarray], most: Optional[int] = None) -> bool:
        """The next batch's unique ids, one vector per table. With ``most``, the oldest
        batches beyond that many are dropped (a window that would need one is then
        None). Returns whether one was."""
        with self._lock:
            self._batches.append((self._next, ids))
            self._next += 1
            dropped = False
            while most is not None and len(self._batches) > most:
                self._held_from = self._batches.popleft()[0] + 1
                dropped = True
            return dropped

    def recorded(self) -> int:
        """The local step of the next batch to be recorded."""
        with self._lock:
            return self._next

    def window(self, first: int, length: int) -> Optional[List[np.ndarray]]:
        """The unique ids of each table in the batches of local steps ``first`` to
        ``first + length`` (excluded), or None when the input was not read that far
        (or a batch of it is no longer held). Batches before ``first`` are dropped
        (their steps ran)."""
        with self._lock:
            while self._batches and self._batches[0][0] < first:
                self._batches.popleft()
            if first < self._held_from or self._next < first + length:
                return None
            self._held_from = first
            parts = [[ids[i] for step, ids in self._batches if step < first + length]
                     for i in range(self._tables)]
        return [np.unique(np.concatenate(p)) if p else np.zeros([0], np.int64) for p in parts]


KERAS_NOT_READING = (
    "its input was not given to fit as a dataset Keras distributes, no layer of the model "
    "looks up a GEO table, or the model is not a functional one whose embedding layers' "
    "inputs are a sub-model's outputs")


class AheadPulls:
    """Which of a ``fit``'s (or a session's) background rounds pull ahead
    (``geo_pull_ahead=every``), and the window they read (see the module doc)."""

    def __init__(self, every: int, depth: int):
        self.every, self.depth = every, depth
        self.steps = 0    # the window a round reads ahead, in local steps
        self._rounds = 0  # rounds since the last pull of every changed row

    def begin(self, reading: bool, k_steps: int, per_call: int,
              not_reading: str = KERAS_NOT_READING) -> None:
        """Training starts with rounds ``k_steps`` apart and ``per_call`` steps an
        execution; ``reading``: the front-end records the batches' ids (else
        ``not_reading`` says why not). Logged."""
        self.steps = window_steps(k_steps, per_call)
        self._rounds = 0
        if not reading:
            logger.warning("GEO: geo_pull_ahead=%d reads no ids ahead here (%s): every "
                           "round pulls every changed row", self.every, not_reading)
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
              counters=None) -> Optional[List[np.ndarray]]:
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
        return [np.asarray(k, np.int64) for k in keys]


__all__ = ["AheadPulls", "BatchIds", "KEY_BYTES", "depth_at", "key_bytes",
           "read_ahead_depth", "window_steps"]

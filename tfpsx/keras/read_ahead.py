"""The ids ``fit``'s next batches will look up, per GEO table: what a round's pull needs
under ``geo_pull_ahead`` (docs/modes.md, "A pull of the rows a worker will read").

``fit``'s dataset (the one Keras hands to the strategy's
``experimental_distribute_dataset``) passes each batch through a recording step before
the train step takes it, as the worker caches' feeder does (:mod:`tfpsx.keras.feeding`):
the batch's ids, as each GEO table's layers will look them up (only the id handling
runs: :func:`~tfpsx.keras.feeding.id_function`), are kept with the batch's local step,
and a prefetch reads ``depth`` batches ahead of the step. A round that starts at local
step ``s`` asks :meth:`ReadAhead.window` for the ids of the batches ``s`` to ``s + W``
(the steps that may run before its next pull lands); when the input was not read that
far (an epoch's end, the start of a ``fit``), it gets None and pulls every changed row.

Batches are counted from ``fit``'s start (:meth:`ReadAhead.begin` gets the local step
of the first), in the order tf.data gives them: the recording map is sequential and
the prefetch keeps its order. Outside a ``fit`` (Keras's look at a batch before it, an
``evaluate`` or ``predict``) nothing is recorded.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Dict, List, Optional

import numpy as np
import tensorflow as tf

from tfpsx import compat
from tfpsx.keras.feeding import each_batch, features, id_function
from tfpsx.modes.geo import GEO_AUTO_KN_BACKGROUND

logger = logging.getLogger("tfpsx")


class ReadAhead:
    """Records the ids of ``fit``'s batches ahead of its step (see the module doc)."""

    def __init__(self, depth: int):
        if depth < 1:
            raise ValueError(f"ReadAhead: depth must be >= 1 batch, got {depth!r}")
        self.depth = depth
        self._lock = threading.Lock()
        self._active = False
        self._spec = None
        self._ids_fn = None
        self._tables = 0
        self._next = 0  # the local step of the next batch recorded
        self._batches = collections.deque()  # (local step, [unique ids per table])

    def wrap(self, dataset: tf.data.Dataset) -> tf.data.Dataset:
        """``dataset`` with each batch's ids recorded before it is taken (while a ``fit``
        is active; otherwise batches pass unchanged), read ``depth`` batches ahead."""
        self._spec = features(dataset.element_spec)
        return each_batch(dataset, self._record, "tfpsx_read_ahead").prefetch(self.depth)

    def begin(self, model, tables, first_step: int) -> bool:
        """A ``fit`` of ``model`` starts at local step ``first_step``: the ids of each of
        ``tables`` (sharded tables: GEO's, by the layers over them) are recorded from
        its batches. Returns whether any is (False: the dataset was not wrapped, no
        layer of the model looks one up, or the ids are not a functional sub-model's:
        the whole model would run in tf.data's thread, reading dense weights from the
        parameter servers there, unbounded)."""
        by_table: Dict[int, List] = {id(t): [] for t in tables}
        for layer in compat.flatten_layers(model, include_self=False):
            table = getattr(layer, "table", None)
            if id(table) in by_table:
                by_table[id(table)].append(layer)
        groups = [by_table[id(t)] for t in tables]
        layers = [layer for group in groups for layer in group]
        with self._lock:
            self._batches.clear()
            self._next = first_step
            self._active = False
            if self._spec is None or not layers:
                return False
            ids_of = id_function(model, layers, sub_model_only=True)
            if ids_of is None:
                return False
            self._tables = len(tables)

            def ids(x):
                seen = ids_of(x)
                out = []
                for group in groups:
                    got = [i for layer in group for i in seen.get(layer, [])]
                    out.append(tf.unique(tf.concat(got, 0))[0] if got else
                               tf.zeros([0], tf.int64))
                return out

            fn = tf.function(ids, autograph=False, input_signature=[self._spec])
            fn.get_concrete_function()  # traced in fit's thread, not tf.data's
            self._ids_fn = fn
            self._active = True
            return True

    def end(self) -> None:
        """The ``fit`` ended: nothing more is recorded, and what was is dropped."""
        with self._lock:
            self._active = False
            self._batches.clear()

    def _record(self, element) -> None:
        if not self._active:
            return
        got = [t.numpy() for t in self._ids_fn(features(element))]
        with self._lock:
            if self._active:
                self._batches.append((self._next, got))
                self._next += 1

    def window(self, first: int, length: int) -> Optional[List[np.ndarray]]:
        """The unique ids of each table in the batches of local steps ``first`` to
        ``first + length`` (excluded), or None when the input was not read that far.
        Batches before ``first`` are dropped (their steps ran)."""
        with self._lock:
            while self._batches and self._batches[0][0] < first:
                self._batches.popleft()
            if not self._active or self._next < first + length:
                return None
            parts = [[ids[i] for step, ids in self._batches if step < first + length]
                     for i in range(self._tables)]
        return [np.unique(np.concatenate(p)) if p else np.zeros([0], np.int64) for p in parts]


def read_ahead_depth(options, workers: int) -> int:
    """The batches ``fit``'s input reads ahead under ``geo_pull_ahead`` (the
    ``DistributedStrategy``'s ``options``, a job of ``workers``): a round's window
    (:meth:`AheadPulls.begin`) at the largest K the job may run (its ``k_steps``;
    "auto": at most GEO_AUTO_KN_BACKGROUND // N), one step an execution, and room."""
    k = (max(1, GEO_AUTO_KN_BACKGROUND // max(1, workers)) if options.k_auto
         else int(options.k_steps))
    return 2 * k + 8


class AheadPulls:
    """GEO's pulls of the rows a worker will read (``geo_pull_ahead=every``): a
    background round's pull brings the changed rows among the ids of the batches that
    may train before its next pull lands, and every changed row after ``every`` such
    rounds, or when the input was not read that far."""

    def __init__(self, every: int, depth: int):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"geo_pull_ahead must be an int >= 1 here, got {every!r}")
        self.every = every
        self.reader = ReadAhead(depth)
        self.steps = 0    # the window a round reads ahead, in local steps
        self._rounds = 0  # rounds since the last pull of every changed row

    def begin(self, model, tables, first_step: int, k_steps: int) -> None:
        """A ``fit`` starts at local step ``first_step`` with rounds ``k_steps`` apart:
        the batches' ids are recorded from its first step. A background round's next
        pull lands before the round after it is due (K steps on) ends, so the steps up
        to 2K on, plus the executions Keras dispatches ahead, may read what it pulls."""
        per_call = int(getattr(model, "steps_per_execution", 1) or 1)
        self.steps = 2 * k_steps + 2 * per_call + 2
        self._rounds = 0
        if not self.reader.begin(model, tables, first_step):
            logger.warning("GEO: geo_pull_ahead=%d reads no ids ahead in this fit (its "
                           "input was not given to fit as a dataset Keras distributes, no "
                           "layer of the model looks up a GEO table, or the model is not "
                           "a functional one whose embedding layers' inputs are a "
                           "sub-model's outputs): every round pulls every changed row",
                           self.every)
        elif self.steps > self.reader.depth:
            logger.warning("GEO: geo_pull_ahead=%d: a round's pull needs the ids of %d "
                           "batches ahead (2 x k_steps=%d + 2 x steps_per_execution=%d + "
                           "2), the input reads %d ahead: every round pulls every changed "
                           "row", self.every, self.steps, k_steps, per_call,
                           self.reader.depth)
        else:
            logger.info("GEO: geo_pull_ahead=%d: a round pulls the changed rows among the "
                        "ids of the next %d batches (read ahead), every changed row after "
                        "%d such rounds", self.every, self.steps, self.every)

    def end(self) -> None:
        """The ``fit`` ended (its final round pulls every changed row)."""
        self.reader.end()

    def among(self, first_step: int, counters=None) -> Optional[List[tf.Tensor]]:
        """The ids per table whose changed rows the pull of a round that started at
        local step ``first_step`` brings, or None: every changed row (after ``every``
        rounds ahead, or where the input was not read that far). A round ahead is
        counted in ``counters`` (GEO's, ``pulls_ahead``)."""
        self._rounds += 1
        keys = (self.reader.window(first_step, self.steps)
                if self._rounds <= self.every else None)
        if keys is None:
            self._rounds = 0
            return None
        if counters is not None:
            counters.add(pulls_ahead=1)
        return [tf.constant(k, tf.int64) for k in keys]


__all__ = ["AheadPulls", "ReadAhead", "read_ahead_depth"]

"""The ids ``fit``'s next batches will look up, per GEO table: what a round's pull needs
under ``geo_pull_ahead`` (which rounds, and how far: :mod:`tfpsx.modes.geo.ahead`;
docs/modes.md, "A pull of the rows a worker will read").

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

import threading
from typing import Dict, List, Optional

import numpy as np
import tensorflow as tf

from tfpsx import compat
from tfpsx.keras.feeding import each_batch, features, id_function
from tfpsx.modes.geo.ahead import BatchIds


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
        self._batches = BatchIds()

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
            self._batches.reset(len(tables), first_step)
            self._active = False
            if self._spec is None or not layers:
                return False
            ids_of = id_function(model, layers, sub_model_only=True)
            if ids_of is None:
                return False

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
            self._batches.reset(0, 0)

    def _record(self, element) -> None:
        if not self._active:
            return
        got = [t.numpy() for t in self._ids_fn(features(element))]
        with self._lock:
            if self._active:
                self._batches.append(got)

    def window(self, first: int, length: int) -> Optional[List[np.ndarray]]:
        """(:meth:`~tfpsx.modes.geo.ahead.BatchIds.window`; None outside a ``fit``.)"""
        with self._lock:
            if not self._active:
                return None
        return self._batches.window(first, length)


__all__ = ["ReadAhead"]

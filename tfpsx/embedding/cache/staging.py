"""Worker caches fed ahead of the step: the protocol both front-ends run per batch.

A cache is *fed* (:attr:`WorkerCache.fed`) when something stages every batch's rows
before the training step that looks them up: the step then reads and trains the cache
only (no PS op of its table), and what a step would otherwise do with the PS happens in
the stager's thread, overlapping the steps:

* ``stage``: the rows of the batch's ids that the cache lacks are fetched from the PS
  and cached (:meth:`WorkerCache.stage`);
* a cache over its size evicts, its victims' deltas pushed, never a row of one of the
  last ``depth`` batches staged (the one a step trains, those staged ahead);
* an async / staleness cache syncs with the PS every ``flush_steps`` batches (GEO's
  communicator syncs GEO's caches).

Evictions and syncs hold the cache's ``sync_lock`` (so does GEO's communicator): two
pushes of one row's delta at once would add it twice.

Keras ``fit`` stages from its input pipeline (:mod:`tfpsx.keras.feeding`); graph mode
stages from a thread of its own (:class:`tfpsx.training.staging.RowStager`).
"""

from __future__ import annotations

import collections
import threading
from typing import List, Sequence

import numpy as np


class Stager:
    """One batch at a time: :meth:`staged` after the batch's rows are in, with the
    batch's unique keys and the cache's size per cache (read in the staging's own run).
    A front-end implements :meth:`_evict` and :meth:`_flush` in its own execution
    (``tf.function`` s, or ``session.run`` s)."""

    def __init__(self):
        self._lock = threading.Lock()  # one batch at a time
        self._caches: List = []
        self._window: collections.deque = collections.deque()
        self._staged = 0

    def _start(self, caches: Sequence, depth: int) -> None:
        """Stages into ``caches`` from now on, keeping the keys of the last ``depth``
        batches from eviction."""
        self._caches = list(caches)
        self._window = collections.deque(maxlen=depth)
        self._staged = 0

    def staged(self, keys: Sequence, sizes: Sequence) -> None:
        """A batch was staged (``keys[i]``: its unique keys in cache i, ``sizes[i]``:
        the rows cache i holds now): evictions and syncs that are due."""
        self._window.append([np.asarray(k) for k in keys])
        self._staged += 1
        for i, cache in enumerate(self._caches):
            if int(sizes[i]) <= cache.options.size and not (
                    cache.flush_in_step and self._staged % cache.options.flush_steps == 0):
                continue  # (the common case: no lock, no run)
            with cache.sync_lock:
                if int(sizes[i]) > cache.options.size:
                    self._evict(cache, np.concatenate([k[i] for k in self._window]))
                if cache.flush_in_step and self._staged % cache.options.flush_steps == 0:
                    self._flush(cache)

    def _evict(self, cache, keep: np.ndarray) -> None:
        raise NotImplementedError

    def _flush(self, cache) -> None:
        raise NotImplementedError

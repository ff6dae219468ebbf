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
  communicator syncs GEO's caches), in a flusher thread of the stager's, beside the
  stagings and the steps: a sync moves every row trained since the last (on a large
  table, many times a batch's misses), and a staging waiting for it stalled the steps
  (measured: word2vec, 100k-row caches, async at 1.18x no cache with the sync in the
  stager's thread, where the cache's ceiling ran 2.2x). The sync is a row copy's push
  and pull (:mod:`tfpsx.embedding.row_copy`), which GEO's communicator runs beside the
  steps too: a step's update landing during a push stays in ``local - old`` for the
  next one. A sync still due when the last is in progress runs once after it.

Evictions and syncs hold the cache's ``sync_lock`` (so does GEO's communicator): two
pushes of one row's delta at once would add it twice. A staging does not (it would wait
for a whole sync): a row fetched while a sync's pull runs may miss a change another
worker pushed meanwhile, until that row changes on the PS again (the pull's ``local +=
global - old`` then brings the missed change too; the PS's rows are not affected), as
in GEO with a cache. A failed sync fails the next staging with its error, and the end;
:meth:`Stager.open_flushes` / :meth:`Stager.finish_flushes` bracket a session or a
``fit`` (the caches' final flush at the end of training follows).

Keras ``fit`` stages from its input pipeline (:mod:`tfpsx.keras.feeding`); graph mode
stages from a thread of its own (:class:`tfpsx.training.staging.RowStager`).
"""

from __future__ import annotations

import collections
import threading
from typing import List, Optional, Sequence

import numpy as np

from tfpsx.background import BackgroundLoop


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
        self._flusher: Optional[BackgroundLoop] = None
        self._due: List = []  # caches whose sync is due (the flusher takes them)
        self._due_lock = threading.Lock()  # (guards the three lines above and below)
        self._flushing = False  # between open_flushes and finish_flushes
        self._flush_error: Optional[BaseException] = None
        self._generation = 0  # open_flushes calls

    def _start(self, caches: Sequence, depth: int) -> None:
        """Stages into ``caches`` from now on, keeping the keys of the last ``depth``
        stagings from eviction."""
        self._caches = list(caches)
        self._window = collections.deque(maxlen=depth)
        self._staged = 0

    def staged(self, keys: Sequence, sizes: Sequence, batches: int = 1) -> None:
        """``batches`` batches were staged in one run (``keys[i]``: their unique keys in
        cache i, ``sizes[i]``: the rows cache i holds now): evictions and syncs that are
        due (a sync every ``flush_steps`` batches)."""
        self._check_flushes()
        self._window.append([np.asarray(k) for k in keys])
        before, self._staged = self._staged, self._staged + batches
        for i, cache in enumerate(self._caches):
            if int(sizes[i]) > cache.options.size:
                with cache.sync_lock:  # (waits for a sync of the cache in progress)
                    self._evict(cache, np.concatenate([k[i] for k in self._window]))
            if (cache.flush_in_step and self._staged // cache.options.flush_steps >
                    before // cache.options.flush_steps):
                self._flush_later(cache)

    # ------------------------------------------------------------------ the flusher
    def open_flushes(self) -> None:
        """Syncs due from now on run in a flusher thread (a session or ``fit`` starts);
        what a previous one left (a flusher, its error) is dropped."""
        self.finish_flushes(0, raise_error=False)
        with self._due_lock:
            self._flush_error = None
            self._flushing = True
            self._generation += 1  # (a late error of the previous flusher is not ours)

    def _flush_later(self, cache) -> None:
        """Hands ``cache``'s sync to the flusher thread (started on first use); nothing
        once the flushes were finished (a staging that ends after its ``fit``)."""
        with self._due_lock:
            if not self._flushing:
                return
            if cache not in self._due:
                self._due.append(cache)
            if self._flusher is None:
                generation = self._generation
                self._flusher = BackgroundLoop(
                    "worker cache sync", lambda: self._flush_due(generation)).start()
            self._flusher.wake()

    def _flush_due(self, generation: int) -> None:
        with self._due_lock:
            due, self._due = self._due, []
        try:
            for cache in due:
                with cache.sync_lock:
                    self._flush(cache)
        except BaseException as e:  # noqa: BLE001 — raised by the next staging or the end
            with self._due_lock:  # (kept even when the flusher was being stopped)
                if generation == self._generation:
                    self._flush_error = e
            raise

    def _check_flushes(self) -> None:
        """Raises the error of a failed sync (a lost PS's TF error, as itself)."""
        if self._flush_error is not None:
            raise self._flush_error

    def finish_flushes(self, timeout: float, raise_error: bool = True) -> bool:
        """Ends the flusher after the sync in progress (the syncs due and not started
        are left to the caches' final flush); False when it did not end within
        ``timeout`` s. With ``raise_error``, a failed sync's error is raised (after the
        flusher ended): the final flush must not run as if every sync had landed."""
        with self._due_lock:
            flusher, self._flusher = self._flusher, None
            self._flushing, self._due = False, []
        ended = flusher is None or flusher.stop(timeout)
        if raise_error and ended:
            self._check_flushes()
        return ended

    def _evict(self, cache, keep: np.ndarray) -> None:
        raise NotImplementedError

    def _flush(self, cache) -> None:
        raise NotImplementedError

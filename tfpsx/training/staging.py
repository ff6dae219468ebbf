"""Graph mode: worker caches staged one batch ahead, so a cached step runs no PS op.

Without a stager a training step of a table with a worker cache fetches its misses from
the PS and pushes its evictions inside the step. A :class:`RowStager` does that in a
thread of its own, one batch ahead (the protocol: :mod:`tfpsx.embedding.cache.staging`)::

    emb = E.DynamicTable("user", 16, optimizer=E.Adagrad(0.1), cache_size=50_000)
    stager = tfpsx.RowStager([emb])        # before the lookups: the steps read the cache
    looked = emb.lookup_unique(ids_ph)
    ...
    with tfpsx.MonitoredTrainingSession() as sess:  # runs the stager's hook
        pending = stager.stage({emb: batches[0].ids})
        for i, batch in enumerate(batches):
            pending.result()                              # batch i's rows are cached
            if i + 1 < len(batches):
                pending = stager.stage({emb: batches[i + 1].ids})  # while step i runs
            sess.run(train_op, feed(batch))

Every batch a step trains must have been staged (a step that finds an id not staged
fails, naming the table). ``stage`` runs in the stager's thread with the session's own
``tf.Session`` (as GEO's communicator does); :meth:`Staging.result` waits at most
TFPSX_RPC_TIMEOUT. An async cache's syncs run in a flusher thread of the stager's. At the
end of the session the stager finishes what it was given, and the sync in progress,
before the caches' final flush.
"""

from __future__ import annotations

import concurrent.futures
from typing import Dict, Optional, Sequence

import numpy as np
import tensorflow as tf

from tfpsx import errors, graph_state, settings
from tfpsx.embedding.cache.staging import Stager
from tfpsx.embedding.sharding import as_step


class Staging:
    """A batch being staged (what :meth:`RowStager.stage` returns)."""

    def __init__(self, future: concurrent.futures.Future, what: str):
        self._future, self._what = future, what

    def result(self, timeout: Optional[float] = None) -> None:
        """Waits until the batch's rows are cached (at most ``timeout`` s, default
        TFPSX_RPC_TIMEOUT); raises what the staging raised (a lost PS's TF error)."""
        bound = settings.get("TFPSX_RPC_TIMEOUT") if timeout is None else timeout
        try:
            self._future.result(timeout=bound)
        except concurrent.futures.TimeoutError:
            raise errors.ClusterTimeoutError(
                f"RowStager: staging {self._what} did not finish within {bound:g} s "
                "(TFPSX_RPC_TIMEOUT): a parameter server does not answer") from None


class RowStager(tf.compat.v1.train.SessionRunHook, Stager):
    """Stages batches into the worker caches of ``tables`` (see the module doc).

    Args:
      tables: ``DynamicTable`` s with ``cache_size`` (every miss admitted: a cache with
        ``cache_admit_after`` > 1 trains rows it did not admit on the PS from the step).
      ahead: batches staged ahead of the one a step trains (kept from eviction with it).

      global_step: a step counter to advance in the stagings' runs instead of in the
        steps (whose own increment of a PS variable would cost each step a round trip):
        each staging adds the steps trained since the last (the updates of the first
        table's cache: one per step that trains it once), the session's end the rest.
        It counts trained steps late by at most one staging, as GEO mode's by at most k
        steps. Not in GEO mode (whose communicator counts the steps itself).

    Raises:
      ValueError: a table without a worker cache, with ``cache_admit_after`` > 1, or
        already looked up for training (its steps would not read the staged cache).
    """

    def __init__(self, tables: Sequence, ahead: int = 1, global_step=None):
        Stager.__init__(self)
        if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 1:
            raise ValueError(f"RowStager: ahead must be an int >= 1, got {ahead!r}")
        tables = list(tables)
        if not tables:
            raise ValueError("RowStager: tables must name at least one DynamicTable")
        for t in tables:
            cache = getattr(t, "cache", None)
            name = getattr(t, "name", repr(t))
            if cache is None:
                raise ValueError(f"RowStager: table {name!r} has no worker cache; create "
                                 "it with cache_size=N")
            if cache.options.admit_after != 1:
                raise ValueError(f"RowStager: table {name!r} has cache_admit_after="
                                 f"{cache.options.admit_after}; a staged cache admits every "
                                 "row (cache_admit_after=1)")
            if cache.apply_ops:
                raise ValueError(f"RowStager: table {name!r} was already trained in this "
                                 "graph; create the stager before the model's lookups")
        caches = [t.cache for t in tables]
        if global_step is not None and not all(c.flush_in_step for c in caches):
            raise ValueError("RowStager: global_step is counted by GEO mode's communicator; "
                             "pass global_step only for async / staleness tables")
        self._tables = tables
        self._ids = [tf.compat.v1.placeholder(tf.int64, [None], name=f"stage_ids_{i}")
                     for i in range(len(caches))]
        step = tf.compat.v1.train.get_global_step()
        self._stage = [c.stage(ids, as_step(step) if step is not None else None)
                       for c, ids in zip(caches, self._ids)]
        self._keep = tf.compat.v1.placeholder(tf.int64, [None], name="stage_keep")
        self._evict_ops = {c: c.evict_except(self._keep) for c in caches}
        self._flush_ops = {c: c.flush() for c in caches if c.flush_in_step}
        self._count = _step_counter(caches[0], global_step) if global_step is not None else []
        for cache in caches:
            cache.fed = True
        self._start(caches, depth=2 * ahead + 3)
        self._session = None
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        graph_state.of().stagers.append(self)

    # ------------------------------------------------------------------ staging
    def stage(self, ids: Dict, batches: int = 1) -> Staging:
        """Starts staging one batch: ``ids`` maps each table to the ids its step will
        look up (any shape, flattened). Returns the :class:`Staging` to wait on.

        Several batches may be staged in one run (one ``session.run`` and one PS round
        trip instead of one per batch: a stager slower than the steps is bound by its
        runs): ``ids`` then holds the ids of the next ``batches`` batches together, and
        the caches' syncs count ``batches`` batches."""
        if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
            raise ValueError(f"RowStager.stage: batches must be an int >= 1, got {batches!r}")
        if self._session is None:
            raise RuntimeError("RowStager.stage needs the session: call it inside "
                               "tfpsx.MonitoredTrainingSession (which runs the stager)")
        missing = [t.name for t in self._tables if t not in ids]
        if missing or len(ids) != len(self._tables):
            raise ValueError(f"RowStager.stage: ids must map each staged table "
                             f"{[t.name for t in self._tables]} to its ids, got "
                             f"{[getattr(t, 'name', t) for t in ids]}")
        feed = {}
        for ph, t in zip(self._ids, self._tables):
            values = np.asarray(ids[t])
            if values.dtype.kind not in "iu":
                raise TypeError(f"RowStager.stage: ids of table {t.name!r} must be integers, "
                                f"got {values.dtype}")
            feed[ph] = values.astype(np.int64).reshape(-1)
        return Staging(self._pool.submit(self._run, feed, batches),
                       f"{batches} batch(es) of {len(ids)} table(s)' ids")

    def _run(self, feed, batches: int) -> None:
        with self._lock:
            got, _ = self._session.run([self._stage, self._count], feed)
            self.staged([k for k, _ in got], [n for _, n in got], batches)

    def _evict(self, cache, keep) -> None:
        self._session.run(self._evict_ops[cache], {self._keep: keep})

    def _flush(self, cache) -> None:
        self._session.run(self._flush_ops[cache])

    # ------------------------------------------------------------------ the hook
    def after_create_session(self, session, coord):
        self._session = session
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "tfpsx-row-stager")
        self.open_flushes()  # (a session recreated after a failure starts clean)

    def end(self, session):
        """Finishes the stagings given and the sync in progress (before the caches'
        final flush), waiting at most TFPSX_RPC_TIMEOUT each; raises a failed sync's
        error."""
        pool, self._pool = self._pool, None
        bound = settings.get("TFPSX_RPC_TIMEOUT")
        try:
            if pool is not None:
                done = concurrent.futures.Future()
                pool.submit(done.set_result, None)  # runs once the one in progress is over
                pool.shutdown(wait=False, cancel_futures=False)
                try:
                    done.result(timeout=bound)
                except concurrent.futures.TimeoutError:
                    raise errors.ClusterTimeoutError(
                        f"RowStager: a staging did not finish within TFPSX_RPC_TIMEOUT="
                        f"{bound:g} s at the end of the session (a parameter server does not "
                        "answer)") from None
            if self._count:  # the steps trained since the last staging
                session.run(self._count)
        finally:
            ended = self.finish_flushes(bound, raise_error=False)
            self._session = None
        if not ended:
            raise errors.ClusterTimeoutError(
                f"RowStager: a worker cache's sync did not finish within TFPSX_RPC_TIMEOUT="
                f"{bound:g} s at the end of the session (a parameter server does not answer)")
        self._check_flushes()


def _step_counter(cache, global_step):
    """The op that adds to ``global_step`` the updates ``cache`` ran since it last did
    (a local counter of the counted ones on the worker)."""
    with tf.compat.v1.device(cache.device):
        counted = tf.compat.v1.Variable(
            tf.zeros([], tf.int64), trainable=False, name="stager_counted_steps",
            collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])
        updates = tf.identity(cache.updates())
        new = updates - counted.read_value()
    added = global_step.assign_add(tf.cast(new, global_step.dtype))
    with tf.control_dependencies([added]):
        return counted.assign(updates).op


def graph_stagers(graph=None) -> list:
    """The :class:`RowStager` s of ``graph``."""
    state = graph_state.peek(graph)
    return list(state.stagers) if state is not None else []

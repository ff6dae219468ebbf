"""When worker caches sync with the PS, outside a step: the flush schedule of one cache,
and the caches of this process's eager code (Keras ``fit``) that sync on their own.

A cache syncs every ``flush_steps`` updates between two steps (never in one: a PS op in
the step would cost every step a round trip) and at the end of training. Graph mode's
driver is ``tfpsx.training.hooks.WorkerCacheHook``; eager code and Keras use
:func:`flush_due_eager_caches` between steps and :func:`flush_eager_caches` at the end.
"""

from __future__ import annotations

import logging
import weakref
from typing import Dict, List

from tfpsx import metrics

logger = logging.getLogger("tfpsx")

# Caches used in eager code or tf.functions: weak, so a cache that is gone leaves.
_EAGER: "weakref.WeakSet" = weakref.WeakSet()


class FlushSchedule:
    """Counts a cache's updates since its last sync: one is due every ``flush_steps``
    (never when GEO mode's communicator syncs the cache: ``own`` False)."""

    def __init__(self, flush_steps: int, own: bool):
        self.flush_steps, self.own = flush_steps, own
        self._flushed_at = 0  # updates at the last sync

    def due(self, updates: int) -> bool:
        return self.own and updates - self._flushed_at >= self.flush_steps

    def flushed(self, updates: int) -> None:
        self._flushed_at = updates


def track_eager(cache) -> None:
    """Registers a cache that syncs on its own when eager code first uses it."""
    _EAGER.add(cache)


def eager_caches() -> List:
    """The worker caches of this process used in eager code or ``tf.function`` (Keras)
    that sync on their own (not GEO mode's): ``fit`` flushes them when it returns."""
    return [c for c in list(_EAGER) if c.flush_in_step]


def report(name: str, values: Dict[str, float]) -> None:
    """Logs a cache's counters and emits them as a ``cache`` metrics record."""
    values = {k: float(v) for k, v in values.items()}
    logger.info("tfpsx worker cache %s: hit rate %.3f over %d ids, %d rows cached, %d fetched, "
                "%d flushed, %d evicted, %d refreshed", name, values["hit_rate"],
                values["lookups"], values["size"], values["rows_fetched"],
                values["rows_flushed"], values["evictions"], values["rows_refreshed"])
    metrics.emit("cache", table=name, **values)


def flush_eager_caches() -> None:
    """Flushes and reports every cache of :func:`eager_caches` (the end of ``fit``)."""
    for cache in eager_caches():
        with cache.sync_lock:
            cache.flush()
            cache.flushed(int(cache.updates()))
        report(cache.table.name, {k: v.numpy() for k, v in cache.stats().items()})


def flush_due_eager_caches() -> None:
    """Syncs every cache of :func:`eager_caches` that is due (between ``fit``'s steps;
    a cache fed by an input pipeline syncs there)."""
    for cache in eager_caches():
        if not cache.fed:
            with cache.sync_lock:
                cache.flush_if_due()

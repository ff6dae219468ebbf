"""How a table trains: the seam where training modes plug into tables.

A :class:`TableUpdater` decides, for one table, which table its lookups read (the table
itself, or a worker-local copy in GEO) and where its row gradients go (the server-side
optimizer on each shard, a copy, or a sync accumulator). Tables never inspect a graph or
a mode: they are handed an updater, either explicitly (``DynamicTable(...,
updater=...)``) or by the innermost :func:`updater_scope` (``tfpsx.model_scope`` opens
one for its mode, as TF's ``variable_creator_scope`` does for variables).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, List, Optional, Tuple

from tfpsx.embedding.cache import WorkerCache
from tfpsx.runtime import RUNTIME

_scopes = threading.local()


class TableUpdater:
    """The default: lookups read the table, gradients go to its server-side optimizer
    (async, bounded staleness, and a table with no cluster). A table with a worker cache
    (``cache_size``) reads and trains the cache instead, which syncs with the table by
    GEO's rule with n = 1 (:mod:`tfpsx.embedding.cache`)."""

    #: Whether a table with a worker cache can train with this updater.
    supports_cache = True

    def __init__(self):
        self.cache = None

    def attach(self, table) -> None:
        """Called once, when ``table`` is created with this updater."""
        options = getattr(table, "cache_options", None)
        if options is not None:
            # A local table (no PS device) keeps its cache beside it.
            remote = any(device is not None for device in table.devices)
            device, reader = worker_placement() if remote else (None, 0)
            self.cache = WorkerCache(table, options, device, reader)

    def lookup_source(self, table):
        """The :class:`~tfpsx.embedding.sharding.ShardedTable` lookups of ``table`` read."""
        return getattr(self, "cache", None) or table  # (a subclass may skip __init__)

    def rows_source(self, table):
        """The :class:`~tfpsx.embedding.sharding.ShardedTable` whose rows this worker's
        model reads whole (a serving export): what lookups read, unless a mode splits them
        (GEO's hot rows)."""
        return self.lookup_source(table)

    def apply_gradients(self, table, keys, grads, step):
        """Applies row gradients ``grads`` ``[n, dim]`` of unique ``keys``; returns the op
        (None in eager mode)."""
        return (getattr(self, "cache", None) or table).apply(keys, grads, step)


def worker_placement() -> Tuple[Optional[str], int]:
    """(this worker's device, its index) in a cluster; (None, 0) without one."""
    config = RUNTIME.config
    if config is None or config.role != "worker" or not config.servers:
        return None, 0
    return f"/job:{config.job_name}/replica:0/task:{config.task_index}", config.index


def _stack() -> List[Callable]:
    if not hasattr(_scopes, "stack"):
        _scopes.stack = []
    return _scopes.stack


@contextlib.contextmanager
def updater_scope(factory: Callable[[object], TableUpdater]):
    """Tables created inside get ``factory(table)`` as their updater (innermost scope wins)."""
    _stack().append(factory)
    try:
        yield
    finally:
        _stack().pop()


def updater_for(table) -> TableUpdater:
    """The updater of the innermost :func:`updater_scope`, or the default."""
    stack = _stack()
    return stack[-1](table) if stack else TableUpdater()

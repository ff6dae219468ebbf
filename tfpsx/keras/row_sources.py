"""Where a ``DynamicEmbedding`` layer reads its rows from, per thread: its table, or a
function given by :func:`reading_rows_from` (a serving export's stock TF objects, a
worker cache's feeder recording the ids a batch will look up)."""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Dict, Optional

_sources = threading.local()


@contextlib.contextmanager
def reading_rows_from(sources: Dict[object, Callable]):
    """Inside (in this thread), the layers in ``sources`` read their rows from
    ``sources[layer](ids)`` (a flat int64 id vector -> rows ``[n, dim]``) instead of their
    table, training or not: the seam a serving export traces the model through, with the
    rows in stock TensorFlow objects (:mod:`tfpsx.serving`). The layer's id handling
    (string hashing, pad_id, combiners, ragged and sparse ids) is unchanged."""
    # Keyed by the layers themselves (held only while inside), never by id(): an id is
    # reused once its object is gone.
    outer = getattr(_sources, "map", None)
    _sources.map = {**(outer or {}), **sources}
    try:
        yield
    finally:
        _sources.map = outer


def source_of(layer) -> Optional[Callable]:
    """The function ``layer`` reads its rows from in this thread, or None (its table)."""
    return (getattr(_sources, "map", None) or {}).get(layer)

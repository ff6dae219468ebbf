"""Counters: named groups of numbers a component keeps about its work (GEO's pushes,
rows and bytes; later the worker cache's hits). Thread-safe; every group registers
itself for the life of the process, so :func:`snapshot` totals all of this process's
counters (also those of a graph that is gone)."""

from __future__ import annotations

import threading
from typing import Dict, List, Tuple

_REGISTRY: List["Counters"] = []
_REGISTRY_LOCK = threading.Lock()


class Counters:
    """A group of counters; subclasses name them in ``FIELDS`` (all start at 0).

    Example:
      >>> class GeoCounters(Counters):
      ...     GROUP, FIELDS = "geo", ("pushes", "rows_sent")
      >>> c = GeoCounters(); c.add(pushes=1, rows_sent=40); c.pushes
      1
    """
    GROUP = "counters"
    FIELDS: Tuple[str, ...] = ()

    def __init__(self):
        self._lock = threading.Lock()
        for name in self.FIELDS:
            setattr(self, name, 0)
        with _REGISTRY_LOCK:
            _REGISTRY.append(self)

    def add(self, **deltas) -> None:
        unknown = sorted(set(deltas) - set(self.FIELDS))
        if unknown:
            raise KeyError(f"{type(self).__name__} has no counter(s) {unknown}; "
                           f"expected some of {list(self.FIELDS)}")
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def snapshot(self) -> Dict[str, float]:
        with self._lock:
            return {name: getattr(self, name) for name in self.FIELDS}

    def __repr__(self):
        return f"{type(self).__name__}({self.snapshot()})"


def snapshot() -> Dict[str, Dict[str, float]]:
    """Every live counter group of this process: {group: {counter: value}} (groups of
    the same name are summed)."""
    out: Dict[str, Dict[str, float]] = {}
    with _REGISTRY_LOCK:
        groups = list(_REGISTRY)
    for counters in groups:
        group = out.setdefault(counters.GROUP, {})
        for name, value in counters.snapshot().items():
            group[name] = group.get(name, 0) + value
    return out

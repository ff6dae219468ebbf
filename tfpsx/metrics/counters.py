"""Counters: named groups of numbers a component keeps about its work (GEO's pushes,
rows and bytes; later the worker cache's hits). Thread-safe. :func:`snapshot` totals all
of this process's counters, also those of groups that are gone (a graph's, a strategy's):
the registry holds live groups weakly, and a group that dies adds its last values to
its name's retired totals. It is bounded so: live groups plus one total per name."""

from __future__ import annotations

import threading
import weakref
from typing import Dict, Tuple

_REGISTRY: "weakref.WeakSet[Counters]" = weakref.WeakSet()
_RETIRED: Dict[str, Dict[str, float]] = {}
_REGISTRY_LOCK = threading.RLock()  # a finalizer may retire a group while it is held


def _retire(group: str, values: Dict[str, float], lock: threading.Lock) -> None:
    """A group died: its last values join its name's retired totals."""
    with lock:
        last = dict(values)
    with _REGISTRY_LOCK:
        totals = _RETIRED.setdefault(group, {})
        for name, value in last.items():
            totals[name] = totals.get(name, 0) + value


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
        self._values: Dict[str, float] = {name: 0 for name in self.FIELDS}
        with _REGISTRY_LOCK:
            _REGISTRY.add(self)
        weakref.finalize(self, _retire, self.GROUP, self._values, self._lock)

    def __getattr__(self, name):
        values = self.__dict__.get("_values")
        if values is not None and name in values:
            return values[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def add(self, **deltas) -> None:
        unknown = sorted(set(deltas) - set(self.FIELDS))
        if unknown:
            raise KeyError(f"{type(self).__name__} has no counter(s) {unknown}; "
                           f"expected some of {list(self.FIELDS)}")
        with self._lock:
            for name, delta in deltas.items():
                self._values[name] += delta

    def snapshot(self) -> Dict[str, float]:
        with self._lock:
            return dict(self._values)

    def __repr__(self):
        return f"{type(self).__name__}({self.snapshot()})"


def snapshot() -> Dict[str, Dict[str, float]]:
    """Every counter group of this process, live or gone: {group: {counter: value}}
    (groups of the same name are summed)."""
    with _REGISTRY_LOCK:
        groups = list(_REGISTRY)
        out = {group: dict(totals) for group, totals in _RETIRED.items()}
    for counters in groups:
        group = out.setdefault(counters.GROUP, {})
        for name, value in counters.snapshot().items():
            group[name] = group.get(name, 0) + value
    return out

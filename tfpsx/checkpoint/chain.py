"""The policy of incremental checkpoints, shared by the TF1 Saver and the Keras callback:
when a save is full and when a delta, which parts a restore applies, and checks of a
chain against the tables it is restored into (before any table changes)."""

from __future__ import annotations

import logging
import os
import shutil
import time
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from tfpsx import settings
from tfpsx.checkpoint import pages, parts

logger = logging.getLogger("tfpsx")

Rows = Dict[str, Dict[str, np.ndarray]]  # table name -> field -> array (or pages.Pages)


class ChainWriter:
    """Writes parts: a full export every ``full_every`` saves, deltas in between; a
    delta whose tables lost their base (``complete`` false) becomes a full one, and so
    does the save after a failed one (its marks were taken)."""

    def __init__(self, full_every: int, what: str):
        self.full_every = settings.parse_int(full_every, f"{what}(full_every=...)", minimum=1)
        self._chain: Optional[List[str]] = None  # None: the next save is full
        self._deltas = 0
        self.last: Dict[str, object] = {}

    def reset(self) -> None:
        """The next save is full: the tables were replaced (a restore), or what followed
        a part failed (its checkpoint was never recorded, and its marks were taken)."""
        self._chain = None

    def save(self, part: str, export: Callable[[bool], Rows], step: int,
             extra: Optional[Dict[str, np.ndarray]] = None) -> Dict[str, object]:
        """Exports (``export(full)``) and writes the part ``part``; returns what it wrote
        (kind, chain, rows, removed, seconds). The same part again (a restarted chief
        saving the step it restored) is a new full part in its place."""
        started = time.monotonic()
        full = (self._chain is None or self._deltas + 1 >= self.full_every or
                os.path.exists(part))
        try:
            rows = export(full)  # a table with a disk tier: its full part in pages
            if not full and not all(pages.complete_of(r) for r in rows.values()):
                full = True  # a restarted server (or a clearing import) since the base
                rows = export(True)
            kind = parts.FULL if full else parts.DELTA
            _write(part, rows, kind, step, [] if full else list(self._chain), extra)
        except BaseException:
            self._chain = None
            raise
        name = os.path.basename(part)
        self._chain = [name] if full else self._chain + [name]
        self._deltas = 0 if full else self._deltas + 1
        self.last = {"kind": kind, "part": part, "chain": list(self._chain),
                     "rows": sum(pages.rows_of(r) for r in rows.values()),
                     "removed": sum(pages.removed_of(r) for r in rows.values()),
                     "pages": sum(r.pages for r in rows.values() if isinstance(r, pages.Pages)),
                     "seconds": time.monotonic() - started}
        return self.last


def check_publisher(publisher, what: str) -> None:
    """Raises ValueError for a ``publisher=`` that is not one (an object with
    ``publish``: ``tfpsx.serving.Publisher``)."""
    if publisher is not None and not callable(getattr(publisher, "publish", None)):
        raise ValueError(f"{what}(publisher=...): expected a tfpsx.serving.Publisher (an "
                         f"object with publish()), got {publisher!r}")


def publish_save(writer: ChainWriter, publisher, model, part: str, step: int,
                 weights=None) -> None:
    """Publishes the save just made (``writer.last``) for serving. A publish that fails is
    logged as an error and the next save is made full, so that the next publish is a
    base: serving misses no row, it waits for that base; training goes on."""
    try:
        publisher.publish(model, part, writer.last, step, weights)
    except Exception as e:  # noqa: BLE001 — training goes on; the next save re-bases
        writer.reset()
        logger.error("publish to %s failed for checkpoint %s (%s: %s); the next save is "
                     "full and publishes a new base, which serving will then load",
                     getattr(publisher, "directory", publisher), part, type(e).__name__, e)


def _write(part, rows, kind, step, chain, extra) -> None:
    if not os.path.exists(part):
        parts.write(part, rows, kind, step, chain, extra=extra)
        return
    fresh = f"{part}.new-{os.getpid()}"
    shutil.rmtree(fresh, ignore_errors=True)
    parts.write(fresh, rows, kind, step, chain, name=os.path.basename(part), extra=extra)
    old = f"{part}.old-{os.getpid()}"
    os.rename(part, old)
    os.rename(fresh, part)
    shutil.rmtree(old, ignore_errors=True)


def plan(part: str, tables: Dict[str, Tuple[int, int]]) -> List[Tuple[str, dict]]:
    """The parts to apply for ``part``, oldest first, each with its index, after checking
    that every part is there and holds every table of ``tables`` (name -> (dim,
    num_slots)) in its shape.

    Raises:
      CheckpointError: a missing part (named); ValueError: a missing table or rows of
        another shape (naming the part, the table and both shapes).
    """
    out = []
    for path in parts.chain(part):
        index = parts.read_index(path)
        missing = sorted(set(tables) - set(index["tables"]))
        if missing:
            raise ValueError(f"incremental checkpoint part {path} has no table(s) {missing}; "
                             f"it holds {sorted(index['tables'])}")
        for name, (dim, slots) in tables.items():
            entry = index["tables"][name]
            for field, tail in (("values", (dim,)), ("slots", (slots, dim))):
                array = np.load(os.path.join(path, f"{entry['file']}.{field}.npy"),
                                mmap_mode="r", allow_pickle=False)  # the header only
                if len(array) and tuple(array.shape[1:]) != tail:
                    raise ValueError(
                        f"incremental checkpoint part {path}: table {name!r} has {field} of "
                        f"shape {list(array.shape)}, this table expects [n, "
                        f"{', '.join(map(str, tail))}] (dim={dim}, num_slots={slots}); was "
                        "it saved from another model?")
        out.append((path, index))
    return out

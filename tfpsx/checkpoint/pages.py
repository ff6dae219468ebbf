"""Full table checkpoints in pages, for tables larger than their servers' RAM.

A shard with a disk tier (``TieredBackend``) holds more rows than its server's RAM
budget, so its full export cannot be one tensor: the server would hold the whole shard
at once. Its full checkpoint is read in key ranges instead (``ShardedTable.page_bounds``
arms the shard's tracking and splits its keys into pages of a 32nd of its ``ram_bytes``;
``ShardedTable.export_range`` reads one), and the part's files are written page by page
(``parts.write`` takes a :class:`Pages`), so neither the server nor the saving process
holds more than a page. A restore imports the part in pages of the same size
(``parts.table_pages``).

What a paged full part holds: every row, each as it was when its page was read. A row
trained between the first page and its own is in the next delta too (tracking was
armed before the first page), so the chain restores exactly; the full part alone is a
moment per page, as a full export of a table in RAM is a moment per lock stripe. A
delta goes in pages too (``ShardedTable.delta_begin``): its marks taken at once, the
keys written since the last save kept, their rows read a page at a time where they are.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1


def page_ranges(bounds: Sequence[int]) -> List[Tuple[int, int]]:
    """The pages ``(lo, hi)`` (both included) that ``bounds`` b_1 < ... < b_m make:
    (-inf, b_1 - 1), (b_1, b_2 - 1), ..., (b_m, +inf)."""
    edges = [int(b) for b in bounds]
    los = [INT64_MIN] + edges
    his = [b - 1 for b in edges] + [INT64_MAX]
    return list(zip(los, his))


class Pages:
    """One table's rows of a checkpoint part, read page by page as they are written: per
    shard (in shard order), each of its pages.

    Args:
      bounds: per shard, its page bounds (``ShardedTable.page_bounds`` or, of a delta,
        ``delta_begin``'s, run).
      read: ``read(shard, lo, hi)`` -> the page's fields as arrays (``export_range``).
      removed, complete: of a delta (``delta_begin``'s); a full part has neither.
    """

    def __init__(self, bounds: Sequence[np.ndarray],
                 read: Callable[[int, int, int], Dict[str, np.ndarray]],
                 removed: Optional[np.ndarray] = None, complete: bool = True):
        self.bounds, self._read = list(bounds), read
        self.removed = np.zeros([0], np.int64) if removed is None else removed
        self.complete = bool(complete)
        self.rows = 0    # rows read so far
        self.pages = 0   # pages read so far

    @classmethod
    def begun(cls, begun, read: Callable[[int, int, int], Dict[str, np.ndarray]]) -> "Pages":
        """From what a part's begin returned, run: ``page_bounds``' list (a full part)
        or ``delta_begin``'s dict (a delta)."""
        if isinstance(begun, dict):
            return cls(begun["bounds"], read, begun["removed"], begun["complete"])
        return cls(begun, read)

    def __iter__(self) -> Iterator[Dict[str, np.ndarray]]:
        for shard, bounds in enumerate(self.bounds):
            for lo, hi in page_ranges(bounds):
                page = self._read(shard, lo, hi)
                self.rows += len(page["keys"])
                self.pages += 1
                yield page


def rows_of(table_rows) -> int:
    """Rows of one table's part: a :class:`Pages` (once written) or fields."""
    return table_rows.rows if isinstance(table_rows, Pages) else len(table_rows["keys"])


def removed_of(table_rows) -> int:
    return len(table_rows.removed if isinstance(table_rows, Pages) else table_rows["removed"])


def complete_of(table_rows) -> bool:
    """Whether a delta of one table has a base (``complete``), pages or fields."""
    return bool(table_rows.complete if isinstance(table_rows, Pages)
                else table_rows["complete"])

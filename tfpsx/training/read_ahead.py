"""Graph mode's ``geo_pull_ahead``: the program records the ids of the batches its steps
will train, and each background round of GEO pulls only the changed rows among the ids
of the steps that may run before its next pull lands (the rule and its window:
:mod:`tfpsx.modes.geo.ahead`; docs/modes.md, "A pull of the rows a worker will read").

In Keras ``fit`` tfpsx reads the batches itself. In graph mode the input is the program's
own, so it says which ids its steps will look up, batch by batch, in the order the steps
train them, as it hands a worker cache's stager its next batches::

    strategy = tfpsx.DistributedStrategy(a_sync_configs={"k_steps": 10,
                                                         "geo_pull_ahead": 8})
    ...
    reader = tfpsx.GeoReadAhead([emb_in, emb_out])   # every GEO table of the graph
    with tfpsx.MonitoredTrainingSession() as sess:
        for i, batch in enumerate(batches):
            while reader.recorded < min(i + reader.batches_ahead, len(batches)):
                b = batches[reader.recorded]
                reader.record({emb_in: b.center, emb_out: b.targets})
            sess.run(train_op, feed(batch))

A round whose window the program has not recorded that far pulls every changed row, as
every round does without a reader: being behind costs bytes, never rows. The n-th batch
recorded is the session's n-th training step: a step that fails and is run again (a
recovered session) is still that batch.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional, Sequence

import numpy as np

from tfpsx import graph_state
from tfpsx.embedding.sharding import ShardedTable
from tfpsx.modes.geo.ahead import BatchIds, depth_at
from tfpsx.modes.geo.rule import GEO_AUTO_KN_BACKGROUND

logger = logging.getLogger("tfpsx")

# The batches a reader holds at most, in windows (batches_ahead): the rounds drop the
# batches whose steps ran; a program that records far ahead, or whose rounds read none
# (not GEO, or GEO without geo_pull_ahead), loses the oldest instead of its memory.
HELD_WINDOWS = 8


class GeoReadAhead:
    """Records the ids a graph's next training steps look up, per GEO table (see the
    module doc).

    Args:
      tables: the graph's GEO tables (``DynamicTable`` s): every one whose copy a round
        pulls (a worker cache's may be left out: its pull brings the rows it holds).

    Raises:
      ValueError: no table, an object that is not a table, a table named twice, or a
        second reader for the same graph.
    """

    def __init__(self, tables: Sequence):
        tables = list(tables)
        if not tables:
            raise ValueError("GeoReadAhead: tables must name at least one DynamicTable")
        wrong = [repr(t) for t in tables if not isinstance(t, ShardedTable)]
        if wrong:
            raise ValueError(f"GeoReadAhead: tables must be DynamicTables, got {wrong}")
        names = [t.name for t in tables]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"GeoReadAhead: tables {twice} are named twice")
        state = graph_state.of()
        if state.geo_read_ahead is not None:
            raise ValueError("GeoReadAhead: this graph has one already (of tables "
                             f"{[t.name for t in state.geo_read_ahead.tables]}); record "
                             "every GEO table's ids with that one")
        self.tables = tables
        self._batches = BatchIds(len(tables), 0)
        self._k_steps: Optional[int] = None  # the mode's, once its rounds are built
        self._warned = False
        state.geo_read_ahead = self

    @property
    def recorded(self) -> int:
        """The batches recorded so far: the next one recorded is this local step's."""
        return self._batches.recorded()

    @property
    def batches_ahead(self) -> int:
        """How many batches ahead of the step being run the program should have recorded
        for every round to pull ahead: a round's window (2 x k_steps + 4 steps) and room.
        Known once the GEO mode built its rounds (the session's start); before, that of
        the largest k_steps="auto" may pick (at one worker)."""
        return depth_at(self._k_steps if self._k_steps is not None
                        else GEO_AUTO_KN_BACKGROUND)

    def record(self, ids: Dict) -> None:
        """The next batch's ids: ``ids`` maps each of the reader's tables to the ids its
        step will look up (any shape, flattened; integers). Call it in the order the
        steps train the batches, ahead of them (:attr:`batches_ahead`). It holds at most
        HELD_WINDOWS x :attr:`batches_ahead` batches: beyond, the oldest are dropped (a
        round that would read one pulls every changed row), with a warning."""
        if not isinstance(ids, dict) or len(ids) != len(self.tables) or \
                any(t not in ids for t in self.tables):
            got = ([getattr(t, "name", t) for t in ids] if isinstance(ids, dict)
                   else type(ids).__name__)
            raise ValueError(f"GeoReadAhead.record: ids must map each of the tables "
                             f"{[t.name for t in self.tables]} to its ids, got {got}")
        unique: List[np.ndarray] = []
        for t in self.tables:
            values = np.asarray(ids[t])
            if values.dtype.kind not in "iu":
                raise ValueError(f"GeoReadAhead.record: the ids of table {t.name!r} must "
                                 f"be integers, got dtype {values.dtype}")
            unique.append(np.unique(values.astype(np.int64).ravel()))
        most = HELD_WINDOWS * self.batches_ahead
        if self._batches.append(unique, most=most) and not self._warned:
            self._warned = True
            logger.warning(
                "GeoReadAhead: %d batches recorded and not yet trained or read by a GEO "
                "round: the oldest are dropped (%s); record about batches_ahead=%d ahead "
                "of the step being run", most,
                "no GEO round with geo_pull_ahead reads this reader" if self._k_steps is None
                else "a round that would read one pulls every changed row",
                self.batches_ahead)

    # ------------------------------------------------------------ GEO's side
    def bind(self, mode_tables: Sequence, k_steps: int):
        """GEO's rounds (graph mode, at the session's start): ``mode_tables`` (its
        GeoTables) with rounds ``k_steps`` apart. Returns ``window(first, length)``: the
        ids per mode table (a worker cache's empty), or None. Raises ValueError where a
        table recorded is not a GEO table of the graph, or a GEO table without a worker
        cache is not recorded."""
        mine = {id(t): i for i, t in enumerate(self.tables)}
        geo = {id(t.global_) for t in mode_tables}
        strays = [t.name for t in self.tables if id(t) not in geo]
        missing = [t.global_.name for t in mode_tables
                   if not t.cached and id(t.global_) not in mine]
        if strays or missing:
            raise ValueError(
                "GeoReadAhead: " + "; ".join(
                    ([f"tables {strays} are not GEO tables of this graph (record only "
                      "GEO's)"] if strays else []) +
                    ([f"GEO tables {missing} are not recorded: give GeoReadAhead every "
                      "GEO table of the graph"] if missing else [])))
        self._k_steps = int(k_steps)
        order = [mine.get(id(t.global_)) for t in mode_tables]
        empty = np.zeros([0], np.int64)

        def window(first: int, length: int) -> Optional[List[np.ndarray]]:
            got = self._batches.window(first, length)
            if got is None:
                return None
            return [empty if j is None else got[j] for j in order]

        return window


__all__ = ["GeoReadAhead"]

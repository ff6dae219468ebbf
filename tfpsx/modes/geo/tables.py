"""How a table joins GEO: lookups read this worker's copy, gradients train it
(:class:`GeoTableUpdater`), under the rule the job runs (:mod:`.rule`)."""

from __future__ import annotations

import logging
import weakref
from typing import List, Optional, Protocol, Tuple

import numpy as np
import tensorflow as tf

from tfpsx import graph_state
from tfpsx.embedding.cache import WorkerCache
from tfpsx.embedding.row_copy import row_bytes
from tfpsx.embedding.sharding import ShardedTable
from tfpsx.embedding.updaters import TableUpdater
from tfpsx.modes.geo.choice import IDLE, TableChoice, TableTraffic
from tfpsx.modes.geo.contention import Contention
from tfpsx.modes.geo.copies import GeoTable, copy_apply
from tfpsx.modes.geo.distinct import DistinctRows
from tfpsx.modes.geo.hot_rows import AsyncRows, HotRows, route_of
from tfpsx.modes.geo.round import row_trip_bytes
from tfpsx.modes.geo.rule import combine_for

logger = logging.getLogger("tfpsx")


class GeoState(Protocol):
    """What a table joins in GEO (graph mode's ``GeoMode``, Keras's ``KerasGeo``)."""
    worker_index: int
    worker_num: int
    worker_device: str
    tables: List[GeoTable]
    updaters: List["GeoTableUpdater"]  # one per table, as they join (the rows they train)
    wire_dtype: Optional[tf.DType]  # the rows travel in it (None: float32)
    slot_wire_dtype: tf.DType  # with share_slots, the rows' slots travel in it
    in_train_thread: bool  # deterministic rounds (the PS combines a round's pushes)
    share_slots: bool  # rows travel with their optimizer slots, summed (geo_table_rule)
    hot_count: int  # ids seen this often in a batch train on the PS (0: none)
    # ids the N workers would train more often in a round train on the PS (0: none)
    hot_per_round: int
    table_choice: bool  # geo_table_choice="auto": rounds or async, table by table
    # The front-end traces its step again when the job's choice changes (Keras): a table
    # that trains async is then traced as async's (AsyncRows), not through HotRows.
    retraces: bool
    named: frozenset  # the rule's keys the user named (named_rule_keys)

    def local_train_op(self, op) -> None:
        """A table's local training op was built (graph mode counts local steps by it)."""

    def round_steps(self) -> int:
        """K, the local steps between rounds, as a step being built runs it."""


def slots_add_up(mode: GeoState, table) -> bool:
    """Whether ``table``'s rows can travel with their optimizer slots, summed on the PS
    (``geo_table_rule="shared_slots"``): its optimizer's slot changes add up
    (``SparseOptimizer.slot_deltas_add``). Where they do not (Adam's moments, FTRL's z),
    a rule the user named is refused, naming the table and what to do; the rule for many
    workers, by default, gives way for that table: its rows travel without their slots
    (as the earlier rule's), logged once.

    Raises:
      ValueError: ``geo_table_rule="shared_slots"`` named for such a table (nothing of
        the table was built).
    """
    optimizer = getattr(table, "optimizer", None)
    if optimizer is None or not getattr(optimizer, "slot_init", ()) or \
            getattr(optimizer, "slot_deltas_add", True):
        return True
    kind = type(optimizer).__name__
    if "geo_table_rule" in mode.named:
        raise ValueError(
            f"GEO: table {table.name!r} trains with tfpsx.embedding.{kind}, whose optimizer "
            "slots do not add up across workers (moving averages, or a state that depends "
            "on the row's value), but geo_table_rule='shared_slots' sums every worker's slot "
            "changes on the PS: its rows would train with wrong slots. Give it "
            "geo_table_rule='average' (rows travel without their slots, each worker's "
            "optimizer state its own), tfpsx.embedding.Adagrad or SGD (whose slots add "
            "up), or train async (k_steps=0)")
    if table.name not in _TOLD:
        _TOLD.add(table.name)
        logger.info("GEO: table %r trains with tfpsx.embedding.%s, whose slots do not add up "
                    "across workers: its rows travel without them (geo_table_rule='average' "
                    "for this table; the rule for many workers sums the slots of the "
                    "others)", table.name, kind)
    return False


_TOLD: set = set()
_TRAINED = "geo_trained"  # the kind of _trained_rows' worker-local variable


def table_choice(mode: GeoState, is_chief: bool, counters=None) -> Optional[TableChoice]:
    """The choice between rounds and async of ``mode``'s tables (a table with a worker
    cache always runs rounds), or None without ``geo_table_choice="auto"`` or with
    deterministic rounds (``geo_sync_in_train_thread=True``: the workers would adopt a
    choice at different steps, and the rounds are there to be reproducible)."""
    if not mode.table_choice or mode.in_train_thread or \
            not any(t.chosen for t in mode.tables):
        return None
    return TableChoice([TableTraffic(u.name, row_bytes(t), row_trip_bytes(u.dim),
                                     fixed=not t.chosen)
                        for u, t in zip(mode.updaters, mode.tables)],
                       getattr(mode, "rule_workers", mode.worker_num), is_chief, counters)


def async_flag(t: GeoTable):
    """A GEO table's worker-local bool variable under ``geo_table_choice="auto"``
    (:mod:`.choice`): True while the table trains async (its lookups read the PS). Set
    by the front-end as the job's choice changes (graph mode: built before the graph is
    finalized); True when a session or process starts (a table starts async)."""
    def make(collections):
        return tf.compat.v1.Variable(True, trainable=False, collections=collections,
                                     use_resource=True, name="tfpsx_geo_trains_async")

    return graph_state.worker_local(t, "geo_trains_async", t.global_.name, t.device, make)


def follow_choice(tables: List[GeoTable], to_ps, to_copy, set_flag) -> None:
    """The lookups of a worker's ``tables`` follow the job's choice
    (:meth:`~tfpsx.modes.geo.choice.TableChoice.after_round`): those ``to_ps`` read
    and train the PS from now, those ``to_copy`` their copy; ``set_flag(i, flag)`` sets
    table i's :func:`async_flag` (a front-end's op)."""
    for i, flag in [(i, True) for i in to_ps] + [(i, False) for i in to_copy]:
        set_flag(i, flag)
        tables[i].trains_async = flag


def quiet(choice: Optional[TableChoice], tables: List[GeoTable], dense_copies: bool) -> bool:
    """Whether a worker's rounds move nothing now: under ``choice`` (None: no choice)
    every one of its ``tables`` trains async, its copy flushed, and no dense copy syncs
    (``dense_copies``), so every step trains the PS (its input position commits as
    async's; its rounds run TFPSX_GEO_QUIET_ROUND_SECONDS apart). A step that trained a
    copy ended before this became true: it takes the round that pushes the copy of a
    table gone async, a round a front-end asks for between steps, the table's flag
    turned async a round before."""
    return (choice is not None and not dense_copies and len(choice.tables) == len(tables)
            and all(t.trains_async for t in tables)
            and all(a == IDLE for a in choice.actions()))


class GeoTableUpdater(TableUpdater):
    """Lookups read this worker's copy; gradients train it (its optimizer, locally).

    A table with ``cache_size`` keeps a bounded copy: a worker cache
    (:mod:`tfpsx.embedding.cache`) whose sync is the mode's every K steps (n = 1, as
    every table row in GEO).
    """

    def __init__(self, mode: GeoState):
        super().__init__()
        self._mode = mode
        self._geo: Optional[GeoTable] = None
        self._hot = 0  # this table's hot count (geo_hot_count; 0: none)
        self._contention: Optional[Contention] = None  # geo_hot_per_round's estimate
        self.distinct: Optional[DistinctRows] = None  # geo_table_choice="auto"'s count
        self.name, self.dim = "", 0
        # What of the rows its training steps held (_trained_rows) was counted: per graph
        # (held weakly: a program may build many), and of eager code.
        self._counted = weakref.WeakKeyDictionary()
        self._eager_counted = np.zeros([2], np.int64)

    def attach(self, table) -> None:
        mode, me = self._mode, self._mode.worker_index
        options = getattr(table, "cache_options", None)
        share, hot = mode.share_slots and slots_add_up(mode, table), mode.hot_count
        self._hot = hot
        self.name, self.dim = table.name, table.dim
        mode.updaters.append(self)
        if mode.hot_per_round:
            self._contention = Contention(f"{table.name}/geo_contention_w{me}",
                                          mode.worker_device, mode.worker_num,
                                          mode.round_steps, mode.hot_per_round)
        if options is not None:
            # A worker cache follows the same rule: its rows travel with their slots
            # when shared, and HotRows reads the hot ids from the PS, the rest through
            # the cache.
            self.cache = WorkerCache(table, options, mode.worker_device, me,
                                     scale=1.0, flush_in_step=False, wire=mode.wire_dtype,
                                     slot_wire=mode.slot_wire_dtype,
                                     combine=combine_for(mode.in_train_thread),
                                     share_slots=share, copy_type=GeoTable)
            self._geo = self.cache.copy
            mode.tables.append(self._geo)
            return
        copy = dict(initializer=table.initializer, seed=table.seed,
                    devices=[mode.worker_device])
        local = ShardedTable(f"{table.name}/geo_local_w{me}", table.dim,
                             optimizer=table.optimizer, min_frequency=table.min_frequency, **copy)
        # With shared slots, old keeps the slots a row had at the last pull too.
        old = ShardedTable(f"{table.name}/geo_old_w{me}", table.dim,
                           optimizer=table.optimizer if share else None, **copy)
        chosen = mode.table_choice and not mode.in_train_thread
        self._geo = GeoTable(table, local, old, mode.worker_device, me, wire=mode.wire_dtype,
                             slot_wire=mode.slot_wire_dtype,
                             combine=combine_for(mode.in_train_thread), share_slots=share,
                             chosen=chosen, trains_async=chosen)
        if chosen and me == 0:  # (the chief's count: it decides for the job)
            self.distinct = DistinctRows(f"{table.name}/geo_distinct_w{me}",
                                         mode.worker_device, steps=mode.round_steps)
        mode.tables.append(self._geo)

    def lookup_source(self, table):
        # (an estimate that cannot find a row, K x N within its bound, adds nothing)
        contention = (self._contention if self._contention is not None
                      and self._contention.active() else None)
        if self._geo.chosen and self._geo.trains_async and self._mode.retraces:
            return AsyncRows(self._geo, self.distinct)
        on_ps = self._on_ps()
        if self._hot or contention is not None or on_ps is not None:
            return HotRows(self._geo, self._hot, contention, on_ps, self.distinct)
        return self._geo.local

    def _on_ps(self):
        """The table's async flag when the job chooses for it, else None."""
        return async_flag(self._geo) if self._geo.chosen else None

    def rows_source(self, table):
        # The copy, whole: the hot rows' PS moves reach it at every pull (the last one in
        # the final sync), as an evaluation reads it (HotRows.lookup); the PS's table
        # while the job trains it async (geo_table_choice="auto").
        return self._geo.global_ if self._geo.trains_async else self._geo.local

    def apply_gradients(self, table, keys, grads, step, hot=None):
        # (``grads`` checked by the table's apply_gradients: the applies do not check
        # them again, an assert a step each)
        route = route_of(hot)
        if route is not None:  # (the split op counted them: no ops of the count's own)
            held = route.held
        else:
            held = tf.stack([tf.size(keys, out_type=tf.int64),
                             tf.constant(0, tf.int64) if hot is None
                             else tf.math.count_nonzero(hot, dtype=tf.int64)])
        counted = self._trained_rows().assign_add(held)
        # The count runs before the gradients are applied, not beside the apply: a
        # train op of PS ops only is grouped on the PS (a table that trains async, its
        # dense weights on the PS), where one op of this worker in it would end each
        # step with the PS telling this worker (a control edge: one more RPC a step).
        with tf.control_dependencies([counted]):
            grads = tf.identity(grads)
        if hot is None and self._geo.chosen:
            # A training lookup of AsyncRows (HotRows' have a hot mask): the PS's rows.
            op = ShardedTable.apply_checked(self._geo.global_, keys, grads, step)
        elif hot is not None:  # the hot rows on the PS, the rest in the copy
            op = HotRows(self._geo, self._hot, on_ps=self._on_ps()).apply(keys, grads, hot,
                                                                          step)
        else:
            op = copy_apply(self._geo, keys, grads, step)
        if op is None:  # (eager: both ran)
            return None
        self._mode.local_train_op(op)
        return op

    def _trained_rows(self) -> tf.Variable:
        """This worker's count of the rows its training steps held, int64 [rows, of them
        hot], worker-local."""
        def make(collections):
            return tf.compat.v1.Variable(tf.zeros([2], tf.int64), trainable=False,
                                         collections=collections, name="tfpsx_geo_trained")

        return graph_state.worker_local(self, _TRAINED, self.name,
                                        self._mode.worker_device, make)

    def session_started(self, session) -> None:
        """A session of this graph initialized its local variables: the count starts
        again from 0 (a session lost to an error takes its steps' count with it)."""
        self._counted[session.graph] = np.zeros([2], np.int64)

    def trained_variable(self, graph=None):
        """The int64 [rows, hot rows] count of what the training steps held: of eager
        code, or of ``graph``; None before a step was built."""
        if graph is None:
            return getattr(self, "_eager_locals", None)  # (graph_state.worker_local's)
        state = graph_state.peek(graph)
        return None if state is None else state.worker_locals.get((_TRAINED, self.name))

    def trained_since(self, session=None) -> Tuple[int, int]:
        """(rows, hot rows) the training steps held since the last call: of eager code,
        or with ``session`` of its graph; (0, 0) before any step was built."""
        if session is None:
            var = getattr(self, "_eager_locals", None)  # (graph_state.worker_local's)
            if var is None:
                return 0, 0
            value, last = var.numpy(), self._eager_counted
            self._eager_counted = value
        else:
            state = graph_state.peek(session.graph)
            var = None if state is None else state.worker_locals.get((_TRAINED, self.name))
            if var is None:
                return 0, 0
            value = np.asarray(session.run(var))
            last = self._counted.get(session.graph, np.zeros([2], np.int64))
            self._counted[session.graph] = value
        rows, hot = (value - last).tolist()
        return rows, hot

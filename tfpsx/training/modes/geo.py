"""GEO in graph mode: the rule, the round and the schedule are :mod:`tfpsx.modes.geo`'s;
this module is their TF1 executor. ``model_scope`` makes each trainable variable a local
copy with its snapshot (the global value on the PS), :class:`GeoOptimizer` trains the
copies, and a session hook runs the rounds: one ``session.run`` per phase (a push and
its pull in one in the background), in a communicator thread while training goes on
(Paddle's GeoCommunicator) or, with ``geo_sync_in_train_thread=True``, between steps
(deterministic: all workers push, meet at a barrier, pull, meet again).
"""

from __future__ import annotations

import logging
import time
from typing import List, Optional, Tuple

import tensorflow as tf

from tfpsx import graph_state
from tfpsx.embedding.sharding import as_step
from tfpsx.embedding.updaters import TableUpdater
from tfpsx.modes.geo import (BARRIER, MIN_ROUNDS_PER_EPOCH, PULL, PUSH, GeoCounters,
                             GeoSchedule, GeoTable, GeoTableUpdater, GeoVariable, adopt_rule,
                             auto_k_steps, caches_locked, count_round, count_trained,
                             dense_async, dense_size, pull_ops, push_ops, rule_workers,
                             table_readers)
from tfpsx.modes.geo.ahead import AheadPulls, key_bytes, window_steps
from tfpsx.modes.geo.choice import CATCH_UP, IDLE, SKIP
from tfpsx.modes.geo.copies import copy_global, drop_unpushed, local_reader
from tfpsx.modes.geo.tables import async_flag, follow_choice, quiet, table_choice
from tfpsx.modes.state import GEO_TABLE_CHOICE
from tfpsx.modes.positions import PendingSteps
from tfpsx.runtime import RUNTIME
from tfpsx.training.hooks import TrainStepDetector
from tfpsx.training.modes.base import GraphStateFactory, Mode, WrappedOptimizer
from tfpsx.training.placement import worker_device_of

logger = logging.getLogger("tfpsx")


# ----------------------------------------------------------------------------- the mode

class GeoMode(Mode):
    """GEO for one graph: the dense pairs and tables to sync, the train ops that count as
    local steps, the counters, and the communicator hook."""
    NAME = "geo"
    ROUNDS = True  # a step reaches the model at a round (its input commits then)
    REPORTS_STEPS = True  # a round adds the local steps it pushed to global_step

    def __init__(self, strategy, config, graph):
        super().__init__(strategy, config, graph)
        self.k_steps = strategy.k_steps
        if strategy.k_auto:
            # The job's K: of the workers it started with (a joiner's is the others').
            self.k_steps = auto_k_steps(
                None, rule_workers(config), deterministic=strategy.geo_sync_in_train_thread)
            logger.info("GEO: k_steps='auto' is %d in graph mode at %d workers (it knows no "
                        "epoch length; give k_steps <= the local steps an epoch // %d for "
                        "%d rounds an epoch)", self.k_steps, rule_workers(config),
                        MIN_ROUNDS_PER_EPOCH, MIN_ROUNDS_PER_EPOCH)
        self.worker_num, self.worker_index = config.worker_num, config.index
        self.worker_device = worker_device_of(config)
        adopt_rule(self, strategy, config)
        self.retraces = False  # (a graph is built once: HotRows serves both states)
        self.rule_workers = rule_workers(config)  # N of the rule: the job's, a joiner's too
        self.dense: List[GeoVariable] = []
        self.tables: List[GeoTable] = []
        self.updaters: List[GeoTableUpdater] = []  # as their tables join
        self.train_ops = []
        self.counters = GeoCounters()
        self.positions = PendingSteps()  # the input positions of steps not pushed
        # geo_pull_ahead: a background round pulls the changed rows among the ids the
        # program recorded for the steps before its next pull lands (GeoReadAhead).
        self.ahead = (AheadPulls(strategy.geo_pull_ahead,
                                 window_steps(self.k_steps, 1))
                      if getattr(strategy, "geo_pull_ahead", 0) else None)
        self._sync_hook = _GeoSyncHook(self)
        self.add_hook(self._sync_hook)

    @classmethod
    def wrap_optimizer(cls, optimizer, strategy, config):
        if isinstance(optimizer, tf.compat.v1.train.SyncReplicasOptimizer):
            raise ValueError("distributed_optimizer: GEO trains a local copy on each worker, "
                             "so it needs an optimizer with a local form; "
                             "SyncReplicasOptimizer aggregates across workers and has none "
                             "(wrap its inner optimizer instead)")
        return GeoOptimizer(optimizer, strategy, config)

    def variable_creator(self):
        """Each trainable variable is created on the PS under its own name (checkpoints are
        the same as in async mode) and the model reads a local copy ``<name>_geo_local``
        on this worker, initialized from the PS value, with its snapshot ``<name>_geo_old``."""
        worker = self.worker_device

        def creator(next_creator, **kwargs):
            if not kwargs.get("trainable", True) or kwargs.get("name") is None:
                return next_creator(**kwargs)
            name = kwargs["name"]
            global_ = next_creator(**dict(kwargs, trainable=False))  # on the PS
            with tf.compat.v1.device(global_.device):
                start = global_.read_value()  # read on the PS, then one transfer
            local_kwargs = dict(
                kwargs, initial_value=start, trainable=True,
                collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES,
                             tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES],
                caching_device=None)
            local_kwargs.pop("partitioner", None)
            with tf.compat.v1.device(worker):
                local = next_creator(**dict(local_kwargs, name=f"{name}_geo_local"))
                old = next_creator(**dict(local_kwargs, name=f"{name}_geo_old", trainable=False,
                                          collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES]))
            self.dense.append(GeoVariable(local, old, global_))
            return local

        return creator

    def table_updater(self, table) -> TableUpdater:
        return GeoTableUpdater(self)

    def local_train_op(self, op) -> None:
        self.train_ops.append(op)

    def round_steps(self) -> int:
        return self.k_steps

    def settle_for_save(self) -> None:
        """An exact save's barrier, before a run: this worker's local steps pushed and
        their positions committed (:meth:`GeoSchedule.settle`)."""
        self._sync_hook.settle()

    def step_in_model(self) -> bool:
        """Whether a step that just ended is in the model already, its input position
        committed as async's (tfpsx.training.hooks.InputPositionHook): while every table
        trains async, no dense copy (geo_table_choice="auto", :meth:`_GeoSyncHook.quiet`)."""
        return self._sync_hook.quiet()


class GeoAsyncDenseMode(GeoMode):
    """GEO's tables (each worker's copy, synced every K steps) with the dense weights
    async on the parameter servers (``geo_dense="async"``): ``model_scope`` places them
    as async does, the wrapped optimizer's update runs beside each (its slots there too),
    and GEO's rounds move table rows only."""

    def variable_creator(self):
        return None


def mode_class(strategy, config) -> type:
    """GEO's graph-mode class for ``strategy`` in the job of ``config``."""
    return GeoAsyncDenseMode if dense_async(strategy, rule_workers(config)) else GeoMode


class GeoOptimizer(WrappedOptimizer):
    """GEO k-step SGD around any ``tf.compat.v1.train`` optimizer (see the module doc).

    The wrapped optimizer trains the local copies that ``model_scope`` made; its slots
    stay on the worker (local variables). The sync is a hook that
    ``tfpsx.MonitoredTrainingSession`` runs; ``counters`` says what it did.
    """

    def __init__(self, optimizer, strategy, config):
        super().__init__(optimizer, "Geo")
        self._strategy, self._config = strategy, config
        self._mode: Optional[GeoMode] = None

    @property
    def counters(self) -> GeoCounters:
        if self._mode is None:
            raise ValueError("GEO: counters exist once minimize / apply_gradients built the "
                             "train op")
        return self._mode.counters

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        graph = tf.compat.v1.get_default_graph()
        grads_and_vars = list(grads_and_vars)
        mode = (mode_class(self._strategy, self._config)
                .for_graph(self._strategy, self._config, graph)
                if RUNTIME.config is not None else None)
        if isinstance(mode, GeoAsyncDenseMode):
            # As async: the update runs beside each variable, on the parameter servers.
            train = tf.group(self._opt.apply_gradients(grads_and_vars, name=name),
                             name="geo_train")
            self._mode = mode
            mode.train_ops.append(train)
            return train
        pairs = {id(p.local) for p in mode.dense} if mode else set()
        stray = [v.name for g, v in grads_and_vars if g is not None and id(v) not in pairs]
        if stray:
            raise ValueError("GEO: these variables were not created inside "
                             f"tfpsx.model_scope(strategy): {stray}; GEO can only train the "
                             "local copies model_scope makes")
        self._mode = mode
        global_vars = set(graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES))
        with tf.compat.v1.device(mode.worker_device):
            apply = self._opt.apply_gradients(grads_and_vars, name=name)
            # The optimizer's slots are worker state: only this worker can initialize them,
            # and the chief's checkpoint must not expect them.
            made = [v for v in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
                    if v not in global_vars]
            global_ref = graph.get_collection_ref(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
            for v in made:
                global_ref.remove(v)
                graph.add_to_collection(tf.compat.v1.GraphKeys.LOCAL_VARIABLES, v)
            train = tf.group(apply, name="geo_train")
        mode.train_ops.append(train)
        return train


# ----------------------------------------------------------------------------- the hook

class _GeoSyncHook(tf.compat.v1.train.SessionRunHook):
    """Runs GEO's rounds on :class:`~tfpsx.modes.geo.GeoSchedule`'s schedule, one
    ``session.run`` per phase."""

    def __init__(self, mode: GeoMode):
        self._mode = mode
        self._session = None
        self._steps = 0      # local steps run
        self._reported = 0   # local steps reported to global_step
        self._built = False
        self._started = False  # a session was created and started the schedule
        self._schedule = GeoSchedule(
            mode.k_steps, mode.in_train_thread, self._run_round,
            cached=lambda: any(t.cached for t in mode.tables),
            barrier=RUNTIME.barrier_worker, counters=mode.counters, quiet=self.quiet)
        self._choice = None
        self._window = None   # geo_pull_ahead: the recorded ids' window (GeoReadAhead)
        self._among = None    # ... fed to the pulls among keys, a placeholder per table
        self._ending = False  # the final round pulls every changed row

    # -------------------------------------------------------------- graph
    def begin(self):
        # Called before the session finalizes the graph: build the sync ops now, when
        # every GEO variable and table of the model exists.
        if self._built:
            return
        self._built = True
        mode = self._mode
        step = as_step(tf.compat.v1.train.get_global_step())
        # (a table the job chooses for starts async: its reader on the PS is registered
        # when it tries rounds, copy_global)
        registrations = [op for t in mode.tables
                         for op in (table_readers(t) if not t.chosen else local_reader(t))]
        self._new_steps = tf.compat.v1.placeholder(tf.int64, [], name="geo_new_steps")
        self._choice = table_choice(mode, RUNTIME.config.is_chief, mode.counters)
        self._begin_ahead()
        if self._choice is None:
            self._push = self._push_ops(mode.dense, mode.tables, step, report=True)
            # Deterministic: the pull is a phase of its own (after a barrier).
            # Background: it runs right after the push in the same step (one round of
            # RPCs less per sync).
            after = [] if mode.in_train_thread else [self._push["done"]]
            self._pulls = {None: self._pull_ops(mode.dense, mode.tables, after)}
            if self._among is not None:
                self._pulls["ahead"] = self._pull_ops(mode.dense, mode.tables, after,
                                                      self._among)
        else:
            # geo_table_choice="auto" (background rounds only): each table's push and
            # pull as the job's choice has them, fetched by the round; a catch-up is a
            # pull, of every key changed since the table went async.
            self._push = self._push_ops(mode.dense, [], step, report=True)
            self._pulls = {"dense": self._pull_ops(mode.dense, [], [self._push["done"]])}
            self._table_pushes = [self._push_ops([], [t], step) for t in mode.tables]
            for i, t in enumerate(mode.tables):
                self._pulls[i] = self._pull_ops([], [t], [self._table_pushes[i]["done"]])
                if self._among is not None and self._among[i] is not None:
                    self._pulls[("ahead", i)] = self._pull_ops(
                        [], [t], [self._table_pushes[i]["done"]], [self._among[i]])
            zero = tf.constant(0, tf.int64)
            self._skipped = dict(rows=zero, bytes=zero, per_table=[zero])
            self._choice_ops = ChoiceOps(mode, self._choice)
        self._register = tf.group(*registrations, name="geo_register")
        # A session created again drops the copies' unpushed steps: each copy takes the
        # PS's rows (the chosen tables' catch-up; a worker cache's copy keeps its rows).
        catch_ups = (self._choice_ops.catch_ups if self._choice is not None
                     else [None] * len(mode.tables))
        self._resets = [None if t.cached else catch_ups[i] or copy_global(t)
                        for i, t in enumerate(mode.tables)]

        self._dense = dense_size(mode.dense)
        self._detector = TrainStepDetector(mode.train_ops)

    def _push_ops(self, dense, tables, step, report: bool = False):
        """The push of ``dense`` and ``tables``; with ``report``, global_step counts the
        local steps pushed (every worker's)."""
        per_table = []
        pushes, (rows, nbytes) = push_ops(dense, tables, float(self._mode.rule_workers),
                                          step, per_table=per_table)
        global_step = tf.compat.v1.train.get_global_step()
        with tf.control_dependencies(pushes):
            done = ([tf.compat.v1.assign_add(global_step, self._new_steps)]
                    if report and global_step is not None and self._mode.REPORTS_STEPS
                    else [])
            return dict(rows=rows, bytes=nbytes, per_table=per_table,
                        done=tf.group(*done, name="geo_push"))

    def _begin_ahead(self) -> None:
        """geo_pull_ahead: the program's GeoReadAhead (its window of recorded ids) and a
        key placeholder per table whose pull may take keys (not a worker cache's)."""
        mode = self._mode
        if mode.ahead is None:
            return
        reader = graph_state.of().geo_read_ahead
        if reader is not None:
            self._window = reader.bind(mode.tables, mode.k_steps)
            self._among = [None if t.cached else
                           tf.compat.v1.placeholder(tf.int64, [None], name=f"geo_among_{i}")
                           for i, t in enumerate(mode.tables)]
        mode.ahead.begin(reader is not None, mode.k_steps, 1, not_reading=(
            "graph mode reads the ids the program records: create a tfpsx.GeoReadAhead of "
            "the graph's GEO tables before the session and record each batch's ids ahead "
            "of its step"))

    def _pull_ops(self, dense, tables, after, among=None):
        """The pull of ``dense`` and ``tables``, after the ops ``after`` (``among``: a key
        tensor per table, geo_pull_ahead's)."""
        per_table = []
        pulls, (rows, nbytes) = pull_ops(dense, tables, after, per_table=per_table,
                                         among=among)
        return dict(rows=rows, bytes=nbytes, per_table=per_table,
                    done=tf.group(*pulls, name="geo_pull"))

    def _round_fetch(self, ahead: bool = False):
        """What a round runs: (the pushes, the pulls, the tables' actions): every table's,
        or as the job's choice has them (geo_table_choice="auto": a table that trains
        async pushes what its copy trained before, once, then neither pushes nor pulls).
        ``ahead``: the pulls among the keys fed to the placeholders (geo_pull_ahead)."""
        if self._choice is None:
            return [self._push], [self._pulls["ahead" if ahead else None]], None
        actions = self._choice.actions()
        pushes = [self._push] + [self._skipped if action == IDLE else self._table_pushes[i]
                                 for i, action in enumerate(actions)]
        pulls = [self._pulls["dense"]] + [
            self._skipped if action in (SKIP, IDLE) else
            self._pulls.get(("ahead", i), self._pulls[i]) if ahead else self._pulls[i]
            for i, action in enumerate(actions)]
        return pushes, pulls, actions

    def _ahead_feed(self, phases) -> Tuple[Optional[list], dict]:
        """(the keys per table of a background round that pulls ahead, or None; their
        feed). Not the final round, nor a deterministic one (whose phases differ)."""
        mode = self._mode
        if self._window is None or self._ending or phases != (PUSH, PULL):
            return None, {}
        among = mode.ahead.among(self._schedule.pushed, self._window, mode.counters)
        if among is None:
            return None, {}
        return among, {ph: keys for ph, keys in zip(self._among, among) if ph is not None}

    def quiet(self) -> bool:
        """(:func:`tfpsx.modes.geo.tables.quiet`: rounds are asked for after a step's
        run, :meth:`after_run`.)"""
        return quiet(self._choice, self._mode.tables, bool(self._mode.dense))

    # -------------------------------------------------------------- session
    def after_create_session(self, session, coord):
        # TF's MonitoredSession, after an error (a first creation that failed in here is
        # retried as a first)
        again = self._started
        self._session = session
        # Sparse tables: this worker's reader of changed keys must exist before anyone
        # pushes (the table tracks changes only for readers it knows). Once: the PS's
        # tables and the copies are resources of the servers, which outlive the session
        # (a session created again empties the readers by taking every row, below).
        if not again:
            session.run(self._register)
        for u in self._mode.updaters:  # the session initialized their counts
            u.session_started(session)
        if self._choice is not None:
            self._choice_ops.session_started(session, RUNTIME.config.is_chief)
        if again:
            self._created_again(session)
            self._schedule.restart(self._steps)
        else:
            self._schedule.start(self._steps)
        self._started = True

    def session_closing(self) -> None:
        """TF closes the session (tfpsx.training.session, before TF's close): on an error
        MonitoredSession then creates a new one. The communicator stops first, after its
        round in flight (bounded by TFPSX_RPC_TIMEOUT): TF's close waits for every run of
        the session, and a round it cut off would have taken the copy's changed keys
        without pushing them (measured: 300-500 rows of a copy apart from the PS after
        such a close, tests/cluster/test_data_plane.py)."""
        if self._session is not None:
            self._schedule.stop("the round in flight when the session closed")

    def _created_again(self, session) -> None:
        """A session created again drops the steps since the last round (GEO's rule,
        :func:`~tfpsx.modes.geo.copies.drop_unpushed`): the new iterator gives back the
        splits the old one held and reads them again from their committed positions
        (tfpsx.data.splits; the closed session's input gave back every split it held,
        SplitInput.abandon). TF initializes the local variables anew: the dense weights'
        copies and snapshots take the PS's values. The round in flight at the error ended
        before TF closed the old session (:meth:`session_closing`): it pushed its steps
        and committed their positions."""
        unpushed = self._steps - self._schedule.pushed
        self._reported = self._steps  # (global_step never counts the dropped steps)
        resets, twice = drop_unpushed(self._mode.tables, self._resets, self._mode.positions)
        if resets:
            session.run(resets)
        logger.warning(
            "GEO: worker %d's session was created again: the %d local step(s) since the "
            "last round are dropped (%s%s) and its input reads their examples again%s",
            self._mode.worker_index, unpushed,
            "its dense weights initialized anew from the PS" if self._mode.dense else
            "its dense weights train on the PS", f", {len(resets)} table copy(ies) took "
            "the PS's rows" if resets else "",
            f"; tables {twice} have those steps already (a worker cache's copy keeps its "
            "rows, a table that trains async applied them on the PS): they train them "
            "twice" if twice else "")

    def after_run(self, run_context, run_values):
        if self._detector.ran_training(run_context):
            self._steps += 1  # else an eval or a global_step read, not a local step
        self._schedule.step_done(self._steps)

    def end(self, session):
        # The last local steps must reach the PS before the worker stops (a failed
        # communicator already failed a step).
        self._session = session
        self._ending = True  # (the final round pulls every changed row)
        self._schedule.end(self._steps, raise_failure=False)
        count_trained(self._mode.counters, self._mode.worker_index,
                      [u.trained_since(session) + (u.dim,) for u in self._mode.updaters],
                      self._steps)

    def settle(self) -> None:
        """(:meth:`GeoMode.settle_for_save`; nothing before the session or after its
        final round.)"""
        if self._session is None:
            return
        pushed = self._schedule.settle(self._steps)
        if pushed:
            logger.info("GEO: worker %d pushed its last %d local step(s) for the chief's "
                        "exact save", self._mode.worker_index, pushed)

    def _run_round(self, phases: Tuple[str, ...]) -> None:
        session, start = self._session, time.monotonic()
        steps = self._schedule.pushed
        new_steps = {self._new_steps: steps - self._reported}
        # The input positions of the steps so far: taken before the round reads the copy,
        # committed once it pushed (tfpsx.modes.positions).
        pending = self._mode.positions.take()
        among, feed = self._ahead_feed(phases)
        pushes, pulls, actions = self._round_fetch(among is not None)
        if self._choice is not None:
            self._choice_ops.catch_up(session, actions)
        # (geo_table_choice="auto": what the tables trained, and the job's choice)
        choice = self._choice_ops.fetch() if self._choice is not None else {}
        if phases == (PUSH, PULL) and not self._mode.in_train_thread:
            with caches_locked(self._mode.tables):
                done = session.run({"push": pushes, "pulls": pulls, "choice": choice},
                                   {**new_steps, **feed})
            pushed, pulled = done["push"], done["pulls"]
        else:
            done = {}
            for phase in phases:
                if phase == BARRIER:
                    RUNTIME.barrier_worker()
                elif phase == PUSH:
                    with caches_locked(self._mode.tables):
                        pushed = session.run(pushes, new_steps)
                else:
                    with caches_locked(self._mode.tables):
                        done = session.run({"pulls": pulls, "choice": choice})
                    pulled = done["pulls"]
        self._reported = steps
        self._mode.positions.commit(pending)
        # (a pull among keys sends them up, counted with the tables' bytes)
        count_round(self._mode.counters, start, self._dense,
                    (sum(p["rows"] for p in pushed),
                     sum(p["bytes"] for p in pushed) +
                     key_bytes(self._mode.tables, among, actions)),
                    (sum(p["rows"] for p in pulled), sum(p["bytes"] for p in pulled)))
        if self._choice is not None:
            self._choice_ops.after_round(session, actions,
                                         [n for p in pushed[1:] for n in p["per_table"]],
                                         [n for p in pulled[1:] for n in p["per_table"]],
                                         done["choice"])


class ChoiceOps:
    """Graph mode's ops for ``geo_table_choice="auto"`` (:mod:`tfpsx.modes.geo.choice`),
    built before the graph is finalized: the job's choice on PS 0 (read; the chief
    writes it), each table's lookup flag (set), its catch-up (the copy takes the PS's
    rows), and what the tables trained (read)."""

    def __init__(self, mode: GeoMode, choice):
        self._choice, self._mode = choice, mode
        var = GraphStateFactory(mode.worker_device).shared(GEO_TABLE_CHOICE, 0)
        self._initialized, self._init = var.is_initialized(), var.initializer
        self._read = var.read_value()
        self._value = tf.compat.v1.placeholder(tf.int64, [])
        self._write = var.assign(self._value)
        self._ready = False
        self._flag = tf.compat.v1.placeholder(tf.bool, [])
        self._set_flag = [async_flag(t).assign(self._flag) if t.chosen else None
                          for t in mode.tables]
        self.catch_ups = [copy_global(t) if t.chosen else None for t in mode.tables]
        zero, zeros = tf.constant(0.0, tf.float64), tf.zeros([2], tf.int64)
        self.trained = [u.trained_variable(tf.compat.v1.get_default_graph()) for u in
                        mode.updaters]
        self.trained = [zeros if v is None else v for v in self.trained]
        self.distinct = [zero if u.distinct is None else u.distinct.take()
                         for u in mode.updaters]

    def session_started(self, session, is_chief: bool) -> None:
        """The chief sets the job's choice up (once a PS holds it, it stays); the lookup
        flags (local variables, True in a new session) follow this worker's choice."""
        if is_chief and not session.run(self._initialized):
            session.run(self._init)
        for i, t in enumerate(self._mode.tables):
            if t.chosen and not t.trains_async:
                session.run(self._set_flag[i], {self._flag: False})

    def catch_up(self, session, actions) -> None:
        """Before a round: the tables that try rounds take the PS's rows."""
        ops = [self.catch_ups[i] for i, action in enumerate(actions) if action == CATCH_UP]
        if ops:
            session.run(ops)

    def fetch(self) -> dict:
        """What a round fetches for the choice: the tables' trained counts and distinct
        rows and, once the chief set it up, the job's choice."""
        return dict(trained=self.trained, distinct=self.distinct,
                    **({"mask": self._read} if self._ready else {}))

    def after_round(self, session, actions, pushed, pulled, fetched) -> None:
        def read():
            if "mask" in fetched:
                return int(fetched["mask"])
            # (a worker may round before the chief set it up: then no choice yet)
            self._ready = bool(session.run(self._initialized))
            return int(session.run(self._read)) if self._ready else None

        to_ps, to_copy = self._choice.after_round(
            actions, [int(n) for n in pushed], [int(n) for n in pulled],
            [float(x) for x in fetched["distinct"]],
            [tuple(int(x) for x in v) for v in fetched["trained"]],
            lambda mask: session.run(self._write, {self._value: mask}), read)
        follow_choice(self._mode.tables, to_ps, to_copy,
                      lambda i, flag: session.run(self._set_flag[i], {self._flag: flag}))

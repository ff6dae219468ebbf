"""GEO on Keras: every worker trains its own copy; every K local steps it syncs with the
parameter servers: the rule, the round and the schedule are :mod:`tfpsx.modes.geo`'s
(dense copies and the changed rows of tables pushed as ``(local - old) / N`` and pulled
back); this module is their eager / ``tf.function`` executor.

Model weights are local variables (what Keras trains), each with a global counterpart on
a PS and an ``old`` snapshot; ``optimizer.iterations`` is kept the same way with N = 1, so
it counts the job's steps (every worker's, as they are pushed). The sync runs in a
background communicator thread while ``fit`` goes on, or, with
``geo_sync_in_train_thread=True``, inside the train step every K steps with barriers
(deterministic: the same values as graph-mode GEO on the same schedule). A final sync
runs when ``fit`` returns, and then the worker's copy takes the global values: after
``fit`` (and in ``evaluate`` / ``predict`` outside it) the model is the job's model.
"""

from __future__ import annotations

import logging
import time
from typing import List, Optional

import tensorflow as tf

from tfpsx import errors, settings
from tfpsx.embedding.updaters import TableUpdater
from tfpsx.keras.modes.async_ import KerasAsync, OnServers
from tfpsx.keras.modes.base import SHARED_PREFIX, CreationContext, KerasMode
from tfpsx.keras.read_ahead import ReadAhead
from tfpsx.keras.read_assign import averaging, read_and_assigned
from tfpsx.keras.variables import SharedVariable, initialize
from tfpsx.modes.geo import (BARRIER, PULL, PUSH, GeoCounters, GeoSchedule, GeoTableUpdater,
                             GeoVariable, adopt_rule, caches_locked, copy_trains, count_round,
                             count_trained, dense_async, dense_size, distrust_snapshot,
                             fold_pulled, pull_ops, push_ops, rule_workers, table_readers,
                             take_global, track_snapshot)
from tfpsx.modes.geo.ahead import AheadPulls, key_bytes, read_ahead_depth
from tfpsx.modes.geo.choice import CATCH_UP
from tfpsx.modes.geo.copies import copy_global, local_reader
from tfpsx.modes.geo.tables import async_flag, follow_choice, quiet, table_choice
from tfpsx.modes.positions import COMMITS, PendingPositions, record_op
from tfpsx.modes.state import GEO_TABLE_CHOICE
from tfpsx.waits import bounded_wait

logger = logging.getLogger("tfpsx")


class KerasGeo(KerasMode):
    NAME = "geo"
    ROUNDS = True  # a step reaches the model at a round (its input commits then)

    def __init__(self, keras_strategy, options, config):
        super().__init__(keras_strategy, options, config)
        adopt_rule(self, options, config)
        # geo_table_choice="auto": the step is traced for each table's state (AsyncRows
        # while it trains async) and traced again when the job's choice changes.
        self.retraces = True
        self._steps_stale = False  # a table's state changed since the step was traced
        self._dispatched = 0  # local steps fit dispatched, as batch_end counts them
        self.rule_workers = rule_workers(config)  # N of the rule: the job's, a joiner's too
        self.dense: List[GeoVariable] = []
        self.step_pairs: List[GeoVariable] = []   # optimizer.iterations (N = 1)
        self.tables = []          # GeoTable, appended by GeoTableUpdater
        self.updaters = []        # the GeoTableUpdaters, as their tables join
        self.counters = GeoCounters()
        self.positions = PendingPositions()  # input positions, unpushed
        self._steps: Optional[tf.Variable] = None    # local steps run
        # The local steps counted when the last round started (the schedule's ``pushed``,
        # where the compiled step reads it).
        self._pushed: Optional[tf.Variable] = None
        self._sync_fns = {}  # the background round's function, by the tables' actions
        self._choice = False  # geo_table_choice="auto": made at the first round
        self._choice_var = None
        # Deterministic rounds run inside the step (after_step) when the schedule's rule
        # says; the schedule runs the background and final ones. The communicator's first
        # wake-up traces the sync function (0.7 s on the examples/keras_ctr model: off
        # fit's path, long before the first K steps ran).
        self.schedule = GeoSchedule(
            options.k_steps, self.in_train_thread, self._run_round,
            cached=lambda: any(t.cached for t in self.tables), barrier=self.barrier,
            first_round=self._trace_round,
            rounds_in_step=self.in_train_thread,
            auto_workers=rule_workers(config) if options.k_auto else 0,
            counters=self.counters, quiet=self._quiet)
        self._registered = False
        self._evicted = {}  # PS evictions of each table at the last take (or registration)
        self._fits = 0
        self._in_fit = False
        # A round inside the step: the positions it took before reading the copy, which
        # it commits once it pushed (_take_pending, _commit_pending).
        self._in_step_pending = {}
        # geo_pull_ahead: a background round pulls the changed rows among the ids of
        # the batches that may train before its next pull lands (read ahead).
        self.ahead = (AheadPulls(options.geo_pull_ahead,
                                 read_ahead_depth(options, self.rule_workers))
                      if getattr(options, "geo_pull_ahead", 0) else None)
        self.reader = ReadAhead(self.ahead.depth) if self.ahead is not None else None

    # ------------------------------------------------------------------ variables
    def create_variable(self, extended, next_creator, kwargs, ctx: CreationContext):
        if not (ctx.is_model_weight(kwargs) or ctx.is_iterations()):
            return extended.create_local(next_creator, kwargs)
        local = extended.create_local(next_creator, kwargs)
        # The global value: the chief's initial one, or the one on the PS already (a
        # restarted chief, a worker joining): every copy starts from it.
        # (A large weight's global value is partitioned over the PS tasks: the rule's push
        # and pull split by slice.)
        global_ = (self.shared(ctx.path, kwargs, initial=local.read_value())
                   if ctx.is_iterations()
                   else self.global_variable(ctx.path, kwargs, initial=local.read_value()))
        with tf.device(self.worker_device):
            local.assign(global_.read_value())
            old = next_creator(initial_value=global_.read_value(), trainable=False,
                               name=f"{kwargs.get('name') or 'var'}_geo_old",
                               dtype=local.dtype)
            # Keras increments iterations by a read and an assign: the rounds' pulls
            # add beside it, and the step folds them in (GeoVariable.pulled).
            pulled = (next_creator(initial_value=tf.zeros_like(old.read_value()),
                                   trainable=False, dtype=local.dtype,
                                   name=f"{kwargs.get('name') or 'var'}_geo_pulled")
                      if ctx.is_iterations() else None)
        pair = GeoVariable(local, old, global_, pulled)
        (self.step_pairs if ctx.is_iterations() else self.dense).append(pair)
        return local

    def table_updater(self, table) -> TableUpdater:
        return GeoTableUpdater(self)

    def local_train_op(self, op) -> None:
        """(Local steps are counted by the step itself, ``after_step``.)"""

    def round_steps(self) -> int:
        # k_steps="auto": chosen by the first fit, before its step is built (which holds it)
        return self.schedule.k_steps

    def steps(self) -> tf.Variable:
        if self._steps is None:
            with tf.device(self.worker_device):
                self._steps = tf.Variable(0, dtype=tf.int64, trainable=False,
                                          name="geo_local_steps")
                self._pushed = tf.Variable(0, dtype=tf.int64, trainable=False,
                                           name="geo_pushed_steps")
        return self._steps

    # ------------------------------------------------------------------ the rule
    def _trace_round(self) -> None:
        """The communicator's first wake-up: the round's function is traced off fit's
        path."""
        choice = self._table_choice()
        self.sync_fn(None if choice is None else choice.actions()).get_concrete_function()

    def _push_ops(self, actions=None, per_table=None):
        return push_ops(self.dense, self.tables, float(self.rule_workers),
                        counters=self.step_pairs, per_table=per_table, actions=actions)

    def _pull_ops(self, after, actions=None, per_table=None, among=None):
        return pull_ops(self.dense + self.step_pairs, self.tables, after, actions,
                        per_table=per_table, among=among)

    def sync_fn(self, actions=None, ahead: bool = False):
        """push + pull in one function (the background communicator's round); under
        geo_table_choice="auto", one per ``actions`` (each table's pull as the job's
        choice has it: :mod:`tfpsx.modes.geo.choice`). ``ahead``: the function takes
        one key vector per table, and each table's pull brings only the changed rows
        among its keys (a worker cache's pull brings those it holds, as always)."""
        if (actions, ahead) not in self._sync_fns:
            n = len(self.tables)

            def sync(*among):
                among = ([None if t.cached else keys for t, keys in zip(self.tables, among)]
                         if ahead else None)
                pushed, pulled = [], []
                pushes, sent = self._push_ops(actions, pushed)
                pulls, received = self._pull_ops(pushes, actions, pulled, among)
                with tf.control_dependencies(pulls):
                    return tuple(tf.identity(x) for x in sent + received + tuple(pushed) +
                                 tuple(pulled))

            # No AutoGraph: the rule functions are graph code already (graph mode runs
            # them as is), and converting them took 4.6 s of every fit's start (measured).
            self._sync_fns[(actions, ahead)] = tf.function(
                sync, autograph=False,
                input_signature=[tf.TensorSpec([None], tf.int64)] * n if ahead else [])
        return self._sync_fns[(actions, ahead)]

    def _count(self, start: float, rows_sent, bytes_sent, rows_received, bytes_received):
        count_round(self.counters, start, dense_size(self.dense), (rows_sent, bytes_sent),
                    (rows_received, bytes_received))

    def _run_round(self, phases) -> None:
        """A background or final round (push, then pull): one call of the sync function.
        The input positions pending before it are committed once it pushed."""
        assert phases == (PUSH, PULL), phases  # deterministic rounds run in the step
        start = time.monotonic()
        pending = self.positions.snapshot()
        choice = self._table_choice()
        actions = None if choice is None else choice.actions()
        try:
            for t, action in zip(self.tables, actions or ()):
                if action == CATCH_UP:  # it tries rounds: its copy takes the PS's rows
                    copy_global(t)
                    track_snapshot(t)
                    t.local_is_old = False
            among = (self.ahead.among(self.schedule.pushed, self.reader.window,
                                      self.counters)
                     if self.ahead is not None else None)
            with caches_locked(self.tables):
                done = [int(x) for x in self.sync_fn(actions, among is not None)(
                    *(among or ()))]
        except BaseException:
            self.positions.put_back(pending)  # (not pushed: the next round's)
            raise
        self.positions.commit(pending)
        # (a pull among keys sends them up, counted with the tables' bytes)
        self._count(start, done[0], done[1] + key_bytes(self.tables, among, actions),
                    done[2], done[3])
        if choice is not None:
            n = len(self.tables)
            self._after_choice_round(choice, actions, done[4:4 + n], done[4 + n:])

    def _table_choice(self):
        """geo_table_choice="auto"'s choice (or None: :func:`table_choice`), made at the
        first round; the job's is on PS 0."""
        if self._choice is False:
            self._choice = table_choice(self, self.is_chief, self.counters)
            if self._choice is not None:
                self._choice_var = self.state.shared(GEO_TABLE_CHOICE, 0)
        return self._choice

    def _after_choice_round(self, choice, actions, pushed, pulled) -> None:
        totals, distinct = [], []
        for u in self.updaters:
            var = u.trained_variable()
            totals.append((0, 0) if var is None else tuple(int(x) for x in var.numpy()))
            distinct.append(0.0 if u.distinct is None else float(u.distinct.take()))
        to_ps, to_copy = choice.after_round(actions, pushed, pulled, distinct, totals,
                                            self._choice_var.assign,
                                            lambda: int(self._choice_var.read_value()))
        follow_choice(self.tables, to_ps, to_copy,
                      lambda i, flag: async_flag(self.tables[i]).assign(flag))
        if to_ps or to_copy:
            self._steps_stale = True  # (fit's callback traces the step again)

    def steps_stale(self) -> bool:
        """Whether the model's step functions were traced for another choice than the
        job's now (:class:`~tfpsx.modes.geo.hot_rows.AsyncRows`); the caller traces them
        again (this clears it). Until it does, the old step still trains right: a table
        traced async trains the PS (its copy, if it runs rounds now, pulls those rows),
        one traced through HotRows follows its flag."""
        stale, self._steps_stale = self._steps_stale, False
        return stale

    def _quiet(self) -> bool:
        """(:func:`tfpsx.modes.geo.tables.quiet`: ``fit`` asks for rounds between steps,
        :meth:`batch_end`.)"""
        choice = self._choice if self._choice is not False else None
        return quiet(choice, self.tables, bool(self.dense or self.step_pairs))

    def commit_position(self, position):
        # A step trains the copy: its position waits for the round that pushes it; while
        # every table trains async the step is on the PS: committed as async's.
        return record_op(position, lambda: COMMITS if self._quiet() else self.positions,
                         "tfpsx_position_geo")

    def _take_pending(self) -> bool:
        self._in_step_pending = self.positions.snapshot()
        return True

    def _commit_pending(self) -> bool:
        pending, self._in_step_pending = self._in_step_pending, {}
        self.positions.commit(pending)
        return True

    def job_value(self, variable):
        """The job's value of a model weight (or ``optimizer.iterations``): its global
        counterpart on the PS, not this worker's copy, which holds its own unpushed
        steps and lacks the others' since its last pull (what a checkpoint saved during
        ``fit`` must hold); None for a variable GEO does not pair."""
        backend = getattr(variable, "value", variable)  # (a Keras variable's tf.Variable)
        for pair in self.dense + self.step_pairs:
            if pair.local is variable or pair.local is backend:
                return pair.global_.read_value()
        parent = getattr(super(), "job_value", None)  # (GEO with async dense: its step)
        return parent(variable) if parent is not None else None

    def settle_for_save(self) -> None:
        """An exact save's barrier, at a step boundary (its steps' ops done): this
        worker's local steps pushed and their positions committed
        (:meth:`GeoSchedule.settle`); outside ``fit`` every step was pushed already."""
        if not self.schedule.running:
            return
        pushed = self.schedule.settle(int(self._steps.read_value()))
        if pushed:
            logger.info("GEO: worker %d pushed its last %d local step(s) for the chief's "
                        "exact save", self.worker_index, pushed)

    # ------------------------------------------------------------------ the step
    def before_step(self) -> list:
        # What the rounds pulled into iterations, before the step reads it (its count
        # for the optimizer and the schedules; in program order, the same variable).
        # (And the dense copies it writes by a read and an assign: _pull_beside.)
        return super().before_step() + [fold_pulled(pair) for pair in
                                        self.step_pairs + self.dense if pair.pulled is not None]

    def after_step(self) -> list:
        steps = self.steps()
        count = steps.assign_add(1, read_value=False)
        if not self.in_train_thread:
            return [count]
        # Deterministic: when the schedule's rule says (K local steps since the last round
        # started, as in graph mode), inside the step: push, all workers meet, pull, meet
        # again (graph mode's geo_sync_in_train_thread).
        with tf.control_dependencies([count]):
            now = steps.read_value()

        def sync_in_step():
            # The deterministic round's phases, chained in the step.
            with tf.control_dependencies([self._pushed.assign(now)]):
                begun = tf.py_function(time.monotonic, [], tf.float64)
            nothing = (tf.constant(0, tf.int64), tf.constant(0, tf.int64))
            last, sent, received = [begun], nothing, nothing
            for phase in self.schedule.phases():
                with tf.control_dependencies(last):
                    if phase == BARRIER:
                        last = [tf.py_function(self._barrier, [], tf.bool)]
                    elif phase == PUSH:
                        # The positions pending before the push reads the copy are in
                        # it: committed once it is in.
                        with tf.control_dependencies(
                                [tf.py_function(self._take_pending, [], tf.bool)]):
                            last, sent = self._push_ops()
                        with tf.control_dependencies(last):
                            last = list(last) + [
                                tf.py_function(self._commit_pending, [], tf.bool)]
                    else:
                        last, received = self._pull_ops(last)
            with tf.control_dependencies(last):
                counted = tf.py_function(self._count_in_step,
                                         [begun, now] + list(sent) + list(received), tf.bool)
            return counted

        return [tf.cond(self.schedule.due(now, self._pushed.read_value()), sync_in_step,
                        lambda: tf.constant(False))]

    def _barrier(self) -> bool:
        self.keras_strategy.reporting(self.barrier)()
        return True

    def _count_in_step(self, start, steps, *rows_and_bytes) -> bool:
        self._count(float(start), *rows_and_bytes)
        self.schedule.ran_in_step(int(steps))
        return True

    # ------------------------------------------------------------------ fit
    def publish(self, model) -> None:
        # A restore (load_weights) between building and the first fit changed the chief's
        # copies (until then local == old): the job continues from that model.
        if self._fits:
            return
        for v in self.dense + self.step_pairs:
            if not bool(tf.reduce_all(tf.equal(v.local.read_value(), v.old.read_value()))):
                v.global_.assign(v.local.read_value())
                v.take(v.local.read_value())

    def _start(self) -> None:
        """Once, when this worker first uses the model (fit, evaluate or predict): its
        copies start from the global model, tables included (a restored table's rows
        would otherwise never reach a copy: a pull brings only rows changed after this
        worker registered), and its table readers are registered."""
        if self._registered:
            return
        if not self.is_chief:
            for v in self.dense + self.step_pairs:
                v.take(v.global_.read_value())
        for t in self.tables:
            if t.chosen:  # (it starts async: its copy takes the PS's rows if it tries
                local_reader(t)  # rounds, copy_global)
                continue
            # Readers first: a push landing while the rows are copied is then also
            # marked for this worker's pulls (value-neutral if the copy had it).
            table_readers(t)
            rows = t.global_.export()
            if int(tf.size(rows["keys"])):
                t.local.import_rows(rows, clear=True)
                # old keeps the PS's slots too when the rows travel with them.
                t.old.import_rows(rows if t.share_slots else
                                  dict(rows, slots=tf.zeros([0], tf.float32)), clear=True)
                with tf.device(t.device):  # the import is not this worker's change
                    t.local.shards[0].take_changed(tf.constant(0, tf.int64))
            if not t.cached:  # local and old are the same rows here
                track_snapshot(t)
            self._evicted[t.global_.name] = self._ps_evictions(t)
        self._registered = True

    @staticmethod
    def _ps_evictions(t) -> int:
        return 0 if t.cached else int(t.global_.stats()["evicted"])

    def _take_global(self, refresh_rounded: bool = False) -> None:
        """This worker's copies become the global model: local = old = global, dense
        and tables (table rows keep this worker's optimizer slots, as the slot wire
        carried them; with a wire dtype, rows last pulled stay as the wire carried them
        unless ``refresh_rounded``: the chief's, when fit ends, since its copy is what
        ``export_serving`` exports (values, not slots); rows
        evicted on the PS since the last take: every row refreshed). GEO's pull does not
        do that (local += global - old keeps the part of this worker's own delta that it
        did not push), so without it a model evaluated, predicted or exported after
        ``fit`` would mix the copy's dense weights with the PS tables' rows."""
        for v in self.dense + self.step_pairs:
            v.take(v.global_.read_value())
        for t in self.tables:
            if t.trains_async:
                continue  # (its lookups read the PS: geo_table_choice="auto")
            evicted = self._ps_evictions(t)
            moved = evicted != self._evicted.get(t.global_.name, evicted)
            take_global(t, refresh_all=moved or (refresh_rounded and t.wire is not None))
            self._evicted[t.global_.name] = evicted

    def check_model(self, model) -> None:
        super().check_model(model)
        optimizer = getattr(model, "optimizer", None)
        paired = {id(pair.local) for pair in self.dense}
        copied = [w for w in model.trainable_weights if id(getattr(w, "value", w)) in paired]
        if copied and averaging(optimizer):
            raise ValueError(
                f"GEO cannot train this model's {len(copied)} dense weight(s), copies on "
                f"this worker, with use_ema=True ({type(optimizer).__name__}): Keras "
                "assigns the weights their moving average every ema_overwrite_frequency steps and "
                "when fit ends, and GEO's next round would push that average's distance "
                "from the last round as this worker's training, undoing the other "
                "workers' steps. Compile with use_ema=False (keep an average of your own "
                "in a callback after fit, or export the PS's weights), or train async "
                "(no k_steps)")

    def begin_fit(self, model) -> None:
        super().begin_fit(model)
        self._start()
        self._pull_beside(model)
        for t in self.tables:
            copy_trains(t)
        self._fits += 1
        self._in_fit = True
        self._dispatched = int(self.steps().read_value())
        self.schedule.start(self._dispatched)
        # Every step is pushed when fit starts: the next round comes K steps on (also
        # after a fit that ended off a multiple of K, whose final round pushed its rest).
        self._pushed.assign(self.schedule.pushed)
        if self.ahead is not None:
            reading = self.reader.begin(model, [t.global_ for t in self.tables],
                                        self._dispatched)
            self.ahead.begin(reading, self.schedule.k_steps,
                             int(getattr(model, "steps_per_execution", 1) or 1))

    def wrap_input(self, dataset):
        return self.reader.wrap(dataset) if self.reader is not None else dataset

    def _pull_beside(self, model) -> None:
        """The dense copies ``model``'s step writes by a read and an assign
        (:mod:`tfpsx.keras.read_assign`: an FTRL optimizer, a constraint) get a
        ``pulled`` variable, as ``iterations`` has: a round's pull adds there and the
        step folds it in first (:meth:`before_step`). A pull into the weight itself
        that landed between the step's read and assign was overwritten, and the next
        push sent the others' change back negated. Before the step and the round are
        traced: the round is traced again if a pair is new, and a step an earlier fit
        traced too (:meth:`steps_stale`). Rounds inside the step (deterministic) come
        after its update in program order: nothing to pull beside."""
        if self.in_train_thread:
            return
        at_risk = read_and_assigned(model)
        new = [pair for pair in self.dense
               if pair.pulled is None and id(pair.local) in at_risk]
        for pair in new:
            with tf.device(self.worker_device):
                pair.pulled = tf.Variable(tf.zeros_like(pair.old.read_value()),
                                          trainable=False, name="geo_pulled")
        if new:
            self._sync_fns.clear()
            # (an earlier fit's step would never fold them: fit's callback traces again)
            self._steps_stale = self._steps_stale or self._fits > 0
            why = sorted({at_risk[id(pair.local)] for pair in new})
            logger.info("GEO: %d dense weight(s) written by a read and an assign in the "
                        "step (%s): rounds pull beside them, and each step folds the pulls "
                        "in first", len(new), ", ".join(why))

    def fit_length(self, epoch_steps: Optional[int]) -> None:
        # k_steps="auto" chooses K here; then too few rounds in an epoch: a warning.
        self.schedule.fit_length(epoch_steps, job_k=self._job_k)

    def _job_k(self, own: int) -> int:
        """``k_steps="auto"``'s K is the job's: the chief's first fit writes the K of its
        epoch on PS 0 (a restarted chief finds it there), every other worker, a joiner
        too, takes it (bounded by TFPSX_SESSION_TIMEOUT). Before ``begin_fit``: the chief
        marks the model ready after it."""
        timeout = settings.get("TFPSX_SESSION_TIMEOUT")
        var = SharedVariable(shared_name=SHARED_PREFIX + "geo_k_steps", shape=[],
                             dtype=tf.int64, device=self.ps_devices[0], trainable=False,
                             name="geo_k_steps")
        initialize(var, tf.constant(0, tf.int64), self.is_chief, timeout)
        if self.is_chief:
            if int(var.read_value()) == 0:
                var.assign(own)
        else:
            bounded_wait(lambda: int(var.read_value()) > 0, timeout,
                         lambda _: errors.ClusterTimeoutError(
                             f"worker {self.worker_index} waited {timeout:g} s "
                             "(TFPSX_SESSION_TIMEOUT) for the chief (worker 0) to choose "
                             "GEO's k_steps='auto' (its first fit does); is it running?"))
        return int(var.read_value())

    def begin_eval(self, model) -> None:
        # Outside fit, evaluate / predict see the global model as it is now (the other
        # workers' last pushes included); a validation during fit sees this worker's
        # copy as it trains (a pull there would change a deterministic schedule).
        super().begin_eval(model)
        if not self._registered:
            self._start()
        elif not self._in_fit:
            self._take_global()

    def batch_end(self, model, steps_left: Optional[int] = None) -> None:
        if not self.schedule.running:
            return
        # The steps fit dispatched, counted here: reading the count the step keeps waits
        # for the step in flight (Keras dispatches the next step while one runs). It is
        # read only when a round may be due (an execution at an epoch's end may run
        # fewer steps than steps_per_execution).
        self._dispatched += getattr(model, "steps_per_execution", 1) or 1
        may = self.schedule.may_round(self._dispatched)
        if may:
            self._dispatched = int(self._steps.read_value())
        self.schedule.step_done(self._dispatched, steps_left, may_round=may)

    def _distrust_snapshots(self) -> None:
        """A fit failed (:func:`tfpsx.modes.geo.distrust_snapshot`)."""
        for t in self.tables:
            distrust_snapshot(t)

    def after_fit(self, model, failed: bool) -> None:
        super().after_fit(model, failed)
        if failed:  # a step raised (end_fit ran all the same, and may have taken)
            self._distrust_snapshots()
            # What the rounds pulled beside a weight since the last step: into the
            # copy now (the communicator stopped), not into a step after a restore.
            for pair in self.dense + self.step_pairs:
                if pair.pulled is not None:
                    fold_pulled(pair)

    def end_fit(self, model) -> None:
        # The last local steps reach the PS before fit returns; then the model is the
        # global one (what model.save writes, what a restarted job resumes from).
        self._in_fit = False
        if self.reader is not None:  # (the final round pulls every changed row)
            self.reader.end()
        steps = int(self._steps.read_value()) if self._steps is not None else 0
        try:
            failed = not self.schedule.end(steps)  # raises a communicator's failure
        except BaseException:
            self._distrust_snapshots()
            raise
        count_trained(self.counters, self.worker_index,
                      [u.trained_since() + (u.dim,) for u in self.updaters], steps)
        if self.steps_stale():  # (the final round's choice: the next fit, evaluate or
            # predict traces its step for it)
            model.train_function = model.test_function = model.predict_function = None
            logger.info("GEO: the model's steps are traced again when next used (the job's "
                        "choice between rounds and async changed in fit's final round)")
        if failed:
            self._distrust_snapshots()
        else:
            if self.in_train_thread:
                # Every final push is in before any copy takes the global model: the PS
                # counts the pushes a worker has not pulled, and its next fit's first
                # round combines by them (a mean over pushes its copy never held).
                self._barrier()
            self._take_global(refresh_rounded=self.is_chief)


class KerasGeoAsyncDense(KerasGeo, KerasAsync):
    """GEO's tables (each worker's copy, synced every K steps) with the dense weights
    async on the parameter servers (``geo_dense="async"``): model weights, their
    optimizer slots and ``optimizer.iterations`` as :class:`KerasAsync` keeps them (the
    optimizer's update runs beside each weight; iterations counts every worker's steps),
    and GEO's rounds move table rows only."""

    def create_variable(self, extended, next_creator, kwargs, ctx: CreationContext):
        return OnServers.create_variable(self, extended, next_creator, kwargs, ctx)

    def after_step(self) -> list:
        return KerasAsync.after_step(self) + KerasGeo.after_step(self)

    def publish(self, model) -> None:
        OnServers.publish(self, model)

    def end_fit(self, model) -> None:
        KerasGeo.end_fit(self, model)
        OnServers.end_fit(self, model)  # the model holds the global dense values


def geo_class(options, config) -> type:
    """GEO's Keras class for ``options`` in the job of ``config``."""
    return KerasGeoAsyncDense if dense_async(options, rule_workers(config)) else KerasGeo

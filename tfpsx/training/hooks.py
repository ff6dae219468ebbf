"""Shared pieces of the modes' session hooks."""

from __future__ import annotations

import logging
import time
from typing import Dict, Iterable, Optional

import tensorflow as tf

from tfpsx import graph_state, metrics
from tfpsx.checkpoint import evaluation
from tfpsx.control import splits
from tfpsx.embedding import cache as _cache
from tfpsx.modes.positions import PendingSteps, commit_seconds, decode_numpy

logger = logging.getLogger("tfpsx")


class ResumeLogHook(tf.compat.v1.train.SessionRunHook):
    """The chief says where training starts: from a checkpoint (which one, at which global
    step) or from a new model; a ``resumed`` metrics record says the same (a job that
    ``tfpsx-run --max_restarts`` brought back shows from which step it went on). A
    session created again after an error (``again``) says the step it goes on from."""

    def __init__(self, checkpoint_dir: Optional[str]):
        self._dir = checkpoint_dir
        self._step = None
        self._sessions = 0

    def begin(self):
        self._step = tf.compat.v1.train.get_global_step()

    def after_create_session(self, session, coord):
        path = tf.train.latest_checkpoint(self._dir) if self._dir else None
        step = int(session.run(self._step)) if self._step is not None else None
        self._sessions += 1
        again = self._sessions > 1  # TF's MonitoredSession created it again after an error
        if again:
            logger.info("chief's session created again, at global step %s", step)
        elif path:
            logger.info("chief resumed from checkpoint %s at global step %s", path, step)
        else:
            logger.info("chief started a new model (no checkpoint in %s)", self._dir)
        metrics.emit("resumed", checkpoint=path, global_step=step, again=again)


class TrainingDoneHook(tf.compat.v1.train.SessionRunHook):
    """The chief marks training done beside its checkpoints when its session ends (with
    the step of the last checkpoint, which TF's saver hook wrote just before: this hook
    runs after it), and clears the mark when a session starts: an evaluator task
    (``tfpsx.evaluate_checkpoints``) then knows when the last checkpoint is in."""

    def __init__(self, checkpoint_dir: str):
        self._dir = checkpoint_dir

    def after_create_session(self, session, coord):
        evaluation.clear_training_done(self._dir)

    def end(self, session):
        latest = evaluation.latest_checkpoint(self._dir)
        if latest is not None:
            evaluation.mark_training_done(self._dir, latest[1])


class TrainStepDetector:
    """Tells whether a ``session.run`` ran one of a mode's train ops: the op itself, or a
    group (a NoOp's control inputs, as ``tf.group`` makes) around one. An eval or a
    ``global_step`` read is not a local step. Answers are cached per fetched op."""

    def __init__(self, train_ops: Iterable = ()):
        self._names = {getattr(op, "op", op).name for op in train_ops}
        self._cache: Dict[str, bool] = {}
        self._reached: Dict[tuple, set] = {}

    def ran_training(self, run_context) -> bool:
        return any(self._runs_train(f) for f in
                   tf.nest.flatten(run_context.original_args.fetches))

    def reached(self, run_context) -> set:
        """The names of the train ops the run's fetches run (directly or in groups);
        cached per fetched ops."""
        fetched = [getattr(f, "op", f) for f in
                   tf.nest.flatten(run_context.original_args.fetches)]
        key = tuple(getattr(op, "name", None) for op in fetched)
        if key not in self._reached:
            self._reached[key] = self._reach(fetched)
        return self._reached[key]

    def _reach(self, stack) -> set:
        found, seen = set(), set()
        while stack:
            op = stack.pop()
            if not isinstance(op, tf.Operation) or op.name in seen:
                continue
            seen.add(op.name)
            if op.name in self._names:
                found.add(op.name)
            elif op.type == "NoOp":
                stack.extend(op.control_inputs)
        return found

    def _runs_train(self, fetch) -> bool:
        op = getattr(fetch, "op", fetch)
        if not isinstance(op, tf.Operation):
            return False
        if op.name not in self._cache:
            self._cache[op.name] = False  # bounds the recursion
            self._cache[op.name] = op.name in self._names or (op.type == "NoOp" and any(
                self._runs_train(c) for c in op.control_inputs))
        return self._cache[op.name]


class WorkerCacheHook(tf.compat.v1.train.SessionRunHook):
    """Drives the graph's worker caches (``DynamicTable(cache_size=...)``): it
    registers their readers of changed keys before the first step; between steps, a cache that ran ``flush_steps`` updates since its last sync syncs with the PS
    (GEO mode's caches sync in its communicator); at the end, the last updates reach the
    PS (a final flush) and each cache's counters go to the log and a ``cache`` metrics
    record."""

    def begin(self):
        self._caches = graph_caches()
        self._own = [c for c in self._caches if c.flush_in_step]
        # (a staged cache syncs in its stager's thread, between the stagings)
        self._due = [c for c in self._own if not c.fed]
        self._detectors = [TrainStepDetector(c.apply_ops) for c in self._due]
        self._steps = [0] * len(self._due)  # training runs since each cache's last sync
        self._register = [c.register() for c in self._own]
        self._registered = False
        self._flush = [c.flush() for c in self._own]
        self._flush_due = [c.flush() for c in self._due]
        self._stats = {c.table.name: c.stats() for c in self._caches}

    def after_create_session(self, session, coord):
        # Before any step: every later change is pulled. Once: a session created again
        # after an error (TF's MonitoredSession) would take what the readers hold, the
        # caches' unflushed keys and the changes not pulled yet (the caches and the PS's
        # tables are resources of the servers: they outlive the session).
        if not self._registered:
            session.run(self._register)
            self._registered = True

    def after_run(self, run_context, run_values):
        due = []
        for i, (cache, detector) in enumerate(zip(self._due, self._detectors)):
            if detector.ran_training(run_context):
                self._steps[i] += 1
                if self._steps[i] >= cache.options.flush_steps:
                    self._steps[i] = 0
                    due.append(self._flush_due[i])
        if due:
            run_context.session.run(due)

    def end(self, session):
        session.run(self._flush)
        for name, values in session.run(self._stats).items():
            _cache.report(name, values)



def graph_caches(graph=None) -> list:
    """The worker caches (:class:`tfpsx.embedding.cache.WorkerCache`) of ``graph``."""
    state = graph_state.peek(graph)
    return list(state.worker_caches) if state is not None else []


def _nothing() -> None:
    pass


class InputSummaryHook(tf.compat.v1.train.SessionRunHook):
    """The chief's TensorBoard scalars of its graph's inputs (``tfpsx.data.next_batch``):
    ``input/<name>/...`` (:func:`tfpsx.control.splits.input_scalars`), every
    ``every_steps`` global steps, into ``output_dir``'s run beside TF's own summaries."""

    def __init__(self, output_dir: str, every_steps: int):
        self._dir = output_dir
        self._timer = tf.compat.v1.train.SecondOrStepTimer(every_steps=every_steps)
        self._step = None

    def begin(self):
        self._step = tf.compat.v1.train.get_global_step()
        self._writer = tf.compat.v1.summary.FileWriterCache.get(self._dir)

    def before_run(self, run_context):
        return tf.compat.v1.train.SessionRunArgs(self._step) if self._step is not None else None

    def after_run(self, run_context, run_values):
        step = run_values.results
        if step is None or not self._timer.should_trigger_for_step(step):
            return
        self._timer.update_last_triggered_step(step)
        self._write(step)

    def _write(self, step) -> None:
        values = [tf.compat.v1.Summary.Value(tag=tag, simple_value=value)
                  for tag, value in splits.input_scalars().items()]
        if values:
            self._writer.add_summary(tf.compat.v1.Summary(value=values), step)
            self._writer.flush()

    def end(self, session):
        step = session.run(self._step) if self._step is not None else None
        if step is not None and step != self._timer.last_triggered_step():
            self._write(step)


class InputPositionListener(tf.compat.v1.train.CheckpointSaverListener):
    """Before each save of the chief's checkpoint: the positions of the graph's inputs
    (``tfpsx.data.next_batch``) go into their variables, which the save then holds. First
    the position, then the model: a restore can repeat the steps trained in between,
    never skip one."""

    def __init__(self):
        self._barrier = None

    def before_save(self, session, global_step_value):
        # An input's exact save: its barrier up from here to after_save (every worker's
        # steps committed, none training), the chief's own runs committed first.
        hook = InputPositionHook.active
        self._barrier = splits.save_barrier(hook.flush if hook is not None else _nothing)
        self._barrier.__enter__()
        save_input_positions(session)

    def after_save(self, session, global_step_value):
        if self._barrier is not None:
            barrier, self._barrier = self._barrier, None
            barrier.__exit__(None, None, None)


def save_input_positions(session) -> None:
    """Fills the variables of the inputs of ``session``'s graph with the coordinators'
    states (nothing when the graph reads none)."""
    state = graph_state.peek(session.graph)
    if state is None or not state.input_positions:
        return
    for name in state.input_positions:  # (a save before the first take: its table set)
        splits.registered()[name].client()
    session.run([op for _, op in state.input_positions.values()])


def restore_input_positions(graph, checkpoint: Optional[str]) -> None:
    """The chief, before TF restores ``checkpoint``'s model: the positions of the graph's
    inputs it holds go into their coordinators (before any worker can take a split:
    theirs wait for the model the chief restores). A checkpoint without them (of a job
    that read no tfpsx input) leaves the inputs where they are."""
    state = graph_state.peek(graph)
    if state is None or not state.input_positions or not checkpoint:
        return
    names = {n for n, _ in tf.train.list_variables(checkpoint)}
    for name, (var, _) in state.input_positions.items():
        key = var.op.name
        if key not in names:
            logger.warning("checkpoint %s holds no position of input %r: it starts from its "
                           "first epoch", checkpoint, name)
            continue
        value = tf.train.load_variable(checkpoint, key)
        if value:
            epoch = splits.restore(name, bytes(value))
            logger.info("input %s: position restored from %s (epoch %s)", name, checkpoint,
                        epoch)


class InputPositionHook(tf.compat.v1.train.SessionRunHook):
    """Commits the input positions of the batches a graph's runs train
    (``tfpsx.data.next_batch``): a run that takes a batch fetches its position too, and
    once the run returned (its updates, dense and tables, applied) the position is
    committed, every ``every`` seconds (TFPSX_INPUT_COMMIT_SECONDS) and when the session
    ends; in GEO it is pending until the round that pushes the step
    (``mode.positions``). ``applied``: whether the last run's step is in the model
    (sync: False when the chief ended before applying it; its batch is then not
    committed). ``in_model``: GEO, whether the last run's step is in the model already
    (every table trains async): its position is committed as async's, not pending."""

    def __init__(self, pending=None, every: Optional[float] = None, applied=None,
                 settle=None, in_model=None):
        self._pending, self._applied, self._in_model = pending, applied, in_model
        self._every = commit_seconds() if every is None else every
        self._settle = settle  # GEO: its unpushed steps pushed (an exact save's flush)
        self._positions: list = []
        self._takes: set = set()
        self._reaches: Dict[tuple, bool] = {}
        self._due = PendingSteps()  # (not GEO) run, not committed yet
        self._last = 0.0

    active: Optional["InputPositionHook"] = None  # the chief's (its saver's listener)

    def begin(self):
        InputPositionHook.active = self
        state = graph_state.peek()
        self._positions = list(state.positions) if state is not None else []
        self._takes = {p.op for p in self._positions}

    def _takes_a_batch(self, fetches) -> bool:
        """Whether running ``fetches`` takes a batch (reaches an iterator's get_next)."""
        graph = tf.compat.v1.get_default_graph()
        roots = []
        for f in tf.nest.flatten(fetches):
            try:
                roots.append(graph.as_graph_element(f))
            except (TypeError, ValueError, KeyError):
                continue
        key = tuple(sorted(r.name for r in roots))
        if key not in self._reaches:
            seen, todo, hit = set(), [r if isinstance(r, tf.Operation) else r.op for r in roots], False
            while todo and not hit:
                op = todo.pop()
                if op in seen:
                    continue
                seen.add(op)
                hit = op in self._takes
                todo += [t.op for t in op.inputs] + list(op.control_inputs)
            self._reaches[key] = hit
        return self._reaches[key]

    def before_run(self, run_context):
        # An input's exact save: this worker's steps committed, it waits while the chief
        # saves (tfpsx.data.splits(exact_saves=True)).
        splits.pause_points(self.flush)
        if self._positions and self._takes_a_batch(run_context.original_args.fetches):
            return tf.compat.v1.train.SessionRunArgs(self._positions)
        return None

    def after_run(self, run_context, run_values):
        if run_values.results is None:
            return
        if self._applied is not None and not self._applied():
            return
        by_tag = splits.inputs_by_tag()
        to = (self._due if self._pending is None or
              (self._in_model is not None and self._in_model()) else self._pending)
        for value in run_values.results:
            tags, keys, ends = decode_numpy(value)
            if len(tags) == 0:
                continue
            name = by_tag.get(int(tags[0]))
            if name is None:
                raise ValueError("a batch's position names no tfpsx.data input of this process")
            to.add(name, keys, ends)
        if time.monotonic() - self._last >= self._every:
            self._commit()

    def _commit(self) -> None:
        self._last = time.monotonic()
        self._due.commit(self._due.take())

    def flush(self) -> None:
        """Commits every run's position now (async, staleness: each run's updates are
        applied by the time it returns; GEO: its unpushed steps pushed first, in a round
        that commits their positions)."""
        if self._settle is not None:
            self._settle()
        self._commit()

    def end(self, session):
        self._commit()

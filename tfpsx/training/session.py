"""``MonitoredTrainingSession``: TF's chief-worker session for a worker of the cluster.

The chief initializes or restores and checkpoints; a non-chief is ready within
~TFPSX_RECOVERY_WAIT of the chief's init (TF's own polls every 30 s); the graph's mode
adds its hooks (GEO's communicator, sync's step, staleness clocks; the worker caches'
final flush).
"""

from __future__ import annotations

import logging
from typing import Optional

import tensorflow as tf

from tfpsx import errors, settings
from tfpsx.checkpoint import IncrementalSaver
from tfpsx.checkpoint.saver import refused_saveables
from tfpsx.runtime import RUNTIME
from tfpsx.training import modes
from tfpsx.training.closing import SessionCloser, closing_stops
from tfpsx.modes.positions import check_feeds_splits, positions_of_graph
from tfpsx.training.hooks import (InputPositionHook, InputPositionListener, ResumeLogHook,
                                  TrainingDoneHook,
                                  InputSummaryHook, WorkerCacheHook,
                                  restore_input_positions,
                                  graph_caches)
from tfpsx.training.staging import graph_stagers

logger = logging.getLogger("tfpsx")


class _FastWorkerSessionCreator(tf.compat.v1.train.WorkerSessionCreator):
    """TF's worker session creator, polling for the chief's init every
    TFPSX_RECOVERY_WAIT seconds instead of every 30; its sessions close as
    :mod:`tfpsx.training.closing` says."""

    def __init__(self, recovery_wait_secs: float, closer: SessionCloser, **kwargs):
        super().__init__(**kwargs)
        self._recovery_wait_secs = recovery_wait_secs
        self._closer = closer

    def _get_session_manager(self):
        if self._session_manager:
            return self._session_manager
        self._session_manager = tf.compat.v1.train.SessionManager(
            local_init_op=self._scaffold.local_init_op,
            local_init_feed_dict=self._scaffold.local_init_feed_dict,
            ready_op=self._scaffold.ready_op,
            ready_for_local_init_op=self._scaffold.ready_for_local_init_op,
            graph=tf.compat.v1.get_default_graph(),
            recovery_wait_secs=self._recovery_wait_secs)
        return self._session_manager

    def create_session(self):
        self._closer.check()  # (an earlier close that failed: TF swallowed its error)
        try:
            return self._closer.wrap(super().create_session())
        except tf.errors.DeadlineExceededError as e:
            raise errors.ClusterTimeoutError(
                f"worker waited {self._max_wait_secs:.0f} s (TFPSX_SESSION_TIMEOUT) for the "
                "chief (worker 0) to initialize or restore the model; is it running?") from e


class _ChiefSessionCreator(tf.compat.v1.train.ChiefSessionCreator):
    """TF's chief session creator, except when it creates the session again.

    TF's ``MonitoredSession`` closes its session on an Aborted or Unavailable error (a
    broken connection to a server, a preempted task) and creates a new one with the same
    creator. TF's chief creator then restores the last checkpoint over the model the
    parameter servers still hold, or, with none, runs the init op: the model trained so
    far is lost (measured: a sync job's global step back to 0 after such an error, and
    the job hung, its workers waiting for a step the chief had started counting again).
    This one takes the model the servers hold when every global variable there is
    initialized: it runs the local init alone and training goes on from the servers'
    step. A server that lost its state (it was started again) has uninitialized
    variables: TF's path then restores or initializes, as on the first start. So the
    check needs a variable on every server: a server holding only table shards (tables
    are made on first use, no variable says they were) keeps TF's path, with a warning.
    The first creation checks too: a chief process started again alone while the servers
    ran on (an orchestrator's restart; ``tfpsx-run`` restarts the whole job) takes their
    model rather than roll it back to the last checkpoint."""

    def __init__(self, servers: int = 0, closer: Optional[SessionCloser] = None, **kwargs):
        super().__init__(**kwargs)
        self._servers = servers
        self._created = False
        self._closer = closer or SessionCloser([])  # (tfpsx.training.closing)

    def create_session(self):
        # Also a chief process started again alone while the servers ran on (an
        # orchestrator's restart): a restore would roll back what every worker trained
        # since the checkpoint (tfpsx-run restarts the whole job instead).
        self._closer.check()  # (an earlier close that failed: TF swallowed its error)
        again = self._created
        self._scaffold.finalize()
        session = self._session_on_the_servers_model(again)
        if session is None:
            # TF's path restores the model of the latest checkpoint: its input positions
            # first (no worker takes a split before the chief's model is ready).
            restore_input_positions(tf.compat.v1.get_default_graph(),
                                    tf.train.latest_checkpoint(self._checkpoint_dir)
                                    if self._checkpoint_dir else None)
            session = super().create_session()
        self._created = True
        return self._closer.wrap(session)

    def _uncovered_servers(self, graph):
        """The servers that hold none of the model's global variables."""
        held = set()
        for v in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES):
            spec = tf.DeviceSpec.from_string(v.device or "")
            if spec.job == "ps" and spec.task is not None:
                held.add(spec.task)
        return sorted(set(range(self._servers)) - held)

    def _session_on_the_servers_model(self, again: bool = True):
        scaffold = self._scaffold
        check = scaffold.ready_for_local_init_op
        if check is None:
            return None
        uncovered = self._uncovered_servers(check.graph)
        if uncovered and not again:
            return None  # (a first start: the servers are new, or cannot be told)
        if uncovered:
            logger.warning(
                "the chief's session is created again after an error; server(s) %s hold none "
                "of the model's variables (only table shards), so whether they lost their "
                "state cannot be told: the model is restored from the last checkpoint, or "
                "initialized anew without one (TF's way)", uncovered)
            return None
        session = tf.compat.v1.Session(self._master, graph=check.graph, config=self._config)
        try:
            missing = session.run(check)
            if missing.size and not again:
                session.close()
                return None  # new servers: TF's path restores or initializes
            if missing.size:
                logger.warning(
                    "the chief's session is created again after an error, and the parameter "
                    "servers lost the model (uninitialized: %s): it is restored from the last "
                    "checkpoint, or initialized anew without one",
                    ", ".join(m.decode() for m in missing[:5]))
                session.close()
                return None
            if scaffold.local_init_op is not None:
                session.run(scaffold.local_init_op, feed_dict=scaffold.local_init_feed_dict)
            if scaffold.ready_op is not None and session.run(scaffold.ready_op).size:
                session.close()
                return None  # (TF's path then says what is not ready)
        except BaseException:
            session.close()
            raise
        if again:
            logger.warning("the chief's session is created again after an error (TF logs it "
                           "at INFO): the parameter servers still hold the model, and "
                           "training goes on from it (no restore, no initialization)")
        else:
            logger.warning("the chief started while the parameter servers already hold the "
                           "job's model (the chief alone was started again): training goes on "
                           "from it, with no restore of the last checkpoint (which would roll "
                           "back what the other workers trained since)")
        return session


class _IncrementalScaffold(tf.compat.v1.train.Scaffold):
    """A Scaffold whose saver is an IncrementalSaver, built when the session is created
    (as TF builds its default saver): by then the modes' hooks have made every table of
    the graph (GEO makes the global tables' ops in its communicator's ``begin``), and a
    saver built earlier would miss them."""

    def __init__(self, full_every: int):
        super().__init__()
        self._full_every = full_every

    def finalize(self):
        if self._saver is None:
            self._saver = IncrementalSaver(full_every=self._full_every, sharded=True,
                                           max_to_keep=5, allow_empty=True)
        return super().finalize()


def MonitoredTrainingSession(checkpoint_dir: Optional[str] = None, hooks=None,  # noqa: N802
                             chief_only_hooks=None, last_step: Optional[int] = None,
                             save_checkpoint_steps=None, save_checkpoint_secs=None,
                             save_summaries_steps=None, scaffold=None,
                             log_step_count_steps: int = 0, session_timeout=None,
                             stop_grace_period_secs: float = 10,
                             incremental_checkpoints: Optional[int] = None):
    """TF's ``MonitoredTrainingSession`` for this worker of the tfpsx cluster.

    The chief (worker 0) initializes, or restores from ``checkpoint_dir`` on a restart
    (``global_step`` continues), saves checkpoints (every ``save_checkpoint_steps`` or
    ``save_checkpoint_secs``; TF's default of 600 s when neither is set) and summaries.
    A non-chief started before the chief's init is ready within ~TFPSX_RECOVERY_WAIT
    (0.25 s) of it and raises ``ClusterTimeoutError`` after ``session_timeout``
    (TFPSX_SESSION_TIMEOUT, 600 s). tfpsx's own hooks (the GEO communicator) and a
    ``StopAtStepHook(last_step)`` are added. Master, ``is_chief`` and the session config
    (device filters) come from the resolved cluster.

    In a collective job (``DistributedStrategy(collective=True)``) every rank initializes
    its own variables and takes rank 0's when the session starts; rank 0 alone restores
    and saves ``checkpoint_dir``.

    ``incremental_checkpoints=M``: tables are saved as a full export every M checkpoints
    and as deltas (rows written and keys removed since the previous one) in between,
    through :class:`tfpsx.checkpoint.IncrementalSaver`; restore applies the chain. Needs
    ``checkpoint_dir``; a ``scaffold`` of your own then carries that saver itself.

    With ``checkpoint_dir`` the chief marks training done there when its session ends
    (after the final checkpoint): an evaluator task's ``tfpsx.evaluate_checkpoints``
    returns once it evaluated that checkpoint.
    """
    config = RUNTIME.require_role("MonitoredTrainingSession", "worker")
    if incremental_checkpoints is not None:
        every = settings.parse_int(incremental_checkpoints,
                                   "MonitoredTrainingSession(incremental_checkpoints=...)",
                                   minimum=1)
        if checkpoint_dir is None:
            raise ValueError("MonitoredTrainingSession(incremental_checkpoints="
                             f"{incremental_checkpoints!r}) needs checkpoint_dir")
        if scaffold is not None:
            raise ValueError("MonitoredTrainingSession(incremental_checkpoints=...) with a "
                             "scaffold: build it with saver=tfpsx.checkpoint.IncrementalSaver("
                             "full_every=M) instead")
        if config.is_chief:  # only the chief saves and restores
            scaffold = _IncrementalScaffold(every)
    elif checkpoint_dir is not None and scaffold is None:
        whole = refused_saveables(tf.compat.v1.get_default_graph())
        if whole:
            # TF's Saver would take them whole at every checkpoint: refused now, before
            # a session starts, rather than at the first save.
            raise ValueError(
                f"MonitoredTrainingSession(checkpoint_dir=...): table(s) {whole} have a disk "
                "tier (TieredBackend), which TF's own Saver would take whole at every "
                "checkpoint, several times the table's size in RAM; give "
                "incremental_checkpoints=M (tables saved page by page, a full export every M "
                "checkpoints), or build the model within "
                "tfpsx.embedding.whole_table_saves() for tables that fit in RAM")
    mode = modes.mode_of()
    each_initializes = bool(mode and mode.EACH_WORKER_INITIALIZES)
    if each_initializes and not config.is_chief:
        # Each rank initializes its own variables; rank 0's (restored ones included) reach
        # the others by the mode's broadcast (collective, hybrid). Rank 0 alone saves.
        checkpoint_dir = None
    own = mode.hooks() if mode else []
    if positions_of_graph():  # the graph reads tfpsx.data.splits: its commits
        check_feeds_splits(mode)
        commits = InputPositionHook(getattr(mode, "positions", None),
                                    applied=getattr(mode, "last_run_applied", None),
                                    settle=getattr(mode, "settle_for_save", None),
                                    in_model=getattr(mode, "step_in_model", None))
        if getattr(mode, "COMMITS_AFTER_HOOKS", False):  # (sync: once the step is applied)
            own.append(commits)
        else:
            own.insert(0, commits)
    own += graph_stagers()  # they finish their stagings before the caches' final flush
    if graph_caches():
        own.append(WorkerCacheHook())
    return _monitored_session(config, each_initializes, checkpoint_dir, list(hooks or []), own,
                              chief_only_hooks, last_step,
                              save_checkpoint_steps, save_checkpoint_secs,
                              save_summaries_steps, scaffold, log_step_count_steps,
                              session_timeout, stop_grace_period_secs)


def _monitored_session(config, each_initializes, checkpoint_dir, hooks, own, chief_only_hooks, last_step,
                       save_checkpoint_steps, save_checkpoint_secs, save_summaries_steps,
                       scaffold, log_step_count_steps, session_timeout, stop_grace_period_secs):
    if last_step is not None:
        hooks.append(tf.compat.v1.train.StopAtStepHook(last_step=last_step))
    master = RUNTIME.server_target()
    session_config = RUNTIME.session_config()
    closer = SessionCloser(closing_stops(own, reads_splits=bool(positions_of_graph())))
    if not config.is_chief and not each_initializes:
        timeout = settings.get("TFPSX_SESSION_TIMEOUT", session_timeout)
        creator = _FastWorkerSessionCreator(
            settings.get("TFPSX_RECOVERY_WAIT"), closer=closer, scaffold=scaffold,
            master=master, config=session_config, max_wait_secs=timeout)
        return tf.compat.v1.train.MonitoredSession(
            session_creator=creator, hooks=hooks + own,
            stop_grace_period_secs=stop_grace_period_secs)
    # TF ends hooks in list order: chief-only ones, its checkpoint saver, then `hooks`.
    # tfpsx's own (GEO's last push, the stagers', the caches' final flush) end before the
    # saver's final save, so the last checkpoint holds every local step (measured before:
    # a GEO chief's final checkpoint missed the steps since its last round).
    chief_hooks = own + list(chief_only_hooks or [])
    if config.is_chief:  # (a collective rank > 0 restores nothing: rank 0's broadcast)
        chief_hooks.append(ResumeLogHook(checkpoint_dir))
    if checkpoint_dir is not None:
        # Among `hooks`, which TF ends after its checkpoint saver's final save.
        hooks = hooks + [TrainingDoneHook(checkpoint_dir)]
    # TF's MonitoredTrainingSession for a chief, with tfpsx's session creator.
    scaffold = scaffold or tf.compat.v1.train.Scaffold()
    creator = _ChiefSessionCreator(servers=config.server_num, closer=closer, scaffold=scaffold,
                                   checkpoint_dir=checkpoint_dir, master=master,
                                   config=session_config)
    return tf.compat.v1.train.MonitoredSession(
        session_creator=creator,
        hooks=chief_hooks + _saver_hooks(checkpoint_dir, scaffold, log_step_count_steps,
                                         save_checkpoint_steps, save_checkpoint_secs,
                                         save_summaries_steps) + hooks,
        stop_grace_period_secs=stop_grace_period_secs)


def _saver_hooks(checkpoint_dir, scaffold, log_step_count_steps, save_checkpoint_steps,
                 save_checkpoint_secs, save_summaries_steps):
    """The hooks TF's MonitoredTrainingSession gives a chief, with its defaults: summaries
    every 100 steps and a checkpoint every 600 s unless either is set; none without
    ``checkpoint_dir``."""
    if not checkpoint_dir:
        return []
    train = tf.compat.v1.train
    if save_summaries_steps is None:
        save_summaries_steps = 100
    if save_checkpoint_steps is None and save_checkpoint_secs is None:
        save_checkpoint_secs = 600
    hooks = []
    if log_step_count_steps and log_step_count_steps > 0:
        hooks.append(train.StepCounterHook(output_dir=checkpoint_dir,
                                           every_n_steps=log_step_count_steps))
    if save_summaries_steps > 0:
        hooks.append(train.SummarySaverHook(scaffold=scaffold, save_steps=save_summaries_steps,
                                            output_dir=checkpoint_dir))
        if positions_of_graph():  # the graph reads tfpsx.data.splits: its input's scalars
            hooks.append(InputSummaryHook(checkpoint_dir, save_summaries_steps))
    if (save_checkpoint_secs or 0) > 0 or (save_checkpoint_steps or 0) > 0:
        hooks.append(train.CheckpointSaverHook(checkpoint_dir, save_steps=save_checkpoint_steps,
                                               save_secs=save_checkpoint_secs,
                                               scaffold=scaffold,
                                               listeners=[InputPositionListener()]))
    return hooks

"""``tfpsx.keras.ParameterServerStrategy``: Keras 3 ``model.fit`` on a tfpsx cluster.

Keras 3 has no parameter-server training (``fit`` under TF's ParameterServerStrategy
fails). Here every worker runs its own ``fit``: the strategy connects this worker's eager
context to the parameter servers (a sparse cluster spec: the PS tasks and this worker
only; two clients whose specs list each other hang), and is a one-replica
``tf.distribute`` strategy whose hooks hand each decision to the mode
(:mod:`tfpsx.keras.modes`): where each variable Keras creates lives (its
``_create_variable``), where the optimizer's update runs (``_update``), how gradients are
reduced across workers (``_batch_reduce_to``), what follows every training step (around
the step function) and what happens around ``fit`` (the callback it supplies,
:mod:`tfpsx.keras.fit`). Keras itself is not changed: a model built outside the scope
trains as Keras trains it.

Example::

  tfpsx.init(); tfpsx.init_worker()
  strategy = tfpsx.keras.ParameterServerStrategy(
      tfpsx.DistributedStrategy(a_sync=True, a_sync_configs={"k_steps": 100}))   # GEO
  with strategy.scope():
      model = build_model()                     # any Keras 3 model
      model.compile(optimizer="adam", loss="binary_crossentropy")
  model.fit(tfpsx.data.shard(dataset).batch(256), epochs=3,
            callbacks=strategy.callbacks())
  tfpsx.stop_worker()
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from typing import Optional

import keras
import tensorflow as tf

from tfpsx import compat, errors, settings
from tfpsx.compat import OneDeviceExtended, distribute_lib
from tfpsx.control import eager_anchor
from tfpsx.control import splits
from tfpsx.control.splits import split_position
from tfpsx.control.watchdog import (RETRYABLE, exit_if_uncaught, find_in_chain, lost_server,
                                    probe, translate_uncaught)
from tfpsx.embedding.cache import flush_eager_caches
from tfpsx.embedding.updaters import updater_scope
from tfpsx.keras import fit
from tfpsx.keras.feeding import RowFeeder
from tfpsx.keras.modes import mode_class
from tfpsx.modes.group import refuse_a_late_join
from tfpsx.modes.positions import COMMITS, check_feeds_splits
from tfpsx.keras.modes.base import CreationContext
from tfpsx.keras.partitioned import resolve_partitioner
from tfpsx.runtime import RUNTIME
from tfpsx.modes.strategy import DistributedStrategy

logger = logging.getLogger("tfpsx")

_NOT_JOINED = (
    "tfpsx.keras.ParameterServerStrategy: this training step runs in a fit() the strategy "
    "was not joined to, so its mode cannot start or end (GEO's sync, sync's group, the "
    "chief's model): call model.fit(..., callbacks=strategy.callbacks())")

_KINDS = ((keras.optimizers.Optimizer, "optimizer"), (keras.metrics.Metric, "metric"),
          (keras.layers.Layer, "layer"), (keras.random.SeedGenerator, "seed"))


def creation_context(kwargs) -> CreationContext:
    """What Keras is creating, read off the Keras name scopes open around it: the
    variable's path (the scopes' path and its name, as ``keras.Variable.path``) and the
    innermost Keras object that opened one (the layer, optimizer, metric or seed
    generator that asked). Keras passes ``tf.Variable`` only a short ``name``, not unique
    in a model (two ``kernel`` s)."""
    name = kwargs.get("name")
    name = name if isinstance(name, str) and name else None
    prefix = compat.keras_current_path()
    path = None if name is None else (f"{prefix}/{name}" if prefix else name)
    for owner in reversed(compat.keras_name_scopes()):
        for cls, kind in _KINDS:
            if isinstance(owner, cls):
                return CreationContext(path, name, kind, owner)
    return CreationContext(path, name, "other", None)


def built_outside(name: str) -> str:
    """The error for a model weight made outside the strategy's scope."""
    return (f"model weight {name!r} was created outside tfpsx.keras.ParameterServerStrategy."
            "scope(): it is not placed by the strategy (it would train on this worker alone, "
            "not on the parameter servers). A subclassed model creates its weights at its "
            "first call: build it inside `with strategy.scope():` (call it on a batch, or "
            "model.build(input_shape)), then compile it there")


class _Extended(OneDeviceExtended):
    """One replica on this worker; every placement and update decision is the mode's."""

    def __init__(self, container, device: str, mode):
        super().__init__(container, device)
        self._owner = weakref.ref(container)
        self.mode = mode
        self._trained = False  # the step being traced updated variables (a training step)
        self.feeds_splits = False  # a traced training step took an input position
        self._guard = None  # the step being traced: its fit check
        # Every variable made in the strategy's scope, by id (TF variables are not
        # hashable), held weakly.
        self._created: dict = {}

    # ------------------------------------------------------------------ variables
    def _create_variable(self, next_creator, **kwargs):
        var = self.mode.create_variable(self, next_creator, kwargs, creation_context(kwargs))
        key, created = id(var), self._created
        try:
            created[key] = weakref.ref(var, lambda _, key=key: created.pop(key, None))
        except TypeError:  # not weak-referable: kept
            created[key] = lambda var=var: var
        return var

    def created_here(self, var) -> bool:
        """``var`` (a tf variable, or a Keras one's ``value``) was made in this
        strategy's scope: placed by its mode."""
        var = getattr(var, "value", var)
        ref = self._created.get(id(var))
        return ref is not None and ref() is var

    def _validate_colocate_with_variable(self, colocate_with_variable):
        # An optimizer's slots go beside their variable; TF's own message for a variable
        # made elsewhere names none of what to do (and TF 2.16's raised AttributeError
        # for one made outside any strategy: its check read None's `extended`).
        name = getattr(colocate_with_variable, "name", "?")
        if getattr(colocate_with_variable, "_distribute_strategy", None) is None:
            raise ValueError(built_outside(name))
        try:
            super()._validate_colocate_with_variable(colocate_with_variable)
        except ValueError as e:
            raise ValueError(built_outside(name)) from e

    def create_local(self, next_creator, kwargs):
        """An ordinary variable on this worker (OneDevice's placement)."""
        return super()._create_variable(next_creator, **kwargs)

    # ------------------------------------------------------------------ updates
    def _update(self, var, fn, args, kwargs, group):
        self._trained = True
        with tf.control_dependencies(self._fit_guard()):
            return self.mode.update(self, var, fn, args, kwargs, group)

    def update_on(self, device: str, var, fn, args, kwargs, group):
        """``fn(var, *args)`` on ``device`` (OneDevice runs every update on the worker)."""
        with tf.device(device), distribute_lib.UpdateContext(device):
            result = fn(var, *args, **(kwargs or {}))
            return result if group else tf.nest.map_structure(self._local_results, result)

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        self._trained = True
        with tf.control_dependencies(self._fit_guard()):
            return self.mode.reduce(self, reduce_op, value_destination_pairs, options)

    def _fit_guard(self) -> list:
        """The training step's first state change waits on this check: a step that
        trains belongs to a ``fit`` joined by ``strategy.callbacks()`` (checked when the
        step is traced, and when it runs: Keras reuses a traced step in a later fit)."""
        if self._guard is None:
            self._guard = self._owner().fit_guard()
        return [self._guard]

    # ------------------------------------------------------------------ steps
    def _call_for_each_replica(self, fn, args, kwargs):
        def step(*step_args, **step_kwargs):
            self._trained, self._guard = False, None
            self.mode.take_trace_ops()  # leftovers of an earlier trace are not this step's
            # A batch of tfpsx.data.splits carries its input position: the model never
            # sees it; the mode commits it once the step is in the model.
            position = None
            if step_args:
                data, position = split_position(step_args[0])
                step_args = (data,) + tuple(step_args[1:])
            # (Ordered before the step's reads of the same variables by the function's
            # automatic control dependencies.)
            self.mode.before_step()
            outputs = fn(*step_args, **step_kwargs)
            if not self._trained:
                return outputs  # an eval or predict step
            after = self.mode.after_step()
            if position is not None:
                check_feeds_splits(self.mode)
                self.feeds_splits = True
                with tf.control_dependencies(after):
                    after = after + [self.mode.commit_position(position)]
            with tf.control_dependencies(after):
                return tf.nest.map_structure(
                    lambda t: tf.identity(t) if isinstance(t, tf.Tensor) else t, outputs)

        return super()._call_for_each_replica(step, args, kwargs)


class ParameterServerStrategy(tf.distribute.OneDeviceStrategy):
    """Keras 3 ``fit`` on a tfpsx cluster, in the mode of a ``tfpsx.DistributedStrategy``.

    Create it on a worker after ``tfpsx.init()`` and ``tfpsx.init_worker()``; build *and
    compile* the model inside ``scope()``; give ``fit`` the strategy's callbacks
    (``callbacks=strategy.callbacks()``, beside your own); then ``fit``, ``evaluate`` and
    ``predict`` run as Keras runs them (callbacks, validation data, the progress bar,
    ``steps_per_execution``).

    * async: weights, optimizer slots and ``optimizer.iterations`` live on the PS; each
      worker's update runs there; every step reads the current global values.
    * sync (``a_sync=False``): the chief applies each step's average of
      ``replicas_to_aggregate`` workers' gradients (one from each), once.
    * GEO (``k_steps=K``): local training, a push/pull every K local steps in a background
      thread (in the step with ``geo_sync_in_train_thread=True``), a final sync at the end
      of ``fit``.
    * bounded staleness (``max_staleness=S``): async, no worker more than S steps ahead.

    ``optimizer.iterations`` is the job's global step in every mode (async and staleness:
    every worker's steps; sync: aggregated steps; GEO: every worker's local steps, as they
    are pushed). Only the chief initializes global values; the others wait for it (a
    chief that restores with ``load_weights`` before ``fit`` publishes the restored model).
    ``DynamicEmbedding`` layers built in the scope use PS-sharded tables trained in the
    same mode.

    Model weights of 256 KiB or more are partitioned along axis 0 over the parameter
    servers (at most one slice per PS; :mod:`tfpsx.keras.partitioned`).

    Args:
      strategy: the mode (default: async).
      variable_partitioner: how large weights are cut: ``"auto"`` (slices of at least
        256 KiB, at most one per PS), ``None`` (every variable whole on one PS), or TF's
        ``tf.distribute.experimental.partitioners`` (``MinSizePartitioner``,
        ``MaxSizePartitioner``, ``FixedShardsPartitioner``) or any callable
        ``(shape, dtype) -> partitions per axis`` (axis 0 only).

    Raises:
      NotInitializedError / WrongRoleError: created before ``tfpsx.init()``, or not on a
        worker.
      ValueError: options the cluster cannot run (e.g. sync's replicas_to_aggregate).
    """

    def __init__(self, strategy: Optional[DistributedStrategy] = None,
                 variable_partitioner="auto"):
        config = RUNTIME.require_role("keras.ParameterServerStrategy", "worker")
        if not RUNTIME.worker_started:
            raise RuntimeError("tfpsx.keras.ParameterServerStrategy() needs "
                               "tfpsx.init_worker() first (it waits for the servers)")
        if config.collective:
            raise ValueError("tfpsx.keras.ParameterServerStrategy() in a collective job "
                             "(tfpsx.init(is_collective=True): no parameter servers); use "
                             "tfpsx.keras.CollectiveStrategy()")
        options = strategy or DistributedStrategy()
        if not isinstance(options, DistributedStrategy):
            raise ValueError("tfpsx.keras.ParameterServerStrategy: strategy must be a "
                             f"tfpsx.DistributedStrategy, got {type(options).__name__}")
        self.variable_partitioner = resolve_partitioner(variable_partitioner,
                                                        config.server_num)
        _connect(config)
        refuse_a_late_join(options, config)
        mode = mode_class(options, config)(self, options, config)
        distribute_lib.Strategy.__init__(self, _Extended(self, mode.worker_device, mode))
        self.options, self._mode = options, mode
        self._pending: Optional[BaseException] = None
        self._fitting = False
        self._feeder = RowFeeder()  # stages fit's batches into worker caches
        with tf.device(mode.worker_device):  # 1 while a fit joined by callbacks() runs
            self._fit_flag = tf.Variable(0, dtype=tf.int32, trainable=False,
                                         name="tfpsx_fit_joined")

    @property
    def mode(self) -> str:
        """"async", "sync", "geo", "staleness" or "hybrid"."""
        return self._mode.NAME

    @property
    def counters(self):
        """GEO's counters (pushes, rows and bytes sent / received, seconds syncing)."""
        return getattr(self._mode, "counters", None)

    @property
    def staleness_waits(self) -> int:
        """Bounded staleness: the steps this worker had to wait for the slowest."""
        return getattr(self._mode, "waits", 0)

    def experimental_distribute_dataset(self, dataset, options=None):
        """The dataset itself: one replica on this worker's CPU has nothing to distribute,
        and tf.distribute's prefetch-to-device iterator halved the examples/s of a step
        in a process connected to a cluster (measured). Its batches pass a staging step
        that feeds the worker caches while a ``fit`` runs (:mod:`tfpsx.keras.feeding`).

        Keras calls this when ``fit``, ``evaluate`` and ``predict`` start: outside a
        ``fit``, it is where an evaluation begins (:meth:`before_inference`); a
        validation inside ``fit`` is not staged."""
        if self._fitting:
            return dataset
        for source in splits.registered().values():  # (Keras looks at a batch first)
            source.keras_will_look()
        self.before_inference(None)
        dataset = self._mode.wrap_input(dataset)
        return self._feeder.wrap(dataset) if self._mode.supports_cache else dataset

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        return dataset_fn(tf.distribute.InputContext())

    def scope(self):
        """Variables created inside are placed by the mode; ``DynamicEmbedding`` layers
        built inside train in it."""
        stack = contextlib.ExitStack()
        stack.enter_context(super().scope())
        stack.enter_context(updater_scope(self._mode.table_updater))
        return stack

    def __repr__(self):
        return f"tfpsx.keras.ParameterServerStrategy({self.options!r})"

    # ------------------------------------------------------------------ around fit
    def flush_for_save(self) -> None:
        """An exact save's barrier (``tfpsx.data.splits(exact_saves=True)``), at this
        worker's step boundary: its steps' ops done, every step in the model (GEO: its
        unpushed local steps pushed in a round, ``settle_for_save``) and their input
        positions committed."""
        compat.async_wait()
        settle = getattr(self._mode, "settle_for_save", None)
        if settle is not None:
            settle()
        fit.flush_commits()

    def job_value(self, variable):
        """``variable``'s value in the job's model (GEO: the global value of a model
        weight, a tensor, not this worker's copy; what a checkpoint saves); else the
        variable itself."""
        of_mode = getattr(self._mode, "job_value", None)
        value = of_mode(variable) if of_mode is not None else None
        return variable if value is None else value

    @property
    def is_chief(self) -> bool:
        """This worker is the chief (it initializes, restores and checkpoints)."""
        return self._mode.is_chief

    def servers_hold_model(self) -> bool:
        """The parameter servers hold a job's model already (a chief's ``fit`` started on
        them): a restore into them would roll back what the workers trained since the
        checkpoint. False on new servers."""
        return self._mode.servers_hold_model()

    def callbacks(self) -> list:
        """What ``fit`` needs to train in this strategy's mode:
        ``model.fit(..., callbacks=strategy.callbacks())`` (add your own beside them).
        ``evaluate`` and ``predict`` need none."""
        return [fit.StrategyCallback(self)]

    def fit_guard(self):
        """A training step's check that it runs in a joined ``fit`` (see
        :meth:`callbacks`): a ValueError when traced outside one, an error when run
        outside one (a step traced by an earlier fit)."""
        if not self._fitting:
            raise ValueError(_NOT_JOINED)
        return tf.debugging.assert_equal(self._fit_flag.read_value(), 1, message=_NOT_JOINED)

    def begin_fit(self, model, epoch_steps: Optional[int] = None) -> None:
        """``fit`` starts (the callback's ``on_train_begin``); ``epoch_steps``: the local
        steps in one of its epochs (None: unknown)."""
        self.check_model(model)
        self._mode.fit_length(epoch_steps)
        self._mode.begin_fit(model)
        self._feeder.begin(model)
        for source in splits.registered().values():  # (Keras's look at a batch read some)
            source.fit_begins()
        self._fitting = True
        self._fit_flag.assign(1)

    def batch_end(self, model, steps_left: Optional[int] = None) -> None:
        """An execution of the train function ended (``steps_per_execution`` steps);
        ``steps_left``: the steps this ``fit`` still runs (None: unknown)."""
        self._mode.batch_end(model, steps_left)

    def steps_stale(self) -> bool:
        """Whether the model's step functions must be traced again before its next step
        (the mode's state changed: GEO's choice between rounds and async, table by
        table); checking clears it."""
        return self._mode.steps_stale()

    def end_fit(self, model, failed: bool = False) -> None:
        """``fit`` ended (``failed``: a step raised; the mode ends all the same)."""
        if not failed:
            try:
                self.translating(self._mode.finish_fit, model)
            except BaseException:
                self.end_fit(model, failed=True)
                raise
        self._fitting = False
        self._fit_flag.assign(0)
        try:
            self._feeder.end(wait=not failed)
            self._mode.end_fit(model)
            if splits.registered():  # its trained steps' positions, before it leaves
                self._commit_due(failed)
            for source in splits.registered().values():
                source.fit_ends()
            if not failed:
                flush_eager_caches()  # async / staleness tables' caches (GEO's synced in end_fit)
        finally:
            self._mode.after_fit(model, failed)

    def _commit_due(self, failed: bool) -> None:
        """Commits the positions of this ``fit``'s last steps (they trained: their
        updates are in). After a failed ``fit`` a failure here is only logged (the
        servers may be the reason it failed): those steps are trained again."""
        try:
            self.translating(COMMITS.flush)
        except Exception as e:  # noqa: BLE001 — see the docstring
            if not failed:
                raise
            logger.warning("the input positions of this worker's last steps were not "
                           "committed (%s): a restart trains those steps again", e)

    def check_model(self, model) -> None:
        optimizer = getattr(model, "optimizer", None)
        if optimizer is None:
            raise ValueError("compile the model (inside strategy.scope()) before fit()")
        if getattr(optimizer, "_distribution_strategy", None) is not self:
            raise ValueError(
                "the model was compiled outside tfpsx.keras.ParameterServerStrategy.scope(): "
                "build *and* compile it inside `with strategy.scope():` (the optimizer's "
                "variables are placed when it is created)")
        for weight in model.weights:
            if not self.extended.created_here(weight):
                raise ValueError(built_outside(getattr(weight, "path", weight.name)))
        if getattr(model, "jit_compile", False) is True:
            raise ValueError(
                "jit_compile=True cannot work with tfpsx.keras.ParameterServerStrategy: XLA "
                "cannot reach variables on parameter servers; compile with jit_compile=False "
                "(the default 'auto' already is False under a strategy)")
        self._mode.check_model(model)

    def before_inference(self, model) -> None:
        """What ``evaluate`` / ``predict`` do first: a non-chief waits for the chief's
        model; in GEO, outside ``fit``, this worker's copy takes the global model. A
        serving export (``tfpsx.export_serving``) calls it to write what ``predict`` uses."""
        self._mode.begin_eval(model)

    def reporting(self, fn):
        """``fn`` for a ``tf.py_function`` inside a step: a tfpsx error it raises (a bounded
        wait that ran out) aborts the step as a TF error and is re-raised, as itself,
        by :meth:`translating`."""
        @functools.wraps(fn)
        def run(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except (errors.ClusterTimeoutError, errors.ServerUnavailableError,
                    errors.PeerUnavailableError, errors.BackgroundTaskError) as e:
                self._pending = e
                raise tf.errors.AbortedError(None, None, f"{type(e).__name__}: {e}") from e

        return run

    def translating(self, step, *args, **kwargs):
        """``step(*args)`` (a Keras train or test function), its failures made tfpsx's: a
        tfpsx error raised inside comes out as itself, a lost server is named."""
        self._pending = None
        try:
            return step(*args, **kwargs)
        except tf.errors.OutOfRangeError:
            raise
        except tf.errors.OpError as e:
            pending, self._pending = self._pending, None
            if pending is not None:
                if isinstance(pending, RETRYABLE):
                    exit_if_uncaught()  # a lost peer: the code a restart policy retries
                raise pending from e
            self._raise_if_server_lost(e)
            staging = self._feeder.take_failure()  # fit's input pipeline lost a server
            if staging is not None:
                self._raise_if_server_lost(staging)
            raise
        except errors.BackgroundTaskError as e:
            self._raise_if_server_lost(e)
            raise

    def _raise_if_server_lost(self, error: BaseException) -> None:
        lost = server_lost_error(error)
        if lost is None:
            return
        exit_if_uncaught()  # the job is over for this worker: no hang in TF's teardown
        raise lost from error


def server_lost_error(error: BaseException) -> Optional[errors.ServerUnavailableError]:
    """The ``ServerUnavailableError`` naming the server an ``UnavailableError`` (``error``
    or one that caused it) lost, or None when there is none. A Keras worker's eager
    context reaches the PS tasks only: an unavailable peer is one of them."""
    if isinstance(error, errors.ServerUnavailableError):
        return None
    unavailable = find_in_chain(error, tf.errors.UnavailableError)
    if unavailable is None:
        return None
    config = RUNTIME.require("keras")
    lost = lost_server(unavailable, config.servers)
    if lost is None:  # the message does not say ("recvmsg:Connection reset by peer"): ask
        lost = next(((rank, address) for rank, address in enumerate(config.servers)
                     if not probe(address, timeout=2.0)), None)
    server = f"server {lost[0]} at {lost[1]}" if lost else "a parameter server"
    lines = [line.strip() for line in str(unavailable).splitlines()
             if line.strip() and "execution error" not in line and "root error" not in line]
    first = (lines or ["unavailable"])[0][:300]
    return errors.ServerUnavailableError(
        f"worker {config.index}: fit() lost {server} ({first}); the job cannot go on "
        "without it (its share of the variables and tables is gone): restart it from "
        "the last checkpoint")


def _connect(config) -> None:
    """Connects this process's eager context to the PS tasks (once per process: TF
    cannot disconnect it; ``RUNTIME.eager_connection`` records it)."""
    job, task = config.job_name, config.task_index
    key = (job, task, tuple(config.servers), config.task_address())
    if RUNTIME.eager_connection == key:
        return
    if RUNTIME.eager_connection is not None:
        raise RuntimeError(f"this process is connected to another cluster already "
                           f"({RUNTIME.eager_connection}); one tfpsx cluster per process")
    if RUNTIME.has_graph_server:
        raise RuntimeError(
            "this worker started a tf.distribute.Server for graph-mode sessions "
            "(tfpsx.server_target()); Keras training connects the eager context to the "
            "cluster instead, on the same address: use one of them per process")
    # A sparse spec (the PS tasks and this worker only): two clients whose specs list
    # each other hang (measured). A dict keeps this task's index in a sparse job.
    spec = tf.train.ClusterSpec({"ps": list(config.servers), job: {task: config.task_address()}})
    eager_anchor.connect(spec, job, task, {f"ps:{i}": a for i, a in enumerate(config.servers)},
                         settings.get("TFPSX_CONNECT_TIMEOUT"),
                         log=lambda m: logger.info("worker %d %s", config.index, m),
                         port=settings.get("TFPSX_LISTEN_PORT"))
    RUNTIME.eager_connection = key
    # A server lost where no step can catch it (Keras's own wait at an epoch's end) is
    # still named, and the process still exits to be restarted.
    translate_uncaught(server_lost_error)

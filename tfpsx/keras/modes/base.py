"""The Keras side of a training mode: what the strategy asks of it.

A Keras mode decides, for one worker's Keras 3 ``fit``:

* ``create_variable``: where each variable Keras creates lives (a shared resource on a
  parameter server, this worker, or both, as GEO's local copy and global value);
* ``update`` / ``reduce``: how the optimizer's per-variable update and gradient
  all-reduce run (on the PS; only on the chief; across workers);
* ``before_step`` / ``after_step``: ops at the start of every step (refreshing the views
  of partitioned variables) and appended to every training step inside the compiled
  function (GEO's step count, staleness clocks, sync's wait for the step);
* ``table_updater``: how a ``DynamicEmbedding`` layer built in the scope trains;
* ``begin_fit`` / ``batch_end`` / ``end_fit``: what happens around ``fit`` in Python
  (waiting for the chief's initialization, GEO's communicator and final sync), from the
  callback the strategy supplies; ``begin_eval`` before ``evaluate`` / ``predict``.

The protocols themselves are :mod:`tfpsx.modes`, shared with graph mode: the
same GEO rule and rounds, sync step protocol and staleness clocks.
"""

from __future__ import annotations

from typing import List, Optional

import tensorflow as tf

from tfpsx import errors, settings
from tfpsx.cluster.placement import GreedyByBytes
from tfpsx.embedding.updaters import TableUpdater
from tfpsx.keras.partitioned import PartitionedVariable, partitions, slice_rows
from tfpsx.modes.positions import COMMITS
from tfpsx.keras.variables import SharedVariable, initialize
from tfpsx.modes.state import State
from tfpsx.runtime import RUNTIME
from tfpsx.waits import bounded_wait

SHARED_PREFIX = "tfpsx/keras/"
TRIGGER = "tfpsx_gradient_trigger"  # the name of a DynamicEmbedding layer's trigger weight


class KerasStateFactory:
    """Keras's :class:`~tfpsx.modes.state.StateFactory`: a protocol variable is a
    :class:`SharedVariable` under its core name on PS 0, the chief initializes it and the
    others wait for it (TFPSX_SESSION_TIMEOUT); a worker's own is a ``tf.Variable``.
    ``created`` lists the shared names made, in order."""

    def __init__(self, mode: "KerasMode"):
        self._mode = mode
        self.created: List[str] = []

    def shared(self, state: State, workers: int) -> SharedVariable:
        mode, shape = self._mode, state.shape(workers)
        var = SharedVariable(shared_name=state.name, shape=shape, dtype=tf.int64,
                             device=mode.ps_devices[0], trainable=False, name=state.name)
        initialize(var, tf.zeros(shape, tf.int64), mode.is_chief,
                   settings.get("TFPSX_SESSION_TIMEOUT"))
        self.created.append(state.name)
        return var

    def local(self, name: str, initial):
        with tf.init_scope(), tf.device(self._mode.worker_device):
            return tf.Variable(initial(), trainable=False, name=name)


class CreationContext:
    """What Keras is creating: the variable's ``path`` and ``name`` (as its
    ``keras.Variable`` has them; None when unnamed) and the kind of object that asked for
    it ("layer", "optimizer", "metric", "seed" or "other")."""

    def __init__(self, path: Optional[str], name: Optional[str], kind: str, owner):
        self.path, self.name, self.kind, self.owner = path, name, kind, owner

    def is_model_weight(self, kwargs) -> bool:
        """A trainable weight of a layer (a DynamicEmbedding's gradient trigger aside)."""
        return (self.kind == "layer" and bool(kwargs.get("trainable", True))
                and self.path is not None and self.name != TRIGGER)

    def is_slot(self, kwargs) -> bool:
        """An optimizer variable made from a model variable (momentum, Adam's m and v)."""
        return self.kind == "optimizer" and kwargs.get("colocate_with") is not None

    def is_iterations(self) -> bool:
        return self.kind == "optimizer" and self.name == "iteration"


class KerasMode:
    """Base: nothing shared, every variable on this worker, updates where the variable is."""
    NAME = ""
    supports_cache = True  # its tables may have worker caches (fed by fit's batches)

    def __init__(self, keras_strategy, options, config):
        # keras_strategy: the tfpsx.keras.ParameterServerStrategy; options: its
        # tfpsx.DistributedStrategy.
        self.keras_strategy, self.options, self.config = keras_strategy, options, config
        self.is_chief = config.is_chief
        self.worker_index, self.worker_num = config.index, config.worker_num
        self.worker_device = (f"/job:{config.job_name}/replica:0/task:{config.task_index}"
                              "/device:CPU:0")
        self.ps_devices = [f"/job:ps/replica:0/task:{i}/device:CPU:0"
                           for i in range(config.server_num)]
        self._placer = GreedyByBytes(len(self.ps_devices))
        self._trace_ops: List = []   # stateful ops of the step being traced
        self._ready: Optional[SharedVariable] = None
        self.state = KerasStateFactory(self)  # the protocol's variables (tfpsx.modes.state)
        self.validate()

    # ------------------------------------------------------------------ interface
    def validate(self) -> None:
        """Raises ValueError when the cluster or the options do not fit the mode."""

    def check_model(self, model) -> None:
        """Raises ValueError for a compiled model this mode cannot train."""

    def create_variable(self, extended, next_creator, kwargs, ctx: CreationContext):
        return extended.create_local(next_creator, kwargs)

    def update(self, extended, var, fn, args, kwargs, group):
        return extended.update_on(self.worker_device, var, fn, args, kwargs, group)

    def applied(self, var):
        """A read of ``var`` ordered after the update just built (Keras's update functions
        return nothing to wait on; in a tf.function the reads and writes of one variable
        run in program order), for ``after_step`` to wait on."""
        return self.record(var.read_value())

    def reduce(self, extended, reduce_op, value_destination_pairs, options):
        return [value for value, _ in value_destination_pairs]

    def before_step(self) -> list:
        """Ops to run first in every step (training, evaluation, prediction)."""
        return []

    def after_step(self) -> list:
        """Ops to run after each training step (inside the compiled step)."""
        return []

    def table_updater(self, table) -> TableUpdater:
        return TableUpdater()

    def commit_position(self, position):
        """The op handing a trained batch's input position (tfpsx.data.splits) to this
        process's commits (every TFPSX_INPUT_COMMIT_SECONDS,
        :data:`tfpsx.modes.positions.COMMITS`), after the step's ``after_step`` ops: the
        step's update is applied by then."""
        return COMMITS.record_op(position)

    def wrap_input(self, dataset):
        """``fit``'s dataset as this mode reads it (GEO's read-ahead of its ids); as is
        by default."""
        return dataset

    def begin_fit(self, model) -> None:
        if self.is_chief:
            self.publish(model)
            self.ready_flag().assign(1)
        else:
            self.wait_until_ready()

    def fit_length(self, epoch_steps: Optional[int]) -> None:
        """``fit`` starts with epochs of ``epoch_steps`` local steps (None: unknown)."""

    def publish(self, model) -> None:
        """The chief, before it marks the model ready (a restore to publish)."""

    def begin_eval(self, model) -> None:
        """Before ``evaluate`` / ``predict`` outside ``fit``, also before a ``fit`` (Keras
        distributes its dataset before the fit's callbacks start). The chief first
        publishes a model it restored, as ``begin_fit`` would (``model`` may be None)."""
        if self.is_chief:
            self.publish(model)
        else:
            self.wait_until_ready()

    def batch_end(self, model, steps_left: Optional[int] = None) -> None:
        """After each execution of the train function (``steps_per_execution`` steps);
        ``steps_left``: the steps the ``fit`` still runs (None: unknown)."""

    def steps_stale(self) -> bool:
        """Whether the model's step functions must be traced again before the next step
        (GEO's choice between rounds and async changed); checking clears it."""
        return False

    def finish_fit(self, model) -> None:
        """``fit``'s steps ended well, before ``end_fit`` (its steps may still run: sync's
        chief applies the steps of workers still training)."""

    def end_fit(self, model) -> None:
        """After ``fit``, also when it failed."""

    def after_fit(self, model, failed: bool) -> None:
        """Last, after ``end_fit`` (``failed``: a step raised)."""

    # ------------------------------------------------------------------ helpers
    def record(self, op):
        """Remembers a stateful op of the step being traced (for ``after_step``)."""
        if op is not None:
            self._trace_ops.append(op)
        return op

    def take_trace_ops(self) -> list:
        ops, self._trace_ops = self._trace_ops, []
        return ops

    def shared(self, path: str, kwargs, initial=None) -> SharedVariable:
        """The variable ``path`` as a shared resource on a PS (``ps_device_for``): the chief
        initializes it (from ``initial``, else the creator's initial value), the others
        wait for it."""
        init = kwargs["initial_value"] if initial is None else initial
        if callable(init):
            init = init()
        init = tf.convert_to_tensor(init, kwargs.get("dtype"))
        device = self.ps_device_for(kwargs, init.shape, init.dtype)
        var = SharedVariable(
            shared_name=SHARED_PREFIX + path, shape=init.shape, dtype=init.dtype,
            device=device, trainable=kwargs.get("trainable", True), name=kwargs.get("name"),
            aggregation=kwargs.get("aggregation") or tf.VariableAggregation.NONE,
            synchronization=kwargs.get("synchronization") or tf.VariableSynchronization.AUTO,
            distribute_strategy=kwargs.get("distribute_strategy"))
        initialize(var, init, self.is_chief, settings.get("TFPSX_SESSION_TIMEOUT"))
        return var

    def global_variable(self, path: str, kwargs, initial=None):
        """A model weight's global value: one shared variable (``shared``), or, when the
        strategy's ``variable_partitioner`` cuts it, a :class:`PartitionedVariable` whose
        slices are placed by bytes like any variable."""
        init = kwargs["initial_value"] if initial is None else initial
        if callable(init):
            init = init()
        init = tf.convert_to_tensor(init, kwargs.get("dtype"))
        parts = partitions(self.keras_strategy.variable_partitioner, path, init.shape,
                           init.dtype)
        if parts == 1:
            return self.shared(path, kwargs, initial=init)
        return self.partitioned(path, kwargs, init, parts)

    def partitioned(self, path: str, kwargs, init: tf.Tensor, parts: int,
                    devices=None) -> PartitionedVariable:
        """``init``'s value in ``parts`` slices along axis 0 on the PS tasks (``devices``,
        or placed by bytes)."""
        if devices is None:
            row_bytes = max(1, init.shape[1:].num_elements() or 1) * init.dtype.size
            devices = [self.ps_devices[self._placer.place(row_bytes * rows)]
                       for rows in slice_rows(int(init.shape[0]), parts)]
        return PartitionedVariable.create(
            SHARED_PREFIX + path, kwargs.get("name"), init, devices, self.worker_device,
            self.is_chief,
            settings.get("TFPSX_SESSION_TIMEOUT"), bool(kwargs.get("trainable", True)))

    def ps_device_for(self, kwargs, shape=None, dtype=None) -> str:
        """Slots go beside their variable; anything else to the least loaded PS by bytes
        (the shape and dtype, when not given, come from the creator's initial value)."""
        colocate = kwargs.get("colocate_with")
        if colocate is not None and getattr(colocate, "device", ""):
            return colocate.device
        if shape is None or dtype is None:
            init = kwargs["initial_value"]
            value = tf.convert_to_tensor(init() if callable(init) else init,
                                         kwargs.get("dtype"))
            shape, dtype = value.shape, value.dtype
        shape, dtype = tf.TensorShape(shape), tf.as_dtype(dtype)
        elements = shape.num_elements() if shape.is_fully_defined() else 1
        return self.ps_devices[self._placer.place(max(1, elements * dtype.size))]

    def ready_flag(self) -> SharedVariable:
        """PS 0's "the chief has initialized (or restored) the model" flag."""
        if self._ready is None:
            self._ready = SharedVariable(shared_name=SHARED_PREFIX + "ready", shape=[],
                                         dtype=tf.int64, device=self.ps_devices[0],
                                         trainable=False, name="ready")
            initialize(self._ready, tf.constant(0, tf.int64), self.is_chief,
                       settings.get("TFPSX_SESSION_TIMEOUT"))
        return self._ready

    def servers_hold_model(self) -> bool:
        """The servers hold a job's model already: a chief's ``fit`` marked it ready on
        PS 0 (they ran on while this process started again, or it trained). False on
        new servers (a new job, or a whole job started again)."""
        flag = self._ready or SharedVariable(
            shared_name=SHARED_PREFIX + "ready", shape=[], dtype=tf.int64,
            device=self.ps_devices[0], trainable=False, name="ready")
        with tf.init_scope():
            return flag.initialized() and int(flag.read_value()) >= 1

    def wait_until_ready(self) -> None:
        """The chief marks the model ready when its first ``fit`` starts (after any
        restore it did before); the others wait for that before they use the model,
        bounded by TFPSX_SESSION_TIMEOUT."""
        flag = self.ready_flag()
        timeout = settings.get("TFPSX_SESSION_TIMEOUT")
        bounded_wait(lambda: int(flag.read_value()) >= 1, timeout,
                     lambda _: errors.ClusterTimeoutError(
                         f"worker {self.worker_index} waited {timeout:g} s "
                         "(TFPSX_SESSION_TIMEOUT) for the chief (worker 0) to start fit(), "
                         "i.e. to initialize or restore the model; is it running?"))

    def barrier(self) -> None:
        RUNTIME.barrier_worker()

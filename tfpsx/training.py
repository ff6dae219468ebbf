"""Graph-mode (TF1 between-graph) training on a tfpsx cluster.

Every worker builds the same graph. ``model_scope(strategy)`` places the model's
variables (on the parameter servers, or, for GEO, on the PS plus a local copy on the
worker); ``distributed_optimizer(optimizer, strategy)`` turns any
``tf.compat.v1.train`` optimizer into the strategy's update; ``MonitoredTrainingSession``
is TF's chief-worker session with tfpsx's hooks and a non-chief that is ready within a
fraction of a second of the chief's init (TF's own polls every 30 s).

Example (GEO, 100 local steps between syncs)::

  tfpsx.init()
  ...                                           # servers: tfpsx.run_server()
  tfpsx.init_worker()
  strategy = tfpsx.DistributedStrategy(a_sync=True, a_sync_configs={"k_steps": 100})
  with tf.Graph().as_default():
      with tfpsx.model_scope(strategy):
          global_step = tf.compat.v1.train.get_or_create_global_step()
          loss = build_model(...)
          opt = tfpsx.distributed_optimizer(
              tf.compat.v1.train.AdagradOptimizer(0.1), strategy)
          train_op = opt.minimize(loss, global_step=global_step)
      with tfpsx.MonitoredTrainingSession(checkpoint_dir=..., last_step=10000) as sess:
          while not sess.should_stop():
              sess.run(train_op, feed_dict=...)
  tfpsx.stop_worker()

Modes (Paddle Fleet's ``DistributedStrategy`` shape):
  * sync (``a_sync=False``): TF's SyncReplicasOptimizer, without its end-of-training
    hang and with a bounded step (``SyncOptimizer``); ``DynamicEmbedding`` tables built
    in the scope aggregate their row gradients sparsely on the PS (``_TableSyncState``).
  * bounded staleness (``max_staleness=S``): async, no worker more than S steps ahead of
    the slowest (``StalenessOptimizer``).
  * async (``a_sync=True``, ``k_steps=0``): variables and the optimizer's apply ops live
    on the parameter servers; no worker waits for another.
  * GEO (``a_sync=True``, ``k_steps=K > 0``): each worker trains a local copy and keeps
    an ``old`` snapshot; every K local steps it pushes ``delta = (local - old) / N``
    (``old += delta``; the PS variable gets ``+= delta``), then pulls:
    ``local += global - old``; ``old = global``. The push and pull run in a background
    communicator thread while training goes on, or in the training thread between steps
    with ``geo_sync_in_train_thread=True`` (deterministic: all workers push, meet at a
    barrier, pull, meet again).
"""

import contextlib
import dataclasses
import logging
import threading
import time
from typing import Dict, List, Optional

import tensorflow as tf

from tfpsx import errors
from tfpsx.fleet import FLEET, RPC_TIMEOUT, _setting

logger = logging.getLogger("tfpsx")

_GEO_STATE = "tfpsx_geo_state"     # graph collection: the graph's one _GeoState
_SYNC_STATE = "tfpsx_table_sync_state"  # graph collection: the graph's _TableSyncState
_HOOKS = "tfpsx_session_hooks"     # graph collection: hooks MonitoredTrainingSession adds

RECOVERY_WAIT = ("TFPSX_RECOVERY_WAIT", 0.25)  # a non-chief's poll for the chief's init
SESSION_TIMEOUT = ("TFPSX_SESSION_TIMEOUT", 600.0)  # a non-chief waiting for the chief


def _require_worker(what: str):
    return FLEET.require_role(what, "worker")


# ----------------------------------------------------------------------------- strategy

_CONFIG_KEYS = {
    "k_steps": "GEO: local steps between syncs (0: plain async)",
    "max_staleness": "bounded staleness: steps a worker may run ahead of the slowest",
    "geo_sync_in_train_thread": "GEO: sync between steps in the training thread (tests)",
    "replicas_to_aggregate": "sync: gradients aggregated per step (default: every worker)",
}


class DistributedStrategy:
    """How workers share their updates (Paddle Fleet's ``DistributedStrategy``).

    Args:
      a_sync: False for sync training, True for async / GEO / bounded staleness.
      a_sync_configs: ``k_steps`` (int >= 0; > 0 selects GEO), ``max_staleness``
        (int >= 0), ``geo_sync_in_train_thread`` (bool), ``replicas_to_aggregate``
        (sync only).

    Raises:
      ValueError: an unknown key or a bad value (the message names both).

    Example:
      >>> tfpsx.DistributedStrategy(a_sync=True, a_sync_configs={"k_steps": 100}).mode
      'geo'
    """

    def __init__(self, a_sync: bool = True, a_sync_configs: Optional[Dict] = None):
        if not isinstance(a_sync, bool):
            raise ValueError(f"DistributedStrategy: a_sync must be True or False, got {a_sync!r}")
        configs = dict(a_sync_configs or {})
        unknown = sorted(set(configs) - set(_CONFIG_KEYS))
        if unknown:
            raise ValueError(f"DistributedStrategy: unknown a_sync_configs key(s) {unknown}; "
                             f"expected some of {sorted(_CONFIG_KEYS)}")
        self.a_sync = a_sync
        self.k_steps = _int_config(configs, "k_steps", 0)
        self.max_staleness = _int_config(configs, "max_staleness", 0)
        self.geo_sync_in_train_thread = configs.get("geo_sync_in_train_thread", False)
        if not isinstance(self.geo_sync_in_train_thread, bool):
            raise ValueError("DistributedStrategy: a_sync_configs['geo_sync_in_train_thread'] "
                             f"must be True or False, got {self.geo_sync_in_train_thread!r}")
        self.replicas_to_aggregate = configs.get("replicas_to_aggregate")
        if not a_sync and (self.k_steps or self.max_staleness):
            raise ValueError("DistributedStrategy: k_steps and max_staleness need a_sync=True "
                             f"(got a_sync=False with {configs})")
        if self.k_steps and self.max_staleness:
            raise ValueError("DistributedStrategy: GEO (k_steps > 0) and max_staleness are "
                             "separate modes; set one of them")

    @property
    def mode(self) -> str:
        """"sync", "async", "geo" or "staleness"."""
        if not self.a_sync:
            return "sync"
        if self.k_steps > 0:
            return "geo"
        return "staleness" if self.max_staleness > 0 else "async"

    def __repr__(self):
        return (f"DistributedStrategy(mode={self.mode!r}, k_steps={self.k_steps}, "
                f"max_staleness={self.max_staleness})")


def _int_config(configs, key, default):
    value = configs.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"DistributedStrategy: a_sync_configs[{key!r}] must be an int >= 0 "
                         f"({_CONFIG_KEYS[key]}), got {value!r}")
    return value


# ----------------------------------------------------------------------------- placement

def replica_device_setter(ps_strategy=None, worker_device: Optional[str] = None):
    """TF's ``replica_device_setter`` for the resolved cluster.

    Variables go to the parameter servers, balanced by byte size (TF's
    ``GreedyLoadBalancingStrategy``), everything else to this worker. Use it with
    ``tf.compat.v1.device(...)``: TF 2.x's ``tf.device`` raises "tf.device does not support
    functions". Large variables: create them with ``variable_partitioner()`` so that their
    slices spread over the servers. ``tfpsx.session_config()`` holds the device filters
    this placement needs (``MonitoredTrainingSession`` applies them).

    Args:
      ps_strategy: a TF ps strategy (default: greedy load balancing by bytes).
      worker_device: default: this worker's ``/job:<job>/task:<i>``.
    """
    config = _require_worker("replica_device_setter")
    if ps_strategy is None:
        ps_strategy = GreedyByBytes(config.server_num)
    return tf.compat.v1.train.replica_device_setter(
        cluster=config.cluster_spec(), worker_device=worker_device or _worker_device(config),
        ps_strategy=ps_strategy)


class GreedyByBytes:
    """A ps strategy: each variable goes to the server with the fewest bytes so far
    (TF 1.x contrib's GreedyLoadBalancingStrategy, which TF 2 no longer ships)."""

    def __init__(self, num_tasks: int):
        self.loads = [0] * num_tasks

    def __call__(self, op) -> int:
        task = min(range(len(self.loads)), key=self.loads.__getitem__)
        self.loads[task] += _variable_bytes(op)
        return task


def _variable_bytes(op) -> int:
    try:
        shape = tf.TensorShape(op.get_attr("shape"))
        dtype = tf.as_dtype(op.get_attr("dtype"))
    except ValueError:  # an op without shape / dtype attrs: count it as small
        return 1
    elements = 1
    for dim in shape.as_list() if shape.rank is not None else []:
        elements *= dim if dim is not None and dim > 0 else 1
    return max(1, elements * dtype.size)


def variable_partitioner(min_slice_bytes: int = 256 << 10, max_partitions: Optional[int] = None):
    """A partitioner that cuts a variable along axis 0 into slices of at least
    ``min_slice_bytes``, at most one per parameter server (``max_partitions``).

    Example:
      >>> with tf.compat.v1.variable_scope("emb", partitioner=tfpsx.variable_partitioner()):
      ...     table = tf.compat.v1.get_variable("table", [1_000_000, 64])
    """
    config = FLEET.require("variable_partitioner")
    if max_partitions is None:
        max_partitions = config.server_num
    if max_partitions < 1 or min_slice_bytes < 1:
        raise ValueError(f"variable_partitioner: max_partitions ({max_partitions}) and "
                         f"min_slice_bytes ({min_slice_bytes}) must be >= 1")
    return tf.compat.v1.min_max_variable_partitioner(max_partitions=max_partitions,
                                                      min_slice_size=min_slice_bytes)


def _worker_device(config) -> str:
    return f"/job:{config.job_name}/task:{config.task_index}"


@dataclasses.dataclass
class _GeoVariable:
    local: tf.Variable     # trained by this worker
    old: tf.Variable       # the global value at the last pull (plus this worker's pushes)
    global_: tf.Variable   # on the parameter server


@contextlib.contextmanager
def model_scope(strategy: Optional[DistributedStrategy] = None):
    """Places the variables of a model built inside it for ``strategy``.

    sync / async / staleness: ``replica_device_setter()`` (variables on the PS). GEO: each
    trainable variable is created on the PS under its own name (checkpoints are the same
    as in async mode) and the model reads a local copy ``<name>_geo_local`` on this
    worker, initialized from the PS value; ``distributed_optimizer`` trains the copies.
    """
    config = _require_worker("model_scope")
    strategy = strategy or DistributedStrategy()
    with tf.compat.v1.device(replica_device_setter()):
        if strategy.mode == "sync":
            state = _TableSyncState.of(tf.compat.v1.get_default_graph(),
                                       create_for=(strategy, config))
            state.scopes += 1
            try:
                yield
            finally:
                state.scopes -= 1
            return
        if strategy.mode != "geo":
            yield
            return
        worker = _worker_device(config)
        graph = tf.compat.v1.get_default_graph()
        state = _GeoState.of(graph, create_for=(strategy, config))

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
            state.dense.append(_GeoVariable(local, old, global_))
            return local

        state.scopes += 1
        try:
            with tf.compat.v1.variable_creator_scope(creator):
                yield
        finally:
            state.scopes -= 1


# ----------------------------------------------------------------------------- optimizers

def distributed_optimizer(optimizer, strategy: Optional[DistributedStrategy] = None):
    """Wraps a ``tf.compat.v1.train`` optimizer for ``strategy`` (default: async).

    Raises:
      NotInitializedError: before ``tfpsx.init()``.
      ValueError: an optimizer GEO cannot run locally, a strategy that is not a
        ``DistributedStrategy``, a sync ``replicas_to_aggregate`` or SyncReplicasOptimizer
        that does not fit the cluster's worker count.
    """
    config = FLEET.require("distributed_optimizer")
    strategy = strategy or DistributedStrategy()
    if not isinstance(strategy, DistributedStrategy):
        raise ValueError("distributed_optimizer: strategy must be a tfpsx.DistributedStrategy, "
                         f"got {type(strategy).__name__}")
    if not isinstance(optimizer, tf.compat.v1.train.Optimizer):
        raise ValueError("distributed_optimizer: optimizer must be a tf.compat.v1.train "
                         f"optimizer (e.g. AdagradOptimizer), got {type(optimizer).__name__}")
    if strategy.mode == "async":
        return optimizer  # variables on the PS: its apply ops already run there
    if strategy.mode == "geo":
        if isinstance(optimizer, tf.compat.v1.train.SyncReplicasOptimizer):
            raise ValueError("distributed_optimizer: GEO trains a local copy on each worker, "
                             "so it needs an optimizer with a local form; "
                             "SyncReplicasOptimizer aggregates across workers and has none "
                             "(wrap its inner optimizer instead)")
        return GeoOptimizer(optimizer, strategy)
    if strategy.mode == "staleness":
        return StalenessOptimizer(optimizer, strategy.max_staleness, config)
    # sync
    n = config.worker_num
    if isinstance(optimizer, tf.compat.v1.train.SyncReplicasOptimizer):
        if optimizer._total_num_replicas != n:  # noqa: SLF001 — TF keeps it private
            raise ValueError(
                f"distributed_optimizer: the SyncReplicasOptimizer was built for "
                f"total_num_replicas={optimizer._total_num_replicas}, but the cluster has "
                f"{n} workers; pass the plain optimizer and let tfpsx wrap it")
        optimizer = optimizer._opt  # noqa: SLF001
    replicas = _sync_replicas(strategy, n, "distributed_optimizer")
    return SyncOptimizer(optimizer, replicas, n, config.is_chief)


def _sync_replicas(strategy: DistributedStrategy, workers: int, what: str) -> int:
    """The strategy's replicas_to_aggregate (default: every worker), checked."""
    replicas = strategy.replicas_to_aggregate
    replicas = workers if replicas is None else replicas
    if isinstance(replicas, bool) or not isinstance(replicas, int) or \
            not 1 <= replicas <= workers:
        raise ValueError(f"{what}: sync needs replicas_to_aggregate in 1..{workers} (the "
                         f"cluster's worker count), got {replicas!r}")
    return replicas


@dataclasses.dataclass
class GeoCounters:
    """What the GEO communicator did on this worker."""
    pushes: int = 0
    rows_sent: int = 0
    rows_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    sync_seconds: float = 0.0   # total time spent in push + pull

    @property
    def mean_sync_seconds(self) -> float:
        return self.sync_seconds / self.pushes if self.pushes else 0.0


SYNC_STEP_TIMEOUT = ("TFPSX_SYNC_STEP_TIMEOUT", 300.0)  # one sync step, gradients included
STALENESS_TIMEOUT = ("TFPSX_STALENESS_TIMEOUT", 300.0)  # a worker waiting for the slowest


class SyncOptimizer(tf.compat.v1.train.SyncReplicasOptimizer):
    """Sync training: TF's SyncReplicasOptimizer (gradients of ``replicas_to_aggregate``
    workers averaged per step on the PS, applied once by the chief's queue runner, tokens
    release the workers) without its two hangs:

    * at the end of training the chief closes the token queue, so a worker blocked on a
      token ends its session (OutOfRange, a normal stop) instead of waiting forever;
    * a step that waits longer than TFPSX_SYNC_STEP_TIMEOUT (300 s; a dead worker with
      ``replicas_to_aggregate`` = every worker) fails with ``ClusterTimeoutError``.

    Stragglers: with ``replicas_to_aggregate`` < the worker count, a step goes on with
    the first gradients in; late ones for an old step are dropped (TF's staleness check).
    """

    def __init__(self, optimizer, replicas_to_aggregate: int, total_num_replicas: int,
                 is_chief: bool):
        super().__init__(optimizer, replicas_to_aggregate=replicas_to_aggregate,
                         total_num_replicas=total_num_replicas)
        self._tfpsx_is_chief = is_chief

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        if global_step is None:
            raise ValueError("sync training needs a global step: minimize(loss, global_step="
                             "tf.compat.v1.train.get_or_create_global_step())")
        train_op = super().apply_gradients(grads_and_vars, global_step, name)
        tf.compat.v1.add_to_collection(_HOOKS, self.make_session_run_hook(self._tfpsx_is_chief))
        tf.compat.v1.add_to_collection(_HOOKS, _SyncEndHook(self, self._tfpsx_is_chief))
        return train_op


class _SyncEndHook(tf.compat.v1.train.SessionRunHook):
    def __init__(self, opt: SyncOptimizer, is_chief: bool):
        self._opt, self._is_chief = opt, is_chief
        self._bounded = tf.compat.v1.train.SessionRunArgs(None, options=tf.compat.v1.RunOptions(
            timeout_in_ms=int(1000 * _setting(None, SYNC_STEP_TIMEOUT))))

    def begin(self):
        self._close = self._opt._sync_token_queue.close(  # noqa: SLF001
            cancel_pending_enqueues=True)

    def before_run(self, run_context):
        return self._bounded

    def end(self, session):
        if self._is_chief:
            session.run(self._close)


class _GraphState:
    """A graph's one state of a training mode (kept in the graph collection
    ``COLLECTION``; its ``hook`` joins the graph's tfpsx hooks), built by
    ``model_scope`` and found by the tables created inside it."""

    COLLECTION = ""

    @classmethod
    def of(cls, graph, create_for=None):
        """The graph's state; made from ``create_for`` (constructor args) when absent."""
        found = graph.get_collection(cls.COLLECTION)
        if found:
            return found[0]
        if create_for is None:
            return None
        state = cls(*create_for)
        graph.add_to_collection(cls.COLLECTION, state)
        graph.add_to_collection(_HOOKS, state.hook)
        return state

    @classmethod
    def in_scope(cls):
        """The state when called inside ``model_scope`` of its mode (graph mode only)."""
        if tf.executing_eagerly():
            return None
        state = cls.of(tf.compat.v1.get_default_graph())
        return state if state is not None and state.scopes > 0 else None


class _TableSyncState(_GraphState):
    """Sync mode for the ``DynamicEmbedding`` tables of one graph (built inside
    ``model_scope(sync strategy)``).

    A training lookup's row gradients go, per shard, into a SparseConditionalAccumulator
    on that shard's PS (stamped with the worker's local step; stale ones are dropped).
    The chief's update thread takes ``replicas_to_aggregate`` gradients per shard, sums
    the rows of each key, divides by ``replicas_to_aggregate`` and applies the table's
    server-side optimizer once, bumps the sync step (and ``global_step``, unless a dense
    ``SyncOptimizer`` in the same graph counts the steps) and puts one token into each
    worker's own token queue. After each training run a worker takes its token (bounded
    by TFPSX_SYNC_STEP_TIMEOUT) before its next step; at the end the chief closes the
    token queues, so waiting workers stop normally.

    Tokens are per worker (unlike TF's SyncReplicasOptimizer, whose shared tokens let a
    fast worker supply two gradients of one step): with ``replicas_to_aggregate`` equal
    to the worker count every step has one gradient from each worker, and a dead worker
    stops the step, which the others report as ``ClusterTimeoutError``. A straggler
    (fewer replicas than workers) that finds several tokens takes them all and goes on
    from the newest step; at most 2 wait for any worker.
    """

    COLLECTION = _SYNC_STATE

    def __init__(self, strategy: DistributedStrategy, config):
        self.total = config.worker_num
        self.replicas = _sync_replicas(strategy, self.total, "model_scope")
        self.is_chief = config.is_chief
        self.index = config.index
        self.worker_device = _worker_device(config)
        self.accumulators = []   # (table, shard, SparseConditionalAccumulator)
        self.train_ops = []
        self.scopes = 0          # open model_scope(sync) blocks
        self._counter = None
        self._local_step = None
        self.hook = _TableSyncHook(self)

    def _steps(self):
        """(sync step on PS 0, this worker's local step): made on the first push."""
        if self._counter is None:
            with tf.compat.v1.device("/job:ps/task:0"):
                self._counter = tf.compat.v1.get_variable(
                    "tfpsx_table_sync_step", [], tf.int64, initializer=tf.zeros_initializer(),
                    trainable=False, use_resource=True)
            with tf.compat.v1.device(self.worker_device):
                # Like SyncReplicasOptimizer's local step: starts at the sync step (a
                # restarted worker's gradients are not stale), then follows the tokens.
                self._local_step = tf.compat.v1.get_variable(
                    "tfpsx_table_sync_local_step", initializer=self._counter.read_value(),
                    trainable=False, use_resource=True,
                    collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])
        return self._counter, self._local_step

    def push(self, table, keys, grads, devices):
        """The op that sends (keys[i], grads[i]) to shard i's accumulator."""
        _, local_step = self._steps()
        pushes = []
        for i, (shard_keys, shard_grads) in enumerate(zip(keys, grads)):
            with devices(i):
                serial = sum(1 for t, s, _ in self.accumulators if t is table and s == i)
                acc = tf.compat.v1.SparseConditionalAccumulator(
                    tf.float32, shape=tf.TensorShape([None, table.dim]), reduction_type="SUM",
                    shared_name=f"{table.name}/part_{i}/sync_grads_{serial}")
                self.accumulators.append((table, i, acc))
                pushes.append(acc.apply_grad(shard_keys, shard_grads,
                                             local_step=local_step.read_value()))
        train = tf.group(*pushes, name="table_sync_push")
        self.train_ops.append(train)
        return train


def sync_state_in_scope() -> Optional[_TableSyncState]:
    """The table sync state when called inside ``model_scope(sync strategy)`` (graph)."""
    return _TableSyncState.in_scope()


class _TableSyncHook(tf.compat.v1.train.SessionRunHook):
    """Workers: a token after each training run. Chief: the update thread."""

    def __init__(self, state: _TableSyncState):
        self._state = state
        self._built = False
        self._thread = None
        self._stop = threading.Event()
        self._error: Optional[BaseException] = None
        self._timeout = tf.compat.v1.RunOptions(
            timeout_in_ms=int(1000 * _setting(None, SYNC_STEP_TIMEOUT)))

    def begin(self):
        if self._built or not self._state.accumulators:
            return
        self._built = True
        st = self._state
        graph = tf.compat.v1.get_default_graph()
        counter, local_step = st._steps()
        updates, chief_init = [], []
        for table, i, acc in st.accumulators:
            handle = table.handles()[i]
            with tf.compat.v1.device(table.devices[i]):
                taken = acc.take_indexed_slices_grad(st.replicas)
                # A key may come from several workers (the accumulator keeps each
                # gradient's rows): one summed row per key, then one optimizer step.
                keys, where = tf.unique(taken.indices)
                grads = tf.math.unsorted_segment_sum(taken.values, where, tf.size(keys))
                updates.append(table.optimizer.apply(table._ops, handle, keys,
                                                     grads / float(st.replicas),
                                                     counter.read_value()))
                chief_init.append(acc.set_global_step(counter.read_value()))
        dense_sync = any(isinstance(h, _SyncEndHook) for h in graph.get_collection(_HOOKS))
        global_step = tf.compat.v1.train.get_global_step()
        with tf.compat.v1.device(counter.device):
            queues = [tf.queue.FIFOQueue(-1, tf.int64, shapes=[],
                                         shared_name=f"tfpsx_table_sync_tokens_{w}",
                                         name=f"tfpsx_table_sync_tokens_{w}")
                      for w in range(st.total)]
            with tf.control_dependencies(updates):
                bump = [counter.assign_add(1)]
                if global_step is not None and not dense_sync:
                    bump.append(tf.compat.v1.assign_add(global_step, 1))
            with tf.control_dependencies(bump):
                token = counter.read_value()
                # At most 2 tokens wait per worker, so the queue of a dead backup worker
                # (fewer replicas than workers) does not grow by one token every step.
                step_op = tf.group(*[q.enqueue_many(tf.fill(
                    [tf.cast(q.size() < 2, tf.int32)], token)) for q in queues])
            self._close = tf.group(*[q.close(cancel_pending_enqueues=True) for q in queues])
            # This worker's token (waits for it), then any older ones a straggler left:
            # only this worker dequeues its queue, so size-then-dequeue does not race.
            mine = queues[st.index]
            first = mine.dequeue()
            with tf.control_dependencies([first]):
                rest = mine.dequeue_many(mine.size())
            newest = tf.maximum(first, tf.reduce_max(rest))  # max of none: int64 min
        with tf.compat.v1.device(st.worker_device):
            self._wait = local_step.assign(newest)
        self._step_op = step_op
        self._chief_init = tf.group(*chief_init)
        self._train_names = {op.name for op in st.train_ops}
        self._cache: Dict[str, bool] = {}

    def after_create_session(self, session, coord):
        if self._built and self._state.is_chief and self._thread is None:
            session.run(self._chief_init)
            self._thread = threading.Thread(target=self._update_loop, args=(session,),
                                            name="tfpsx-table-sync-chief", daemon=True)
            self._thread.start()

    def _update_loop(self, session):
        # Blocks in the accumulators' take until the gradients are in; the session's close
        # at the end cancels the last, unfinished take.
        while not self._stop.is_set():
            try:
                session.run(self._step_op)
            except (tf.errors.CancelledError, tf.errors.OutOfRangeError):
                if not self._stop.is_set():
                    self._error = RuntimeError("sync (tables): the chief's update was "
                                               "cancelled before training ended")
                return
            except Exception as e:  # noqa: BLE001 — re-raised in the training thread
                if not self._stop.is_set():
                    self._error = e
                    logger.error("sync (tables): the chief's update failed: %s", e)
                return

    def after_run(self, run_context, run_values):
        if self._error is not None:
            raise RuntimeError("sync (tables): the chief's update thread failed") \
                from self._error
        if not self._built or not any(
                _runs_train(f, self._train_names, self._cache)
                for f in tf.nest.flatten(run_context.original_args.fetches)):
            return
        try:
            run_context.session.run(self._wait, options=self._timeout)
        except tf.errors.OutOfRangeError:
            run_context.request_stop()  # the chief ended training
        except tf.errors.DeadlineExceededError as e:
            raise errors.ClusterTimeoutError(
                f"sync (tables): worker waited TFPSX_SYNC_STEP_TIMEOUT="
                f"{_setting(None, SYNC_STEP_TIMEOUT):g} s for its token, i.e. for "
                f"{self._state.replicas} of the {self._state.total} workers' gradients and "
                "the chief's update; is a worker or the chief dead? Lower "
                "replicas_to_aggregate to go on without stragglers") from e

    def end(self, session):
        if self._built and self._state.is_chief:
            self._stop.set()
            session.run(self._close)


class _WrappedOptimizer(tf.compat.v1.train.Optimizer):
    """An optimizer around a ``tf.compat.v1.train`` one: gradients, slots and variables
    are the wrapped optimizer's; subclasses change only ``apply_gradients``."""

    def __init__(self, optimizer, name: str):
        super().__init__(use_locking=False, name=f"{name}{optimizer.get_name()}")
        self._opt = optimizer

    def compute_gradients(self, *args, **kwargs):
        return self._opt.compute_gradients(*args, **kwargs)

    def get_slot(self, *args, **kwargs):
        return self._opt.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._opt.get_slot_names(*args, **kwargs)

    def variables(self):
        return self._opt.variables()


class StalenessOptimizer(_WrappedOptimizer):
    """Async training with bounded staleness (SSP): no worker runs more than
    ``max_staleness`` steps ahead of the slowest. Every worker's step count is a slot of a
    clock vector on PS 0; after each step a worker waits (polling, bounded by
    TFPSX_STALENESS_TIMEOUT: then ``ClusterTimeoutError`` naming the slowest workers)
    while it is too far ahead. A worker that ends sets its clock out of the way, so
    finished workers hold nobody back; a dead one does until the timeout."""

    def __init__(self, optimizer, max_staleness: int, config):
        super().__init__(optimizer, "Staleness")
        self.max_staleness, self._config = max_staleness, config

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        train_op = self._opt.apply_gradients(grads_and_vars, global_step, name)
        n, me = self._config.worker_num, self._config.index
        with tf.compat.v1.device("/job:ps/task:0"):
            clocks = tf.compat.v1.get_variable(
                "tfpsx_worker_clocks", [n], tf.int64, initializer=tf.zeros_initializer(),
                trainable=False, use_resource=True)
        with tf.compat.v1.device(clocks.device):
            tick = tf.compat.v1.scatter_add(clocks, [me], tf.constant([1], tf.int64))
            done = tf.compat.v1.scatter_update(clocks, [me], tf.constant([2 ** 62], tf.int64))
            read = clocks.read_value()
        tf.compat.v1.add_to_collection(
            _HOOKS, _StalenessHook(train_op, tick, read, done, self.max_staleness, me))
        return train_op


class _StalenessHook(tf.compat.v1.train.SessionRunHook):
    def __init__(self, train_op, tick, read, done, max_staleness: int, me: int):
        self._tick, self._read, self._done = tick, read, done
        self._train_names = {getattr(train_op, "op", train_op).name}
        self._cache: Dict[str, bool] = {}
        self._s, self._me = max_staleness, me
        self._timeout = _setting(None, STALENESS_TIMEOUT)
        self.waits = 0  # steps this worker had to wait for the slowest

    def after_run(self, run_context, run_values):
        fetched = tf.nest.flatten(run_context.original_args.fetches)
        if not any(_runs_train(f, self._train_names, self._cache) for f in fetched):
            return
        session = run_context.session
        clocks = session.run(self._tick)
        deadline = time.monotonic() + self._timeout
        waited = False
        while clocks[self._me] - clocks.min() > self._s:
            waited = True
            if time.monotonic() > deadline:
                slow = [int(w) for w in (clocks == clocks.min()).nonzero()[0]]
                raise errors.ClusterTimeoutError(
                    f"bounded staleness: worker {self._me} at step {clocks[self._me]} waited "
                    f"{self._timeout:g} s (TFPSX_STALENESS_TIMEOUT) for worker(s) {slow} at "
                    f"step {clocks.min()} (max_staleness={self._s}); are they alive?")
            time.sleep(0.005)
            clocks = session.run(self._read)
        self.waits += waited

    def end(self, session):
        session.run(self._done)


def _runs_train(fetch, train_names, cache: Dict[str, bool]) -> bool:
    """Whether fetching ``fetch`` runs one of the ops named ``train_names``: itself, or a
    group (a NoOp's control inputs, as tf.group makes) around one. Cached per op."""
    op = getattr(fetch, "op", fetch)
    if not isinstance(op, tf.Operation):
        return False
    if op.name not in cache:
        cache[op.name] = False  # bounds the recursion
        cache[op.name] = op.name in train_names or (op.type == "NoOp" and any(
            _runs_train(c, train_names, cache) for c in op.control_inputs))
    return cache[op.name]


class _GeoState(_GraphState):
    """The GEO bookkeeping of one graph: what to sync (dense pairs, sparse tables), which
    train ops count as local steps, the counters, and the one communicator hook."""

    COLLECTION = _GEO_STATE

    def __init__(self, strategy: DistributedStrategy, config):
        self.k_steps = strategy.k_steps
        self.in_train_thread = strategy.geo_sync_in_train_thread
        self.worker_num = config.worker_num
        self.worker_index = config.index
        self.worker_device = _worker_device(config)
        self.dense: List[_GeoVariable] = []
        self.tables = []  # tfpsx.embedding.DynamicEmbedding in GEO mode
        self.train_ops = []
        self.counters = GeoCounters()
        self.scopes = 0  # open model_scope(geo) blocks
        self.hook = _GeoSyncHook(self)


def geo_state_in_scope() -> Optional[_GeoState]:
    """The GEO state when called inside ``model_scope(geo strategy)`` in graph mode."""
    return _GeoState.in_scope()


class GeoOptimizer(_WrappedOptimizer):
    """GEO k-step SGD around any ``tf.compat.v1.train`` optimizer (see the module doc).

    The wrapped optimizer trains the local copies that ``model_scope`` made; its slots
    stay on the worker (local variables). The sync is a hook that
    ``tfpsx.MonitoredTrainingSession`` runs; ``counters`` says what it did.
    """

    def __init__(self, optimizer, strategy: DistributedStrategy):
        super().__init__(optimizer, "Geo")
        self._strategy = strategy
        self._state: Optional[_GeoState] = None

    @property
    def counters(self) -> GeoCounters:
        if self._state is None:
            raise ValueError("GEO: counters exist once minimize / apply_gradients built the "
                             "train op")
        return self._state.counters

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        graph = tf.compat.v1.get_default_graph()
        state = _GeoState.of(graph)
        pairs = {id(p.local) for p in state.dense} if state else set()
        grads_and_vars = list(grads_and_vars)
        stray = [v.name for g, v in grads_and_vars if g is not None and id(v) not in pairs]
        if stray:
            raise ValueError("GEO: these variables were not created inside "
                             f"tfpsx.model_scope(strategy): {stray}; GEO can only train the "
                             "local copies model_scope makes")
        ours = (self._strategy.k_steps, self._strategy.geo_sync_in_train_thread)
        if (state.k_steps, state.in_train_thread) != ours:
            raise ValueError(
                f"GEO: model_scope was built with k_steps={state.k_steps}, "
                f"geo_sync_in_train_thread={state.in_train_thread} but distributed_optimizer "
                f"with k_steps={ours[0]}, geo_sync_in_train_thread={ours[1]}; pass both the "
                "same DistributedStrategy")
        self._state = state
        global_vars = set(graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES))
        with tf.compat.v1.device(state.worker_device):
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
        state.train_ops.append(train)
        return train


class _GeoSyncHook(tf.compat.v1.train.SessionRunHook):
    """Runs GEO's push + pull every k local steps (background thread, or in line)."""

    def __init__(self, state: _GeoState):
        self._state = state
        self._session = None
        self._thread = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._error: Optional[BaseException] = None
        self._steps = 0          # local steps run
        self._pushed_steps = 0   # local steps reported to global_step
        self._lock = threading.Lock()
        self._built = False

    # -------------------------------------------------------------- graph
    def begin(self):
        # Called before the session finalizes the graph: build the sync ops now, when
        # every GEO variable and table of the model exists.
        if self._built:
            return
        self._built = True
        st = self._state
        n = float(st.worker_num)
        pushes, sent, sent_bytes, registrations = [], [], [], []
        for p in st.dense:
            with tf.compat.v1.device(p.local.device):
                delta = (p.local.read_value() - p.old.read_value()) / n
                bump_old = p.old.assign_add(delta)
            with tf.compat.v1.device(p.global_.device):
                push = p.global_.assign_add(delta)
            pushes.append(tf.group(bump_old, push))
        for table in st.tables:
            push, rows_sent, register = table._geo_push_ops(n, st)
            pushes.append(push)
            sent.append(rows_sent)
            sent_bytes.append(tf.cast(rows_sent, tf.int64) * (8 + 4 * table.dim))  # key + row
            registrations.extend(register)
        self._new_steps = tf.compat.v1.placeholder(tf.int64, [], name="geo_new_steps")
        global_step = tf.compat.v1.train.get_global_step()
        with tf.control_dependencies(pushes):
            # global_step counts every worker's local steps, reported at each push.
            report = ([tf.compat.v1.assign_add(global_step, self._new_steps)]
                      if global_step is not None else [])
            self._push = {"done": tf.group(*report, name="geo_push"),
                          "rows": tf.add_n([tf.constant(0)] + sent),
                          "bytes": tf.add_n([tf.constant(0, tf.int64)] + sent_bytes)}
        self._push_pull = None
        if st.in_train_thread:
            # Deterministic: push, a barrier (every worker's push is in), then the pull.
            self._pull = self._pull_ops([])
        else:
            # Background: the pull runs right after the push in the same step (one
            # round of RPCs less per sync).
            self._pull = self._pull_ops(list(self._push.values()))
            self._push_pull = {"push": self._push, "pull": self._pull}
        self._register = tf.group(*registrations, name="geo_register")
        self._dense_rows = sum(int(p.local.shape[0]) if p.local.shape.rank else 1
                               for p in st.dense)
        self._dense_bytes = sum(4 * int(p.local.shape.num_elements()) for p in st.dense)
        self._train_names = {op.name for op in st.train_ops}
        self._train_cache: Dict[str, bool] = {}

    def _pull_ops(self, after):
        """The pull of every GEO variable and table, after the ops ``after``."""
        pulls, received, received_bytes = [], [], []
        with tf.control_dependencies(after):
            for p in self._state.dense:
                with tf.compat.v1.device(p.global_.device):
                    g = p.global_.read_value()
                with tf.compat.v1.device(p.local.device):
                    g = tf.identity(g)  # one transfer, used twice
                    with tf.control_dependencies([p.local.assign_add(g - p.old.read_value())]):
                        pulls.append(p.old.assign(g))
        for table in self._state.tables:
            pull, rows = table._geo_pull_ops(self._state, after)
            pulls.append(pull)
            received.append(rows)
            received_bytes.append(tf.cast(rows, tf.int64) * (8 + 4 * table.dim))
        return {"done": tf.group(*pulls, name="geo_pull"),
                "rows": tf.add_n([tf.constant(0)] + received),
                "bytes": tf.add_n([tf.constant(0, tf.int64)] + received_bytes)}

    # -------------------------------------------------------------- session
    def after_create_session(self, session, coord):
        self._session = session
        # Sparse tables: this worker's reader of changed keys must exist before anyone
        # pushes (the table tracks changes only for readers it knows).
        session.run(self._register)
        if self._state.in_train_thread:
            # Deterministic mode: no worker trains (and pushes) before every worker has
            # copied the initial global values and registered its readers.
            FLEET.barrier_worker()
        elif self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="tfpsx-geo-communicator",
                                            daemon=True)
            self._thread.start()

    def after_run(self, run_context, run_values):
        if self._error is not None:
            raise RuntimeError("GEO communicator failed") from self._error
        if not any(_runs_train(f, self._train_names, self._train_cache) for f in
                   tf.nest.flatten(run_context.original_args.fetches)):
            return  # an eval or a global_step read, not a local step
        self._steps += 1
        if self._steps % self._state.k_steps:
            return
        if self._state.in_train_thread:
            self._sync(barrier=True)
        else:
            self._wake.set()

    def end(self, session):
        # The last local steps must reach the PS before the worker stops.
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=_setting(None, RPC_TIMEOUT))
            if self._thread.is_alive():
                raise errors.ClusterTimeoutError(
                    "GEO communicator: the last sync did not finish within TFPSX_RPC_TIMEOUT")
        if self._steps > self._pushed_steps and self._error is None:
            self._sync(barrier=False, session=session)

    def _loop(self):
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._sync(barrier=False)
            except BaseException as e:  # noqa: BLE001 — re-raised in the training thread
                self._error = e
                logger.error("GEO communicator failed: %s", e)
                return

    def _sync(self, barrier: bool, session=None):
        session = session or self._session
        with self._lock:
            start = time.monotonic()
            steps = self._steps
            new_steps = {self._new_steps: steps - self._pushed_steps}
            if barrier or self._push_pull is None:
                pushed = session.run(self._push, new_steps)
                if barrier:
                    FLEET.barrier_worker()
                pulled = session.run(self._pull)
                if barrier:
                    FLEET.barrier_worker()
            else:
                done = session.run(self._push_pull, new_steps)
                pushed, pulled = done["push"], done["pull"]
            self._pushed_steps = steps
            c = self._state.counters
            c.pushes += 1
            c.rows_sent += self._dense_rows + int(pushed["rows"])
            c.rows_received += self._dense_rows + int(pulled["rows"])
            c.bytes_sent += self._dense_bytes + int(pushed["bytes"])
            c.bytes_received += self._dense_bytes + int(pulled["bytes"])
            c.sync_seconds += time.monotonic() - start


# ----------------------------------------------------------------------------- session

class _FastWorkerSessionCreator(tf.compat.v1.train.WorkerSessionCreator):
    """TF's worker session creator, polling for the chief's init every
    TFPSX_RECOVERY_WAIT seconds instead of every 30."""

    def __init__(self, recovery_wait_secs: float, **kwargs):
        super().__init__(**kwargs)
        self._recovery_wait_secs = recovery_wait_secs

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
        try:
            return super().create_session()
        except tf.errors.DeadlineExceededError as e:
            raise errors.ClusterTimeoutError(
                f"worker waited {self._max_wait_secs:.0f} s (TFPSX_SESSION_TIMEOUT) for the "
                "chief (worker 0) to initialize or restore the model; is it running?") from e


def MonitoredTrainingSession(checkpoint_dir: Optional[str] = None, hooks=None,  # noqa: N802
                             chief_only_hooks=None, last_step: Optional[int] = None,
                             save_checkpoint_steps=None, save_checkpoint_secs=None,
                             save_summaries_steps=None, scaffold=None,
                             log_step_count_steps: int = 0, session_timeout=None,
                             stop_grace_period_secs: float = 10):
    """TF's ``MonitoredTrainingSession`` for this worker of the tfpsx cluster.

    The chief (worker 0) initializes, or restores from ``checkpoint_dir`` on a restart
    (``global_step`` continues), saves checkpoints (every ``save_checkpoint_steps`` or
    ``save_checkpoint_secs``; TF's default of 600 s when neither is set) and summaries.
    A non-chief started before the chief's init is ready within ~TFPSX_RECOVERY_WAIT
    (0.25 s) of it and raises ``ClusterTimeoutError`` after ``session_timeout``
    (TFPSX_SESSION_TIMEOUT, 600 s). tfpsx's own hooks (the GEO communicator) and a
    ``StopAtStepHook(last_step)`` are added. Master, ``is_chief`` and the session config
    (device filters) come from the resolved cluster.
    """
    config = _require_worker("MonitoredTrainingSession")
    session = _monitored_session(config, checkpoint_dir, hooks, chief_only_hooks, last_step,
                                 save_checkpoint_steps, save_checkpoint_secs,
                                 save_summaries_steps, scaffold, log_step_count_steps,
                                 session_timeout, stop_grace_period_secs)
    if any(isinstance(h, _SyncEndHook) for h in
           tf.compat.v1.get_default_graph().get_collection(_HOOKS)):
        return _SyncTimeoutMessages(session, config.worker_num)
    return session


class _SyncTimeoutMessages:
    """A monitored session whose step timeouts say what a sync step waited for."""

    def __init__(self, session, workers: int):
        self._session, self._workers = session, workers

    def __getattr__(self, name):
        return getattr(self._session, name)

    def __enter__(self):
        self._session.__enter__()
        return self

    def __exit__(self, *exc):
        return self._session.__exit__(*exc)

    def run(self, *args, **kwargs):
        try:
            return self._session.run(*args, **kwargs)
        except tf.errors.DeadlineExceededError as e:
            raise errors.ClusterTimeoutError(
                f"a sync step waited TFPSX_SYNC_STEP_TIMEOUT="
                f"{_setting(None, SYNC_STEP_TIMEOUT):g} s for the gradients of the other "
                f"workers (of {self._workers}) or for its token; is a worker dead? Lower "
                "replicas_to_aggregate to go on without stragglers") from e


def _monitored_session(config, checkpoint_dir, hooks, chief_only_hooks, last_step,
                       save_checkpoint_steps, save_checkpoint_secs, save_summaries_steps,
                       scaffold, log_step_count_steps, session_timeout, stop_grace_period_secs):
    graph = tf.compat.v1.get_default_graph()
    hooks = list(hooks or []) + list(graph.get_collection(_HOOKS))
    if last_step is not None:
        hooks.append(tf.compat.v1.train.StopAtStepHook(last_step=last_step))
    master = FLEET.server_target()
    session_config = FLEET.session_config()
    if not config.is_chief:
        timeout = _setting(session_timeout, SESSION_TIMEOUT)
        creator = _FastWorkerSessionCreator(
            _setting(None, RECOVERY_WAIT), scaffold=scaffold, master=master,
            config=session_config, max_wait_secs=timeout)
        return tf.compat.v1.train.MonitoredSession(
            session_creator=creator, hooks=hooks, stop_grace_period_secs=stop_grace_period_secs)
    kwargs = {}
    if save_checkpoint_steps is not None:
        kwargs["save_checkpoint_steps"] = save_checkpoint_steps
    if save_checkpoint_secs is not None:
        kwargs["save_checkpoint_secs"] = save_checkpoint_secs
    if save_summaries_steps is not None:
        kwargs["save_summaries_steps"] = save_summaries_steps
    return tf.compat.v1.train.MonitoredTrainingSession(
        master=master, is_chief=True, checkpoint_dir=checkpoint_dir, scaffold=scaffold,
        hooks=hooks, chief_only_hooks=chief_only_hooks, config=session_config,
        log_step_count_steps=log_step_count_steps,
        stop_grace_period_secs=stop_grace_period_secs, **kwargs)

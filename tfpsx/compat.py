"""Every private TensorFlow symbol tfpsx uses, in one place, with why and on which TF.

tfpsx builds on TF's public API; where that has no door, the private symbol is named
here and nowhere else (a test keeps ``tensorflow.python`` imports out of every other
module), so a TF upgrade that moves one breaks this file alone, with the reason beside it.
Checked on TF 2.16 and 2.21 (the versions CI and ``make test TF=2.16`` run); each
symbol has existed unchanged in that range.

* :data:`SaveableObject`, :data:`SaveSpec` — a table's checkpoint entries in TF1 graph
  mode: ``tf.compat.v1.train.Saver`` takes saveables, and TF exports no public base
  class for them (``tensorflow.python.training.saving.saveable_object``; TF 2.16-2.21).
* :data:`distribute_lib`, :data:`OneDeviceExtended` — the Keras strategy subclasses
  ``tf.distribute.OneDeviceStrategy``'s extended object (the hooks Keras calls:
  ``_create_variable``, ``_update``, ``_batch_reduce_to``, ``_call_for_each_replica``)
  and enters ``UpdateContext`` as TF's own strategies do; neither is public (TF 2.16-2.21).
* :data:`BaseResourceVariable`, :func:`set_handle_shapes_and_types`,
  :func:`create_handle_data` — an eager variable bound to a named resource on a PS
  (``tf.Variable`` makes anonymous resources other clients cannot reach; TF 2.16-2.21).
* :data:`gen_resource_variable_ops` — ``VarHandleOp`` with a ``shared_name``,
  ``VarIsInitializedOp`` and ``ReadVariableOp`` on a handle (raw ops: also
  ``tf.raw_ops``, but the generated module carries the shape inference TF's variables
  rely on; TF 2.16-2.21).
* :func:`ensure_eager_context_initialized` — creates the remote eager contexts at
  connect time (TF defers it to the first op; ``context.ensure_initialized``, TF
  2.16-2.21).
* :func:`eager_mode` — ops run eagerly inside a TF1 graph's scope
* :func:`async_wait` — waits for the eager ops in flight and raises a remote op's error
  now (``context.async_wait``; Keras's TF trainer calls it at each epoch's end, so an
  error of an epoch's last step would surface outside the step; TF 2.16-2.21).
* :data:`Trackable` — a table's object-based checkpoint entry (``tf.train.Checkpoint``);
  ``tf.__internal__.tracking.Trackable`` is TF's exported-but-internal name for it.
* :func:`keras_name_scopes`, :func:`keras_current_path` — what Keras is creating when a
  variable reaches the strategy's creator: Keras passes ``tf.Variable`` only a short
  name, but opens ``keras.name_scope(name, caller=obj)`` around every creation (layer
  weights, optimizer variables, metrics, seed generators), and a variable's ``path`` is
  the open scopes' path plus its name (``keras.src.backend.common``; Keras 3.x, checked
  on 3.15 with TF 2.16 and 2.21).
* :func:`flatten_layers` — every layer of a Keras model, nested and subclassed models'
  included (``Layer._flatten_layers``: Keras has no public walk; Keras 3.x).
* :func:`unfinalize` — opens a finalized TF1 graph for a few read ops a running session
  extends to (``Graph._unsafe_unfinalize``: no public way; TF 2.16-2.21).
* :func:`sync_replicas_parts` — the replica count and the wrapped optimizer of a
  ``tf.compat.v1.train.SyncReplicasOptimizer`` (``_total_num_replicas``, ``_opt``: TF
  keeps both private; TF 2.16-2.21).

* :func:`unsized` — a ``tf.data.Dataset`` whose ``cardinality()`` says 0 (Keras then
  never learns an epoch's length from the first and cuts the later ones to it: a worker
  of ``tfpsx.data.splits`` reads as many batches an epoch as the splits it takes);
  ``dataset_ops.UnaryUnchangedStructureDataset`` is the base TF's own unary datasets use
  (TF 2.16-2.21).
* :func:`tape_records` — whether a ``tf.GradientTape`` records a tensor: Keras's
  ``train_step`` calls a subclassed model's ``call(inputs)`` without ``training`` when
  its signature has none, and a ``DynamicEmbedding`` inside then tells a training call
  from an evaluation by the tape (``record.should_record_backprop``; TF 2.16-2.21).

* :func:`read_on_service` — a dataset registered with a tf.data service dispatcher and
  read back under dynamic sharding, from inside a tf.data function (a lease's split,
  ``tfpsx.data.service``), with the client's task refresh every 100 ms: the public
  ``from_dataset_id`` keeps TF's default interval, which made each lease's read wait
  about 0.4 s for its task (1,500 lines in 12 splits: 5.9 s against 1.4 s;
  ``data_service_ops._register_dataset`` / ``_from_dataset_id``, TF 2.16-2.21).

A private *attribute* of a TF or Keras object is read here too: a test walks every other
module's attribute reads (``tests/unit/test_architecture.py``). A subclass's own
``self._x`` (TF's session creators, Keras layers, the strategy's extended object) is its
own business.
"""

from __future__ import annotations

import threading
from typing import Optional

import tensorflow as tf
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute.one_device_strategy import OneDeviceExtended
from tensorflow.python.eager import context as _context
from tensorflow.python.ops import gen_resource_variable_ops
from tensorflow.python.ops import handle_data_util as _handle_data_util
from tensorflow.python.ops import resource_variable_ops as _resource_variable_ops
from tensorflow.python.training.saving.saveable_object import SaveableObject, SaveSpec

BaseResourceVariable = _resource_variable_ops.BaseResourceVariable
Trackable = tf.__internal__.tracking.Trackable


def set_handle_shapes_and_types(handle, shape, dtype) -> None:
    """Gives an eager resource handle the shape and dtype its variable holds (what TF's
    own eager variables do to their handles)."""
    _resource_variable_ops._set_handle_shapes_and_types(  # noqa: SLF001
        handle, _handle_data_util.create_handle_data(shape, dtype), graph_mode=False)


def server_def(cluster_spec, job_name: str, task_index: int, port: Optional[int] = None,
               config=None):
    """The ServerDef of ``/job:<job_name>/task:<task_index>`` of ``cluster_spec``,
    listening on ``port`` when given (TF's ``ServerDef.port``: the cluster's address for
    the task is what the others dial, e.g. a NAT's or a proxy's) and with ``config`` as
    its sessions' default."""
    from tensorflow.core.protobuf import tensorflow_server_pb2

    out = tensorflow_server_pb2.ServerDef(
        cluster=cluster_spec.as_cluster_def(), job_name=job_name, task_index=task_index,
        protocol="grpc", port=port or 0)
    if config is not None:
        out.default_session_config.CopyFrom(config)
    return out


_CONNECT_LOCK = threading.Lock()  # the connect's patch of TF's module is process-wide


def connect_to_cluster(cluster_spec, job_name: str, task_index: int,
                       port: Optional[int] = None) -> None:
    """``tf.config.experimental_connect_to_cluster``; with ``port``, this process's
    server listens there (TF's function has no argument for ``ServerDef.port``: the
    ServerDef it builds gets the port on its way to the context)."""
    if not port:
        tf.config.experimental_connect_to_cluster(cluster_spec, job_name=job_name,
                                                  task_index=task_index)
        return
    def with_port(original):
        def set_def(definition):
            definition.port = port
            return original(definition)
        return set_def

    with _CONNECT_LOCK:
        originals = {name: getattr(_context, name)
                     for name in ("set_server_def", "update_server_def")}
        try:
            for name, original in originals.items():
                setattr(_context, name, with_port(original))
            tf.config.experimental_connect_to_cluster(cluster_spec, job_name=job_name,
                                                      task_index=task_index)
        finally:
            for name, original in originals.items():
                setattr(_context, name, original)
    got = _context.get_server_def()
    if got is None or got.port != port:
        raise RuntimeError(
            f"TFPSX_LISTEN_PORT={port}: this TensorFlow ({tf.__version__}) connected its "
            f"eager context without it (ServerDef.port "
            f"{None if got is None else got.port}); tfpsx.compat.connect_to_cluster needs "
            "updating for it")


def ensure_eager_context_initialized() -> None:
    """Creates this process's eager context now, with the remote contexts of the cluster
    it was connected to."""
    _context.ensure_initialized()


def enable_collectives(cluster_spec, job_name: str, task_index: int, leader: str,
                       port: Optional[int] = None) -> None:
    """Starts this process's collective runtime the way TF's MultiWorkerMirroredStrategy
    does: the group leader and device filters in the context's config, then an in-process
    gRPC server for ``/job:<job_name>/task:<task_index>`` of ``cluster_spec`` (listening
    on ``port`` when given) whose collective executor reaches the other tasks. Raises
    RuntimeError once the eager context exists (TF configures collectives at program
    start only)."""
    ctx = _context.context()
    ctx.configure_collective_ops(
        collective_leader=leader, scoped_allocator_enabled_ops=("CollectiveReduce",),
        device_filters=(f"/job:{job_name}/task:{task_index}",))
    ctx.enable_collective_ops(server_def(cluster_spec, job_name, task_index, port, ctx.config))
    ctx.ensure_initialized()


def collective_barrier(device: str, group_size: int, group_key: int, timeout: float) -> None:
    """An all-reduce of one number over ``group_size`` ranks (``group_key``, used once
    per process): it returns on a rank once every rank reached it."""
    with tf.device(device):
        tf.raw_ops.CollectiveReduceV2(
            input=tf.constant([1], tf.int32), group_size=group_size, group_key=group_key,
            instance_key=tf.constant(1), ordering_token=[], merge_op="Add", final_op="Id",
            timeout_seconds=float(timeout)).numpy()


def abort_collectives(message: str) -> None:
    """Fails every collective in flight, and every later one, with ``message`` (a lost
    peer: TF's collectives would wait for it until their timeout)."""
    _context.context().abort_collective_ops(tf.errors.UNAVAILABLE, message)


def eager_mode():
    """A context in which ops run eagerly, even inside a TF1 graph's ``as_default()``
    (where ``tf.init_scope()`` stays in the graph): a graph-mode step's
    ``tf.numpy_function`` that runs an eager collective."""
    return _context.eager_mode()


def async_wait() -> None:
    """Waits for this process's eager ops in flight; raises the error of one that failed
    (a remote op whose server died)."""
    _context.async_wait()


def keras_name_scopes() -> list:
    """The objects (``caller``) of the Keras name scopes open now, outermost first (None
    for a scope opened without one)."""
    from keras.src.backend.common import global_state

    return [s.caller for s in global_state.get_global_attribute("name_scope_stack") or []]


def keras_current_path() -> str:
    """The path of the Keras name scopes open now ("" outside any)."""
    from keras.src.backend.common.name_scope import current_path

    return current_path()


def flatten_layers(model, include_self: bool = True, recursive: bool = True) -> list:
    """Every layer of ``model`` (nested layers and subclassed models' included)."""
    return model._flatten_layers(include_self=include_self, recursive=recursive)


def unfinalize(graph) -> None:
    """Opens the finalized ``graph`` for new ops (finalize it again after)."""
    graph._unsafe_unfinalize()


def unsized(dataset):
    """``dataset`` (the same elements, the same pipeline) with a ``cardinality()`` of 0."""
    from tensorflow.python.data.ops import dataset_ops

    class _Unsized(dataset_ops.UnaryUnchangedStructureDataset):
        def __init__(self, inner):
            super().__init__(inner, inner._variant_tensor)

        def cardinality(self):
            return tf.constant(0, tf.int64)

    return _Unsized(dataset)


def tape_records(tensor) -> bool:
    """Whether a ``tf.GradientTape`` active in this thread watches ``tensor`` (its
    gradient will be taken)."""
    from tensorflow.python.eager import record

    return bool(record.should_record_backprop([tensor]))


def step_graph(graph):
    """``graph``, or when it is a TF2 tf.cond / while branch (a graph of its own), the
    graph the branch is built in: the step's (a ``tf.function``'s, or a TF1 graph)."""
    from tensorflow.python.ops import control_flow_v2_func_graphs

    while isinstance(graph, control_flow_v2_func_graphs.ControlFlowFuncGraph):
        graph = graph.outer_graph
    return graph


def read_on_service(service: str, dataset, element_spec, task_refresh_ms: int = 100,
                    outstanding: int = 2):
    """``dataset`` read through the tf.data service at ``service`` (registered now: in a
    tf.data function, each time it runs), one data worker reading it in order under
    ``ShardingPolicy.DYNAMIC`` when its source is a single element; uncompressed; at
    most ``outstanding`` elements asked for at a time."""
    from tensorflow.python.data.experimental.ops import data_service_ops

    dataset_id = data_service_ops._register_dataset(service, dataset, compression=None)
    return data_service_ops._from_dataset_id(
        tf.data.experimental.service.ShardingPolicy.DYNAMIC, service, dataset_id,
        element_spec, task_refresh_interval_hint_ms=task_refresh_ms,
        max_outstanding_requests=outstanding)


def sync_replicas_parts(optimizer):
    """(total_num_replicas, the optimizer it wraps) of a ``SyncReplicasOptimizer``."""
    return optimizer._total_num_replicas, optimizer._opt


__all__ = ["SaveableObject", "SaveSpec", "distribute_lib", "OneDeviceExtended",
           "BaseResourceVariable", "gen_resource_variable_ops", "set_handle_shapes_and_types",
           "ensure_eager_context_initialized", "eager_mode", "async_wait", "Trackable",
           "enable_collectives", "abort_collectives", "collective_barrier",
           "keras_name_scopes", "keras_current_path", "flatten_layers", "unfinalize",
           "sync_replicas_parts", "tape_records", "unsized", "read_on_service",
           "step_graph"]

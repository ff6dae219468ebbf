"""tfpsx: a TensorFlow-native parameter-server extension.

Example:
  >>> import tfpsx
  >>> tfpsx.init()                 # role from TF_CONFIG or TFPSX_* env (or a role maker)
  >>> if tfpsx.is_server():
  ...     tfpsx.run_server()       # returns once every worker called stop_worker()
  ... else:
  ...     tfpsx.init_worker()
  ...     ...                      # train: tfpsx.model_scope, distributed_optimizer, ...
  ...     tfpsx.stop_worker()

This module is a facade. The package is layered, each layer importing only the ones
below it (``make test`` checks it with import-linter):

  testing | serving           LocalCluster for tests of a user's job; serving export
                              (SavedModels without tfpsx ops)
  launcher | keras            tfpsx-run; Keras 3 fit (ParameterServerStrategy, layers)
  training | data             strategy -> Mode (async, sync, staleness, GEO), sessions;
                              each worker's part of the input
  embedding                   DynamicTable over sharded storage backends
  runtime                     the process state machine behind init() / run_server() ...
  control                     scheduler, PS-0 counters, their client side
  cluster | ops | metrics     config resolution; the op library; counters and sinks
  errors | settings | background
"""

import importlib
from typing import Optional

from tfpsx import cluster as _cluster
from tfpsx import errors, metrics, settings
from tfpsx.cluster import (AutoRoleMaker, ClusterConfig, EnvRoleMaker, FlagsRoleMaker,
                           RoleMaker, TFConfigRoleMaker, UserDefinedRoleMaker)
from tfpsx.errors import OpLibraryError
from tfpsx.ops import library_info as op_library_info
from tfpsx.ops import load_ops
from tfpsx.runtime import RUNTIME as _RUNTIME
from tfpsx.runtime import ServerReport

__version__ = "0.1.0"

# Names loaded on first use: these modules import TensorFlow's training stack, which the
# scheduler, the launcher and role resolution never need. name -> module holding it (a
# module name maps to itself).
_LAZY = {
    "embedding": "tfpsx.embedding",
    "training": "tfpsx.training",
    "testing": "tfpsx.testing",
    "keras": "tfpsx.keras",
    "serving": "tfpsx.serving",
    "data": "tfpsx.data",
    "DistributedStrategy": "tfpsx.modes.strategy",
    "distributed_optimizer": "tfpsx.training",
    "model_scope": "tfpsx.training",
    "replica_device_setter": "tfpsx.training",
    "variable_partitioner": "tfpsx.training",
    "MonitoredTrainingSession": "tfpsx.training",
    "RowStager": "tfpsx.training",
    "GeoReadAhead": "tfpsx.training",
    "GeoOptimizer": "tfpsx.training",
    "GeoCounters": "tfpsx.training",
    "export_serving": "tfpsx.serving",
    "evaluate_checkpoints": "tfpsx.checkpoint.evaluation",
}

__all__ = [
    "init", "is_server", "is_worker", "is_chief", "is_evaluator", "role", "worker_index",
    "worker_num", "server_index", "server_num", "cluster_spec", "cluster_config",
    "run_server", "run_scheduler", "init_worker", "stop_worker", "barrier_worker",
    "server_target", "session_config", "anchor_eager_service", "load_ops", "op_library_info",
    "ClusterConfig", "ServerReport", "RoleMaker", "AutoRoleMaker", "TFConfigRoleMaker",
    "EnvRoleMaker", "UserDefinedRoleMaker", "FlagsRoleMaker", "OpLibraryError", "errors",
    "metrics", "settings", "__version__", *_LAZY,
]


def __getattr__(name):
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name])
        return module if _LAZY[name].endswith("." + name) else getattr(module, name)
    raise AttributeError(f"module 'tfpsx' has no attribute {name!r}")


def init(role_maker: Optional[RoleMaker] = None, is_collective: bool = False) -> ClusterConfig:
    """Resolves this process's role, rank and cluster.

    Args:
      role_maker: where to read the cluster from. ``None`` reads TF_CONFIG, else the
        TFPSX_* variables (``AutoRoleMaker``); pass ``UserDefinedRoleMaker``,
        ``TFConfigRoleMaker``, ``EnvRoleMaker`` or ``FlagsRoleMaker`` to choose.
      is_collective: a collective job (Fleet's ``fleet.init(is_collective=True)``):
        workers only, no parameter servers; every weight is all-reduced among the
        workers (``tfpsx.keras.CollectiveStrategy``). A cluster that declares servers
        is refused.

    Returns:
      The validated :class:`ClusterConfig`.

    Raises:
      ValueError: the configuration is missing or malformed (the message names the
        variable, the bad value and what was expected).
    """
    return _RUNTIME.init(role_maker, is_collective)


def cluster_config() -> ClusterConfig:
    """The resolved :class:`ClusterConfig` (after ``init()``)."""
    return _RUNTIME.require("cluster_config")


def role() -> str:
    """"server", "worker", "scheduler" or "evaluator"."""
    return _RUNTIME.require("role").role


def is_server() -> bool:
    """True in a parameter-server process."""
    return _RUNTIME.require("is_server").role == _cluster.SERVER


def is_worker() -> bool:
    """True in a worker process (the chief included)."""
    return _RUNTIME.require("is_worker").role == _cluster.WORKER


def is_evaluator() -> bool:
    """True in a TF_CONFIG ``evaluator`` process (not part of the training cluster)."""
    return _RUNTIME.require("is_evaluator").role == _cluster.EVALUATOR


def is_chief() -> bool:
    """True for worker 0 (TF_CONFIG's ``chief`` task when there is one)."""
    return _RUNTIME.require("is_chief").is_chief


def worker_index() -> int:
    """This worker's rank, 0..worker_num()-1. Raises WrongRoleError elsewhere."""
    return _RUNTIME.require_role("worker_index", _cluster.WORKER).index


def worker_num() -> int:
    """The number of workers (the chief included)."""
    return _RUNTIME.require("worker_num").worker_num


def server_index() -> int:
    """This server's rank, 0..server_num()-1. Raises WrongRoleError elsewhere."""
    return _RUNTIME.require_role("server_index", _cluster.SERVER).index


def server_num() -> int:
    """The number of parameter servers."""
    return _RUNTIME.require("server_num").server_num


def cluster_spec():
    """The training cluster as a ``tf.train.ClusterSpec`` (jobs ``ps``, ``worker``[, ``chief``])."""
    return _RUNTIME.require("cluster_spec").cluster_spec()


def run_server(register_timeout: Optional[float] = None,
               heartbeat_timeout: Optional[float] = None) -> ServerReport:
    """Serves this parameter server until every worker has called ``stop_worker()``.

    Loads the tfpsx op library, starts ``tf.distribute.Server`` for this task and, unlike
    ``server.join()``, returns when the job is over.

    Args:
      register_timeout: seconds every worker has to call ``init_worker()`` before this
        raises ``ClusterTimeoutError`` naming the missing workers (TFPSX_REGISTER_TIMEOUT,
        default 600).
      heartbeat_timeout: seconds of heartbeat silence after which a started worker is
        reported lost and no longer waited for (TFPSX_HEARTBEAT_TIMEOUT, default 60).

    Returns:
      A :class:`ServerReport` listing the workers that stopped and those lost.
    """
    return _RUNTIME.run_server(register_timeout, heartbeat_timeout)


def anchor_eager_service(server, timeout: Optional[float] = None) -> None:
    """Makes a ``tf.distribute.Server`` you started yourself safe for several eager
    clients (Keras workers), as ``run_server()`` does for its own.

    TF's eager service can crash a server when two clients create their contexts on it
    at the same moment (docs/eager-anchor.md); the server's own context, created here
    before any client connects, closes that window for good. Keras workers wait for it.

    Args:
      server: the ``tf.distribute.Server`` of this process, started.
      timeout: seconds the call may take (TFPSX_RPC_TIMEOUT, default 30).

    Raises:
      ServerUnavailableError: the server did not accept it.
    """
    from tfpsx.control import eager_anchor

    eager_anchor.anchor(server.server_def, settings.get("TFPSX_RPC_TIMEOUT", timeout))


def run_scheduler() -> int:
    """Serves as the scheduler (TFPSX_ROLE=scheduler) until the job ends; returns an exit code.

    The scheduler assigns ranks, hands every node the full cluster, runs barriers and
    heartbeats, and returns 0 once every worker has finished (or died) and the servers
    confirmed the end. See :mod:`tfpsx.control.scheduler`.
    """
    return _RUNTIME.run_scheduler()


def init_worker(connect_timeout: Optional[float] = None) -> None:
    """Waits (bounded) for every server, then registers this worker with them.

    Args:
      connect_timeout: seconds to wait for all servers to accept connections
        (TFPSX_CONNECT_TIMEOUT, default 120); the wait logs what it waits for.

    Raises:
      ClusterTimeoutError: a server did not come up in time (named with its address).
      OpsNotLoadedOnServerError: a server runs without the tfpsx op library.
    """
    _RUNTIME.init_worker(connect_timeout)


def stop_worker() -> None:
    """Tells the servers this worker is done; they return once all workers are."""
    _RUNTIME.stop_worker()


def barrier_worker(timeout: Optional[float] = None) -> None:
    """Blocks until every worker reached the same barrier (TFPSX_BARRIER_TIMEOUT)."""
    _RUNTIME.barrier_worker(timeout)


def server_target() -> str:
    """The session target of this worker's own ``tf.distribute.Server`` (started on first call)."""
    return _RUNTIME.server_target()


def session_config():
    """A ``tf.compat.v1.ConfigProto`` with the device filters a between-graph worker needs."""
    return _RUNTIME.session_config()

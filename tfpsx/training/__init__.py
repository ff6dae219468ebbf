"""Graph-mode (TF1 between-graph) training on a tfpsx cluster.

Every worker builds the same graph. ``model_scope(strategy)`` places the model's
variables (on the parameter servers; GEO adds a local copy on the worker);
``distributed_optimizer(optimizer, strategy)`` turns any ``tf.compat.v1.train``
optimizer into the strategy's update; ``MonitoredTrainingSession`` is TF's chief-worker
session with the mode's hooks.

Example (GEO, 100 local steps between syncs)::

  strategy = tfpsx.DistributedStrategy(a_sync=True, a_sync_configs={"k_steps": 100})
  with tf.Graph().as_default():
      with tfpsx.model_scope(strategy):
          global_step = tf.compat.v1.train.get_or_create_global_step()
          loss = build_model(...)
          opt = tfpsx.distributed_optimizer(tf.compat.v1.train.AdagradOptimizer(0.1), strategy)
          train_op = opt.minimize(loss, global_step=global_step)
      with tfpsx.MonitoredTrainingSession(checkpoint_dir=..., last_step=10000) as sess:
          while not sess.should_stop():
              sess.run(train_op, feed_dict=...)

The map: :mod:`~.strategy` (options -> mode name), :mod:`~.placement`, :mod:`~.scope`,
:mod:`~.optimizer`, :mod:`~.session`, and :mod:`~.modes` (one module per mode behind the
``Mode`` interface: async, sync, staleness, GEO).
"""

from tfpsx.modes.geo import GeoCounters
from tfpsx.training.modes import mode_for, mode_of
from tfpsx.training.modes.geo import GeoOptimizer
from tfpsx.training.modes.staleness import StalenessOptimizer
from tfpsx.training.modes.sync import SyncOptimizer
from tfpsx.training.optimizer import distributed_optimizer
from tfpsx.cluster.placement import GreedyByBytes
from tfpsx.training.placement import replica_device_setter, variable_partitioner
from tfpsx.training.scope import model_scope
from tfpsx.training.session import MonitoredTrainingSession
from tfpsx.training.read_ahead import GeoReadAhead
from tfpsx.training.staging import RowStager
from tfpsx.modes.strategy import DistributedStrategy

__all__ = [
    "DistributedStrategy", "model_scope", "distributed_optimizer", "MonitoredTrainingSession",
    "replica_device_setter", "variable_partitioner", "GreedyByBytes", "GeoOptimizer",
    "GeoCounters", "SyncOptimizer", "StalenessOptimizer", "mode_for", "mode_of", "RowStager",
    "GeoReadAhead",
]

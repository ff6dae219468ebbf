"""Keras 3 ``model.fit`` on a tfpsx cluster.

* :class:`ParameterServerStrategy` (:mod:`~tfpsx.keras.strategy`): a ``tf.distribute``
  strategy for one worker's ``fit``, in any tfpsx mode (async, sync, GEO, bounded
  staleness); the per-mode parts are :mod:`~tfpsx.keras.modes`, the hooks around
  ``fit`` :mod:`~tfpsx.keras.fit`, the PS-resident variables
  :mod:`~tfpsx.keras.variables`;
* :class:`CollectiveStrategy` (:mod:`~tfpsx.keras.collective`): ``fit`` in a collective
  job, every weight all-reduced among the workers (no parameter servers);
* :mod:`~tfpsx.keras.layers`: ``DynamicEmbedding``, a layer over a growing table;
* :mod:`~tfpsx.keras.checkpoint`: ``IncrementalCheckpoint``, a callback saving tables as
  full exports every M saves and deltas between, and ``evaluate_checkpoints``, an
  evaluator task's loop over them;
* :mod:`~tfpsx.keras.schedules`: ``ScaledLearningRate``, the learning rate proportional
  to the global batch, with a warm-up;
* :mod:`~tfpsx.keras.expiry`: ``ExpireByDataTime``, a callback evicting the rows a
  stream has not seen for a span of its data time;
* :mod:`~tfpsx.keras.summaries`: ``TrainingSummaries``, a callback writing loss,
  examples/s and the PS traffic as TensorBoard scalars.

Each mode's protocol is :mod:`tfpsx.modes` (shared with graph mode): this package is its
eager / ``tf.function`` front-end.
"""

from tfpsx.keras import layers
from tfpsx.keras.collective import CollectiveStrategy
from tfpsx.keras.checkpoint import IncrementalCheckpoint, evaluate_checkpoints
from tfpsx.keras.layers import DynamicEmbedding
from tfpsx.keras.schedules import ScaledLearningRate
from tfpsx.keras.strategy import ParameterServerStrategy
from tfpsx.keras.expiry import ExpireByDataTime
from tfpsx.keras.summaries import TrainingSummaries

__all__ = ["ParameterServerStrategy", "CollectiveStrategy", "DynamicEmbedding", "IncrementalCheckpoint",
           "evaluate_checkpoints", "TrainingSummaries", "ExpireByDataTime", "ScaledLearningRate", "layers"]

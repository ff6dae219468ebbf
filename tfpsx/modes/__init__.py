"""The training modes' protocols, written once for both front-ends.

A mode's protocol is what the workers and servers do, in what order, and when: GEO's
push / pull / barrier sequence and its schedule (:mod:`~tfpsx.modes.geo`), the
per-worker vectors on PS 0 and the finished-worker mark (:mod:`~tfpsx.modes.group`),
sync's step (push, mark, the chief's wait and apply, the others' wait; its accumulators;
:mod:`~tfpsx.modes.sync`), the staleness clock and wait (:mod:`~tfpsx.modes.staleness`).
It is backend-neutral: a front-end is the executor that
runs it, a TF1 session step (:mod:`tfpsx.training.modes`) or an eager / ``tf.function``
step (:mod:`tfpsx.keras.modes`); the front-ends import this package and never each
other's modes (an import contract).
"""

from tfpsx.modes.geo import (BARRIER, PULL, PUSH, GeoCounters, GeoSchedule, GeoState,
                             GeoTableUpdater, GeoVariable, dense_pull, dense_push,
                             round_phases)
from tfpsx.modes.group import DONE
from tfpsx.modes.staleness import wait_for_slowest
from tfpsx.modes.sync import (GradientAccumulators, SyncGroup, SyncState, SyncTableUpdater,
                              TableAccumulators, replicas_to_aggregate)

__all__ = ["BARRIER", "PULL", "PUSH", "DONE", "GeoCounters", "GeoSchedule", "GeoState",
           "GeoTableUpdater", "GeoVariable", "GradientAccumulators", "SyncGroup",
           "SyncState", "SyncTableUpdater", "TableAccumulators", "dense_pull", "dense_push",
           "replicas_to_aggregate", "round_phases", "wait_for_slowest"]

"""GEO (k-step geometric SGD), once for both front-ends: the rule, the copies, the hot
rows, the round, the schedule, the tables.

Each worker trains a local copy; every K local steps it syncs with the parameter servers.
Dense variables and tables, one rule (:mod:`.rule`):

* push: ``delta = (local - old) / N``; ``old += delta``; the PS value ``+= delta`` (a
  table pushes only the rows changed in the worker's copy since its last push, whole:
  n = 1, and the PS combines the pushes of a row that several workers trained from the
  same value, see :mod:`.rule`);
* pull: ``local += global - old``; ``old = global`` (a table pulls the rows any worker
  changed on the PS since this worker's last pull: the PS keeps a changed-key set per
  worker).

A table's copy (:class:`GeoTable`, :mod:`.copies`) is a
:class:`~tfpsx.embedding.row_copy.RowCopy`, synced by that module's push and pull (a
worker cache syncs by them too, whatever the mode: GEO hands it :class:`GeoTable` as its
``copy_type``), plus what the front-end tracks to make the copy the global table after
the last round (:func:`take_global`). The rows a round cannot sum right train on the PS
(:class:`HotRows`, :mod:`.hot_rows`; by contention: :mod:`.contention`).

Which table and dense rule a job runs is chosen by its worker count unless named
(:func:`rule_for`). A **round** (:mod:`.round`) is a sequence of phases, which a front-end
interprets: a TF1 session runs them one ``session.run`` each; Keras chains them inside
its compiled step. The **schedule** (:mod:`.schedule`) says when a round runs, for both
front-ends. A table joins GEO through :class:`GeoTableUpdater` (:mod:`.tables`).
"""

from tfpsx.embedding.row_copy import table_readers
from tfpsx.modes.geo.contention import Contention
from tfpsx.modes.geo.copies import (GeoTable, copy_trains, distrust_snapshot, take_global,
                                    track_snapshot)
from tfpsx.modes.geo.hot_rows import HotRows
from tfpsx.modes.geo.round import (BARRIER, PULL, PUSH, GeoCounters, caches_locked,
                                   count_round, count_trained, dense_size, round_phases,
                                   row_trip_bytes)
from tfpsx.modes.geo.rule import (GEO_AUTO_KN, GEO_AUTO_KN_BACKGROUND, GEO_EARLIER,
                                  GEO_FOR_MANY, GEO_HOT_PER_ROUND_BACKGROUND,
                                  GEO_MANY_WORKERS, GeoVariable, adopt_rule,
                                  auto_hot_per_round, auto_kn, combine_for, dense_async,
                                  dense_pull, dense_push, fold_pulled, hot_count,
                                  hot_per_round, log_rule, named_rule_keys, pull_ops,
                                  push_ops, rows_and_bytes, rule_for, rule_workers,
                                  shares_slots, wire_dtype)
from tfpsx.modes.geo.schedule import (GEO_K_WITHOUT_EPOCH, MIN_ROUNDS_PER_EPOCH, GeoSchedule,
                                      auto_k_steps, few_rounds)
from tfpsx.modes.geo.tables import GeoState, GeoTableUpdater

__all__ = [
    "BARRIER", "PULL", "PUSH", "GeoCounters", "caches_locked", "count_round", "count_trained",
    "dense_size", "row_trip_bytes", "round_phases", "adopt_rule", "GEO_EARLIER",
    "GEO_FOR_MANY", "GEO_MANY_WORKERS", "GeoVariable",
    "dense_async", "dense_pull", "dense_push", "fold_pulled", "hot_count", "hot_per_round",
    "log_rule", "named_rule_keys",
    "pull_ops", "push_ops", "rows_and_bytes", "rule_for", "rule_workers", "shares_slots",
    "wire_dtype",
    "GEO_AUTO_KN", "GEO_AUTO_KN_BACKGROUND", "GEO_HOT_PER_ROUND_BACKGROUND",
    "auto_hot_per_round", "GEO_K_WITHOUT_EPOCH", "MIN_ROUNDS_PER_EPOCH",
    "GeoSchedule", "auto_k_steps", "auto_kn", "few_rounds", "GeoState", "GeoTableUpdater",
    "combine_for", "Contention", "GeoTable", "HotRows", "copy_trains", "distrust_snapshot",
    "table_readers", "take_global", "track_snapshot",
]

"""``DistributedStrategy``: how workers share their updates (Paddle Fleet's shape).

The strategy is the modes' options, for both front-ends: it only holds and validates
them; :attr:`DistributedStrategy.mode` is the one place that turns them into a mode
name, which each front-end resolves to its implementation of the mode (graph mode's
:func:`tfpsx.training.modes.mode_for`, Keras's ``tfpsx.keras.modes``).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

from tfpsx.modes.geo import (GEO_AUTO_KN, GEO_AUTO_KN_BACKGROUND, GEO_FOR_MANY,
                             GEO_HOT_PER_ROUND_BACKGROUND, GEO_K_WITHOUT_EPOCH,
                             MIN_ROUNDS_PER_EPOCH)

_CONFIG_KEYS = {
    "k_steps": f"GEO: local steps between syncs (0: plain async; 'auto': "
               f"{MIN_ROUNDS_PER_EPOCH} rounds in Keras fit's epoch and K x workers <= "
               f"{GEO_AUTO_KN_BACKGROUND}, {GEO_AUTO_KN} in deterministic rounds)",
    "max_staleness": "bounded staleness: steps a worker may run ahead of the slowest",
    "geo_sync_in_train_thread": "GEO: sync between steps in the training thread (tests)",
    "replicas_to_aggregate": "sync: gradients aggregated per step (default: every worker)",
    "sync_reduction": "sync: how a step's gradients combine, 'mean' (default, as TF's "
                      "SyncReplicasOptimizer) or 'sum' (as tf.distribute's all-reduce, for "
                      "a loss already divided by the global batch)",
    "geo_wire_dtype": "GEO: the dtype table rows' values travel in ('float32', "
                      "'bfloat16', 'float16'; their slots: geo_slot_wire_dtype); values stay "
                      "float32 on both sides",
    "geo_slot_wire_dtype": "GEO: the dtype a table row's optimizer slots travel in where "
                           "they travel with it (geo_table_rule='shared_slots'): "
                           "'bfloat16' (default) or 'float32'; both sides keep them float32",
    "geo_table_rule": "GEO: how the PS adds the workers' pushes of a table row: "
                      "'shared_slots' (summed, the optimizer's slots shared) or 'average'; "
                      "default: by the worker count (docs/modes.md, GEO at N workers)",
    "geo_dense": "GEO: how the dense weights train: 'async' (on the parameter servers) or "
                 "'copies' (each worker's copy, synced every k_steps); default: by the "
                 "worker count",
    "geo_hot_count": "GEO: an id seen at least this many times in a worker's batch trains "
                     "its row on the parameter servers, async (0: never); default: by the "
                     "worker count",
    "geo_hot_per_round": "GEO: an id the workers would train at least this many times in "
                         "one round (the worker count x how many of this worker's last "
                         "k_steps batches held it) trains its row on the parameter servers, "
                         f"async (0: never; 'auto': {GEO_AUTO_KN} in deterministic rounds, "
                         f"{GEO_HOT_PER_ROUND_BACKGROUND} in background ones); default: by "
                         "the worker count",
    "geo_table_choice": "GEO: 'auto' (each table runs rounds while they move fewer bytes "
                        "than async would, else trains async: the chief decides from GEO's "
                        "traffic counters, re-checked as the job runs) or 'rounds' (every "
                        "table runs rounds); default: by the worker count",
    "geo_pull_ahead": "GEO (background rounds): 0 (default) pulls every row the others "
                      "changed each round; S >= 1 pulls only the changed rows this worker "
                      "reads before its next pull lands (Keras: fit's batches read ahead; "
                      "graph mode: the ids a tfpsx.GeoReadAhead records), and every "
                      "changed row each S-th round",
}
_GEO_TABLE_CHOICES = ("auto", "rounds")
_WIRE_DTYPES = ("float32", "bfloat16", "float16")
_SLOT_WIRE_DTYPES = ("float32", "bfloat16")
_SYNC_REDUCTIONS = ("mean", "sum")
_GEO_TABLE_RULES = ("average", "shared_slots")
_GEO_DENSE = ("copies", "async")
_DENSE = ("ps", "allreduce")


class DistributedStrategy:
    """How workers share their updates (Paddle Fleet's ``DistributedStrategy``).

    Args:
      a_sync: False for sync training, True for async / GEO / bounded staleness.
      a_sync_configs: ``k_steps`` (int >= 0; > 0 selects GEO; "auto" selects GEO with
        K = the first Keras ``fit``'s epoch steps //
        :data:`~tfpsx.modes.geo.MIN_ROUNDS_PER_EPOCH` (that many rounds an epoch), with
        K x the worker count at most :data:`~tfpsx.modes.geo.GEO_AUTO_KN_BACKGROUND` in
        background rounds, :data:`~tfpsx.modes.geo.GEO_AUTO_KN` in deterministic ones;
        graph mode knows no epoch: :data:`~tfpsx.modes.geo.GEO_K_WITHOUT_EPOCH` within
        the same bound),
        ``max_staleness``
        (int >= 0), ``geo_sync_in_train_thread`` (bool), ``geo_wire_dtype`` (GEO: table
        rows travel as "float32", "bfloat16" or "float16"), ``geo_slot_wire_dtype``
        (GEO: the dtype a row's optimizer slots travel in where they travel with it,
        under shared slots: "bfloat16" (default) or "float32"; a push sends
        their deltas, its rounding kept in the copy for the row's next push, a pull
        their values less the optimizer's initial ones, and both sides keep them
        float32),
        ``geo_table_rule`` (GEO:
        "shared_slots": the PS sums the workers' pushes of a row, and each row travels
        with its optimizer slots, so every worker's Adagrad accumulator holds every
        worker's gradients, as in async; "average": the PS averages the pushes of a row
        several workers trained), ``geo_dense`` (GEO: "async": the dense weights train
        on the parameter servers, async, and only the tables run GEO's rounds;
        "copies": each worker trains a copy, averaged every K steps), ``geo_hot_count``
        (GEO: an id seen at least this many times in a worker's batch is read and
        trained on the parameter servers, async, not in the worker's copy; 0: never),
        ``geo_hot_per_round`` (GEO: the same for an id the workers would train at least
        this many times in one round, estimated as the worker count x how many of this
        worker's last K batches held it; "auto": :data:`~tfpsx.modes.geo.GEO_AUTO_KN`
        in deterministic rounds (the K x N that ``k_steps="auto"`` keeps there),
        :data:`~tfpsx.modes.geo.GEO_HOT_PER_ROUND_BACKGROUND` in background ones (half
        the K x N it keeps there); 0: never), ``geo_table_choice`` (GEO: "auto": a table
        whose rounds move more bytes than async would for the same rows trains async,
        decided by the chief from GEO's traffic counters and re-checked as the job runs
        (:mod:`tfpsx.modes.geo.choice`); "rounds": every table runs rounds),
        ``geo_pull_ahead`` (GEO, background rounds: 0, the default, a round pulls every
        row the other workers changed; S >= 1: only the changed rows this worker's steps
        read before its next pull lands, read ahead from ``fit``'s input or, in graph
        mode, recorded by the program in a ``tfpsx.GeoReadAhead``, and every changed row
        each S-th round; exact: a row left on the PS is one the copy does not read until
        a pull brings it).
        A key left unnamed is chosen by the job's worker count: from
        :data:`~tfpsx.modes.geo.GEO_MANY_WORKERS` workers GEO's rule for many workers
        (:data:`~tfpsx.modes.geo.GEO_FOR_MANY`: shared slots, dense weights async, hot
        rows on the PS), which keeps async's quality at any N; below, the earlier rule
        (:data:`~tfpsx.modes.geo.GEO_EARLIER`: averaged rows, dense copies, no hot rows),
        as good there and faster (docs/modes.md, "GEO at N workers"). A table with a
        worker cache follows the same rule; the hybrid mode all-reduces its dense
        weights, unless the key is named (then the combination is an error),
        ``replicas_to_aggregate`` (sync only).
      collective: True for collective mode (a job of workers only,
        ``tfpsx.init(is_collective=True)``): every weight on every worker, gradients
        averaged by all-reduce each step (Fleet's ``fleet.init(is_collective=True)``);
        ``a_sync`` and ``a_sync_configs`` do not apply.
      dense: where the dense weights train. ``"ps"`` (default): on the parameter
        servers, in the mode of ``a_sync`` / ``a_sync_configs``. ``"allreduce"``: the
        hybrid mode: every worker holds every dense weight, their gradients are averaged
        over the workers by all-reduce each step (differently seeded workers start from
        worker 0's values), while ``DynamicEmbedding`` tables stay on the parameter
        servers in the async or GEO mode ``a_sync_configs`` select.

    Raises:
      ValueError: an unknown key or a bad value (the message names both).

    Example:
      >>> tfpsx.DistributedStrategy(a_sync=True, a_sync_configs={"k_steps": 100}).mode
      'geo'
    """

    def __init__(self, a_sync: bool = True, a_sync_configs: Optional[Dict] = None,
                 collective: bool = False, dense: str = "ps"):
        if dense not in _DENSE:
            raise ValueError(f"DistributedStrategy: dense must be one of {list(_DENSE)} "
                             f"(where dense weights train), got {dense!r}")
        if dense == "allreduce" and collective:
            raise ValueError("DistributedStrategy: dense='allreduce' is the hybrid mode "
                             "(tables on the parameter servers); collective=True has no "
                             "servers and all-reduces every weight already: set one of them")
        if dense == "allreduce" and not a_sync:
            raise ValueError("DistributedStrategy: dense='allreduce' (the hybrid mode) trains "
                             "the tables async or GEO; a_sync=False (sync) does not apply: "
                             "the dense weights are averaged every step already")
        self.dense = dense
        if not isinstance(collective, bool):
            raise ValueError("DistributedStrategy: collective must be True or False, got "
                             f"{collective!r}")
        if collective and a_sync_configs:
            raise ValueError("DistributedStrategy: collective=True averages every step by "
                             f"all-reduce; a_sync_configs {a_sync_configs} do not apply")
        self.collective = collective
        if not isinstance(a_sync, bool):
            raise ValueError(f"DistributedStrategy: a_sync must be True or False, got {a_sync!r}")
        configs = dict(a_sync_configs or {})
        unknown = sorted(set(configs) - set(_CONFIG_KEYS))
        if unknown:
            raise ValueError(f"DistributedStrategy: unknown a_sync_configs key(s) {unknown}; "
                             f"expected some of {sorted(_CONFIG_KEYS)}")
        self.a_sync = a_sync
        # k_steps="auto": K from the first fit's epoch length and the worker count
        # (tfpsx.modes.geo.auto_k_steps); until the modes choose it, GEO_K_WITHOUT_EPOCH.
        self.k_auto = configs.get("k_steps") == "auto"
        self.k_steps = (GEO_K_WITHOUT_EPOCH if self.k_auto
                        else _int_config(configs, "k_steps", 0))
        self.max_staleness = _int_config(configs, "max_staleness", 0)
        self.geo_sync_in_train_thread = configs.get("geo_sync_in_train_thread", False)
        if not isinstance(self.geo_sync_in_train_thread, bool):
            raise ValueError("DistributedStrategy: a_sync_configs['geo_sync_in_train_thread'] "
                             f"must be True or False, got {self.geo_sync_in_train_thread!r}")
        self.replicas_to_aggregate = configs.get("replicas_to_aggregate")
        self.sync_reduction = configs.get("sync_reduction", "mean")
        if self.sync_reduction not in _SYNC_REDUCTIONS:
            raise ValueError("DistributedStrategy: a_sync_configs['sync_reduction'] must be "
                             f"one of {list(_SYNC_REDUCTIONS)}, got {self.sync_reduction!r}")
        if "sync_reduction" in configs and a_sync:
            raise ValueError("DistributedStrategy: a_sync_configs['sync_reduction'] applies "
                             "to sync (a_sync=False); got a_sync=True")
        self.geo_wire_dtype = configs.get("geo_wire_dtype", "float32")
        if self.geo_wire_dtype not in _WIRE_DTYPES:
            raise ValueError("DistributedStrategy: a_sync_configs['geo_wire_dtype'] must be one "
                             f"of {list(_WIRE_DTYPES)}, got {self.geo_wire_dtype!r}")
        self.geo_slot_wire_dtype = configs.get("geo_slot_wire_dtype", "bfloat16")
        if self.geo_slot_wire_dtype not in _SLOT_WIRE_DTYPES:
            raise ValueError("DistributedStrategy: a_sync_configs['geo_slot_wire_dtype'] must "
                             f"be one of {list(_SLOT_WIRE_DTYPES)}, got "
                             f"{self.geo_slot_wire_dtype!r} (float16's range ends at 65,504, "
                             "which an accumulator passes)")
        # The GEO rule's keys the user named; an unnamed one is None here, chosen by the
        # worker count when the job runs (tfpsx.modes.geo.rule_for).
        self.geo_explicit = frozenset(k for k in GEO_FOR_MANY if k in configs)
        self.geo_table_rule = configs.get("geo_table_rule")
        if "geo_table_rule" in configs and self.geo_table_rule not in _GEO_TABLE_RULES:
            raise ValueError("DistributedStrategy: a_sync_configs['geo_table_rule'] must be one "
                             f"of {list(_GEO_TABLE_RULES)}, got {self.geo_table_rule!r}")
        self.geo_dense = configs.get("geo_dense")
        if "geo_dense" in configs and self.geo_dense not in _GEO_DENSE:
            raise ValueError("DistributedStrategy: a_sync_configs['geo_dense'] must be one "
                             f"of {list(_GEO_DENSE)}, got {self.geo_dense!r}")
        self.geo_hot_count = (_int_config(configs, "geo_hot_count", 0)
                              if "geo_hot_count" in configs else None)
        self.geo_hot_per_round = configs.get("geo_hot_per_round")
        if self.geo_hot_per_round != "auto" and "geo_hot_per_round" in configs:
            self.geo_hot_per_round = _int_config(configs, "geo_hot_per_round", 0)
        self.geo_table_choice = configs.get("geo_table_choice")
        if "geo_table_choice" in configs and self.geo_table_choice not in _GEO_TABLE_CHOICES:
            raise ValueError("DistributedStrategy: a_sync_configs['geo_table_choice'] must be "
                             f"one of {list(_GEO_TABLE_CHOICES)}, got "
                             f"{self.geo_table_choice!r}")
        self.geo_pull_ahead = _int_config(configs, "geo_pull_ahead", 0)
        if self.geo_pull_ahead and not self.k_steps:
            raise ValueError("DistributedStrategy: a_sync_configs['geo_pull_ahead'] applies "
                             "to GEO (k_steps > 0); got geo_pull_ahead="
                             f"{self.geo_pull_ahead} with k_steps=0")
        if self.geo_pull_ahead and self.geo_sync_in_train_thread:
            raise ValueError("DistributedStrategy: a_sync_configs['geo_pull_ahead']="
                             f"{self.geo_pull_ahead} reads ahead for background rounds; "
                             "deterministic rounds (geo_sync_in_train_thread=True) pull every "
                             "changed row: set one of them")
        for key in sorted(self.geo_explicit):
            if not self.k_steps:
                raise ValueError(f"DistributedStrategy: a_sync_configs['{key}'] applies to "
                                 f"GEO (k_steps > 0); got {key}={configs[key]!r} with k_steps=0")
        if self.geo_dense == "async" and dense == "allreduce":
            raise ValueError("DistributedStrategy: dense='allreduce' (the hybrid mode) "
                             "all-reduces the dense weights every step; "
                             f"a_sync_configs['geo_dense']={self.geo_dense!r} does not apply")
        if not a_sync and (self.k_steps or self.max_staleness):
            raise ValueError("DistributedStrategy: k_steps and max_staleness need a_sync=True "
                             f"(got a_sync=False with {configs})")
        if self.k_steps and self.max_staleness:
            raise ValueError("DistributedStrategy: GEO (k_steps > 0) and max_staleness are "
                             "separate modes; set one of them")
        if dense == "allreduce" and self.max_staleness:
            raise ValueError("DistributedStrategy: dense='allreduce' (the hybrid mode) steps "
                             "every worker together; max_staleness="
                             f"{self.max_staleness} does not apply (tables: async or GEO)")

    @property
    def hybrid(self) -> bool:
        """The hybrid mode: dense weights all-reduced, tables on the servers in ``mode``."""
        return self.dense == "allreduce"

    @property
    def mode(self) -> str:
        """"sync", "async", "geo", "staleness" or "collective" (the only place options
        become a mode). In the hybrid mode (``dense="allreduce"``), the tables' mode."""
        if self.collective:
            return "collective"
        if not self.a_sync:
            return "sync"
        if self.k_steps > 0:
            return "geo"
        return "staleness" if self.max_staleness > 0 else "async"

    def key(self) -> Tuple:
        """Every option: two strategies with the same key train the same way."""
        return (self.a_sync, self.k_steps, self.k_auto, self.max_staleness,
                self.geo_sync_in_train_thread,
                self.replicas_to_aggregate, self.sync_reduction, self.geo_wire_dtype,
                self.geo_slot_wire_dtype, self.collective, self.dense,
                self.geo_table_rule, self.geo_dense, self.geo_hot_count,
                self.geo_hot_per_round, self.geo_table_choice, self.geo_pull_ahead)

    def __repr__(self):
        if self.collective:
            return "DistributedStrategy(mode='collective')"
        extra = ""
        if self.mode == "geo" and self.geo_sync_in_train_thread:
            extra = ", geo_sync_in_train_thread=True"
        if self.mode == "geo" and self.geo_wire_dtype != "float32":
            extra += f", geo_wire_dtype={self.geo_wire_dtype!r}"
        if self.mode == "geo" and self.geo_slot_wire_dtype != "bfloat16":
            extra += f", geo_slot_wire_dtype={self.geo_slot_wire_dtype!r}"
        if self.mode == "geo":
            for key in ("geo_table_rule", "geo_dense", "geo_hot_count", "geo_hot_per_round",
                        "geo_table_choice"):
                if key in self.geo_explicit:
                    extra += f", {key}={getattr(self, key)!r}"
            if self.geo_pull_ahead:
                extra += f", geo_pull_ahead={self.geo_pull_ahead}"
        if self.mode == "sync" and self.replicas_to_aggregate is not None:
            extra = f", replicas_to_aggregate={self.replicas_to_aggregate}"
        if self.mode == "sync" and self.sync_reduction != "mean":
            extra += f", sync_reduction={self.sync_reduction!r}"
        if self.hybrid:
            extra += ", dense='allreduce'"
        k_steps = "'auto'" if self.k_auto else self.k_steps
        return (f"DistributedStrategy(mode={self.mode!r}, k_steps={k_steps}, "
                f"max_staleness={self.max_staleness}{extra})")


def _int_config(configs, key, default):
    value = configs.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"DistributedStrategy: a_sync_configs[{key!r}] must be an int >= 0 "
                         f"({_CONFIG_KEYS[key]}), got {value!r}")
    return value

"""GEO's rule: for dense variables, for table rows (the mechanism of a table's copy is
:mod:`tfpsx.embedding.row_copy`'s, which a worker cache syncs by too), the push and pull
phases of dense variables and tables together, and which rule a job runs by its worker
count (:func:`rule_for`). The functions build ops in graph mode and run in eager mode or
``tf.function``.

GEO mode pushes table rows with n = 1: a row's whole delta, what async would have
applied, k steps late (averaging by N, GEO's rule for dense weights, would train a row
that one worker alone touched N times slower, and keep pushing the rest of its delta at
every sync).

Whole deltas overshoot on a hot row: when several workers trained it from the same
value between two syncs, each delta is a full move (each worker's optimizer saw only its
share of the gradients), and their sum is several moves (measured at 4 workers on the
Criteo job: the model after the final sync had log loss 1.29 where each worker's copy
had 0.50). So the PS combines the parallel pushes of a row (``GeoTable.combine``, the
PS's ``accumulate(combine=...)``, :mod:`tfpsx.embedding.row_copy`), chosen by
:func:`combine_for`:

* ``"mean"`` (deterministic GEO: every worker pushes, they meet, they pull): the row
  moves to the mean of the round's deltas, exact in any order, since every push of a
  round started from the value of the last one (the PS keeps the others' move since
  the pusher's pull: it adds (delta - their move) / (1 + c));
* ``"scaled"`` (GEO's background communicator): a push adds delta / (1 + c). Its
  pushes start from different values (a worker pulled before or after another's push),
  and the mean would drag a row back towards each pusher's stale copy (measured, 1 PS +
  4 workers, 300k rows, k=10, one run each: final AUC 0.734 against 0.766 scaled and
  0.763 summed); scaled, a hot row that every worker trains moves by about the mean of
  their deltas once the syncs interleave (1 + 1/2 + 1/3 + 1/4 = 2.08 deltas for four
  pushes from one value, not 4).

**Shared slots** (``GeoTable(share_slots=True)``, a strategy's ``geo_table_rule=
"shared_slots"``): a row travels as ``[value | optimizer slots]`` both ways, the PS sums
every push whole, and ``old`` keeps the slots of the last pull too. The PS's slots then
hold every worker's share (Adagrad's accumulator: every worker's squared gradients, as in
async), each pull brings them back, and a worker's local steps keep async's size; with
local slots a worker's accumulator sees ~1/N of a hot row's gradients and its steps are
~sqrt(N) times async's, which the average then scales back by N. Measured with
``benchmarks/geo_scale.py`` (docs/modes.md): the better rule while K x N is small, worse
than the average at K=10 from 8 workers.

The rows the copies cannot train right train on the PS: :mod:`.hot_rows`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from tfpsx.embedding.row_copy import row_bytes, table_pull, table_push
from tfpsx.modes.geo.choice import IDLE, SKIP
from tfpsx.modes.geo.copies import GeoTable

logger = logging.getLogger("tfpsx")


@dataclasses.dataclass
class GeoVariable:
    """A dense variable in GEO: the PS value, this worker's copy and its snapshot."""
    local: tf.Variable     # trained by this worker
    old: tf.Variable       # the global value at the last pull (plus this worker's pushes)
    global_: tf.Variable   # on the parameter server
    # A counter that its step increments by a read and an assign (Keras 3's
    # ``optimizer.iterations``: ``assign(self + 1)``, not atomic): a round's pull adds
    # here, never to ``local``, which the step alone writes, since a pull that landed
    # between the step's read and assign was lost with it (one round of the others'
    # steps each time: the job's step count came out 4-8 short, 1 run in ~3 under load).
    # The step folds it into ``local`` (:func:`fold_pulled`).
    pulled: Optional[tf.Variable] = None

    def take(self, value) -> None:
        """(Eagerly, no round in flight) this worker's copy and snapshot become
        ``value``, nothing pulled left to fold."""
        self.local.assign(value)
        self.old.assign(value)
        if self.pulled is not None:
            self.pulled.assign(tf.zeros_like(self.pulled))


def dense_push(v: GeoVariable, n: float):
    """delta = (local - old) / n; old += delta; global += delta (n = 1: a counter, e.g.
    the step count, whose global value is the sum of every worker's)."""
    with tf.compat.v1.device(v.local.device):
        delta = v.local.read_value() - v.old.read_value()
        if v.pulled is not None:
            # read after ``local``: a fold between the two reads is then counted a
            # round later, never twice (:func:`fold_pulled` takes from here first)
            with tf.control_dependencies([delta]):
                delta = delta + v.pulled.read_value()
        if n != 1:
            delta = delta / n
        bump_old = v.old.assign_add(delta)
    with tf.compat.v1.device(v.global_.device):
        push = v.global_.assign_add(delta)
    return tf.group(bump_old, push)


def dense_pull(v: GeoVariable, after=()):
    """After the ops ``after``: local += global - old (``pulled`` += for a counter that
    has it); old = global."""
    with tf.control_dependencies(list(after)):
        with tf.compat.v1.device(v.global_.device):
            g = v.global_.read_value()
    into = v.local if v.pulled is None else v.pulled
    with tf.compat.v1.device(v.local.device):
        g = tf.identity(g)  # one transfer, used twice
        with tf.control_dependencies([into.assign_add(g - v.old.read_value())]):
            return v.old.assign(g)


def fold_pulled(v: GeoVariable):
    """In the step, before it reads ``local`` (the step alone writes it): what the
    pulls added to ``v.pulled`` since the last fold moves into ``local``, taken out of
    ``pulled`` first (atomic adds both; a round's pull may add between them)."""
    with tf.compat.v1.device(v.local.device):
        count = v.pulled.read_value()
        with tf.control_dependencies([v.pulled.assign_sub(count)]):
            return v.local.assign_add(count, read_value=False)


def push_ops(dense: List[GeoVariable], tables: List[GeoTable], n: float, step=None,
             counters: List[GeoVariable] = (), per_table: Optional[list] = None,
             actions: Optional[Sequence[str]] = None):
    """The push phase: every dense pair (``delta / n``), every counter pair (n = 1: the
    job's step count) and every table's changed rows (whole deltas, n = 1: a row is
    rarely trained by every worker between two syncs; none for a table whose action is
    IDLE: :mod:`.choice`). Returns (ops, (rows, bytes) the tables sent); ``per_table``
    (a list) gets each table's rows sent."""
    ops = [dense_push(v, n) for v in dense] + [dense_push(v, 1) for v in counters]
    rows = []
    for i, t in enumerate(tables):
        if actions is not None and actions[i] == IDLE:
            rows.append((tf.constant(0, tf.int32), 0))
            continue
        op, count = table_push(t, 1.0, step)
        ops.append(op)
        rows.append((count, row_bytes(t)))
    if per_table is not None:
        per_table.extend(tf.cast(count, tf.int64) for count, _ in rows)
    return ops, rows_and_bytes(rows)


def pull_ops(variables: List[GeoVariable], tables: List[GeoTable], after=(),
             actions: Optional[Sequence[str]] = None, per_table: Optional[list] = None,
             among: Optional[Sequence] = None):
    """The pull phase, after the ops ``after``: every pair and the rows any worker
    changed on the PS. Under ``geo_table_choice="auto"``, ``actions`` says per table
    what its pull does (:mod:`.choice`: none for a table that trains async, SKIP or
    IDLE; else a pull). ``among`` (per table, a key vector or None): the pull brings
    only the changed rows among those keys (``geo_pull_ahead``: the rows this worker
    reads before its next pull lands; :func:`tfpsx.embedding.row_copy.table_pull`).
    Returns (ops, (rows, bytes) the tables received); ``per_table`` (a list) gets each
    table's rows pulled."""
    ops = [dense_pull(v, after) for v in variables]
    rows = []
    for i, t in enumerate(tables):
        if actions is not None and actions[i] in (SKIP, IDLE):
            rows.append((tf.constant(0, tf.int32), 0))
            continue
        op, count = table_pull(t, after, None if among is None else among[i])
        ops.append(op)
        rows.append((count, row_bytes(t)))
    if per_table is not None:
        per_table.extend(tf.cast(count, tf.int64) for count, _ in rows)
    return ops, rows_and_bytes(rows)


def combine_for(deterministic: bool) -> str:
    """How a GEO table's round pushes combine on the PS (see the module doc)."""
    return "mean" if deterministic else "scaled"


def rows_and_bytes(rows) -> Tuple[tf.Tensor, tf.Tensor]:
    """(rows, bytes) as int64 tensors of ``(count, bytes a row)`` entries
    (:func:`tfpsx.embedding.row_copy.row_bytes`: its key, values and slots as they
    travel)."""
    counts = [(tf.cast(r, tf.int64), size) for r, size in rows]
    return (tf.add_n([tf.constant(0, tf.int64)] + [r for r, _ in counts]),
            tf.add_n([tf.constant(0, tf.int64)] + [r * size for r, size in counts]))


# The most steps of one row a round may sum (docs/modes.md, "GEO at N workers"):
# k_steps="auto" keeps K x N within it for every row, and GEO's hot rows by contention
# (geo_hot_per_round) train on the PS the rows for which a user's K does not (in
# background rounds those above GEO_HOT_PER_ROUND_BACKGROUND, below). In
# deterministic rounds GEO_AUTO_KN (word2vec in the harness: within 1% of async's loss up
# to K x N = 40, 2% over at 80; the Criteo job held further), in background ones
# GEO_AUTO_KN_BACKGROUND, whose pull lands up to K steps after its push, so that a copy
# trains on rows up to 2K steps old (word2vec at that latency: 1.4% over at K x N = 40,
# at most 0.6% at 20).
GEO_AUTO_KN = 40
GEO_AUTO_KN_BACKGROUND = 20


def auto_kn(deterministic: bool) -> int:
    """The most steps of a row a round may sum (K x N for ``k_steps="auto"``):
    :data:`GEO_AUTO_KN` in deterministic rounds, :data:`GEO_AUTO_KN_BACKGROUND` in
    background ones."""
    return GEO_AUTO_KN if deterministic else GEO_AUTO_KN_BACKGROUND


# geo_hot_per_round="auto" in background rounds: half of GEO_AUTO_KN_BACKGROUND. The
# contention estimate sees a row's rate in one worker's last K batches, scaled by N;
# rows that pass under it still sum up to the bound's steps in a round, and in
# background rounds a copy trains on them up to 2K steps old (the harness, word2vec, N=8,
# K=10: 1.6% over async's loss at 20, 0.9% at 10; every cell of both jobs within 0.002
# AUC / 1% at 10: K=10 at N=2-8, "auto" at N=2-32, K=100 at N=8). In deterministic
# rounds the bound is GEO_AUTO_KN's (within target at N=2-32, K=10, and N=8, K=100).
GEO_HOT_PER_ROUND_BACKGROUND = GEO_AUTO_KN_BACKGROUND // 2


def auto_hot_per_round(deterministic: bool) -> int:
    """``geo_hot_per_round="auto"``: :data:`GEO_AUTO_KN` in deterministic rounds,
    :data:`GEO_HOT_PER_ROUND_BACKGROUND` in background ones."""
    return GEO_AUTO_KN if deterministic else GEO_HOT_PER_ROUND_BACKGROUND


# GEO's rule for many workers (docs/modes.md, "GEO at N workers"): its keys' values. A
# key left unnamed is chosen by the job's worker count: this rule from GEO_MANY_WORKERS
# workers on, the earlier rule (GEO_EARLIER) below, where it kept async's quality and is
# faster. A table with a worker cache follows the same rule; the hybrid mode's
# all-reduced dense weights keep their own unless the key is named (then a combination
# that does not apply is an error).
GEO_MANY_WORKERS = 3
GEO_FOR_MANY = {"geo_table_rule": "shared_slots", "geo_dense": "async", "geo_hot_count": 4,
                "geo_hot_per_round": "auto", "geo_table_choice": "auto"}
GEO_EARLIER = {"geo_table_rule": "average", "geo_dense": "copies", "geo_hot_count": 0,
               "geo_hot_per_round": 0, "geo_table_choice": "rounds"}


def rule_workers(config) -> int:
    """The worker count GEO's rule and ``k_steps="auto"`` are decided by: the workers the
    job started with (the scheduler's TFPSX_WORKER_NUM, which every node is told, a
    joiner too), else the job's count. A rule is a job-wide decision: a worker that
    joins a running job must run the same one as the others, on the same rows."""
    started = getattr(config, "initial_worker_num", None)
    return int(started) if started else int(config.worker_num)


def rule_for(options, worker_num: int) -> Dict[str, object]:
    """GEO's rule for a job of ``worker_num`` workers: ``geo_table_rule``, ``geo_dense``,
    ``geo_hot_count``, ``geo_hot_per_round``. A key the user named keeps its value; the
    others come from the rule for many workers at ``GEO_MANY_WORKERS`` workers or more,
    else from the earlier rule (docs/modes.md, "GEO at N workers"). The hybrid mode's
    dense weights are all-reduced: its ``geo_dense`` is "copies" (unused)."""
    base = GEO_FOR_MANY if worker_num >= GEO_MANY_WORKERS else GEO_EARLIER
    rule = {key: getattr(options, key, None) for key in base}
    rule = {key: base[key] if value is None else value for key, value in rule.items()}
    if getattr(options, "dense", "ps") == "allreduce":
        rule["geo_dense"] = "copies"
    return rule


def shares_slots(options, worker_num: int) -> bool:
    """Whether GEO's tables travel with their optimizer slots, summed on the PS
    (``geo_table_rule="shared_slots"``; :func:`rule_for`)."""
    return rule_for(options, worker_num)["geo_table_rule"] == "shared_slots"


def dense_async(options, worker_num: int) -> bool:
    """Whether GEO's dense weights train async on the PS (``geo_dense="async"``) rather
    than as worker copies synced every K steps (:func:`rule_for`)."""
    return rule_for(options, worker_num)["geo_dense"] == "async"


def hot_count(options, worker_num: int) -> int:
    """How often an id must occur in a worker's batch for GEO to train its row on the PS
    (``geo_hot_count``, 0: never; :func:`rule_for`)."""
    return int(rule_for(options, worker_num)["geo_hot_count"] or 0)


def hot_per_round(options, worker_num: int) -> int:
    """The most steps of one row a round may sum before GEO trains the row on the PS
    (``geo_hot_per_round``; 0: never; "auto": :func:`auto_hot_per_round` of the
    rounds' kind; :func:`rule_for`)."""
    value = rule_for(options, worker_num)["geo_hot_per_round"]
    if value == "auto":
        return auto_hot_per_round(options.geo_sync_in_train_thread)
    return int(value or 0)


def named_rule_keys(options) -> frozenset:
    """The GEO rule's keys the user named (a default gives way where it does not apply)."""
    return getattr(options, "geo_explicit", frozenset())


def log_rule(options, worker_num: int, now: Optional[int] = None) -> None:
    """Says which GEO rule the job runs, and why (once per process and rule); ``now``:
    the job's workers now, when more joined than it started with."""
    rule = rule_for(options, worker_num)
    line = ", ".join(f"{key}={value!r}" for key, value in rule.items())
    if line not in _LOGGED_RULES:
        _LOGGED_RULES.add(line)
        named = sorted(named_rule_keys(options))
        joined = (f"; the job's rule, of the {worker_num} workers it started with, though "
                  f"{now} train now" if now is not None and now != worker_num else "")
        logger.info("GEO at %d worker(s): %s (%s%s)", worker_num, line,
                    f"named: {', '.join(named)}; the others by the worker count" if named else
                    f"by the worker count: the rule for many workers from {GEO_MANY_WORKERS}, "
                    "docs/modes.md", joined)


_LOGGED_RULES: set = set()


def adopt_rule(state, options, config) -> None:
    """A front-end's GEO state (``GeoState``) takes the job's rule from ``options`` for
    the job of ``config`` (its :func:`rule_workers`): how rounds run
    (``in_train_thread``), the wire dtypes (the values', the slots'), the table rule
    (``share_slots``, ``hot_count``, ``hot_per_round``) and the keys the user named; the
    rule is logged (once)."""
    workers = rule_workers(config)
    state.in_train_thread = options.geo_sync_in_train_thread
    state.wire_dtype = wire_dtype(options)
    state.slot_wire_dtype = tf.as_dtype(getattr(options, "geo_slot_wire_dtype", "bfloat16"))
    state.share_slots = shares_slots(options, workers)
    state.hot_count = hot_count(options, workers)
    state.hot_per_round = hot_per_round(options, workers)
    state.table_choice = rule_for(options, workers)["geo_table_choice"] == "auto"
    state.named = named_rule_keys(options)
    log_rule(options, workers, now=int(config.worker_num))


def wire_dtype(options) -> Optional[tf.DType]:
    """The dtype GEO's table rows travel in (None: float32), from a
    ``DistributedStrategy``'s ``geo_wire_dtype``."""
    name = getattr(options, "geo_wire_dtype", "float32")
    return None if name == "float32" else tf.as_dtype(name)

"""GEO's model quality at N workers, against async at the same N: many logical workers in
one process (issue 40).

Each logical worker is what a GEO worker holds: a local copy of the table (a
``ShardedTable`` with the table's own optimizer, trained by the core's ``apply``) and its
snapshot ``old``, dense copies (``GeoVariable``), and rounds run by the mode core's own
phases (``tfpsx.modes.geo.push_ops`` / ``pull_ops``: a table copy's push and pull of
``tfpsx.embedding.row_copy`` with GEO's combine on the PS, the dense rule ``/ N``). The "PS" is
the same op library's tables and variables in this process. What is not the job's own
code: the model's step (a Wide&Deep written with TF ops, the Criteo example's shape:
one table of dim+1 rows, field-aware ids, Adagrad on the table, Adam on the dense part)
and the schedule (workers step in lock-step, one after another).

Schedules:

* ``async``: every step, the N workers' gradients are computed on one snapshot of the
  global model and applied one after another by the PS's optimizers (each gradient is up
  to N-1 updates old, as N async workers' are);
* ``geo``, deterministic rounds (``--latency 0``): every K local steps every worker
  pushes, then every worker pulls (the rounds of ``geo_sync_in_train_thread``);
* ``geo``, background rounds (``--latency L``): every worker pushes after its K-th step
  and its pull lands L steps later, while it trains on (the communicator's round trip).

GEO's rule for many workers (docs/modes.md, "GEO at N workers") is ``--rules shared
--async_part dense --hot_count 4 --hot_per_round auto``: tables by shared slots, the
dense part trained as async trains it (``geo_dense="async"``), the ids seen 4+ times in a
worker's batch and the rows too contended for a round read and trained on the PS
through the product's ``tfpsx.modes.geo.HotRows`` (``geo_hot_count``) and
``tfpsx.modes.geo.contention`` (``geo_hot_per_round``).

Jobs (``--job``): ``criteo`` (below) and ``word2vec`` (skip-gram with negative sampling
over the word2vec example's planted-topic corpus, one table of input and output vectors,
no dense part, held-out loss: ``_geo_scale_word2vec.py``).

Data: the Criteo-format planted model of ``examples/criteo/make_data.py`` (the same
fields, Zipf vocabularies and interactions), ids hashed to ``--buckets`` per field (so
that 32 copies of the table fit in memory). Deterministic: the same seed gives the same
numbers. Prints one line per run and, with ``--json``, writes them.

  python benchmarks/geo_scale.py --workers 2,4,8,16,32 --k 10 --rules shared \
      --async_part dense --hot_count 4 --hot_per_round auto
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Dict, List

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples", "criteo"))
import make_data  # noqa: E402  (the planted Criteo-format model)
sys.path.insert(0, HERE)
import _geo_scale_word2vec as word2vec  # noqa: E402

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfpsx import embedding  # noqa: E402
from tfpsx.embedding import row_copy  # noqa: E402
from tfpsx.embedding.row_copy import table_readers  # noqa: E402
from tfpsx.embedding.sharding import ShardedTable  # noqa: E402
from tfpsx.modes import geo  # noqa: E402
from tfpsx.modes.geo import Contention, GeoTable  # noqa: E402

DEVICE = "/cpu:0"
# The job (--job): criteo (the Wide&Deep) or word2vec (_geo_scale_word2vec); use_job
# sets these.
JOB = "criteo"
FIELDS, INTS = make_data.CAT_FIELDS, make_data.INT_FIELDS


def batch_spec():
    return [tf.TensorSpec([None, FIELDS], tf.int64), tf.TensorSpec([None, INTS], tf.float32),
            tf.TensorSpec([None], tf.float32)]


def use_job(name: str) -> None:
    global JOB, FIELDS, INTS
    JOB = name
    FIELDS, INTS = ((word2vec.FIELDS, word2vec.INTS) if name == "word2vec" else
                    (make_data.CAT_FIELDS, make_data.INT_FIELDS))


def make_dense(name: str, dim: int, hidden, init=None):
    return (word2vec.NoDense() if JOB == "word2vec" else Dense(name, dim, hidden, init))


def apply_dense(adam, grads, variables) -> None:
    if variables:  # (word2vec has none)
        adam.apply(grads, variables)


# How a round adds the N workers' dense deltas: the divisor of each.
# "moments": the values' deltas summed, Adam's moments shared (their deltas averaged,
# pulled back: every worker's Adam steps by the mean of the workers' moments) and its step
# count summed (the bias correction of every worker's steps).
# "outer": the mean, then an outer optimizer on the round's move of the global part
# (DiLoCo / SlowMo / BMUF): Nesterov momentum over the averaged delta, --outer_lr and
# --outer_momentum (deterministic rounds).
DENSE_RULES = {"mean": lambda n: float(n), "sqrt": lambda n: float(np.sqrt(n)),
               "sum": lambda n: 1.0, "moments": lambda n: 1.0, "outer": lambda n: float(n)}


class OuterStep:
    """The outer optimizer of ``--dense outer`` on the global dense variables: after a
    round's (averaged) pushes, d = global - its value after the last round; m = mu m + d;
    global = that value + lr (mu m + d) (Nesterov)."""

    def __init__(self, variables, lr: float, momentum: float):
        self.vars, self.lr, self.mu = variables, lr, momentum
        self.prev = [tf.Variable(v.read_value()) for v in variables]
        self.m = [tf.Variable(tf.zeros_like(v)) for v in variables]

    def __call__(self) -> None:
        for v, prev, m in zip(self.vars, self.prev, self.m):
            d = v.read_value() - prev.read_value()
            m.assign(self.mu * m + d)
            v.assign(prev + self.lr * (self.mu * m + d))
            prev.assign(v.read_value())


# ----------------------------------------------------------------------------- data

def criteo_data(rows: int, eval_rows: int, buckets: int, seed: int):
    """(train, eval): dicts of ``keys`` [n, 26] int64 (field << 32 | value bucket), ``x``
    [n, 13] float32 (log1p of the counts, missing 0), ``y`` [n] float32; eval also has
    the planted probabilities ``p``."""
    rng = np.random.default_rng(seed)
    planted = make_data.Planted()

    def part(n):
        ids, ints, missing = make_data.draw(rng, n)
        p = make_data._sigmoid(planted.logit(ids, ints, missing))
        y = (rng.random(n) < p).astype(np.float32)
        keys = (np.arange(FIELDS, dtype=np.int64)[None, :] << 32) | (ids % buckets)
        x = np.where(missing, 0.0, np.log1p(np.maximum(ints, 0))).astype(np.float32)
        return {"keys": keys, "x": x / 4.0, "y": y, "p": p}

    return part(rows), part(eval_rows)


# ----------------------------------------------------------------------------- the model

class Dense:
    """The Wide&Deep's dense weights: a deep MLP over the embeddings and counts, and the
    counts' wide weights."""

    def __init__(self, name: str, dim: int, hidden, init=None):
        sizes = [FIELDS * dim + INTS] + list(hidden) + [1]
        shapes = []
        for i in range(len(sizes) - 1):
            shapes += [(f"w{i}", (sizes[i], sizes[i + 1])), (f"b{i}", (sizes[i + 1],))]
        shapes.append(("count", (INTS, 1)))
        rng = np.random.default_rng(1)
        self.vars = []
        with tf.device(DEVICE):
            for j, (n, shape) in enumerate(shapes):
                value = (init[j] if init is not None else
                         (rng.normal(0, np.sqrt(2.0 / shape[0]), shape) if n[0] == "w"
                          else np.zeros(shape)).astype(np.float32))
                self.vars.append(tf.Variable(value, name=f"{name}_{n}"))

    def values(self):
        return [v.numpy() for v in self.vars]

    def logits(self, rows, x):
        emb, wide = rows[..., :-1], tf.reduce_sum(rows[..., -1], axis=1)
        h = tf.concat([tf.reshape(emb, [tf.shape(emb)[0], -1]), x], 1)
        layers = (len(self.vars) - 1) // 2
        for i in range(layers):
            h = tf.matmul(h, self.vars[2 * i]) + self.vars[2 * i + 1]
            if i < layers - 1:
                h = tf.nn.relu(h)
        return tf.squeeze(h, 1) + wide + tf.squeeze(tf.matmul(x, self.vars[-1]), 1)


def gradients(table, dense: Dense, keys, x, y, step=None):
    """(unique keys, their row gradients, dense gradients, loss) of one batch, reading
    ``table``'s rows (a missing key: its initial row, as the optimizer will start it);
    ``table`` a ``geo.HotRows``: the product's split (hot ids on the PS)."""
    hot = None
    if isinstance(table, geo.HotRows):
        looked = table.lookup_unique(keys, train=True, step=step)
        unique, index, rows, hot = (looked.unique_keys, looked.indices, looked.unique_rows,
                                    looked.hot)
    else:
        unique, index = tf.unique(tf.reshape(keys, [-1]))
        rows = table.shards[0].find(unique)[0]
    with tf.GradientTape() as tape:
        tape.watch(rows)
        batch_rows = tf.reshape(tf.gather(rows, index), [tf.shape(keys)[0], FIELDS, -1])
        loss = (word2vec.objective(batch_rows) if JOB == "word2vec" else
                tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
                    labels=y, logits=dense.logits(batch_rows, x))))
    grads = tape.gradient(loss, [rows] + dense.vars)
    if hot is not None:
        return unique, grads[0], grads[1:], loss, hot
    return unique, grads[0], grads[1:], loss


# ----------------------------------------------------------------------------- runs

class Run:
    """One (schedule, N, K, rule) run over the same data."""

    runs = 0

    def __init__(self, args, data, n: int, tag: str):
        # Tables are process-wide resources by name: every run gets its own.
        Run.runs += 1
        tag = f"run{Run.runs}_{tag}"
        self.args, self.data, self.n, self.tag = args, data, n, tag
        self.dim = args.dim + (JOB == "criteo")  # (criteo: the wide weight)
        self.hidden = [int(h) for h in args.hidden.split(",") if h]
        init = embedding.normal(stddev=word2vec.INIT_STDDEV if JOB == "word2vec" else 0.01)
        self.make_table = lambda name, optimizer: ShardedTable(
            f"{tag}/{name}", self.dim, devices=[DEVICE], initializer=init,
            optimizer=optimizer, seed=3)
        self.global_table = self.make_table("global", embedding.Adagrad(args.table_lr))
        self.global_dense = make_dense(f"{tag}_global", args.dim, self.hidden)
        self.step = tf.Variable(0, dtype=tf.int64)

    def batches(self):
        """Worker w's batches: the training rows dealt out round-robin, one epoch."""
        d, b = self.data, self.args.batch
        steps = len(d["y"]) // (b * self.n)
        for s in range(steps):
            yield s, [(d["keys"][(s * self.n + w) * b:(s * self.n + w + 1) * b],
                       d["x"][(s * self.n + w) * b:(s * self.n + w + 1) * b],
                       d["y"][(s * self.n + w) * b:(s * self.n + w + 1) * b])
                      for w in range(self.n)]

    def evaluate(self, table: ShardedTable, dense: Dense) -> Dict[str, float]:
        e = self.data_eval
        if JOB == "word2vec":
            return word2vec.metrics(lambda keys: tf.reshape(
                table.shards[0].find(tf.reshape(keys, [-1]))[0], [keys.shape[0], FIELDS, -1]), e)
        probs = []
        for i in range(0, len(e["y"]), 8192):
            keys = tf.constant(e["keys"][i:i + 8192])
            rows = tf.reshape(table.shards[0].find(tf.reshape(keys, [-1]))[0],
                              [keys.shape[0], FIELDS, -1])
            probs.append(tf.sigmoid(dense.logits(rows, tf.constant(e["x"][i:i + 8192]))).numpy())
        p = np.concatenate(probs)
        return {"auc": make_data.auc(e["y"], p), "logloss": make_data.logloss(e["y"], p)}


def run_async(args, data, data_eval, n: int) -> Dict[str, float]:
    r = Run(args, data, n, f"async_n{n}")
    r.data_eval = data_eval
    adam = keras.optimizers.Adam(args.lr)

    @tf.function(input_signature=batch_spec())
    def grads_of(keys, x, y):
        return gradients(r.global_table, r.global_dense, keys, x, y)

    @tf.function(reduce_retracing=True)
    def apply(unique, row_grads, dense_grads):
        r.global_table.apply(unique, row_grads, r.step)
        apply_dense(adam, dense_grads, r.global_dense.vars)
        r.step.assign_add(1)

    for _, batches in r.batches():
        got = [grads_of(*b) for b in batches]  # one snapshot
        for unique, row_grads, dense_grads, _ in got:
            apply(unique, row_grads, dense_grads)
    return r.evaluate(r.global_table, r.global_dense)


def hot_keys(keys: np.ndarray, hot_fields, hot_count: int) -> np.ndarray:
    """A step's hot rows: those of the ``hot_fields`` (``--hot_vocab``), or the keys that
    occur at least ``hot_count`` times in the batch (``--hot_count``)."""
    if hot_fields:
        return np.unique(keys[:, hot_fields])
    unique, counts = np.unique(keys, return_counts=True)
    return unique[counts >= hot_count]


class RoundDamping:
    """``--alpha`` (an experiment, deterministic rounds, shared slots): a row that c
    workers pushed in a round moves by the sum of their deltas / c**alpha (alpha 0: the
    sum, the rule; 1: their mean); its optimizer slots stay summed."""

    def __init__(self, table, geos, alpha: float):
        self.table, self.alpha = table, alpha
        counts: Dict[int, int] = {}
        for t in geos:
            local, old = t.local.export(), t.old.export()
            lk, ok = local["keys"].numpy(), old["keys"].numpy()
            ov = dict(zip(ok.tolist(), old["values"].numpy()))
            lv = local["values"].numpy()
            for i, key in enumerate(lk.tolist()):
                prev = ov.get(key)
                if prev is None or np.any(lv[i] != prev):
                    counts[key] = counts.get(key, 0) + 1
        self.keys = np.array([k for k, c in counts.items() if c > 1], np.int64)
        self.c = np.array([counts[k] for k in self.keys.tolist()], np.float32)
        self.base = (table.lookup(tf.constant(self.keys)).numpy() if len(self.keys) else None)

    def after_pushes(self):
        if not len(self.keys):
            return
        now = self.table.lookup(tf.constant(self.keys)).numpy()
        scale = self.c[:, None] ** -self.alpha
        self.table.insert(tf.constant(self.keys), self.base + (now - self.base) * scale)


def wire_dtype(name: str):
    """A row part's wire dtype (--wire, --slot_wire), as GEO's: None for the default
    (float32 values; slots as the values), else the dtype named."""
    return None if name == "" else tf.as_dtype(name)


class AheadPull:
    """``--pull ahead:S`` (issue 62, part 2): a worker's table pull brings the rows the
    others changed that its next steps will read (until its next pull lands), and every
    other changed row once it has waited S rounds (S = 0: no bound); the rest stay
    stale in its copy, their keys kept on the worker. Counts the rows pulled against
    the rows a pull of every changed row would have brought (``changed``)."""

    def __init__(self, spec: str, data, n: int, batch: int, k: int):
        kind, bound = spec.split(":")
        # ahead: the steps until the next pull lands; behind: the K steps before it (the
        # rows this worker trained since its last push, which a product worker knows
        # without reading its input ahead)
        self.behind, self.bound, self.k = kind == "behind", int(bound), k
        self.data, self.n, self.batch = data, n, batch
        self.stale: Dict[int, Dict[int, int]] = {}  # worker -> {key: round marked}
        self.rounds: Dict[int, int] = {}
        self.pulled = self.changed = 0

    def ahead(self, w: int, step: int, steps: int) -> np.ndarray:
        """The keys worker w's steps ``step .. step + steps - 1`` look up."""
        b, n, keys = self.batch, self.n, self.data["keys"]
        parts = [keys[(s * n + w) * b:(s * n + w + 1) * b] for s in range(step, step + steps)]
        parts = [p for p in parts if len(p)]
        return np.unique(np.concatenate(parts).reshape(-1)) if parts else np.zeros([0], np.int64)

    def pull(self, t, w: int, step: int, steps: int) -> None:
        me = tf.constant(t.reader, tf.int64)
        taken = np.concatenate([c.numpy() for c in t.global_.on_shards(
            lambda i, shard: shard.take_changed(me))])
        stale = self.stale.setdefault(w, {})
        r = self.rounds[w] = self.rounds.get(w, 0) + 1
        for key in taken.tolist():
            stale.setdefault(key, r)
        self.changed += len(taken)  # (what a pull of every changed row brings now)
        keys = np.fromiter(stale.keys(), np.int64, len(stale))
        if not len(keys):
            return
        marked = np.fromiter(stale.values(), np.int64, len(stale))
        near = (self.ahead(w, max(0, step - self.k), self.k) if self.behind else
                self.ahead(w, step, steps))
        want = np.isin(keys, near)
        if self.bound:
            want |= r - marked >= self.bound
        keys = keys[want]
        for key in keys.tolist():
            del stale[key]
        self.pulled += len(keys)
        if len(keys):
            pull_keys(t, tf.constant(keys, tf.int64))


def pull_keys(t, keys) -> None:
    """A pull of ``keys`` only: local += global - old, old = global (row_copy.table_pull's
    update, for the keys given)."""
    zero = tf.constant(0, tf.int64)
    rows = t.global_.stitched(lambda i, s, k: s.find(k, with_slots=t.share_slots)[0], keys)
    rows = row_copy.from_wire(t, row_copy.to_wire(t, rows, pull=True), pull=True)
    t.local.shards[0].accumulate(keys, rows - row_copy.local_rows(t.old, keys, t.share_slots),
                                 zero, skip_reader=0, with_slots=t.share_slots)
    row_copy.set_rows(t, t.old, keys, rows)


def run_geo(args, data, data_eval, n: int, k: int, rule: str, latency: int,
            dense_rule: str) -> Dict[str, float]:
    r = Run(args, data, n, f"geo_{rule}_n{n}_k{k}_l{latency}")
    r.data_eval = data_eval
    optimizer = embedding.Adagrad(args.table_lr)
    workers = []
    shared_moments: List[tf.Variable] = []  # the "PS" values of Adam's moments, step count
    moment_pairs: Dict[int, list] = {}  # worker -> its moments' pairs (--dense moments)
    start = r.global_dense.values()
    shared = rule == "shared"  # sum, with the optimizer's slots shared
    for w in range(n):
        local = r.make_table(f"local{w}", optimizer)
        old = r.make_table(f"old{w}", optimizer if shared else None)
        t = GeoTable(r.global_table, local, old, DEVICE, reader=w,
                     combine="sum" if shared else rule, share_slots=shared,
                     wire=wire_dtype(args.wire), slot_wire=wire_dtype(args.slot_wire))
        local_dense = make_dense(f"{r.tag}_local{w}", args.dim, r.hidden, init=start)
        old_dense = make_dense(f"{r.tag}_old{w}", args.dim, r.hidden, init=start)
        pairs = [geo.GeoVariable(l, o, g) for l, o, g in
                 zip(local_dense.vars, old_dense.vars, r.global_dense.vars)]
        adam = keras.optimizers.Adam(args.lr)
        if dense_rule == "moments":
            adam.build(local_dense.vars)
            state = [v.value for v in adam._momentums + adam._velocities]
            if not shared_moments:
                with tf.device(DEVICE):
                    shared_moments.extend(tf.Variable(tf.zeros_like(v)) for v in state)
                    shared_moments.append(tf.Variable(tf.constant(0, tf.int64)))
            with tf.device(DEVICE):
                olds = [tf.Variable(tf.zeros_like(v)) for v in state]
                old_it = tf.Variable(tf.constant(0, tf.int64))
            moment_pairs[w] = [geo.GeoVariable(l, o, g) for l, o, g in
                               zip(state, olds, shared_moments[:-1])]
            # (the step count: summed, with the values)
            pairs = pairs + [geo.GeoVariable(adam.iterations.value, old_it, shared_moments[-1])]
        workers.append((t, local_dense, pairs, adam))
    for t, *_ in workers:
        table_readers(t)

    # --async_part: one part trained as async trains it (every worker's gradient computed
    # on one snapshot of the global part, applied by the PS's optimizer one after
    # another), the other by GEO: which part loses what GEO loses.
    async_dense, async_tables = args.async_part == "dense", args.async_part == "tables"
    global_adam = keras.optimizers.Adam(args.lr)

    # --hot_count with --hot_rule ps: the product's split (geo.HotRows, a strategy's
    # geo_hot_count): a batch's hot ids read and trained on the PS, applied after every
    # worker's step read the same snapshot (as the async peer's); --hot_rule sync: they
    # train in the copy, pushed and pulled after every step.
    # --hot_per_round B: with them the rows too contended for a round (the product's
    # geo_hot_per_round, tfpsx.modes.geo.contention: N x how many of the worker's
    # last K batches held the row >= B), on the PS.
    per_round = (geo.auto_hot_per_round(deterministic=not latency)
                 if args.hot_per_round == "auto"
                 else int(args.hot_per_round))
    hot_on_ps = ((bool(args.hot_count) and args.hot_rule == "ps" or per_round > 0)
                 and not async_tables)

    def make_step(t, dense, adam):
        contention = (Contention(f"w{t.reader}", DEVICE, n, lambda: k, per_round)
                      if per_round else None)
        table = (r.global_table if async_tables else
                 geo.HotRows(t, args.hot_count, contention) if hot_on_ps else t.local)
        dense = r.global_dense if async_dense else dense

        @tf.function(input_signature=batch_spec())
        def step(keys, x, y):
            out = gradients(table, dense, keys, x, y, r.step)
            unique, row_grads, dense_grads = out[:3]
            hot = out[4] if len(out) > 4 else None
            if not async_tables and not hot_on_ps:
                t.local.apply(unique, row_grads, r.step)
            if not async_dense:
                apply_dense(adam, dense_grads, dense.vars)
            return unique, row_grads, dense_grads, hot
        return step

    @tf.function(reduce_retracing=True)
    def apply_global(unique, row_grads, dense_grads):
        if async_tables:
            r.global_table.apply(unique, row_grads, r.step)
        if async_dense:
            apply_dense(global_adam, dense_grads, r.global_dense.vars)

    def make_apply(t):
        split = geo.HotRows(t, args.hot_count)

        @tf.function(reduce_retracing=True)
        def apply_split(unique, row_grads, hot):
            split.apply(unique, row_grads, hot, r.step)
        return apply_split

    step_fns = [make_step(t, d, a) for t, d, _, a in workers]
    outer = (OuterStep(r.global_dense.vars, args.outer_lr, args.outer_momentum)
             if dense_rule == "outer" and not async_dense else None)
    apply_fns = {id(t): make_apply(t) for t, *_ in workers} if hot_on_ps else {}
    if async_dense:
        for _, _, pairs, _ in workers:
            pairs.clear()
    if async_tables:
        workers = [(None,) + tuple(w[1:]) for w in workers]
    # Rows of the fields with at most --hot_vocab values (trained by every worker at
    # every step: dense weights in all but name) sync every step, the rest every k.
    hot_fields = [f for f in range(FIELDS) if JOB == "criteo" and
                  min(make_data.VOCAB[f], args.buckets) <= args.hot_vocab]
    pending = {}  # worker -> local step at which its pull lands
    ahead = (AheadPull(args.pull, data, n, args.batch, k) if args.pull != "all" and
             not async_tables else None)

    def pull(w, pairs, t, steps_now):
        """Worker w's pull (its table's as --pull says), after ``steps_now`` local steps."""
        if ahead is None or t is None:
            geo.pull_ops(pairs, [t] if t else [])
            return
        geo.pull_ops(pairs, [])
        ahead.pull(t, w, steps_now, k + latency)

    # Rows pushed every step (hot) and the distinct rows the workers' steps trained.
    moved = {"hot_rows": 0, "step_rows": 0}
    local_steps = 0
    for s, batches in r.batches():
        got = [step_fns[w](*b) for w, b in enumerate(batches)]
        if args.async_part:
            for g in got:
                apply_global(*g[:3])
        if hot_on_ps:
            for (t, _, _, _), (unique, row_grads, _, hot) in zip(workers, got):
                apply_fns[id(t)](unique, row_grads, hot)
                moved["hot_rows"] += int(tf.reduce_sum(tf.cast(hot, tf.int32)))
                moved["step_rows"] += int(tf.size(unique))
        local_steps = s + 1
        if (hot_fields or args.hot_count) and not hot_on_ps and not async_tables \
                and local_steps % k:
            for w, (t, _, _, _) in enumerate(workers):
                hot = hot_keys(batches[w][0], hot_fields, args.hot_count)
                moved["hot_rows"] += len(hot)
                moved["step_rows"] += len(np.unique(batches[w][0]))
                row_copy.push_rows(t, tf.constant(hot), 1.0, r.step)
            for t, _, _, _ in workers:
                row_copy.table_pull(t)
        dense_k = args.dense_k or k
        tables_due, dense_due = local_steps % k == 0, local_steps % dense_k == 0
        if tables_due or dense_due:
            def parts(t, pairs):
                return (pairs if dense_due else []), ([t] if tables_due and t else [])

            damp = (RoundDamping(r.global_table, [w[0] for w in workers], args.alpha)
                    if args.alpha and tables_due and shared and not latency else None)
            for w, (t, _, pairs, _) in enumerate(workers):
                if w in pending:
                    # One communicator runs one round at a time: the round in flight
                    # ends (its pull lands) before the next starts (a product worker
                    # waits for it: tfpsx.modes.geo.GeoSchedule).
                    pull(w, pairs + moment_pairs.get(w, []), t, local_steps)
                    del pending[w]
                geo.push_ops(*parts(t, pairs), DENSE_RULES[dense_rule](n), r.step)
                if moment_pairs and dense_due:  # the moments: averaged
                    geo.push_ops(moment_pairs[w], [], float(n), r.step)
                if latency:
                    pending[w] = local_steps + latency
            if damp is not None:
                damp.after_pushes()
            if outer is not None and dense_due:
                outer()
            if not latency:
                for w, (t, _, pairs, _) in enumerate(workers):
                    dense, tabs = parts(t, pairs)
                    if tabs:
                        pull(w, dense + (moment_pairs.get(w, []) if dense_due else []), t,
                             local_steps)
                    else:
                        geo.pull_ops(dense + (moment_pairs.get(w, []) if dense_due else []), [])
        for w, due in list(pending.items()):
            if local_steps >= due:
                t, _, pairs, _ = workers[w]
                pull(w, pairs + moment_pairs.get(w, []), t, local_steps)
                del pending[w]
        r.step.assign_add(1)
    # The final round: every worker's unpushed steps.
    for t, _, pairs, _ in workers:
        geo.push_ops(pairs, [t] if t else [], DENSE_RULES[dense_rule](n), r.step)
    if outer is not None:
        outer()
    out = r.evaluate(r.global_table, r.global_dense)
    if moved["step_rows"]:
        out["hot_share"] = round(moved["hot_rows"] / moved["step_rows"], 4)
    if ahead is not None:
        out.update(pulled_rows=ahead.pulled, changed_rows=ahead.changed)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--job", default="criteo", choices=["criteo", "word2vec"],
                   help="criteo: the Wide&Deep (AUC); word2vec: skip-gram over the planted-"
                        "topic corpus (held-out loss)")
    p.add_argument("--workers", default="1,2,4,8,16,32")
    p.add_argument("--k", default="10,100", help="GEO's k_steps values; 'auto': the "
                   "product's k_steps='auto' for the epoch, N and the rounds "
                   "(tfpsx.modes.geo.auto_k_steps)")
    p.add_argument("--min_rounds", type=int, default=0,
                   help="a smaller K where the epoch would hold fewer rounds (0: never)")
    p.add_argument("--rules", default="scaled,sum", help="the PS's combine of a row's pushes")
    p.add_argument("--dense", default="mean", help="how a round adds the dense deltas: "
                   f"{', '.join(DENSE_RULES)}")
    p.add_argument("--outer_lr", type=float, default=0.7, help="--dense outer's")
    p.add_argument("--outer_momentum", type=float, default=0.9, help="--dense outer's")
    p.add_argument("--alpha", type=float, default=0.0,
                   help="an experiment (deterministic rounds, --rules shared): a row that "
                        "c workers pushed in a round moves by the sum of their deltas / "
                        "c**alpha")
    p.add_argument("--dense_k", type=int, default=0,
                   help="the dense part's rounds every this many steps (0: k's)")
    p.add_argument("--hot_vocab", type=int, default=0,
                   help="rows of fields with at most this many values sync every step")
    p.add_argument("--hot_count", type=int, default=0,
                   help="rows seen at least this often in a worker's batch sync every step")
    p.add_argument("--hot_per_round", default="0",
                   help="rows the N workers would train this often in a round (N x how many "
                        "of a worker's last K batches held them) are read and trained on "
                        "the PS (the product's geo_hot_per_round; 'auto': 40 in "
                        "deterministic rounds, 10 in background ones; 0: never)")
    p.add_argument("--hot_rule", default="ps", choices=["ps", "sync"],
                   help="hot rows: read and trained on the PS (the product's geo_hot_count) "
                        "or trained in the copy and synced every step")
    p.add_argument("--latency", default="0",
                   help="background rounds: a pull lands this many steps after the push "
                        "(0: deterministic rounds; 'k': K steps, the latest a product "
                        "worker lets it land before it waits)")
    p.add_argument("--rows", type=int, default=131072)
    p.add_argument("--eval_rows", type=int, default=32768)
    p.add_argument("--buckets", type=int, default=8192, help="values per field (hashed)")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--hidden", default="64,32")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam's, for the dense part")
    p.add_argument("--table_lr", type=float, default=0.05, help="Adagrad's, for the table")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no_async", action="store_true")
    p.add_argument("--async_part", default="", choices=["", "dense", "tables"],
                   help="train this part as async does, the other by GEO (what loses what)")
    p.add_argument("--wire", default="", choices=["", "float32", "bfloat16", "float16"],
                   help="the dtype a row's values travel in (geo_wire_dtype)")
    p.add_argument("--slot_wire", default="", choices=["", "float32", "bfloat16"],
                   help="with --rules shared: the dtype a row's slots travel in "
                        "(geo_slot_wire_dtype; default: as the values)")
    p.add_argument("--pull", default="all",
                   help="a table pull's rows: all (every row the others changed), or "
                        "ahead:S (those the worker's steps until its next pull read, and "
                        "any changed row once it waited S rounds; S=0: no bound), or "
                        "behind:S (those its last K steps read, and the same bound)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.pull != "all":
        kind, _, bound = args.pull.partition(":")
        if kind not in ("ahead", "behind") or not bound.isdigit():
            p.error(f"--pull {args.pull!r}: expected all, ahead:S or behind:S (S >= 0 rounds)")
        if args.async_part == "tables":
            p.error("--pull with --async_part tables: the tables train async, no copy pulls")
    tf.random.set_seed(args.seed)
    use_job(args.job)
    data, data_eval = (word2vec.data(args.rows, args.eval_rows, args.seed)
                       if args.job == "word2vec" else
                       criteo_data(args.rows, args.eval_rows, args.buckets, args.seed))
    results: List[dict] = []

    def report(**row):
        results.append(row)
        print(json.dumps(row), flush=True)

    for n in [int(v) for v in args.workers.split(",")]:
        if not args.no_async:
            t0 = time.time()
            report(mode="async", n=n, **run_async(args, data, data_eval, n),
                   seconds=round(time.time() - t0, 1))
        for k_max in args.k.split(","):
            # --min_rounds R: K shrinks until the epoch holds R rounds (GEO's advice)
            steps = args.rows // (args.batch * n)
            k_max = (geo.auto_k_steps(steps, n, deterministic=args.latency == "0")
                     if k_max == "auto" else int(k_max))
            k = min(k_max, max(1, steps // args.min_rounds)) if args.min_rounds else k_max
            latency = k if args.latency == "k" else int(args.latency)
            for rule in args.rules.split(","):
                for dense_rule in args.dense.split(","):
                    t0 = time.time()
                    part = {"async_part": args.async_part} if args.async_part else {}
                    if args.min_rounds:
                        part.update(k_max=k_max, min_rounds=args.min_rounds)
                    if args.hot_per_round != "0":
                        part.update(hot_per_round=args.hot_per_round)
                    part.update({key: getattr(args, key) for key in ("wire", "slot_wire")
                                 if getattr(args, key) != ""})
                    if args.pull != "all":
                        part.update(pull=args.pull)
                    report(mode="geo", n=n, k=k, rule=rule, dense=dense_rule, **part,
                           latency=latency, rounds=(args.rows // (args.batch * n)) // k,
                           **run_geo(args, data, data_eval, n, k, rule, latency,
                                     dense_rule),
                           seconds=round(time.time() - t0, 1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

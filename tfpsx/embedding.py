"""Dynamic embedding tables that live on the parameter servers and grow with new ids.

Example (graph mode, on a worker after ``tfpsx.init()``)::

  emb = tfpsx.embedding.DynamicEmbedding(
      "user", dim=16, initializer=tfpsx.embedding.normal(stddev=0.05),
      optimizer=tfpsx.embedding.Adagrad(learning_rate=0.1))
  looked = emb.lookup_unique(ids)              # ids: any int shape
  loss = model(looked.embeddings)              # ids' shape + [16]
  train_op = emb.minimize(loss, [looked], step=global_step)

Eager / tf.function: pass the tape, then apply the gradients::

  with tf.GradientTape() as tape:
      looked = emb.lookup_unique(ids, tape=tape)
      loss = model(looked.embeddings)
  emb.apply_gradients(looked, tape.gradient(loss, looked.unique_rows), step=step)

The table is sharded over the PS tasks of the resolved cluster by ``key mod S``; each
shard is a ``TfpsxHashTable`` resource on ``/job:ps/task:i`` named ``<name>/part_<i>``.
Lookups deduplicate ids first, so each distinct id crosses the network once. Without a
cluster (no ``tfpsx.init()``), the table is one local shard, for development.
Checkpoints: a table is a Trackable, saved and restored by ``tf.train.Checkpoint`` and
``tf.compat.v1.train.Saver`` with all keys, values, optimizer slots and metadata; the
saved form is shard-free, so a table restores into a different number of shards.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence

import tensorflow as tf

from tfpsx._loader import load_ops

_INT64_MIN = -(2 ** 63)


# ----------------------------------------------------------------------------- initializers

@dataclasses.dataclass(frozen=True)
class Initializer:
    """How a new key's row is drawn: a pure function of (seed, key), so every PS and every
    restart draws the same row."""
    kind: str
    a: float = 0.0
    b: float = 0.0


def zeros() -> Initializer:
    return Initializer("zeros")


def constant(value: float) -> Initializer:
    return Initializer("constant", float(value))


def uniform(minval: float = -0.05, maxval: float = 0.05) -> Initializer:
    if not minval < maxval:
        raise ValueError(f"uniform initializer: expected minval < maxval, got {minval}, {maxval}")
    return Initializer("uniform", float(minval), float(maxval))


def normal(mean: float = 0.0, stddev: float = 0.05) -> Initializer:
    if stddev < 0:
        raise ValueError(f"normal initializer: expected stddev >= 0, got {stddev}")
    return Initializer("normal", float(mean), float(stddev))


# ----------------------------------------------------------------------------- optimizers

class SparseOptimizer:
    """A server-side optimizer: its slots live beside each row on the PS."""
    name = "optimizer"
    slot_init: Sequence[float] = ()

    def apply(self, ops, handle, keys, grads, step):
        raise NotImplementedError

    @staticmethod
    def _f(value):
        return tf.cast(value, tf.float32)


class SGD(SparseOptimizer):
    name = "sgd"

    def __init__(self, learning_rate: float = 0.01):
        self.learning_rate = learning_rate

    def apply(self, ops, handle, keys, grads, step):
        return ops.tfpsx_hash_table_apply_sgd(handle, keys, grads, self._f(self.learning_rate), step)


class Adagrad(SparseOptimizer):
    name = "adagrad"

    def __init__(self, learning_rate: float = 0.01, initial_accumulator_value: float = 0.1,
                 epsilon: float = 0.0):
        self.learning_rate, self.epsilon = learning_rate, epsilon
        self.slot_init = (float(initial_accumulator_value),)

    def apply(self, ops, handle, keys, grads, step):
        return ops.tfpsx_hash_table_apply_adagrad(handle, keys, grads, self._f(self.learning_rate),
                                                  self._f(self.epsilon), step)


class Adam(SparseOptimizer):
    """Lazy Adam: only the looked-up rows move; bias correction uses the global step (>= 1)."""
    name = "adam"
    slot_init = (0.0, 0.0)

    def __init__(self, learning_rate: float = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-7):
        self.learning_rate, self.beta1, self.beta2, self.epsilon = learning_rate, beta1, beta2, epsilon

    def apply(self, ops, handle, keys, grads, step):
        f = self._f
        return ops.tfpsx_hash_table_apply_adam(handle, keys, grads, f(self.learning_rate),
                                               f(self.beta1), f(self.beta2), f(self.epsilon), step)


class Ftrl(SparseOptimizer):
    """FTRL-Proximal, as ``tf.compat.v1.train.FtrlOptimizer`` (slots: z, accumulator)."""
    name = "ftrl"

    def __init__(self, learning_rate: float = 0.01, learning_rate_power: float = -0.5,
                 l1: float = 0.0, l2: float = 0.0, initial_accumulator_value: float = 0.1):
        if learning_rate_power > 0:
            raise ValueError(f"Ftrl: learning_rate_power must be <= 0, got {learning_rate_power}")
        self.learning_rate, self.lr_power, self.l1, self.l2 = learning_rate, learning_rate_power, l1, l2
        self.slot_init = (0.0, float(initial_accumulator_value))

    def apply(self, ops, handle, keys, grads, step):
        f = self._f
        return ops.tfpsx_hash_table_apply_ftrl(handle, keys, grads, f(self.learning_rate),
                                               f(self.lr_power), f(self.l1), f(self.l2), step)


OPTIMIZERS = {"sgd": SGD, "adagrad": Adagrad, "adam": Adam, "ftrl": Ftrl}


def _optimizer(spec) -> Optional[SparseOptimizer]:
    if spec is None or isinstance(spec, SparseOptimizer):
        return spec
    if isinstance(spec, str) and spec.lower() in OPTIMIZERS:
        return OPTIMIZERS[spec.lower()]()
    raise ValueError(f"unknown optimizer {spec!r}; expected one of {', '.join(OPTIMIZERS)} or a "
                     "tfpsx.embedding.SparseOptimizer (SGD, Adagrad, Adam, Ftrl)")


# ----------------------------------------------------------------------------- the table

@dataclasses.dataclass
class EmbeddingLookup:
    """What ``lookup_unique`` returns: the rows of the distinct ids and the embeddings."""
    unique_keys: tf.Tensor    # [u] int64
    unique_rows: tf.Tensor    # [u, dim]: differentiate the loss with respect to this
    indices: tf.Tensor        # [n] position of each id in unique_keys
    embeddings: tf.Tensor     # ids' shape + [dim]


def _step(step):
    return tf.constant(0, tf.int64) if step is None else tf.cast(step, tf.int64)


class DynamicEmbedding(tf.__internal__.tracking.Trackable):
    """A growable int64 -> float32[dim] table, sharded over the parameter servers.

    Args:
      name: the table's name; shard i is ``<name>/part_<i>`` on its PS. Two tables with
        the same name on one PS must have the same dim and optimizer.
      dim: row width (> 0).
      initializer: a new key's row (``zeros()``, ``constant(v)``, ``uniform(lo, hi)``,
        ``normal(mean, stddev)``); deterministic in ``seed`` and the key.
      optimizer: the server-side optimizer (``SGD``, ``Adagrad``, ``Adam``, ``Ftrl`` or
        their names); its slots are stored with the rows. None: no training.
      shards: how many shards; default: the cluster's server count after
        ``tfpsx.init()``, else 1 (a local table).
      devices: one device per shard; default ``/job:ps/task:i`` in a cluster, none locally.
      seed: the initializer's seed.
      min_frequency: admission: a key gets a stored, trained row only after it was looked
        up this many times; until then lookups return its initial row.
      capacity: rows to reserve, over all shards (each takes its share): the shards
        size their index and map and fault in the rows' memory when they are created,
        so inserting up to that many keys neither rehashes nor page-faults (inserts
        of new keys run ~2x faster in ``benchmarks/embedding_ops.py``). A hint: the
        table still grows past it; ignored for a shard that already exists.

    Raises:
      ValueError: a bad dim, optimizer, shard count or device list.
    """

    def __init__(self, name: str, dim: int, initializer: Initializer = None, optimizer=None,
                 shards: Optional[int] = None, devices: Optional[Sequence[str]] = None,
                 seed: int = 0, min_frequency: int = 1, capacity: Optional[int] = None,
                 _geo_copy: bool = False):
        if not isinstance(name, str) or not name:
            raise ValueError(f"DynamicEmbedding: name must be a non-empty string, got {name!r}")
        if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0:
            raise ValueError(f"DynamicEmbedding {name!r}: dim must be a positive int, got {dim!r}")
        if isinstance(min_frequency, bool) or not isinstance(min_frequency, int) or min_frequency < 1:
            raise ValueError(f"DynamicEmbedding {name!r}: min_frequency must be an int >= 1, "
                             f"got {min_frequency!r}")
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int)
                                     or capacity < 0):
            raise ValueError(f"DynamicEmbedding {name!r}: capacity must be None or an int >= 0 "
                             f"(rows to reserve), got {capacity!r}")
        self.name, self.dim, self.seed, self.min_frequency = name, dim, int(seed), min_frequency
        self.capacity = capacity or 0
        self.initializer = initializer or normal()
        if not isinstance(self.initializer, Initializer):
            raise ValueError(f"DynamicEmbedding {name!r}: initializer must come from "
                             "tfpsx.embedding.zeros/constant/uniform/normal, got "
                             f"{self.initializer!r}")
        self.optimizer = _optimizer(optimizer)
        if devices is None:
            devices = self._default_devices(shards)
        devices = list(devices)
        if shards is not None and len(devices) != shards:
            raise ValueError(f"DynamicEmbedding {name!r}: {shards} shards but {len(devices)} "
                             f"devices {devices}")
        if not devices:
            raise ValueError(f"DynamicEmbedding {name!r}: needs at least one shard")
        self.devices = devices
        self._ops = load_ops()
        self._handle_cache: Dict[object, List[tf.Tensor]] = {}
        self._checkpointed = not _geo_copy  # GEO's worker copies are not model state
        self._geo = self._sync = None
        if not _geo_copy:
            from tfpsx import training  # here: tfpsx.training imports TF's training stack

            self._geo = training.geo_state_in_scope()
            # Sync (built inside model_scope(a_sync=False)): gradients are aggregated
            # over the workers on the PS and applied once per step by the chief.
            self._sync = training.sync_state_in_scope()
        if self._geo is not None:
            # GEO (built inside tfpsx.model_scope with k_steps > 0): this worker trains a
            # local copy and keeps the old snapshot; the communicator syncs changed rows.
            copy = dict(initializer=self.initializer, seed=self.seed,
                        devices=[self._geo.worker_device], _geo_copy=True)
            me = self._geo.worker_index
            self._local = DynamicEmbedding(f"{name}/geo_local_w{me}", dim,
                                           optimizer=self.optimizer,
                                           min_frequency=min_frequency, **copy)
            self._old = DynamicEmbedding(f"{name}/geo_old_w{me}", dim, **copy)
            self._geo.tables.append(self)

    @staticmethod
    def _default_devices(shards: Optional[int]) -> List[Optional[str]]:
        from tfpsx.fleet import FLEET

        config = FLEET.config
        if config is not None and config.servers and config.role in ("worker", "server"):
            count = config.server_num if shards is None else shards
            if count > config.server_num:
                raise ValueError(f"DynamicEmbedding: {count} shards but the cluster has only "
                                 f"{config.server_num} parameter servers")
            return [f"/job:ps/task:{i}" for i in range(count)]
        return [None] * (1 if shards is None else shards)

    @property
    def num_shards(self) -> int:
        return len(self.devices)

    def _device(self, i):
        return tf.device(self.devices[i]) if self.devices[i] else _nullcontext()

    def handles(self) -> List[tf.Tensor]:
        """One handle per shard (creates the shards on first run)."""
        key = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        if key in self._handle_cache:
            return self._handle_cache[key]
        slot_init = list(self.optimizer.slot_init) if self.optimizer else []
        handles = []
        for i in range(self.num_shards):
            with self._device(i):
                handles.append(self._ops.tfpsx_hash_table_handle_op(
                    shared_name=f"{self.name}/part_{i}", dim=self.dim, num_slots=len(slot_init),
                    slot_init=slot_init, initializer=self.initializer.kind,
                    init_a=self.initializer.a, init_b=self.initializer.b, seed=self.seed,
                    min_frequency=self.min_frequency,
                    capacity=-(-self.capacity // self.num_shards)))
        if key is not None or not tf.inside_function():
            self._handle_cache[key] = handles
        if (key is not None and self._checkpointed and not key.building_function
                and not self._saveable_added(key)):
            # A default tf.compat.v1.train.Saver (and MonitoredTrainingSession's) saves
            # what this collection holds, as it does for TF's own MutableHashTable. Not in
            # a tf.function: its export ops would run on every call.
            key.add_to_collection(tf.compat.v1.GraphKeys.SAVEABLE_OBJECTS, self.saveable())
        return handles

    def _saveable_added(self, graph) -> bool:
        return any(isinstance(s, _TableSaveable) and s.table is self
                   for s in graph.get_collection(tf.compat.v1.GraphKeys.SAVEABLE_OBJECTS))

    def saveable(self):
        """A TF1 SaveableObject for ``tf.compat.v1.train.Saver``, named after the table
        (tensors ``<name>-keys``, ``-values``, ``-slots``, ``-freq``, ``-step``)."""
        return _TableSaveable(self)

    # ------------------------------------------------------------------ keys
    def _keys(self, ids) -> tf.Tensor:
        ids = tf.convert_to_tensor(ids)
        if not ids.dtype.is_integer:
            raise TypeError(f"DynamicEmbedding {self.name!r}: ids must be integers (int32 or "
                            f"int64), got {ids.dtype.name}")
        return tf.cast(ids, tf.int64)

    def _partition(self, keys):
        """(per-shard keys, per-shard positions) of a 1-D key vector."""
        if self.num_shards == 1:
            return [keys], [tf.range(tf.size(keys))]
        shard = tf.cast(tf.math.floormod(keys, self.num_shards), tf.int32)
        parts = tf.dynamic_partition(keys, shard, self.num_shards)
        positions = tf.dynamic_partition(tf.range(tf.size(keys)), shard, self.num_shards)
        return parts, positions

    # ------------------------------------------------------------------ lookups
    def lookup_unique(self, ids, train: bool = True, step=None, tape=None) -> EmbeddingLookup:
        """Looks ids up once per distinct id; see the module docstring for training.

        Args:
          ids: integer tensor of any shape.
          train: insert missing keys (subject to admission) and count frequencies; False
            reads only (missing keys get their initial row, nothing is stored).
          step: the training step recorded as a new row's last-update step.
          tape: a GradientTape to watch ``unique_rows`` on (eager training).
        """
        if self._geo is not None:
            return self._local.lookup_unique(ids, train=train, step=step, tape=tape)
        keys = self._keys(ids)
        flat = tf.reshape(keys, [-1])
        unique, index = tf.unique(flat)
        parts, positions = self._partition(unique)
        step = _step(step)
        rows = []
        for i, handle in enumerate(self.handles()):
            with self._device(i):
                if train:
                    rows.append(self._ops.tfpsx_hash_table_find_or_insert(handle, parts[i], step))
                else:
                    rows.append(self._ops.tfpsx_hash_table_find(handle, parts[i])[0])
        unique_rows = rows[0] if self.num_shards == 1 else tf.dynamic_stitch(positions, rows)
        unique_rows = tf.reshape(unique_rows, [-1, self.dim])
        if tape is not None:
            tape.watch(unique_rows)
        embeddings = tf.reshape(tf.gather(unique_rows, index),
                                tf.concat([tf.shape(keys), [self.dim]], axis=0))
        return EmbeddingLookup(unique, unique_rows, index, embeddings)

    def lookup(self, ids, train: bool = False, step=None,
               dedup: Optional[bool] = None) -> tf.Tensor:
        """Rows of ``ids`` (ids' shape + [dim]); read-only unless ``train``.

        Args:
          ids: integer tensor of any shape.
          train: as in ``lookup_unique`` (training lookups always deduplicate, so that each
            distinct id is counted and inserted once per batch).
          step: as in ``lookup_unique``.
          dedup: look each distinct id up once (unique, find, gather back). Default: yes
            when a shard lives on a parameter server, where it cuts the rows sent; no for
            a local table, whose kernel serves a repeated id from cache faster than the
            unique + gather back would cost (measured in benchmarks/embedding_ops.py).
        """
        if self._geo is not None:
            return self._local.lookup(ids, train=train, step=step, dedup=dedup)
        if dedup is None:
            dedup = any(device is not None for device in self.devices)
        if train or dedup:
            return self.lookup_unique(ids, train=train, step=step).embeddings
        keys = self._keys(ids)
        parts, positions = self._partition(tf.reshape(keys, [-1]))
        rows = []
        for i, handle in enumerate(self.handles()):
            with self._device(i):
                rows.append(self._ops.tfpsx_hash_table_find(handle, parts[i])[0])
        rows = rows[0] if self.num_shards == 1 else tf.dynamic_stitch(positions, rows)
        return tf.reshape(rows, tf.concat([tf.shape(keys), [self.dim]], axis=0))

    # ------------------------------------------------------------------ training
    def apply_gradients(self, looked: EmbeddingLookup, grads, step=None):
        """Sends (unique keys, row gradients) to the server-side optimizer of each shard
        (in GEO: to this worker's copy; the communicator pushes the changed rows)."""
        if self._geo is not None:
            op = self._local.apply_gradients(looked, grads, step)
            self._geo.train_ops.append(op)
            return op
        if self.optimizer is None:
            raise ValueError(f"DynamicEmbedding {self.name!r} has no optimizer; pass "
                             "optimizer=tfpsx.embedding.Adagrad(...) (or SGD, Adam, Ftrl)")
        if grads is None:
            raise ValueError(f"DynamicEmbedding {self.name!r}: the gradient is None; does the "
                             "loss depend on lookup_unique(...).unique_rows?")
        if isinstance(grads, tf.IndexedSlices):
            grads = tf.math.unsorted_segment_sum(grads.values, grads.indices,
                                                 tf.shape(looked.unique_keys)[0])
        grads = tf.reshape(tf.cast(grads, tf.float32), [-1, self.dim])
        keys, positions = self._partition(looked.unique_keys)
        if self._sync is not None:
            shard_grads = [grads if self.num_shards == 1 else tf.gather(grads, positions[i])
                           for i in range(self.num_shards)]
            return self._sync.push(self, keys, shard_grads, self._device)
        step = _step(step)
        ops = []
        for i, handle in enumerate(self.handles()):
            shard_grads = grads if self.num_shards == 1 else tf.gather(grads, positions[i])
            with self._device(i):
                ops.append(self.optimizer.apply(self._ops, handle, keys[i], shard_grads, step))
        return tf.group(ops) if not tf.executing_eagerly() else None

    def minimize(self, loss, lookups: Sequence[EmbeddingLookup], step=None):
        """Graph mode: the op that applies d(loss)/d(rows) of ``lookups`` on the servers."""
        grads = tf.gradients(loss, [l.unique_rows for l in lookups])
        return tf.group([self.apply_gradients(l, g, step) for l, g in zip(lookups, grads)])

    def _geo_push_ops(self, n: float, state):
        """GEO's sparse push for this table (built by the communicator hook): the keys
        changed in the local copy since the last push, delta = (local - old) / n,
        old += delta, the PS shards += delta. Returns (push op, rows pushed, reader
        registrations)."""
        ops = self._ops
        local, old = self._local.handles()[0], self._old.handles()[0]
        zero = tf.constant(0, tf.int64)
        step = _step(tf.compat.v1.train.get_global_step())
        with tf.compat.v1.device(state.worker_device):
            keys = ops.tfpsx_hash_table_take_changed(local, zero)
            delta = (ops.tfpsx_hash_table_find(local, keys)[0]
                     - ops.tfpsx_hash_table_find(old, keys)[0]) / n
            bump_old = ops.tfpsx_hash_table_accumulate(old, keys, delta, zero)
        push = tf.group(bump_old, self.accumulate(keys, delta, step))
        me = tf.constant(state.worker_index, tf.int64)
        register = [ops.tfpsx_hash_table_take_changed(local, zero)]
        for i, handle in enumerate(self.handles()):
            with self._device(i):
                register.append(ops.tfpsx_hash_table_take_changed(handle, me))
        return push, tf.size(keys), register

    def _geo_pull_ops(self, state, after=()):
        """GEO's sparse pull, run after the ops ``after``: the keys any worker changed on
        the PS since this worker's last pull, local += global - old, old = global.
        Returns (pull op, rows pulled)."""
        ops = self._ops
        local, old = self._local.handles()[0], self._old.handles()[0]
        me = tf.constant(state.worker_index, tf.int64)
        zero = tf.constant(0, tf.int64)
        got_keys, got_rows = [], []
        with tf.control_dependencies(list(after)):
            for i, handle in enumerate(self.handles()):
                with self._device(i):
                    changed = ops.tfpsx_hash_table_take_changed(handle, me)
                    got_keys.append(changed)
                    got_rows.append(ops.tfpsx_hash_table_find(handle, changed)[0])
        with tf.compat.v1.device(state.worker_device):
            keys_in, rows_in = tf.concat(got_keys, 0), tf.concat(got_rows, 0)
            moved = ops.tfpsx_hash_table_accumulate(
                local, keys_in, rows_in - ops.tfpsx_hash_table_find(old, keys_in)[0], zero)
            with tf.control_dependencies([moved]):
                pull = ops.tfpsx_hash_table_insert(old, keys_in, rows_in, zero)
        return pull, tf.size(keys_in)

    # ------------------------------------------------------------------ plain table ops
    def insert(self, keys, values, step=None):
        keys = tf.reshape(self._keys(keys), [-1])
        values = tf.reshape(tf.convert_to_tensor(values, tf.float32), [-1, self.dim])
        return self._per_shard(keys, values, lambda h, k, v: self._ops.tfpsx_hash_table_insert(
            h, k, v, _step(step)))

    def accumulate(self, keys, deltas, step=None):
        keys = tf.reshape(self._keys(keys), [-1])
        deltas = tf.reshape(tf.convert_to_tensor(deltas, tf.float32), [-1, self.dim])
        return self._per_shard(keys, deltas, lambda h, k, v: self._ops.tfpsx_hash_table_accumulate(
            h, k, v, _step(step)))

    def _per_shard(self, keys, rows, fn):
        parts, positions = self._partition(keys)
        ops = []
        for i, handle in enumerate(self.handles()):
            shard_rows = rows if self.num_shards == 1 else tf.gather(rows, positions[i])
            with self._device(i):
                ops.append(fn(handle, parts[i], shard_rows))
        return tf.group(ops) if not tf.executing_eagerly() else None

    def _on_shards(self, fn) -> list:
        """fn(shard index, handle) for every shard, each on its shard's device."""
        out = []
        for i, handle in enumerate(self.handles()):
            with self._device(i):
                out.append(fn(i, handle))
        return out

    def remove(self, keys) -> tf.Tensor:
        parts, _ = self._partition(tf.reshape(self._keys(keys), [-1]))
        return tf.add_n(self._on_shards(
            lambda i, h: self._ops.tfpsx_hash_table_remove(h, parts[i])))

    def size(self) -> tf.Tensor:
        return tf.add_n(self._on_shards(lambda i, h: self._ops.tfpsx_hash_table_size(h)))

    def stats(self) -> tf.Tensor:
        """[size, admitted, evicted, pending_admission, memory_bytes], summed over shards."""
        return tf.add_n(self._on_shards(lambda i, h: self._ops.tfpsx_hash_table_stats(h)))

    def evict(self, min_step=None, keep_top_n=None) -> tf.Tensor:
        """Evicts rows last updated before ``min_step`` (TTL) and/or keeps the top-N most
        frequent rows per shard; returns how many rows went."""
        min_step = tf.constant(_INT64_MIN, tf.int64) if min_step is None else tf.cast(min_step, tf.int64)
        keep = tf.constant(-1, tf.int64) if keep_top_n is None else tf.cast(keep_top_n, tf.int64)
        return tf.add_n(self._on_shards(
            lambda i, h: self._ops.tfpsx_hash_table_evict(h, min_step, keep)))

    def export(self, since_step=None) -> Dict[str, tf.Tensor]:
        """Every row (or those updated at ``since_step`` or later: a delta export), all
        shards merged: keys, values [n, dim], slots [n, num_slots, dim], freq, step."""
        since = tf.constant(_INT64_MIN, tf.int64) if since_step is None else tf.cast(since_step, tf.int64)
        parts = self._on_shards(lambda i, h: self._ops.tfpsx_hash_table_export(h, since))
        names = ("keys", "values", "slots", "freq", "step")
        return {name: tf.concat([p[j] for p in parts], axis=0) for j, name in enumerate(names)}

    def import_rows(self, rows: Dict[str, tf.Tensor], clear: bool = True):
        """Loads exported rows (from any shard count) into this table's shards."""
        keys = tf.convert_to_tensor(rows["keys"], tf.int64)
        parts, positions = self._partition(keys)
        ops = []
        for i, handle in enumerate(self.handles()):
            pick = (lambda t: t) if self.num_shards == 1 else (lambda t: tf.gather(t, positions[i]))
            with self._device(i):
                ops.append(self._ops.tfpsx_hash_table_import(
                    handle, parts[i], pick(tf.convert_to_tensor(rows["values"], tf.float32)),
                    pick(tf.convert_to_tensor(rows["slots"], tf.float32)),
                    pick(tf.convert_to_tensor(rows["freq"], tf.int64)),
                    pick(tf.convert_to_tensor(rows["step"], tf.int64)), clear=clear))
        return tf.group(ops) if not tf.executing_eagerly() else None

    # ------------------------------------------------------------------ checkpoints
    def _serialize_to_tensors(self):
        return self.export()

    def _restore_from_tensors(self, restored_tensors):
        return self.import_rows(restored_tensors, clear=True)


from tensorflow.python.training.saving import saveable_object as _saveable_object  # noqa: E402


class _TableSaveable(_saveable_object.SaveableObject):
    """Saver glue: exports all shards on save; re-shards into the current table on restore."""

    def __init__(self, table: DynamicEmbedding):
        self.table = table
        rows = table.export()
        specs = [_saveable_object.SaveSpec(rows[k], "", f"{table.name}-{k}")
                 for k in ("keys", "values", "slots", "freq", "step")]
        super().__init__(rows["keys"], specs, table.name)

    def restore(self, restored_tensors, restored_shapes):
        names = ("keys", "values", "slots", "freq", "step")
        return self.table.import_rows(dict(zip(names, restored_tensors)), clear=True)


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False

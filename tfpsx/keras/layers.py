"""``tfpsx.keras.layers.DynamicEmbedding``: a Keras 3 layer over a tfpsx dynamic table.

Ids are int32/int64 or strings (hashed to int64 with
``tf.strings.to_hash_bucket_fast(s, 2**63 - 1)``: FarmHash64 of the string's bytes
modulo 2^63 - 1, stable across processes, machines and TF versions). Inputs:

* dense ``[batch, ...]`` ids: output ``[batch, ..., dim]``, or with a ``combiner``
  (``"sum"``, ``"mean"``, ``"sqrtn"``) the rows of the last axis combined into
  ``[batch, ..., dim]`` (``pad_id`` entries skipped: multi-hot features padded to a
  width);
* ``tf.RaggedTensor`` / ``tf.SparseTensor`` ids ``[batch, (n)]``: a combiner is required;
  an empty row combines to zeros.

Training: the table's rows are not Keras weights; their gradients go to the table's
server-side optimizer (or, in the scope of a ``tfpsx.keras.ParameterServerStrategy``, to
what its mode does with tables) from the backward pass: the lookup is wired through a
zero scalar weight ``tfpsx_gradient_trigger`` whose custom gradient pushes the row
gradients (OpenEmbedding's trick, there a registered gradient). The layer works without a
cluster (a local table, as outside a ``ParameterServerStrategy`` scope), so the same
model code runs in a notebook and on the cluster.

Saving: ``model.save("m.keras")`` / ``keras.models.load_model`` and ``save_weights`` carry
the table's rows (keys, values, optimizer slots, frequencies, steps);
``tf.train.Checkpoint(model=model)`` tracks the table as a checkpointable.

Serving: ``tfpsx.export_serving(model, path)`` writes a SavedModel without tfpsx ops; it
traces this layer's ``call`` with its rows read from stock TF objects
(:func:`tfpsx.keras.row_sources.reading_rows_from`), so what is served is this layer's
own id handling.
"""

from __future__ import annotations

from typing import Optional

import keras
import numpy as np
import tensorflow as tf

from tfpsx import compat
from tfpsx import embedding as E
from tfpsx.embedding import initializers as _initializers
from tfpsx.embedding import optimizers as _optimizers
from tfpsx.embedding.cache import CacheOptions
from tfpsx.embedding.saveable import refuse_whole_save
from tfpsx.embedding.sharding import EXPORT_FIELDS
from tfpsx.keras.modes.base import TRIGGER
from tfpsx.keras.row_sources import source_of
from tfpsx.keras.collective import CollectiveStrategy
from tfpsx.keras.strategy import ParameterServerStrategy

COMBINERS = ("sum", "mean", "sqrtn")
_HASH_BUCKETS = 2 ** 63 - 1


def _initializer(spec) -> E.Initializer:
    if spec is None:
        return E.normal()
    if isinstance(spec, E.Initializer):
        return spec
    if isinstance(spec, dict) and spec.get("kind") in ("zeros", "constant", "uniform", "normal"):
        return E.Initializer(spec["kind"], float(spec.get("a", 0.0)), float(spec.get("b", 0.0)))
    if isinstance(spec, str) and spec in ("zeros", "normal", "uniform"):
        return getattr(_initializers, spec)()
    raise ValueError(f"initializer must be a tfpsx.embedding initializer (zeros(), constant(v), "
                     f"uniform(lo, hi), normal(mean, stddev)) or one of 'zeros', 'normal', "
                     f"'uniform', got {spec!r}")


@keras.saving.register_keras_serializable(package="tfpsx")
class DynamicEmbedding(keras.layers.Layer):
    """Embeddings of int or string ids from a growing table (see the module doc).

    Args:
      dim: row width.
      table_name: the table's name on the parameter servers (default: the layer's name;
        every worker must build the same model, so names match).
      initializer: a new id's row (a ``tfpsx.embedding`` initializer, or "normal",
        "uniform", "zeros"); deterministic in ``seed`` and the id.
      optimizer: the table's server-side optimizer (``tfpsx.embedding.Adagrad(...)``,
        SGD, Adam, Ftrl, or a name); None: the table is not trained.
      combiner: None, "sum", "mean" or "sqrtn" (see the module doc).
      pad_id: with a combiner, ids equal to it are skipped.
      min_frequency, capacity, seed: the table's options (``tfpsx.embedding.DynamicTable``).
      cache_size, cache_policy, flush_steps, cache_admit_after: a worker cache of the
        table's hot rows
        (``tfpsx.embedding.DynamicTable``; async and GEO strategies).
      backend: where the table's shards keep their rows (``tfpsx.embedding.DynamicTable``);
        ``tfpsx.embedding.TieredBackend(directory, ram_bytes)`` keeps each shard's rows
        beyond ``ram_bytes`` of RAM on its server's disk. None: all in RAM.
    """

    def __init__(self, dim: int, table_name: Optional[str] = None, initializer=None,
                 optimizer="adagrad", combiner: Optional[str] = None,
                 pad_id: Optional[int] = None, min_frequency: int = 1,
                 capacity: Optional[int] = None, seed: int = 0,
                 cache_size: Optional[int] = None, cache_policy: str = "lfu",
                 flush_steps: int = 100, cache_admit_after: int = 1,
                 backend: Optional[E.Backend] = None, **kwargs):
        super().__init__(**kwargs)
        if isinstance(backend, dict):  # from get_config
            backend = E.TieredBackend(backend["directory"], backend["ram_bytes"])
        if backend is not None and not isinstance(backend, E.Backend):
            raise ValueError(f"DynamicEmbedding layer {self.name!r}: backend must be None or a "
                             f"tfpsx.embedding.Backend (e.g. TieredBackend), got {backend!r}")
        self.backend = backend
        CacheOptions.parse(f"{table_name or self.name} (layer)", cache_size, cache_policy,
                           flush_steps, cache_admit_after)
        self.cache_size, self.cache_policy = cache_size, cache_policy
        self.flush_steps, self.cache_admit_after = flush_steps, cache_admit_after
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"DynamicEmbedding layer {self.name!r}: dim must be a positive "
                             f"int, got {dim!r}")
        if combiner is not None and combiner not in COMBINERS:
            raise ValueError(f"DynamicEmbedding layer {self.name!r}: combiner must be None or "
                             f"one of {', '.join(COMBINERS)}, got {combiner!r}")
        if pad_id is not None and combiner is None:
            raise ValueError(f"DynamicEmbedding layer {self.name!r}: pad_id={pad_id} needs a "
                             "combiner (padded multi-hot ids are combined into one row)")
        self.dim, self.combiner, self.pad_id = dim, combiner, pad_id
        self.table_name = table_name
        self.initializer = _initializer(initializer)
        self.table_optimizer = _optimizers.resolve(optimizer)
        self.min_frequency, self.capacity, self.seed = min_frequency, capacity, seed
        self.table: Optional[E.DynamicTable] = None

    # ------------------------------------------------------------------ build
    def build(self, input_shape=None):
        if self.table is not None:
            return
        # On the parameter servers in a ParameterServerStrategy's scope; a local table
        # otherwise, also in a process of a cluster (its eager context reaches no PS).
        strategy = tf.distribute.get_strategy()
        if isinstance(strategy, CollectiveStrategy):
            raise ValueError(
                f"DynamicEmbedding layer {self.name!r} in a tfpsx.keras.CollectiveStrategy: "
                "its table grows on the parameter servers, and a collective job has none "
                "(every weight is all-reduced); use the hybrid mode (tables on parameter "
                "servers, dense weights all-reduced: tfpsx.keras.ParameterServerStrategy("
                "tfpsx.DistributedStrategy(dense='allreduce'))), or keras.layers.Embedding "
                "for a fixed vocabulary")
        on_ps = isinstance(strategy, ParameterServerStrategy)
        self.table = E.DynamicTable(
            self.table_name or self.name, self.dim, initializer=self.initializer,
            optimizer=self.table_optimizer, seed=self.seed, min_frequency=self.min_frequency,
            capacity=self.capacity, devices=None if on_ps else [None],
            cache_size=self.cache_size, cache_policy=self.cache_policy,
            flush_steps=self.flush_steps, cache_admit_after=self.cache_admit_after,
            backend=self.backend)
        self._step = self.add_weight(name="table_step", shape=(), dtype="int64",
                                     initializer="zeros", trainable=False)
        if self.table_optimizer is not None:
            self._trigger = self.add_weight(name=TRIGGER, shape=(), initializer="zeros",
                                            trainable=True)
        self.built = True

    # ------------------------------------------------------------------ ids
    def _ids(self, inputs):
        """(flat int64 ids, a function from their rows to the layer's output)."""
        if isinstance(inputs, tf.SparseTensor):
            inputs = tf.RaggedTensor.from_sparse(inputs)
        dtype = inputs.dtype
        if dtype == tf.string:
            inputs = (inputs.with_flat_values(
                tf.strings.to_hash_bucket_fast(inputs.flat_values, _HASH_BUCKETS))
                if isinstance(inputs, tf.RaggedTensor)
                else tf.strings.to_hash_bucket_fast(inputs, _HASH_BUCKETS))
        elif not dtype.is_integer:
            raise TypeError(f"DynamicEmbedding layer {self.name!r} takes integer or string ids, "
                            f"got {dtype.name} (ids are categories: cast integral floats with "
                            "tf.cast(x, tf.int64))")
        else:
            inputs = tf.cast(inputs, tf.int64)
        if isinstance(inputs, tf.RaggedTensor):
            if self.combiner is None:
                raise ValueError(f"DynamicEmbedding layer {self.name!r}: ragged or sparse ids "
                                 "need a combiner ('sum', 'mean' or 'sqrtn')")
            return inputs.flat_values, lambda rows: self._combine(inputs.with_flat_values(rows))
        if self.combiner is None:
            shape = tf.shape(inputs)
            return tf.reshape(inputs, [-1]), lambda rows: tf.reshape(
                rows, tf.concat([shape, [self.dim]], 0))
        ragged = (tf.ragged.boolean_mask(inputs, tf.not_equal(inputs, self.pad_id))
                  if self.pad_id is not None else tf.RaggedTensor.from_tensor(inputs))
        return ragged.flat_values, lambda rows: self._combine(ragged.with_flat_values(rows))

    def _combine(self, rows: tf.RaggedTensor) -> tf.Tensor:
        total = tf.reduce_sum(rows, axis=-2)  # [..., (n), dim] -> [..., dim]
        if self.combiner == "sum":
            return total
        count = tf.cast(tf.expand_dims(rows.row_lengths(axis=rows.ragged_rank), -1), total.dtype)
        count = tf.maximum(count, 1.0)  # an empty row combines to zeros
        return total / (count if self.combiner == "mean" else tf.sqrt(count))

    # ------------------------------------------------------------------ call
    def call(self, inputs, training=None):
        ids, finish = self._ids(inputs)
        source = source_of(self)
        if source is not None:
            return finish(source(ids))
        if training is None and self.table_optimizer is not None:
            # A subclassed model whose call(inputs) takes no training flag gets None from
            # Keras's train_step: a training call is one whose gradient a tape takes.
            training = compat.tape_records(tf.convert_to_tensor(self._trigger))
        if not training or self.table_optimizer is None:
            return finish(self.table.lookup(ids))
        step = self._step.assign_add(1)
        looked = self.table.lookup_unique(ids, train=True, step=step)
        rows = self._pushing_gradients(looked, step)
        return finish(tf.gather(rows, looked.indices))

    def _pushing_gradients(self, looked: E.EmbeddingLookup, step) -> tf.Tensor:
        """``looked.unique_rows``, wired so that the backward pass hands their gradient to
        the table's updater (Keras differentiates only its weights: the trigger is one)."""
        table = self.table

        @tf.custom_gradient
        def rows(trigger):
            def push(d_rows):
                op = table.apply_gradients(looked, d_rows, step)
                with tf.control_dependencies([op] if op is not None else []):
                    # A zero the compiler cannot fold, from a stateful op that waits for
                    # the apply: a constant lost this control dependency, and the apply
                    # with it (measured under Keras's Adam); so did 0 * the gradient's
                    # sum on TF 2.16, where no table trained in Keras's fit.
                    done = tf.raw_ops.Timestamp()
                    return tf.zeros_like(trigger) + tf.minimum(tf.cast(done, trigger.dtype),
                                                               0.0)

            return tf.identity(looked.unique_rows), push

        return rows(tf.convert_to_tensor(self._trigger))

    def compute_output_shape(self, input_shape):
        shape = tuple(input_shape)
        return (shape[:-1] if self.combiner else shape) + (self.dim,)

    # ------------------------------------------------------------------ saving
    def get_config(self):
        config = super().get_config()
        config.update(
            dim=self.dim, table_name=self.table_name, combiner=self.combiner, pad_id=self.pad_id,
            initializer={"kind": self.initializer.kind, "a": self.initializer.a,
                         "b": self.initializer.b},
            optimizer=None if self.table_optimizer is None else self.table_optimizer.get_config(),
            min_frequency=self.min_frequency, capacity=self.capacity, seed=self.seed,
            cache_size=self.cache_size,
            cache_policy=getattr(self.cache_policy, "name", self.cache_policy),
            flush_steps=self.flush_steps, cache_admit_after=self.cache_admit_after,
            backend=({"directory": self.backend.directory, "ram_bytes": self.backend.ram_bytes}
                     if isinstance(self.backend, E.TieredBackend) else None))
        return config

    def _keras_variables(self):
        return list(self._trainable_variables) + list(self._non_trainable_variables)

    def save_own_variables(self, store):
        refuse_whole_save(self.table, "model.save / save_weights")  # before any table op
        if self.table.cache is not None:
            self.table.flush_cache()  # the worker cache's updates reach the table first
        for i, var in enumerate(self._keras_variables()):
            store[str(i)] = var.numpy()
        for name, value in self.table.export().items():
            store[f"table_{name}"] = value.numpy()

    def load_own_variables(self, store):
        variables = self._keras_variables()
        for i, var in enumerate(variables):
            var.assign(store[str(i)])
        rows = {name: np.asarray(store[f"table_{name}"]) for name in EXPORT_FIELDS}
        self.table.import_rows(rows, clear=True)

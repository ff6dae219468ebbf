"""Wide&Deep and DeepFM for Criteo-format data, over tfpsx ``DynamicEmbedding`` tables.

Inputs: ``dense`` (float32 [B, 13], log1p-scaled counts) and ``cat`` (string [B, 26]).
A value is made field-aware first (``"C7=" + value``: the same hex string in two fields
is two ids), then one table, sharded over the parameter servers on a cluster, takes the
26 ids of an example: each id's row is its embedding (``dim`` wide: the deep part, and
DeepFM's FM part) and its wide weight (one more column: the first-order part), so an
id costs one lookup, one update and one row on the wire, not two. The table's
server-side optimizer is Adagrad; the dense layers train with Adam.

* ``wide_deep``: logit = wide (the ids' weights + a linear map of the counts) + an MLP
  over the concatenated embeddings and counts.
* ``deepfm``: the same, plus the FM's second-order term over the same embeddings:
  ``0.5 * sum_k((sum_f v_fk)^2 - sum_f v_fk^2)``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import keras
import tensorflow as tf

import tfpsx
from criteo_data import CAT_FIELDS, INT_FIELDS

MODELS = ("wide_deep", "deepfm")


@keras.saving.register_keras_serializable(package="criteo")
class FieldIds(keras.layers.Layer):
    """``[B, F]`` strings -> ``"C<f+1>=<value>"``: one id space per field."""

    def __init__(self, fields: int = CAT_FIELDS, **kwargs):
        super().__init__(**kwargs)
        self.fields = fields
        self.prefixes = tf.constant([f"C{f + 1}=" for f in range(fields)])

    def call(self, values):
        return tf.strings.join([tf.broadcast_to(self.prefixes, tf.shape(values)), values])

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return dict(super().get_config(), fields=self.fields)


@keras.saving.register_keras_serializable(package="criteo")
class FMInteraction(keras.layers.Layer):
    """The FM's second-order term of ``[B, F, k]`` embeddings: ``[B, 1]``."""

    def call(self, v):
        total = tf.reduce_sum(v, axis=1)
        return 0.5 * tf.reduce_sum(tf.square(total) - tf.reduce_sum(tf.square(v), axis=1),
                                   axis=1, keepdims=True)


@keras.saving.register_keras_serializable(package="criteo")
class SplitRows(keras.layers.Layer):
    """``[B, F, dim + 1]`` rows -> (embeddings ``[B, F, dim]``, the ids' summed wide
    weights ``[B, 1]``)."""

    def call(self, rows):
        return rows[..., :-1], tf.reduce_sum(rows[..., -1], axis=1, keepdims=True)

    def compute_output_shape(self, input_shape):
        return (tuple(input_shape[:-1]) + (input_shape[-1] - 1,), (input_shape[0], 1))


def build(kind: str, dim: int = 16, hidden: Sequence[int] = (256, 128),
          table_lr: float = 0.05, learning_rate: float = 1e-3,
          cache_size: Optional[int] = None, flush_steps: int = 100,
          backend: Optional[tfpsx.embedding.Backend] = None) -> keras.Model:
    """The compiled model (build it inside a tfpsx strategy's scope on a cluster);
    ``backend``: where the table's shards keep their rows (e.g. on disk beyond a RAM
    budget: ``tfpsx.embedding.TieredBackend``)."""
    if kind not in MODELS:
        raise ValueError(f"--model must be one of {', '.join(MODELS)}, got {kind!r}")
    dense = keras.Input((INT_FIELDS,), name="dense")
    cat = keras.Input((CAT_FIELDS,), dtype="string", name="cat")
    ids = FieldIds(name="field_ids")(cat)
    cache = {} if not cache_size else {"cache_size": cache_size, "flush_steps": flush_steps}
    rows = tfpsx.keras.DynamicEmbedding(
        dim + 1, optimizer=tfpsx.embedding.Adagrad(table_lr),
        initializer=tfpsx.embedding.normal(stddev=0.01), name="embedding", backend=backend,
        **cache)(ids)
    v, id_weights = SplitRows(name="split")(rows)
    wide = keras.layers.Add(name="wide")([id_weights,
                                          keras.layers.Dense(1, name="count_weights")(dense)])
    deep = keras.layers.Concatenate()([keras.layers.Flatten()(v), dense])
    for i, units in enumerate(hidden):
        deep = keras.layers.Dense(units, activation="relu", name=f"deep_{i}")(deep)
    logits = [wide, keras.layers.Dense(1, name="deep_out")(deep)]
    if kind == "deepfm":
        logits.append(FMInteraction(name="fm")(v))
    prob = keras.layers.Activation("sigmoid", name="click")(keras.layers.Add()(logits))
    model = keras.Model({"dense": dense, "cat": cat}, prob, name=kind)
    model.compile(keras.optimizers.Adam(learning_rate), "binary_crossentropy")
    return model

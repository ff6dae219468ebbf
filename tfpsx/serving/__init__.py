"""Serving export without tfpsx ops: a trained model as a SavedModel that stock
TensorFlow and TF Serving load and run.

* :mod:`~tfpsx.serving.initializers`: a table's initial row of a key, in stock TF ops;
* :mod:`~tfpsx.serving.table`: ``ServingTable``, a table's rows in a ``DenseHashTable``
  and a variable per shard, and the initial row for any other id;
* :mod:`~tfpsx.serving.signature`: named, flat signature inputs and outputs;
* :mod:`~tfpsx.serving.keras`: a Keras 3 model traced with its tables swapped;
* :mod:`~tfpsx.serving.graph`: a TF1 graph's inference subgraph, re-imported with its
  tables and variables swapped;
* :mod:`~tfpsx.serving.export`: TF Serving's layout, the check that no tfpsx op is left;
* :mod:`~tfpsx.serving.delta`, :mod:`~tfpsx.serving.publish`, ``follower.py``: a served
  model that follows training by deltas (docs/online.md).
"""

from __future__ import annotations

import os
import sys
from typing import Mapping, Optional

import tensorflow as tf

from tfpsx.serving import export as _export
from tfpsx.serving.export import SERVING_DEFAULT, tfpsx_ops, version_dir
from tfpsx.serving.publish import Publisher, published
from tfpsx.serving.table import ServingTable

__all__ = ["export_serving", "Publisher", "published", "ServingTable", "SERVING_DEFAULT",
           "tfpsx_ops", "version_dir"]


def export_serving(model_or_session, path, *, inputs: Optional[Mapping] = None,
                   outputs: Optional[Mapping] = None, version: Optional[int] = None) -> str:
    """Writes a SavedModel of a trained model that runs without tfpsx (no ``Tfpsx`` op).

    Every tfpsx table becomes stock TensorFlow objects saved in the SavedModel's
    checkpoint: per shard a ``tf.lookup.experimental.DenseHashTable`` (id -> row index)
    and a variable of the rows; an id the table does not hold gets the row the table's
    initializer would give it, computed with stock ops. The signature ``serving_default``
    runs the model's inference with named inputs and outputs, in TF Serving's layout.
    Every export also has the signatures ``apply_delta`` and
    ``applied_sequence`` (:mod:`tfpsx.serving.delta`): it can be the base that a
    follower keeps fresh with the deltas of a :class:`Publisher`.

    Example::

      model.fit(...)                                   # a Keras 3 model
      tfpsx.export_serving(model, "/models/ctr")       # -> /models/ctr/1
      # anywhere, without tfpsx:
      served = tf.saved_model.load("/models/ctr/1").signatures["serving_default"]
      served(ids=tf.constant([[3, 7, 0]], tf.int64))   # {"dense": <tf.Tensor ...>}

    Args:
      model_or_session: a Keras 3 model (built; after ``fit`` in a
        ``tfpsx.keras.ParameterServerStrategy``, on any worker), or for a TF1 graph a
        ``tf.compat.v1.Session`` (or ``tfpsx.MonitoredTrainingSession``) holding the
        trained values.
      path: TF Serving's model base path: the model goes to ``path/<version>``.
      inputs: Keras: optional input specs ``{name: tf.TensorSpec}`` (required for a
        subclassed model); graph: ``{name: placeholder}``, required.
      outputs: graph: ``{name: tensor}``, required; Keras: not used (the model's outputs,
        named after its output layers).
      version: the version folder's number (a positive int); default: the next free
        one (1 in a new folder).

    Returns:
      The version folder written (``path/<version>``).

    Raises:
      ValueError: ``path`` is a file, a bad version, a model that is not built or has no
        known inputs, a graph export without inputs or outputs.
      FileExistsError: ``path/<version>`` exists already.
      TypeError: not a Keras model or a session.
    """
    path = os.fspath(path)
    version_dir(path, version)  # fail before any work
    if _is_keras_model(model_or_session):
        if outputs is not None:
            raise ValueError("export_serving: outputs= is for a graph-mode session; a Keras "
                             "model's outputs are its own")
        from tfpsx.serving import keras as _keras
        return _keras.export(model_or_session, path, version, inputs)
    if _is_session(model_or_session):
        from tfpsx.serving import graph as _graph
        return _graph.export(model_or_session, path, version, inputs, outputs)
    raise TypeError(f"export_serving: expected a Keras model or a tf.compat.v1.Session, "
                    f"got {type(model_or_session).__name__}")


def _is_keras_model(obj) -> bool:
    keras = sys.modules.get("keras")  # a Keras model means Keras is imported already
    return keras is not None and isinstance(obj, keras.Model)


def _is_session(obj) -> bool:
    # A tf.compat.v1.Session, or a (tfpsx or TF) MonitoredSession, open or closed.
    return (isinstance(obj, tf.compat.v1.Session) or callable(getattr(obj, "_tf_sess", None))
            or (isinstance(getattr(obj, "graph", None), tf.Graph) and hasattr(obj, "run")))

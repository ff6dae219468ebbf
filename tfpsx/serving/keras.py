"""Serving export of a Keras 3 model whose ``DynamicEmbedding`` layers hold tfpsx tables.

The served function is the model's own ``call`` (``training=False``), traced with

* each ``tfpsx.keras.DynamicEmbedding`` layer reading its rows from a
  :class:`~tfpsx.serving.table.ServingTable` (stock TF: a hash table and a variable per
  shard) through the layer's :func:`~tfpsx.keras.row_sources.reading_rows_from` seam, so the
  layer's own id handling (string hashing, ``pad_id``, combiners) is what is served;
* every Keras variable read from a fresh local ``tf.Variable`` holding its value, through
  ``keras.StatelessScope`` (a weight on a parameter server, GEO's worker copy and a local
  weight are all copied the same way, and nothing of the training model is captured).

Functional, Sequential and subclassed models take the same path; a subclassed model
needs ``inputs=`` (its input specs), the others have them.
"""

from __future__ import annotations

import logging
from typing import List

import keras
import numpy as np
import tensorflow as tf

from tfpsx import compat
from tfpsx.keras.layers import DynamicEmbedding
from tfpsx.keras.row_sources import reading_rows_from
from tfpsx.keras.strategy import ParameterServerStrategy
from tfpsx.serving import delta, signature
from tfpsx.serving import export as _export
from tfpsx.serving.export import SERVING_DEFAULT
from tfpsx.serving.table import ServingTable, from_trained

logger = logging.getLogger("tfpsx.serving")


class KerasServingModule(tf.Module):
    """What the SavedModel holds: the served tables, the weights' copies, ``serve``."""

    def __init__(self, tables: List[ServingTable], weights: List[tf.Variable]):
        super().__init__(name=None)
        self.tables = tables
        self.weights = weights


def _embedding_layers(model) -> List[DynamicEmbedding]:
    # Keras has no public walk over nested layers (a subclassed model's included).
    layers = compat.flatten_layers(model)
    return [layer for layer in layers if isinstance(layer, DynamicEmbedding)]


def _keras_inputs(model, inputs) -> tuple:
    """([signature.Input], a function from {name: input} to the model's call argument)."""
    if inputs is not None:
        if isinstance(inputs, dict):
            items = [signature.Input(name, signature.as_spec(spec)[0])
                     for name, spec in inputs.items()]
            return items, lambda named: named
        spec, name = signature.as_spec(inputs)
        item = signature.Input(name or "inputs", spec)
        return [item], lambda named: named[item.name]
    try:
        model_inputs = model.inputs
    except (AttributeError, ValueError):
        model_inputs = None
    if not model_inputs:
        raise ValueError(
            f"export_serving: model {model.name!r} has no known inputs (a subclassed model, "
            "or a Sequential one without an Input): pass inputs=, e.g. "
            "inputs={'ids': tf.TensorSpec([None, 3], tf.int64)}")
    items = [signature.Input(t.name, _spec_of(t)) for t in model_inputs]
    struct = getattr(model, "_inputs_struct", None)
    if struct is None:  # Sequential: one input
        return items, lambda named: named[items[0].name]
    return items, lambda named: keras.tree.map_structure(lambda t: named[t.name], struct)


def _spec_of(keras_tensor):
    shape, dtype = tuple(keras_tensor.shape), tf.as_dtype(keras_tensor.dtype)
    if getattr(keras_tensor, "sparse", False):
        return tf.SparseTensorSpec(shape, dtype)
    if getattr(keras_tensor, "ragged", False):
        return tf.RaggedTensorSpec(shape, dtype, ragged_rank=1)
    return tf.TensorSpec(shape, dtype)


def _output_names(model) -> List[str]:
    names = getattr(model, "output_names", None)
    return list(names) if names else []


def before_export(model) -> None:
    """In the caller's thread: checks, and what ``predict`` does first.

    Raises:
      ValueError: the model is not built.
    """
    if not model.built:
        raise ValueError(f"export_serving: model {model.name!r} is not built; call it on data "
                         "(or fit it) first")
    strategy = getattr(model, "_distribute_strategy", None)
    if isinstance(strategy, ParameterServerStrategy):
        strategy.before_inference(model)  # what predict reads (GEO: the global model)


def _internal(layers) -> set:
    """Ids of the variables of ``DynamicEmbedding`` layers (the step, the gradient
    trigger): not read by inference."""
    return {id(v) for layer in layers for v in layer.variables}


def delta_weights(model) -> List[str]:
    """The ``apply_delta`` weight inputs of ``model``'s export
    (:func:`tfpsx.serving.delta.weight_input` of their position in ``model.weights``)."""
    internal = _internal(_embedding_layers(model))
    return [delta.weight_input(i) for i, v in enumerate(model.weights) if id(v) not in internal]


def build_module(model, inputs=None, sequence: int = 0, job_values: bool = False):
    """(the module to save, its signatures: ``serving_default`` and the delta ones of
    :mod:`tfpsx.serving.delta`) of a built Keras model (:func:`before_export` first); in
    a thread without a strategy scope. ``sequence``: the delta sequence the export is at.
    ``job_values``: the rows and weights the job's checkpoint saves (the servers'
    tables, ``strategy.job_value`` of each weight), not what this worker's ``predict``
    reads: they differ in GEO (the worker's copy), and a publisher's deltas are of the
    checkpoint's.

    Raises:
      ValueError: the model has no known inputs and none were given.
    """
    layers = _embedding_layers(model)
    tables, sources, internal = [], {}, _internal(layers)
    for layer in layers:
        if layer.table is None:
            raise ValueError(f"export_serving: DynamicEmbedding layer {layer.name!r} is not "
                             "built; call the model on data first")
        table = layer.table
        served = from_trained(table, table if job_values else table.updater.rows_source(table))
        tables.append(served)
        sources[layer] = served.lookup
    if not layers:
        logger.info("export_serving: model %r has no tfpsx DynamicEmbedding layer; it is "
                    "exported as it is", model.name)
    mapping, weights, by_input = [], [], {}
    position = {id(v): i for i, v in enumerate(model.weights)}  # as a checkpoint's
    strategy = getattr(model, "_distribute_strategy", None)
    value_of = (strategy.job_value if job_values and isinstance(
        strategy, ParameterServerStrategy) else (lambda v: v))
    for v in model.variables:
        if id(v) in internal:  # not read by inference: a constant, not a saved weight
            mapping.append((v, tf.zeros(v.shape, v.dtype)))
            continue
        value = value_of(v) if id(v) in position else v
        copy = tf.Variable(np.asarray(value.numpy()), trainable=False, name=_var_name(v))
        weights.append(copy)
        mapping.append((v, copy))
        if id(v) in position:  # (a variable that is no weight, e.g. a seed: not in deltas)
            by_input[delta.weight_input(position[id(v)])] = copy
    items, arguments = _keras_inputs(model, inputs)
    names = _output_names(model)

    def serve(*flat):
        named = signature.rebuild(items, flat)
        state = [(v, tf.convert_to_tensor(value)) for v, value in mapping]
        with reading_rows_from(sources), keras.StatelessScope(state_mapping=state):
            outputs = model(arguments(named), training=False)
        return signature.named_outputs(outputs, names)

    module = KerasServingModule(tables, weights)
    module.serve = tf.function(serve, input_signature=signature.flat_specs(items),
                               autograph=False)
    signatures = {SERVING_DEFAULT: module.serve.get_concrete_function()}
    signatures.update(delta.add_signatures(
        module, {t.table_name: t for t in tables}, by_input, sequence))
    return module, signatures


def _var_name(v) -> str:
    return (getattr(v, "path", None) or v.name).replace("/", "_").replace(":", "_")


def export(model, path: str, version, inputs=None, sequence: int = 0,
           extra_files=None, job_values: bool = False) -> str:
    """``export_serving`` of a Keras model: checks, then the module built and written in
    a clean thread (:func:`tfpsx.serving.export.in_clean_thread`); ``sequence``,
    ``extra_files`` and ``job_values`` as a publisher's base needs them
    (:mod:`tfpsx.serving.publish`, :func:`build_module`)."""
    if job_values:
        if not model.built:
            raise ValueError(f"export_serving: model {model.name!r} is not built")
    else:
        before_export(model)

    def build_and_write():
        module, signatures = build_module(model, inputs, sequence, job_values)
        return _export.write(module, signatures, path, version, extra_files)

    return _export.in_clean_thread(build_and_write)

"""Serving signatures: named, flat tensor inputs and outputs.

A SavedModel signature (what TF Serving calls) takes and returns named dense tensors. A
model input that is a ``tf.SparseTensor`` or a ``tf.RaggedTensor`` becomes several named
inputs, put back together in the served function:

* sparse ``x``: ``x_indices`` int64 ``[n, rank]``, ``x_values`` ``[n]``,
  ``x_dense_shape`` int64 ``[rank]`` (a ``tf.SparseTensor``'s components);
* ragged ``x`` (one ragged dimension): ``x_values`` ``[n]`` and ``x_row_lengths`` int64
  ``[batch]`` (row i holds the next ``x_row_lengths[i]`` values).

Dense ids padded with the layer's ``pad_id`` stay one dense input: the usual serving form.
"""

from __future__ import annotations

import re
from typing import Dict, List, Sequence, Tuple

import tensorflow as tf

_NAME = re.compile(r"^[A-Za-z0-9_.\-/]+$")


def check_name(name: str, what: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"{what}: a signature name must be a non-empty string of letters, "
                         f"digits and _ . - /, got {name!r}")
    return name


class Input:
    """One model input: its flat named specs and how to rebuild it from their tensors."""

    def __init__(self, name: str, spec):
        self.name = check_name(name, "export_serving inputs")
        self.spec = spec
        if isinstance(spec, tf.SparseTensorSpec):
            rank = spec.shape.rank
            if rank is None:
                raise ValueError(f"input {name!r}: a sparse input needs a known rank")
            self.specs = [tf.TensorSpec([None, rank], tf.int64, f"{name}_indices"),
                          tf.TensorSpec([None], spec.dtype, f"{name}_values"),
                          tf.TensorSpec([rank], tf.int64, f"{name}_dense_shape")]
        elif isinstance(spec, tf.RaggedTensorSpec):
            if spec.ragged_rank != 1 or spec.shape.rank != 2:
                raise ValueError(f"input {name!r}: a served ragged input must be [batch, (n)] "
                                 f"(one ragged dimension), got {spec}")
            self.specs = [tf.TensorSpec([None], spec.dtype, f"{name}_values"),
                          tf.TensorSpec([None], tf.int64, f"{name}_row_lengths")]
        elif isinstance(spec, tf.TensorSpec):
            self.specs = [tf.TensorSpec(spec.shape, spec.dtype, name)]
        else:
            raise TypeError(f"input {name!r}: expected a tf.TensorSpec, tf.SparseTensorSpec "
                            f"or tf.RaggedTensorSpec, got {spec!r}")

    def build(self, tensors: Sequence[tf.Tensor]):
        if isinstance(self.spec, tf.SparseTensorSpec):
            return tf.SparseTensor(*tensors)
        if isinstance(self.spec, tf.RaggedTensorSpec):
            values, lengths = tensors
            return tf.RaggedTensor.from_row_lengths(
                values, tf.cast(lengths, self.spec.row_splits_dtype))
        return tensors[0]


def flat_specs(inputs: Sequence[Input]) -> List[tf.TensorSpec]:
    specs = [s for i in inputs for s in i.specs]
    names = [s.name for s in specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"export_serving: the serving inputs' names repeat: {duplicates}")
    return specs


def rebuild(inputs: Sequence[Input], flat: Sequence[tf.Tensor]) -> Dict[str, object]:
    """name -> the model input of each :class:`Input`, from the flat signature tensors."""
    out, at = {}, 0
    for i in inputs:
        out[i.name] = i.build(flat[at:at + len(i.specs)])
        at += len(i.specs)
    return out


def named_outputs(outputs, names: Sequence[str] = ()) -> Dict[str, tf.Tensor]:
    """A signature's outputs: a dict stays; a tensor or a list is named by ``names``
    (the model's output names), else ``output_0``, ``output_1``, ..."""
    if isinstance(outputs, dict):
        items = list(outputs.items())
    else:
        flat = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
        names = list(names) if len(names) == len(flat) else [f"output_{i}" for i in
                                                               range(len(flat))]
        items = list(zip(names, flat))
    result = {}
    for name, value in items:
        check_name(name, "export_serving outputs")
        if not isinstance(value, tf.Tensor):
            raise TypeError(f"output {name!r}: a served output must be a dense tensor, got "
                            f"{type(value).__name__} (convert it in the model, e.g. "
                            ".to_tensor())")
        result[name] = value
    return result


def as_spec(value) -> Tuple[object, str]:
    """(a TypeSpec, a name hint) of a spec, a KerasTensor, a tensor or a placeholder."""
    if isinstance(value, tf.TypeSpec):
        return value, getattr(value, "name", None) or ""
    if isinstance(value, (tf.Tensor, tf.SparseTensor, tf.RaggedTensor)):
        name = value.op.name if isinstance(value, tf.Tensor) and hasattr(value, "op") else ""
        return tf.type_spec_from_value(value), name
    raise TypeError(f"expected a tf.TensorSpec (or tf.SparseTensorSpec, tf.RaggedTensorSpec), "
                    f"got {value!r}")

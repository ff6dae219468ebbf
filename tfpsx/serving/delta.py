"""The signatures that let a served model follow training: ``apply_delta`` and
``applied_sequence``, in stock TensorFlow ops only.

Every export (:func:`tfpsx.export_serving`) carries them, so any export can be the base
of a chain of deltas (:mod:`tfpsx.serving.publish` writes them, ``follower.py`` applies
them):

* ``apply_delta``: inputs ``sequence`` (int64 scalar), per table ``table_<name>_keys``
  (int64 ``[n]``), ``table_<name>_rows`` (float32 ``[n, dim]``, the rows' absolute
  values) and ``table_<name>_removed`` (int64 ``[m]``), and per weight
  ``weight_<i>`` (the i-th of the Keras model's ``weights``; a graph's:
  ``weight_<variable name>``), its whole value. It
  removes the removed keys, writes the rows, assigns the weights, and returns
  ``applied_sequence``, an output that depends on every write: TF Serving's ``Predict``
  runs no target nodes, only what its outputs need, so the writes must be needed.
  A delta whose ``sequence`` is not the applied one plus one is refused (an
  InvalidArgumentError, before any write): deltas apply in order, each once, so a
  duplicate changes nothing.
* ``applied_sequence``: the sequence of the last delta applied (the base's own
  sequence until one is).

A delta file (``tfpsx.serving.publish``) is a stock TF bundle whose tensors are named
as these inputs, so a follower feeds each input from the tensor of its name.
"""

from __future__ import annotations

import re
from typing import Dict, List, Mapping

import tensorflow as tf

from tfpsx.serving.table import ServingTable  # noqa: F401 (the tables' type)

APPLY = "apply_delta"
APPLIED = "applied_sequence"
SEQUENCE = "sequence"
FIELDS = ("keys", "rows", "removed")


def table_input(table_name: str, field: str) -> str:
    """The ``apply_delta`` input (and delta tensor) of a table's field (a table's
    trained name: a graph's shards of it are one table here)."""
    if field not in FIELDS:
        raise ValueError(f"a delta's table field is one of {FIELDS}, got {field!r}")
    return f"table_{re.sub(r'[^A-Za-z0-9_]', '_', table_name)}_{field}"


def weight_input(index: int) -> str:
    """The ``apply_delta`` input (and delta tensor) of the model's ``index``-th weight."""
    return f"weight_{int(index):04d}"


def named_weight_input(name: str) -> str:
    """The ``apply_delta`` input of a graph's variable ``name`` (its op's name)."""
    return "weight_" + re.sub(r"[^A-Za-z0-9_]", "_", name)


class ShardedServing:
    """A graph export's table for deltas: its served shards (a ``ServingTable`` each,
    shard i of ``count``), keys routed as the trained table's (``key mod count``); a
    shard the inference does not read (not exported) takes none."""

    def __init__(self, shards: Dict[int, ServingTable], count: int):
        self.shards, self.count = dict(shards), int(count)
        self.dim = next(iter(self.shards.values())).dim

    def _parts(self, keys):
        index = tf.cast(tf.math.floormod(keys, self.count), tf.int32)
        return tf.dynamic_partition(keys, index, self.count), index

    def delta_checks(self, keys, removed, what: str) -> List:
        parts, _ = self._parts(keys)
        return [c for i, table in self.shards.items()
                for c in table.delta_checks(parts[i], removed[:0], what)]

    def apply(self, keys, rows, removed) -> List:
        parts, index = self._parts(keys)
        row_parts = tf.dynamic_partition(tf.reshape(rows, [-1, self.dim]), index, self.count)
        gone, _ = self._parts(removed)
        return [w for i, table in self.shards.items()
                for w in table.apply(parts[i], row_parts[i], gone[i])]


def add_signatures(module: tf.Module, tables: Mapping[str, ServingTable],
                   weights: Mapping[str, tf.Variable], sequence: int = 0) -> Dict[str, object]:
    """Gives ``module`` the applied sequence (a variable saved with it, ``sequence``) and
    the two signatures' functions; returns ``{name: concrete function}``.

    Args:
      tables: the served tables by their trained name.
      weights: the weight copies the served function reads, by input name
        (:func:`weight_input`).
      sequence: the sequence of the state exported (0: none yet).

    Raises:
      ValueError: two tables whose names give the same input name.
    """
    specs: List[tf.TensorSpec] = [tf.TensorSpec([], tf.int64, SEQUENCE)]
    by_input: Dict[str, str] = {}
    for name, table in tables.items():
        key = table_input(name, "keys")
        if key in by_input:
            raise ValueError(f"export_serving: tables {by_input[key]!r} and {name!r} give the "
                             f"same delta input {key!r}; rename one")
        by_input[key] = name
        specs += [tf.TensorSpec([None], tf.int64, key),
                  tf.TensorSpec([None, table.dim], tf.float32, table_input(name, "rows")),
                  tf.TensorSpec([None], tf.int64, table_input(name, "removed"))]
    weight_names = sorted(weights)
    specs += [tf.TensorSpec(weights[n].shape, weights[n].dtype, n) for n in weight_names]
    module.applied = tf.Variable(int(sequence), dtype=tf.int64, trainable=False,
                                 name="applied_sequence")
    ordered = list(tables.items())

    def apply_delta(*flat):
        sequence = flat[0]
        applied = module.applied.read_value()
        checks = [tf.debugging.Assert(
            tf.equal(sequence, applied + 1),
            [f"{APPLY}: delta", sequence, "is out of order: this model applied", applied,
             "(deltas apply in order, each once; a follower restarted reloads its base "
             "and applies the deltas after the base's sequence)"])]
        at = 1
        table_parts = []
        for name, table in ordered:
            keys, rows, removed = flat[at:at + 3]
            at += 3
            checks += table.delta_checks(keys, removed, APPLY)
            table_parts.append((table, keys, rows, removed))
        with tf.control_dependencies(checks):
            writes = [w for table, keys, rows, removed in table_parts
                      for w in table.apply(keys, rows, removed)]
            writes += [weights[n].assign(value) for n, value in zip(weight_names, flat[at:])]
        with tf.control_dependencies(writes):
            done = module.applied.assign(sequence)
        with tf.control_dependencies([done]):
            return {APPLIED: tf.identity(sequence)}

    def applied_sequence():
        return {APPLIED: module.applied.read_value()}

    module.apply_delta = tf.function(apply_delta, input_signature=specs, autograph=False)
    module.applied_sequence = tf.function(applied_sequence, input_signature=[],
                                          autograph=False)
    return {APPLY: module.apply_delta.get_concrete_function(),
            APPLIED: module.applied_sequence.get_concrete_function()}

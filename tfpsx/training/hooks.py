"""Shared pieces of the modes' session hooks."""

from __future__ import annotations

from typing import Dict, Iterable

import tensorflow as tf


class TrainStepDetector:
    """Tells whether a ``session.run`` ran one of a mode's train ops: the op itself, or a
    group (a NoOp's control inputs, as ``tf.group`` makes) around one. An eval or a
    ``global_step`` read is not a local step. Answers are cached per fetched op."""

    def __init__(self, train_ops: Iterable = ()):
        self._names = {getattr(op, "op", op).name for op in train_ops}
        self._cache: Dict[str, bool] = {}

    def ran_training(self, run_context) -> bool:
        return any(self._runs_train(f) for f in
                   tf.nest.flatten(run_context.original_args.fetches))

    def _runs_train(self, fetch) -> bool:
        op = getattr(fetch, "op", fetch)
        if not isinstance(op, tf.Operation):
            return False
        if op.name not in self._cache:
            self._cache[op.name] = False  # bounds the recursion
            self._cache[op.name] = op.name in self._names or (op.type == "NoOp" and any(
                self._runs_train(c) for c in op.control_inputs))
        return self._cache[op.name]

"""Server-side optimizers of a table: their slots live beside each row, on the PS.

Each optimizer is a spec here and one functor in the C++ core
(``custom_ops/cc/core/optimizers.h``), registered there under the same ``name``; one op,
``TfpsxHashTableApply``, runs any of them. A new optimizer is one functor and one spec:
its ``name``, its ``HYPERPARAMS`` (attribute names, in the functor's order) and its
``slot_init`` (each slot's initial value).
"""

from __future__ import annotations

import inspect
from typing import Optional, Sequence, Tuple

import tensorflow as tf


class SparseOptimizer:
    """A server-side optimizer spec (subclass it; see the module docstring)."""
    name = "optimizer"
    HYPERPARAMS: Tuple[str, ...] = ()
    slot_init: Sequence[float] = ()

    def hyperparameters(self) -> tf.Tensor:
        """The hyperparameters as one float vector, in the order the core expects (a
        value may be a tensor, e.g. a decaying learning rate)."""
        return tf.stack([tf.cast(getattr(self, n), tf.float32) for n in self.HYPERPARAMS])

    def get_config(self) -> dict:
        """The constructor's arguments (and ``name``), for saving: see :func:`from_config`."""
        config = {"name": self.name}
        config.update({n: getattr(self, n) for n in self.HYPERPARAMS})
        if "initial_accumulator_value" in self._constructor_args():
            config["initial_accumulator_value"] = self.slot_init[-1]
        return config

    @classmethod
    def _constructor_args(cls):
        return inspect.signature(cls.__init__).parameters

    def __repr__(self):
        values = ", ".join(f"{n}={getattr(self, n)!r}" for n in self.HYPERPARAMS)
        return f"{type(self).__name__}({values})"


class SGD(SparseOptimizer):
    name, HYPERPARAMS = "sgd", ("learning_rate",)

    def __init__(self, learning_rate: float = 0.01):
        self.learning_rate = learning_rate


class Adagrad(SparseOptimizer):
    name, HYPERPARAMS = "adagrad", ("learning_rate", "epsilon")

    def __init__(self, learning_rate: float = 0.01, initial_accumulator_value: float = 0.1,
                 epsilon: float = 0.0):
        self.learning_rate, self.epsilon = learning_rate, epsilon
        self.slot_init = (float(initial_accumulator_value),)


class Adam(SparseOptimizer):
    """Lazy Adam: only the looked-up rows move; bias correction uses the global step (>= 1)."""
    name, HYPERPARAMS = "adam", ("learning_rate", "beta1", "beta2", "epsilon")
    slot_init = (0.0, 0.0)

    def __init__(self, learning_rate: float = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-7):
        self.learning_rate, self.beta1, self.beta2, self.epsilon = learning_rate, beta1, beta2, epsilon


class Ftrl(SparseOptimizer):
    """FTRL-Proximal, as ``tf.compat.v1.train.FtrlOptimizer`` (slots: z, accumulator)."""
    name, HYPERPARAMS = "ftrl", ("learning_rate", "learning_rate_power", "l1", "l2")

    def __init__(self, learning_rate: float = 0.01, learning_rate_power: float = -0.5,
                 l1: float = 0.0, l2: float = 0.0, initial_accumulator_value: float = 0.1):
        if learning_rate_power > 0:
            raise ValueError(f"Ftrl: learning_rate_power must be <= 0, got {learning_rate_power}")
        self.learning_rate, self.learning_rate_power = learning_rate, learning_rate_power
        self.l1, self.l2 = l1, l2
        self.slot_init = (0.0, float(initial_accumulator_value))


OPTIMIZERS = {cls.name: cls for cls in (SGD, Adagrad, Adam, Ftrl)}


def from_config(config: dict) -> SparseOptimizer:
    """The optimizer ``get_config()`` described."""
    config = dict(config)
    return OPTIMIZERS[config.pop("name")](**config)


def resolve(spec) -> Optional[SparseOptimizer]:
    """An optimizer from a spec, a name ("adagrad"), a ``get_config()`` dict or None (no
    training)."""
    if spec is None or isinstance(spec, SparseOptimizer):
        return spec
    if isinstance(spec, str) and spec.lower() in OPTIMIZERS:
        return OPTIMIZERS[spec.lower()]()
    if isinstance(spec, dict) and spec.get("name") in OPTIMIZERS:
        return from_config(spec)
    raise ValueError(f"unknown optimizer {spec!r}; expected one of {', '.join(OPTIMIZERS)} or a "
                     "tfpsx.embedding.SparseOptimizer (SGD, Adagrad, Adam, Ftrl)")

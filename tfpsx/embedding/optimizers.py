"""Server-side optimizers of a table: their slots live beside each row, on the PS.

Each optimizer is one functor in the C++ core (``custom_ops/cc/core/optimizers.h``),
registered there under its ``name`` with its slot count and hyperparameter names in order:
that registry is the single source of truth, and one op, ``TfpsxHashTableApply``, runs
any of them. A spec here is the Python face of one entry: its constructor arguments, its
``HYPERPARAMS`` (attributes, named and ordered as the registry's) and its ``slot_init``
(each slot's initial value). :func:`check_registry` compares the specs with the registry
the op library reports, the first time an optimizer is resolved: a mismatch is an error
naming both sides. A new optimizer is one functor, one line in the C++ list and one spec.
"""

from __future__ import annotations

import inspect
import threading
from typing import Iterable, Optional, Sequence, Tuple

import tensorflow as tf

from tfpsx.ops import bindings


class SparseOptimizer:
    """A server-side optimizer spec (subclass it; see the module docstring)."""
    name = "optimizer"
    HYPERPARAMS: Tuple[str, ...] = ()
    slot_init: Sequence[float] = ()
    # Whether the slot changes of N workers that trained one row from the same state add
    # up to what one worker training all their steps would hold: true of a sum of
    # squared gradients (Adagrad's accumulator), not of moving averages (Adam's moments)
    # or of a state that depends on the row's value (FTRL's z). GEO's
    # geo_table_rule="shared_slots" sums them.
    slot_deltas_add = True

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
    slot_deltas_add = False  # N moving averages from one value do not sum to one

    def __init__(self, learning_rate: float = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-7):
        self.learning_rate, self.beta1, self.beta2, self.epsilon = learning_rate, beta1, beta2, epsilon


class Ftrl(SparseOptimizer):
    """FTRL-Proximal, as ``tf.compat.v1.train.FtrlOptimizer`` (slots: z, accumulator)."""
    name, HYPERPARAMS = "ftrl", ("learning_rate", "learning_rate_power", "l1", "l2")
    # n (the squared gradients) adds up; z's sigma * w term uses each worker's own n and w.
    slot_deltas_add = False

    def __init__(self, learning_rate: float = 0.01, learning_rate_power: float = -0.5,
                 l1: float = 0.0, l2: float = 0.0, initial_accumulator_value: float = 0.1):
        if learning_rate_power > 0:
            raise ValueError(f"Ftrl: learning_rate_power must be <= 0, got {learning_rate_power}")
        self.learning_rate, self.learning_rate_power = learning_rate, learning_rate_power
        self.l1, self.l2 = l1, l2
        self.slot_init = (0.0, float(initial_accumulator_value))


OPTIMIZERS = {cls.name: cls for cls in (SGD, Adagrad, Adam, Ftrl)}


class RegistryMismatchError(RuntimeError):
    """The Python optimizer specs and the op library's registry disagree."""


def check_registry(native: Iterable[Tuple[str, int, Tuple[str, ...]]],
                   specs: Optional[dict] = None) -> None:
    """Raises RegistryMismatchError unless ``specs`` (default :data:`OPTIMIZERS`) and the
    library's registry ``native`` (``[(name, num_slots, hyperparameters)]``, see
    ``tfpsx.ops.bindings.optimizer_registry``) list the same optimizers with the same slot
    counts and the same hyperparameters in the same order."""
    specs = OPTIMIZERS if specs is None else specs
    native = {name: (slots, tuple(hparams)) for name, slots, hparams in native}
    problems = []
    for name in sorted(set(native) | set(specs)):
        if name not in specs:
            problems.append(f"{name!r} is in the op library's registry but has no Python spec")
            continue
        if name not in native:
            problems.append(f"{name!r} has a Python spec ({specs[name].__name__}) but is not in "
                            "the op library's registry")
            continue
        spec = specs[name]
        spec_slots = len(spec().slot_init)
        slots, hparams = native[name]
        if spec_slots != slots:
            problems.append(f"{name!r}: the op library keeps {slots} slot(s), "
                            f"{spec.__name__} initializes {spec_slots}")
        if tuple(spec.HYPERPARAMS) != hparams:
            problems.append(f"{name!r}: the op library takes hyperparameters "
                            f"[{', '.join(hparams)}], {spec.__name__} sends "
                            f"[{', '.join(spec.HYPERPARAMS)}]")
    if problems:
        raise RegistryMismatchError(
            "the server-side optimizers of tfpsx's Python specs (tfpsx/embedding/"
            "optimizers.py) and of its op library (custom_ops/cc/core/optimizers.h) "
            "differ: " + "; ".join(problems) + ". Rebuild the op library from the same "
            "source tree (pip install -e .) or fix the spec.")


_checked = False
_check_lock = threading.Lock()


def _check_library_once() -> None:
    global _checked
    if _checked:
        return
    with _check_lock:
        if not _checked:
            check_registry(bindings.optimizer_registry())
            _checked = True


def from_config(config: dict) -> SparseOptimizer:
    """The optimizer ``get_config()`` described."""
    config = dict(config)
    return OPTIMIZERS[config.pop("name")](**config)


def resolve(spec) -> Optional[SparseOptimizer]:
    """An optimizer from a spec, a name ("adagrad"), a ``get_config()`` dict or None (no
    training)."""
    if spec is None:
        return spec
    _check_library_once()
    if isinstance(spec, SparseOptimizer):
        return spec
    if isinstance(spec, str) and spec.lower() in OPTIMIZERS:
        return OPTIMIZERS[spec.lower()]()
    if isinstance(spec, dict) and spec.get("name") in OPTIMIZERS:
        return from_config(spec)
    raise ValueError(f"unknown optimizer {spec!r}; expected one of {', '.join(OPTIMIZERS)} or a "
                     "tfpsx.embedding.SparseOptimizer (SGD, Adagrad, Adam, Ftrl)")

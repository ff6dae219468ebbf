"""Where ``fit``, ``evaluate`` and ``predict`` meet the strategy.

Keras 3 has no hook around ``fit`` for a ``tf.distribute`` strategy, and tfpsx's modes
need one (the chief's initialization, GEO's communicator and final sync, a bounded wait
that failed inside a step re-raised as itself). :func:`install` wraps ``keras.Model``'s
three methods once, for the process: a model built in a
``tfpsx.keras.ParameterServerStrategy`` scope goes through the strategy's ``call_keras``;
every other model through Keras unchanged (unless a strategy exists and the model was
built outside its scope: then its ``fit`` would train a local model only, a clear error).
The user adds no callback: the strategy adds :class:`ModeCallback` to ``fit``'s.
"""

from __future__ import annotations

import functools
import threading
import weakref

import keras

from tfpsx.embedding.cache import flush_due_eager_caches

_lock = threading.Lock()
_originals = {}
_strategies: "weakref.WeakSet" = weakref.WeakSet()


class ModeCallback(keras.callbacks.Callback):
    """Tells the mode when an execution of the train function ended (GEO wakes its
    communicator there; ``steps_per_execution`` steps ran)."""

    def __init__(self, mode):
        super().__init__()
        self._mode = mode

    def on_train_batch_end(self, batch, logs=None):
        self._mode.batch_end(self.model)
        flush_due_eager_caches()  # worker caches sync between steps


def install(strategy) -> None:
    """Routes fit / evaluate / predict of models built in ``strategy``'s scope through it."""
    with _lock:
        _strategies.add(strategy)
        for name in ("fit", "evaluate", "predict"):
            if name not in _originals:
                _originals[name] = getattr(keras.Model, name)
                setattr(keras.Model, name, _routed(name, _originals[name]))


def _routed(name: str, original):
    @functools.wraps(original)
    def method(model, *args, **kwargs):
        strategy = getattr(model, "_distribute_strategy", None)
        if strategy in _strategies:
            return strategy.call_keras(name, original, model, args, kwargs)
        if len(_strategies):
            raise ValueError(
                f"this model was built outside tfpsx.keras.ParameterServerStrategy.scope(), "
                f"so {name}() would use a local model only: build and compile it inside "
                "`with strategy.scope():`")
        return original(model, *args, **kwargs)

    return method

"""Which of a Keras model's weights its training step writes by a read and an assign
(``v.assign(f(v))``) rather than by TF's atomic add: GEO's background rounds must not
pull into such a weight, since a pull that lands between the step's read and its assign
is overwritten, and the next push then sends the others' change back negated (GEO pulls
beside it instead: :class:`tfpsx.modes.geo.GeoVariable`'s ``pulled``). Of the weights
GEO pairs (the trainable ones; a layer's non-trainable state stays per worker):

* every one, when the optimizer's update is not one of the Keras optimizers known to
  add to the weight (``assign_add`` / ``assign_sub`` on its ``tf.Variable``, weight
  decay included): FTRL and schedule-free AdamW assign the weight, Muon its weight
  decay, and a user's optimizer is not known;
* one with a constraint (Keras applies it as ``v.assign(constraint(v))`` after the
  update);
* one the optimizer overwrites with its gradient (``overwrite_with_gradient``: float8
  layers' scales).

A step of the user's own that assigns a weight (a custom ``train_step``) is not seen.

An optimizer with ``use_ema=True`` assigns the weights their moving average outright
(every ``ema_overwrite_frequency`` steps, and when ``fit`` ends): :func:`averaging` names
it, and GEO refuses it for the weights it pairs.
"""

from __future__ import annotations

from typing import Dict

import keras

# Keras 3's optimizers whose update_step changes the weight by the optimizer's
# assign_add / assign_sub, and whose weight decay is the TF backend's (an assign_sub of
# the tf.Variable): read in keras/src/optimizers; the TF backend runs them as the
# tf.Variable's own atomic adds. Not Muon: its own weight decay assigns the Keras
# variable. Matched by exact class: a subclass may override either.
ADDING_OPTIMIZERS = tuple(getattr(keras.optimizers, name) for name in (
    "SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "Adafactor", "Lamb", "Lion",
    "Nadam", "RMSprop") if hasattr(keras.optimizers, name))


_LOSS_SCALE = getattr(keras.optimizers, "LossScaleOptimizer", None)


def _adds(optimizer) -> bool:
    """Whether ``optimizer`` changes the weights by adds (a LossScaleOptimizer: its
    inner one's)."""
    inner = getattr(optimizer, "inner_optimizer", None)
    if _LOSS_SCALE is not None and isinstance(optimizer, _LOSS_SCALE) and inner is not None:
        return _adds(inner)
    return type(optimizer) in ADDING_OPTIMIZERS


def read_and_assigned(model) -> Dict[int, str]:
    """The ``tf.Variable`` s under ``model``'s weights that its training step may write by
    a read and an assign (see the module doc): ``id(variable)`` -> why, for the log."""
    optimizer = getattr(model, "optimizer", None)
    adds = _adds(optimizer)
    found = {}
    for w in model.trainable_weights:
        if not adds:
            why = f"its optimizer ({type(optimizer).__name__}) assigns them"
        elif getattr(w, "constraint", None) is not None:
            why = "a constraint"
        elif getattr(w, "overwrite_with_gradient", False):
            why = "the optimizer overwrites it with its gradient"
        else:
            continue
        found[id(getattr(w, "value", w))] = why
    return found


def averaging(optimizer) -> bool:
    """Whether ``optimizer`` (a LossScaleOptimizer: its inner one) keeps a moving average
    of the weights that it assigns them (Keras's ``use_ema=True``)."""
    inner = getattr(optimizer, "inner_optimizer", None)
    if _LOSS_SCALE is not None and isinstance(optimizer, _LOSS_SCALE) and inner is not None:
        return averaging(inner)
    return bool(getattr(optimizer, "use_ema", False))

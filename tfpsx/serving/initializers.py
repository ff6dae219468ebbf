"""A table's initial row of a key, in stock TensorFlow ops (no tfpsx op).

A tfpsx table gives a key it does not hold the row its initializer draws from (seed, key)
(``custom_ops/cc/core/initializer.h``). A served model must give an id unseen in training
the same row, so :func:`initial_rows` computes that function again with ops every
TensorFlow (and TF Serving) has: splitmix64 in ``uint64`` arithmetic (``tf.bitwise`` and
wrapping multiplication), then the same float32 steps in the same order.

Exactness (``tests/ops/test_serving_export.py`` checks it against the table's op):

* ``zeros``, ``constant`` and ``uniform`` rows are bit-identical to the table's: they take
  only integer ops and float32 adds and multiplies, each rounded as in C++ (the op library
  is built for baseline x86-64 without ``-ffast-math``: no FMA contraction).
* ``normal`` rows take ``logf``, ``cosf`` and ``sinf`` from the C library of the machine
  that runs the table (glibc, whose x86-64 build also picks an FMA or a plain variant at
  run time by CPU). Those are not correctly rounded (glibc 2.36 on this project's machines,
  measured with ctypes over 300k of this initializer's arguments: 0.7%, 1.3% and 1.3% of
  them differ from the correctly rounded float), and TensorFlow's float32 ``Log`` /
  ``Cos`` / ``Sin`` are other approximations again (they differ from glibc's for 23%,
  19% and 14% of the same arguments), so no stock op sequence reproduces them bit for
  bit on every machine. Here they are computed
  in float64 and rounded to float32 once (the correctly rounded values, which the C
  library's are within one unit in the last place of); the rest follows the C++ steps.
  About 0.4-1% of a normal table's initial values then differ from the table's by a
  rounding step or two: at most ~2.4e-7 x (|mean| + 6 x stddev) in absolute terms
  (7e-8 for ``normal(stddev=0.05)``; 3e-8 measured).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

_U64 = tf.uint64
_TWO_PI = np.float32(6.2831853071795864)
_INV_2_24 = np.float32(1.0 / 16777216.0)
_HALF_STEP = np.float32(0.5 / 16777216.0)


def _u64(value: int) -> tf.Tensor:
    return tf.constant(value % 2 ** 64, _U64)


def _mix(x: tf.Tensor) -> tf.Tensor:
    """splitmix64's finalizer (``Mix`` in initializer.h); uint64 arithmetic wraps."""
    x = x + _u64(0x9E3779B97F4A7C15)
    x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, _u64(30))) * _u64(0xBF58476D1CE4E5B9)
    x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, _u64(27))) * _u64(0x94D049BB133111EB)
    return tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, _u64(31)))


def _uniform01(bits: tf.Tensor) -> tf.Tensor:
    """(0, 1] in float32 from the top 24 bits (``Uniform01``)."""
    top = tf.cast(tf.bitwise.right_shift(bits, _u64(40)), tf.float32)  # < 2^24: exact
    return (top + np.float32(1.0)) * _INV_2_24


def _rounded(fn, x: tf.Tensor) -> tf.Tensor:
    """``fn`` of a float32 tensor, correctly rounded to float32 (computed in float64)."""
    return tf.cast(fn(tf.cast(x, tf.float64)), tf.float32)


def initial_rows(keys: tf.Tensor, kind: str, a: float, b: float, seed: int,
                 dim: int) -> tf.Tensor:
    """The initial rows ``[n, dim]`` float32 of int64 ``keys`` ``[n]``.

    Args:
      keys: a 1-D int64 tensor.
      kind, a, b: the initializer (``tfpsx.embedding.Initializer``'s fields).
      seed: the table's seed (an int64, as the table's op attribute takes it).
      dim: the row width.

    Raises:
      ValueError: an unknown initializer kind.
    """
    a32, b32 = np.float32(a), np.float32(b)
    n = tf.size(keys)
    if kind in ("zeros", "constant"):
        value = a32 if kind == "constant" else np.float32(0.0)
        return tf.fill(tf.stack([n, dim]), value)
    if kind not in ("uniform", "normal"):
        raise ValueError(f"initializer kind must be zeros, constant, uniform or normal, "
                         f"got {kind!r}")
    key_bits = tf.bitcast(tf.cast(keys, tf.int64), _U64)
    base = tf.expand_dims(_mix(tf.bitwise.bitwise_xor(_u64(seed), _mix(key_bits))), 1)
    if kind == "uniform":
        span = np.float32(b32 - a32)  # float32 arithmetic, as in C++
        j = tf.constant(np.arange(dim, dtype=np.uint64))
        return a32 + span * (_uniform01(_mix(base + j)) - _HALF_STEP)
    # Normal, Box-Muller: pair p draws from base + 4p and base + 4p + 1 (C++'s loop index
    # j = 2p reads base + 2j, base + 2j + 1) and fills values 2p and 2p + 1.
    pairs = (dim + 1) // 2
    offsets = tf.constant(4 * np.arange(pairs, dtype=np.uint64))
    u1 = _uniform01(_mix(base + offsets))
    u2 = _uniform01(_mix(base + offsets + _u64(1)))
    radius = tf.sqrt(np.float32(-2.0) * _rounded(tf.math.log, u1)) * b32
    angle = _TWO_PI * u2
    first = a32 + radius * _rounded(tf.cos, angle)
    second = a32 + radius * _rounded(tf.sin, angle)
    rows = tf.reshape(tf.stack([first, second], axis=2), [-1, 2 * pairs])
    return rows[:, :dim] if dim % 2 else rows

"""A worker cache's admission filter: a count-min sketch of recent misses (TinyLFU).

A missed row enters the cache at its K-th recent sighting. The sketch keeps
:data:`DEPTH` rows of int32 counters, each indexed by its own hash of the key; a key's
estimate is the least of its counters. Once ``window`` missed ids went in since it last
did, every counter halves (TinyLFU's aging), so old sightings fade.
"""

from __future__ import annotations

import tensorflow as tf

DEPTH = 4
# Each row's hash: (key mod a prime < 2^31) * a + b, mod the width (no int64 overflow).
_HASH = ((2147483647, 1103515245, 12345), (2147483629, 69069, 1013904223),
         (2147483587, 1664525, 907633385), (2147483563, 22695477, 1))


class AdmissionSketch:
    """The sketch of a cache of ``size`` rows: >= 4 counters per cached row, aged every
    10x the cache's size in missed ids."""

    def __init__(self, size: int):
        self.width = 1 << max(10, (4 * size - 1).bit_length())
        self.window = 10 * size

    def variable(self, collections):
        """The counters, a worker-local variable ``[DEPTH, width]``."""
        return tf.compat.v1.Variable(tf.zeros([DEPTH, self.width], tf.int32), trainable=False,
                                     collections=collections, name="tfpsx_cache_sketch")

    def add(self, sketch, keys, counts):
        """Adds ``counts`` sightings of ``keys``; returns (each key's estimated recent
        sightings, this one included)."""
        n = tf.size(keys)
        index = tf.stack([tf.math.floormod(tf.math.floormod(keys, p) * a + b, self.width)
                          for p, a, b in _HASH])  # [depth, n]
        rows = tf.broadcast_to(tf.range(DEPTH, dtype=tf.int64)[:, None], [DEPTH, n])
        where = tf.reshape(tf.stack([rows, index], axis=-1), [-1, 2])
        added = sketch.scatter_nd_add(where, tf.reshape(
            tf.broadcast_to(tf.cast(counts, tf.int32)[None, :], [DEPTH, n]), [-1]))
        # gather from the variable itself: a read_value() would copy the whole sketch
        # (and make the next scatter copy it again)
        with tf.control_dependencies([added] if not tf.executing_eagerly() else []):
            return tf.reduce_min(tf.reshape(sketch.gather_nd(where), [DEPTH, n]), axis=0)

    @staticmethod
    def halve(sketch):
        """Ages the sketch: every counter halves."""
        return sketch.assign(tf.math.floordiv(sketch.read_value(), 2))

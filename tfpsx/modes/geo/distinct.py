"""How many distinct rows a worker's steps trained since the last round
(:class:`DistinctRows`), for ``geo_table_choice="auto"``'s estimate of what rounds would
move on a table that trains async (:mod:`.choice`): linear counting over a bitmap.

Each training lookup sets the bucket of each of its unique keys (the top bits of a
Fibonacci hash, as :mod:`.contention`'s); a round reads how many buckets are still clear
(``z`` of ``m``) and clears them: ``-m ln(z / m)`` distinct keys (Whang et al.'s linear
counting: within ~1% while the keys are fewer than ``m``; a full bitmap reads as ``m ln
m``). One byte a bucket (256 KiB a table at the default width), on the worker,
worker-local; a step's marks racing with the round's read land in this round or the next.
"""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from tfpsx import graph_state
from tfpsx.modes.geo.contention import bucket_of

DEFAULT_WIDTH = 1 << 18


class DistinctRows:
    """The distinct keys a worker's training lookups held since the last :meth:`take`.

    Args:
      name: the table's name (the variable's, one per graph).
      device: this worker's device.
      width: buckets (a power of two).
    """

    def __init__(self, name: str, device: Optional[str], width: int = DEFAULT_WIDTH):
        if width < 2 or width & (width - 1):
            raise ValueError(f"DistinctRows: width must be a power of two >= 2, got {width!r}")
        self.name, self.device, self.width = name, device, int(width)

    def mark(self, unique_keys):
        """Sets the buckets of a training lookup's ``unique_keys`` (int64); the op."""
        bits = self._bits()
        buckets = bucket_of(unique_keys, self.width)
        return bits.scatter_update(tf.IndexedSlices(
            tf.ones(tf.shape(buckets), tf.int8), buckets))

    def take(self) -> tf.Tensor:
        """The distinct keys marked since the last take (float64, estimated), and the
        bitmap cleared."""
        bits = self._bits()
        with tf.compat.v1.device(self.device):
            clear = tf.cast(self.width, tf.float64) - tf.reduce_sum(
                tf.cast(bits.read_value(), tf.float64))
            with tf.control_dependencies([clear]):
                reset = bits.assign(tf.zeros([self.width], tf.int8))
            with tf.control_dependencies([reset]):
                m = float(self.width)
                return -m * tf.math.log(tf.maximum(clear, 1.0) / m)

    def _bits(self):
        return graph_state.worker_local(
            self, "geo_distinct", self.name, self.device,
            lambda collections: tf.compat.v1.Variable(
                tf.zeros([self.width], tf.int8), trainable=False, collections=collections,
                use_resource=True, name="tfpsx_geo_distinct"))


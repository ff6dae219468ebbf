"""How often GEO's N workers would train a row in one round: the rows too contended for
the copies (GEO's hot rows by contention, a strategy's ``geo_hot_per_round``).

A round sums what the N workers' copies did to a row in K local steps, every step of it
computed from the row's value at the last pull. The more of those steps a round holds,
the further the sum strays from what async's steps, taken one after another, would have
done: measured with ``benchmarks/geo_scale.py``, within 1% of async's loss while a round
holds at most ``bound`` of a row's steps (:data:`~tfpsx.modes.geo.rule.GEO_AUTO_KN` in
deterministic rounds; :data:`~tfpsx.modes.geo.rule.GEO_AUTO_KN_BACKGROUND` in background
ones, whose pull lands up to K steps late), 2.2% above it at 80 (word2vec, 8 workers,
K=10), diverging at 320. ``k_steps="auto"`` keeps K x N within that bound for every row;
with a K of the user's, :class:`Contention` finds the rows for which it does not hold
and GEO trains them on the PS (async), the rest in the copy. In background rounds the
strategy's "auto" bound is :data:`~tfpsx.modes.geo.rule.GEO_HOT_PER_ROUND_BACKGROUND`,
half the K x N that ``k_steps="auto"`` keeps there
(:func:`tfpsx.modes.geo.rule.auto_hot_per_round`), so an "auto" job builds the estimate
too from a K x N over that (K > 1).

The estimate: the number of this worker's last ~K batches before this one that held
the row (an exponential moving average with a window of K lookups, one counter per hash
bucket), scaled to K batches (a row in a fraction p of them has (K - 1) p there) and
times N (the other workers draw from the same stream). The batch at hand is left out:
that it holds the row says nothing of the others' batches (counted in, a row seen once
would weigh N). A batch that holds an id several times is one step of its row
(``geo_hot_count`` is the rule for those). A row is hot when the estimate reaches
``bound``. Before a worker has seen a row's rate it counts as hot: every counter starts
at twice the bound and fades over the window, so a job's first ~K steps train on the PS
(measured: without that start, the first rounds' sums of large early steps cost 1.4% of
word2vec's loss at N=8, K=10; with it, 0.2%).

One counter a bucket (``width`` buckets, float32 value and int64 age: 12 bytes each; 3
MiB a table at the default width), on the worker, worker-local (not saved: a restarted
worker starts again from the bound). Two rows that share a bucket add up: a rare row
beside a hot one is taken for hot (async's traffic for it, not a loss of quality).
"""

from __future__ import annotations

import logging
import math
from typing import Callable, Optional

import tensorflow as tf

from tfpsx import graph_state

logger = logging.getLogger("tfpsx")

DEFAULT_WIDTH = 1 << 18
_MIX = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: Fibonacci hashing


class Contention:
    """Which rows of a worker's batch a GEO round would train more than ``bound`` times.

    Args:
      name: the table's name (the variables' names, one set per graph).
      device: this worker's device.
      worker_num: N.
      k_steps: K, read when a step is built (Keras chooses ``k_steps="auto"`` at its first
        ``fit``): with K x N <= ``bound`` no row can be, and :meth:`hot` builds nothing.
      bound: the most steps of a row a round may sum (>= 1).
      width: hash buckets (a power of two).
    """

    def __init__(self, name: str, device: Optional[str], worker_num: int,
                 k_steps: Callable[[], int], bound: int, width: int = DEFAULT_WIDTH):
        if bound < 1:
            raise ValueError(f"Contention: bound must be >= 1, got {bound!r}")
        if width < 2 or width & (width - 1):
            raise ValueError(f"Contention: width must be a power of two >= 2, got {width!r}")
        self.name, self.device, self.worker_num = name, device, int(worker_num)
        self.k_steps, self.bound, self.width = k_steps, int(bound), int(width)
        self._told = False  # the log line, once

    def active(self) -> bool:
        """Whether a round can sum more than ``bound`` steps of a row (K x N > bound)
        and the estimate can see it: a round of one step (K = 1) keeps no batches
        before the one at hand, so no row is hot by it and nothing is built."""
        k = self.k_steps()
        return k > 1 and k * self.worker_num > self.bound

    def hot(self, unique_keys) -> Optional[tf.Tensor]:
        """Counts a step of this lookup's ``unique_keys`` (int64) and returns which of
        them are hot (bool), or None when none can be (:meth:`active`). Call it once per
        training lookup."""
        if not self.active():
            return None
        k = self.k_steps()
        if not self._told:
            self._told = True
            logger.info("GEO: %s: a round sums up to K x N = %d x %d = %d steps of a row, over "
                        "geo_hot_per_round=%d: the rows the workers would train %d+ times "
                        "in a round (estimated on this worker) train on the PS, async",
                        self.name, k, self.worker_num, k * self.worker_num, self.bound,
                        self.bound)
        ema, age, clock = self._vars()
        bucket = self.bucket(unique_keys)
        buckets, at = tf.unique(bucket)
        # a step that holds the row (however often) is one of its steps
        added = tf.math.unsorted_segment_sum(tf.ones(tf.shape(at), tf.float32), at,
                                             tf.size(buckets))
        now = clock.assign_add(1)
        keep = 1.0 - 1.0 / k  # > 0: active() holds K > 1
        idle = tf.cast(now - tf.gather(age, buckets), tf.float32)
        # The estimate is the count before this batch: the batch holds the row on this
        # worker, which says nothing of how often the others' batches do (counted in, a
        # row seen once would weigh N, and from N >= bound every row would be hot).
        before = tf.gather(ema, buckets) * tf.pow(keep, idle)
        with tf.control_dependencies([before]):  # graph mode: read both, then write
            stored = [ema.scatter_update(tf.IndexedSlices(before + added, buckets)),
                      age.scatter_update(tf.IndexedSlices(tf.fill(tf.shape(buckets), now),
                                                          buckets))]
        # before / keep: a row in a fraction p of the batches has (K - 1) p before, K p
        # after its batch: N x K p
        scale = float(self.worker_num) / keep
        with tf.control_dependencies(stored if not tf.executing_eagerly() else []):
            return tf.gather(before, at) * scale >= float(self.bound)

    def bucket(self, keys) -> tf.Tensor:
        """Each key's bucket (:func:`bucket_of`)."""
        return bucket_of(keys, self.width)

    def _vars(self) -> tuple:
        """(ema, age, clock): worker-local variables (``graph_state.worker_local``; not
        saved)."""
        return graph_state.worker_local(self, "geo_contention", self.name, self.device,
                                        self._make)

    def _make(self, collections) -> tuple:
        start = 2.0 * self.bound / self.worker_num  # every row hot until its rate shows
        return tuple(tf.compat.v1.Variable(init, trainable=False, collections=collections,
                                           name=f"tfpsx_contention_{part}")
                     for part, init in (("ema", tf.fill([self.width], start)),
                                        ("age", tf.zeros([self.width], tf.int64)),
                                        ("clock", tf.constant(0, tf.int64))))


def bucket_of(keys, width: int) -> tf.Tensor:
    """Each key's bucket of ``width`` (a power of two): the top bits of key x 2^64 /
    golden ratio (int64 wraps; the shift is arithmetic, the mask drops the sign's
    copies)."""
    bits = int(math.log2(width))
    mixed = tf.cast(keys, tf.int64) * tf.constant(_MIX, tf.int64)
    return tf.bitwise.bitwise_and(tf.bitwise.right_shift(mixed, 64 - bits),
                                  tf.constant(width - 1, tf.int64))

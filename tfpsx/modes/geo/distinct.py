"""How many distinct rows a worker's steps trained since the last round
(:class:`DistinctRows`), for ``geo_table_choice="auto"``'s estimate of what rounds would
move on a table that trains async (:mod:`.choice`): linear counting over a bitmap.

Each training lookup sets the bucket of each of its unique keys (the top bits of a
Fibonacci hash, as :mod:`.contention`'s); a round reads how many buckets are still clear
(``z`` of ``m``) and clears them: ``-m ln(z / m)`` distinct keys (Whang et al.'s linear
counting: within ~1% while the keys are fewer than ``m``; a full bitmap reads as ``m ln
m``). One byte a bucket (256 KiB a table at the default width), on the worker,
worker-local; a step's marks racing with the round's read land in this round or the next.

The estimate is of K steps (a round's): while every table trains async, rounds run
further apart (:class:`~tfpsx.modes.geo.schedule.GeoSchedule`, TFPSX_GEO_QUIET_ROUND_SECONDS),
and the distinct rows of more steps would count rows met again as one, below what that
many K-step rounds would move. So a count marks the training lookups of only the first
K steps after each take (``steps``: K x the lookups a step's graph builds, counted as
they are built, a model may look a table up several times a step), and a take scales
its estimate by the lookups since the last take over those marked. Before the first
take it marks K lookups (the choice leaves a job's first round out).
"""

from __future__ import annotations

import types
from typing import Callable, Optional

import tensorflow as tf

from tfpsx import compat, graph_state
from tfpsx.modes.geo.contention import bucket_of

DEFAULT_WIDTH = 1 << 18


class DistinctRows:
    """The distinct keys a worker's training lookups held since the last :meth:`take`.

    Args:
      name: the table's name (the variable's, one per graph).
      device: this worker's device.
      width: buckets (a power of two).
      steps: the steps whose lookups are marked after each take (K: a round's steps),
        read when a lookup is built; 0: every lookup.
    """

    def __init__(self, name: str, device: Optional[str], width: int = DEFAULT_WIDTH,
                 steps: Callable[[], int] = lambda: 0):
        if width < 2 or width & (width - 1):
            raise ValueError(f"DistinctRows: width must be a power of two >= 2, got {width!r}")
        self.name, self.device, self.width = name, device, int(width)
        self._steps = steps
        self.steps = 0  # the steps a take's estimate holds (the last mark's; 0: all)
        self.sites = 1  # the training lookups the last step's graph built
        self._sites_in = None  # (that graph)
        self._count_owner = types.SimpleNamespace()  # (worker_local keeps one per owner)

    def mark(self, unique_keys):
        """Sets the buckets of a training lookup's ``unique_keys`` (int64) while the
        lookups since the last take are within the first ``steps()`` steps' (0:
        always); the op. Each lookup built in a step's graph is counted a site."""
        self.steps = int(self._steps())
        if self.steps < 0:
            raise ValueError(f"DistinctRows: steps must be >= 0, got {self.steps!r}")
        step_graph = compat.step_graph(tf.compat.v1.get_default_graph())
        if tf.executing_eagerly():
            self.sites = 1  # (each eager call is a step)
        elif step_graph is not self._sites_in:  # (a new graph, or a trace again)
            self._sites_in, self.sites = step_graph, 1
        else:
            self.sites += 1
        bits, count = self._bits(), self._count()
        with tf.compat.v1.device(self.device):
            # [lookups since the last take, the most to mark]
            now = count.assign_add(tf.constant([1, 0], tf.int64))

        def set_buckets():
            buckets = bucket_of(unique_keys, self.width)
            with tf.control_dependencies([bits.scatter_update(tf.IndexedSlices(
                    tf.ones(tf.shape(buckets), tf.int8), buckets))]):
                return tf.constant(True)

        if not self.steps:
            with tf.control_dependencies([now]):
                return set_buckets()
        return tf.cond(now[0] <= now[1], set_buckets, lambda: tf.constant(False))

    def take(self) -> tf.Tensor:
        """The distinct keys of the lookups marked since the last take (float64,
        estimated) times the lookups since then over those marked (at least 1); the
        bitmap and the count cleared, the next take's lookups to mark set (K x the
        sites of the step's graph, built by then)."""
        per = self.steps * self.sites
        bits, count = self._bits(), self._count()
        with tf.compat.v1.device(self.device):
            clear = tf.cast(self.width, tf.float64) - tf.reduce_sum(
                tf.cast(bits.read_value(), tf.float64))
            seen = tf.cast(count.read_value()[0], tf.float64)
            with tf.control_dependencies([clear, seen]):
                reset = [bits.assign(tf.zeros([self.width], tf.int8)),
                         count.assign(tf.constant([0, per], tf.int64))]
            with tf.control_dependencies(reset):
                m = float(self.width)
                scale = (tf.maximum(seen / float(per), 1.0) if per
                         else tf.constant(1.0, tf.float64))
                return -m * tf.math.log(tf.maximum(clear, 1.0) / m) * scale

    def _bits(self):
        return graph_state.worker_local(
            self, "geo_distinct", self.name, self.device,
            lambda collections: tf.compat.v1.Variable(
                tf.zeros([self.width], tf.int8), trainable=False, collections=collections,
                use_resource=True, name="tfpsx_geo_distinct"))

    def _count(self):
        return graph_state.worker_local(
            self._count_owner, "geo_distinct_lookups", self.name, self.device,
            lambda collections: tf.compat.v1.Variable(
                tf.constant([0, self.steps], tf.int64), trainable=False,
                collections=collections, use_resource=True,
                name="tfpsx_geo_distinct_lookups"))

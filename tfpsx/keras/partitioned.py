"""Large variables cut along axis 0 over the parameter servers, for Keras 3 ``fit``.

A model weight of ``min_shard_bytes`` or more (256 KiB by default, graph mode's
:func:`tfpsx.variable_partitioner` default) gets its global value in slices, one
:class:`~tfpsx.keras.variables.SharedVariable` each, placed by bytes like every other
variable: a 100 MB kernel no longer lands whole on one PS. The partitioner is TF's own
(``tf.distribute.experimental.partitioners``: ``MinSizePartitioner``,
``MaxSizePartitioner``, ``FixedShardsPartitioner``, or any callable
``(shape, dtype) -> partitions per axis``), given to
``tfpsx.keras.ParameterServerStrategy(variable_partitioner=...)``.

Keras 3 has no sharded variables (its ``keras.Variable`` wraps one ``tf.Variable``, whose
handle the gradient tape and the optimizer key on), so what Keras holds stays one
variable on the worker and the slices are its global counterpart:

* GEO: the worker's copy is local anyway; the push and pull split by slice.
* async, sync, staleness: the worker's variable is a :class:`View`. Every step first
  reads the slices into it (the step reads current global values, as an unpartitioned
  variable on a PS would), the optimizer's update runs on the worker, and what the
  update changed (``new - read``, for the weight and each of its optimizer slots, which
  are views too) is added to the slices: each worker's update reaches the global value,
  whatever the others did meanwhile.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Sequence

import tensorflow as tf

from tfpsx.keras.variables import SharedVariable, initialize

DEFAULT_MIN_SHARD_BYTES = 256 << 10


def default_partitioner(server_num: int):
    """Slices of at least 256 KiB, at most one per parameter server."""
    return tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=DEFAULT_MIN_SHARD_BYTES, max_shards=server_num)


def resolve_partitioner(value, server_num: int) -> Optional[Callable]:
    """``"auto"`` (the default partitioner), ``None`` (never partition) or a callable."""
    if value is None:
        return None
    if isinstance(value, str) and value == "auto":
        return default_partitioner(server_num)
    if callable(value):
        return value
    raise ValueError(
        "tfpsx.keras.ParameterServerStrategy: variable_partitioner must be 'auto', None or a "
        "callable (shape, dtype) -> partitions per axis (e.g. tf.distribute.experimental."
        f"partitioners.MinSizePartitioner), got {value!r}")


def partitions(partitioner: Optional[Callable], name: str, shape: tf.TensorShape,
               dtype: tf.DType) -> int:
    """How many slices along axis 0 ``partitioner`` cuts the variable ``name`` into (1: it
    stays whole). Scalars and variables of unknown shape stay whole.

    Raises:
      ValueError: the partitioner cut another axis, or into more slices than rows, or
        returned something that is not one positive count per axis.
    """
    if partitioner is None or shape.rank in (None, 0) or not shape.is_fully_defined():
        return 1
    counts = partitioner(shape, dtype)
    try:
        counts = [int(c) for c in counts]
    except TypeError:
        counts = None
    if counts is None or len(counts) != shape.rank or any(c < 1 for c in counts):
        raise ValueError(
            f"variable_partitioner returned {counts!r} for {name!r} of shape {shape}: expected "
            f"a list of {shape.rank} positive counts, one per axis")
    if any(c != 1 for c in counts[1:]):
        raise ValueError(
            f"variable_partitioner cut {name!r} of shape {shape} as {counts}: only axis 0 can "
            "be partitioned (every other count must be 1)")
    if counts[0] > shape[0]:
        raise ValueError(f"variable_partitioner cut {name!r} of shape {shape} into "
                         f"{counts[0]} slices: more than its {shape[0]} rows")
    return counts[0]


def slice_rows(rows: int, parts: int) -> List[int]:
    """Rows per slice: as even as possible, the first ones one row longer (TF's rule)."""
    base, extra = divmod(rows, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


class PartitionedVariable:
    """A global value cut along axis 0 into ``SharedVariable`` slices on the PS tasks.

    Reads concatenate the slices; ``assign`` and ``assign_add`` split the value and write
    each slice where it lives. Enough of a variable for the modes' rules (GEO's push and
    pull, the publish of a restored model, the views' refresh and update)."""

    def __init__(self, slices: Sequence[SharedVariable], home: str):
        self.slices = list(slices)
        self.home = home  # the worker: where values are cut and joined
        self.rows = [int(s.shape[0]) for s in self.slices]
        first = self.slices[0]
        self.dtype = first.dtype
        self.shape = tf.TensorShape([sum(self.rows)]).concatenate(first.shape[1:])
        self.device = first.device  # an outer device scope only: each op names its slice's

    @classmethod
    def create(cls, shared_name: str, name: Optional[str], initial: tf.Tensor, devices,
               home: str, is_chief: bool, timeout: float,
               trainable: bool) -> "PartitionedVariable":
        """Slices ``<shared_name>/part_<i>_of_<n>`` on ``devices`` (one each), initialized
        from ``initial`` by the chief (kept when they hold a value already)."""
        parts = len(devices)
        pieces = tf.split(initial, slice_rows(int(initial.shape[0]), parts), axis=0)
        slices = []
        for i, (piece, device) in enumerate(zip(pieces, devices)):
            var = SharedVariable(shared_name=f"{shared_name}/part_{i}_of_{parts}",
                                 shape=piece.shape, dtype=piece.dtype, device=device,
                                 trainable=trainable, name=f"{name or 'var'}/part_{i}")
            initialize(var, piece, is_chief, timeout)
            slices.append(var)
        return cls(slices, home)

    def read_value(self) -> tf.Tensor:
        reads = [s.read_value() for s in self.slices]  # each on its slice's PS
        with tf.device(self.home):
            return tf.concat(reads, axis=0)

    def numpy(self):
        """The global value, joined (eager)."""
        return self.read_value().numpy()

    def _split(self, value):
        with tf.device(self.home):
            return tf.split(tf.convert_to_tensor(value, self.dtype), self.rows, axis=0)

    def assign(self, value, read_value: bool = False):
        return tf.group(*[s.assign(p, read_value=False)
                          for s, p in zip(self.slices, self._split(value))])

    def assign_add(self, delta, read_value: bool = False):
        return tf.group(*[s.assign_add(p, read_value=False)
                          for s, p in zip(self.slices, self._split(delta))])

    def initialized(self) -> bool:
        return all(s.initialized() for s in self.slices)

    @property
    def devices(self) -> List[str]:
        return [s.device for s in self.slices]

    def __repr__(self):
        return f"<PartitionedVariable shape={self.shape} slices on {self.devices}>"


@dataclasses.dataclass
class View:
    """A worker variable that Keras trains, standing for a partitioned global value
    (async, sync, staleness): refreshed from it before each step; its update's change is
    added to it. ``slots``: the views of the optimizer's slots of this weight."""
    local: tf.Variable
    global_: PartitionedVariable
    slots: List["View"] = dataclasses.field(default_factory=list)
    read: Optional[tf.Tensor] = None  # the value read into ``local`` by the step being traced

    def refresh(self):
        """``local = global``; remembers the value read (the update's baseline)."""
        self.read = self.global_.read_value()
        return self.local.assign(self.read, read_value=False)

    def push_change(self):
        """``global += local - read``: this step's update of ``local``, added to the
        global value (after whatever the other workers added since the read); the
        baseline becomes the value now."""
        if self.read is None:  # no refresh in this trace (an update outside a step)
            raise RuntimeError(f"{self.local.name}: an update without a refresh before it")
        now = self.local.read_value()
        # A second update in one step (weight decay, then the optimizer's rule) pushes
        # only what it changed.
        change, self.read = now - self.read, now
        return self.global_.assign_add(change)

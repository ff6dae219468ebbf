"""Collective mode's protocol, written once for both front-ends: data parallelism by
all-reduce among the workers, no parameter servers.

Every rank holds every weight. Each step, the ranks' gradients are summed by TF's own
``CollectiveReduceV2`` (the op TF's MultiWorkerMirroredStrategy is built on; ring over
gRPC between the workers' collective servers, which ``tfpsx.init_worker()`` starts);
the front-end scales the loss by the world size first, so the sum is the mean gradient
of the global batch. A new weight takes rank 0's initial value (a broadcast), so
differently seeded ranks start equal.

Instance keys are given as the collectives are built, in the same order on every rank,
as TF's own strategies give them (a traced step reuses its keys each run). Every
collective is bounded by
``TFPSX_COLLECTIVE_TIMEOUT``; the peer watch (:meth:`tfpsx.runtime.Runtime.watch_peers`)
names a lost rank sooner and aborts the collectives in flight.
"""

from __future__ import annotations

import itertools
import re
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

import tensorflow as tf

from tfpsx import errors, settings
from tfpsx.control.watchdog import find_in_chain, probe

# One group for all of a job's collectives (its workers, one device each).
GROUP_KEY = 0x7466
# CollectiveReduceV2's types; a weight of another type (a bool flag) is not broadcast.
REDUCIBLE = (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64)


def reducible(variables) -> list:
    """The ``variables`` of a type a collective carries (:data:`REDUCIBLE`)."""
    return [v for v in variables if tf.as_dtype(v.dtype).base_dtype in REDUCIBLE]


def from_rank_0(variables, broadcast: Callable[[list], Sequence]) -> list:
    """Every rank's ``variables`` take rank 0's values (collective and hybrid, at a
    session's or a ``fit``'s start): the :func:`reducible` ones, by
    ``broadcast(variables)`` (rank 0's values of them, in order: an in-graph broadcast,
    or one through the hybrid's dense all-reduce). Returns the assigns' results (graph
    mode runs them). Graph mode's hybrid, whose broadcast runs in the session, feeds
    its assigns instead."""
    variables = reducible(variables)
    if not variables:
        return []
    return [v.assign(x) for v, x in zip(variables, broadcast(variables))]


def step_key(dtype, size: int) -> int:
    """The instance key of a training step's all-reduce of ``size`` values of ``dtype``
    (:meth:`CollectiveGroup.total_in_step`): the same on every rank and in every trace,
    above the keys given in order (which start at 1)."""
    import zlib

    return (1 << 30) + zlib.crc32(f"{tf.as_dtype(dtype).name}:{size}".encode()) % (1 << 29)


class CollectiveGroup:
    """The workers of a collective job, from one rank's side.

    Args:
      rank, size: this worker's rank and the world size.
      device: this worker's device (``/job:worker/replica:0/task:<i>/device:CPU:0``).
    """

    def __init__(self, rank: int, size: int, device: str):
        if not 0 <= rank < size:
            raise ValueError(f"collective group: rank {rank} is out of range for world size "
                             f"{size}; expected 0..{size - 1}")
        self.rank, self.size, self.device = rank, size, device
        self.timeout = float(settings.get("TFPSX_COLLECTIVE_TIMEOUT"))
        # Instance keys are given when a collective is built (traced, or run eagerly),
        # as TF's own strategies give them: ranks build the same collectives in the same
        # order (the same code on the same shapes; tfpsx.data.shard gives every rank the
        # same steps, so a retrace for a last, smaller batch happens on all of them), and
        # a traced step reuses its keys every time it runs.
        self._keys = itertools.count(1)

    def _next_key(self) -> int:
        return next(self._keys)

    def _reduce(self, flat: tf.Tensor, final_op: str) -> tf.Tensor:
        key = self._next_key()
        return tf.raw_ops.CollectiveReduceV2(
            input=flat, group_size=self.size, group_key=GROUP_KEY, instance_key=key,
            ordering_token=[], merge_op="Add", final_op=final_op,
            communication_hint="ring", timeout_seconds=self.timeout)

    def total_in_step(self, flat: tf.Tensor) -> tf.Tensor:
        """A flat tensor's sum over the ranks, as a training step's all-reduce
        (:mod:`tfpsx.modes.lockstep`): its instance key is its dtype's and size's, not
        the next one, so a step traced again (a last, smaller batch on one rank only: an
        input leased as each rank goes), and the idle step of a rank whose data ended,
        meet the others' step in the same collective."""
        n = flat.shape[0]
        if n is None:
            raise ValueError(f"collective all-reduce: the step's {flat.dtype.name} gradients "
                             "have no static size; every trainable variable needs a static "
                             "shape")
        with tf.device(self.device):
            return tf.raw_ops.CollectiveReduceV2(
                input=flat, group_size=self.size, group_key=GROUP_KEY,
                instance_key=step_key(flat.dtype, int(n)), ordering_token=[],
                merge_op="Add", final_op="Id", communication_hint="ring",
                timeout_seconds=self.timeout)

    def all_reduce(self, values: Sequence, mean: bool = False) -> List[tf.Tensor]:
        """The sum (or mean) of each value over the ranks. Values of one dtype travel
        packed in one collective; ``IndexedSlices`` (a sparse Keras gradient) are made
        dense first."""
        with tf.device(self.device):
            return packed(values, lambda flat: self._reduce(flat, "Div" if mean else "Id"),
                          "collective all-reduce")

    def broadcast(self, values: Sequence) -> List[tf.Tensor]:
        """Rank 0's values on every rank (a sum where the others add zeros: exact)."""
        tensors = [tf.convert_to_tensor(v) for v in values]
        with tf.device(self.device):
            mine = tensors if self.rank == 0 else [tf.zeros_like(t) for t in tensors]
            return self.all_reduce(mine)

    def check_world(self, what: str) -> None:
        """The first collective: every rank reached it with the same world size (TF
        refuses a rank that joins with another group size; its error is named here).
        Bounded by TFPSX_COLLECTIVE_TIMEOUT when a rank never comes."""
        try:
            with tf.device(self.device):
                self.all_reduce([tf.constant([1], tf.int32)])[0].numpy()
        except tf.errors.OpError as e:
            lines = [line.strip() for line in (e.message or "").splitlines() if line.strip()]
            cause = next((line for line in lines if "group" in line or "timed out" in line),
                         lines[0] if lines else type(e).__name__)
            raise ValueError(
                f"{what}: the workers could not form one collective group: rank {self.rank} "
                f"counts {self.size} worker(s), and TF said: {cause[:400]}. Every worker "
                "must be given the same worker list (and every one must start)") from e


_RELAYED = re.compile(r"PeerUnavailableError: (worker \d+ lost worker .*)")
# TF's lines around the cause in a failed collective's message.
_NOISE = ("Graph execution error", "From /job:", "Additional GRPC error information",
          "The error could be from", "[[", "Recent warning", "Executing non-",
          "Detected at node", "File ")
_CAUSE = re.compile(r"recvmsg|socket closed|connection|failed to connect|unavailable|"
                    r"deadline|timed out", re.IGNORECASE)
def layout(dtypes: Sequence) -> List[Tuple[tf.DType, List[int]]]:
    """The order in which values of ``dtypes`` travel: (dtype, the values' indices) for
    each dtype, sorted by name (the same order on every rank).

    Raises:
      TypeError: a dtype a collective cannot reduce (named).
    """
    by_dtype: Dict[tf.DType, List[int]] = {}
    for i, dtype in enumerate(dtypes):
        dtype = tf.as_dtype(dtype).base_dtype
        if dtype not in REDUCIBLE:
            raise TypeError(f"value {i} has dtype {dtype.name}; expected one of "
                            f"{', '.join(d.name for d in REDUCIBLE)}")
        by_dtype.setdefault(dtype, []).append(i)
    return [(d, by_dtype[d]) for d in sorted(by_dtype, key=lambda d: d.name)]


def unpacked(shapes: Sequence, flats: Sequence[tf.Tensor], order) -> List[tf.Tensor]:
    """``flats`` (one per dtype of ``order``, :func:`layout`'s) cut back into values of
    ``shapes`` (static, or shape tensors)."""
    out: List[tf.Tensor] = [None] * len(shapes)
    for (_, members), flat in zip(order, flats):
        sizes = [tf.reduce_prod(shapes[i]) if isinstance(shapes[i], tf.Tensor)
                 else int(np.prod(shapes[i], dtype=np.int64)) for i in members]
        for i, piece in zip(members, tf.split(flat, sizes)):
            out[i] = tf.reshape(piece, shapes[i])
    return out


def _dense(value) -> tf.Tensor:
    """``value`` as a dense tensor, with its static shape where one is known (an
    ``IndexedSlices``' dense shape is a tensor: its value, when TF can tell it)."""
    tensor = tf.convert_to_tensor(value)
    if isinstance(value, tf.IndexedSlices) and not tensor.shape.is_fully_defined():
        shape = tf.get_static_value(value.dense_shape)
        if shape is not None:
            tensor.set_shape([int(d) for d in shape])
    return tensor


def packed(values: Sequence, reduce_flat, what: str, shapes=None) -> List[tf.Tensor]:
    """``reduce_flat`` of ``values`` packed by dtype: one flat tensor per dtype (in the
    same order on every rank, :func:`layout`), reduced, and cut back into the values'
    shapes. ``IndexedSlices`` are made dense first. ``shapes``: the values' static
    shapes where TF's are not known (a gradient's, as its variable's).

    Raises:
      TypeError: a value of a dtype a collective cannot reduce (named).
    """
    tensors = [_dense(v) for v in values]
    for tensor, shape in zip(tensors, shapes or []):
        tensor.set_shape(shape)
    try:
        order = layout([t.dtype for t in tensors])
    except TypeError as e:
        raise TypeError(f"{what}: {e}") from None
    reduced = [reduce_flat(tf.concat([tf.reshape(tensors[i], [-1]) for i in members], 0))
               for _, members in order]
    return unpacked([t.shape.as_list() if t.shape.is_fully_defined() else tf.shape(t)
                     for t in tensors], reduced, order)


_TASK = re.compile(r"/job:(?:worker|chief)/replica:\d+/task:(\d+)")


def lost_peer_error(error: BaseException, config) -> Optional[errors.PeerUnavailableError]:
    """The ``PeerUnavailableError`` naming the worker a failed collective lost (its
    address or task in TF's message, else the first peer that does not answer), or None
    when ``error`` is no such failure."""
    if isinstance(error, errors.PeerUnavailableError):
        return None
    # Raised by a step's Python side (the hybrid mode's all-reduce) and carried out of a
    # TF1 session as a TF error: the same error again.
    relayed = find_in_chain(error, tf.errors.OpError)
    named = _RELAYED.search(str(relayed)) if relayed is not None else None
    if named:
        return errors.PeerUnavailableError(named.group(1))
    failed = find_in_chain(error, (tf.errors.UnavailableError, tf.errors.InternalError,
                                   tf.errors.AbortedError, tf.errors.CancelledError))
    if failed is None:
        return None
    text = str(failed)
    if not isinstance(failed, tf.errors.UnavailableError) and "Collective" not in text:
        return None
    peers = {r: a for r, a in enumerate(config.workers) if r != config.index}
    lost = next(((r, a) for r, a in peers.items() if a in text), None)
    if lost is None:
        tasks = [int(t) for t in _TASK.findall(text)]
        ranks = [r for r in peers if config.worker_device_job(r)[1] in tasks]
        lost = (ranks[0], peers[ranks[0]]) if len(ranks) == 1 else None
    if lost is None:
        lost = next(((r, a) for r, a in peers.items() if not probe(a, timeout=2.0)), None)
    if lost is None:
        return None
    lines = [line.strip() for line in text.splitlines()
             if line.strip() and not line.strip().startswith(_NOISE)]
    lines = [line for line in lines if _CAUSE.search(line)] or lines
    return errors.PeerUnavailableError(
        f"worker {config.index} lost worker {lost[0]} at {lost[1]} "
        f"({(lines or ['unavailable'])[0][:300]}); a collective cannot go on without every "
        "rank: restart the job from its last checkpoint")

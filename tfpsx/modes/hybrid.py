"""The hybrid mode's dense half, written once for both front-ends: every worker holds
every dense weight, and each step their gradients are averaged over the workers by
all-reduce, while the ``DynamicEmbedding`` tables stay on the parameter servers (async or
GEO, their own server-side optimizer).

The all-reduce is TF's own ``CollectiveReduceV2`` (:class:`~tfpsx.modes.collective.
CollectiveGroup`, as in collective mode), run by a :class:`DenseAllReduce`: a graph session
on a small in-process server of its own per worker (job ``tfpsx_dense``), whose cluster is
the workers' dense servers only, with worker 0 as the group leader. Why a server of its
own: a worker's link to the parameter servers cannot carry collectives among the
workers on TF 2.21 (measured: a Keras worker's eager context connected to the PS with
``enable_collective_ops`` after it fails every function that reads a PS resource; in the
other order TF crashes; a context whose cluster lists the other workers deadlocks at
connect, each waiting for the other's server). A step hands its packed gradients to the
session through ``tf.numpy_function`` (an in-process session: no gRPC to itself).

The dense servers' addresses are TFPSX_DENSE_ENDPOINTS (one per worker, rank order)
when the deployment gives them; else they are found at start-up: each worker picks a
free port on its own host and writes it into a vector on PS 0 (:func:`meet`); every
worker waits until all ports are there, bounded by TFPSX_SESSION_TIMEOUT. (A worker
restarted alone while the servers run could read a peer's port of before the restart:
give the addresses, or restart the whole job, as ``tfpsx-run`` does.)
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tfpsx import errors, settings
from tfpsx.control import sockets
from tfpsx.control.ports import listening
from tfpsx.modes import lockstep
from tfpsx.modes.collective import CollectiveGroup, lost_peer_error
from tfpsx.waits import wait_for

JOB = "tfpsx_dense"


def meet(rank: int, size: int, port: int, write: Callable[[int, int], None],
         read: Callable[[], Sequence[int]], timeout: float, poll: float = 0.05) -> List[int]:
    """Writes this worker's dense-server ``port`` at ``rank`` (``write(rank, port)``) and
    waits until every worker's is there (``read()``: the vector, 0 where none yet).

    Raises:
      ClusterTimeoutError: a worker did not write its port within ``timeout`` seconds.
    """
    write(rank, port)

    def ports(_left) -> List[int]:
        got = [int(p) for p in read()]
        if len(got) != size:
            raise ValueError(f"hybrid mode: the servers hold {len(got)} workers' ports, "
                             f"this worker counts {size}; every worker must be given the same "
                             "worker list")
        return got

    return wait_for(ports, all, timeout, lambda got, _waited: errors.ClusterTimeoutError(
        f"hybrid mode: worker {rank} waited {timeout:g} s (TFPSX_SESSION_TIMEOUT) for "
        f"worker(s) {[r for r, p in enumerate(got) if not p]} to start their dense "
        "all-reduce (each writes its port on server 0 when its strategy or session "
        "starts); are they running, in the same mode?"), poll=poll)


class DenseAllReduce:
    """This worker's side of the dense weights' all-reduce (see the module doc).

    Args:
      rank: this worker's rank.
      addresses: every worker's dense server, ``host:port``, in rank order.
      timeout: each collective's bound (TFPSX_COLLECTIVE_TIMEOUT).
    """

    def __init__(self, rank: int, addresses: Sequence[str], timeout: float):
        self.rank, self.addresses, self.timeout = rank, list(addresses), float(timeout)
        config = tf.compat.v1.ConfigProto()
        config.experimental.collective_group_leader = f"/job:{JOB}/replica:0/task:0"
        mine = self.addresses[rank]
        # A port this worker picked: on loopback too in a local job (the launcher's list
        # has the job's own ports only).
        sockets.confine_port(int(mine.rsplit(":", 1)[1]))
        with listening(f"worker {rank}'s dense all-reduce server", mine):
            self._server = tf.distribute.Server(
                tf.train.ClusterSpec({JOB: self.addresses}), job_name=JOB, task_index=rank,
                config=config, start=True)
        self._graph = tf.Graph()
        self._session = tf.compat.v1.Session(self._server.target, graph=self._graph,
                                             config=config)
        self._group = CollectiveGroup(rank, len(self.addresses),
                                      f"/job:{JOB}/replica:0/task:{rank}/device:CPU:0")
        self._built: Dict[Tuple, Tuple[list, list]] = {}
        self._lock = threading.Lock()  # one collective at a time, in the same order everywhere

    @property
    def size(self) -> int:
        return len(self.addresses)

    def _run(self, kind: str, arrays: Sequence[np.ndarray],
             timeout: Optional[float] = None) -> List[np.ndarray]:
        arrays = [np.asarray(a) for a in arrays]
        signature = (kind,) + tuple((a.dtype.str, a.shape) for a in arrays)
        with self._lock:
            if signature not in self._built:
                # Built on first use, in the order the ranks use them: the collectives'
                # instance keys are given as they are built (the same on every rank).
                with self._graph.as_default():
                    inputs = [tf.compat.v1.placeholder(a.dtype, a.shape) for a in arrays]
                    if kind == "broadcast":
                        outputs = self._group.broadcast(inputs)
                    else:
                        outputs = self._group.all_reduce(inputs, mean=kind == "mean")
                self._built[signature] = (inputs, outputs)
            inputs, outputs = self._built[signature]
            bound = self.timeout + 1.0 if timeout is None else timeout
            options = tf.compat.v1.RunOptions(timeout_in_ms=int(bound * 1000))
            return self._session.run(outputs, dict(zip(inputs, arrays)), options=options)

    def mean(self, arrays: Sequence[np.ndarray]) -> List[np.ndarray]:
        """Each array's mean over the workers."""
        return self._run("mean", arrays)

    def total(self, flat: np.ndarray) -> np.ndarray:
        """A flat array's sum over the workers (a step's packed gradients and its count:
        :func:`mean_in_step`)."""
        return self._run("sum", [flat])[0]

    def broadcast(self, arrays: Sequence[np.ndarray]) -> List[np.ndarray]:
        """Worker 0's arrays on every worker."""
        return self._run("broadcast", arrays)

    def meet_at_end(self) -> None:
        """After this worker's last step (both front-ends): every worker's last
        all-reduce is done once they all reach this one; after it, a peer may still read
        this worker's few bytes of it (a ring pulls each chunk from the rank before), so
        it lingers TFPSX_COLLECTIVE_LINGER. Then a worker that ends is no loss to the
        others (it may save or export longer than they run)."""
        self.mean([np.zeros([1], np.float32)])
        time.sleep(settings.get("TFPSX_COLLECTIVE_LINGER"))

    def check_world(self, timeout: float) -> None:
        """The first collective: every worker's dense server answered within ``timeout``
        seconds, with the same world size. Raises ValueError naming TF's reason
        otherwise."""
        try:
            self._run("sum", [np.ones([1], np.int32)], timeout=timeout)
        except tf.errors.OpError as e:
            lines = [line.strip() for line in (e.message or "").splitlines() if line.strip()]
            raise ValueError(
                f"hybrid mode: worker {self.rank}'s dense all-reduce could not form one "
                f"group with {self.addresses} ({(lines or [type(e).__name__])[0][:300]}); "
                "every worker must run the hybrid mode with the same worker list") from e

    def close(self) -> None:
        self._session.close()


def mean_in_step(values: Sequence, total: Callable[[np.ndarray], np.ndarray],
                 size: int) -> List[tf.Tensor]:
    """Inside a step being built (a ``tf.function`` or a TF1 graph): the mean of
    ``values`` over the ``size`` workers, by ``total`` (a flat array's sum over the
    workers: :meth:`DenseAllReduce.total`, wrapped by the front-end) through
    ``tf.numpy_function``; a worker whose data ended takes part idle
    (:mod:`tfpsx.modes.lockstep`)."""
    def total_in_step(flat):
        return tf.numpy_function(total, [flat], flat.dtype, stateful=True,
                                 name="tfpsx_dense_all_reduce")

    return lockstep.reduce_in_step(values, total_in_step, size, "hybrid mode's all-reduce")


def named_peer_loss(fn, config):
    """``fn``, its failure on a lost worker raised as the ``PeerUnavailableError`` that
    names it."""
    def run(*args):
        try:
            return fn(*args)
        except tf.errors.OpError as e:
            lost = lost_peer_error(e, config)
            if lost is not None:
                raise lost from e
            raise

    return run


def start(rank: int, hosts: Sequence[str], write, read) -> DenseAllReduce:
    """This worker's :class:`DenseAllReduce`, on the addresses TFPSX_DENSE_ENDPOINTS
    gives, else on a free port of its host, the ports met on the servers (:func:`meet`);
    the group checked.

    Raises:
      ValueError: TFPSX_DENSE_ENDPOINTS is not one ``host:port`` per worker.
    """
    given = settings.get("TFPSX_DENSE_ENDPOINTS")
    if given:
        addresses = dense_endpoints(given, len(hosts))
    else:
        import portpicker

        port = portpicker.pick_unused_port()
        ports = meet(rank, len(hosts), port, write, read,
                     settings.get("TFPSX_SESSION_TIMEOUT"))
        addresses = [f"{h}:{p}" for h, p in zip(hosts, ports)]
    bridge = DenseAllReduce(rank, addresses, settings.get("TFPSX_COLLECTIVE_TIMEOUT"))
    bridge.check_world(settings.get("TFPSX_SESSION_TIMEOUT"))
    return bridge


def dense_endpoints(value: str, workers: int) -> List[str]:
    """TFPSX_DENSE_ENDPOINTS's addresses, checked: one ``host:port`` per worker."""
    addresses = [a.strip() for a in value.split(",") if a.strip()]
    bad = [a for a in addresses
           if ":" not in a or not a.rsplit(":", 1)[1].isdigit() or not a.rsplit(":", 1)[0]]
    if bad or len(addresses) != workers:
        raise ValueError(
            f"TFPSX_DENSE_ENDPOINTS={value!r}: expected {workers} host:port address(es), "
            f"one per worker in rank order"
            + (f"; not host:port: {bad}" if bad else f"; it lists {len(addresses)}"))
    return addresses

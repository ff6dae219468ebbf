"""Where each mode commits a batch's input position (the data plane, :mod:`tfpsx.data`):
once the step that trained the batch is in the model, for both front-ends.

* async, bounded staleness, sync: a step's update is applied on the servers (sync: by
  the chief, which every worker's step waits for) within the step, so the step hands its
  batch's position over after its update (Keras: to :data:`COMMITS`, which commits every
  TFPSX_INPUT_COMMIT_SECONDS (0.5 s) from a thread of its own; graph mode's sync: after
  its hook waited for the chief, and not when the chief ended before the step);
* collective and the hybrid: every worker applies the step within it (lockstep); a
  collective rank commits through its own client (:func:`commit_from_python`);
* GEO: a step trains this worker's copy, which reaches the model when a round pushes
  it. The step records its position as pending (Keras: through a
  ``tf.numpy_function``, :class:`PendingPositions`; graph mode: the session hook,
  :class:`PendingSteps`); a
  round takes what is pending *before* it reads the copy to push, and commits it once the
  push is in: every committed position's steps were pushed. A worker that dies takes its
  unpushed steps and their positions with it: they are trained again. At an exact
  save's barrier a worker pushes its unpushed steps in a round of its own
  (``GeoSchedule.settle``): the checkpoint then holds every step it committed.

In graph mode a session hook fetches the position of each run that takes a batch and
commits it after the run (every TFPSX_INPUT_COMMIT_SECONDS, and when the session
ends): the run applied the step's updates, dense and tables, by then.

A commit moves a split's position forward only (the coordinator keeps the furthest), so
committing a position twice, or late, is harmless.
"""

from __future__ import annotations

import logging
import threading
from typing import Dict, List, Optional, Tuple

import numpy as np
import tensorflow as tf

from tfpsx import settings
from tfpsx.control import splits

logger = logging.getLogger("tfpsx")


def check_feeds_splits(mode) -> None:
    """Raises when ``mode`` (a front-end's mode object, or None) cannot train from
    ``tfpsx.data.splits`` (both front-ends ask before a step commits a position).

    Sync trains from splits with every worker's gradient in each step: a worker whose
    data ended leaves the group, and the chief, its own data done, applies the others'
    steps until they leave (SyncGroup.drain). The hybrid's workers step together: one
    whose data ended takes part idle until every one's did
    (tfpsx.modes.hybrid.idle_until_done).

    Raises:
      ValueError: a mode, or a sync option, that would leave a trained batch out of the
        model or make a worker wait for one whose data ended; named with the fix.
    """
    mode_name = getattr(mode, "NAME", "")
    exact = any(getattr(s, "exact", False) for s in splits.registered().values())
    if exact and mode_name == "hybrid":
        raise ValueError(
            "tfpsx.data.splits(exact_saves=True) with the hybrid: its workers step together "
            "(each step all-reduces the dense gradients), so a worker paused at the save's "
            "barrier would hold the others inside their step, where they cannot ack it; "
            "give exact_saves=False (a restore then repeats at most the steps of the save's "
            "window), or train async, staleness, sync or GEO for exact saves")
    if exact and (mode_name == "geo" or getattr(mode, "ROUNDS", False)) and \
            getattr(mode, "in_train_thread", False):
        raise ValueError(
            "tfpsx.data.splits(exact_saves=True) with geo_sync_in_train_thread=True: its "
            "rounds meet every worker inside a step, so a worker paused at the save's "
            "barrier would hold the others inside their round, where they cannot ack it; "
            "leave geo_sync_in_train_thread=False (the background communicator: a worker "
            "pushes its last steps at the barrier), or give exact_saves=False")
    if mode_name == "sync":
        replicas = getattr(mode, "replicas", None)
        workers = getattr(mode, "worker_num", None) or getattr(
            getattr(mode, "config", None), "worker_num", None)
        if replicas is not None and workers is not None and replicas < workers:
            raise ValueError(
                f"tfpsx.data.splits with sync and replicas_to_aggregate={replicas} of "
                f"{workers} workers: a step drops the gradients of the workers that come "
                f"after the first {replicas}, and their batches would be committed yet not "
                "in the model; leave replicas_to_aggregate unset (every worker), or feed "
                "the job with tfpsx.data.shard")


def commit_seconds() -> float:
    """How often a worker commits its applied steps' positions
    (TFPSX_INPUT_COMMIT_SECONDS, 0.5 s by default)."""
    return settings.get("TFPSX_INPUT_COMMIT_SECONDS")


class CommitQueue:
    """Keras's commits of its applied steps' positions (async, staleness, sync), as graph
    mode's session hook does them: a step hands its batch's position to this process
    (:meth:`record_op`: a ``tf.numpy_function`` after the step's update, no RPC), and a
    background thread commits what came in every ``every`` seconds (and
    :meth:`flush`, at an exact save's barrier and when ``fit`` ends). Measured before:
    a commit RPC in each step cost the Criteo job 2-3% of its examples/s, and a commit
    every 50 ms 11% more context switches than a static cut's (each commit is an eager
    op on PS 0: its inputs sent, run, answered), 0.2 s 8% fewer than that but still
    0.968x the static cut's examples/s, 0.5 s (the default) 0.99x. A worker
    killed loses the positions of its last ``every`` seconds of steps: trained again."""

    def __init__(self, every: Optional[float] = None):
        self._every = every
        self._due = PendingSteps()  # the positions due, by input
        self._lock = threading.Lock()  # (the commit thread's start)
        self._flushing = threading.Lock()  # one commit at a time, in order
        self._loop = None

    def record_op(self, position) -> tf.Tensor:
        """The op a step runs after its update: its batch's position, due."""
        return record_op(position, lambda: self, "tfpsx_position_due")

    def add(self, name: str, keys, offsets) -> None:
        """A batch's position (``keys``, ``offsets``: numpy) of input ``name``, due."""
        self._due.add(name, keys, offsets)
        self._start()

    def _start(self) -> None:
        if self._loop is None:
            from tfpsx.background import BackgroundLoop

            with self._lock:
                if self._loop is None:
                    self._loop = BackgroundLoop("input commits", self._tick,
                                                interval=self.every).start()

    @property
    def every(self) -> float:
        """Seconds between commits (TFPSX_INPUT_COMMIT_SECONDS unless given)."""
        return self._every if self._every is not None else commit_seconds()

    def _tick(self) -> None:
        try:
            self.flush()
        except Exception as e:  # noqa: BLE001 — logged; the next tick tries again
            logger.warning("committing this worker's input positions failed (tried again "
                           "in %g s): %s", self.every, e)

    def flush(self) -> None:
        """Commits what is due now (what failed stays due)."""
        with self._flushing:
            taken = self._due.take()
            try:
                for name in sorted(taken):
                    splits.coordinator_of(name).commit(*taken[name])
                    del taken[name]
            except BaseException:
                for name, (keys, offsets) in taken.items():  # (back, merged with what
                    self._due.add(name, keys, offsets)      # came in since)
                raise


def record_op(position, to, name: str) -> tf.Tensor:
    """The op handing a batch's position to ``to()`` (asked when the op runs: an object
    with ``add(input name, keys, offsets)``), a ``tf.numpy_function`` named ``name``."""
    input_name, check = splits.checked_input(position)
    with tf.control_dependencies([check]):
        keys, offsets = splits.latest(position)

    def add(keys, offsets):
        to().add(input_name, keys, offsets)
        return np.int64(0)

    return tf.numpy_function(add, [keys, offsets], tf.int64, stateful=True, name=name)


def commit_from_python(position) -> tf.Tensor:
    """The op committing a batch's position through this process's client (a
    ``tf.numpy_function``): a collective rank's step cannot place an op on the
    coordinator's home, rank 0 (its sessions see only its own task)."""
    name, check = splits.checked_input(position)
    with tf.control_dependencies([check]):
        keys, offsets = splits.latest(position)

    def commit(keys, offsets):
        return np.int64(splits.coordinator_of(name).commit(keys, offsets))

    return tf.numpy_function(commit, [keys, offsets], tf.int64, stateful=True,
                             name="tfpsx_commit_position")


class PendingPositions:
    """GEO on Keras: the positions this worker trained into its copy and has not pushed,
    by input. A step hands its batch's position over after training its copy
    (:meth:`record`, a ``tf.numpy_function``); a round takes what is pending before it
    reads the copy (:meth:`snapshot`) and commits it once it pushed (:meth:`commit`).
    Kept in Python under a lock (:class:`PendingSteps`, graph mode's): before, a worker
    table whose commit removed the keys it committed by a lookup, then a remove, between
    which a step could write a newer position for a key (lost: its split was never
    committed to its end)."""

    def __init__(self):
        self._pending = PendingSteps()

    def record(self, position) -> tf.Tensor:
        """The op a step runs after training its copy: its batch's position, pending."""
        return record_op(position, lambda: self, "tfpsx_position_pending")

    def add(self, name: str, keys, offsets) -> None:
        """A batch's position (numpy ``keys``, ``offsets``) of input ``name``, pending."""
        self._pending.add(name, keys, offsets)

    def snapshot(self) -> Dict[str, Tuple[np.ndarray, np.ndarray]]:
        """What is pending now (taken: a round then pushes the copy that holds it)."""
        return self._pending.take()

    def commit(self, snapshot: Dict[str, Tuple[np.ndarray, np.ndarray]]) -> None:
        """Commits a snapshot, after the round's push."""
        PendingSteps.commit(snapshot)

    def put_back(self, snapshot: Dict[str, Tuple[np.ndarray, np.ndarray]]) -> None:
        """A round that failed before its commit: its snapshot is pending again."""
        for name, (keys, offsets) in snapshot.items():
            self._pending.add(name, keys, offsets)


class PendingSteps:
    """Graph mode's GEO: the positions of the steps trained into this worker's copy and
    not pushed, by input (the session hook adds each run's; a round takes them before it
    reads the copy and commits them once it pushed)."""

    def __init__(self):
        self._pending: Dict[str, Dict[int, int]] = {}
        self._lock = threading.Lock()

    def add(self, name: str, keys, offsets) -> None:
        with self._lock:
            table = self._pending.setdefault(name, {})
            for k, o in zip(keys.tolist(), offsets.tolist()):
                if o > table.get(k, -1):
                    table[k] = o

    def take(self) -> Dict[str, Tuple[np.ndarray, np.ndarray]]:
        """What is pending now (before the round reads the copy); cleared."""
        with self._lock:
            taken, self._pending = self._pending, {}
        return {name: (np.fromiter(t.keys(), np.int64), np.fromiter(t.values(), np.int64))
                for name, t in taken.items() if t}

    @staticmethod
    def commit(taken: Dict[str, Tuple[np.ndarray, np.ndarray]]) -> None:
        """Commits what :meth:`take` took (after the round's push)."""
        for name, (keys, offsets) in taken.items():
            splits.coordinator_of(name).commit(keys, offsets)


# This process's (a Keras worker's) queue of positions to commit.
COMMITS = CommitQueue()


def decode_numpy(position: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tags, keys, ends) of a position's value (float32 [5, batch])."""
    bits = np.ascontiguousarray(np.asarray(position, np.float32).T).view(np.int32)
    keys = np.ascontiguousarray(bits[:, 0:2]).view(np.int64)[:, 0]
    ends = np.ascontiguousarray(bits[:, 2:4]).view(np.int64)[:, 0]
    return bits[:, 4], keys, ends


def positions_of_graph(graph=None) -> list:
    """The positions ``tfpsx.data.next_batch`` registered in a graph (graph mode)."""
    from tfpsx import graph_state

    state = graph_state.peek(graph)
    return list(state.positions) if state is not None else []


__all__ = ["COMMITS", "CommitQueue", "record_op", "check_feeds_splits", "commit_from_python",
           "commit_seconds", "PendingPositions", "PendingSteps", "decode_numpy",
           "positions_of_graph"]

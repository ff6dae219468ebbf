"""Where each mode commits a batch's input position (the data plane, :mod:`tfpsx.data`):
once the step that trained the batch is in the model, for both front-ends.

* async, bounded staleness, sync: a step's update is applied on the servers (sync: by
  the chief, which every worker's step waits for) within the step, so the step commits
  its batch's position after its update (:func:`commit_ops`; graph mode's sync: after
  its hook waited for the chief, and not when the chief ended before the step);
* GEO: a step trains this worker's copy, which reaches the model when a round pushes
  it. The step records its position as pending (Keras: in a worker-local table,
  :class:`PendingPositions`; graph mode: the session hook, :class:`PendingSteps`); a
  round takes what is pending *before* it reads the copy to push, and commits it once the
  push is in: every committed position's steps were pushed. A worker that dies takes its
  unpushed steps and their positions with it: they are trained again.

In graph mode a session hook fetches the position of each run that takes a batch and
commits it after the run (every ~50 ms, and when the session ends): the run applied the
step's updates, dense and tables, by then.

A commit moves a split's position forward only (the coordinator keeps the furthest), so
committing a position twice, or late, is harmless.
"""

from __future__ import annotations

import threading
from typing import Dict, List, Tuple

import numpy as np
import tensorflow as tf

from tfpsx.control import splits


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
    if (mode_name == "geo" or getattr(mode, "ROUNDS", False)) and exact:  # (hybrid GEO too)
        raise ValueError(
            "tfpsx.data.splits(exact_saves=True) with GEO: GEO's rounds push this worker's "
            "steps from a thread of their own, which a save's barrier at the step boundary "
            "does not pause; give exact_saves=False (a restore then repeats at most the "
            "steps of a round per worker), or train async, staleness or sync for exact saves")
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


def commit_ops(position) -> tf.Operation:
    """The op committing a batch's position (after the ops it is made to depend on)."""
    name, check = splits.checked_input(position)
    with tf.control_dependencies([check]):
        keys, offsets = splits.latest(position)
        return splits.coordinator_of(name).commit_op(keys, offsets)


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
    """GEO: the positions this worker trained into its copy and has not pushed, by input
    (a stock ``MutableHashTable`` on the worker: split key -> the furthest end trained)."""

    def __init__(self, device: str):
        self.device = device
        self._tables: Dict[str, tf.lookup.experimental.MutableHashTable] = {}
        self._lock = threading.Lock()

    def _table(self, name: str):
        """Input ``name``'s table (made once, outside the step function that uses it)."""
        with self._lock:
            if name not in self._tables:
                with tf.init_scope(), tf.device(self.device):
                    self._tables[name] = tf.lookup.experimental.MutableHashTable(
                        tf.int64, tf.int64, default_value=-1, name=f"tfpsx_pending_{name}")
            return self._tables[name]

    def record(self, position) -> tf.Operation:
        """The op a step runs after training its copy: its batch's position, pending."""
        name, check = splits.checked_input(position)
        with tf.control_dependencies([check]):
            keys, offsets = splits.latest(position)
            return self._table(name).insert(keys, offsets)

    def names(self) -> List[str]:
        with self._lock:
            return sorted(self._tables)

    # ------------------------------------------------------------------ eager rounds
    def snapshot(self) -> Dict[str, Tuple[np.ndarray, np.ndarray]]:
        """What the tables hold now (eagerly; before the round reads the copy)."""
        out = {}
        for name in self.names():
            keys, offsets = self._table(name).export()
            if int(tf.size(keys)):
                out[name] = (keys.numpy(), offsets.numpy())
        return out

    def commit(self, snapshot: Dict[str, Tuple[np.ndarray, np.ndarray]]) -> None:
        """Commits a snapshot (after the round's push), and drops what it committed from
        the tables (a position trained since stays: its key's end moved on)."""
        for name, (keys, offsets) in snapshot.items():
            splits.coordinator_of(name).commit(keys, offsets)
            table = self._table(name)
            now = table.lookup(tf.constant(keys)).numpy()
            done = keys[now == offsets]
            if len(done):
                table.remove(tf.constant(done))



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


__all__ = ["check_feeds_splits", "commit_from_python", "commit_ops", "PendingPositions", "PendingSteps", "decode_numpy",
           "positions_of_graph"]

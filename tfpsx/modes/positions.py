"""Where each mode commits a batch's input position (the data plane, :mod:`tfpsx.data`):
once the step that trained the batch is in the model, for both front-ends.

* async, bounded staleness, sync, hybrid: a step's update is applied on the servers
  (sync: by the chief, which every worker's step waits for) within the step, so the step
  commits its batch's position after its update (:func:`commit_ops`);
* GEO: a step trains this worker's copy, which reaches the model when a round pushes
  it. The step records its position in a worker-local table (:class:`PendingPositions`);
  a round takes what the table holds *before* it reads the copy to push, and commits it
  once the push is in: every committed position's steps were pushed. A worker that dies
  takes its unpushed steps and their positions with it: they are trained again.

A commit moves a split's position forward only (the coordinator keeps the furthest), so
committing a position twice, or late, is harmless.
"""

from __future__ import annotations

import threading
from typing import Dict, List, Tuple

import numpy as np
import tensorflow as tf

from tfpsx.control import splits


def commit_ops(position) -> tf.Operation:
    """The op committing a batch's position (after the ops it is made to depend on)."""
    name, check = splits.checked_input(position)
    with tf.control_dependencies([check]):
        keys, offsets = splits.latest(position)
        return splits.coordinator_of(name).commit_op(keys, offsets)


class PendingPositions:
    """GEO: the positions this worker trained into its copy and has not pushed, by input
    (a stock ``MutableHashTable`` on the worker: split key -> the furthest end trained)."""

    def __init__(self, device: str):
        self.device = device
        self._tables: Dict[str, tf.lookup.experimental.MutableHashTable] = {}
        self._graph_tables: Dict[Tuple[int, str], object] = {}
        self._lock = threading.Lock()

    def _table(self, name: str):
        graph = None if tf.executing_eagerly() or tf.inside_function() else \
            tf.compat.v1.get_default_graph()
        with self._lock:
            store, key = ((self._tables, name) if graph is None
                          else (self._graph_tables, (id(graph), name)))
            if key not in store:
                with tf.init_scope(), tf.device(self.device):
                    store[key] = tf.lookup.experimental.MutableHashTable(
                        tf.int64, tf.int64, default_value=-1, name=f"tfpsx_pending_{name}")
            return store[key]

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

    # ------------------------------------------------------------------ graph rounds
    def graph_ops(self):
        """Graph mode, built before the graph is finalized: ``take`` ({input: (keys,
        offsets)}, what the tables hold: run before the round reads the copy) and
        ``commit`` ({input: (keys placeholder, offsets placeholder, op)}: run with a
        take's values after the push; it drops what it committed from the table)."""
        take, commit = {}, {}
        for name in self._graph_names():
            table = self._table(name)
            take[name] = table.export()
            keys = tf.compat.v1.placeholder(tf.int64, [None], name=f"tfpsx_commit_{name}_keys")
            offsets = tf.compat.v1.placeholder(tf.int64, [None],
                                               name=f"tfpsx_commit_{name}_offsets")
            committed = splits.coordinator_of(name).commit_op(keys, offsets)
            with tf.control_dependencies([committed]), tf.device(self.device):
                same = tf.equal(table.lookup(keys), offsets)
                dropped = table.remove(tf.boolean_mask(keys, same))
            commit[name] = (keys, offsets, tf.group(committed, dropped))
        return take, commit

    def _graph_names(self) -> List[str]:
        graph_id = id(tf.compat.v1.get_default_graph())
        with self._lock:
            return sorted(n for g, n in self._graph_tables if g == graph_id)


def positions_of_graph(graph=None) -> list:
    """The positions ``tfpsx.data.next_batch`` registered in a graph (graph mode)."""
    from tfpsx import graph_state

    state = graph_state.peek(graph)
    return list(state.positions) if state is not None else []


__all__ = ["commit_ops", "PendingPositions", "positions_of_graph"]

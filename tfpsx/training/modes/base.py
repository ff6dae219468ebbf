"""The Mode interface: one training mode, one object per graph.

A mode has one place for each thing a mode decides:

* ``validate``: the cluster and the options fit (e.g. sync's replicas_to_aggregate);
* ``variable_creator``: where ``model_scope`` puts variables beyond TF's placement
  (GEO: a worker-local copy beside each PS variable);
* ``wrap_optimizer`` (a classmethod: ``distributed_optimizer`` needs no graph);
* ``table_updater``: how a ``DynamicTable`` built in ``model_scope`` trains;
* ``hooks``: what ``MonitoredTrainingSession`` adds.

Its per-graph state (GEO's variable pairs, sync's accumulators) lives on the object, one
per graph (:meth:`Mode.for_graph`): held by the graph as a plain attribute, not in a graph
collection, so ``export_meta_graph`` never sees it and it goes when the graph goes. A new
mode is one module with a ``Mode`` subclass and one registry entry.
"""

from __future__ import annotations

import contextlib
from typing import Callable, List, Optional

import tensorflow as tf

from tfpsx import graph_state
from tfpsx.embedding.updaters import TableUpdater, updater_scope
from tfpsx.modes.state import State


class Mode:
    """Base: variables on the PS as TF places them, the optimizer as it is, tables trained
    by their server-side optimizer, no hooks (which is async)."""
    NAME = ""
    # Every worker initializes its own variables (they all live on it), rank 0 alone
    # restores and saves; else the chief initializes and the others wait for it.
    EACH_WORKER_INITIALIZES = False

    def __init__(self, strategy, config, graph):
        self.strategy, self.config, self.graph = strategy, config, graph
        self._hooks: List[tf.compat.v1.train.SessionRunHook] = []
        self.validate()

    @classmethod
    def for_graph(cls, strategy, config, graph=None) -> "Mode":
        """The graph's mode object (made on first use); a graph trains one way only.

        Raises:
          ValueError: the graph already trains with a strategy of other options.
        """
        graph = graph or tf.compat.v1.get_default_graph()
        state = graph_state.of(graph)
        mode = state.mode
        if mode is None:
            mode = state.mode = cls(strategy, config, graph)
        elif mode.strategy.key() != strategy.key():
            raise ValueError(
                f"{strategy.mode}: this graph's model was built for {mode.strategy!r}, but "
                f"it is now asked to train with {strategy!r}; pass model_scope and "
                "distributed_optimizer the same DistributedStrategy")
        return mode

    # ------------------------------------------------------------------ the interface
    def validate(self) -> None:
        """Raises ValueError when the cluster or the options do not fit the mode."""

    def placement(self):
        """The device function ``model_scope`` places variables with."""
        from tfpsx.training.placement import replica_device_setter

        return replica_device_setter()

    def variable_creator(self) -> Optional[Callable]:
        """A ``variable_creator_scope`` function for ``model_scope``, or None."""
        return None

    @classmethod
    def wrap_optimizer(cls, optimizer, strategy, config):
        """The optimizer ``distributed_optimizer`` returns for this mode."""
        return optimizer

    def table_updater(self, table) -> TableUpdater:
        """The updater of a table built inside ``model_scope``."""
        return TableUpdater()

    def hooks(self) -> List[tf.compat.v1.train.SessionRunHook]:
        """The session hooks this graph's training needs, in the order they run."""
        return list(self._hooks)

    def add_hook(self, hook) -> None:
        self._hooks.append(hook)

    # ------------------------------------------------------------------ model_scope
    @contextlib.contextmanager
    def scope(self):
        """Variables and tables built inside are placed and trained by this mode."""
        creator = self.variable_creator()
        with contextlib.ExitStack() as stack:
            if creator is not None:
                stack.enter_context(tf.compat.v1.variable_creator_scope(creator))
            stack.enter_context(updater_scope(self.table_updater))
            yield


class WrappedOptimizer(tf.compat.v1.train.Optimizer):
    """An optimizer around a ``tf.compat.v1.train`` one: gradients, slots and variables
    are the wrapped optimizer's; subclasses change only ``apply_gradients``."""

    def __init__(self, optimizer, name: str):
        super().__init__(use_locking=False, name=f"{name}{optimizer.get_name()}")
        self._opt = optimizer

    def compute_gradients(self, *args, **kwargs):
        return self._opt.compute_gradients(*args, **kwargs)

    def get_slot(self, *args, **kwargs):
        return self._opt.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._opt.get_slot_names(*args, **kwargs)

    def variables(self):
        return self._opt.variables()


class GraphStateFactory:
    """Graph mode's :class:`~tfpsx.modes.state.StateFactory`: a protocol variable is a
    resource variable under its core name, at the graph's root whatever scope builds
    it, made once per graph. A checkpointed one is a global variable (the chief's
    session initializes or restores it; the others wait until it is); one that is not
    is in no collection: the mode has the chief initialize it when its session starts."""

    def __init__(self, worker_device: str):
        self.worker_device = worker_device

    @staticmethod
    @contextlib.contextmanager
    def _root():
        graph = tf.compat.v1.get_default_graph()
        root = tf.compat.v1.VariableScope(tf.compat.v1.AUTO_REUSE, name="")
        with tf.compat.v1.variable_scope(root, auxiliary_name_scope=False), \
                graph.name_scope(None):
            yield

    def shared(self, state: State, workers: int):
        with self._root(), tf.compat.v1.device("/job:ps/task:0"):
            return tf.compat.v1.get_variable(
                state.name, state.shape(workers), tf.int64,
                initializer=tf.zeros_initializer(), trainable=False, use_resource=True,
                collections=None if state.checkpointed else [])

    def local(self, name: str, initial: Callable):
        with self._root(), tf.compat.v1.device(self.worker_device):
            return tf.compat.v1.get_variable(
                name, initializer=initial(), trainable=False, use_resource=True,
                collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])


def mode_of(graph=None) -> Optional[Mode]:
    """The mode a graph trains with, or None (no model_scope / distributed_optimizer)."""
    state = graph_state.peek(graph)
    return None if state is None else state.mode

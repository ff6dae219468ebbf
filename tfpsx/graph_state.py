"""What tfpsx keeps per TF1 graph, in one object reached through one accessor.

A graph being built holds a training mode, table handles, worker caches and the row
gradients already checked: :class:`GraphState` declares them all, and :func:`of` is the
one way to reach a graph's (made on first use). It lives on the graph itself, as one
attribute, on purpose: the state holds the graph's ops, so a dictionary of ours keyed
by graph (even a ``WeakKeyDictionary``) would keep every graph alive forever; on the
graph, it goes when the graph goes. No Python objects go into graph collections
(``SAVEABLE_OBJECTS`` aside: that is how TF's own ``Saver`` finds saveables).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

import tensorflow as tf

_ATTR = "_tfpsx_state"


@dataclasses.dataclass
class GraphState:
    #: The graph's training mode (``tfpsx.training.modes``; one per graph), or None.
    mode: Optional[Any] = None
    #: (table spec, device) -> the table's handle op in this graph.
    table_handles: Dict[Any, tf.Tensor] = dataclasses.field(default_factory=dict)
    #: worker cache name -> its worker-local variables in this graph.
    cache_variables: Dict[str, tuple] = dataclasses.field(default_factory=dict)
    #: table name -> its GEO contention estimate's worker-local variables in this graph
    #: (tfpsx.embedding.contention).
    contention_variables: Dict[str, tuple] = dataclasses.field(default_factory=dict)
    #: The worker caches that built ops in this graph, in order (their driver's list).
    worker_caches: List[Any] = dataclasses.field(default_factory=list)
    # tfpsx.training.staging.RowStager: its hook runs before the caches' final flush
    stagers: List[Any] = dataclasses.field(default_factory=list)
    #: id(gradient) -> (gradient, keys, dim): row gradients already checked.
    checked_rows: Dict[int, tuple] = dataclasses.field(default_factory=dict)


def of(graph: Optional[tf.Graph] = None) -> GraphState:
    """The state of ``graph`` (default: the default graph), made on first use."""
    graph = graph if graph is not None else tf.compat.v1.get_default_graph()
    state = getattr(graph, _ATTR, None)
    if state is None:
        state = GraphState()
        setattr(graph, _ATTR, state)
    return state


def peek(graph: Optional[tf.Graph] = None) -> Optional[GraphState]:
    """The state of ``graph`` if tfpsx made one, else None (nothing is made)."""
    graph = graph if graph is not None else tf.compat.v1.get_default_graph()
    return getattr(graph, _ATTR, None)

"""What tfpsx keeps per TF1 graph, in one object reached through one accessor.

A graph being built holds a training mode, table handles, worker caches and the row
gradients already checked: :class:`GraphRegistry` declares them all, and :func:`of` is the
one way to reach a graph's (made on first use). It lives on the graph itself, as one
attribute, on purpose: the state holds the graph's ops, so a dictionary of ours keyed
by graph (even a ``WeakKeyDictionary``) would keep every graph alive forever; on the
graph, it goes when the graph goes. No Python objects go into graph collections
(``SAVEABLE_OBJECTS`` aside: that is how TF's own ``Saver`` finds saveables).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Dict, List, Optional, Tuple

import tensorflow as tf

_ATTR = "_tfpsx_state"


@dataclasses.dataclass
class GraphRegistry:
    #: The graph's training mode (``tfpsx.training.modes``; one per graph), or None.
    mode: Optional[Any] = None
    #: (table spec, device) -> the table's handle op in this graph.
    table_handles: Dict[Any, tf.Tensor] = dataclasses.field(default_factory=dict)
    #: (kind, name) -> an owner's worker-local variables in this graph
    #: (:func:`worker_local`; a worker cache's, a GEO table's, ...).
    worker_locals: Dict[Tuple[str, str], Any] = dataclasses.field(default_factory=dict)
    #: The worker caches that built ops in this graph, in order (their driver's list).
    worker_caches: List[Any] = dataclasses.field(default_factory=list)
    # tfpsx.training.staging.RowStager: its hook runs before the caches' final flush
    stagers: List[Any] = dataclasses.field(default_factory=list)
    #: tfpsx.training.read_ahead.GeoReadAhead: the batches' ids GEO's pulls read ahead
    #: (``geo_pull_ahead``; one per graph), or None.
    geo_read_ahead: Optional[Any] = None
    #: id(gradient) -> (gradient, keys, dim): row gradients already checked.
    checked_rows: Dict[int, tuple] = dataclasses.field(default_factory=dict)
    #: GEO's chosen tables' lookups, by their hot mask (its ``ref()``): their Route (the
    #: table's flag as the lookup read it, the keys it sent to the PS, the rows it held);
    #: the same step's apply takes them (tfpsx.modes.geo.hot_rows).
    geo_routes: Dict[Any, tuple] = dataclasses.field(default_factory=dict)
    #: The positions of the input batches the graph's steps take (``tfpsx.data.next_batch``):
    #: the mode commits them when the step that trains them is in the model.
    positions: List[Dict[str, tf.Tensor]] = dataclasses.field(default_factory=list)
    #: input name -> (its position's variable in the chief's checkpoints, the op filling it
    #: with the coordinator's state before a save).
    input_positions: Dict[str, Tuple[Any, Any]] = dataclasses.field(default_factory=dict)


def of(graph: Optional[tf.Graph] = None) -> GraphRegistry:
    """The state of ``graph`` (default: the default graph), made on first use."""
    graph = graph if graph is not None else tf.compat.v1.get_default_graph()
    state = getattr(graph, _ATTR, None)
    if state is None:
        state = GraphRegistry()
        setattr(graph, _ATTR, state)
    return state


def peek(graph: Optional[tf.Graph] = None) -> Optional[GraphRegistry]:
    """The state of ``graph`` if tfpsx made one, else None (nothing is made)."""
    graph = graph if graph is not None else tf.compat.v1.get_default_graph()
    return getattr(graph, _ATTR, None)


def worker_local(owner: Any, kind: str, name: str, device: Optional[str],
                 make: Callable[[Optional[list]], Any],
                 made: Optional[Callable[[Optional[GraphRegistry]], None]] = None) -> Any:
    """Variables on this worker, local (every worker initializes its own; no Saver
    takes them), made by ``make(collections)`` on ``device``: one set for eager code and
    ``tf.function`` s (kept on ``owner._eager_locals``), one per graph in graph mode (in
    the graph's ``worker_locals`` under ``(kind, name)``, in ``LOCAL_VARIABLES``; a
    ``tf.cond`` branch of that graph finds its graph's). ``made(state)`` runs once a set
    is made: with the graph's state, or None for the eager set."""
    with tf.init_scope():
        place = tf.device(device) if device else contextlib.nullcontext()
        if tf.executing_eagerly():
            if getattr(owner, "_eager_locals", None) is None:
                with place:
                    owner._eager_locals = make(None)
                if made is not None:
                    made(None)
            return owner._eager_locals
        state = of()
        key = (kind, name)
        if key not in state.worker_locals:
            with place:
                state.worker_locals[key] = make([tf.compat.v1.GraphKeys.LOCAL_VARIABLES])
            if made is not None:
                made(state)
        return state.worker_locals[key]

"""Serving export of a TF1 graph (``tf.compat.v1``) that looks ids up in tfpsx tables.

The user names the inference: ``inputs={name: placeholder}``, ``outputs={name: tensor}``.
The export

1. cuts the subgraph that computes the outputs from the inputs (data edges only: control
   dependencies are training's ordering, not inference; a table lookup's step input is
   not followed, nor is any lookup's table handle);
2. reads, with the user's session, every variable of it and every table shard a lookup
   in it reads (one shard per run: a big table crosses the network shard by shard);
3. re-imports the subgraph in a ``tf.function`` (stage by stage: the part before the
   lookups, each lookup as a :class:`~tfpsx.serving.table.ServingTable` ``find``, the
   part after them), with every variable mapped to a local copy. Each shard's lookup is
   replaced where it is, so the graph's own dedup, partition and stitch stay as trained.

A training lookup (``lookup_unique(train=True)``: find-or-insert) is served as a read:
serving never inserts, and an unseen id gets the initial row the table would give it.
In GEO, the lookups read the worker's copy, and so does the export: what the session's
own predictions use.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Dict, List, Mapping, Optional, Set, Tuple

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from tfpsx import compat
from tfpsx.compat import gen_resource_variable_ops

from tfpsx.checkpoint.pages import page_ranges
from tfpsx.embedding.initializers import Initializer
from tfpsx.ops import bindings
from tfpsx.serving import delta
from tfpsx.serving import export as _export
from tfpsx.serving import signature
from tfpsx.serving.table import ServingTable

HANDLE = "TfpsxHashTableHandleOp"
# An export's weights by delta input: {input name: the variable's op name}.
WEIGHTS_FILE = os.path.join("assets.extra", "tfpsx_weights.json")
READS = ("TfpsxHashTableFind", "TfpsxHashTableFindOrInsert")
VARIABLES = ("VarHandleOp", "VariableV2", "Variable")
PLACEHOLDERS = ("Placeholder", "PlaceholderV2")
_WRITES = ("Assign", "ResourceApply", "Apply", "ResourceScatter", "Scatter",
           "ResourceSparseApply", "SparseApply")
_PIPELINES = ("Iterator", "Queue", "Reader")


class GraphServingModule(tf.Module):
    def __init__(self, tables: List[ServingTable], weights: List[tf.Variable]):
        super().__init__(name=None)
        self.tables = tables
        self.weights = weights


def _source(ref: str) -> Tuple[str, int]:
    """("node", output index) of a NodeDef input such as "a/b:1" or "a/b"."""
    name, _, index = ref.partition(":")
    return name, int(index or 0)


def _tensor_name(ref: str) -> str:
    name, index = _source(ref)
    return f"{name}:{index}"


def _raw_session(session):
    """The ``tf.compat.v1.Session`` under a monitored (and wrapped) session."""
    for _ in range(8):
        if isinstance(session, tf.compat.v1.Session):
            return session
        inner = getattr(session, "_tf_sess", None)
        if not callable(inner):
            break
        session = inner()
        if session is None:
            raise ValueError("export_serving: the monitored session is closed; export inside "
                             "its `with` block (or from a new session on the same target)")
    if hasattr(session, "run") and isinstance(getattr(session, "graph", None), tf.Graph):
        return session
    raise TypeError(f"export_serving: expected a tf.compat.v1.Session or a monitored session, "
                    f"got {type(session).__name__}")


@contextlib.contextmanager
def _extending(graph: tf.Graph):
    """The user's graph, open for a few read ops even when a MonitoredSession finalized it
    (a running session extends to them; the graph is finalized again after)."""
    finalized = graph.finalized
    if finalized:
        compat.unfinalize(graph)  # no public way to add an op after finalize
    try:
        with graph.as_default():
            yield
    finally:
        if finalized:
            graph.finalize()


class _Cut:
    """The inference subgraph of ``outputs`` from ``inputs``, in the user's graph."""

    def __init__(self, graph: tf.Graph, inputs: Dict[str, object], outputs: Dict[str, tf.Tensor]):
        self.graph = graph
        self.graph_def = graph.as_graph_def()
        self.nodes = {n.name: n for n in self.graph_def.node}
        self.cut: Set[str] = set()  # tensor names fed by the signature
        for value in inputs.values():
            parts = ([value.indices, value.values, value.dense_shape]
                     if isinstance(value, tf.SparseTensor) else [value])
            self.cut.update(t.name for t in parts)
        self.needed = self._walk([t.op.name for t in outputs.values()])
        self.reads = [n for n in self.needed if self.nodes[n].op in READS]
        self.variables = [n for n in self.needed if self.nodes[n].op in VARIABLES]
        self.handles = {r: self._handle_of(r) for r in self.reads}
        self._check()

    def data_inputs(self, name: str) -> List[str]:
        node = self.nodes[name]
        refs = [r for r in node.input if not r.startswith("^")]
        if node.op in READS:
            return refs[1:2]  # the keys; not the handle, not the step
        if node.op in VARIABLES or node.op == HANDLE:
            return []
        return refs

    def _walk(self, roots: List[str]) -> Set[str]:
        needed, stack = set(), list(roots)
        while stack:
            name = stack.pop()
            if name in needed:
                continue
            if name not in self.nodes:
                raise ValueError(f"export_serving: {name!r} is not in the session's graph")
            needed.add(name)
            stack.extend(_source(r)[0] for r in self.data_inputs(name)
                         if _tensor_name(r) not in self.cut)
        return needed

    def _handle_of(self, read: str) -> str:
        name = _source(self.nodes[read].input[0])[0]
        while self.nodes[name].op == "Identity":
            name = _source(self.nodes[name].input[0])[0]
        if self.nodes[name].op != HANDLE:
            raise ValueError(f"export_serving: the table of lookup {read!r} comes from a "
                             f"{self.nodes[name].op} op, not a table handle; cannot serve it")
        return name

    def _check(self) -> None:
        for name in sorted(self.needed):
            op = self.nodes[name].op
            if op in PLACEHOLDERS:
                raise ValueError(f"export_serving: the outputs depend on placeholder {name!r}, "
                                 "which is not in inputs=; add it (inputs={name: tensor})")
            if op.startswith("Tfpsx") and op not in READS:
                raise ValueError(f"export_serving: the outputs depend on {op} op {name!r}; only "
                                 "table lookups can be served (pass inference outputs)")
            if op.startswith(_WRITES) or op.startswith(_PIPELINES):
                raise ValueError(f"export_serving: the outputs depend on {op} op {name!r}: pass "
                                 "inference outputs that neither train nor read an input "
                                 "pipeline (feed placeholders through inputs=)")

    def topological(self, names: Set[str]) -> List[str]:
        order, done = [], set()
        for root in sorted(names):
            stack = [(root, False)]
            while stack:
                name, expanded = stack.pop()
                if name in done:
                    continue
                if expanded:
                    done.add(name)
                    order.append(name)
                    continue
                stack.append((name, True))
                stack.extend((_source(r)[0], False) for r in self.data_inputs(name)
                             if _tensor_name(r) not in self.cut and _source(r)[0] in names)
        return order


def _variable_reads(graph: tf.Graph, names) -> Dict[str, tf.Tensor]:
    """A tensor reading each variable ``names`` (its op's name), in ``graph`` (open:
    :func:`_extending`)."""
    fetches: Dict[str, tf.Tensor] = {}
    for name in names:
        tensor = graph.get_tensor_by_name(f"{name}:0")
        if tensor.op.type != "VarHandleOp":
            fetches[name] = tensor
            continue
        reads = [c for c in tensor.consumers() if c.type == "ReadVariableOp"]
        if reads:
            fetches[name] = reads[0].outputs[0]
        else:
            with tf.compat.v1.colocate_with(tensor.op):
                fetches[name] = gen_resource_variable_ops.read_variable_op(
                    tensor, tensor.op.get_attr("dtype"))
    return fetches


def read_variables(session, names) -> Dict[str, np.ndarray]:
    """The values of the variables ``names`` (their ops' names) in ``session`` (a
    publisher's delta: the weights a graph export copied)."""
    raw = _raw_session(session)
    with _extending(raw.graph):
        fetches = _variable_reads(raw.graph, names)
    return raw.run(fetches) if fetches else {}


def _read_values(session, cut: _Cut):
    """(variable name -> value, handle name -> (keys, rows)), read with the user's session."""
    graph = cut.graph
    with _extending(graph):
        fetches = _variable_reads(graph, cut.variables)
        # Each shard in pages (a tiered one: a 32nd of its ram_bytes; one in RAM: one
        # page), so that its server holds a page of rows at a time, not the shard.
        lo = tf.compat.v1.placeholder(tf.int64, [])
        hi = tf.compat.v1.placeholder(tf.int64, [])
        exports = {}
        for handle in sorted(set(cut.handles.values())):
            op = graph.get_operation_by_name(handle)
            with tf.compat.v1.device(op.device):
                bounds = bindings.table_page_bounds(op.outputs[0], tf.constant(0, tf.int64),
                                                    tf.constant(False))
                keys, rows = bindings.table_export_range(op.outputs[0], lo, hi)[:2]
            exports[handle] = (bounds, keys, rows)
    values = session.run(fetches) if fetches else {}
    shards = {}
    for h, (bounds, keys, rows) in exports.items():
        got = [session.run((keys, rows), feed_dict={lo: a, hi: b})
               for a, b in page_ranges(session.run(bounds))]
        shards[h] = (np.concatenate([k for k, _ in got]), np.concatenate([r for _, r in got]))
    return values, shards


def _served_table(node, keys: np.ndarray, rows: np.ndarray) -> ServingTable:
    attr = node.attr
    init = Initializer(attr["initializer"].s.decode() or "zeros", attr["init_a"].f,
                       attr["init_b"].f)
    return ServingTable(attr["shared_name"].s.decode(), attr["dim"].i, init, attr["seed"].i,
                        [(keys, rows)])


def _functions_used(nodes, library) -> graph_pb2.GraphDef:
    by_name = {f.signature.name: f for f in library.function}
    wanted, stack = set(), []

    def refs(node):
        names = [node.op] if node.op in by_name else []
        for value in node.attr.values():
            if value.HasField("func"):
                names.append(value.func.name)
            names.extend(f.name for f in value.list.func)
        return names

    for node in nodes:
        stack.extend(refs(node))
    while stack:
        name = stack.pop()
        if name in wanted or name not in by_name:
            continue
        wanted.add(name)
        for node in by_name[name].node_def:
            stack.extend(refs(node))
    out = graph_pb2.GraphDef()
    out.library.function.extend(by_name[n] for n in sorted(wanted))
    return out


def _clean(node):
    """A copy of ``node`` for the served graph: no device, no colocation, no control inputs."""
    copy = type(node)()
    copy.CopyFrom(node)
    copy.device = ""
    if "_class" in copy.attr:
        del copy.attr["_class"]
    del copy.input[:]
    copy.input.extend(r for r in node.input if not r.startswith("^"))
    return copy


def _serve_fn(cut: _Cut, items, input_tensors, outputs, tables, copies):
    """The served function: the subgraph, imported stage by stage around its lookups."""
    body = [n for n in cut.topological(cut.needed)
            if cut.nodes[n].op not in READS + VARIABLES and cut.nodes[n].op != HANDLE]
    consumers: Dict[str, Set[str]] = {}
    for name in cut.needed:
        for ref in cut.data_inputs(name):
            consumers.setdefault(_tensor_name(ref), set()).add(name)
    wanted_out = {t.name for t in outputs.values()}

    def serve(*flat):
        known: Dict[str, tf.Tensor] = {}
        for item, value in signature.rebuild(items, flat).items():
            given = input_tensors[item]
            if isinstance(given, tf.SparseTensor):
                known.update({given.indices.name: value.indices, given.values.name: value.values,
                              given.dense_shape.name: value.dense_shape})
            else:
                known[given.name] = value
        for name, var in copies.items():
            # The identity captures the handle into the function (an input_map needs a
            # tensor of the graph being built, not the eager handle).
            known[f"{name}:0"] = (tf.identity(var.handle) if cut.nodes[name].op == "VarHandleOp"
                                  else var.read_value())
        pending, reads, stage = list(body), list(cut.reads), 0
        while pending or reads:
            blocked = set(reads)
            batch = []
            for name in pending:
                if any(_source(r)[0] in blocked for r in cut.data_inputs(name)
                       if _tensor_name(r) not in known):
                    blocked.add(name)
                else:
                    batch.append(name)
            if batch:
                known.update(_import(cut, batch, known, consumers, wanted_out, stage))
                stage += 1
            ready = [r for r in reads if _tensor_name(cut.data_inputs(r)[0]) in known]
            for read in ready:
                keys = known[_tensor_name(cut.data_inputs(read)[0])]
                rows, found = tables[cut.handles[read]].find(keys)
                known[f"{read}:0"], known[f"{read}:1"] = rows, found
            if not batch and not ready:
                raise ValueError("export_serving: the inference subgraph could not be ordered "
                                 f"around its lookups {reads}")
            taken = set(batch)
            pending = [n for n in pending if n not in taken]
            reads = [r for r in reads if r not in ready]
        return {name: tf.identity(known[t.name]) for name, t in outputs.items()}

    return serve


def _import(cut: _Cut, batch: List[str], known, consumers, wanted_out, stage: int):
    """Imports the nodes ``batch``; returns their tensors later stages or outputs use."""
    inside = set(batch)
    graph_def = _functions_used([cut.nodes[n] for n in batch], cut.graph_def.library)
    graph_def.versions.CopyFrom(cut.graph_def.versions)
    graph_def.node.extend(_clean(cut.nodes[n]) for n in batch)
    input_map = {}
    for name in batch:
        for ref in cut.data_inputs(name):
            tensor = _tensor_name(ref)
            if _source(ref)[0] not in inside:
                input_map[tensor] = known[tensor]
    returned = sorted({t for t, users in consumers.items() if _source(t)[0] in inside and
                       (users - inside or t in wanted_out)} |
                      {t for t in wanted_out if _source(t)[0] in inside})
    tensors = tf.compat.v1.import_graph_def(graph_def, input_map=input_map,
                                            return_elements=returned, name=f"stage{stage}")
    return dict(zip(returned, tensors))


def _table_shards(cut: _Cut, tables: Dict[str, ServingTable]) -> Dict[str, object]:
    """The served shards grouped by trained table (a delta's unit): shard
    ``<table>/part_<i>`` of a table with n shards in the graph (its handles)."""
    counts: Dict[str, int] = {}
    for node in cut.graph_def.node:
        if node.op == HANDLE:
            table = node.attr["shared_name"].s.decode().rsplit("/part_", 1)[0]
            counts[table] = counts.get(table, 0) + 1
    groups: Dict[str, Dict[int, ServingTable]] = {}
    for handle, served in tables.items():
        table, _, index = served.table_name.rpartition("/part_")
        groups.setdefault(table, {})[int(index)] = served
    return {t: delta.ShardedServing(shards, counts.get(t, len(shards)))
            for t, shards in groups.items()}


def export(session, path: str, version: Optional[int], inputs: Optional[Mapping],
           outputs: Optional[Mapping], sequence: int = 0, extra_files=None) -> str:
    """Exports the inference ``outputs`` of ``inputs`` (see the module doc), with the
    delta signatures (:mod:`tfpsx.serving.delta`: its tables by trained table, its
    weights by variable, named in ``assets.extra/tfpsx_weights.json``); ``sequence`` and
    ``extra_files`` as a publisher's base needs them."""
    if not inputs or not outputs:
        raise ValueError("export_serving of a session needs inputs={name: placeholder} and "
                         "outputs={name: tensor} (the inference to serve)")
    raw = _raw_session(session)
    graph = raw.graph
    for kind, given in (("inputs", inputs), ("outputs", outputs)):
        for name, value in given.items():
            signature.check_name(name, f"export_serving {kind}")
            parts = ([value.indices, value.values, value.dense_shape]
                     if isinstance(value, tf.SparseTensor) and kind == "inputs" else [value])
            for part in parts:
                if not isinstance(part, tf.Tensor) or part.graph is not graph:
                    raise ValueError(f"export_serving {kind}[{name!r}]: expected a tensor of the "
                                     f"session's graph, got {value!r}")
    cut = _Cut(graph, dict(inputs), dict(outputs))
    values, shards = _read_values(raw, cut)
    items = [signature.Input(name, tf.type_spec_from_value(value) if isinstance(
        value, tf.SparseTensor) else tf.TensorSpec(value.shape, value.dtype))
        for name, value in inputs.items()]

    def build_and_write():
        tables = {h: _served_table(cut.nodes[h], *shards[h]) for h in shards}
        copies = {name: tf.Variable(np.asarray(value), trainable=False,
                                    name=name.replace("/", "_"))
                  for name, value in values.items()}
        module = GraphServingModule(list(tables.values()), list(copies.values()))
        serve = _serve_fn(cut, items, dict(inputs), dict(outputs), tables, copies)
        module.serve = tf.function(serve, input_signature=signature.flat_specs(items),
                                   autograph=False)
        weights = {delta.named_weight_input(name): name for name in copies}
        signatures = {_export.SERVING_DEFAULT: module.serve.get_concrete_function()}
        signatures.update(delta.add_signatures(
            module, _table_shards(cut, tables), {k: copies[v] for k, v in weights.items()},
            sequence))
        files = dict(extra_files or {}, **{WEIGHTS_FILE: json.dumps(weights).encode()})
        return _export.write(module, signatures, path, version, files)

    return _export.in_clean_thread(build_and_write)

"""Input checks of table operations: a bad input is refused before any shard changes.

Every message names the table, the argument or field, what it got and what was
expected. What the shapes already say (everything, in eager mode) is checked in Python
and raises ``ValueError`` at the call (or while a ``tf.function`` traces). What only the
running graph knows (a row count from ``export``, a restored checkpoint's shapes)
becomes a ``tf.debugging.Assert``; the checked tensors come back wrapped in identities
that depend on it, so every per-shard op built from them waits for the check: a multi-
shard write is all or nothing.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import tensorflow as tf

from tfpsx import graph_state

EXPORT_FIELDS = ("keys", "values", "slots", "freq", "step")
_INTEGER, _REAL = "integer", "real"

Dim = Union[int, tf.Tensor]   # a known size, or a scalar tensor the graph computes
Shape = Sequence[Dim]


def _static(dim: Dim) -> Optional[int]:
    if isinstance(dim, (int, np.integer)):
        return int(dim)
    value = tf.get_static_value(dim)
    return None if value is None else int(value)


def _describe(shape: Shape, names: Mapping[int, str]) -> str:
    """[n=3, 2, 16]: a dim with a name in ``names`` (by position) says what it stands for;
    one only the running graph knows is its name alone ([n, dim=16])."""
    parts = []
    for i, dim in enumerate(shape):
        value = _static(dim)
        if i in names:
            parts.append(names[i] if value is None else f"{names[i]}={value}")
        else:
            parts.append("?" if value is None else str(value))
    return "[" + ", ".join(parts) + "]"


def _verdict(shape: tf.TensorShape, allowed: Sequence[Shape]) -> Optional[bool]:
    """True: ``shape`` is one of ``allowed``; False: it is none of them; None: only the
    running graph can tell."""
    if shape.rank is None:
        return None
    undecided = False
    for want in allowed:
        if len(want) != shape.rank:
            continue
        state: Optional[bool] = True
        for got, dim in zip(shape.as_list(), want):
            dim = _static(dim)
            if got is None or dim is None:
                state = None if state is not False else False
            elif got != dim:
                state = False
        if state is True:
            return True
        undecided = undecided or state is None
    return None if undecided else False


def _shape_text(shape_tensor: tf.Tensor) -> tf.Tensor:
    return tf.strings.reduce_join(tf.strings.as_string(shape_tensor), separator=",")


class Checker:
    """Collects one operation's checks: static ones raise at once, dynamic ones become
    asserts that :meth:`guard` makes the checked tensors depend on."""

    def __init__(self, what: str):
        self.what = what        # e.g. "DynamicTable 'user': import_rows"
        self._asserts: List[tf.Operation] = []

    def fail(self, message: str):
        raise ValueError(f"{self.what}: {message}")

    def tensor(self, name: str, value, kind: str, cast) -> tf.Tensor:
        """``value`` as a tensor of dtype ``cast``; refused unless its dtype is of
        ``kind`` (integer, or real: integer or floating)."""
        if isinstance(value, (tf.SparseTensor, tf.RaggedTensor, tf.IndexedSlices)):
            self.fail(f"{name} must be a dense tensor, got a {type(value).__name__}")
        try:
            t = tf.convert_to_tensor(value)
        except (TypeError, ValueError) as e:
            self.fail(f"{name} must be a tensor of {kind} numbers, got {type(value).__name__} "
                      f"({e})")
        dtype = t.dtype
        ok = dtype.is_integer or (kind == _REAL and dtype.is_floating)
        # An empty Python list converts to float32: it is no wrong dtype, it is no value.
        empty_python = not isinstance(value, (tf.Tensor, tf.Variable, np.ndarray)) and \
            t.shape.num_elements() == 0
        if not ok and not empty_python:
            expected = "an integer dtype (int64)" if kind == _INTEGER else \
                "a floating dtype (float32)"
            self.fail(f"{name} must have {expected}, got {dtype.name}")
        return t if t.dtype == cast else tf.cast(t, cast)

    def shape(self, name: str, t: tf.Tensor, allowed: Sequence[Shape], expected: str,
              at_run_time: bool = True):
        """``t``'s shape must be one of ``allowed`` (dims: ints or scalar tensors);
        ``expected`` says so in words for the message. ``at_run_time=False``: only what
        the static shape tells (an op downstream checks the rest before anything
        changes)."""
        verdict = _verdict(t.shape, allowed)
        if verdict is False:
            self.fail(f"{name} must have shape {expected}, got {t.shape.as_list()}")
        if verdict is None and at_run_time:
            got = tf.shape(t, out_type=tf.int64)
            wants = [tf.cast(tf.stack(want), tf.int64) if want else tf.zeros([0], tf.int64)
                     for want in allowed]
            self._assert(self._shape_ok(t.shape, got, allowed, wants),
                         f"{name} must have shape {expected}", ["here", wants[0], "got", got])

    @staticmethod
    def _shape_ok(static: tf.TensorShape, got: tf.Tensor, allowed, wants) -> tf.Tensor:
        """A run-time test of the shape ``got`` against ``allowed``: with the rank known,
        the dims the graph does not know compared as numbers (training steps pay one
        Equal for an unknown row count); else the shapes compared as text."""
        if static.rank is None:
            return tf.reduce_any([tf.equal(_shape_text(got), _shape_text(w)) for w in wants])
        tests = []
        for want in allowed:
            if len(want) != static.rank:
                continue
            dims = [(i, d) for i, (g, d) in enumerate(zip(static.as_list(), want))
                    if g is None or _static(d) is None]
            if any(_static(d) is not None and g is not None and g != _static(d)
                   for g, d in zip(static.as_list(), want)):
                continue  # this one cannot match
            tests.append(tf.reduce_all([tf.equal(got[i], tf.cast(d, tf.int64)) for i, d in dims]))
        return tests[0] if len(tests) == 1 else tf.reduce_any(tests)

    def _assert(self, ok, message: str, data):
        # The Assert kernel escapes quotes in strings ('a' reads \'a\'): the graph's
        # message names the table without them.
        text = f"{self.what}: {message}".replace("'", "")
        self._asserts.append(tf.debugging.Assert(ok, [text, *data], summarize=8))

    def condition(self, ok, static_ok: Optional[bool], message: str, data=()):
        """A check of a value: ``static_ok`` when known now, else ``ok`` at run time."""
        if static_ok is False:
            self.fail(message)
        if static_ok is None:
            self._assert(ok, message, data)

    def guard(self, tensors):
        """``tensors`` (a dict or list), each depending on every dynamic check."""
        if not self._asserts or tf.executing_eagerly():
            return tensors
        with tf.control_dependencies(self._asserts):
            if isinstance(tensors, dict):
                return {k: tf.identity(v) for k, v in tensors.items()}
            return [tf.identity(v) for v in tensors]


def _row_count(keys: tf.Tensor) -> Dim:
    n = keys.shape.num_elements()
    return tf.size(keys, out_type=tf.int64) if n is None else n


def import_rows(what: str, dim: int, num_slots: int, rows) -> Dict[str, tf.Tensor]:
    """``rows`` (what ``export()`` returns) checked and converted for an import.

    keys ``[n]`` integers; values ``[n, dim]``; slots ``[n, num_slots, dim]``, or empty
    (``[0]`` or ``[n, 0, dim]``, e.g. from a table without an optimizer: the slots then
    start from the optimizer's initial values); freq and step ``[n]`` integers. Slots of
    another slot count are refused (pass empty slots to start them afresh); slots of
    another optimizer with the same count cannot be told apart and are taken as they are.
    The slots come back as ``[n, 0 or num_slots, dim]``.
    """
    c = Checker(f"{what}: import_rows")
    if not isinstance(rows, Mapping):
        c.fail(f"rows must be a dict with the fields {', '.join(EXPORT_FIELDS)} (what export() "
               f"returns), got {type(rows).__name__}")
    missing = [f for f in EXPORT_FIELDS if f not in rows]
    unknown = sorted(str(f) for f in rows if f not in EXPORT_FIELDS)
    if missing or unknown:
        c.fail(f"rows must have exactly the fields {', '.join(EXPORT_FIELDS)} (what export() "
               f"returns); missing: {missing or 'none'}, unknown: {unknown or 'none'}")
    keys = c.tensor("keys", rows["keys"], _INTEGER, tf.int64)
    values = c.tensor("values", rows["values"], _REAL, tf.float32)
    slots = c.tensor("slots", rows["slots"], _REAL, tf.float32)
    freq = c.tensor("freq", rows["freq"], _INTEGER, tf.int64)
    step = c.tensor("step", rows["step"], _INTEGER, tf.int64)
    c.shape("keys", keys, [[_row_count(keys)]], "[n] (a vector)")
    n = _row_count(keys)
    c.shape("values", values, [[n, dim]], _describe([n, dim], {0: "n", 1: "dim"}))
    for name, t in (("freq", freq), ("step", step)):
        c.shape(name, t, [[n]], _describe([n], {0: "n"}))
    full = [n, num_slots, dim]
    allowed = [full] + ([[n, 0, dim], [0]] if num_slots else [[0]])
    c.shape("slots", slots, allowed,
            f"{_describe(full, {0: 'n', 1: 'num_slots', 2: 'dim'})} (the optimizer of this table "
            f"has {num_slots} slot(s)), or empty ([0] or [n, 0, {dim}]: slots start from their "
            "initial values)")
    checked = c.guard(dict(keys=keys, values=values, slots=slots, freq=freq, step=step))
    checked["slots"] = _slots_matrix(checked["slots"], n, dim, num_slots)
    return checked


def _slots_matrix(slots: tf.Tensor, n: Dim, dim: int, num_slots: int) -> tf.Tensor:
    """Checked slots as ``[n, k, dim]``, k = 0 (empty) or num_slots, so that they can be
    gathered per shard like the other fields."""
    if slots.shape.rank == 3:
        return slots
    if slots.shape.num_elements() == 0 or num_slots == 0:
        return tf.zeros(tf.stack([n, 0, dim]), tf.float32)
    k = tf.where(tf.equal(tf.size(slots, out_type=tf.int64), 0), tf.constant(0, tf.int64),
                 tf.constant(num_slots, tf.int64))
    return tf.reshape(slots, tf.stack([tf.cast(n, tf.int64), k, dim]))


def rows_like_keys(what: str, name: str, dim: int, keys: tf.Tensor, rows) -> tf.Tensor:
    """``rows`` for a write of ``keys`` (as given: any shape) as ``[n, dim]`` floats;
    they must have keys' shape + [dim], or [n, dim] with n = the number of keys."""
    c = Checker(what)
    t = c.tensor(name, rows, _REAL, tf.float32)
    n = _row_count(keys)
    allowed = [[n, dim]]
    if keys.shape.rank is not None and keys.shape.rank != 1:
        dynamic = tf.shape(keys, out_type=tf.int64)
        allowed.append([d if d is not None else dynamic[i]
                        for i, d in enumerate(keys.shape.as_list())] + [dim])
    c.shape(name, t, allowed, f"the shape of keys + [dim={dim}], or "
                              f"{_describe([n, dim], {0: 'n', 1: 'dim'})}")
    return tf.reshape(c.guard([t])[0], [-1, dim])


def _checked_rows(graph) -> dict:
    """Row gradients already checked in ``graph``: id -> (tensor, keys, dim). A table's
    apply checks what its apply_gradients checked already; this spares the graph a
    second assert per step."""
    return graph_state.of(graph).checked_rows


def row_gradients(what: str, dim: int, unique_keys: tf.Tensor, grads) -> tf.Tensor:
    """The row gradients of ``unique_keys`` as ``[u, dim]`` floats: ``grads`` must be
    ``[u, dim]`` (u = the number of unique keys; a transposed or flattened gradient would
    train the wrong rows) or ``IndexedSlices`` of it."""
    graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
    if graph is not None and isinstance(grads, tf.Tensor):
        hit = _checked_rows(graph).get(id(grads))
        if hit is not None and hit[0] is grads and hit[1] is unique_keys and hit[2] == dim:
            return grads
    out = _row_gradients(what, dim, unique_keys, grads)
    if graph is not None:
        _checked_rows(graph)[id(out)] = (out, unique_keys, dim)
    return out


def _row_gradients(what: str, dim: int, unique_keys: tf.Tensor, grads) -> tf.Tensor:
    c = Checker(what)
    u = _row_count(unique_keys)
    expected = _describe([u, dim], {0: "unique ids", 1: "dim"})
    if isinstance(grads, tf.IndexedSlices):
        # Which rows the slices land in is checked (dense_shape); that values and
        # indices agree, unsorted_segment_sum checks before any row changes.
        values = c.tensor("the gradient values", grads.values, _REAL, tf.float32)
        indices = c.tensor("the gradient indices", grads.indices, _INTEGER, tf.int64)
        k = _row_count(indices)
        c.shape("the gradient indices", indices, [[k]], "[k] (a vector)", at_run_time=False)
        c.shape("the gradient values", values, [[k, dim]],
                _describe([k, dim], {0: "k indices", 1: "dim"}), at_run_time=False)
        if grads.dense_shape is not None:
            dense = tf.cast(grads.dense_shape, tf.int64)
            c.shape("the gradient dense_shape", dense, [[2]], "[2]")
            static = tf.get_static_value(dense)
            static_ok = None if static is None or _static(u) is None else \
                list(static) == [_static(u), dim]
            got = "?" if static is None else [int(d) for d in static]
            c.condition(tf.reduce_all(tf.equal(dense, [tf.cast(u, tf.int64), dim])), static_ok,
                        f"the gradient (IndexedSlices) must have dense shape {expected}, "
                        f"got {got}", [dense])
        values, indices = c.guard([values, indices])
        return tf.math.unsorted_segment_sum(values, indices, tf.cast(u, tf.int64))
    t = c.tensor("the gradient", grads, _REAL, tf.float32)
    c.shape("the gradient", t, [[u, dim]], expected)
    return c.guard([t])[0]


def evict_args(what: str, min_step, keep_top_n) -> Tuple[tf.Tensor, tf.Tensor]:
    """(min_step, keep_top_n) as int64 scalars: None, or an integer (tensor) scalar;
    keep_top_n >= 0."""
    c = Checker(f"{what}: evict")
    out = []
    for name, value in (("min_step", min_step), ("keep_top_n", keep_top_n)):
        if value is None:
            out.append(None)
            continue
        if isinstance(value, bool):
            c.fail(f"{name} must be None or an integer, got {value!r}")
        t = c.tensor(name, value, _INTEGER, tf.int64)
        c.shape(name, t, [[]], "[] (a scalar)")
        out.append(t)
    keep = out[1]
    if keep is not None:
        static = tf.get_static_value(keep)
        c.condition(tf.greater_equal(keep, 0), None if static is None else bool(static >= 0),
                    f"keep_top_n must be >= 0 (rows to keep per shard), got "
                    f"{'?' if static is None else int(static)}", [keep])
    guarded = iter(c.guard([t for t in out if t is not None]))
    return tuple(None if t is None else next(guarded) for t in out)

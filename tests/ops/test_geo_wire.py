"""GEO's wire dtypes in one process (tfpsx.embedding.row_copy): under shared slots a table
row travels as ``[values | optimizer slots]``, the values in ``geo_wire_dtype`` and the
slots in ``geo_slot_wire_dtype`` (bfloat16 by default): a push sends their deltas, a pull
their values less the optimizer's initial ones. The reference for the rounding is
ml_dtypes' bfloat16 (numpy), not TensorFlow's cast; the PS and the copies keep float32."""

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import tfpsx
from tfpsx import embedding as E
from tfpsx.embedding import row_copy
from tfpsx.embedding.sharding import ShardedTable
from tfpsx.modes import geo
from tfpsx.modes.geo.copies import copy_global

DIM = 4
KEYS = np.arange(0, 40, 3, dtype=np.int64)
_names = iter(range(10 ** 6))


def bf16(x):
    """x rounded to bfloat16 (ml_dtypes: round to nearest even), as float32."""
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def rows_of(table, keys):
    """[values | slots] of ``keys`` in a table (float32 numpy)."""
    return table.stitched(lambda i, shard, k: shard.find(k, with_slots=True)[0],
                          tf.constant(keys)).numpy()


def worker(g, reader, slot_wire=tf.bfloat16, wire=None):
    """A worker's copy of ``g`` under shared slots, its readers registered and its copy
    taking the PS's rows (as a round's catch-up does)."""
    copy = dict(initializer=g.initializer, seed=g.seed, devices=[None], optimizer=g.optimizer)
    t = geo.GeoTable(g, ShardedTable(f"geo_wire_l{next(_names)}", DIM, **copy),
                     ShardedTable(f"geo_wire_o{next(_names)}", DIM, **copy), None, reader,
                     share_slots=True, slot_wire=slot_wire, wire=wire)
    row_copy.table_readers(t)
    copy_global(t)
    return t


def train(t, seed):
    """Two Adagrad steps of the copy on KEYS, with gradients of every size (the slots
    move by amounts bfloat16 cannot hold exactly)."""
    rng = np.random.default_rng(seed)
    for _ in range(2):
        t.local.apply(tf.constant(KEYS), tf.constant(
            rng.normal(scale=0.37, size=(len(KEYS), DIM)).astype(np.float32)))


def table():
    """The PS's table (2 shards, Adagrad) holding KEYS."""
    g = ShardedTable(f"geo_wire_g{next(_names)}", DIM, [None, None], initializer=E.normal(0.1),
                     optimizer=E.Adagrad(0.3), seed=5)
    g.insert(tf.constant(KEYS), tf.constant(
        np.random.default_rng(0).normal(size=(len(KEYS), DIM)).astype(np.float32)))
    return g


def test_a_push_sends_the_values_whole_and_the_slots_in_bfloat16():
    g = table()
    w = worker(g, 1)
    before = rows_of(g, KEYS)
    local_before = rows_of(w.local, KEYS)
    np.testing.assert_array_equal(local_before, before)
    train(w, 1)
    delta = rows_of(w.local, KEYS) - rows_of(w.old, KEYS)
    assert np.all(delta[:, DIM:] != 0)  # the steps moved every slot
    ops, (rows, sent) = geo.push_ops([], [w], 1.0)
    tf.group(ops)
    assert int(rows) == len(KEYS)
    # a row: its key, 4 float32 values and 4 bfloat16 accumulators
    assert int(sent) == len(KEYS) * (8 + DIM * 4 + DIM * 2) == \
        len(KEYS) * row_copy.row_bytes(w)
    got = rows_of(g, KEYS)
    np.testing.assert_array_equal(got[:, :DIM], before[:, :DIM] + delta[:, :DIM])
    np.testing.assert_array_equal(got[:, DIM:], before[:, DIM:] + bf16(delta[:, DIM:]))
    # old took what the PS added: the rounding stays in local - old (the values':
    # float32's own rounding of old + delta) ...
    residue = rows_of(w.local, KEYS) - rows_of(w.old, KEYS)
    np.testing.assert_allclose(residue[:, :DIM], 0, atol=1e-7)
    np.testing.assert_allclose(residue[:, DIM:], delta[:, DIM:] - bf16(delta[:, DIM:]),
                               atol=1e-6)
    # ... and the next push of the row carries it: what the PS's slots moved by, plus
    # what the copy holds unpushed, is what the copy's slots moved by (nothing lost)
    train(w, 4)
    row_copy.table_push(w, 1.0, None)
    local, unpushed = rows_of(w.local, KEYS), rows_of(w.local, KEYS) - rows_of(w.old, KEYS)
    assert np.abs(unpushed[:, DIM:]).max() > 0
    np.testing.assert_allclose(rows_of(g, KEYS)[:, DIM:] - before[:, DIM:] + unpushed[:, DIM:],
                               local[:, DIM:] - local_before[:, DIM:], atol=1e-6)


def test_a_pull_brings_the_slots_in_bfloat16_less_their_initial_values():
    """A pull brings a row's slots' values, not deltas: an Adagrad accumulator near its
    start (0.1) narrowed to bfloat16 would lose the increments below its rounding, so
    they travel less the optimizer's initial value, which the puller adds back."""
    g = table()
    pusher, puller = worker(g, 1), worker(g, 2)
    train(pusher, 2)
    row_copy.table_push(pusher, 1.0, None)
    ps = rows_of(g, KEYS)
    ops, (rows, got) = geo.pull_ops([], [puller])
    assert int(rows) == len(KEYS) and int(got) == len(KEYS) * (8 + DIM * 4 + DIM * 2)
    local = rows_of(puller.local, KEYS)
    np.testing.assert_array_equal(local[:, :DIM], ps[:, :DIM])
    np.testing.assert_allclose(local[:, DIM:], bf16(ps[:, DIM:] - 0.1) + 0.1, rtol=1e-6)
    np.testing.assert_array_equal(rows_of(puller.old, KEYS), local)
    # narrowed whole, the increments would be lost to the rounding
    added = ps[:, DIM:] - 0.1
    assert np.abs(local[:, DIM:] - ps[:, DIM:]).max() < np.abs(bf16(ps[:, DIM:]) -
                                                                ps[:, DIM:]).max() / 4
    assert np.all(np.abs(local[:, DIM:] - ps[:, DIM:]) <= np.abs(added) / 256)


def test_float32_slots_and_bfloat16_values_travel_as_named():
    """geo_slot_wire_dtype="float32" with geo_wire_dtype="bfloat16": each part in its own."""
    g = table()
    w, puller = worker(g, 1, slot_wire=tf.float32, wire=tf.bfloat16), \
        worker(g, 2, slot_wire=tf.float32, wire=tf.bfloat16)
    before = rows_of(g, KEYS)
    train(w, 3)
    delta = rows_of(w.local, KEYS) - rows_of(w.old, KEYS)
    ops, (_, sent) = geo.push_ops([], [w], 1.0)
    assert int(sent) == len(KEYS) * (8 + DIM * 2 + DIM * 4)
    got = rows_of(g, KEYS)
    np.testing.assert_array_equal(got[:, :DIM], before[:, :DIM] + bf16(delta[:, :DIM]))
    np.testing.assert_array_equal(got[:, DIM:], before[:, DIM:] + delta[:, DIM:])
    geo.pull_ops([], [puller])
    local = rows_of(puller.local, KEYS)  # (local += global - old: float32's rounding)
    np.testing.assert_allclose(local[:, :DIM], bf16(got[:, :DIM]), rtol=0, atol=1e-7)
    np.testing.assert_allclose(local[:, DIM:], got[:, DIM:], rtol=0, atol=1e-7)


def test_the_slot_wire_dtype_is_an_option_named_in_its_error():
    s = tfpsx.DistributedStrategy(a_sync=True, a_sync_configs={"k_steps": 10})
    assert s.geo_slot_wire_dtype == "bfloat16" and "slot_wire" not in repr(s)
    s = tfpsx.DistributedStrategy(a_sync=True, a_sync_configs={
        "k_steps": 10, "geo_slot_wire_dtype": "float32"})
    assert "geo_slot_wire_dtype='float32'" in repr(s)
    for bad in ("int8", "float16"):  # (float16's range ends at 65,504)
        with pytest.raises(ValueError, match=r"geo_slot_wire_dtype'\] must be one of "
                                             rf"\['float32', 'bfloat16'\], got '{bad}'"):
            tfpsx.DistributedStrategy(a_sync=True, a_sync_configs={
                "k_steps": 10, "geo_slot_wire_dtype": bad})

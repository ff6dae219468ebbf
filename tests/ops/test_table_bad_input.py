"""Bad input to a table is refused with a message naming the table, the field or argument,
what it got and what was expected, and changes nothing: on every shard, eager and in a
graph (where the checks the shapes cannot settle are asserts that every shard op waits for),
for import_rows, checkpoint restores, evict, insert / accumulate and apply_gradients."""

import re

import numpy as np
import pytest
import tensorflow as tf

import tfpsx
from tfpsx import embedding as E

_names = iter(range(10 ** 6))


def table(dim=2, shards=3, optimizer="adagrad", name=None, **kw):
    name = name or f"bad{next(_names)}"
    return E.DynamicTable(name, dim, optimizer=optimizer, devices=[None] * shards,
                              initializer=E.normal(stddev=0.1), **kw)


def snapshot(emb, sess=None):
    """Every row with its slots and metadata, sorted by key (eager or in ``sess``)."""
    rows = emb.export()
    rows = sess.run(rows) if sess is not None else {k: v.numpy() for k, v in rows.items()}
    order = np.argsort(rows["keys"])
    return {k: v[order] for k, v in rows.items()}


def assert_same(before, after):
    assert before.keys() == after.keys()
    for k in before:
        np.testing.assert_array_equal(before[k], after[k], err_msg=k)


def filled(dim=2, shards=3, optimizer="adagrad", **kw):
    """A multi-shard table with rows on every shard, trained once (slots, freq, step set)."""
    t = table(dim, shards, optimizer, **kw)
    looked = t.lookup_unique([100, 101, 102, 103, 104], step=3)
    t.apply_gradients(looked, tf.ones([5, dim]), step=3)
    return t


def good_rows(dim=2, num_slots=1, n=3):
    return {"keys": tf.constant([1, 2, 3][:n], tf.int64),
            "values": tf.fill([n, dim], 0.5),
            "slots": tf.fill([n, num_slots, dim], 0.25),
            "freq": tf.constant([4, 5, 6][:n], tf.int64),
            "step": tf.constant([7, 8, 9][:n], tf.int64)}


# ----------------------------------------------------------------------------- import_rows
BAD_IMPORTS = [
    # (what to change, the message expected)
    (lambda r: r.update(freq=r["freq"][:2]), r"freq must have shape \[n=3\], got \[2\]"),
    (lambda r: r.update(step=tf.zeros([4], tf.int64)), r"step must have shape \[n=3\], got \[4\]"),
    (lambda r: r.pop("slots"), r"rows must have exactly the fields keys, values, slots, freq, step "
                             r"\(what export\(\) returns\); missing: \['slots'\]"),
    (lambda r: r.update(value=r.pop("values")), r"rows must .*missing: \['values'\], unknown: \['value'\]"),
    (lambda r: r.update(keys=tf.constant([1.0, 2.0, 3.0])),
     r"keys must have an integer dtype \(int64\), got float32"),
    (lambda r: r.update(freq=tf.constant(["a", "b", "c"])),
     r"freq must have an integer dtype \(int64\), got string"),
    (lambda r: r.update(keys=tf.constant([[1, 2, 3]], tf.int64)),
     r"keys must have shape \[n\] \(a vector\), got \[1, 3\]"),
    (lambda r: r.update(values=tf.zeros([3, 3])),
     r"values must have shape \[n=3, dim=2\], got \[3, 3\]"),
    (lambda r: r.update(values=tf.zeros([2, 3])),  # transposed
     r"values must have shape \[n=3, dim=2\], got \[2, 3\]"),
    (lambda r: r.update(slots=tf.zeros([3, 2, 2])),  # Adam's two slots into an Adagrad table
     r"slots must have shape \[n=3, num_slots=1, dim=2\] \(the optimizer of this table has "
     r"1 slot\(s\)\), or empty .*got \[3, 2, 2\]"),
    (lambda r: r.update(slots=tf.zeros([6])), r"slots must have shape .*got \[6\]"),
]


@pytest.mark.parametrize("change,message", BAD_IMPORTS)
def test_import_refuses_bad_rows_before_any_shard_changes(change, message):
    t = filled()
    before = snapshot(t)
    rows = good_rows()
    change(rows)
    with pytest.raises(ValueError, match=rf"DynamicTable '{t.name}': import_rows: {message}"):
        t.import_rows(rows, clear=True)
    assert_same(before, snapshot(t))
    with pytest.raises(ValueError, match="must be a dict with the fields keys, values"):
        t.import_rows(list(good_rows().values()))
    assert_same(before, snapshot(t))


def test_import_accepts_exported_rows_and_empty_slots():
    src = filled(optimizer="adagrad")
    rows = src.export()
    dst = table(shards=2)                       # another shard count: re-sharded
    dst.import_rows(rows)
    assert_same(snapshot(src), snapshot(dst))
    # Empty slots ([0], or [n, 0, dim] as a table without an optimizer exports) start
    # from the optimizer's initial value (Adagrad's accumulator: 0.1).
    for slots in (tf.zeros([0]), tf.zeros([5, 0, 2]), []):
        dst.import_rows(dict(rows, slots=slots))
        got = snapshot(dst)
        np.testing.assert_array_equal(got["values"], snapshot(src)["values"])
        np.testing.assert_allclose(got["slots"], np.full([5, 1, 2], 0.1))
    plain = table(optimizer=None)               # no optimizer: no slots to import
    plain.import_rows(dict(rows, slots=tf.zeros([0])))
    assert int(plain.size()) == 5
    with pytest.raises(ValueError, match=r"slots must have shape \[n=5, num_slots=0, dim=2\]"):
        plain.import_rows(rows)
    # Python and numpy data of the expected kinds convert (ints are fine as values).
    dst.import_rows({"keys": [7, 8], "values": [[1, 2], [3, 4]], "slots": np.zeros((2, 1, 2)),
                     "freq": np.array([1, 1], np.int32), "step": [0, 0]})
    np.testing.assert_array_equal(dst.lookup([7, 8]), [[1, 2], [3, 4]])


def test_graph_import_is_all_or_nothing():
    """In a graph the row count is known only when the graph runs: the asserts fail the
    run before any shard clears or imports (the rows used to reach shard 0 first)."""
    with tf.Graph().as_default():
        t = table()
        looked = t.lookup_unique(tf.constant([100, 101, 102, 103, 104], tf.int64))
        train = t.apply_gradients(looked, tf.ones([5, 2]))
        feeds = {name: tf.compat.v1.placeholder(dtype, name=name) for name, dtype in
                 (("keys", tf.int64), ("values", tf.float32), ("slots", tf.float32),
                  ("freq", tf.int64), ("step", tf.int64))}
        load = t.import_rows(feeds, clear=True)
        with tf.compat.v1.Session() as sess:
            sess.run(train)
            before = snapshot(t, sess)
            good = dict(keys=np.array([1, 2, 3]), values=np.full([3, 2], 0.5, np.float32),
                        slots=np.full([3, 1, 2], 0.25, np.float32), freq=np.array([4, 5, 6]),
                        step=np.array([7, 8, 9]))
            for field, value, message in (
                    ("freq", good["freq"][:1],
                     r"freq must have shape \[n\]\] \[here\] \[3\] \[got\] \[1\]"),
                    ("values", good["values"].T,
                     r"values must have shape \[n, dim=2\]\] \[here\] \[3 2\] \[got\] \[2 3\]"),
                    ("slots", np.zeros([3, 2, 2], np.float32), r"slots must have shape"),
                    ("keys", good["keys"].reshape(1, 3), r"keys must have shape \[n\]")):
                with pytest.raises(tf.errors.InvalidArgumentError,
                                   match=rf"DynamicTable {t.name}: import_rows: {message}"):
                    sess.run(load, {feeds[k]: (value if k == field else v)
                                    for k, v in good.items()})
                assert_same(before, snapshot(t, sess))
            sess.run(load, {feeds[k]: v for k, v in good.items()})
            assert list(snapshot(t, sess)["keys"]) == [1, 2, 3]
        # Shapes the graph already knows are refused while it is built.
        with pytest.raises(ValueError, match=r"freq must have shape \[n=3\], got \[2\]"):
            t.import_rows(dict(good_rows(), freq=tf.zeros([2], tf.int64)))


def test_tf_function_import_checks_at_run_time():
    t = filled()
    before = snapshot(t)
    spec = {"keys": tf.TensorSpec(None, tf.int64), "values": tf.TensorSpec(None, tf.float32),
            "slots": tf.TensorSpec(None, tf.float32), "freq": tf.TensorSpec(None, tf.int64),
            "step": tf.TensorSpec(None, tf.int64)}

    @tf.function(input_signature=[spec])
    def load(rows):
        t.import_rows(rows, clear=True)

    with pytest.raises(tf.errors.InvalidArgumentError, match=r"freq must have shape"):
        load(dict(good_rows(), freq=tf.constant([1], tf.int64)))
    assert_same(before, snapshot(t))
    load(good_rows())
    assert list(snapshot(t)["keys"]) == [1, 2, 3]


# ----------------------------------------------------------------------------- checkpoints
def test_checkpoint_of_another_table_is_refused_and_changes_nothing(tmp_path):
    src = filled(dim=3, optimizer="adam")
    path = tf.train.Checkpoint(table=src).write(str(tmp_path / "ckpt"))
    dst = filled(dim=2, optimizer="adagrad")
    before = snapshot(dst)
    with pytest.raises(ValueError, match=rf"'{dst.name}': import_rows: values must have shape "
                                         r"\[n=5, dim=2\], got \[5, 3\]"):
        tf.train.Checkpoint(table=dst).read(path).assert_consumed()
    assert_same(before, snapshot(dst))
    same_dim = filled(dim=3, optimizer="adagrad")  # Adam's 2 slots, an Adagrad table: 1
    before = snapshot(same_dim)
    with pytest.raises(ValueError, match=r"slots must have shape \[n=5, num_slots=1, dim=3\]"):
        tf.train.Checkpoint(table=same_dim).read(path)
    assert_same(before, snapshot(same_dim))


def test_saver_restore_of_another_table_is_refused_and_changes_nothing(tmp_path):
    name = f"saved{next(_names)}"
    with tf.Graph().as_default():
        src = table(dim=3, name=name)
        fill = src.insert(tf.constant([1, 2, 3, 4], tf.int64), tf.ones([4, 3]))
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session() as sess:
            sess.run(fill)
            path = saver.save(sess, str(tmp_path / "model"))
    with tf.Graph().as_default():
        # Same name, other dim: the checkpoint's rows do not fit; the shapes of restored
        # tensors are known only when the restore runs.
        dst = E.DynamicTable(name, 2, optimizer="adagrad", devices=[None] * 3,
                                 initializer=E.zeros())
        fill = dst.insert(tf.constant([10, 11, 12], tf.int64), tf.ones([3, 2]))
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session() as sess:
            sess.run(fill)
            before = snapshot(dst, sess)
            with pytest.raises(tf.errors.InvalidArgumentError,
                               match=rf"DynamicTable {name}: import_rows: (values|slots) "
                                     r"must have shape .*\[got\] \[4 (1 )?3\]"):
                saver.restore(sess, path)
            assert_same(before, snapshot(dst, sess))


# ----------------------------------------------------------------------------- evict
@pytest.mark.parametrize("kwargs,message", [
    ({"keep_top_n": -1}, r"keep_top_n must be >= 0 \(rows to keep per shard\), got -1"),
    ({"keep_top_n": 2.5}, r"keep_top_n must have an integer dtype \(int64\), got float32"),
    ({"keep_top_n": True}, r"keep_top_n must be None or an integer, got True"),
    ({"min_step": [1, 2]}, r"min_step must have shape \[\] \(a scalar\), got \[2\]"),
    ({"min_step": "late"}, r"min_step must have an integer dtype \(int64\), got string"),
])
def test_evict_refuses_bad_arguments(kwargs, message):
    t = filled()
    before = snapshot(t)
    with pytest.raises(ValueError, match=rf"DynamicTable '{t.name}': evict: {message}"):
        t.evict(**kwargs)
    assert_same(before, snapshot(t))


def test_graph_evict_is_all_or_nothing():
    with tf.Graph().as_default():
        t = table()
        fill = t.insert(tf.range(30, dtype=tf.int64), tf.ones([30, 2]))
        keep = tf.compat.v1.placeholder(tf.int64, [])
        evict = t.evict(min_step=tf.constant(0, tf.int64), keep_top_n=keep)
        with tf.compat.v1.Session() as sess:
            sess.run(fill)
            before = snapshot(t, sess)
            with pytest.raises(tf.errors.InvalidArgumentError, match="keep_top_n must be >= 0"):
                sess.run(evict, {keep: -3})
            assert_same(before, snapshot(t, sess))
            assert sess.run(evict, {keep: 2}) == 30 - 3 * 2


# ----------------------------------------------------------------------------- writes
@pytest.mark.parametrize("grads,got", [
    (tf.ones([4, 3]), r"\[4, 3\]"),        # transposed: used to train the wrong rows
    (tf.ones([12]), r"\[12\]"),            # flattened
    (tf.ones([1, 3, 4]), r"\[1, 3, 4\]"),
    (tf.ones([3, 5]), r"\[3, 5\]"),        # dim + 1: used to be a raw Reshape error
    (tf.ones([2, 4]), r"\[2, 4\]"),        # a row short
])
def test_apply_gradients_refuses_other_shapes(grads, got):
    t = filled(dim=4)
    looked = t.lookup_unique([100, 101, 200])
    before = snapshot(t)
    with pytest.raises(ValueError, match=rf"DynamicTable '{t.name}': apply_gradients: the "
                                         rf"gradient must have shape \[unique ids=3, dim=4\], "
                                         rf"got {got}"):
        t.apply_gradients(looked, grads)
    assert_same(before, snapshot(t))


def test_apply_gradients_indexed_slices():
    t = filled(dim=4)
    looked = t.lookup_unique([100, 101, 200])
    before = snapshot(t)
    bad = tf.IndexedSlices(tf.ones([2, 5]), tf.constant([0, 2]), tf.constant([3, 5]))
    with pytest.raises(ValueError, match=r"the gradient values must have shape "
                                         r"\[k indices=2, dim=4\], got \[2, 5\]"):
        t.apply_gradients(looked, bad)
    bad = tf.IndexedSlices(tf.ones([2, 4]), tf.constant([0, 2]), tf.constant([7, 4]))
    with pytest.raises(ValueError, match=r"dense shape \[unique ids=3, dim=4\], got \[7, 4\]"):
        t.apply_gradients(looked, bad)
    assert_same(before, snapshot(t))
    # What a tape gives for a gather of unique_rows: IndexedSlices, rows of one id summed.
    with tf.GradientTape() as tape:
        looked = t.lookup_unique([100, 101, 200, 100], tape=tape)
        loss = tf.reduce_sum(tf.gather(looked.unique_rows, looked.indices))
    grads = tape.gradient(loss, looked.unique_rows)
    sgd = filled(dim=4, optimizer=E.SGD(1.0))
    start = sgd.lookup([100, 101, 200]).numpy()
    sgd.apply_gradients(sgd.lookup_unique([100, 101, 200, 100]),
                        tf.IndexedSlices(grads.values, grads.indices, grads.dense_shape))
    np.testing.assert_allclose(sgd.lookup([100, 101, 200]), start - [[2.0], [1.0], [1.0]],
                               rtol=1e-6)


def test_graph_apply_gradients_checks_at_run_time():
    with tf.Graph().as_default():
        t = table(dim=4)
        ids = tf.compat.v1.placeholder(tf.int64, [None])
        grads = tf.compat.v1.placeholder(tf.float32, None)
        looked = t.lookup_unique(ids)
        train = t.apply_gradients(looked, grads)
        with tf.compat.v1.Session() as sess:
            sess.run(train, {ids: [1, 2, 3], grads: np.ones([3, 4])})
            before = snapshot(t, sess)
            with pytest.raises(tf.errors.InvalidArgumentError,
                               match=rf"DynamicTable {t.name}: apply_gradients: the "
                                     r"gradient must have shape \[unique ids, dim=4\]\] "
                                     r"\[here\] \[3 4\] \[got\] \[4 3\]"):
                sess.run(train, {ids: [1, 2, 3], grads: np.ones([4, 3])})
            assert_same(before, snapshot(t, sess))
        # A static shape is refused while the graph is built.
        with pytest.raises(ValueError, match=r"got \[None, 3\]"):
            t.apply_gradients(looked, tf.compat.v1.placeholder(tf.float32, [None, 3]))


def test_insert_and_accumulate_refuse_transposed_rows():
    t = filled(dim=4)
    before = snapshot(t)
    for write, name in ((t.insert, "insert: values"), (t.accumulate, "accumulate: deltas")):
        with pytest.raises(ValueError, match=rf"'{t.name}': {name} must have shape the shape of "
                                             r"keys \+ \[dim=4\], or \[n=2, dim=4\], got \[4, 2\]"):
            write([100, 300], np.ones([4, 2], np.float32))
    assert_same(before, snapshot(t))
    t.insert([[100, 300]], np.full([1, 2, 4], 2.0, np.float32))  # keys' shape + [dim]
    np.testing.assert_array_equal(t.lookup([100, 300]), np.full([2, 4], 2.0))


def test_import_kernel_refuses_bad_shapes():
    """What reaches the kernel directly (no Python checks) is an InvalidArgument, never a
    crash, and the table is unchanged."""
    t = filled(shards=1)
    before = snapshot(t)
    handle, ops = t.handles()[0], tfpsx.load_ops()
    good = good_rows()
    cases = [
        (dict(keys=tf.constant([[1, 2, 3]], tf.int64)), "import keys must be a vector"),
        (dict(values=tf.zeros([3, 3])), r"imported values must have shape \[3,2\]"),
        (dict(values=tf.zeros([6])), r"imported values must have shape \[3,2\]"),
        (dict(slots=tf.zeros([6])), r"import slots must be empty or have shape \[3,1,2\].*got \[6\]"),
        (dict(slots=tf.zeros([3, 2, 2])),
         r"import slots must be empty or have shape \[3,1,2\].*got \[3,2,2\]"),
        (dict(freq=tf.zeros([3, 1], tf.int64)),
         r"import freq must be empty or have shape \[3\], got \[3,1\]"),
        (dict(step=tf.zeros([2], tf.int64)), r"import step must be empty or have shape \[3\]"),
    ]
    for change, message in cases:
        rows = dict(good, **change)
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=rf"tfpsx table '{re.escape(t.name)}/part_0': {message}"):
            ops.tfpsx_hash_table_import(handle, rows["keys"], rows["values"], rows["slots"],
                                        rows["freq"], rows["step"], clear=True)
        assert_same(before, snapshot(t))

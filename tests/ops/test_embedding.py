"""tfpsx.embedding.DynamicTable and the table ops in one process (eager and graph)."""

import re
import subprocess
import sys
import threading

import numpy as np
import pytest
import tensorflow as tf

import tfpsx
from tfpsx import embedding as E

_names = iter(range(10 ** 6))


def table(dim=4, **kw):
    kw.setdefault("initializer", E.normal(stddev=0.1))
    kw.setdefault("devices", [None] * kw.pop("shards", 1))
    return E.DynamicTable(f"t{next(_names)}", dim, **kw)


def sorted_export(emb):
    rows = {k: v.numpy() for k, v in emb.export().items()}
    order = np.argsort(rows["keys"])
    return {k: v[order] for k, v in rows.items()}


def test_lookup_shapes_dedup_and_determinism():
    a, b = table(seed=7, shards=2), table(seed=7, shards=3)
    ids = tf.constant([[5, -3, 5], [2 ** 40, 7, -3]])
    looked = a.lookup_unique(ids)
    assert looked.embeddings.shape == (2, 3, 4)
    assert looked.unique_keys.shape == (4,)  # 5 and -3 were looked up once each
    np.testing.assert_array_equal(looked.embeddings[0, 0], looked.embeddings[0, 2])
    # Same seed and key: the same row, whatever the table, shard count or process.
    np.testing.assert_array_equal(b.lookup(ids, train=True), looked.embeddings)
    assert int(a.size()) == 4 and int(b.size()) == 4
    # Read-only lookups store nothing.
    table(seed=7).lookup(ids)
    c = table(seed=7)
    c.lookup(ids)
    assert int(c.size()) == 0


@pytest.mark.parametrize("shards", [1, 3])
def test_lookup_without_dedup_equals_dedup(shards):
    emb = table(seed=3, shards=shards)
    ids = tf.constant([[9, 4, 9, -1], [4, 4, 2 ** 50, 0]])
    emb.lookup(ids[:, :2], train=True)  # some stored rows, some initial rows
    emb.accumulate(tf.constant([9, 4], tf.int64), tf.ones([2, 4]))
    direct = emb.lookup(ids, dedup=False)
    assert direct.shape == (2, 4, 4)
    np.testing.assert_array_equal(direct, emb.lookup(ids, dedup=True))
    np.testing.assert_array_equal(direct, emb.lookup_unique(ids, train=False).embeddings)


def test_insert_accumulate_remove_export_import():
    t = table(dim=2, shards=2)
    t.insert([1, 2, 3], [[1, 1], [2, 2], [3, 3]], step=4)
    t.accumulate([2, 10], [[0.5, 0.5], [1, 1]], step=6)
    rows = sorted_export(t)
    np.testing.assert_array_equal(rows["keys"], [1, 2, 3, 10])
    np.testing.assert_allclose(rows["values"][:3], [[1, 1], [2.5, 2.5], [3, 3]])
    np.testing.assert_array_equal(rows["step"], [4, 6, 4, 6])
    delta = {k: v.numpy() for k, v in t.export(since_step=5).items()}
    assert sorted(delta["keys"]) == [2, 10]
    assert int(t.remove([1, 99])) == 1 and int(t.size()) == 3
    u = table(dim=2, shards=3)
    u.import_rows(t.export())
    for key, value in sorted_export(t).items():
        np.testing.assert_array_equal(sorted_export(u)[key], value)


def test_changed_keys_per_reader():
    t = table(dim=2)
    ops, handle = tfpsx.load_ops(), t.handles()[0]
    assert ops.tfpsx_hash_table_take_changed(handle, tf.constant(0, tf.int64)).shape == (0,)
    t.accumulate([4, 8], [[1, 1], [1, 1]])
    t.lookup([9, 4], train=True)
    np.testing.assert_array_equal(ops.tfpsx_hash_table_take_changed(handle, tf.constant(0, tf.int64)),
                                  [4, 8, 9])
    assert ops.tfpsx_hash_table_take_changed(handle, tf.constant(0, tf.int64)).shape == (0,)


def _take(t, reader):
    """The keys changed for ``reader`` on every shard, sorted."""
    me = tf.constant(reader, tf.int64)
    return sorted(int(k) for part in t.on_shards(lambda i, s: s.take_changed(me))
                  for k in part.numpy())


def test_parallel_pushes_of_a_row_combine_on_every_shard():
    """GEO's pushes (skip_reader = the pusher; the others: the pushes of the row since the
    pusher's last take): 'mean' keeps a row at the mean of the pushes, 'scaled' adds
    delta / (1 + others); a bad combine is refused, nothing sent."""
    keys = [4, 5, 6]
    want = {"mean": [[7 / 3, 10 / 3], [2, 2], [3, 3]],
            "scaled": [[3 + 0.5 + 1, 3 + 0.5 + 2], [3.5, 3.5], [3, 3]]}
    for combine, rows in want.items():
        t = table(dim=2, shards=3, initializer=E.zeros())
        for reader in (1, 2, 3):
            assert _take(t, reader) == []  # registers the readers
        t.accumulate(keys, [[3, 3]] * 3, skip_reader=1, combine=combine)  # alone: whole
        t.accumulate(keys[:2], [[1, 1]] * 2, skip_reader=2, combine=combine)  # 1 other
        t.accumulate(keys[:1], [[3, 6]], skip_reader=3, combine=combine)  # 2 others
        np.testing.assert_allclose(t.lookup(keys).numpy(), rows, rtol=1e-6, err_msg=combine)
        assert _take(t, 3) == keys and _take(t, 1) == [4, 5]

    with pytest.raises(ValueError, match=r"combine='avg'; expected one of sum, mean, scaled"):
        t.accumulate([4], [[1, 1]], skip_reader=1, combine="avg")
    with pytest.raises(ValueError, match=r"combine='mean' counts .* needs the pusher's reader "
                                         r"as skip_reader \(>= 0\), got -1"):
        t.accumulate([4], [[1, 1]], combine="mean")
    np.testing.assert_allclose(t.lookup([4]).numpy(), [rows[0]], rtol=1e-6)


def test_rows_travel_with_their_optimizer_slots_on_every_shard():
    """GEO with shared optimizer state: find(with_slots) reads [value | slots] (a missing
    key: its initial row and slot_init), accumulate(with_slots) adds deltas to both; a
    delta of the wrong width or a combined push is refused before any shard changes."""
    t = table(dim=2, shards=3, initializer=E.constant(1.0),
              optimizer=E.Adagrad(0.1, initial_accumulator_value=0.1))
    assert t.row_width == 4
    keys = tf.constant([4, 5, 6], tf.int64)
    t.apply(keys[:1], [[0.5, -1.0]])

    def full():
        return t.stitched(lambda i, s, k: s.find(k, with_slots=True)[0], keys).numpy()

    acc = [0.35, 1.1]
    value = [1 - 0.1 * 0.5 / np.sqrt(0.35), 1 + 0.1 / np.sqrt(1.1)]
    np.testing.assert_allclose(full(), [value + acc, [1, 1, 0.1, 0.1], [1, 1, 0.1, 0.1]],
                               rtol=1e-5)
    deltas = [[1, 2, 0.25, 0.5], [0, -1, 1, 0], [0, 0, 0, 0]]
    t.accumulate(keys, deltas, with_slots=True)
    np.testing.assert_allclose(full(), np.array([value + acc, [1, 1, 0.1, 0.1],
                                                 [1, 1, 0.1, 0.1]]) + deltas, rtol=1e-5)
    np.testing.assert_allclose(t.lookup(keys).numpy(), full()[:, :2], rtol=1e-6)
    before = full()
    with pytest.raises(ValueError, match=r"deltas.*\[dim=4\]"):
        t.accumulate(keys, [[1, 2]] * 3, with_slots=True)
    with pytest.raises(ValueError, match=r"with_slots adds every delta whole; "
                                         r"combine='scaled' is not supported"):
        t.accumulate(keys, deltas, skip_reader=1, combine="scaled", with_slots=True)
    np.testing.assert_array_equal(full(), before)


def test_a_shard_takes_rows_whole_with_their_slots():
    """insert(with_slots) writes [value | slots] exactly, a present key's and a new one's
    (what a GEO copy takes from the PS under shared slots); a row of the wrong width is
    refused and changes nothing."""
    t = table(dim=2, shards=1, initializer=E.constant(1.0),
              optimizer=E.Adagrad(0.1, initial_accumulator_value=0.1))
    shard, step = t.shards[0], tf.constant(0, tf.int64)
    keys = tf.constant([4, 7], tf.int64)
    t.apply(keys[:1], [[0.5, -1.0]])  # key 4 present, with its own accumulator
    rows = np.array([[3, -3, 0.75, 2.5], [1e-7, 7, 0, 9]], np.float32)
    shard.insert(keys, rows, step, with_slots=True)
    np.testing.assert_array_equal(shard.find(keys, with_slots=True)[0].numpy(), rows)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"values must have shape \[2,4\] \(keys' shape \+ \[dim \* "
                             r"\(1 \+ num_slots\) = 2 \* 2\]\), got \[2,2\]"):
        shard.insert(keys, rows[:, :2] + 1, step, with_slots=True)
    np.testing.assert_array_equal(shard.find(keys, with_slots=True)[0].numpy(), rows)


def _dense_reference(tf_optimizer, init, grads_per_step):
    """The same update by TF's own optimizer on a dense variable."""
    with tf.Graph().as_default():
        var = tf.compat.v1.get_variable("v", initializer=tf.constant(init), use_resource=True)
        grad = tf.compat.v1.placeholder(tf.float32, init.shape)
        apply = tf_optimizer().apply_gradients([(grad, var)])
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for g in grads_per_step:
                sess.run(apply, {grad: g})
            return sess.run(var)


@pytest.mark.parametrize("ours,theirs", [
    (lambda: E.SGD(0.1), lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1)),
    (lambda: E.Adagrad(0.1, 0.1), lambda: tf.compat.v1.train.AdagradOptimizer(0.1, 0.1)),
    (lambda: E.Adam(0.01, 0.9, 0.999, 1e-8),
     lambda: tf.compat.v1.train.AdamOptimizer(0.01, 0.9, 0.999, 1e-8)),
    (lambda: E.Ftrl(0.1, -0.5, 0.01, 0.02, 0.1),
     lambda: tf.compat.v1.train.FtrlOptimizer(0.1, -0.5, 0.1, 0.01, 0.02)),
], ids=["sgd", "adagrad", "adam", "ftrl"])
def test_server_side_optimizers_match_tf(ours, theirs):
    rng = np.random.default_rng(0)
    keys = np.array([3, 11, 42], np.int64)
    t = table(dim=5, optimizer=ours(), shards=2)
    init = t.lookup(keys, train=True).numpy()
    grads = [rng.normal(size=(3, 5)).astype(np.float32) for _ in range(3)]
    for step, g in enumerate(grads, start=1):
        looked = t.lookup_unique(keys)
        t.apply_gradients(looked, g, step=step)
    ours_rows = t.lookup(keys).numpy()
    np.testing.assert_allclose(ours_rows, _dense_reference(theirs, init, grads), rtol=2e-5, atol=2e-6)


def test_graph_mode_training_lowers_the_loss():
    target = np.random.default_rng(1).normal(size=(50, 3)).astype(np.float32)
    with tf.Graph().as_default():
        emb = table(dim=3, optimizer=E.Adagrad(0.5), shards=2)
        ids = tf.compat.v1.placeholder(tf.int64, [None])
        goal = tf.compat.v1.placeholder(tf.float32, [None, 3])
        step = tf.compat.v1.placeholder(tf.int64, [])
        looked = emb.lookup_unique(ids, step=step)
        loss = tf.reduce_mean((looked.embeddings - goal) ** 2)
        train = emb.minimize(loss, [looked], step=step)
        with tf.compat.v1.Session() as sess:
            feed = {ids: np.arange(50), goal: target}
            first = sess.run(loss, {**feed, step: 0})
            for s in range(1, 60):
                sess.run(train, {**feed, step: s})
            assert sess.run(loss, {**feed, step: 60}) < first * 0.2
            assert sess.run(emb.size()) == 50


@pytest.mark.heavy
def test_tf_function_training():
    emb = table(dim=2, optimizer=E.SGD(0.1))

    @tf.function
    def train_step(ids, step):
        with tf.GradientTape() as tape:
            looked = emb.lookup_unique(ids, step=step, tape=tape)
            loss = tf.reduce_sum((looked.embeddings - 1.0) ** 2)
        emb.apply_gradients(looked, tape.gradient(loss, looked.unique_rows), step=step)
        return loss

    ids = tf.constant([1, 2, 2, 3], tf.int64)
    losses = [float(train_step(ids, tf.constant(s, tf.int64))) for s in range(20)]
    assert losses[-1] < losses[0] * 0.01


def test_checkpoint_round_trip_bit_exact_with_resharding(tmp_path):
    a = table(dim=3, optimizer=E.Adam(0.01), shards=2)
    ids = tf.constant(np.arange(-20, 30), tf.int64)
    for step in range(1, 4):
        looked = a.lookup_unique(ids, step=step)
        a.apply_gradients(looked, tf.ones_like(looked.unique_rows), step=step)
    path = tf.train.Checkpoint(table=a).save(str(tmp_path / "ckpt"))
    b = table(dim=3, optimizer=E.Adam(0.01), shards=3)
    b.lookup([1000], train=True)  # restore replaces, it does not merge
    tf.train.Checkpoint(table=b).restore(path).assert_consumed()
    want, got = sorted_export(a), sorted_export(b)
    for key in want:
        assert want[key].tobytes() == got[key].tobytes(), key


def test_saver_round_trip(tmp_path):
    name = f"saved{next(_names)}"
    with tf.Graph().as_default():
        a = E.DynamicTable(name, 2, optimizer=E.Adagrad(0.1), devices=[None, None])
        train = a.apply_gradients(a.lookup_unique([1, 2, 3]), tf.ones([3, 2]), step=5)
        saver = tf.compat.v1.train.Saver()  # the default saver finds the table itself
        with tf.compat.v1.Session() as sess:
            sess.run(train)
            want = sess.run(a.export())
            path = saver.save(sess, str(tmp_path / "model"))
    assert f"{name}-values" in dict(tf.train.list_variables(path))
    with tf.Graph().as_default():
        b = E.DynamicTable(name, 2, optimizer=E.Adagrad(0.1), devices=[None] * 3)
        b.handles()
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session() as sess:
            saver.restore(sess, path)
            got = sess.run(b.export())
    order_w, order_g = np.argsort(want["keys"]), np.argsort(got["keys"])
    for key in want:
        np.testing.assert_array_equal(want[key][order_w], got[key][order_g])


def test_admission_and_eviction_counts():
    t = table(dim=2, min_frequency=3, optimizer=E.SGD(0.1))
    for _ in range(2):
        t.lookup([1, 2], train=True)
    stats = {k: int(v) for k, v in t.stats().items()}
    assert (stats["size"], stats["admitted"], stats["pending_admission"]) == (0, 0, 2)
    init = t.lookup([1]).numpy()
    t.apply_gradients(t.lookup_unique([1, 2], train=False), tf.ones([2, 2]))  # not admitted: no row
    assert int(t.size()) == 0
    t.lookup([1], train=True)  # third sighting of key 1
    np.testing.assert_array_equal(t.lookup([1]), init)
    assert [int(t.stats()[k]) for k in ("size", "admitted", "evicted", "pending_admission")] \
        == [1, 1, 0, 1]

    u = table(dim=2)
    u.insert(np.arange(100), np.ones((100, 2)), step=1)
    u.insert(np.arange(100, 150), np.ones((50, 2)), step=9)
    assert int(u.evict(min_step=5)) == 100
    for _ in range(3):
        u.lookup(np.arange(140, 150), train=True)
    assert int(u.evict(keep_top_n=10)) == 40
    np.testing.assert_array_equal(np.sort(u.export()["keys"].numpy()), np.arange(140, 150))
    assert int(u.stats()["evicted"]) == 140


def test_concurrent_lookups_and_updates():
    t = table(dim=4, shards=2, initializer=E.zeros())
    errors = []

    def worker(w):
        try:
            for i in range(30):
                t.accumulate(np.arange(100), np.ones((100, 4)), step=i)
                t.lookup(np.arange(w * 1000, w * 1000 + 200), train=True)
                t.lookup(np.arange(100))
        except Exception as e:  # reported below: a thread's failure must fail the test
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(1, 5)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors
    assert int(t.size()) == 100 + 4 * 200 - 0  # keys 0..99 and each thread's 200
    np.testing.assert_array_equal(t.lookup(np.arange(100)), np.full((100, 4), 4 * 30.0))


def test_capacity_reserves_rows_up_front():
    # 2 shards, 3000 rows each reserved: the index and the row memory of the first 6000
    # keys exist before any key does, so inserting them grows nothing.
    t = table(dim=4, shards=2, capacity=6000)
    reserved = int(t.stats()["bytes_reserved"])
    assert reserved >= 6000 * (20 + 4 * 4)  # at least the rows' records [key|step|freq|row]
    keys = np.arange(6000, dtype=np.int64) * 7919
    rows = np.arange(6000 * 4, dtype=np.float32).reshape(6000, 4)
    t.insert(keys, rows)
    stats = {k: int(v) for k, v in t.stats().items()}
    assert stats["size"] == 6000 and stats["bytes_reserved"] == reserved
    assert stats["bytes_used"] >= 6000 * (20 + 4 * 4)  # the records now hold rows
    np.testing.assert_array_equal(t.lookup(keys), rows)
    t.insert(-keys[1:], rows[1:])  # past the reservation the table grows as any other
    assert int(t.size()) == 11999 and int(t.stats()["bytes_reserved"]) > reserved
    np.testing.assert_array_equal(t.lookup(keys), rows)


_RESERVE_BEYOND_MEMORY = """
import resource
import tensorflow as tf
from tfpsx import embedding as E
E.DynamicTable("warm", 2).lookup([1])  # TF's threads and the op library are up
with open("/proc/self/status") as f:
    vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.RLIM_INFINITY))
try:
    E.DynamicTable("big", 16, capacity=100_000_000).lookup([1])
except tf.errors.ResourceExhaustedError as e:
    print("ERROR:", e.message)
"""


@pytest.mark.heavy
def test_capacity_beyond_memory_is_a_clear_error():
    # 100M rows (~9 GiB) in a process allowed 1 GiB more address space: the table is not
    # created, and the error says which table, what it reserved and why it failed.
    out = subprocess.run([sys.executable, "-c", _RESERVE_BEYOND_MEMORY], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.search(r"ERROR: .*tfpsx table 'big/part_0' with capacity=100000000: reserving "
                     r"100000000 rows \(\d+ MiB\) failed", out.stdout), out.stdout + out.stderr[-2000:]


def test_bad_inputs_are_clear():
    with pytest.raises(ValueError, match="capacity must be None or an int >= 0.*got -5"):
        E.DynamicTable("cap", 2, capacity=-5)
    with pytest.raises(tf.errors.InvalidArgumentError, match="capacity must be in 0..1073741696"):
        E.DynamicTable(f"hugecap{next(_names)}", 2, capacity=2 ** 40).lookup([1])
    with pytest.raises(TypeError, match="ids must be integers.*float32"):
        table().lookup(tf.constant([1.5]))
    with pytest.raises(ValueError, match="dim must be a positive int, got -2"):
        E.DynamicTable("neg", -2)
    with pytest.raises(ValueError, match="unknown optimizer 'rmsprop'.*sgd, adagrad, adam, ftrl"):
        E.DynamicTable("opt", 2, optimizer="rmsprop")
    name = f"reused{next(_names)}"
    E.DynamicTable(name, 4).lookup([1], train=True)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=f"'{name}/part_0' already exists on this device with dim=4.*dim=8"):
        E.DynamicTable(name, 8).lookup([1], train=True)
    t = table(dim=3)
    bad = {"keys": tf.constant([1, 2], tf.int64), "values": tf.zeros([2, 5]),
           "slots": tf.zeros([2, 0, 5]), "freq": tf.zeros([2], tf.int64), "step": tf.zeros([2], tf.int64)}
    with pytest.raises(ValueError, match=r"'t\d+': import_rows: values must have shape "
                                         r"\[n=2, dim=3\], got \[2, 5\]"):
        t.import_rows(bad)
    with pytest.raises(ValueError, match="has no optimizer"):
        t.apply_gradients(t.lookup_unique([1]), tf.ones([1, 3]))
    sgd_table = table(dim=2, optimizer=E.SGD())
    ops = tfpsx.load_ops()
    with pytest.raises(tf.errors.InvalidArgumentError, match="has 0 optimizer slot.*needs 1"):
        ops.tfpsx_hash_table_apply_adagrad(sgd_table.handles()[0], tf.constant([1], tf.int64),
                                           tf.ones([1, 2]), 0.1, 0.0, tf.constant(0, tf.int64))


class _RecordingStorage(E.storage.HashTableStorage):
    """A backend's shard that records which storage operations ran (the seam under test)."""

    def __init__(self, spec, device, log):
        super().__init__(spec, device)
        self._log = log

    def _run(self, op, *args, **kwargs):
        self._log.append((self.spec.shared_name, op.__name__))
        return super()._run(op, *args, **kwargs)


class _RecordingBackend(E.Backend):
    def __init__(self):
        self.log = []

    def create(self, spec, device):
        return _RecordingStorage(spec, device, self.log)


def test_a_backend_serves_every_operation_of_its_tables():
    backend = _RecordingBackend()
    t = table(dim=2, shards=2, optimizer=E.SGD(0.5), backend=backend)
    looked = t.lookup_unique([3, 4, 3])
    t.apply_gradients(looked, tf.ones([2, 2]))
    t.accumulate([5], [[1.0, 1.0]])
    rows = sorted_export(t)
    assert sorted(rows["keys"]) == [3, 4, 5]
    ops = {(name.rsplit("/", 1)[1], op) for name, op in backend.log}
    for shard in ("part_0", "part_1"):
        for op in ("table_find_or_insert", "table_apply", "table_export"):
            assert (shard, op) in ops, (shard, op, sorted(ops))
    assert ("part_1", "table_accumulate") in ops  # key 5 lives on shard 5 mod 2 = 1


def test_an_updater_decides_where_gradients_go():
    seen = []

    class Recording(E.TableUpdater):
        def apply_gradients(self, table, keys, grads, step):
            seen.append((table.name, keys.numpy().tolist(), grads.numpy().tolist()))

    with E.updater_scope(lambda table: Recording()):
        t = table(dim=1, optimizer=E.SGD(1.0))
    looked = t.lookup_unique([7, 7, 9])
    t.apply_gradients(looked, tf.constant([[1.0], [2.0]]))
    assert seen == [(t.name, [7, 9], [[1.0], [2.0]])]
    before = t.lookup([7, 9]).numpy()
    np.testing.assert_array_equal(t.lookup([7, 9]), before)  # nothing was applied
    outside = table(dim=1, optimizer=E.SGD(1.0))  # the scope has ended: the default
    assert type(outside.updater) is E.TableUpdater


def test_the_table_and_the_keras_layer_have_distinct_names():
    """A traceback names the table (DynamicTable) or the Keras layer (DynamicEmbedding);
    the table's former name still works, with a DeprecationWarning."""
    import tfpsx
    assert E.DynamicTable.__name__ == "DynamicTable"
    assert tfpsx.keras.DynamicEmbedding.__name__ == "DynamicEmbedding"
    with pytest.warns(DeprecationWarning, match="now tfpsx.embedding.DynamicTable"):
        assert tfpsx.embedding.DynamicEmbedding is E.DynamicTable
    with pytest.raises(AttributeError, match="no attribute 'Dynamic'"):
        tfpsx.embedding.Dynamic  # noqa: B018

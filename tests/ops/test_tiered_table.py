"""Tables larger than RAM (tfpsx.embedding.TieredBackend) in one process, graph mode: a
tiered table trained, evicted, removed from and checkpointed holds exactly the rows of
the same table in RAM, within its RAM budget, with most rows on disk; prefetches racing
the steps change no row; a restore from its incremental checkpoints is bit-exact; bad
input is a clear error that changes nothing."""

import concurrent.futures
import contextlib
import os

import numpy as np
import pytest
import tensorflow as tf

from tfpsx import embedding as E
from tfpsx.checkpoint import IncrementalSaver
from tfpsx.ops import bindings

_names = iter(range(10 ** 6))
DIM = 8
RAM = 1_600_000          # per shard: a few thousand rows of 84 bytes in RAM
UNIVERSE = 2_000_000     # see ids()


class Model:
    """One table (2 shards, Adagrad), trained from fed ids, with eviction, removal,
    export and an incremental saver: the operations a training job runs on a table."""

    def __init__(self, prefix, backend=None, full_every=4):
        self.step = tf.compat.v1.train.get_or_create_global_step()
        self.table = E.DynamicTable(f"{prefix}t", DIM, optimizer=E.Adagrad(0.1),
                                    initializer=E.normal(stddev=0.1), devices=[None, None],
                                    backend=backend)
        self.ids = tf.compat.v1.placeholder(tf.int64, [None])
        looked = self.table.lookup_unique(self.ids, step=self.step)
        grads = 0.01 * tf.sin(looked.unique_rows * 7.0)
        with tf.control_dependencies([self.table.apply_gradients(looked, grads, step=self.step)]):
            self.train = self.step.assign_add(1)
        self.read = self.table.lookup(self.ids)  # an evaluation's: trains nothing
        self.ahead = tf.compat.v1.placeholder(tf.int64, [None])
        # (A table in RAM without a worker cache has nothing to prefetch: an error.)
        self.prefetch = self.table.prefetch(self.ahead) if backend else tf.constant(0, tf.int64)
        self.prefetched = 0
        self.min_step = tf.compat.v1.placeholder(tf.int64, [])
        self.evict = self.table.evict(min_step=self.min_step)
        self.remove = self.table.remove(self.ids)
        self.export = self.table.export()
        self.size = self.table.stats()["size"]
        self.tier = [s.tier_stats() for s in self.table.shards] if backend else []
        self.saver = IncrementalSaver(full_every=full_every, max_to_keep=10)
        self.saves = []

    def rows(self, sess):
        got = sess.run(self.export)
        order = np.argsort(got["keys"], kind="stable")
        return {f: v[order].tobytes() for f, v in got.items()}

    def tier_stats(self, sess):
        return [dict(zip(bindings.TIER_STATS_FIELDS, s)) for s in sess.run(self.tier)]


def ids(rng, n):
    """Half log-uniform (a hot head), half uniform (new ids every step)."""
    head = np.exp(rng.random(n - n // 2) * np.log(UNIVERSE)).astype(np.int64) - 1
    return np.concatenate([head, rng.integers(0, UNIVERSE, n // 2)]) * 2654435761


def drive(model, sess, seed, rounds, directory=None):
    """Trains in rounds with evictions and removals between; saves after each round when
    ``directory``. Returns [(rows, checkpoint path)] per round."""
    rng, reads = np.random.default_rng(seed), np.random.default_rng(seed + 1)
    out = []
    for round_ in range(rounds):
        batches = [ids(rng, 3000) for _ in range(8)]
        # Each batch's disk rows asked for while the one before trains (another thread,
        # as an input pipeline would): value-neutral, whatever the interleaving.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            for i, batch in enumerate(batches):
                coming = (pool.submit(sess.run, model.prefetch, {model.ahead: batches[i + 1]})
                          if i + 1 < len(batches) else None)
                sess.run(model.train, {model.ids: batch})
                if coming is not None:
                    model.prefetched += coming.result()
        sess.run(model.remove, {model.ids: ids(rng, 500)})
        if round_ % 2 == 1:
            sess.run(model.evict, {model.min_step: 8 * round_ - 12})
        path = None
        if directory:
            path = model.saver.save(sess, os.path.join(directory, "model"),
                                    global_step=model.step)
            model.saves.append(dict(model.saver.last_save))
        rows = model.rows(sess)
        # A read of more rows than the budget's room for one batch: the rows on disk
        # are read where they are.
        rows["read"] = sess.run(model.read, {model.ids: ids(reads, 40_000)}).tobytes()
        out.append((rows, path))
    return out


def run_model(prefix, backend, seed, rounds, directory=None, inspect=None):
    with tf.Graph().as_default():
        model = Model(prefix, backend)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            out = drive(model, sess, seed, rounds, directory)
            if inspect:
                inspect(model, sess)
    return out


def test_a_tiered_table_holds_the_rows_of_the_same_table_in_ram_and_restores_exactly(tmp_path):
    seen = {}

    def inspect(model, sess):
        seen["tier"] = model.tier_stats(sess)
        seen["size"] = sess.run(model.size)
        seen["saves"] = model.saves
        seen["prefetched"] = model.prefetched

    backend = E.TieredBackend(str(tmp_path / "tier"), ram_bytes=RAM)
    prefix = f"tier{next(_names)}"
    tiered = run_model(prefix, backend, 11, 4, str(tmp_path / "ckpt"), inspect)
    in_ram = run_model(prefix, None, 11, 4)
    assert seen["prefetched"] > 0  # prefetches brought rows back (0 on a table in RAM)
    for round_, ((got, _), (want, _)) in enumerate(zip(tiered, in_ram)):
        assert got == want, f"round {round_}: the tiered table's rows differ from RAM's"
    # Most rows live on disk, RAM stays within the budget, and they came back from it.
    rows = len(in_ram[-1][0]["keys"]) // 8
    assert seen["size"] == rows
    for shard in seen["tier"]:
        assert shard["ram_bytes"] <= RAM, shard
        assert shard["disk_rows"] > rows // 4, shard  # of the 2 shards' rows: most
        assert shard["rows_faulted"] > 0 and shard["read_calls"] > 0, shard
        assert shard["bytes_written"] <= 3 * shard["bytes_spilled"], shard
    for name in os.listdir(tmp_path / "tier"):
        assert sorted(os.listdir(tmp_path / "tier" / name)) == ["part_0", "part_1"]
    # The first save is a full part, read from the shards in pages of a 32nd of RAM's
    # rows (so neither the servers nor the saver held the table at once); the last is a
    # delta over it. Each restored into a fresh tiered table (in pages too) and into one
    # in RAM (a session of its own: the tables of a restarted job), bit-exact.
    first, last = seen["saves"][0], seen["saves"][-1]
    assert first["kind"] == "full" and first["pages"] > 20, first
    assert first["rows"] == len(tiered[0][0]["keys"]) // 8
    assert last["kind"] == "delta" and last["pages"] > 2, last  # a delta in pages too
    for (want, path) in (tiered[0], tiered[-1]):
        want = dict(want)
        del want["read"]
        for restore_backend in (E.TieredBackend(str(tmp_path / "tier"), ram_bytes=RAM), None):
            with tf.Graph().as_default():
                model = Model(prefix, restore_backend)
                with tf.compat.v1.Session() as sess:
                    sess.run(tf.compat.v1.global_variables_initializer())
                    sess.run(model.train, {model.ids: [10 ** 12, 10 ** 12 + 1]})  # replaced
                    model.saver.restore(sess, path)
                    assert model.rows(sess) == want
                    if restore_backend:
                        stats = model.tier_stats(sess)
                        assert all(s["disk_rows"] > 0 and s["ram_bytes"] <= RAM
                                   for s in stats), stats


def test_bad_tier_input_is_a_clear_error_and_any_batch_fits(tmp_path):
    with pytest.raises(ValueError, match="directory must be a non-empty path"):
        E.TieredBackend("", ram_bytes=RAM)
    with pytest.raises(ValueError, match="ram_bytes must be a positive int.*got 0"):
        E.TieredBackend(str(tmp_path), ram_bytes=0)
    with tf.Graph().as_default():
        small = E.DynamicTable(f"tier{next(_names)}", DIM, optimizer=E.Adagrad(0.1),
                               backend=E.TieredBackend(str(tmp_path), ram_bytes=100_000))
        blocked = tmp_path / "file"
        blocked.write_text("not a folder")
        unwritable = E.DynamicTable(f"tier{next(_names)}", DIM,
                                    backend=E.TieredBackend(str(blocked), ram_bytes=RAM))
        ok = E.DynamicTable(f"tier{next(_names)}", DIM, optimizer=E.Adagrad(0.1),
                            backend=E.TieredBackend(str(tmp_path / "ok"), ram_bytes=RAM))
        feed = tf.compat.v1.placeholder(tf.int64, [None])
        big = ok.lookup(feed, train=True)
        size = ok.stats()["size"]
        with tf.compat.v1.Session() as sess:
            with pytest.raises(tf.errors.InvalidArgumentError,
                               match=r"ram_bytes=100000 is below .* needs at least: \d+"):
                sess.run(small.stats())
            with pytest.raises(tf.errors.FailedPreconditionError, match=str(blocked)):
                sess.run(unwritable.stats())
            # One batch of more new rows than fit above the high-water mark (a GEO
            # round's push is K batches): it goes in pieces, within the budget.
            assert sess.run(size) == 0
            assert sess.run(big, {feed: np.arange(40_000)}).shape == (40_000, DIM)
            assert sess.run(size) == 40_000
            assert sess.run(ok.tier_stats()["ram_bytes"]) <= RAM
    with pytest.raises(ValueError, match="cannot hold a worker cache"):
        ok.shards[0].cache_find(tf.constant([1], tf.int64), 0)


def test_a_keras_model_fits_saves_and_loads_with_a_tiered_table(tmp_path):
    import keras

    import tfpsx
    import tfpsx.keras

    backend = E.TieredBackend(str(tmp_path / "tier"), ram_bytes=RAM)
    emb = tfpsx.keras.DynamicEmbedding(DIM, table_name=f"tier{next(_names)}", backend=backend,
                                       optimizer=E.Adagrad(0.1), combiner="mean")
    inputs = keras.Input((4,), dtype="int64")
    model = keras.Model(inputs, keras.layers.Dense(1)(emb(inputs)))
    model.compile("adam", "mse")
    rng = np.random.default_rng(4)
    x = ids(rng, 4 * 16_000).reshape(-1, 4)
    y = (x[:, :1] % 3).astype(np.float32)
    model.fit(x, y, batch_size=400, epochs=1, verbose=0)
    stats = dict(zip(bindings.TIER_STATS_FIELDS, emb.table.shards[0].tier_stats().numpy()))
    assert stats["disk_rows"] > int(emb.table.size()) // 2, stats
    assert stats["ram_bytes"] <= RAM, stats
    assert emb.get_config()["backend"] == {"directory": str(tmp_path / "tier"), "ram_bytes": RAM}
    path = str(tmp_path / "m.keras")
    with pytest.raises(ValueError, match=rf"model.save / save_weights would take table "
                                         rf"'{emb.table.name}' whole.*IncrementalCheckpoint"):
        model.save(path)  # TF's own saver would hold the table whole in RAM: refused
    with E.whole_table_saves():  # it fits: saved whole, as asked
        model.save(path)
    want = model.predict(x[:512], verbose=0)
    # The loaded model must read its rows from the file, not from the live table (the
    # same shared name in this process would be the same resource): the table is gone.
    for shard in emb.table.shards:
        tf.raw_ops.DestroyResourceOp(resource=shard.handle(), ignore_lookup_error=False)
    loaded = keras.models.load_model(path)
    twin = loaded.layers[1]
    assert isinstance(twin.backend, E.TieredBackend) and twin.backend.ram_bytes == RAM
    assert int(twin.table.size()) > 0
    np.testing.assert_allclose(loaded.predict(x[:512], verbose=0), want, rtol=1e-6, atol=1e-6)
    # (model's table is the loaded one now: the same names in one process)
    # An incremental checkpoint's full part is read in pages too, and restores in pages.
    ckpt = tfpsx.keras.IncrementalCheckpoint(str(tmp_path / "ckpt"))
    ckpt.save(model)
    assert ckpt.last_save["kind"] == "full" and ckpt.last_save["pages"] > 10, ckpt.last_save
    assert ckpt.last_save["rows"] == int(emb.table.size())
    model.fit(x[:4000], y[:4000], batch_size=400, epochs=1, verbose=0)
    ckpt.save(model)  # a delta, in pages too
    assert ckpt.last_save["kind"] == "delta" and ckpt.last_save["pages"] >= 1, ckpt.last_save
    assert 0 < ckpt.last_save["rows"] < int(emb.table.size())
    want = model.predict(x[:512], verbose=0)
    loaded.layers[1].table.insert(np.array([7, 8]), np.ones([2, DIM]))  # replaced
    loaded.layers[1].table.remove(np.unique(x[:512, :2]))  # rows the predictions read
    assert not np.array_equal(loaded.predict(x[:512], verbose=0), want)
    ckpt.restore(loaded)
    np.testing.assert_array_equal(loaded.predict(x[:512], verbose=0), want)
    # The serving export reads the shard in pages (a 32nd of RAM's rows each), moving no
    # row back to RAM; the SavedModel serves what the model predicts.
    def tier():
        return dict(zip(bindings.TIER_STATS_FIELDS, emb.table.shards[0].tier_stats().numpy()))

    before = tier()
    served = tf.saved_model.load(tfpsx.export_serving(model, str(tmp_path / "served")))
    after = tier()
    assert after["rows_faulted"] == before["rows_faulted"] and after["ram_bytes"] <= RAM
    out = served.signatures["serving_default"](tf.constant(x[:512]))
    np.testing.assert_allclose(next(iter(out.values())).numpy(),
                               model.predict(x[:512], verbose=0), rtol=1e-6, atol=1e-6)


def test_pages_hold_the_extreme_keys_and_an_empty_table_saves_as_one_page(tmp_path):
    """The pages' key ranges cover every int64 (the first from the minimum, the last to
    the maximum), and a tiered table with no row saves and restores as one empty page."""
    prefix = f"edge{next(_names)}"
    keys = np.concatenate([[np.iinfo(np.int64).min, -1, 0, np.iinfo(np.int64).max],
                           np.arange(1, 8001) * 2654435761 * 1000003])  # both signs
    with tf.Graph().as_default():
        full = E.DynamicTable(f"{prefix}f", DIM, backend=E.TieredBackend(
            str(tmp_path / "tier"), ram_bytes=RAM))
        empty = E.DynamicTable(f"{prefix}e", DIM, backend=E.TieredBackend(
            str(tmp_path / "tier"), ram_bytes=RAM))
        fill = full.insert(keys, np.arange(len(keys) * DIM, dtype=np.float32).reshape(-1, DIM))
        exports = {t.name: t.export() for t in (full, empty)}
        tf.compat.v1.train.get_or_create_global_step()  # TF's part of the checkpoint
        saver = IncrementalSaver(full_every=1)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(fill)
            want = sess.run(exports)
            path = saver.save(sess, str(tmp_path / "ckpt" / "m"), global_step=1)
            assert saver.last_save["pages"] > 5 and saver.last_save["rows"] == len(keys)
    with tf.Graph().as_default():
        twins = [E.DynamicTable(f"{prefix}{s}", DIM) for s in "fe"]  # in RAM, restored
        exports = {t.name: t.export() for t in twins}
        tf.compat.v1.train.get_or_create_global_step()
        saver = IncrementalSaver(full_every=1)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            saver.restore(sess, path)
            got = sess.run(exports)
    for name in want:
        for field in want[name]:
            np.testing.assert_array_equal(got[name][field], want[name][field])
    assert len(got[f"{prefix}e"]["keys"]) == 0


def test_whole_saves_of_a_tiered_table_are_refused_before_anything_is_written(tmp_path):
    """TF's own savers take a table whole in RAM: for a tiered table (larger than RAM) an
    out-of-memory kill, not a save. tf.train.Checkpoint and a plain TF1 Saver refuse it
    naming the savers that read it in pages, writing nothing; within
    whole_table_saves() both save it whole."""
    rows = {"keys": np.arange(1, 301) * 7919, "values": np.ones([300, DIM], np.float32)}
    table = E.DynamicTable(f"whole{next(_names)}", DIM, backend=E.TieredBackend(
        str(tmp_path / "tier"), ram_bytes=RAM))
    table.insert(rows["keys"], rows["values"])
    with pytest.raises(ValueError, match=rf"tf.train.Checkpoint would take table "
                                         rf"'{table.name}' whole.*IncrementalSaver"):
        tf.train.Checkpoint(table=table).write(str(tmp_path / "tf2" / "ckpt"))
    assert not os.listdir(tmp_path / "tf2") if os.path.exists(tmp_path / "tf2") else True
    with E.whole_table_saves():
        tf.train.Checkpoint(table=table).write(str(tmp_path / "tf2ok" / "ckpt"))
    assert tf.train.latest_checkpoint(str(tmp_path / "tf2ok")) is None  # (write: no index)
    assert os.listdir(tmp_path / "tf2ok")
    for allowed in (False, True):  # a TF1 graph's tables built within it, or not
        with tf.Graph().as_default(), (E.whole_table_saves() if allowed
                                       else contextlib.nullcontext()):
            t = E.DynamicTable(f"whole{next(_names)}", DIM, backend=E.TieredBackend(
                str(tmp_path / "tier"), ram_bytes=RAM))
            fill = t.insert(rows["keys"], rows["values"])
            saver = tf.compat.v1.train.Saver()
            folder = str(tmp_path / f"tf1{allowed}")
            with tf.compat.v1.Session() as sess:
                sess.run(fill)
                if allowed:
                    saver.save(sess, os.path.join(folder, "m"))
                    assert tf.train.latest_checkpoint(folder)
                    continue
                with pytest.raises(tf.errors.InvalidArgumentError,
                                   match=r"a tf.compat.v1.train.Saver would take table .* "
                                         r"whole.*IncrementalSaver"):
                    saver.save(sess, os.path.join(folder, "m"))
                assert tf.train.latest_checkpoint(folder) is None

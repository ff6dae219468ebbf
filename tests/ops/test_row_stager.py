"""Graph mode's RowStager (tfpsx.training.staging), in one process: a local table's worker
cache staged one batch ahead by the stager's thread while the steps run."""

import time

import numpy as np
import pytest
import tensorflow as tf

import tfpsx
from tfpsx import embedding as E
from tfpsx.training.hooks import WorkerCacheHook

DIM, LR, VOCAB, BATCH, STEPS = 3, 0.1, 40, 6, 60
_names = iter(range(10 ** 6))


def batches(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=BATCH) for _ in range(STEPS)]


def model(cache_size=None, staged=True, global_step=None):
    """A table (SGD: no slots, so a cache's rows train exactly as the table's), the
    stager (counting steps into ``global_step`` if given), and one step:
    mean((row - target(id))^2)."""
    table = E.DynamicTable(f"t{next(_names)}", DIM, optimizer=E.SGD(LR), devices=[None],
                           initializer=E.normal(stddev=0.1), seed=3,
                           **({"cache_size": cache_size, "flush_steps": 7}
                              if cache_size else {}))
    stager = (tfpsx.RowStager([table], global_step=global_step)
              if cache_size and staged else None)
    ids = tf.compat.v1.placeholder(tf.int64, [None])
    looked = table.lookup_unique(ids)
    keys = tf.cast(ids, tf.float32)
    target = tf.stack([keys / 50.0, -keys / 80.0, tf.sin(keys)], axis=-1)
    loss = tf.reduce_mean(tf.square(looked.embeddings - target))
    train = table.minimize(loss, [looked])
    table.export_op = E.ShardedTable.export(table)  # the table's own rows, not the cache's
    return table, stager, ids, train


def reference_rows(data):
    """The rows the table itself (no cache) trains on ``data``, by key."""
    with tf.Graph().as_default():
        table, _, ids, train = model()
        with tf.compat.v1.train.MonitoredSession() as sess:
            for b in data:
                sess.run(train, {ids: b})
            return rows_of(table, sess._tf_sess())


def rows_of(table, session):
    rows = session.run(table.export_op)
    return dict(zip(rows["keys"].tolist(), rows["values"]))


class _ReadAtEnd(tf.compat.v1.train.SessionRunHook):
    """Runs ``fetches`` in the session's last moment (after the hooks before it)."""

    def __init__(self, fetches):
        self.fetches, self.got = fetches, None

    def end(self, session):
        self.got = session.run(self.fetches)


def test_a_staged_cache_trains_as_the_table_itself():
    data = batches()
    want = reference_rows(data)
    with tf.Graph().as_default():
        table, stager, ids, train = model(cache_size=8)
        # What tfpsx.MonitoredTrainingSession adds: the stager, then the caches' hook
        # (its end: the final flush); then a read of the table's rows.
        final = _ReadAtEnd({"rows": table.export_op, "stats": table.cache.stats()})
        with tf.compat.v1.train.MonitoredSession(
                hooks=[stager, WorkerCacheHook(), final]) as sess:
            pending = stager.stage({table: data[0]})
            for i, b in enumerate(data):
                pending.result()
                if i + 1 < len(data):
                    pending = stager.stage({table: data[i + 1]})
                sess.run(train, {ids: b})
    rows, counters = final.got["rows"], final.got["stats"]
    got = dict(zip(rows["keys"].tolist(), rows["values"]))
    assert sorted(got) == sorted(want)
    for key, row in want.items():
        np.testing.assert_allclose(got[key], row, rtol=1e-5, atol=1e-6, err_msg=f"key {key}")
    # Every row a step used was staged (none fetched by a step); the cache evicted (its
    # 8 rows < the 3 batches kept). (Its syncs: at least the final flush here, since the
    # flusher's may merge; the next test sees the flusher's during the session.)
    assert counters["prefetched"] == counters["rows_fetched"] > 0, counters
    assert counters["evictions"] > 0 and counters["flushes"] >= 1, counters


def test_several_batches_per_staging_the_syncs_beside_and_the_steps_counted():
    """Groups of 4 batches staged per run; the syncs run in the stager's flusher thread
    during the steps; the stager, not the step, advances global_step: by the end, once
    per step trained."""
    data, group = batches(seed=1), 4
    want = reference_rows(data)
    with tf.Graph().as_default():
        step = tf.compat.v1.train.get_or_create_global_step()
        table, stager, ids, train = model(cache_size=VOCAB, global_step=step)
        stats = table.cache.stats()
        final = _ReadAtEnd({"rows": table.export_op, "step": step})
        with tf.compat.v1.train.MonitoredSession(
                hooks=[stager, WorkerCacheHook(), final]) as sess:

            def stage(i):
                return stager.stage({table: np.concatenate(data[i:i + group])},
                                    batches=len(data[i:i + group]))

            pending = stage(0)
            for i, b in enumerate(data):
                if i % group == 0:
                    pending.result()
                    pending = stage(i + group) if i + group < len(data) else pending
                sess.run(train, {ids: b})
            # The flusher synced while the session ran (not only the final flush).
            deadline = time.monotonic() + 30
            while sess.run(stats)["flushes"] == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert sess.run(stats)["flushes"] > 0
            with pytest.raises(ValueError, match="batches must be an int >= 1, got 0"):
                stager.stage({table: data[0]}, batches=0)
    got = dict(zip(final.got["rows"]["keys"].tolist(), final.got["rows"]["values"]))
    assert sorted(got) == sorted(want)
    for key, row in want.items():
        np.testing.assert_allclose(got[key], row, rtol=1e-5, atol=1e-6, err_msg=f"key {key}")
    assert final.got["step"] == STEPS


def test_misuse_is_a_clear_error():
    with tf.Graph().as_default():
        plain = E.DynamicTable(f"t{next(_names)}", DIM, optimizer=E.SGD(LR), devices=[None])
        with pytest.raises(ValueError, match=r"table 't\d+' has no worker cache"):
            tfpsx.RowStager([plain])
        with pytest.raises(ValueError, match="ahead must be an int >= 1, got 0"):
            tfpsx.RowStager([plain], ahead=0)
        admitting = E.DynamicTable(f"t{next(_names)}", DIM, optimizer=E.SGD(LR),
                                   devices=[None], cache_size=4, cache_admit_after=2)
        with pytest.raises(ValueError, match="cache_admit_after=2"):
            tfpsx.RowStager([admitting])
        table, _, ids, train = model(cache_size=8, staged=False)
        with pytest.raises(ValueError, match="create the stager before the model's lookups"):
            tfpsx.RowStager([table])

    with tf.Graph().as_default():
        table, stager, ids, train = model(cache_size=8)
        with pytest.raises(RuntimeError, match="inside tfpsx.MonitoredTrainingSession"):
            stager.stage({table: [1, 2]})
        with tf.compat.v1.train.MonitoredSession(hooks=[stager, WorkerCacheHook()]) as sess:
            with pytest.raises(ValueError, match=r"must map each staged table \['t\d+'\]"):
                stager.stage({})
            with pytest.raises(TypeError, match="must be integers, got float64"):
                stager.stage({table: [1.5]})
            stager.stage({table: [1, 2]}).result()
            sess.run(train, {ids: [1, 2]})
            # A batch nobody staged: the step fails before it trains anything.
            with pytest.raises(tf.errors.InvalidArgumentError,
                               match="found ids the input pipeline did not stage"):
                sess.run(train, {ids: [30]})

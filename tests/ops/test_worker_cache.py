"""The worker cache of a DynamicTable (cache_size=...), in one process.

Workers are simulated in-process: each cache is a WorkerCache with its own reader id over
one shared (2-shard) table, as N workers' caches are over the PS shards. The GEO
reference is the rule graph and Keras GEO run (tfpsx.embedding.row_copy, tfpsx.modes.geo)
on uncached worker copies.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfpsx
from tfpsx import embedding as E
from tfpsx.embedding import row_copy
from tfpsx.embedding.cache import CacheOptions, WorkerCache
from tfpsx.embedding.sharding import ShardedTable
from tfpsx.modes import geo

_names = iter(range(10 ** 6))
DIM, LR = 3, 0.1


def name(prefix="c"):
    return f"{prefix}{next(_names)}"


def shared_table(optimizer="sgd"):
    return ShardedTable(name("g"), DIM, [None, None], initializer=E.normal(stddev=0.1),
                        optimizer=E.SGD(LR) if optimizer == "sgd" else optimizer, seed=3)


def targets(keys):
    keys = np.asarray(keys, np.float32)
    return np.stack([keys / 50.0, -keys / 80.0, np.sin(keys)], axis=-1).astype(np.float32)


def train_step(source, ids):
    """One SGD step of mean((emb - target(id))^2) through ``source`` (a cache or a GEO
    worker copy): the gradient depends on the rows, so stale or lost rows show."""
    with tf.GradientTape() as tape:
        looked = source.lookup_unique(tf.constant(ids, tf.int64), tape=tape)
        loss = tf.reduce_mean(tf.square(looked.embeddings - targets(ids)))
    source.apply(looked.unique_keys, tape.gradient(loss, looked.unique_rows))


def worker_batches(worker, steps, vocab, batch, seed=0):
    rng = np.random.default_rng(seed * 100 + worker)
    return [rng.integers(0, vocab, size=batch) for _ in range(steps)]


def global_rows(table):
    rows = {k: v.numpy() for k, v in table.export().items()}
    return dict(zip(rows["keys"].tolist(), rows["values"]))


def assert_same_rows(got, want):
    assert sorted(got) == sorted(want)
    for key, row in want.items():
        np.testing.assert_allclose(got[key], row, rtol=1e-5, atol=1e-6, err_msg=f"key {key}")


def geo_schedule(make_worker, sync, workers, k, syncs, vocab, batch):
    """Deterministic GEO: every worker runs k local steps, all push, all pull."""
    copies = [make_worker(i) for i in range(workers)]
    data = [worker_batches(i, k * syncs, vocab, batch) for i in range(workers)]
    for s in range(syncs):
        for i, copy in enumerate(copies):
            for ids in data[i][s * k:(s + 1) * k]:
                train_step(copy, ids)
        pushed = [sync(c, "push") for c in copies]
        for c in copies:
            sync(c, "pull")
    return copies, pushed


def run_uncached_geo(workers, k, syncs, vocab, batch):
    g = shared_table()

    def make(i):
        copy = dict(initializer=g.initializer, seed=g.seed, devices=[None])
        t = geo.GeoTable(g, ShardedTable(name("l"), DIM, optimizer=g.optimizer, **copy),
                         ShardedTable(name("o"), DIM, **copy), None, i + 1)
        row_copy.table_readers(t)
        t.lookup_unique, t.apply = t.local.lookup_unique, t.local.apply
        return t

    def sync(t, what):
        if what == "push":
            return row_copy.table_push(t, float(workers), None)[1]
        return row_copy.table_pull(t)[1]

    geo_schedule(make, sync, workers, k, syncs, vocab, batch)
    return global_rows(g)


def run_cached_geo(workers, k, syncs, vocab, batch, size, policy="lfu"):
    g = shared_table()
    options = CacheOptions(size, policy)

    def make(i):
        return WorkerCache(g, options, None, i + 1, scale=float(workers), flush_in_step=False)

    def sync(c, what):
        if what == "push":
            return row_copy.table_push(c.copy, c.scale, None)[1]
        return row_copy.table_pull(c.copy)[1]

    caches, _ = geo_schedule(make, sync, workers, k, syncs, vocab, batch)
    return global_rows(g), caches


@pytest.mark.parametrize("wire,refresh,tracked", [
    (None, False, False), (None, False, True), (tf.bfloat16, True, False),
    (tf.bfloat16, False, True)])
def test_take_global_makes_a_copy_the_global_table(wire, refresh, tracked):
    """After its last round (push, pull) a worker's copy takes the global table
    (geo.take_global, what GEO does when fit ends): every row the PS holds,
    also those the other worker pushed after that pull and those this worker never
    looked up, equals the PS's exactly in local and old (bfloat16 rows on the wire: with
    ``refresh_all``, every value comes over; without, the rows the pulls brought
    are the PS's as bfloat16 carried them); without a wire dtype only the rows that
    differ have to. ``tracked`` (Keras GEO's copies): the snapshot's changed-key reader
    says which rows the copy takes from it, not an export of every row."""
    g = shared_table()
    copies = []
    for i in range(2):
        copy = dict(initializer=g.initializer, seed=g.seed, devices=[None])
        t = geo.GeoTable(g, ShardedTable(name("l"), DIM, optimizer=g.optimizer, **copy),
                         ShardedTable(name("o"), DIM, **copy), None, i + 1, wire=wire)
        row_copy.table_readers(t)
        if tracked:
            geo.track_snapshot(t)
        copies.append(t)
    # Worker 0 sees ids 0-39, worker 1 ids 20-79: rows of both, and rows of one only.
    data = {0: worker_batches(0, 12, 40, 10), 1: [b + 20 for b in worker_batches(1, 16, 60, 10)]}
    for s in range(3):
        for i, t in enumerate(copies):
            for ids in data[i][s * 4:(s + 1) * 4]:
                train_step(t.local, ids)
            row_copy.table_push(t, 1.0, None)
        for t in copies:
            row_copy.table_pull(t)
    first, other = copies
    for ids in data[1][12:]:  # the other worker trains on and pushes after the last pull
        train_step(other.local, ids)
    late = row_copy.table_push(other, 1.0, None)[1]
    assert int(late) > 0
    local_before = global_rows(first.local)
    geo.take_global(first, refresh_all=refresh)
    want = global_rows(g)
    assert set(want) - set(range(40)), "worker 1 pushed no row worker 0 never looked up"
    exact = wire is None or refresh
    for table in (first.local, first.old):
        got = global_rows(table)
        assert set(want) <= set(got)
        for key, row in want.items():
            if exact:
                np.testing.assert_array_equal(got[key], row, err_msg=f"key {key}")
            else:  # bfloat16 keeps 8 bits of mantissa
                np.testing.assert_allclose(got[key], row, rtol=2 ** -8, err_msg=f"key {key}")
        if not exact:  # what refresh_all is for
            assert any(not np.array_equal(got[k], want[k]) for k in want)
    if wire is None:  # only the late push's rows differed: the rest of the copy was the PS's
        moved = [k for k in want if not np.array_equal(local_before.get(k), want[k])]
        assert 0 < len(moved) <= int(late), (len(moved), int(late))

    # An evaluate or predict after fit takes again, the copy untrained since: the rows
    # the other worker pushed meanwhile come over, into local and old, and no other.
    assert first.local_is_old
    ps_before = global_rows(g)
    for ids in data[0][:4]:
        train_step(other.local, ids)
    again = int(row_copy.table_push(other, 1.0, None)[1])
    local_before = global_rows(first.local)
    geo.take_global(first)
    want = global_rows(g)
    changed = {k for k in want if not np.array_equal(ps_before.get(k), want[k])}
    assert 0 < len(changed) <= again, (len(changed), again)
    for table in (first.local, first.old):
        got = global_rows(table)
        for key in changed:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"key {key}")
        for key in set(want) - changed:  # as the first take left them
            np.testing.assert_array_equal(got[key], local_before[key], err_msg=f"key {key}")

    # Once the copy trains (a fit: KerasGeo.begin_fit clears the mark), local and old
    # differ on rows the PS did not change, and the take copies them again: after a fit
    # that failed (rows trained, not pushed: they take old's values) and after one that
    # ended with its last round (every trained row pushed, then pulled).
    for pushed in (False, True):
        geo.copy_trains(first)
        for ids in data[0][4:8] if pushed else data[0][8:12]:
            train_step(first.local, ids)
        old_rows = global_rows(first.old)
        assert any(not np.array_equal(row, old_rows.get(k))
                   for k, row in global_rows(first.local).items())
        if pushed:
            row_copy.table_push(first, 1.0, None)
            row_copy.table_pull(first)
        geo.take_global(first)
        assert first.local_is_old
        old_rows = global_rows(first.old)
        for key, row in global_rows(first.local).items():
            np.testing.assert_array_equal(row, old_rows[key], err_msg=f"key {key}")
    if tracked:
        # A round that failed part way: the push took the copy's rows from its reader,
        # their write into old was cancelled. The fit failed, so the front-end distrusts
        # the snapshot's reader: the next take copies every row, then trusts it again.
        for ids in data[0][:2]:
            train_step(first.local, ids)
        first.local.shards[0].take_changed(tf.constant(0, tf.int64))
        geo.distrust_snapshot(first)
        geo.take_global(first)
        assert first.old_tracked and first.local_is_old
        old_rows = global_rows(first.old)
        for key, row in global_rows(first.local).items():
            np.testing.assert_array_equal(row, old_rows[key], err_msg=f"key {key}")


@pytest.mark.parametrize("workers", [1, 2])
def test_cached_geo_equals_uncached_geo(workers):
    """A cache that holds what a worker touches trains GEO exactly: the global table
    after the last sync equals the uncached GEO run's on the same schedule (1e-5)."""
    args = dict(workers=workers, k=4, syncs=5, vocab=60, batch=12)
    want = run_uncached_geo(**args)
    got, caches = run_cached_geo(**args, size=64)
    assert_same_rows(got, want)
    for c in caches:
        stats = {k: float(v) for k, v in c.stats().items()}
        assert stats["evictions"] == 0 and stats["flushes"] == 0  # GEO's sync, not its own
        assert 0 < stats["hit_rate"] < 1 and stats["size"] <= 64


@pytest.mark.parametrize("policy", ["lfu", "lru", E.LFU(), E.LRU()])
def test_one_worker_evicting_cache_equals_uncached_geo(policy):
    """With one worker an evicted row's delta is on the PS before the row is fetched
    again, so a cache of 8 rows over 60 ids still gives GEO's values exactly."""
    args = dict(workers=1, k=4, syncs=5, vocab=60, batch=12)
    want = run_uncached_geo(**args)
    got, (cache,) = run_cached_geo(**args, size=8, policy=policy)
    assert cache.options.policy == {"lfu": E.LFU(), "lru": E.LRU()}.get(policy, policy)
    assert_same_rows(got, want)
    assert float(cache.stats()["evictions"]) > 50


class RuleSource:
    """A worker's lookups and applies under GEO's rule for many workers: the ids seen
    ``hot`` times in a batch on the PS (geo.HotRows), the rest in the copy or the
    cache, whose rows travel with their Adagrad slots (share_slots)."""

    def __init__(self, t: geo.GeoTable, hot: int):
        self.rows = geo.HotRows(t, hot)

    def lookup_unique(self, ids, tape=None):
        self.looked = self.rows.lookup_unique(ids, train=True, tape=tape)
        return self.looked

    def apply(self, keys, grads):
        self.rows.apply(keys, grads, self.looked.hot, None)


def rule_run(workers, size=None, hot=10 ** 6, k=4, syncs=4, vocab=40, batch=12):
    """GEO under the rule for many workers on uncached copies (size None) or on caches
    of ``size`` rows, ids seen ``hot`` times in a batch on the PS; returns (the PS's
    rows with their slots, the copies)."""
    g = shared_table(E.Adagrad(0.3))
    copies = []

    def make(i):
        if size is None:
            copy = dict(initializer=g.initializer, seed=g.seed, devices=[None],
                        optimizer=g.optimizer)
            t = geo.GeoTable(g, ShardedTable(name("l"), DIM, **copy),
                             ShardedTable(name("o"), DIM, **copy), None, i + 1,
                             combine="sum", share_slots=True)
            row_copy.table_readers(t)
        else:
            t = WorkerCache(g, CacheOptions(size, "lfu"), None, i + 1, flush_in_step=False,
                            share_slots=True).copy
        copies.append(t)
        return RuleSource(t, hot)

    def sync(source, what):
        t = source.rows.geo
        if what == "push":
            return row_copy.table_push(t, 1.0, None)[1]
        return row_copy.table_pull(t)[1]

    geo_schedule(make, sync, workers, k, syncs, vocab, batch)
    rows = {k: v.numpy() for k, v in g.export().items()}
    return {key: np.concatenate([rows["values"][i], rows["slots"][i].ravel()])
            for i, key in enumerate(rows["keys"].tolist())}, copies


@pytest.mark.parametrize("workers,size", [(3, 64), (1, 6)])
def test_a_cache_under_geos_rule_for_many_workers_trains_as_the_uncached_copy(workers, size):
    """GEO's rule for many workers holds with a worker cache: its rows travel with their
    Adagrad slots (fetched, synced and evicted), summed on the PS. The PS's rows and
    slots after the last round equal the uncached rule's on the same schedule: 3
    workers with caches that evict nothing, and one worker whose 6-row cache evicts,
    over 40 ids."""
    want, _ = rule_run(workers)
    got, caches = rule_run(workers, size=size)
    assert_same_rows(got, want)
    slots = np.array([row[DIM:] for row in want.values()])
    assert (slots > 0.1 + 1e-3).any()  # Adagrad's accumulators moved off their start
    for t in caches:
        stats = {k: float(v) for k, v in t.local.stats().items()}
        assert stats["hit_rate"] > 0 and stats["size"] <= size + 12
        if size < 40:
            assert stats["evictions"] > 0
        # Every step's copy part went through the cache's own apply (its clock as the
        # rows' step, its count; GEO's split once bypassed it): 4 rounds of K=4 steps.
        assert int(t.local.updates()) == 4 * 4


def test_a_cache_with_hot_rows_reads_and_trains_them_on_the_ps():
    """The hot ids of a cached worker's batch (seen twice here) are read from the PS and
    trained there, never cached; the rest go through the cache, with their slots."""
    g = shared_table(E.Adagrad(0.3))
    cache = WorkerCache(g, CacheOptions(16, "lfu"), None, 1, flush_in_step=False,
                        share_slots=True)
    row_copy.table_readers(cache.copy)
    # The PS's row 5 has a moved accumulator: a cached row must arrive with it.
    g.apply(tf.constant([5], tf.int64), tf.ones([1, DIM]))
    source = RuleSource(cache.copy, 2)
    init = g.rows(tf.constant([7], tf.int64), False).numpy()  # 7 not on the PS yet
    train_step(source, [7, 7, 5, 9])
    cached = cache.export()["keys"].numpy().tolist()
    assert sorted(cached) == [5, 9]
    ps5 = g.shards[1].find(tf.constant([5], tf.int64), with_slots=True)[0].numpy()
    old5 = cache.old.shards[0].find(tf.constant([5], tf.int64), with_slots=True)[0].numpy()
    np.testing.assert_array_equal(old5, ps5)  # fetched with its slots, untouched since
    assert (ps5[0, DIM:] > 1.0).all()
    assert not np.allclose(g.rows(tf.constant([7], tf.int64), False).numpy(), init)
    stats = {k: float(v) for k, v in cache.stats().items()}
    assert stats["lookups"] == 2 and stats["rows_fetched"] == 2  # 5 and 9, not 7


def constant_gradient_run(workers, size, steps, vocab, batch, flush_steps, lr=0.5,
                          admit_after=1, zipf=False):
    """Async caches (n = 1) of several workers training one table in turns with a
    gradient that does not depend on the rows (loss = sum(emb * w[id])): whatever is
    cached, evicted, flushed or refreshed, the PS must end at init - lr * sum of all
    gradients. Returns (got, want, caches)."""
    g = ShardedTable(name("g"), DIM, [None, None], initializer=E.normal(stddev=0.1),
                     optimizer=E.SGD(lr), seed=5)
    init_keys = np.arange(vocab, dtype=np.int64)
    init = dict(zip(init_keys.tolist(), g.rows(tf.constant(init_keys), train=False).numpy()))
    weights = np.random.default_rng(9).normal(size=(vocab, DIM)).astype(np.float32)
    caches = [WorkerCache(g, CacheOptions(size, "lfu", flush_steps, admit_after), None, i + 1)
              for i in range(workers)]
    data = [worker_batches(i, steps, vocab, batch, seed=1) for i in range(workers)]
    if zipf:  # a few hot ids and a long tail
        rng = np.random.default_rng(4)
        data = [[np.minimum(rng.zipf(1.3, size=batch) - 1, vocab - 1) for _ in range(steps)]
                for _ in range(workers)]
    total = {}
    for step in range(steps):
        for i, cache in enumerate(caches):
            ids = data[i][step]
            with tf.GradientTape() as tape:
                looked = cache.lookup_unique(tf.constant(ids, tf.int64), tape=tape)
                loss = tf.reduce_sum(looked.embeddings * weights[ids])
            cache.apply(looked.unique_keys, tape.gradient(loss, looked.unique_rows))
            for key in ids.tolist():
                total[key] = total.get(key, 0) + 1
    for cache in caches:
        cache.flush()
    want = {k: init[k] - np.float32(lr) * n * weights[k] for k, n in total.items()}
    return global_rows(g), want, caches


@pytest.mark.heavy
def test_eviction_writes_back_every_update():
    got, want, caches = constant_gradient_run(workers=2, size=10, steps=40, vocab=50,
                                              batch=8, flush_steps=3)
    assert_same_rows(got, want)
    for c in caches:
        stats = {k: float(v) for k, v in c.stats().items()}
        assert stats["evictions"] > 100 and stats["flushes"] >= 13
        assert stats["rows_refreshed"] > 0  # the other worker's rows came back
        assert stats["size"] <= 10 + 8


@pytest.mark.heavy
def test_admission_keeps_the_tail_on_the_ps_and_loses_nothing():
    """cache_admit_after=2: a missed row enters at its second recent sighting; the rest
    train on the PS directly. Two async workers over a Zipf stream: the PS still ends at
    init - lr * sum of all gradients, the tail passed by (rows not admitted), and the
    cache churned less than one that admits every miss."""
    runs = {}
    for admit_after in (1, 2):
        got, want, caches = constant_gradient_run(workers=2, size=12, steps=40, vocab=400,
                                                  batch=16, flush_steps=5, zipf=True,
                                                  admit_after=admit_after)
        assert_same_rows(got, want)
        runs[admit_after] = [{k: float(v) for k, v in c.stats().items()} for c in caches]
    for every, admitting in zip(runs[1], runs[2]):
        assert every["not_admitted"] == 0
        assert admitting["not_admitted"] > 50, admitting
        assert admitting["evictions"] < every["evictions"] / 2, (admitting, every)
        assert admitting["hit_rate"] > 0.3, admitting
        assert admitting["size"] <= 12 + 16


def test_admission_sketch_counts_recent_sightings_and_ages():
    """The sketch admits at the K-th sighting (several in one batch count), and halves
    every 10 x cache_size missed ids, so old sightings fade."""
    cache = WorkerCache(shared_table(), CacheOptions(2, admit_after=3), None, 1)
    assert cache.sketch.window == 20 and cache.sketch.width == 1024

    def cached(key):
        return bool(cache.shards[0].find(tf.constant([key], tf.int64))[1][0])

    train_step(cache, [7])
    train_step(cache, [7])
    assert not cached(7)  # two sightings
    train_step(cache, [7])
    assert cached(7)  # the third
    train_step(cache, [8, 8, 8])
    assert cached(8)  # three in one batch
    train_step(cache, [9, 9])  # 2 sightings of 9, then 14 more missed ids: halved
    train_step(cache, list(range(100, 114)))
    train_step(cache, [9])  # 2 // 2 + 1 = 2 < 3
    assert not cached(9)
    stats = {k: float(v) for k, v in cache.stats().items()}
    assert stats["not_admitted"] == 2 + 1 + 14 + 1, stats


def test_a_cache_smaller_than_one_batch_serves_it_whole():
    """A batch with more distinct ids than the cache holds is served and trained whole;
    nothing is lost, and the cache is back within its size by the next lookup."""
    got, want, (cache,) = constant_gradient_run(workers=1, size=4, steps=10, vocab=200,
                                                batch=50, flush_steps=100)
    assert_same_rows(got, want)
    assert int(cache.stats()["size"]) <= 50
    ids = tf.constant(np.arange(300, 360), tf.int64)
    cache.lookup_unique(ids)
    assert int(cache.stats()["size"]) <= 4 + 60


@pytest.mark.heavy
def test_zipf_stream_hit_rate():
    """Zipf(1.1) ids over a vocabulary of 1M, a cache of 5% of it (LFU): at least 85% of
    4M looked-up ids hit the cache (its steady state is ~89%; the first sightings miss)."""
    vocab, size, batch, steps = 1_000_000, 50_000, 16_384, 250
    rng = np.random.default_rng(0)
    cdf = np.cumsum(np.arange(1, vocab + 1, dtype=np.float64) ** -1.1)
    cdf /= cdf[-1]
    ranks = rng.permutation(vocab)  # hot ids anywhere in the key space
    emb = E.DynamicTable(name("zipf"), 4, optimizer=E.SGD(0.1), devices=[None],
                             cache_size=size, flush_steps=50)

    @tf.function
    def step(ids):
        with tf.GradientTape() as tape:
            looked = emb.lookup_unique(ids, tape=tape)
            loss = tf.reduce_sum(looked.embeddings)
        emb.apply_gradients(looked, tape.gradient(loss, looked.unique_rows))

    seen = np.zeros(vocab, bool)
    for _ in range(steps):
        draw = np.minimum(np.searchsorted(cdf, rng.random(batch)), vocab - 1)
        seen[ranks[draw]] = True
        step(tf.constant(ranks[draw].astype(np.int64)))
    emb.flush_cache()
    stats = {k: float(v) for k, v in emb.stats().items()}
    assert stats["cache_lookups"] == batch * steps
    assert stats["cache_hit_rate"] >= 0.85, stats
    assert stats["cache_size"] <= size + batch  # the last batch's misses are evicted next
    # Every id was fetched once into the PS table, and every sighting trained its row by
    # -0.1 (loss = sum): nothing was lost, the PS rows moved by -0.1 * 4M in each column.
    assert stats["size"] == seen.sum()
    rows = emb.export()
    fresh = ShardedTable(name("fresh"), 4, [None], initializer=emb.initializer, seed=emb.seed)
    moved = rows["values"].numpy() - fresh.rows(rows["keys"], train=False).numpy()
    np.testing.assert_allclose(moved.astype(np.float64).sum(axis=0), -0.1 * batch * steps,
                               rtol=1e-4)


def test_prefetch_stages_the_next_batch():
    g = shared_table()
    cache = WorkerCache(g, CacheOptions(100), None, 1)
    plain = WorkerCache(shared_table(), CacheOptions(100), None, 1)
    batches = worker_batches(0, 6, 40, 10)
    for i, ids in enumerate(batches):
        train_step(plain, ids)
        train_step(cache, ids)
        if i + 1 < len(batches):
            cache.prefetch(tf.constant(batches[i + 1], tf.int64))
    for c in (cache, plain):
        c.flush()
    assert_same_rows(global_rows(g), global_rows(plain.table))
    stats = {k: float(v) for k, v in cache.stats().items()}
    first = len(np.unique(batches[0]))
    assert stats["rows_fetched"] == first  # every later miss had been staged
    assert stats["prefetched"] == float(plain.stats()["rows_fetched"]) - first


@pytest.mark.parametrize("admit_after", [1, 2])
def test_graph_mode_cache_trains_like_the_table_it_caches(admit_after):
    """Graph mode, one worker, the hook MonitoredTrainingSession adds: a cache of 16 rows
    over 40 ids (evicting; a sync every 2 updates, between steps; a final one at the
    end) leaves the PS rows the uncached table gets from the same SGD steps; also with
    admission (rows not yet admitted train on the PS in the step)."""
    from tfpsx.training.hooks import WorkerCacheHook, graph_caches

    with tf.Graph().as_default():
        ids = tf.compat.v1.placeholder(tf.int64, [None])
        want = tf.gather(tf.constant(targets(range(40))), ids)
        tables, trains = [], []
        for cache_size in (16, None):
            emb = E.DynamicTable(name("graph"), DIM, optimizer=E.SGD(LR), devices=[None],
                                     initializer=E.zeros(), cache_size=cache_size,
                                     flush_steps=2, cache_admit_after=admit_after)
            looked = emb.lookup_unique(ids)
            loss = tf.reduce_sum(tf.square(looked.embeddings - want))
            tables.append(emb)
            trains.append(emb.minimize(loss, [looked]))
        cached, plain = tables
        stats = cached.stats()
        exports = [cached.export(), plain.export()]
        assert graph_caches() == [cached.cache]
        # One state object on the graph, nothing of tfpsx's in its collections.
        graph = tf.compat.v1.get_default_graph()
        assert hasattr(graph, "_tfpsx_state") and not any(hasattr(graph, a) for a in (
            "_tfpsx_mode", "_tfpsx_table_handles", "_tfpsx_cache_vars", "_tfpsx_checked_rows"))
        assert not [k for k in graph.get_all_collection_keys() if "tfpsx" in str(k)]
        with tf.compat.v1.train.MonitoredSession(hooks=[WorkerCacheHook()]) as sess:
            for ids_ in worker_batches(0, 60, 40, 10):
                sess.run(trains, {ids: ids_})
            got = sess.run(stats)
        with tf.compat.v1.Session() as sess:  # the tables outlive the session
            rows, plain_rows = sess.run(exports)
    assert got["cache_evictions"] > 0
    assert (got["cache_not_admitted"] > 0) == (admit_after > 1)
    assert got["cache_flushes"] == 30  # every 2 updates (the final one came after)
    assert_same_rows(dict(zip(rows["keys"].tolist(), rows["values"])),
                     dict(zip(plain_rows["keys"].tolist(), plain_rows["values"])))


def test_bad_cache_options_are_clear_errors():
    for kwargs, pattern in [
            (dict(cache_size=0), r"cache_size must be None \(no cache\) or an int >= 1.*got 0"),
            (dict(cache_size=2.5), r"cache_size .* got 2\.5"),
            (dict(cache_size=8, cache_policy="fifo"), r"cache_policy must be one of "
                                                      r"\['lfu', 'lru'\] or a "
                                                      r"tfpsx.embedding.LFU\(\) / LRU\(\), "
                                                      r"got 'fifo'"),
            (dict(cache_size=8, flush_steps=0), r"flush_steps must be an int >= 1.*got 0"),
            (dict(cache_size=8, cache_admit_after=0),
             r"cache_admit_after must be an int >= 1 .*got 0"),
            (dict(cache_size=8, cache_admit_after="2"), r"cache_admit_after .*got '2'")]:
        with pytest.raises(ValueError, match=pattern):
            E.DynamicTable(name("bad"), 2, devices=[None], **kwargs)
    plain = E.DynamicTable(name("plain"), 2, devices=[None])
    with pytest.raises(ValueError, match=r"prefetch needs a worker cache \(create the table "
                                         r"with cache_size=N\) or a disk tier"):
        plain.prefetch([1, 2])
    assert plain.cache is None


def test_a_cache_with_sync_training_is_refused():
    from tfpsx.training.modes.sync import SyncTableUpdater
    with pytest.raises(ValueError, match=r"cache_size=8 with SyncTableUpdater: sync training "
                                         r"aggregates"):
        E.DynamicTable(name("sync"), 2, devices=[None], cache_size=8,
                           updater=SyncTableUpdater(mode=None))


def test_stats_without_cluster_and_float_ids_error():
    emb = E.DynamicTable(name("s"), 2, devices=[None], optimizer=E.SGD(0.1),
                             cache_size=4)
    with pytest.raises(TypeError, match="ids must be integers"):
        emb.lookup_unique(tf.constant([1.5]))
    emb.lookup_unique(tf.constant([1, 2, 2]))
    s = {k: float(v) for k, v in emb.stats().items()}
    assert s["cache_lookups"] == 3 and s["cache_hits"] == 0 and s["cache_size"] == 2
    assert tfpsx.embedding.DynamicTable is E.DynamicTable


@pytest.mark.heavy
def test_keras_layer_with_a_cache_trains_like_without():
    """The Keras layer with cache_size, fit without a cluster: the cache (8 rows over 30
    ids, evicting) trains the rows as the table alone would (SGD, one worker), and the
    saved model holds them (a save flushes the cache first)."""
    import keras
    from tfpsx.keras import layers

    rng = np.random.default_rng(4)
    x = rng.integers(0, 30, size=(256, 3)).astype(np.int64)
    y = (x.sum(axis=1) % 7 / 7.0).astype(np.float32)

    def train(cache_size):
        keras.utils.set_random_seed(1)
        emb = layers.DynamicEmbedding(4, table_name=name("keras"), combiner="sum",
                                      optimizer=E.SGD(0.05), initializer="zeros",
                                      cache_size=cache_size, flush_steps=3)
        model = keras.Sequential([keras.Input((3,), dtype="int64"), emb, keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        model.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False)
        store = {}
        emb.save_own_variables(store)
        return model.predict(x, verbose=0), store, emb

    want, want_store, _ = train(None)
    got, got_store, emb = train(8)
    assert float(emb.table.stats()["cache_evictions"]) > 0
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert_same_rows(dict(zip(got_store["table_keys"].tolist(), got_store["table_values"])),
                     dict(zip(want_store["table_keys"].tolist(), want_store["table_values"])))
    with pytest.raises(ValueError, match=r"cache_policy must be one of"):
        layers.DynamicEmbedding(4, cache_size=8, cache_policy="mru")

"""GEO's hot rows (tfpsx.modes.geo.HotRows, a strategy's geo_hot_count and
geo_hot_per_round), in one process: an id seen at least hot_count times in a worker's
batch, or one the N workers would train too often in a round
(tfpsx.modes.geo.contention), is read from and trained on the PS (async), the rest of
the batch trains the worker's copy, and the copy's next pull brings the PS's async
moves."""

import pytest

import numpy as np
import tensorflow as tf

from tfpsx import embedding as E
from tfpsx.embedding import row_copy
from tfpsx.embedding.sharding import ShardedTable
from tfpsx.modes import geo
from tfpsx.modes.geo import Contention

DIM = 2
_names = iter(range(10 ** 6))


def geo_pair(reader=1, hot_count=2):
    n = next(_names)
    g = ShardedTable(f"hot_g{n}", DIM, [None, None], initializer=E.normal(stddev=0.1),
                     optimizer=E.Adagrad(0.5), seed=3)
    copy = dict(initializer=g.initializer, seed=g.seed, devices=[None])
    t = geo.GeoTable(g, ShardedTable(f"hot_l{n}", DIM, optimizer=g.optimizer, **copy),
                     ShardedTable(f"hot_o{n}", DIM, **copy), None, reader, combine="sum")
    row_copy.table_readers(t)
    return t, geo.HotRows(t, hot_count)


def rows_of(table, keys):
    return table.shards[0].find(tf.constant(keys, tf.int64))[0].numpy() \
        if len(table.shards) == 1 else table.rows(tf.constant(keys, tf.int64), False).numpy()


def test_a_batchs_hot_ids_read_and_train_on_the_ps_the_rest_on_the_copy():
    t, hot = geo_pair(hot_count=2)
    # The PS and the copy hold different values for both keys: a read shows its source.
    t.global_.insert(tf.constant([7, 9], tf.int64), tf.constant([[1., 1.], [2., 2.]]))
    t.local.insert(tf.constant([7, 9], tf.int64), tf.constant([[-1., -1.], [-2., -2.]]))
    t.old.insert(tf.constant([7, 9], tf.int64), tf.constant([[-1., -1.], [-2., -2.]]))
    ids = tf.constant([[7, 9], [7, 3]], tf.int64)  # 7 twice (hot), 9 and 3 once
    with tf.GradientTape() as tape:
        looked = hot.lookup_unique(ids, train=True, step=1, tape=tape)
        loss = tf.reduce_sum(looked.embeddings)
    assert looked.unique_keys.numpy().tolist() == [7, 9, 3]
    assert looked.hot.numpy().tolist() == [True, False, False]
    np.testing.assert_allclose(looked.unique_rows.numpy()[:2], [[1., 1.], [-2., -2.]])
    np.testing.assert_allclose(looked.embeddings.numpy()[0], [[1., 1.], [-2., -2.]])
    grads = tape.gradient(loss, looked.unique_rows)
    hot.apply(looked.unique_keys, grads, looked.hot, step=1)
    # 7 moved on the PS (its Adagrad), not in the copy; 9 and 3 in the copy only.
    assert (rows_of(t.global_, [7]) < 1.).all()
    np.testing.assert_allclose(rows_of(t.local, [7]), [[-1., -1.]])
    assert (rows_of(t.local, [9]) < -2.).all()
    np.testing.assert_allclose(rows_of(t.global_, [9]), [[2., 2.]])
    # A push moves only the copy's rows; the pull brings 7's async move home: the copy
    # then holds the PS's value of every row it shares (its own deltas pushed).
    row_copy.table_push(t, 1.0, None)
    row_copy.table_pull(t)
    np.testing.assert_allclose(rows_of(t.local, [7, 9, 3]), rows_of(t.global_, [7, 9, 3]),
                               rtol=1e-6)


def test_two_workers_hot_rows_meet_on_the_ps_at_every_step():
    """Worker B's next step reads the move worker A's step just made to a hot row (no
    round between them), as async's would."""
    a, hot_a = geo_pair(reader=1)
    b = geo.GeoTable(a.global_, ShardedTable("hot_b_l", DIM, optimizer=a.global_.optimizer,
                                             initializer=a.global_.initializer, seed=3,
                                             devices=[None]),
                     ShardedTable("hot_b_o", DIM, initializer=a.global_.initializer,
                                  seed=3, devices=[None]), None, 2, combine="sum")
    row_copy.table_readers(b)
    hot_b = geo.HotRows(b, 2)
    ids = tf.constant([5, 5, 6], tf.int64)
    looked = hot_a.lookup_unique(ids, train=True, step=1)
    hot_a.apply(looked.unique_keys, tf.ones([2, DIM]), looked.hot, step=1)
    seen_by_b = hot_b.lookup_unique(ids, train=True, step=1)
    np.testing.assert_allclose(seen_by_b.unique_rows.numpy()[0], rows_of(a.global_, [5])[0])
    assert not np.allclose(seen_by_b.unique_rows.numpy()[0], looked.unique_rows.numpy()[0])
    # An evaluation reads the copy, whole.
    np.testing.assert_allclose(hot_b.lookup(ids).numpy()[2], rows_of(b.local, [6])[0])


def test_a_table_with_a_worker_cache_follows_the_rule_for_many_workers():
    """GEO's updater gives a cached table the job's rule: its rows travel with their
    slots (summed on the PS), and its hot ids read and train on the PS (HotRows over
    the cache; tests/ops/test_worker_cache.py drives both)."""
    from tfpsx.modes.geo import GeoTableUpdater

    class Mode:
        worker_index, worker_num, worker_device = 0, 4, "/job:localhost/replica:0/task:0"
        tables, wire_dtype, in_train_thread, share_slots, hot_count = [], None, True, True, 4
        hot_per_round, named, updaters = 0, frozenset(), []
        table_choice, slot_wire_dtype = False, tf.float32

    table = E.DynamicTable("hot_cached", DIM, optimizer=E.Adagrad(0.1), cache_size=16)
    updater = GeoTableUpdater(Mode())
    updater.attach(table)
    (t,) = Mode.tables
    assert t.cached and t.share_slots and t.combine == "sum"
    assert t.old.num_slots == 1  # old keeps the slots a row came with
    source = updater.lookup_source(table)
    assert isinstance(source, geo.HotRows) and source.hot_count == 4
    assert source.geo.local is updater.cache


def _contention(worker_num=8, k=10, bound=40, name=None):
    return Contention(name or f"c{next(_names)}", None, worker_num, lambda: k, bound,
                      width=1 << 12)


def test_rows_too_contended_for_a_round_train_on_the_ps_and_the_long_tail_in_the_copy():
    """8 workers, K=10: a round would sum up to 80 steps of a row, twice the bound (40).
    Until a row's rate shows, it counts as hot (the job's first steps train on the PS);
    then a row in every batch stays hot (8 x ~10 of the last 10 batches), and an id seen
    once goes to the copy, as the rest of the long tail; the count rule still holds."""
    t, _ = geo_pair(hot_count=3)
    hot = geo.HotRows(t, 3, _contention())
    first = hot.lookup_unique(tf.constant([7, 1000], tf.int64), train=True, step=1)
    assert first.hot.numpy().tolist() == [True, True]  # nothing measured yet
    for step in range(2, 40):
        looked = hot.lookup_unique(tf.constant([7, 1000 + step, 55, 55, 55], tf.int64),
                                   train=True, step=step)
    # 7 in every batch; 1039 new; 55 thrice in this batch (the count rule), new too
    assert looked.unique_keys.numpy().tolist() == [7, 1039, 55]
    assert looked.hot.numpy().tolist() == [True, False, True]
    # Where the batch's rows come from: 7's and 55's from the PS, 1039's from the copy.
    t.global_.insert(tf.constant([7], tf.int64), tf.constant([[3., 3.]]))
    t.local.insert(tf.constant([1039], tf.int64), tf.constant([[-4., -4.]]))
    again = hot.lookup_unique(tf.constant([7, 1039], tf.int64), train=True, step=40)
    assert again.hot.numpy().tolist() == [True, False]
    np.testing.assert_allclose(again.unique_rows.numpy(), [[3., 3.], [-4., -4.]])


def test_a_row_leaves_the_ps_once_its_batches_thin_out():
    """The estimate is the last ~K batches': a row that stops coming cools down within a
    few rounds; one in 2 of every 3 batches (8 x 10 x 2/3 = 53 steps a round) stays hot,
    one in 1 of 3 (27) does not; a row seen once, after the start, is not (its own batch
    says nothing of the others')."""
    c = _contention()
    keys = tf.constant([7, 8], tf.int64)
    for _ in range(60):
        c.hot(keys)
    assert c.hot(keys).numpy().tolist() == [True, True]
    # 7 gone; 9 in 2 of every 3 batches, 8 in 1 of 3 (each batch has a new id too)
    for step in range(120):
        c.hot(tf.constant([5000 + step] + ([8, 9] if step % 3 == 0 else
                                           [9] if step % 3 == 1 else []), tf.int64))
    assert c.hot(tf.constant([7, 8, 9, 1234], tf.int64)).numpy().tolist() == [
        False, False, True, False]


@pytest.mark.parametrize("workers", [2, 4, 16])
def test_the_estimate_scales_a_rows_rate_by_the_worker_count(workers):
    """The definition, at several N: a round of K steps on N workers holds about N x K / T
    steps of a row that is in one of every T batches. With K = 40 and bound 40, a row at
    1.5x the bound or more is hot and one at 0.6x or less is not (its rate seen in this
    worker's own batches, scaled by N), whatever N is."""
    k, bound = 40, 40
    c = _contention(worker_num=workers, k=k, bound=bound)
    period = {7: int(workers * k // (1.5 * bound)),         # >= 1.5x the bound
              8: int(-(-workers * k // (0.6 * bound)))}     # <= 0.6x
    rate = {key: workers * k / t for key, t in period.items()}
    assert rate[7] >= 1.5 * bound and rate[8] <= 0.6 * bound, rate
    for step in range(400):
        c.hot(tf.constant([10_000 + step] + [key for key, t in period.items()
                                              if step % t == 0], tf.int64))
    assert c.hot(tf.constant([7, 8], tf.int64)).numpy().tolist() == [True, False], rate


def test_no_row_is_too_contended_where_k_x_n_keeps_the_bound():
    """K x N <= the bound (what k_steps="auto" keeps in deterministic rounds), or rounds
    of one step (no batch before the one at hand to count): the estimate builds nothing
    and HotRows keeps its count rule alone."""
    c = _contention(worker_num=8, k=5, bound=40)
    assert not c.active() and c.hot(tf.constant([1, 2], tf.int64)) is None
    one_step = _contention(worker_num=32, k=1, bound=10)
    assert not one_step.active() and one_step.hot(tf.constant([1, 2], tf.int64)) is None
    t, _ = geo_pair()
    looked = geo.HotRows(t, 2, c).lookup_unique(tf.constant([1, 1, 2], tf.int64),
                                                train=True, step=1)
    assert looked.hot.numpy().tolist() == [True, False]


def test_the_estimate_is_worker_local_in_graph_mode():
    """In a TF1 graph its counters are local variables (every worker initializes its
    own; the chief's Saver neither saves nor restores them)."""
    with tf.Graph().as_default() as g:
        c = _contention(name="graph_contention")
        hot = c.hot(tf.constant([5, 6], tf.int64))
        again = c.hot(tf.constant([5, 6], tf.int64))  # the same variables
        made = g.get_collection(tf.compat.v1.GraphKeys.LOCAL_VARIABLES)
        assert sorted(v.op.name.split("/")[-1] for v in made) == [
            "tfpsx_contention_age", "tfpsx_contention_clock", "tfpsx_contention_ema"]
        assert not g.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
        clock = [v for v in made if v.op.name.endswith("tfpsx_contention_clock")][0]
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.local_variables_initializer())
            assert sess.run(hot).tolist() == [True, True]
            assert sess.run(again).tolist() == [True, True]  # still fading from the start
            assert sess.run(clock) == 2  # both lookups counted in the same variables
        with tf.compat.v1.Session() as sess:  # a session of its own: a new count
            sess.run(tf.compat.v1.local_variables_initializer())
            assert sess.run(clock) == 0


@pytest.mark.parametrize("kwargs,words", [
    (dict(bound=0), ["bound", ">= 1", "0"]),
    (dict(width=1000), ["width", "power of two", "1000"]),
])
def test_a_bad_bound_or_width_is_a_clear_error(kwargs, words):
    args = dict(name="bad", device=None, worker_num=8, k_steps=lambda: 10, bound=40)
    with pytest.raises(ValueError) as e:
        Contention(**dict(args, **kwargs))
    assert all(w in str(e.value) for w in words), e.value


def test_geos_updater_gives_a_table_the_estimate_under_the_rule():
    """GEO's updater builds a table's estimate when the rule has geo_hot_per_round, with
    the mode's N and its K as a step being built runs it."""
    from tfpsx.modes.geo import GeoTableUpdater

    class Mode:
        worker_index, worker_num, worker_device = 1, 8, "/job:localhost/replica:0/task:0"
        tables, wire_dtype, in_train_thread, share_slots, hot_count = [], None, True, True, 0
        hot_per_round, named, updaters = 40, frozenset(), []
        table_choice, slot_wire_dtype = False, tf.float32

        def round_steps(self):
            return 10

    updater = GeoTableUpdater(Mode())
    table = E.DynamicTable("hot_contended", DIM, optimizer=E.Adagrad(0.1))
    updater.attach(table)
    source = updater.lookup_source(table)
    assert isinstance(source, geo.HotRows) and source.hot_count == 0
    c = source.contention
    assert (c.worker_num, c.k_steps(), c.bound, c.active()) == (8, 10, 40, True)
    Mode.hot_per_round = 0
    off = GeoTableUpdater(Mode())
    off.attach(E.DynamicTable("hot_not_contended", DIM, optimizer=E.Adagrad(0.1)))
    assert off.lookup_source(None) is Mode.tables[-1].local


class _CountingMode:
    """A GEO mode as GeoTableUpdater sees it (this process's device), hot count 2."""
    worker_index, worker_num, worker_device = 0, 4, "/job:localhost/replica:0/task:0"
    wire_dtype, in_train_thread, share_slots, hot_count = None, True, True, 2
    hot_per_round, named, table_choice = 0, frozenset(), False
    slot_wire_dtype = tf.float32

    def __init__(self):
        self.tables, self.updaters, self.train_ops = [], [], []

    def local_train_op(self, op):
        self.train_ops.append(op)


def test_the_rows_a_step_trains_are_counted_for_the_traffic_against_async():
    """GEO's updater counts each training step's distinct rows and its hot ones (what the
    worker logs against async when fit ends: tfpsx.modes.geo.count_trained), eagerly and
    in a graph, where a new session starts the count again."""
    from tfpsx.modes.geo import GeoCounters, GeoTableUpdater, count_trained, row_trip_bytes

    mode = _CountingMode()
    updater = GeoTableUpdater(mode)
    table = E.DynamicTable(f"counted{next(_names)}", DIM, optimizer=E.Adagrad(0.1))
    updater.attach(table)
    source = updater.lookup_source(table)
    for ids in ([5, 5, 6], [7, 8, 9, 9]):  # 2 rows (5 hot), then 3 (9 hot)
        looked = source.lookup_unique(tf.constant(ids, tf.int64), train=True, step=1)
        updater.apply_gradients(table, looked.unique_keys,
                                tf.ones_like(looked.unique_rows), 1, looked.hot)
    assert updater.trained_since() == (5, 2)
    assert updater.trained_since() == (0, 0)  # counted once
    counters = GeoCounters()
    counters.add(table_bytes=1000)
    count_trained(counters, 0, [(5, 2, DIM)], steps=2)
    assert (counters.trained_rows, counters.hot_rows) == (5, 2)
    assert counters.async_table_bytes == 5 * row_trip_bytes(DIM) == 5 * 2 * (8 + 4 * DIM)
    assert counters.table_bytes_vs_async == (1000 + 2 * row_trip_bytes(DIM)) / (
        5 * row_trip_bytes(DIM))

    with tf.Graph().as_default() as graph:
        mode = _CountingMode()
        updater = GeoTableUpdater(mode)
        table = E.DynamicTable(f"counted{next(_names)}", DIM, optimizer=E.Adagrad(0.1))
        updater.attach(table)
        ids = tf.compat.v1.placeholder(tf.int64, [None])
        looked = updater.lookup_source(table).lookup_unique(ids, train=True, step=1)
        train = updater.apply_gradients(table, looked.unique_keys,
                                        tf.ones_like(looked.unique_rows), 1, looked.hot)
        init = [tf.compat.v1.global_variables_initializer(),
                tf.compat.v1.local_variables_initializer()]
        for steps in (2, 1):  # a second session: its count starts from 0 again
            with tf.compat.v1.Session(graph=graph) as sess:
                sess.run(init)
                updater.session_started(sess)
                for _ in range(steps):
                    sess.run(train, {ids: [1, 1, 2]})
                assert updater.trained_since(sess) == (2 * steps, steps)


def test_a_chosen_tables_split_counts_the_rows_a_step_trains_in_both_states():
    """Under geo_table_choice="auto" the split op of a graph's step counts what it held
    (no count ops of the updater's own): while the table trains async every row is the
    PS's, then in rounds the hot count's (2 here); the expected counts are the batches'
    distinct ids, counted by hand."""
    from tfpsx.modes.geo import GeoTableUpdater
    from tfpsx.modes.geo.hot_rows import route_of
    from tfpsx.modes.geo.tables import async_flag

    class Mode(_CountingMode):
        in_train_thread, table_choice, retraces = False, True, False

        def round_steps(self):
            return 10

    with tf.Graph().as_default() as graph:
        mode = Mode()
        updater = GeoTableUpdater(mode)
        table = E.DynamicTable(f"counted{next(_names)}", DIM, optimizer=E.Adagrad(0.1))
        updater.attach(table)
        source = updater.lookup_source(table)
        assert isinstance(source, geo.HotRows) and source.on_ps is not None
        ids = tf.compat.v1.placeholder(tf.int64, [None])
        looked = source.lookup_unique(ids, train=True, step=1)
        train = updater.apply_gradients(table, looked.unique_keys,
                                        tf.ones_like(looked.unique_rows), 1, looked.hot)
        assert route_of(looked.hot) is not None  # (the apply counts the split's figure)
        to_rounds = async_flag(mode.tables[-1]).assign(False)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run([tf.compat.v1.global_variables_initializer(),
                      tf.compat.v1.local_variables_initializer()])
            updater.session_started(sess)
            for _ in range(3):  # async: [1, 2] and [1, 2, 3], both the PS's
                sess.run(train, {ids: [1, 1, 2]})
                sess.run(train, {ids: [3, 2, 1]})
            assert updater.trained_since(sess) == (15, 15)
            sess.run(to_rounds)  # rounds: 1 is seen twice (hot), 2 once
            for _ in range(2):
                sess.run(train, {ids: [1, 1, 2]})
            assert updater.trained_since(sess) == (4, 2)


@pytest.mark.parametrize("optimizer", [E.Adam(0.01), E.Ftrl(0.1)], ids=["adam", "ftrl"])
def test_shared_slots_do_not_sum_an_optimizers_slots_that_do_not_add_up(optimizer, caplog):
    """Adam's moments (N moving averages from one value) and FTRL's z do not add up across
    workers: geo_table_rule='shared_slots' named for such a table is refused before
    anything of it is built, naming what to do; the rule for many workers by default
    lets that table's rows travel without their slots. Adagrad's accumulator shares."""
    from tfpsx.modes.geo import GeoTableUpdater

    named = _CountingMode()
    named.named = frozenset({"geo_table_rule"})
    table = E.DynamicTable(f"moments{next(_names)}", DIM, optimizer=optimizer)
    with pytest.raises(ValueError, match=rf"table '{table.name}' trains with "
                                         rf"tfpsx.embedding.{type(optimizer).__name__}.*"
                                         r"geo_table_rule='average'.*Adagrad or SGD"):
        GeoTableUpdater(named).attach(table)
    assert named.tables == named.updaters == []
    by_default = _CountingMode()
    with caplog.at_level("INFO", logger="tfpsx"):
        GeoTableUpdater(by_default).attach(table)
    (t,) = by_default.tables
    assert not t.share_slots and t.old.num_slots == 0
    assert "its rows travel without them" in caplog.text
    shared = _CountingMode()
    shared.named = frozenset({"geo_table_rule"})
    GeoTableUpdater(shared).attach(E.DynamicTable(f"acc{next(_names)}", DIM,
                                                  optimizer=E.Adagrad(0.1)))
    assert shared.tables[0].share_slots

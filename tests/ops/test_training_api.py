"""tfpsx.training's API in one process: strategy validation, misuse errors, placement."""

import pytest
import tensorflow as tf

import tfpsx
from tfpsx.runtime import RUNTIME as FLEET

PS = ["127.0.0.1:2001", "127.0.0.1:2002"]
WK = ["127.0.0.1:2003", "127.0.0.1:2004"]


@pytest.fixture
def worker():
    """This process as worker 1 of a 2 PS + 2 worker cluster (nothing is started)."""
    FLEET.reset()
    tfpsx.init(tfpsx.UserDefinedRoleMaker("worker", 1, PS, WK))
    yield
    FLEET.reset()


def test_strategy_modes():
    assert tfpsx.DistributedStrategy().mode == "async"
    assert tfpsx.DistributedStrategy(a_sync=False).mode == "sync"
    assert tfpsx.DistributedStrategy(a_sync_configs={"k_steps": 100}).mode == "geo"
    assert tfpsx.DistributedStrategy(a_sync_configs={"max_staleness": 3}).mode == "staleness"
    assert tfpsx.DistributedStrategy(collective=True).mode == "collective"
    hybrid = tfpsx.DistributedStrategy(a_sync_configs={"k_steps": 10}, dense="allreduce")
    assert hybrid.hybrid and hybrid.mode == "geo" and "dense='allreduce'" in repr(hybrid)
    assert not tfpsx.DistributedStrategy().hybrid
    assert hybrid.key() != tfpsx.DistributedStrategy(a_sync_configs={"k_steps": 10}).key()
    # GEO's rule comes by the worker count unless named: the rule for many workers from
    # 3 workers, the earlier one below; a named key keeps its value and shows in the repr.
    from tfpsx.modes.geo import rule_for
    geo = tfpsx.DistributedStrategy(a_sync_configs={"k_steps": 10})
    assert (geo.geo_table_rule, geo.geo_dense, geo.geo_hot_count) == (None, None, None)
    assert repr(geo) == "DistributedStrategy(mode='geo', k_steps=10, max_staleness=0)"
    many = {"geo_table_rule": "shared_slots", "geo_dense": "async", "geo_hot_count": 4,
            "geo_hot_per_round": "auto", "geo_table_choice": "auto"}
    earlier = {"geo_table_rule": "average", "geo_dense": "copies", "geo_hot_count": 0,
               "geo_hot_per_round": 0, "geo_table_choice": "rounds"}
    assert rule_for(geo, 2) == earlier and rule_for(geo, 3) == rule_for(geo, 32) == many
    assert rule_for(hybrid, 8) == dict(many, geo_dense="copies")  # dense all-reduced
    named = tfpsx.DistributedStrategy(a_sync_configs={"k_steps": 10, "geo_hot_count": 0})
    assert rule_for(named, 8) == dict(many, geo_hot_count=0) and rule_for(named, 2) == earlier
    assert named.geo_explicit == {"geo_hot_count"} and "geo_hot_count=0" in repr(named)
    assert named.key() != geo.key()
    # geo_hot_per_round: "auto" is the bound k_steps="auto" keeps in deterministic
    # rounds, half of it in background ones
    from tfpsx.modes.geo import hot_per_round
    assert hot_per_round(geo, 8) == 10 and hot_per_round(geo, 2) == 0
    inline = tfpsx.DistributedStrategy(a_sync_configs={"k_steps": 10,
                                                       "geo_sync_in_train_thread": True})
    assert hot_per_round(inline, 8) == 40
    per_round = tfpsx.DistributedStrategy(a_sync_configs={"k_steps": 10,
                                                          "geo_hot_per_round": 16})
    assert hot_per_round(per_round, 2) == hot_per_round(per_round, 8) == 16
    assert "geo_hot_per_round=16" in repr(per_round) and per_round.key() != geo.key()
    auto = tfpsx.DistributedStrategy(a_sync_configs={"k_steps": "auto"})
    assert auto.mode == "geo" and auto.k_auto and auto.k_steps == 10
    assert "k_steps='auto'" in repr(auto) and auto.key() != geo.key()

def test_a_joiner_runs_the_geo_rule_and_k_of_the_workers_the_job_started_with(caplog):
    """A rule is a job-wide decision: a worker that joins a 2-worker job (the scheduler
    tells every node the workers the job started with) runs the earlier rule and the
    K of 2 workers, as the first two do, on the same rows, and says so."""
    import dataclasses

    from tfpsx.cluster import ClusterConfig
    from tfpsx.keras.modes.geo import geo_class
    from tfpsx.modes.geo import rule_workers
    from tfpsx.training.modes.geo import mode_class

    first = ClusterConfig(role="worker", index=0, servers=tuple(PS), workers=tuple(WK),
                          initial_worker_num=2)
    joiner = dataclasses.replace(first, index=2, workers=tuple(WK) + ("127.0.0.1:2005",))
    assert joiner.joined and rule_workers(joiner) == rule_workers(first) == 2
    geo = tfpsx.DistributedStrategy(a_sync_configs={"k_steps": "auto"})
    assert mode_class(geo, joiner) is mode_class(geo, first)
    assert geo_class(geo, joiner) is geo_class(geo, first)

    class State:
        pass

    from tfpsx.modes.geo import adopt_rule, rule
    rule._LOGGED_RULES.clear()
    firsts, joined = State(), State()
    with caplog.at_level("INFO", logger="tfpsx"):
        adopt_rule(firsts, geo, first)
        rule._LOGGED_RULES.clear()  # (once per process: the joiner is another)
        adopt_rule(joined, geo, joiner)
    assert vars(firsts) == vars(joined) and not joined.share_slots
    assert "GEO at 2 worker(s): geo_table_rule='average'" in caplog.text
    assert "of the 2 workers it started with, though 3 train now" in caplog.text


@pytest.mark.parametrize("kwargs,words", [
    ({"a_sync_configs": {"k_steps": -1}}, ["k_steps", "-1", ">= 0"]),
    ({"a_sync_configs": {"k_steps": 2.5}}, ["k_steps", "2.5"]),
    ({"a_sync_configs": {"k_steps": "fast"}}, ["k_steps", "'fast'", "'auto'"]),
    ({"a_sync_configs": {"k_step": 10}}, ["unknown", "'k_step'", "k_steps"]),
    ({"a_sync_configs": {"max_staleness": True}}, ["max_staleness", "True"]),
    ({"a_sync": "yes"}, ["a_sync", "'yes'"]),
    ({"a_sync": False, "a_sync_configs": {"k_steps": 5}}, ["a_sync=True"]),
    ({"a_sync_configs": {"k_steps": 5, "max_staleness": 2}}, ["separate modes"]),
    ({"collective": 1}, ["collective", "True or False", "1"]),
    ({"collective": True, "a_sync_configs": {"k_steps": 5}}, ["all-reduce", "do not apply"]),
    ({"dense": "mirrored"}, ["dense", "'ps', 'allreduce'", "'mirrored'"]),
    ({"dense": "allreduce", "collective": True}, ["hybrid", "collective=True", "one of them"]),
    ({"dense": "allreduce", "a_sync": False}, ["hybrid", "a_sync=False"]),
    ({"dense": "allreduce", "a_sync_configs": {"max_staleness": 2}},
     ["hybrid", "max_staleness=2"]),
    ({"a_sync_configs": {"k_steps": 5, "geo_sync_in_train_thread": 1}},
     ["geo_sync_in_train_thread", "True or False"]),
    ({"a_sync_configs": {"k_steps": 5, "geo_table_rule": "sum"}},
     ["geo_table_rule", "'average', 'shared_slots'", "'sum'"]),
    ({"a_sync_configs": {"geo_table_rule": "shared_slots"}},
     ["geo_table_rule", "applies to GEO", "k_steps=0"]),
    ({"a_sync_configs": {"k_steps": 5, "geo_dense": "ps"}},
     ["geo_dense", "'copies', 'async'", "'ps'"]),
    ({"a_sync_configs": {"geo_dense": "async"}}, ["geo_dense", "applies to GEO", "k_steps=0"]),
    ({"a_sync_configs": {"k_steps": 5, "geo_dense": "async"}, "dense": "allreduce"},
     ["dense='allreduce'", "geo_dense']='async'", "does not apply"]),
    ({"a_sync_configs": {"k_steps": 5, "geo_hot_count": 2.5}},
     ["geo_hot_count", "int >= 0", "2.5"]),
    ({"a_sync_configs": {"geo_hot_count": 4}}, ["geo_hot_count", "applies to GEO"]),
    ({"a_sync_configs": {"k_steps": 5, "geo_hot_per_round": "many"}},
     ["geo_hot_per_round", "int >= 0", "'auto'", "'many'"]),
    ({"a_sync_configs": {"k_steps": 5, "geo_hot_per_round": -1}},
     ["geo_hot_per_round", "int >= 0", "-1"]),
    ({"a_sync_configs": {"geo_hot_per_round": "auto"}}, ["geo_hot_per_round", "applies to GEO"]),
    ({"a_sync": False, "a_sync_configs": {"sync_reduction": "avg"}},
     ["sync_reduction", "'mean', 'sum'", "'avg'"]),
    ({"a_sync_configs": {"sync_reduction": "sum"}}, ["sync_reduction", "applies to sync"]),
    ({"a_sync_configs": {"k_steps": 5, "geo_pull_ahead": "yes"}},
     ["geo_pull_ahead", "int >= 0", "'yes'"]),
    ({"a_sync_configs": {"geo_pull_ahead": 4}}, ["geo_pull_ahead", "applies to GEO", "k_steps=0"]),
    ({"a_sync_configs": {"k_steps": 5, "geo_pull_ahead": 4, "geo_sync_in_train_thread": True}},
     ["geo_pull_ahead']=4", "deterministic rounds", "one of them"]),
])
def test_bad_strategy_is_a_clear_error(kwargs, words):
    with pytest.raises(ValueError) as e:
        tfpsx.DistributedStrategy(**kwargs)
    for w in words:
        assert w in str(e.value)


def test_sync_from_splits_needs_every_workers_gradient_in_each_step(monkeypatch):
    """A step that drops some workers' gradients (replicas_to_aggregate < workers) would
    commit batches that are not in the model: refused, naming the fix; every worker's
    gradient (the default) trains from splits, as async, GEO and the hybrid."""
    from types import SimpleNamespace

    from tfpsx.modes.positions import check_feeds_splits

    with pytest.raises(ValueError, match=r"replicas_to_aggregate=1 of 3 workers.*leave "
                                         r"replicas_to_aggregate unset"):
        check_feeds_splits(SimpleNamespace(NAME="sync", replicas=1, worker_num=3))
    with pytest.raises(ValueError, match="replicas_to_aggregate=2 of 4"):  # graph mode's
        check_feeds_splits(SimpleNamespace(NAME="sync", replicas=2,
                                           config=SimpleNamespace(worker_num=4)))
    for fine in (SimpleNamespace(NAME="sync", replicas=3, worker_num=3),
                 SimpleNamespace(NAME="async"), SimpleNamespace(NAME="hybrid"), None):
        check_feeds_splits(fine)
    # Exact saves: refused where the workers meet inside a step (the hybrid's all-reduce,
    # GEO's deterministic rounds: a worker paused at the save's barrier would hold the
    # others where they cannot ack it); GEO's background rounds settle at the barrier.
    from tfpsx.control import splits as control_splits

    with monkeypatch.context() as patched:
        patched.setattr(control_splits, "registered",
                        lambda: {"input": SimpleNamespace(exact=True)})
        with pytest.raises(ValueError, match=r"exact_saves=True\) with geo_sync_in_train_"
                                             r"thread=True: .*give exact_saves=False"):
            check_feeds_splits(SimpleNamespace(NAME="geo", in_train_thread=True))
        check_feeds_splits(SimpleNamespace(NAME="geo", in_train_thread=False))
        check_feeds_splits(SimpleNamespace(NAME="sync", replicas=3, worker_num=3))
        for hybrid in (SimpleNamespace(NAME="hybrid", ROUNDS=True),
                       SimpleNamespace(NAME="hybrid")):
            with pytest.raises(ValueError, match=r"exact_saves=True\) with the hybrid: "
                                                 r".*give exact_saves=False"):
                check_feeds_splits(hybrid)
        check_feeds_splits(SimpleNamespace(NAME="async"))
    assert "sync_reduction='sum'" in repr(tfpsx.DistributedStrategy(
        a_sync=False, a_sync_configs={"sync_reduction": "sum"}))


def test_distributed_optimizer_before_init(monkeypatch):
    monkeypatch.setattr(FLEET, "config", None)
    with pytest.raises(tfpsx.errors.NotInitializedError, match=r"tfpsx.init\(\)"):
        tfpsx.distributed_optimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))


def test_collective_in_a_job_with_servers_is_a_clear_error(worker):
    with tf.Graph().as_default():
        with pytest.raises(ValueError, match=r"collective=True\) needs a collective job .*"
                           r"this one has 2 server"):
            with tfpsx.model_scope(tfpsx.DistributedStrategy(collective=True)):
                pass


@pytest.mark.parametrize("k_steps", [0, 10])
def test_hybrid_places_the_model_on_the_worker_and_refuses_variables_on_servers(
        worker, k_steps):
    hybrid = tfpsx.DistributedStrategy(a_sync_configs={"k_steps": k_steps}, dense="allreduce")
    with tf.Graph().as_default():
        with tfpsx.model_scope(hybrid):
            w = tf.compat.v1.get_variable("w", [3], initializer=tf.zeros_initializer())
        assert w.device == "/job:worker/task:1"
        assert tfpsx.training.mode_of().NAME == "hybrid"
    with tf.Graph().as_default():
        with tf.compat.v1.device(tfpsx.replica_device_setter()):  # not model_scope
            w = tf.compat.v1.get_variable("w", [3], initializer=tf.zeros_initializer())
        opt = tfpsx.distributed_optimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                          hybrid)
        with pytest.raises(ValueError, match=r"variables \['w:0'\] live on the parameter "
                                             r"servers.*tfpsx.model_scope\(strategy\)"):
            opt.minimize(tf.reduce_sum(w * w))


def test_geo_needs_an_optimizer_with_a_local_form(worker):
    geo = tfpsx.DistributedStrategy(a_sync_configs={"k_steps": 10})
    with tf.Graph().as_default():
        sync = tf.compat.v1.train.SyncReplicasOptimizer(
            tf.compat.v1.train.GradientDescentOptimizer(0.1), replicas_to_aggregate=2)
        with pytest.raises(ValueError, match="local form.*SyncReplicasOptimizer"):
            tfpsx.distributed_optimizer(sync, geo)
    with pytest.raises(ValueError, match="tf.compat.v1.train optimizer.*str"):
        tfpsx.distributed_optimizer("sgd", geo)
    with pytest.raises(ValueError, match="DistributedStrategy.*dict"):
        tfpsx.distributed_optimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                    {"k_steps": 10})


def test_geo_pull_ahead_in_graph_mode_reads_what_a_geo_read_ahead_records(worker, caplog):
    """Graph mode's rounds read ahead the ids the program records (tfpsx.GeoReadAhead):
    without one every round pulls every changed row, and says so; a reader of a table
    that is not one of the graph's GEO tables is refused when the rounds are built."""
    import logging

    from tfpsx import embedding as E
    from tfpsx.training.modes import mode_of

    ahead = tfpsx.DistributedStrategy(a_sync_configs={"k_steps": 10, "geo_pull_ahead": 4})
    assert "geo_pull_ahead=4" in repr(ahead)
    assert ahead.key() != tfpsx.DistributedStrategy(a_sync_configs={"k_steps": 10}).key()
    with tf.Graph().as_default():
        with tfpsx.model_scope(ahead):
            tf.compat.v1.get_variable("w", [2])
        mode = mode_of()
        assert mode.ahead.every == 4
        hook = mode._sync_hook
        with caplog.at_level(logging.WARNING, logger="tfpsx"):
            hook._begin_ahead()
        assert ("geo_pull_ahead=4 reads no ids ahead here (graph mode reads the ids the "
                "program records: create a tfpsx.GeoReadAhead") in caplog.text
        assert hook._among is None  # (every round pulls every changed row)
        tfpsx.GeoReadAhead([E.DynamicTable("not_geo", 2, devices=[None])])
        with pytest.raises(ValueError, match=r"\['not_geo'\] are not GEO tables of this graph"):
            hook._begin_ahead()


def test_geo_rejects_variables_made_outside_model_scope(worker):
    geo = tfpsx.DistributedStrategy(a_sync_configs={"k_steps": 10, "geo_dense": "copies"})
    with tf.Graph().as_default():
        stray = tf.compat.v1.get_variable("stray", [3], initializer=tf.zeros_initializer())
        loss = tf.reduce_sum(tf.square(stray))
        opt = tfpsx.distributed_optimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), geo)
        with pytest.raises(ValueError, match="stray.*model_scope"):
            opt.minimize(loss)


def test_placement_balances_bytes_and_geo_copies_stay_local(worker):
    geo = tfpsx.DistributedStrategy(a_sync_configs={"k_steps": 10, "geo_dense": "copies"})
    with tf.Graph().as_default():
        with tfpsx.model_scope(geo):
            big = tf.compat.v1.get_variable("big", [1000, 8])
            small = [tf.compat.v1.get_variable(f"s{i}", [10]) for i in range(3)]
            step = tf.compat.v1.train.get_or_create_global_step()
            loss = tf.reduce_sum(big) + tf.add_n([tf.reduce_sum(s) for s in small])
            opt = tfpsx.distributed_optimizer(tf.compat.v1.train.AdamOptimizer(0.1), geo)
            opt.minimize(loss, global_step=step)
        devices = {v.op.name: v.device for v in tf.compat.v1.global_variables()}
        local = {v.op.name: v.device for v in tf.compat.v1.local_variables()}
    # The big table alone on one server, the small ones and the step on the other.
    assert devices["big"] != devices["s0"] == devices["s1"] == devices["s2"]
    assert set(devices) == {"big", "s0", "s1", "s2", "global_step"}  # no slot on the PS
    assert local["big_geo_local"] == local["big_geo_old"] == "/job:worker/task:1"
    assert all(d == "/job:worker/task:1" for d in local.values()), local
    assert any("Adam" in name for name in local)  # the slots are worker-local


def test_sync_with_another_worker_count_than_the_cluster(worker):
    plain = tf.compat.v1.train.GradientDescentOptimizer(0.1)
    with tf.Graph().as_default():
        with pytest.raises(ValueError, match=r"replicas_to_aggregate in 1..2.*got 3"):
            tfpsx.distributed_optimizer(plain, tfpsx.DistributedStrategy(
                a_sync=False, a_sync_configs={"replicas_to_aggregate": 3}))
        theirs = tf.compat.v1.train.SyncReplicasOptimizer(plain, replicas_to_aggregate=3,
                                                          total_num_replicas=3)
        with pytest.raises(ValueError, match="total_num_replicas=3.*cluster has 2 workers"):
            tfpsx.distributed_optimizer(theirs, tfpsx.DistributedStrategy(a_sync=False))


def test_sync_needs_a_global_step(worker):
    with tf.Graph().as_default():
        with tfpsx.model_scope(tfpsx.DistributedStrategy(a_sync=False)):
            v = tf.compat.v1.get_variable("v", [2])
            opt = tfpsx.distributed_optimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                              tfpsx.DistributedStrategy(a_sync=False))
            with pytest.raises(ValueError, match="sync training needs a global step"):
                opt.minimize(tf.reduce_sum(v))


def test_geo_optimizer_and_model_scope_must_share_the_strategy(worker):
    with tf.Graph().as_default():
        with tfpsx.model_scope(tfpsx.DistributedStrategy(a_sync_configs={"k_steps": 10})):
            v = tf.compat.v1.get_variable("v", [2])
            opt = tfpsx.distributed_optimizer(
                tf.compat.v1.train.GradientDescentOptimizer(0.1),
                tfpsx.DistributedStrategy(a_sync_configs={"k_steps": 50}))
            with pytest.raises(ValueError, match="k_steps=10.*k_steps=50"):
                opt.minimize(tf.reduce_sum(v))


def test_a_session_that_would_save_a_tiered_table_whole_is_refused_before_it_starts(
        worker, tmp_path):
    # TF's own Saver would take the tiered table whole at every checkpoint: refused
    # before any session starts (nothing connects), naming incremental_checkpoints.
    from tfpsx import embedding as E

    with tf.Graph().as_default():
        table = E.DynamicTable("tiered_session", 4, devices=[None], backend=E.TieredBackend(
            str(tmp_path / "tier"), ram_bytes=1_600_000))
        table.lookup(tf.constant([1], tf.int64))
        with pytest.raises(ValueError, match=r"table\(s\) \['tiered_session'\] have a disk "
                                             r"tier.*incremental_checkpoints=M"):
            tfpsx.MonitoredTrainingSession(checkpoint_dir=str(tmp_path / "ckpt"))

"""Keras 3 fit on local clusters (tests/cluster/scripts/keras_job.py), every mode."""

import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import SCRIPTS, scenario, wait_for_log
from test_training import geo_reference, served_outputs
from serving_follow_check import follow
import training_job as linear

import tfpsx
from tfpsx.launcher import loopback
from tfpsx.modes.state import GEO_TABLE_CHOICE, states_of

FAST = {"TFPSX_HEARTBEAT_TIMEOUT": "6"}
# A model that did not learn predicts the base rate: log loss ~0.69 on the planted clicks.
LEARNED = 0.45


def reports(c, workers):
    out = {}
    for i in range(workers):
        records = c.metrics("worker", i, "keras")
        assert records, f"worker {i} emitted no 'keras' record:\n{c.logs()}"
        out[i] = records[-1]
    return out


def finish(c, timeout=200):
    codes = c.wait(timeout=timeout)
    assert all(code == 0 for code in codes.values()), f"{codes}\n{c.logs()}"


@pytest.mark.budget(45, why="a cluster of 1 PS + 2 Keras workers: 3 TensorFlow imports and fit's "
                            "tracing, 3 epochs")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode,extra", [
    # (async: make test's Keras async job is the two-server scenario below)
    pytest.param("async", [], marks=pytest.mark.slow),
    # The users' table on the PS's disk beyond 2 MB (TieredBackend): its 200 rows stay in
    # RAM; the spills are driven in one process (tests/ops/test_tiered_table.py).
    pytest.param("sync", ["--table_ram_bytes", "2000000"], id="sync"),
    # GEO's communicator traces its sync while fit starts (0.7 s, more on a loaded
    # machine): steps of 20 ms leave it time to sync during fit, as a real fit does.
    # GEO's rule for many workers, named: tables by shared slots, the dense weights async
    # on the PS, the ids seen 4+ times in a batch (tags of 100 values) read and trained
    # there. The tags' table has a worker cache of 60 rows, which follows the rule (its
    # rows travel with their slots, its hot ids train on the PS); the users' table has
    # none. geo_hot_per_round=4 (K x N = 16 steps of a row a round, over it): the ids
    # the workers would train 4+ times in a round train on the PS too.
    pytest.param("geo", ["--k_steps", "8", "--step_delay", "0.02", "--geo_rule", "many",
                         "--cache_size", "60", "--cache_table", "tags_emb",
                         "--geo_hot_per_round", "4"],
                 id="geo-rule-for-many"),
    # Nothing named, k_steps="auto": at 2 workers tfpsx chooses the earlier rule (averaged
    # rows, worker copies of the dense weights), and K = 32 local steps // 8 rounds = 4.
    # The users' table tiered on the PS (2 MB): GEO's pushes and pulls go through it. The
    # deep kernel has a constraint (Keras assigns it after each update): its copy is
    # pulled beside it (tfpsx.keras.read_assign). geo_pull_ahead=2: two rounds of three
    # pull only the changed rows among the ids fit's input read ahead (the pull among
    # keys against numpy: tests/ops/test_geo_pull_ahead.py).
    pytest.param("geo", ["--k_steps", "auto", "--step_delay", "0.02", "--geo_rule",
                         "default", "--table_ram_bytes", "2000000", "--constrain",
                         "--geo_pull_ahead", "2"], id="geo"),
    # The users' table tiered on its PS here too (TieredBackend, 2 MB).
    pytest.param("staleness", ["--max_staleness", "2", "--table_ram_bytes", "2000000"],
                 id="staleness")])
def test_wide_and_deep_trains_in_every_mode(make_cluster, tmp_path, mode, extra):
    if "--table_ram_bytes" in extra:
        extra = extra + ["--table_dir", str(tmp_path / "tables")]
    c = make_cluster(1, 2, script="keras_job.py", env=FAST, timeout=240,
                     args=["--mode", mode] + extra).start()
    finish(c)
    got = reports(c, 2)
    steps = sum(r["local_steps"] for r in got.values())
    for r in got.values():
        assert r["eval_loss"] < LEARNED, r
        assert r["train_loss"][-1] < r["train_loss"][0], r
    chief = got[0]
    # the protocol's variables on PS 0 are the core's, under its names
    # (and GEO's choice between rounds and async under the rule for many workers)
    state = [s.name for s in states_of(mode)] + (
        [GEO_TABLE_CHOICE.name] if "many" in extra else [])
    assert all(r["mode_state"] == state for r in got.values()), got
    if mode in ("async", "staleness"):
        # iterations is the global step: every worker's steps, on PS 0.
        assert chief["kernel_device"].startswith("/job:ps/")
        assert max(r["iterations"] for r in got.values()) == steps, got
    if "--table_ram_bytes" in extra:  # the users' table is tiered on the PS, within 2 MB
        tier = chief["tiers"]["user_emb"]
        assert 0 < tier["ram_bytes"] <= 2_000_000, chief["tiers"]
        assert os.listdir(tmp_path / "tables" / "user_emb") == ["part_0"]
    if mode == "sync":
        assert chief["kernel_device"].startswith("/job:ps/")
        # one aggregated step per pair of worker steps (equal shards: equal step counts)
        assert got[0]["local_steps"] == got[1]["local_steps"]
        assert all(r["iterations"] == r["local_steps"] for r in got.values()), got
    if mode == "geo":
        # the PS's dense weights (the rule for many workers), or a local copy (the earlier
        # rule, chosen at 2 workers when nothing is named)
        many = "many" in extra
        where = "/job:ps/" if many else "/job:worker/"
        if not many:
            assert "GEO at 2 worker(s): geo_table_rule='average', geo_dense='copies', " \
                   "geo_hot_count=0, geo_hot_per_round=0, geo_table_choice='rounds' (by the " \
                   "worker count" in c.log("worker", 0)
        assert chief["kernel_device"].startswith(where), chief["kernel_device"]
        # 32 local steps an epoch. K = 8: 4 rounds, and fit says they are too few; "auto":
        # K = 4, 8 rounds.
        k = 8 if many else 4
        if many:
            assert "GEO: k_steps=8 leaves 4 round(s) in an epoch of 32 local steps" in c.log(
                "worker", 0)
            for table in ("user_emb", "tags_emb"):  # both tables, the cached one too
                assert (f"{table}/geo_contention_w0: a round sums up to K x N = 8 x 2 = 16 "
                        "steps of a row, over geo_hot_per_round=4") in c.log("worker", 0)
        else:
            assert "GEO: k_steps='auto' is 4 (8 rounds in an epoch of 32 local steps" in \
                c.log("worker", 0)
            for w in (0, 1):
                assert "GEO: 1 dense weight(s) written by a read and an assign in the step " \
                       "(a constraint): rounds pull beside them" in c.log("worker", w)
            assert "round(s) in an epoch" not in c.log("worker", 0)
            # geo_pull_ahead=2: the window is 2K + 2 x 2 steps an execution + 2 = 14
            # batches; the input reads 2 x 10 (auto's largest K at 2 workers) + 8 ahead.
            for w in (0, 1):
                assert ("GEO: geo_pull_ahead=2: a round pulls the changed rows among the "
                        "ids of the next 14 batches (read ahead)") in c.log("worker", w)
            # Each epoch's rounds near its end pull every changed row (the input ends
            # there), and every third round does: at least 1 and at most 2 of 3 ahead.
            for r in got.values():
                assert 1 <= r["pulls_ahead"] <= (2 * r["pushes"]) // 3 + 1, r
        # The PS's Adagrad accumulators hold the workers' squared gradients, pushed with
        # the rows; under the average they stay at their initial 0.1.
        grown = [m > 0.1 + 1e-4 for m in chief["ps_slot_means"].values()]
        assert all(grown) if many else not any(grown), chief
        if many:
            # geo_table_choice="auto" (the rule's): the users' table starts async and the
            # chief chooses for it from its counters, every worker follows; the cached
            # tags' table always runs rounds.
            said = c.log("worker", 0)
            assert "GEO: table 'user_emb' " in said and "tags_emb' t" not in said, said
            switches = [line for line in said.splitlines() if "GEO: table 'user_emb' " in line
                        and ("tries rounds:" in line or "trains async from now" in line)]
            async_now = not switches or "trains async from now" in switches[-1]
            assert (chief["tables_async"], chief["table_switches"]) == (
                int(async_now), len(switches)), (chief, switches)
            assert got[1]["table_switches"] <= len(switches), got[1]  # (as it read them)
            # Keras traces the step again for each table state (AsyncRows while async):
            # when a table's copy caught up and when it went back to async.
            traced = said.count("traced again")
            print("the users' table's switches:", switches, "steps traced again:", traced)
            assert traced <= 2 * len(switches), (traced, switches)
            if any("trains async from now" in line for line in switches):
                assert traced >= 2, (traced, switches)
        if many:  # the tags' cache, under the rule: its rows came with their slots
            for r in got.values():
                (stats,) = r["caches"].values()
                assert stats["rows_fetched"] > 0, r["caches"]
                # a key and [value | Adagrad accumulator]: 8 + 4 * 2 * 8 bytes a row
                assert stats["bytes_fetched"] == stats["rows_fetched"] * (8 + 4 * 16), stats
        # What the tables moved against what async would have moved for the rows the
        # steps trained (each worker logs it when fit ends): the hot rows on the PS (the
        # rule's), the rounds' bytes, and the ratio in the log.
        for i, r in got.items():
            assert r["trained_rows"] >= r["hot_rows"] >= (1 if many else 0), r
            assert r["table_bytes"] > 0 and r["async_table_bytes"] > 0, r
            ratio = (r["table_bytes"] + r["hot_table_bytes"]) / r["async_table_bytes"]
            assert (f"GEO on worker {i}, {r['local_steps']} local steps: its tables moved"
                    in c.log("worker", i)), c.log("worker", i)[-2000:]
            assert f"{ratio:.2f}x the" in c.log("worker", i)
        # The communicator syncs during fit (not only the final sync), at most once per
        # K local steps: a round that lags behind training merges the wake-ups it missed.
        assert all(2 <= r["pushes"] <= r["local_steps"] // k + 1 for r in got.values()), \
            [(r["pushes"], r["local_steps"]) for r in got.values()]
        # every worker's local steps, as pushed; the last worker's final sync saw them all
        assert max(r["iterations"] for r in got.values()) == steps, \
            [(r["iterations"], r["local_steps"], r["pushes"]) for r in got.values()]


@pytest.mark.budget(50, why="a cluster of 1 PS + 2 Keras workers staging every batch through "
                            "their caches")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode,extra", [
    ("async", []),
    pytest.param("geo", ["--k_steps", "8", "--step_delay", "0.02"], marks=pytest.mark.slow)])
def test_worker_caches_are_fed_by_fits_input_pipeline(make_cluster, mode, extra):
    """Both tables with a worker cache of 24 rows (200 users, 100 tags): fit's dataset
    stages every batch's rows before the step takes it, so the steps fetch nothing from
    the PS (every fetched row was staged) while steps_per_execution=2 and validations
    run; the users' cache evicts (never a row of the 7 batches staged last: nearly
    every tag is in each batch, so the tags' cache keeps all 100); the model learns."""
    c = make_cluster(1, 2, script="keras_job.py", env=FAST, timeout=240,
                     args=["--mode", mode, "--cache_size", "24"] + extra).start()
    finish(c)
    for r in reports(c, 2).values():
        assert r["eval_loss"] < LEARNED, r
        assert set(r["caches"]) == {"user_emb", "tags_emb"}, r
        for name, stats in r["caches"].items():
            assert stats["rows_fetched"] > 0 and stats["prefetched"] == stats["rows_fetched"], \
                (name, stats)
            if name == "user_emb":
                assert stats["evictions"] > 0 and stats["size"] < 200, (name, stats)
            assert 0 < stats["hit_rate"] < 1, (name, stats)
            if mode == "async":
                assert stats["flushes"] >= 1, (name, stats)


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory):
    """The async job on 2 PS + 2 workers that the next tests read: weights of 512 bytes or
    more cut over both servers, the users' table tiered, the chief's saved model
    (model.save) and its serving export (tfpsx.export_serving) written after fit, its
    incremental checkpoints published for serving (a base, then deltas); worker 1's last
    step after the chief's fit returned. (c, folder of the saved files)"""
    out = tmp_path_factory.mktemp("keras_two_servers_out")
    # tfpsx installed under a path with a space (a virtualenv in "My Projects"): the
    # loader splits LD_PRELOAD there, so the launcher preloads a copy of the bind shim.
    spaced = out / "My Projects" / os.path.basename(loopback.shim_path())
    spaced.parent.mkdir()
    spaced.write_bytes(open(loopback.shim_path(), "rb").read())
    # The users' table on the servers' disk beyond 2 MB a shard (TieredBackend): async,
    # a shard on each server, saved with model.save and served from the export.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loopback, "shim_path", lambda: str(spaced))
        with scenario(tmp_path_factory, "keras_two_servers", 2, 2, script="keras_job.py",
                      env=FAST, timeout=300,
                      args=["--mode", "async", "--epochs", "2", "--partition_bytes", "512",
                            "--last_step_after_chief", str(out / "chief_fit_ended"),
                            "--save", str(out / "saved"), "--export", str(out / "export"),
                            "--checkpoint", str(out / "ckpt"), "--incremental", "5",
                            "--publish", str(out / "published"),
                            "--table_ram_bytes", "2000000", "--own_server",
                            "--table_dir", str(out / "tables")]) as c:
            yield c, out


def test_the_jobs_tensorflow_servers_listen_on_loopback_only(two_servers):
    # TF binds 0.0.0.0 on its own; every server and worker of a local job (its own port
    # each) listened, and on loopback only, read from /proc/net/tcp* while it ran, with
    # tfpsx installed under a path with a space; the workers' own servers on 0.0.0.0
    # stayed there.
    c, _ = two_servers
    assert "tfpsx-preload-" in c.shim and " " not in c.shim, c.shim  # the shim's copy
    assert sorted(c.listeners) == sorted(c.tf_ports()), (c.listeners, c.tf_ports())
    assert loopback.exposed({p: list(a) for p, a in c.listeners.items()}) == {}, c.listeners
    assert all(a in ("127.0.0.1", "::ffff:127.0.0.1") for s in c.listeners.values() for a in s)
    for r in reports(c, 2).values():
        assert r["own_server"] == ["0.0.0.0"], r["own_server"]


@pytest.mark.timeout(400)
def test_two_servers_share_the_model(two_servers):
    # Weights of 1 KiB or more are cut in two (a slice per server); the model trains.
    c, _ = two_servers
    got = reports(c, 2)
    assert all(r["eval_loss"] < LEARNED for r in got.values()), got
    for r in got.values():
        assert r["train_loss"][-1] < r["train_loss"][0], r
    # iterations is the global step: every worker's steps, on PS 0.
    steps = sum(r["local_steps"] for r in got.values())
    assert max(r["iterations"] for r in got.values()) == steps, got
    for i in range(2):  # each server holds a share of the weights and the tables' shards
        assert "serving at" in c.log("server", i)
    # the users' table: a tiered shard on each server, in its folder, within its budget
    tier = got[0]["tiers"]["user_emb"]
    assert 0 < tier["ram_bytes"] <= 2 * 2_000_000, got[0]["tiers"]
    assert sorted(os.listdir(two_servers[1] / "tables" / "user_emb")) == ["part_0", "part_1"]
    cut = got[0]["partitioned"]
    assert cut, "no weight was partitioned"
    for path, devices in cut.items():  # each weight's slices are on both servers
        assert sorted(d.split("/task:")[1][0] for d in devices) == ["0", "1"], (path, devices)


@pytest.mark.timeout(300)
@pytest.mark.slow
@pytest.mark.parametrize("workers,servers", [(1, 1), (2, 1), (2, 2)])
def test_deterministic_geo_equals_graph_mode_geo(make_cluster, workers, servers):
    """The graph-mode test compares GEO with the numpy replay of the rule: Keras GEO on the
    same data, model and schedule gives the same global values (with 2 servers, the
    kernel's global value is cut in two slices, one on each)."""
    k, syncs = 5, 4
    c = make_cluster(servers, workers, script="keras_job.py", env=FAST, timeout=240,
                     args=["--model", "linear", "--mode", "geo", "--k_steps", str(k),
                           "--syncs", str(syncs), "--deterministic",
                           "--partition", str(servers)]).start()
    finish(c)
    want_w, want_b = geo_reference(workers, k, syncs)
    for r in reports(c, workers).values():
        assert len(r["partitioned"]) == (servers > 1), r["partitioned"]
        assert r["pushes"] == syncs
        np.testing.assert_allclose(r["global_w"], want_w.ravel(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(r["global_b"], want_b, rtol=1e-5, atol=1e-6)
        assert r["iterations"] == workers * k * syncs  # the job's global step


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_keras_geo_rounds_on_the_cores_schedule_across_fits(make_cluster):
    """The core's schedule decides Keras's in-step rounds: after a fit that ends off a
    multiple of K (its final round pushes the rest), the next round comes K steps on.
    K = 5, two fits of 8 steps: rounds at 5, 8 (final), 13, 16 (final); a round at every
    multiple of K would add one (5, 8, 10, 15, 16). Its own cluster (slow): no scenario
    runs two deterministic fits."""
    c = make_cluster(1, 1, script="keras_job.py", env=FAST, timeout=200,
                     args=["--model", "linear", "--mode", "geo", "--k_steps", "5",
                           "--fit_steps", "8,8", "--deterministic"]).start()
    finish(c)
    (r,) = reports(c, 1).values()
    assert r["pushes"] == 4, r
    assert r["iterations"] == 16, r
    want_w, want_b = geo_reference(1, 16, 1)  # one worker: GEO is SGD, whatever the rounds
    np.testing.assert_allclose(r["global_w"], want_w.ravel(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(r["global_b"], want_b, rtol=1e-5, atol=1e-6)


def sync_reference(workers: int, steps: int):
    """Sync SGD in numpy: every step averages one gradient of each worker's batch."""
    w, b = np.zeros((linear.DIM, 1), np.float32), np.float32(0)
    data = [list(linear.batches(i, steps)) for i in range(workers)]
    for s in range(steps):
        gw, gb = np.zeros_like(w), np.float32(0)
        for i in range(workers):
            x, y = data[i][s]
            err = (x @ w)[:, 0] + b - y
            gw += (2.0 / linear.BATCH) * (x.T @ err[:, None]) / workers
            gb += np.float32((2.0 / linear.BATCH) * err.sum() / workers)
        w = (w - np.float32(linear.LR) * gw).astype(np.float32)
        b = np.float32(b - np.float32(linear.LR) * gb)
    return w, b


@pytest.mark.timeout(300)
@pytest.mark.slow
@pytest.mark.parametrize("servers", [1, 2])
def test_sync_applies_one_gradient_of_each_worker_per_step(make_cluster, servers):
    steps = 25
    # Worker 1 is slow: a fast worker that supplied two gradients of a step would show.
    # With 2 servers the kernel is cut in two slices (the chief's update reaches both).
    c = make_cluster(servers, 2, script="keras_job.py", env=FAST, timeout=240,
                     args=["--model", "linear", "--mode", "sync", "--steps", str(steps),
                           "--partition", str(servers)]).start()
    finish(c)
    want_w, want_b = sync_reference(2, steps)
    for r in reports(c, 2).values():
        assert len(r["partitioned"]) == (servers > 1), r["partitioned"]
        assert r["iterations"] == steps
        np.testing.assert_allclose(r["global_w"], want_w.ravel(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(r["global_b"], want_b, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_sync_with_a_killed_worker_is_a_cluster_timeout(make_cluster):
    c = make_cluster(1, 2, script="keras_job.py",
                     env=dict(FAST, TFPSX_SYNC_STEP_TIMEOUT="4"), timeout=240,
                     args=["--mode", "sync", "--epochs", "50", "--step_delay", "0.01"]).start()
    wait_for_log(c, "worker", 1, "Epoch 1/", timeout=120)
    c.kill("worker", 1)
    codes = c.wait([("worker", 0)], timeout=60)
    assert codes[("worker", 0)] != 0
    log = c.log("worker", 0)
    assert "ClusterTimeoutError" in log and "TFPSX_SYNC_STEP_TIMEOUT" in log, log[-3000:]
    assert "worker(s) [1]" in log, log[-3000:]


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_sync_fails_fast_when_the_scheduler_reports_the_worker_dead(make_cluster):
    """With a scheduler, a killed worker is known dead after TFPSX_HEARTBEAT_TIMEOUT: the
    chief's wait for its gradients fails then, naming it, not after the step timeout."""
    c = make_cluster(1, 2, script="keras_job.py", config_mode="scheduler",
                     env=dict(FAST, TFPSX_SYNC_STEP_TIMEOUT="300"), timeout=240,
                     args=["--mode", "sync", "--epochs", "50", "--step_delay", "0.01"]).start()
    wait_for_log(c, "worker", 1, "Epoch 1/", timeout=120)
    c.kill("worker", 1)
    killed = time.monotonic()
    codes = c.wait([("worker", 0)], timeout=120)
    assert codes[("worker", 0)] != 0
    assert time.monotonic() - killed < int(FAST["TFPSX_HEARTBEAT_TIMEOUT"]) + 30, c.logs()
    log = c.log("worker", 0)
    assert re.search(r"ClusterTimeoutError: sync: worker 0 waited [\d.]+ s for step \d+, which "
                     r"cannot complete: worker 1 at 127\.0\.0\.1:\d+ died", log), log[-3000:]


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_uneven_shards_do_not_deadlock_sync(make_cluster):
    c = make_cluster(1, 2, script="keras_job.py", env=FAST, timeout=240,
                     args=["--mode", "sync", "--epochs", "2", "--uneven"]).start()
    finish(c)
    got = reports(c, 2)
    assert got[0]["local_steps"] > 2 * got[1]["local_steps"], got
    assert got[0]["eval_loss"] < 0.69, got


@pytest.mark.timeout(400)
def test_the_chief_saves_a_model_that_reloads_without_a_cluster(two_servers):
    out = two_servers[1] / "saved"
    check = (
        "import sys, numpy as np, keras, tensorflow as tf, tfpsx.keras\n"
        f"m = keras.models.load_model({str(out / 'model.keras')!r})\n"
        f"x = np.load({str(out / 'eval_features.npy')!r}, allow_pickle=True).item()\n"
        "x = {k: tf.constant(v) for k, v in x.items()}\n"
        f"want = np.load({str(out / 'predictions.npy')!r})\n"
        "got = m.predict(x, verbose=0)\n"
        "np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)\n"
        "print('RELOADED', got.shape)\n")
    proc = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0 and "RELOADED (2048, 1)" in proc.stdout, \
        proc.stdout + proc.stderr[-3000:]


def check_served(out, tmp_path):
    """The export in ``out`` serves, without tfpsx, what the chief's predict gave."""
    assert sorted(os.listdir(out / "model")) == ["1"]
    want = np.load(out / "predictions.npy")
    for loader, got in served_outputs(out / "model" / "1", out / "feed.npz", tmp_path).items():
        (name,) = got
        np.testing.assert_allclose(got[name], want, rtol=0, atol=1e-6, err_msg=loader)


@pytest.mark.timeout(400)
def test_the_chief_exports_a_model_that_serves_without_tfpsx(two_servers, tmp_path):
    """Async: the tables' rows come from their shards on two PS (the weights cut over both).
    Served in a process without tfpsx (TF2 and TF1 loaders)."""
    check_served(two_servers[1] / "export", tmp_path)


@pytest.mark.timeout(400)
def test_the_chiefs_published_base_and_deltas_serve_what_its_export_serves(two_servers,
                                                                           tmp_path):
    """The chief published a base and deltas while both workers trained (the users'
    table tiered: its delta parts in pages); followed in a process without tfpsx, they
    serve exactly what the export taken after the last step serves. Its last delta
    holds worker 1's steps after the chief's last one, in the partitioned kernel too
    (the servers' slices, not the chief's view as its last step read them)."""
    c, out = two_servers
    published = reports(c, 2)[0]["published"]
    assert published["kind"] == "delta" and published["sequence"] >= 2, published
    got = follow(out / "published", out / "export" / "model" / "1",
                           dict(np.load(out / "export" / "feed.npz")), tmp_path)
    assert (got["base"], got["sequence"]) == (1, published["sequence"]), got
    assert got["applied"] >= 1 and got["diff"] == 0.0 and got["tf1_diff"] == 0.0, got
    assert got["unregistered_ops"] == [] and got["tfpsx_imported"] is False, got


@pytest.mark.timeout(400)
@pytest.mark.slow
def test_a_geo_chief_exports_its_copy_that_serves_without_tfpsx(make_cluster, tmp_path):
    """GEO: the rows come from the chief's copy, as predict reads them (a job of its own:
    the mode differs from the two-server scenario's)."""
    out = tmp_path / "export"
    c = make_cluster(2, 2, script="keras_job.py", env=FAST, timeout=300,
                     args=["--mode", "geo", "--k_steps", "8", "--epochs", "1", "--export",
                           str(out)])
    finish(c.start(), timeout=300)
    check_served(out, tmp_path)


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_the_same_model_code_runs_without_a_cluster(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, "keras_job.py"), "--local",
                           "--epochs", "2"], capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, TFPSX_METRICS_DIR=str(tmp_path),
                                   PYTHONPATH=SCRIPTS + os.pathsep + os.environ.get("PYTHONPATH", ""),
                                   TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    r = tfpsx.metrics.read(str(tmp_path), "local", 0, "keras")[-1]
    assert r["eval_loss"] < LEARNED, r


@pytest.mark.timeout(400)
@pytest.mark.slow
@pytest.mark.parametrize("mode,extra", [("geo", ["--k_steps", "8"])])
def test_a_restarted_job_resumes_from_the_chiefs_checkpoint(make_cluster, tmp_path, mode, extra):
    """ModelCheckpoint (weights, tables included) on the chief; a new job (new servers)
    whose chief restores them before fit starts from the trained model, not a new one.
    (IncrementalCheckpoint's restore: test_launcher's Keras --max_restarts test.)"""
    ckpt = str(tmp_path / "ckpt")
    first = make_cluster(1, 2, script="keras_job.py", env=FAST, timeout=240,
                         args=["--mode", mode, "--epochs", "2", "--checkpoint", ckpt] + extra)
    finish(first.start())
    trained = reports(first, 2)[0]
    # A new model has not learned (its loss is random-init's, measured 0.58 .. 0.93); the
    # trained one has, by an amount that varies with the schedule (GEO k=8 once ended at
    # 0.458 from 0.932). The restored model must start nearer the trained loss than the
    # new one: below the midpoint of the two.
    start, end = trained["loss_before_fit"], trained["val_loss"][-1]
    assert end < start - 0.1, trained
    midpoint = (start + end) / 2
    again = make_cluster(1, 2, script="keras_job.py", env=FAST, timeout=240,
                         args=["--mode", mode, "--epochs", "1", "--checkpoint", ckpt] + extra)
    finish(again.start())
    for r in reports(again, 2).values():
        # Every worker starts from the restored model (its tables too).
        assert r["loss_before_fit"] < midpoint, (r, trained)


@pytest.mark.timeout(300)
def test_misuse_is_a_clear_error(make_cluster):
    c = make_cluster(1, 1, script="keras_misuse.py", env=FAST, timeout=200).start()
    finish(c)
    got = c.metrics("worker", 0, "misuse")[-1]
    assert got["fine"] is None, got
    assert got["before_init_worker"].startswith("RuntimeError") and \
        "tfpsx.init_worker() first" in got["before_init_worker"]
    # Keras is not patched: its own fit / evaluate / predict after a strategy exists, and a
    # model built outside the scope trains locally with no error.
    assert got["untouched"] == {"fit": True, "evaluate": True, "predict": True}, got
    assert got["outside_scope"] is None, got["outside_scope"]
    for case in ("without_callbacks", "callbacks_then_without"):
        assert "callbacks=strategy.callbacks()" in (got[case] or ""), (case, got[case])
    assert got["without_callbacks"].startswith("ValueError"), got["without_callbacks"]
    assert "compiled outside" in got["compiled_outside"]
    assert "jit_compile=True cannot work" in got["jit_compile"] and \
        "jit_compile=False" in got["jit_compile"]
    assert "gradient_accumulation_steps=4" in got["gradient_accumulation"]
    for case in ("built_outside_adam", "built_outside_sgd"):  # (TF's raw error; trained)
        assert (got[case] or "").startswith("ValueError: model weight"), (case, got[case])
        assert "created outside tfpsx.keras.ParameterServerStrategy.scope()" in got[case]
        assert "build it inside `with strategy.scope():`" in got[case], got[case]
    assert "unknown a_sync_configs key(s) ['k_step']" in got["bad_options"]
    # GEO's dense copies with an optimizer's moving average (Keras assigns it to the
    # weights): refused before a step, naming the option and what to do.
    ema = got["geo_with_ema"] or ""
    assert ema.startswith("ValueError: GEO cannot train this model's 2 dense weight(s), "
                          "copies on this worker, with use_ema=True (Adam)"), ema
    assert "Compile with use_ema=False" in ema, ema
    assert got["geo_with_ema_untouched"] is True, got
    # Exact saves where the workers meet inside a step (the hybrid's all-reduce, GEO's
    # deterministic rounds): a worker paused at the save's barrier would hold the others
    # where they cannot ack it; refused before a step trains.
    got_hybrid = got["splits_exact_hybrid_geo"] or ""
    assert got_hybrid.startswith("ValueError"), got_hybrid
    assert "exact_saves=True) with the hybrid" in got_hybrid, got_hybrid
    in_step = got["splits_exact_geo_in_step"] or ""
    assert in_step.startswith("ValueError"), in_step
    assert "exact_saves=True) with geo_sync_in_train_thread=True" in in_step, in_step


def test_the_strategy_before_init_names_the_call(monkeypatch):
    from tfpsx.runtime import RUNTIME

    monkeypatch.setattr(RUNTIME, "config", None)
    with pytest.raises(tfpsx.errors.NotInitializedError,
                       match=r"keras.ParameterServerStrategy\(\) needs the cluster: call "
                             r"tfpsx.init\(\) first"):
        tfpsx.keras.ParameterServerStrategy()


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_a_worker_joins_a_running_keras_fit(make_cluster):
    """Elastic in Keras: a third worker started while two run fit (async) joins through
    the scheduler (TFPSX_MAX_WORKER_NUM=3), connects its eager context like the others,
    trains its shard and the job ends with code 0 everywhere."""
    c = make_cluster(1, 2, script="keras_job.py", config_mode="scheduler", timeout=250,
                     env={"TFPSX_MAX_WORKER_NUM": "3"},
                     args=["--mode", "async", "--epochs", "6", "--step_delay", "0.02"])
    c.start()
    wait_for_log(c, "worker", 0, "Epoch 1/", timeout=120)
    joiner = c.add_worker()
    finish(c, timeout=240)
    r = reports(c, 3)
    assert r[2]["local_steps"] > 0 and len(r[2]["train_loss"]) == 6, r[2]
    # It trained on the running job's model, not a new one: its first epoch's loss is
    # below the first workers' first one, and after the barrier every worker evaluates
    # the same model on the servers.
    assert r[2]["train_loss"][0] < r[0]["train_loss"][0], r
    np.testing.assert_allclose(r[2]["eval_loss"], r[0]["eval_loss"], rtol=1e-4)
    assert re.search(r"joins the running job as rank 2", c.log("scheduler", 0))
    assert "worker 2 connected to 1 server(s)" in c.log(*joiner)

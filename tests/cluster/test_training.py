"""Graph-mode training modes on local clusters (tests/cluster/scripts/training_job.py)."""

import os
import re
import subprocess
import sys
import time

import numpy as np
import tensorflow as tf
import pytest

from conftest import wait_for_log
from tfpsx.testing import wait_until
import sparse_job as sparse
import training_job as job

FAST = {"TFPSX_HEARTBEAT_TIMEOUT": "6"}


def reports(c, workers, tag="training"):
    """Each worker's last '<tag>' metrics record (the job scripts emit one at the end)."""
    out = {}
    for i in range(workers):
        records = c.metrics("worker", i, tag)
        assert records, f"worker {i} emitted no {tag!r} metrics record:\n{c.logs()}"
        out[i] = records[-1]
    return out


def finish(c, timeout=150):
    codes = c.wait(timeout=timeout)
    assert all(code == 0 for code in codes.values()), f"{codes}\n{c.logs()}"


def kill_worker_1_once_training(c, timeout):
    """Kills worker 1 a second after its session is ready; returns the exit codes of the
    rest (waiting at most ``timeout`` s)."""
    wait_for_log(c, "worker", 1, "session ready")
    time.sleep(1.0)
    c.kill("worker", 1)
    return c.wait(timeout=timeout)


def geo_reference(workers: int, k: int, syncs: int):
    """The GEO update rule in numpy: k local SGD steps per worker, push (local-old)/N,
    all pushes land, pull local += global - old, old = global."""
    params = [np.zeros((job.DIM, 1), np.float32), np.zeros((), np.float32)]
    glob = [p.copy() for p in params]
    local = [[p.copy() for p in params] for _ in range(workers)]
    old = [[p.copy() for p in params] for _ in range(workers)]
    data = [list(job.batches(i, k * syncs)) for i in range(workers)]
    n = np.float32(workers)
    for s in range(syncs):
        for i in range(workers):
            w, b = local[i]
            for x, y in data[i][s * k:(s + 1) * k]:
                err = (x @ w)[:, 0] + b - y
                gw = (2.0 / job.BATCH) * (x.T @ err[:, None])
                gb = (2.0 / job.BATCH) * err.sum()
                w = (w - np.float32(job.LR) * gw).astype(np.float32)
                b = np.float32(b - np.float32(job.LR) * gb)
            local[i] = [w, b]
        for i in range(workers):
            for j in range(2):
                delta = (local[i][j] - old[i][j]) / n
                old[i][j] = old[i][j] + delta
                glob[j] = glob[j] + delta
        for i in range(workers):
            for j in range(2):
                local[i][j] = local[i][j] + (glob[j] - old[i][j])
                old[i][j] = glob[j].copy()
    return glob


@pytest.mark.timeout(240)
@pytest.mark.parametrize("workers", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_geo_in_train_thread_matches_numpy_reference(make_cluster, workers):
    k, syncs = 5, 4
    c = make_cluster(1, workers, script="training_job.py", env=FAST,
                     args=["--mode", "geo", "--k_steps", str(k), "--deterministic",
                           "--syncs", str(syncs)]).start()
    finish(c)
    want_w, want_b = geo_reference(workers, k, syncs)
    for i, r in reports(c, workers).items():
        assert r["pushes"] == syncs and r["local_steps"] == k * syncs
        assert r["rows_sent"] == syncs * (job.DIM + 1)  # w's rows and b, once per push
        assert r["global_step"] == workers * k * syncs
        np.testing.assert_allclose(r["global_w"], want_w.ravel(), rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(r["global_b"], want_b, rtol=2e-5, atol=1e-6)
        assert r["placement"]["w"].startswith("/job:ps/")
        assert r["placement"]["w_geo_local"] == f"/job:worker/task:{i}"
        assert r["placement"]["w_geo_old"] == f"/job:worker/task:{i}"


@pytest.mark.budget(40, why="a cluster of 1 PS + 2 workers, 300 sync steps")
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode,extra", [
    # (async trains in the export's job below, staleness in the fast worker's)
    pytest.param("async", [], marks=pytest.mark.slow),
    pytest.param("geo", ["--k_steps", "10"], marks=pytest.mark.slow),
    pytest.param("sync", [], marks=pytest.mark.slow),
    ("sync", ["--table"]),
    # a straggler among 2 workers, 1 replica per step
    # (also the replicas_to_aggregate < workers case)
    pytest.param("sync", ["--table", "--replicas", "1", "--step_delay", "0.05",
                          "--slow_worker", "1"], marks=pytest.mark.slow),
    pytest.param("staleness", ["--max_staleness", "2"], marks=pytest.mark.slow)])
def test_mode_trains_below_threshold(make_cluster, mode, extra):
    c = make_cluster(1, 2, script="training_job.py", env=FAST,
                     args=["--mode", mode, "--steps", "300"] + extra).start()
    finish(c)
    got = reports(c, 2)
    for r in got.values():
        assert r["eval_loss"] < 0.01, r
        assert r["global_step"] >= 300
        assert r["placement"]["w"].startswith("/job:ps/")
        if mode == "geo":
            assert r["pushes"] >= 1  # the background communicator ran
    if mode == "sync" and "--replicas" not in extra:
        # Each global step averages exactly one gradient of each worker, so the workers
        # ran 2 x 300 steps in all (async: ~300); a push in flight when the chief stopped
        # may add one. With a table (--table) its sync steps must not count twice in
        # global_step.
        total = sum(r["local_steps"] for r in got.values())
        assert 600 <= total <= 602, got
    if "--slow_worker" in extra:  # the straggler held nobody back
        assert got[0]["local_steps"] > 2 * got[1]["local_steps"], got


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_partitioned_variable_spreads_over_servers(make_cluster):
    c = make_cluster(2, 2, script="training_job.py", env=FAST,
                     args=["--mode", "async", "--steps", "100", "--partitioned"]).start()
    finish(c)
    r = reports(c, 2)[0]
    parts = {name: dev for name, dev in r["placement"].items() if name.startswith("w/part_")}
    assert len(parts) == 2, r["placement"]
    assert set(parts.values()) == {"/job:ps/task:0", "/job:ps/task:1"}
    assert r["eval_loss"] < 0.05


@pytest.mark.budget(50, why="a cluster of 2 PS + 2 workers, then the export served in a process "
                            "without tfpsx")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode,extra", [
    ("async", ["--steps", "100", "--partitioned"]),
    pytest.param("geo", ["--k_steps", "5", "--deterministic", "--syncs", "4"],
                 marks=pytest.mark.slow)])
def test_the_chief_exports_the_graph_that_serves_without_tfpsx(make_cluster, tmp_path, mode,
                                                               extra):
    """A graph-mode job: the table's shards on two PS (async; w partitioned over them) or
    the chief's GEO copies; exported from a session on the chief's server, served in a
    process without tfpsx. The async job is also make test's async training and
    partitioning check: it learns, and w's two slices sit one on each server."""
    out = tmp_path / "export"
    c = make_cluster(2, 2, script="training_job.py", env=FAST,
                     args=["--mode", mode, "--table", "--export", str(out)] + extra).start()
    finish(c)
    if mode == "async":
        for r in reports(c, 2).values():
            assert r["eval_loss"] < 0.05 and r["global_step"] >= 100, r
            parts = {n: d for n, d in r["placement"].items() if n.startswith("w/part_")}
            assert set(parts.values()) == {"/job:ps/task:0", "/job:ps/task:1"}, r["placement"]
    want = np.load(out / "predictions.npy")
    for loader, got in served_outputs(out / "model" / "1", out / "feed.npz", tmp_path).items():
        np.testing.assert_allclose(got["pred"], want, rtol=0, atol=1e-6, err_msg=loader)


def served_outputs(path, feed, tmp_path):
    """``serving_default``'s outputs in a process without tfpsx (tests/serving_check.py):
    {"tf2": {name: array}, "tf1": {...}}, by TF2's loader and the TF1 one TF Serving's
    mirrors (a session's graph optimizations may round a last bit differently)."""
    got = str(tmp_path / "served.npz")
    check = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "serving_check.py")
    proc = subprocess.run(
        [sys.executable, check, str(path), str(feed), got], capture_output=True, text=True,
        timeout=180, env=dict({k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
                              TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0 and "SERVED" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    out = dict(np.load(got))
    return {loader: {k[4:]: v for k, v in out.items() if k.startswith(loader + "/")}
            for loader in ("tf2", "tf1")}


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_non_chief_started_first_is_ready_soon_after_chief(make_cluster):
    c = make_cluster(1, 2, script="training_job.py", env=FAST,
                     args=["--mode", "async", "--steps", "50"])
    c.start([("server", 0), ("worker", 1)])
    wait_for_log(c, "worker", 1, "connected to 1 server")
    time.sleep(2.0)  # worker 1 is now waiting for the chief's init
    c.start([("worker", 0)])
    finish(c)
    r = reports(c, 2)
    gap = r[1]["ready"] - r[0]["ready"]
    print(f"non-chief ready {gap:+.2f} s after the chief")
    assert gap < 5.0


@pytest.mark.timeout(240)
@pytest.mark.slow
@pytest.mark.parametrize("mode,checkpoint", [("sync", False), ("async", True), ("geo", False)])
def test_a_chief_session_created_again_goes_on_from_the_servers_model(make_cluster, tmp_path,
                                                                       mode, checkpoint):
    """The chief's session run fails with the AbortedError of a broken connection (TF's
    MonitoredSession then creates the session again): training goes on from the model
    the server holds, never from a re-initialized one (sync, no checkpoint: TF's creator
    ran the init op, the global step went back to 0 and the job hung) nor from the last
    checkpoint (async: the steps since would be lost)."""
    args = ["--mode", mode, "--steps", "300", "--step_delay", "0.01", "--abort_once_at", "150"]
    if mode == "geo":
        args += ["--k_steps", "10"]
    if checkpoint:
        args += ["--checkpoint_dir", str(tmp_path / "ckpt"), "--save_steps", "40"]
    c = make_cluster(1, 2, script="training_job.py", env=FAST, timeout=200, args=args).start()
    finish(c, timeout=200)
    aborted = c.metrics("worker", 0, "aborted")
    assert len(aborted) == 1 and aborted[0]["global_step"] >= 150, aborted
    first, again = c.metrics("worker", 0, "resumed")
    assert not first["again"] and first["global_step"] == 0, first
    # The step the server held: not 0, not the last checkpoint's (120 when it failed)
    assert again["again"] and again["global_step"] >= aborted[0]["global_step"], again
    log = c.log("worker", 0)
    assert "the parameter servers still hold the model, and training goes on from it" in log
    r = reports(c, 2)
    assert r[0]["global_step"] >= 300 and r[0]["eval_loss"] < 0.05, r


@pytest.mark.budget(50, why="the chief killed after its first checkpoint and started again: 4 "
                            "TensorFlow starts")
@pytest.mark.timeout(300)
def test_chief_restart_resumes_from_checkpoint(make_cluster, tmp_path):
    """The chief is killed once TF's checkpoint state names a checkpoint at step 20 or
    later (the first one, saved when the session starts, holds the few steps the workers
    ran before it: waiting for any checkpoint killed the chief after that one, and the
    restart resumed at step 6 in one loaded CI run), and comes back from it."""
    ckpt = str(tmp_path / "ckpt")
    c = make_cluster(1, 2, script="training_job.py",
                     env={"TFPSX_HEARTBEAT_TIMEOUT": "30"},
                     args=["--mode", "async", "--steps", "400", "--checkpoint_dir", ckpt,
                           "--save_steps", "20", "--step_delay", "0.02"]).start()

    def latest_step() -> int:
        """The step of the checkpoint TF's state file names (-1: none yet); the state
        file is written after the checkpoint's data and index."""
        state = os.path.join(ckpt, "checkpoint")
        text = open(state).read() if os.path.exists(state) else ""
        found = re.search(r'^model_checkpoint_path: ".*model\.ckpt-(\d+)"', text, re.M)
        return int(found.group(1)) if found else -1

    wait_until(lambda: latest_step() >= 20, 120, "a checkpoint at step 20 or later")
    saved = latest_step()
    c.kill("worker", 0)
    c.procs[("worker", 0)].wait(timeout=10)
    c.start([("worker", 0)])
    finish(c, timeout=200)
    r = reports(c, 2)
    assert r[0]["start_step"] >= saved, (saved, r[0])  # restored, not re-initialized
    assert r[0]["global_step"] >= 400 and r[0]["eval_loss"] < 0.01


def sparse_geo_reference(workers: int, k: int, syncs: int, cache: bool = False):
    """Sparse GEO in numpy: rows changed in a worker's copy since its last push (by
    training or by a pull) are pushed whole (local-old: tables push with n = 1), unless
    that is zero (a row the pull brought and this worker never trained); the PS adds
    each row's mean over the workers that pushed it in the round; a pull brings every
    row the other workers pushed since this worker's last pull (and a row several
    pushed, to each of them). A copy's new row starts from its
    initial value; with a worker ``cache``, from the PS's value (a miss is fetched),
    and a pull brings only the rows the cache holds."""
    zero = np.zeros(sparse.DIM, np.float32)
    local = [{} for _ in range(workers)]
    old = [{} for _ in range(workers)]
    glob = {}
    changed = [set() for _ in range(workers)]
    to_pull = [set() for _ in range(workers)]
    data = [list(sparse.batches(i, k * syncs)) for i in range(workers)]
    rows_sent = [0] * workers
    trained = [0] * workers  # each step's distinct rows, summed
    for s in range(syncs):
        for i in range(workers):
            for ids in data[i][s * k:(s + 1) * k]:
                uniq, inv = np.unique(ids, return_inverse=True)
                trained[i] += len(uniq)
                for u in uniq:
                    if cache and u not in local[i]:  # a miss: fetched from the PS
                        local[i][u] = glob.get(u, zero).copy()
                        old[i][u] = glob.get(u, zero).copy()
                rows = np.stack([local[i].get(u, zero) for u in uniq])
                grad = np.zeros_like(rows)
                np.add.at(grad, inv, 2 * (rows[inv] - sparse.targets(ids))
                          / np.float32(sparse.BATCH * sparse.DIM))
                for j, u in enumerate(uniq):
                    local[i][u] = (rows[j] - np.float32(sparse.LR) * grad[j]).astype(np.float32)
                    changed[i].add(u)
        pushed = {}  # this round's deltas of each row, by pusher
        for i in range(workers):
            for u in changed[i]:
                delta = local[i][u] - old[i].get(u, zero)
                if not delta.any():
                    continue
                old[i][u] = old[i].get(u, zero) + delta
                pushed.setdefault(u, {})[i] = delta
                rows_sent[i] += 1
            changed[i] = set()
        for u, deltas in pushed.items():  # the PS adds each row's mean over its pushers
            glob[u] = glob.get(u, zero) + (np.sum(list(deltas.values()), axis=0)
                                           / np.float32(len(deltas)))
            for r in range(workers):  # a row one worker pushed is not pulled back by it
                if len(deltas) > 1 or r not in deltas:
                    to_pull[r].add(u)
        for i in range(workers):
            for u in to_pull[i]:
                if cache and u not in local[i]:
                    continue
                local[i][u] = local[i].get(u, zero) + (glob[u] - old[i].get(u, zero))
                old[i][u] = glob[u].copy()
                changed[i].add(u)
            to_pull[i] = set()
    return glob, rows_sent, trained


@pytest.mark.budget(40, why="a cluster of 2 PS + 2 workers")
@pytest.mark.timeout(240)
@pytest.mark.parametrize("workers,cache", [pytest.param(1, 0, marks=pytest.mark.slow), (2, 0),
                                           pytest.param(3, 0, marks=pytest.mark.slow),
                                           pytest.param(2, 32, marks=pytest.mark.slow)])
def test_sparse_geo_matches_numpy_reference_and_ships_touched_rows(make_cluster, workers,
                                                                   cache):
    """cache: each worker keeps a worker cache of 32 rows (of the 20-30 ids it trains),
    not a copy of every row: GEO's values all the same."""
    k, syncs = 3, 4
    c = make_cluster(2, workers, script="sparse_job.py", env=FAST,
                     args=["--k_steps", str(k), "--syncs", str(syncs),
                           "--cache_size", str(cache)]).start()
    finish(c)
    want, rows_sent, trained = sparse_geo_reference(workers, k, syncs, cache=bool(cache))
    for i, r in reports(c, workers, "sparse").items():
        assert r["pushes"] == syncs
        # What the tables moved against async (the log line when the session ends): the
        # rows each step trained, what async would have moved for them (a read and a
        # gradient, with their keys), and the rounds' table bytes (no dense part here).
        assert r["trained_rows"] == trained[i] and r["hot_rows"] == 0
        assert r["async_table_bytes"] == trained[i] * 2 * (8 + 4 * sparse.DIM)
        assert r["hot_table_bytes"] == 0
        assert r["table_bytes"] == r["bytes_sent"] + r["bytes_received"] > 0
        # Only rows with a delta travelled (a row a pull brought and training left alone
        # stays home). A cache also pushes a row it evicts, and again when it is trained
        # after its next miss: not the reference's count.
        if cache:
            assert r["rows_sent"] > 0
        else:
            assert r["rows_sent"] == rows_sent[i]
        assert r["rows_sent"] < syncs * sparse.VOCAB
        assert r["bytes_sent"] == r["rows_sent"] * (8 + 4 * sparse.DIM)
        got = {int(key): np.array(v, np.float32) for key, v in r["rows"].items()}
        if cache:  # a cache's misses are looked up on the PS, which creates their rows:
            # a row no worker trained keeps its initial value there (zeros)
            extra = set(got) - {int(u) for u in want}
            assert all(not got[u].any() for u in extra), extra
            got = {u: row for u, row in got.items() if u not in extra}
        assert sorted(got) == sorted(int(u) for u in want)
        for u, row in want.items():
            np.testing.assert_allclose(got[int(u)], row, rtol=1e-5, atol=1e-6)


def contended_reference(per_round: int, k: int):
    """GEO's contention estimate (tfpsx.modes.geo.contention) for one worker, in numpy:
    ``hot(unique ids)`` -> which are too contended for a round of k steps; ``margin``:
    the closest an estimate came to the bound (a replay is exact only away from it)."""
    from tfpsx.modes.geo.contention import _MIX, DEFAULT_WIDTH
    bits, keep = DEFAULT_WIDTH.bit_length() - 1, 1.0 - 1.0 / k
    ema, age, state = {}, {}, {"now": 0, "margin": np.inf}

    def hot(uniq):
        state["now"] += 1
        with np.errstate(over="ignore"):
            mixed = np.asarray(uniq, np.int64) * np.int64(_MIX)
        buckets = (mixed >> np.int64(64 - bits)) & np.int64(DEFAULT_WIDTH - 1)
        before = {b: ema.get(b, 2.0 * per_round) * keep ** (state["now"] - age.get(b, 0))
                  for b in set(buckets.tolist())}
        for b, v in before.items():
            ema[b], age[b] = v + sum(1 for x in buckets if x == b), state["now"]
        est = np.array([before[b] / keep for b in buckets.tolist()])
        state["margin"] = min(state["margin"], float(np.min(np.abs(est - per_round))))
        return est >= per_round

    return hot, state


def hot_geo_reference(k: int, syncs: int, hot_count: int, per_round: int = 0):
    """One GEO worker with hot rows and an async dense bias, in numpy: an id seen
    ``hot_count``+ times in a batch (or, with ``per_round``, too contended for a round:
    :func:`contended_reference`) is read from and trained on the PS, the others in the
    copy (pushed whole every k steps; the pull brings the PS's moves); the bias trains
    on the PS every step. Returns (the PS's rows, the bias, the estimate's margin)."""
    zero = np.zeros(sparse.DIM, np.float32)
    lr, scale = np.float32(sparse.LR), np.float32(sparse.BATCH * sparse.DIM)
    glob, local, old = {}, {}, {}
    bias = zero.copy()
    steps = list(sparse.batches(0, k * syncs))
    contended, state = contended_reference(per_round, k) if per_round else (None, {})
    for s, ids in enumerate(steps, 1):
        uniq, inv, counts = np.unique(ids, return_inverse=True, return_counts=True)
        hot = counts >= hot_count
        if contended is not None:
            hot = hot | contended(uniq)
        rows = np.stack([(glob if h else local).get(u, zero) for u, h in zip(uniq, hot)])
        err = 2 * (rows[inv] + bias - sparse.targets(ids)) / scale
        grad = np.zeros_like(rows)
        np.add.at(grad, inv, err)
        for j, u in enumerate(uniq):
            (glob if hot[j] else local)[u] = (rows[j] - lr * grad[j]).astype(np.float32)
        bias = (bias - lr * err.sum(0)).astype(np.float32)
        if s % k == 0:  # push the copy's deltas, then pull every row
            for u in list(local):
                glob[u] = glob.get(u, zero) + (local[u] - old.get(u, zero))
                old[u] = local[u].copy()
            for u in list(glob):
                local[u] = local.get(u, zero) + (glob[u] - old.get(u, zero))
                old[u] = glob[u].copy()
    return glob, bias, state.get("margin")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("per_round", [
    0,
    # geo_hot_per_round=1 at K x N = 3: the ids this worker's last batches held (N x
    # their batches of the last ~3 >= 1, every id while the estimate starts) train on
    # the PS too; the replay runs the estimate in numpy.
    pytest.param(1, id="contended")])
def test_graph_geo_trains_hot_rows_and_dense_weights_on_the_ps(make_cluster, per_round):
    """GEO's rule at many workers in graph mode, one worker (deterministic): ids seen
    twice or more in a batch are read and trained on the PS (geo_hot_count=2), and so
    are those too contended for a round (geo_hot_per_round), the rest in the copy, and a
    dense bias trains async on the PS (geo_dense="async"): the PS's rows and bias equal
    the numpy replay of that rule. Its own cluster: the rule is a strategy of its own
    (no scenario trains with it), one worker so the replay is exact."""
    k, syncs = 3, 4
    c = make_cluster(2, 1, script="sparse_job.py", env=FAST,
                     args=["--k_steps", str(k), "--syncs", str(syncs), "--geo_hot_count", "2",
                           "--geo_hot_per_round", str(per_round),
                           "--dense_bias", "--geo_dense", "async"]).start()
    finish(c)
    if per_round:
        assert "geo_hot_per_round=1: the rows the workers would train 1+ times" in c.log(
            "worker", 0)
    want, want_bias, margin = hot_geo_reference(k, syncs, 2, per_round)
    assert per_round == 0 or margin > 1e-3, margin  # no decision the float32 ops could flip
    (r,) = reports(c, 1, "sparse").values()
    assert r["bias_device"].startswith("/job:ps/"), r["bias_device"]
    np.testing.assert_allclose(r["bias"], want_bias, rtol=1e-5, atol=1e-6)
    got = {int(key): np.array(v, np.float32) for key, v in r["rows"].items()}
    assert sorted(got) == sorted(int(u) for u in want)
    for u, row in want.items():
        np.testing.assert_allclose(got[int(u)], row, rtol=1e-5, atol=1e-6, err_msg=str(u))


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_async_worker_cache_trains_flushes_and_reports(make_cluster):
    """Async through a worker cache of 8 rows (each worker trains 20-30 ids): the PS rows
    learn their targets through evictions and flushes, the session's end flushes the
    last updates, and each worker logs and emits its cache's counters."""
    c = make_cluster(2, 2, script="sparse_job.py", env=FAST,
                     args=["--mode", "async", "--syncs", "300", "--cache_size", "8",
                           "--flush_steps", "5"]).start()
    finish(c)
    rows = reports(c, 2, "sparse")[0]["rows"]
    assert sorted(int(k) for k in rows) == list(range(30))
    for key, row in rows.items():
        target = sparse.targets([int(key)])[0]
        # From 0, each row covered at least half of the way to its target.
        assert np.abs(np.array(row) - target).max() <= 0.5 * np.abs(target).max() + 1e-6, key
    for i, r in reports(c, 2, "cache").items():
        assert r["table"] == "sparse"
        assert r["flushes"] >= 300 // 5 and r["evictions"] > 0 and r["size"] <= 8 + 6
        assert 0 < r["hit_rate"] < 1 and r["lookups"] == 300 * sparse.BATCH
    assert "tfpsx worker cache sparse: hit rate" in c.logs()


def sparse_sync_reference(steps: int):
    """Sync Adagrad in numpy on the one batch every worker trains on: each step averages
    the workers' (equal) row gradients and applies them once per row."""
    ids = next(sparse.batches(0, 1))
    want = sparse.targets(ids)
    uniq, inv = np.unique(ids, return_inverse=True)
    rows = np.zeros((len(uniq), sparse.DIM), np.float32)
    accum = np.full_like(rows, 0.1)
    for _ in range(steps):
        grad = np.zeros_like(rows)
        np.add.at(grad, inv, 2 * (rows[inv] - want) / np.float32(sparse.BATCH * sparse.DIM))
        accum += grad * grad
        rows -= np.float32(sparse.LR) * grad / np.sqrt(accum)
    return dict(zip(uniq.tolist(), rows))


@pytest.mark.timeout(240)
@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_sparse_sync_applies_the_averaged_rows_once_per_step(make_cluster, workers):
    steps = 30
    c = make_cluster(2, workers, script="sparse_job.py", env=FAST,
                     args=["--mode", "sync", "--syncs", str(steps)]).start()
    finish(c)
    want = sparse_sync_reference(steps)
    runs = 0
    for r in reports(c, workers, "sparse").values():
        assert r["global_step"] == steps, r
        runs += r["runs"]
        got = {int(key): np.array(v, np.float32) for key, v in r["rows"].items()}
        assert sorted(got) == sorted(want)  # rows on both PS shards
        for u, row in want.items():
            # Summing a key's rows from two workers, then dividing, rounds differently
            # from one worker's row: not bit-exact, far tighter than a second apply.
            np.testing.assert_allclose(got[u], row, rtol=1e-5, atol=1e-6)
    # Every step took one gradient per worker (a fast worker may give two of a step's).
    assert runs >= steps * workers
    if workers == 1:
        assert runs == steps


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_sparse_sync_dead_worker_is_a_clear_timeout(make_cluster):
    c = make_cluster(2, 2, script="sparse_job.py", env=dict(FAST, TFPSX_SYNC_STEP_TIMEOUT="4"),
                     args=["--mode", "sync", "--syncs", "1000000"]).start()
    codes = kill_worker_1_once_training(c, timeout=120)
    assert codes[("worker", 0)] != 0
    log = c.log("worker", 0)
    assert "ClusterTimeoutError" in log and "TFPSX_SYNC_STEP_TIMEOUT=4 s" in log, log[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("script", ["training_job.py", "sparse_job.py"])
def test_sync_fails_fast_naming_the_worker_the_scheduler_declared_dead(make_cluster, script):
    """With a scheduler, a killed worker is declared dead after TFPSX_HEARTBEAT_TIMEOUT;
    the chief's wait for the sync step's gradients (dense and tables) fails then,
    naming it and its address, long before TFPSX_SYNC_STEP_TIMEOUT (300 s)."""
    args = (["--mode", "sync", "--steps", "100000", "--step_delay", "0.01",
             "--no_final_barrier"] if script == "training_job.py"
            else ["--mode", "sync", "--syncs", "1000000"])
    c = make_cluster(1 if script == "training_job.py" else 2, 2, script=script,
                     config_mode="scheduler", args=args,
                     env=dict(FAST, TFPSX_SYNC_STEP_TIMEOUT="300")).start()
    wait_for_log(c, "worker", 1, "session ready")
    time.sleep(1.0)
    c.kill("worker", 1)
    killed = time.monotonic()
    codes = c.wait([("worker", 0)], timeout=120)
    assert codes[("worker", 0)] != 0
    assert time.monotonic() - killed < int(FAST["TFPSX_HEARTBEAT_TIMEOUT"]) + 30, c.logs()
    log = c.log("worker", 0)
    # The same message as Keras's (one protocol, tfpsx.modes.sync).
    assert re.search(r"ClusterTimeoutError: sync: worker 0 waited [\d.]+ s for step \d+, which "
                     r"cannot complete: worker 1 at 127\.0\.0\.1:\d+ died", log), log[-3000:]


@pytest.mark.timeout(240)
@pytest.mark.slow
@pytest.mark.parametrize("mode,extra", [("async", []), ("geo", ["--k_steps", "10"])])
def test_training_goes_on_when_a_worker_is_killed(make_cluster, mode, extra):
    c = make_cluster(1, 2, script="training_job.py", env=FAST,
                     args=["--mode", mode, "--steps", "400", "--step_delay", "0.01",
                           "--no_final_barrier"] + extra).start()
    codes = kill_worker_1_once_training(c, timeout=180)
    assert codes[("worker", 0)] == 0 and codes[("server", 0)] == 0, f"{codes}\n{c.logs()}"
    r = reports(c, 1)[0]
    assert r["global_step"] >= 400 and r["eval_loss"] < 0.01, r
    assert "worker 1" in c.log("server", 0) and "reported lost" in c.log("server", 0)


@pytest.mark.budget(40, why="200 steps of a worker held back by a slow one (30 ms a step)")
@pytest.mark.timeout(240)
def test_bounded_staleness_holds_the_fast_worker_back(make_cluster):
    c = make_cluster(1, 2, script="training_job.py", env=FAST,
                     args=["--mode", "staleness", "--max_staleness", "3", "--steps", "200",
                           "--step_delay", "0.03", "--slow_worker", "1"]).start()
    finish(c)
    fast, slow = reports(c, 2)[0], reports(c, 2)[1]
    # Unbounded, worker 0 would run ~10x the slow worker's steps; here at most 3 ahead
    # (+2: the step in flight when the slow worker stops counting at its end).
    assert fast["local_steps"] <= slow["local_steps"] + 3 + 2, (fast, slow)
    assert fast["staleness_waits"] > 0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode,env", [("staleness", {"TFPSX_STALENESS_TIMEOUT": "4"}),
                                      ("sync", {"TFPSX_SYNC_STEP_TIMEOUT": "4"})])
@pytest.mark.slow
def test_a_dead_worker_is_a_clear_timeout_not_a_hang(make_cluster, mode, env):
    c = make_cluster(1, 2, script="training_job.py", env=dict(FAST, **env),
                     args=["--mode", mode, "--max_staleness", "1", "--steps", "100000",
                           "--step_delay", "0.01", "--no_final_barrier"]).start()
    codes = kill_worker_1_once_training(c, timeout=120)
    assert codes[("worker", 0)] != 0
    log = c.log("worker", 0)
    assert "ClusterTimeoutError" in log, log[-3000:]
    if mode == "staleness":
        assert "waited 4 s (TFPSX_STALENESS_TIMEOUT) for worker(s) [1]" in log
    else:
        assert "TFPSX_SYNC_STEP_TIMEOUT=4 s" in log


@pytest.mark.timeout(240)
@pytest.mark.slow
@pytest.mark.parametrize("mode,extra", [("async", []), ("geo", ["--k_steps", "auto"])])
def test_a_worker_joins_a_running_job_trains_and_the_job_ends_cleanly(make_cluster, mode,
                                                                      extra):
    """Elastic: the scheduler admits up to TFPSX_MAX_WORKER_NUM workers; a third one
    started while two train gets rank 2, the servers' model (its session carries its own
    address, which they never had), trains on, and everyone ends with code 0. In GEO
    every worker, the joiner too, runs the job's one rule and K (of the 2 workers it
    started with)."""
    # 3,000 steps (at least 15 s with two workers): the joiner's start (TF's import, its
    # registration) took longer than 900 steps' 5 s on a loaded 2-core machine, and it
    # then found the job over (CI of a2ab170).
    c = make_cluster(1, 2, script="training_job.py", config_mode="scheduler",
                     env=dict(FAST, TFPSX_MAX_WORKER_NUM="3"),
                     args=["--mode", mode, "--steps", "3000", "--step_delay", "0.01"] + extra)
    c.start()
    wait_for_log(c, "worker", 0, "session ready")
    time.sleep(1.0)
    joiner = c.add_worker()
    assert joiner == ("worker", 2)
    finish(c, timeout=200)
    r = reports(c, 3)
    assert r[2]["start_step"] > 0 and r[2]["local_steps"] > 20, r[2]  # joined mid-job
    assert r[0]["global_step"] >= 3000 and r[2]["eval_loss"] < 0.01, r
    if mode == "geo":
        rules = [re.findall(r"GEO at \d+ worker\(s\): [^(]*|k_steps='auto' is \d+",
                            c.log("worker", i)) for i in range(3)]
        assert rules[0] and rules[0] == rules[1] == rules[2], rules
        assert "GEO at 2 worker(s): geo_table_rule='average'" in rules[0][-1], rules
    sched = c.log("scheduler", 0)
    assert re.search(r"worker 127\.0\.0\.1:\d+ joins the running job as rank 2 "
                     r"\(3 of at most 3 workers\)", sched), sched[-2000:]
    # The job ended when the joiner had finished too, not when the first two did.
    assert re.search(r"worker rank 2 \(127\.0\.0\.1:\d+\) finished",
                     sched.split("scheduler exiting")[0]), sched[-2000:]


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_sync_refuses_a_joining_worker_naming_why(make_cluster):
    c = make_cluster(1, 2, script="training_job.py", config_mode="scheduler",
                     env=dict(FAST, TFPSX_MAX_WORKER_NUM="3"),
                     args=["--mode", "sync", "--steps", "300", "--step_delay", "0.01"])
    c.start()
    wait_for_log(c, "worker", 0, "session ready")
    joiner = c.add_worker()
    codes = c.wait(timeout=200)
    assert codes[joiner] == 1, f"{codes}\n{c.logs()}"
    log = c.log(*joiner)
    assert "ValueError: sync: worker 2 joined a running job of 2 workers, but sync training " \
           "waits on the workers the job started with" in log, log[-3000:]
    # The others finish their sync steps: the joiner never took part.
    assert codes[("worker", 0)] == 0 and codes[("worker", 1)] == 0, f"{codes}\n{c.logs()}"
    assert reports(c, 2)[0]["global_step"] >= 300


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_a_joined_worker_killed_with_sigkill_leaves_and_the_others_finish(make_cluster):
    c = make_cluster(1, 2, script="training_job.py", config_mode="scheduler",
                     env=dict(FAST, TFPSX_MAX_WORKER_NUM="3"),
                     args=["--mode", "async", "--steps", "900", "--step_delay", "0.01",
                           "--no_final_barrier"])
    c.start()
    wait_for_log(c, "worker", 0, "session ready")
    joiner = c.add_worker()
    wait_for_log(c, *joiner, "session ready")
    time.sleep(0.5)
    c.kill(*joiner)
    codes = c.wait(timeout=200)
    del codes[joiner]
    assert all(code == 0 for code in codes.values()), f"{codes}\n{c.logs()}"
    assert reports(c, 2)[0]["global_step"] >= 900
    sched = c.log("scheduler", 0)
    assert re.search(r"worker rank 2 \(127\.0\.0\.1:\d+\) is dead: no heartbeat", sched), \
        sched[-2000:]


@pytest.mark.timeout(240)
def test_a_geo_chiefs_final_checkpoint_holds_its_last_local_steps(make_cluster, tmp_path):
    """GEO's last push (steps since the last round) runs when the session ends: it must
    reach the servers before TF's saver writes the final checkpoint, or the checkpoint
    (what a restart, an evaluator or an export reads) misses up to k-1 steps."""
    ckpt = str(tmp_path / "ckpt")
    c = make_cluster(1, 1, script="training_job.py", env=FAST,
                     args=["--mode", "geo", "--k_steps", "10", "--steps", "95",
                           "--checkpoint_dir", ckpt]).start()
    finish(c)
    r = reports(c, 1)[0]
    saved = tf.train.load_variable(ckpt, "w").ravel()
    np.testing.assert_allclose(saved, r["global_w"], rtol=1e-6, atol=1e-7)
    assert tf.train.load_variable(ckpt, "global_step") == r["global_step"]


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_a_chief_started_again_alone_takes_the_servers_model_not_its_checkpoint(
        make_cluster, tmp_path):
    """An orchestrator restarts the chief's process alone while the servers and the other
    worker run on: its session takes the model the servers hold (TF's chief would restore
    the last checkpoint over it, rolling back what was trained since)."""
    ckpt = tmp_path / "ckpt"
    c = make_cluster(1, 2, script="training_job.py",
                     env={"TFPSX_HEARTBEAT_TIMEOUT": "60"},
                     args=["--mode", "async", "--steps", "4000", "--step_delay", "0.005",
                           "--checkpoint_dir", str(ckpt), "--save_steps", "100"]).start()
    wait_for_log(c, "worker", 0, "session ready")
    deadline = time.monotonic() + 60
    while tf_latest(ckpt) is None or tf_latest(ckpt)[1] < 300:
        assert time.monotonic() < deadline, c.logs()
        time.sleep(0.2)
    c.kill("worker", 0)
    saved = tf_latest(ckpt)[1]
    c.start_task("worker", 0)
    finish(c, timeout=200)
    log = c.log("worker", 0)
    assert "the chief started while the parameter servers already hold the job's model" \
        in log, log[-3000:]
    starts = [r["start_step"] for r in c.metrics("worker", 0, "training")]
    assert starts[-1] > saved, (starts, saved)  # went on from the servers' step


def tf_latest(folder):
    """(path, step) of the newest TF checkpoint in ``folder``, or None."""
    import tensorflow as tf

    path = tf.train.latest_checkpoint(str(folder)) if folder.exists() else None
    return None if path is None else (path, int(path.rsplit("-", 1)[1]))

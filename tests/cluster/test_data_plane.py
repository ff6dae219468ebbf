"""The data plane end to end (tfpsx.data.splits): jobs that train a visit counter beside
the model (tests/cluster/scripts/visits_job.py, graph_visits_job.py: a table keyed by
example id whose row moves by exactly +1 per trained visit) say how many times each
example is in the final model, after kills, restarts and restores. 0 would be a skip, 2 a
repeat: no run may skip one; repeats stay within the bound the modes state (the steps in
flight when a worker dies, or between a checkpoint's position and its model).

Each test starts its own job under tfpsx-run: each SIGKILLs a process of it (a worker, the
server) or slows and joins workers, and counts every visit of the whole job, which no
shared scenario's job could give; the refusals (sync, hybrid) run in the Keras misuse
scenario instead (tests/cluster/test_keras.py)."""

import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

import tfpsx
from tfpsx.serving import publish
from conftest import SCRIPTS, cluster
import visits_job

pytestmark = pytest.mark.timeout(300)
RUN = [sys.executable, "-m", "tfpsx.launcher.run"]
EXAMPLES, BATCH = 6000, 50


def _env(**extra):
    # Commits every 50 ms (0.2 s by default): the repeat bounds below count the batches
    # in flight and those of the last 50 ms.
    env = dict(os.environ, TFPSX_HEARTBEAT_INTERVAL="0.5", TFPSX_INPUT_COMMIT_SECONDS="0.05")
    env["PYTHONPATH"] = SCRIPTS + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def examples(tmp_path_factory):
    """The 6,000 examples as 4 text files (visits_job.write_files)."""
    folder = tmp_path_factory.mktemp("visits_data")
    visits_job.write_files(str(folder / "data"), EXAMPLES)
    return folder / "data"


def _kill_child(launcher, which, every=False):
    """SIGKILLs the first-started process under ``launcher`` that ``which(psutil.Process)``
    names (``every``: each one)."""
    import psutil

    def matches(p):
        try:
            return which(p)
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied,
                ProcessLookupError):
            return False  # (a child that exited meanwhile: not the one to kill)

    found = [p for p in psutil.Process(launcher.pid).children(recursive=True) if matches(p)]
    assert found, "no such process"
    for process in found if every else [min(found, key=lambda p: p.create_time())]:
        process.kill()


def run_job(tmp_path, examples, script, workers, args, kill_server_after=None,
            data_workers=0, kill_data_worker=False, kill="server", delay=1.0, servers=1,
            env=None, max_restarts=1):
    """tfpsx-run of ``script`` with ``servers`` PS + ``workers`` under ``max_restarts``; with
    ``kill_server_after`` (a checkpoint folder), the server (``kill="chief"``: the chief;
    ``"worker"``: worker 1) is SIGKILLed ``delay`` seconds after the chief's first
    checkpoint there (a server or the chief restarts the whole job, restored from it; a
    worker is started again in place); with ``data_workers``, the job reads through a
    tf.data service of that many data workers, and with ``kill_data_worker`` they are
    SIGKILLed 2 s into worker 0's reading (the dispatcher gives each lease to one of them,
    whichever asks first: the one that holds the reads in flight is not known); ``env``:
    settings for the job's processes. Returns (launcher result, {id: visits})."""

    out = tmp_path / "out"
    out.mkdir()
    os.symlink(examples, out / "data")
    proc = subprocess.Popen(
        RUN + ["--log_dir", str(tmp_path / "logs"), "--server_num", str(servers), "--worker_num",
               str(workers), "--max_restarts", str(max_restarts), "--timeout", "240",
               "--data_workers", str(data_workers),
               os.path.join(SCRIPTS, script), "--out", str(out)] + args,
        env=_env(**(env or {})), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, cwd=str(tmp_path))
    try:
        if kill_server_after is not None:
            deadline = time.monotonic() + 150
            while not any((kill_server_after / f).exists()
                          for f in ("checkpoint.json", "checkpoint")):
                assert proc.poll() is None and time.monotonic() < deadline, \
                    proc.stderr.read()[-3000:]
                time.sleep(0.1)
            time.sleep(delay)
            role, rank = {"server": ("server", None), "chief": ("worker", "0"),
                          "worker": ("worker", "1")}[kill]
            _kill_child(proc, lambda p: p.environ().get("TFPSX_ROLE") == role and
                        (rank is None or p.environ().get("TFPSX_RANK") == rank))
        if kill_data_worker:
            log = tmp_path / "logs" / "workerlog.0"
            deadline = time.monotonic() + 150
            while not (log.exists() and "tf.data service at" in log.read_text()):
                assert proc.poll() is None and time.monotonic() < deadline, \
                    proc.stderr.read()[-3000:]
                time.sleep(0.1)
            time.sleep(2.0)
            _kill_child(proc, lambda p: "data_worker" in p.cmdline(), every=True)
        stdout, stderr = proc.communicate(timeout=280)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait(timeout=30)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    got = np.load(out / "visits.npz")
    return stderr, dict(zip(got["ids"].tolist(), got["counts"].tolist()))


def assert_each_once(visits, repeats_at_most, epochs=1):
    """No example skipped (every id ``epochs`` times or more), at most ``repeats_at_most``
    once more, none more often."""
    counts = np.array([visits.get(i, 0.0) for i in range(EXAMPLES)])
    histogram = {int(v): int((counts == v).sum()) for v in np.unique(counts)}
    print(f"examples by visits: {histogram}")  # (the figures of docs/data.md: pytest -s)
    assert counts.min() >= epochs, f"skipped: {histogram}"
    assert counts.max() <= epochs + 1 and histogram.get(epochs + 1, 0) <= repeats_at_most, \
        histogram
    return histogram


@pytest.mark.budget(60, why="tfpsx-run, 1 PS + 3 Keras workers (4 TensorFlow imports), a "
                            "worker SIGKILLed and started again in place")
# (Keras async's worker restarted in place: make test-all; make test has graph mode's,
# and Keras async's job restored from its checkpoint.)
@pytest.mark.parametrize("mode", [pytest.param("async", marks=pytest.mark.slow), "geo",
                                  pytest.param("staleness", marks=pytest.mark.slow)])
def test_keras_a_worker_killed_and_started_again_skips_nothing(tmp_path, examples, mode):
    """Keras fit from splits leased on PS 0, worker 1 SIGKILLed after 25 batches and
    started again in place: its leases come back from their committed positions (what
    its steps put in the model stays; in GEO its unpushed steps are trained again by
    whoever takes the split), its restore(model) rolls back nothing the others trained
    after the chief's checkpoint, and every example is in the model once. Async commits its
    applied steps every 50 ms, so the batches in flight and those of the last 50 ms may
    repeat; GEO with the round that pushes
    (two epochs: a step at an epoch's end is committed K steps into the next).

    Worker 2 is SIGKILLed after its tfpsx.stop_worker(), its training done: it is not
    started again (a new process waited for the scheduler of a job that had ended, and
    the job FAILED; with --max_restarts 1 spent on worker 1, it would count as lost)."""
    epochs = 2 if mode == "geo" else 1
    # (GEO: its table trains async, and a round then runs every K steps only as often as
    # TFPSX_GEO_QUIET_ROUND_SECONDS says: 1 ms here, under a step, for the rounds' check below)
    err, visits = run_job(tmp_path, examples, "visits_job.py", 3,
                          ["--mode", mode, "--input", "splits", "--examples", str(EXAMPLES),
                           "--die_after", "1:25,2:stopped", "--step_delay", "0.02",
                           "--split_bytes", "5000", "--epochs", str(epochs),
                           "--checkpoint", str(tmp_path / "ckpt"), "--save_every", "10"],
                          env={"TFPSX_GEO_QUIET_ROUND_SECONDS": "0.001"})
    assert re.search(r"worker 1 exited with code -9 .*starting it again in place", err), err
    assert re.search(r"worker 2 exited with code -9 \(killed by SIGKILL\) after its "
                     r"tfpsx.stop_worker\(\): its training was done; not started again",
                     err), err
    log = (tmp_path / "logs" / "workerlog.1").read_text()
    assert re.search(r"worker 1 gave back \d+ split\(s\) its earlier process held", log)
    # Every worker calls restore(model) before fit (docs/recovery.md), the chief saving
    # every 10 batches: worker 1 started again restores nothing, so the servers keep what
    # the others trained since the checkpoint (a restore rolled it back: their examples
    # at 0 visits, skipped, below).
    again = log.split("===== tfpsx-run: restart")[-1]
    assert re.search(r"worker 1 does not restore ckpt-\d+: the chief restores", again), again
    assert "restored" not in again, again
    # async: a step's position is committed by the CommitQueue's thread every 50 ms
    # (TFPSX_INPUT_COMMIT_SECONDS, _env), so the batch in flight, the one handed over
    # and the steps of the last 50 ms (>= 20 ms each here: 3) may repeat (CI once measured 3 batches); GEO: with the round that
    # pushed it (a worker that dies between a push and its commit: K)
    assert_each_once(visits, repeats_at_most=(6 if mode == "geo" else 5) * BATCH,
                     epochs=epochs)
    if mode == "geo":  # a round every K = 5 steps, though the dataset reports no length
        # (its table trains async: each step's position committed as async's, at once)
        assert "GEO: every table trains async: a round, which moves nothing" in log, log[-3000:]
        for i in (0, 2):
            r = tfpsx.metrics.read(str(tmp_path / "logs"), "worker", i, "visits")[-1]
            assert r["rounds"] >= r["batches"] // (2 * 5), r


@pytest.mark.budget(60, why="tfpsx-run, 1 PS + 2 Keras workers, a worker SIGKILLed once "
                            "its fit ended and started again in place")
def test_keras_a_worker_started_again_with_nothing_left_to_train_ends_cleanly(tmp_path,
                                                                           examples):
    """Worker 1 SIGKILLed once its fit ended (the input's splits all trained or held by
    the chief) and started again in place: Keras's fit looks at a batch before its
    steps and failed on an input with none (StopIteration, the job FAILED: found by
    the kill matrix); the look now reads split 0 untrained, fit trains nothing, and the
    job ends well with every example once. (A worker SIGKILLed after its
    tfpsx.stop_worker() is not started again: the GEO kill above.)"""
    err, visits = run_job(tmp_path, examples, "visits_job.py", 2,
                          ["--input", "splits", "--examples", str(EXAMPLES), "--die_after",
                           "1:end", "--step_delay", "0.01", "--split_bytes", "5000"])
    assert re.search(r"worker 1 exited with code -9 .*starting it again in place", err), err
    log = (tmp_path / "logs" / "workerlog.1").read_text()
    assert "worker 1 has nothing left to train; Keras's look at a batch before fit" in log
    assert_each_once(visits, repeats_at_most=0)


@pytest.mark.budget(60, why="tfpsx-run, 1 PS + 3 Keras workers in sync, a worker SIGKILLed "
                            "and started again in place")
def test_keras_sync_from_splits_a_worker_killed_skips_nothing(tmp_path, examples):
    """Sync from splits (each step the sum of every worker's gradients, so each visit
    moves its row by +1 whatever the workers in the step): worker 1 SIGKILLed and started
    again in place rejoins the group, its leases come back from what the chief applied,
    and the workers' data ends at different steps: the chief, its own done first or not,
    applies the others' last steps (they leave the group as their data ends)."""
    # (3 workers: with 1 other the chief's data ends last or with it more often, and
    # then it drains no step)
    err, visits = run_job(tmp_path, examples, "visits_job.py", 3,
                          ["--mode", "sync", "--input", "splits", "--examples", str(EXAMPLES),
                           "--die_after", "1:25", "--split_bytes", "5000",
                           "--chief_batch", str(3 * BATCH)])
    assert re.search(r"worker 1 exited with code -9 .*starting it again in place", err), err
    # a step commits once the chief applied it, from the CommitQueue every 50 ms: the
    # step in flight and those of the last 50 ms may repeat
    assert_each_once(visits, repeats_at_most=4 * BATCH)
    # The chief's batches are 3x the others': its data ends first, and it applies theirs
    # (without, a run lost 94 of the 6,000 examples in graph mode).
    chief = (tmp_path / "logs" / "workerlog.0").read_text()
    assert re.search(r"sync: the chief applied \d+ step\(s\) of the workers still training "
                     "after its own data ended", chief), chief[-3000:]


@pytest.mark.budget(60, why="tfpsx-run, 1 PS + 2 hybrid workers, or 2 collective ranks "
                            "(Keras or graph mode)")
# Each mode and each front-end once in make test (the other two pairs: make test-all).
@pytest.mark.parametrize("script,mode", [
    ("visits_job.py", "collective"), ("graph_visits_job.py", "hybrid"),
    pytest.param("visits_job.py", "hybrid", marks=pytest.mark.slow),
    pytest.param("graph_visits_job.py", "collective", marks=pytest.mark.slow)])
def test_lockstep_from_splits_every_example_once_and_equal_copies(tmp_path, examples, script,
                                                                  mode):
    """The hybrid and collective modes from splits: the workers step together (each step
    all-reduces the gradients of the weights every worker holds), but splits leased as
    each goes end their data at different steps. The chief reads 3x the others' batch,
    so its data ends first: it takes part in the others' steps idle (zeros and a count
    of 0 in each all-reduce: a batch of weight 0), applying each, until a step no worker
    trains (the chief usually; the other when its last split ends first). Every example is in the model once (hybrid: the counter is a table on the
    PS; collective, no servers: a dense weight of every rank, its input's coordinator
    on rank 0), and every worker's copy of the weights is the same, bit for bit (each
    applied every step). Without the idle steps the others' all-reduce waited for the
    chief's and the job failed."""
    err, visits = run_job(tmp_path, examples, script, 2,
                          ["--mode", mode, "--split_bytes", "5000",
                           "--chief_batch", str(3 * BATCH)]
                          + (["--examples", str(EXAMPLES), "--input", "splits"]
                             if script == "visits_job.py" else []),
                          servers=0 if mode == "collective" else 1)
    assert_each_once(visits, repeats_at_most=0)
    copies = [np.load(tmp_path / "out" / f"dense.{w}.npz") for w in range(2)]
    assert len(copies[0].files) == len(copies[1].files) >= 1
    for name in copies[0].files:
        np.testing.assert_array_equal(copies[0][name], copies[1][name])
        assert np.abs(copies[0][name]).sum() > 0  # trained, not zeros
    # (Usually the chief's data ends first; splits are leased as each reads, so the
    # other's last split may end first (CI once logged rank 1's, 1 idle step), or both
    # at the same step (once in ~20 runs here: no idle step to take part in).
    logs = "".join((tmp_path / "logs" / f"workerlog.{w}").read_text() for w in range(2))
    who, others = "(worker|rank) [01]", "(workers|ranks)"
    first = re.findall(f"{mode}: {who}'s data ended first: it applied \\d+ step\\(s\\) of "
                       f"the {others} still training", logs)
    last = re.findall(f"{mode}: {who}'s data ended at the job's last step: no step of the "
                      f"{others} to apply", logs)
    assert (len(first), len(last)) in ((1, 1), (0, 2)), logs[-3000:]


@pytest.mark.budget(60, why="tfpsx-run, 2 collective ranks, rank 1 SIGKILLed: the whole "
                            "job started again from rank 0's checkpoint")
@pytest.mark.parametrize("script", [
    pytest.param("visits_job.py", marks=pytest.mark.slow),  # (Keras: make test-all)
    "graph_visits_job.py"])
def test_collective_from_splits_a_rank_killed_resumes_skipping_nothing(tmp_path, examples,
                                                                       script):
    """A collective job from splits (its coordinator on rank 0: no servers), rank 1
    SIGKILLed after 30 batches: a collective cannot go on without it, so tfpsx-run starts
    every rank again, and rank 0 restores its checkpoint, the input's position saved
    before the model (Keras: IncrementalCheckpoint; graph mode: the session's Saver).
    No example is skipped; the repeats are the steps not committed at the save (graph
    mode commits every ~50 ms)."""
    ckpt = tmp_path / "ckpt"
    err, visits = run_job(tmp_path, examples, script, 2,
                          ["--mode", "collective", "--split_bytes", "5000", "--checkpoint",
                           str(ckpt), "--die_after", "1:30", "--step_delay", "0.01"]
                          + (["--examples", str(EXAMPLES), "--input", "splits",
                              "--save_every", "10"] if script == "visits_job.py"
                             else ["--save_steps", "10"]),
                          servers=0)
    assert re.search(r"worker 1 exited with code -9 .*restarting the job", err), err
    chief = (tmp_path / "logs" / "workerlog.0").read_text()
    assert re.search(r"(restored .*input position\(s\) of \['input'\]|input input: position "
                     r"restored from)", chief), chief[-3000:]
    assert_each_once(visits, repeats_at_most=(2 if script == "visits_job.py" else 10) * BATCH)


@pytest.mark.budget(60, why="tfpsx-run, 1 PS + 2 Keras workers + TF's tf.data service (a "
                            "dispatcher, a data worker), the data worker SIGKILLed")
def test_keras_data_workers_killed_lose_nothing(tmp_path, examples):
    """tfpsx-run --data_workers 1: the splits are still leased from PS 0 and committed by
    the steps, but read and parsed on TF's tf.data worker. It is SIGKILLed while the
    workers read: the launcher starts it again on its address, each worker reads again
    what the service had not delivered of its leases (the service alone would lose it:
    its visitation is at most once), and every example is in the model exactly once.
    (On a TensorFlow before tfpsx.data.service.MIN_TF, what each training task's input
    meets instead: the refusal, naming why.)"""
    from tfpsx.data import service

    if tuple(int(p) for p in tf.__version__.split(".")[:2]) < service.MIN_TF:
        with pytest.raises(RuntimeError, match="needs TensorFlow 2.21 or newer"):
            service.address("grpc://127.0.0.1:1")
        return
    err, visits = run_job(tmp_path, examples, "visits_job.py", 2,
                          ["--input", "splits", "--examples", str(EXAMPLES),
                           "--step_delay", "0.05", "--split_bytes", "60000"],
                          data_workers=1, kill_data_worker=True)
    assert re.search(r"data_worker \d exited with code -9 .*started it again on its "
                     r"address", err), err
    logs = "".join((tmp_path / "logs" / f"workerlog.{i}").read_text() for i in range(2))
    assert "read and parsed by the tf.data service" in logs
    # (Whether the kill cut a read short depends on where the dispatcher had put the reads
    # in flight; tests/ops/test_data_splits.py stops a data worker mid-read for sure.)
    print("reads again:", logs.count("reading the rest again"))
    assert_each_once(visits, repeats_at_most=0)


@pytest.mark.budget(75, why="tfpsx-run, 1 PS + 2 Keras workers, the server SIGKILLed: the "
                            "whole job started again (6 TensorFlow imports)")
# make test: GEO's exact saves (the restore of the input's position, and the barrier with
# GEO's push); the default (async, not exact: the same restore, a bound on repeats),
# async's and sync's exact saves in make test-all.
@pytest.mark.parametrize("exact,kill,mode", [
    pytest.param(False, "server", "async", marks=pytest.mark.slow),
    pytest.param(True, "server", "async", marks=pytest.mark.slow),
    pytest.param(True, "server", "sync", marks=pytest.mark.slow),
    (True, "server", "geo"),
    pytest.param(False, "chief", "async", marks=pytest.mark.slow),
    pytest.param(True, "chief", "async", marks=pytest.mark.slow)],
    ids=["", "exact_saves", "sync_exact_saves", "geo_exact_saves", "chief",
         "chief_exact_saves"])
def test_keras_a_job_restored_from_its_checkpoint_skips_nothing(tmp_path, examples, exact,
                                                                kill, mode):
    """The server (or the chief: slow) SIGKILLed after the chief's first incremental
    checkpoint: tfpsx-run starts the whole job again, the chief restores the tables, the weights and the input's
    position (saved before them), and every example is in the final model: those trained
    after the checkpoint were rolled back with it and trained again; at most the steps of
    the save's own window repeat, and none with exact_saves (the save's barrier: every
    worker's steps committed and paused around it; in sync, a worker acks it from its
    wait for the chief, where it is while the chief saves; in GEO, a worker pushes its
    unpushed steps first, in a round that commits their positions, and the chief saves
    the job's dense weights, not its copy). Without GEO's push at the barrier, a round
    in flight at the save was in the model and not in its positions: 50 repeats in 1
    of 2 runs."""
    ckpt = tmp_path / "ckpt"
    err, visits = run_job(tmp_path, examples, "visits_job.py", 2,
                          ["--input", "splits", "--examples", str(EXAMPLES), "--checkpoint",
                           str(ckpt), "--save_every", "10", "--step_delay", "0.02",
                           "--split_bytes", "5000", "--mode", mode] + ["--exact"] * exact,
                          kill_server_after=ckpt, kill=kill)
    killed = "server 0" if kill == "server" else "worker 0"
    assert re.search(rf"{killed} exited with code -9 .*restarting the job", err), err
    chief = (tmp_path / "logs" / "workerlog.0").read_text()
    assert re.search(r"restored .*ckpt-\d+\.tables: .*input position\(s\) of \['input'\]",
                     chief), chief[-3000:]
    # Without exact saves: each worker's steps between the position's save and the
    # model's, and those of its last commit interval (50 ms here, 2-3 steps of 20 ms):
    # up to 4 batches a worker on a loaded 2-core machine (350 repeats, 7 batches of 3
    # workers, in one CI run there when this test ran 3; 50-150 unloaded)
    assert_each_once(visits, repeats_at_most=0 if exact else 2 * 4 * BATCH)
    if exact:
        logs = [(tmp_path / "logs" / "workerlog.1").read_text()]
        paused = [re.findall(r"worker \d paused (\d+) ms for the chief's exact save", log)
                  for log in logs]
        acked = [log.count("acked the chief's exact save from its wait") for log in logs]
        assert all(p or a for p, a in zip(paused, acked)), \
            "the other workers paused at the saves (sync: acked from their waits)"
        print("barrier pauses (ms):", paused, "acks from a wait:", acked)
        up = [float(m) for m in re.findall(r"exact save: the barrier was up (\d+) ms", chief)]
        assert up and "did not pause within" not in chief, chief[-3000:]
        print("barrier up (ms):", up)


@pytest.mark.budget(60, why="tfpsx-run, 1 PS + 2 (async) or 3 (GEO) graph-mode workers, a "
                            "worker SIGKILLed and started again in place")
# (GEO's: make test-all. At 3 workers its table trains async, so its positions commit as
# async's; graph mode's GEO commit with a round is the session test's below.)
@pytest.mark.parametrize("mode", ["async", pytest.param("geo", marks=pytest.mark.slow)])
def test_graph_a_worker_killed_and_started_again_skips_nothing(tmp_path, examples, mode):
    """Graph mode (tfpsx.data.next_batch in a MonitoredTrainingSession): the same kill;
    async commits after each run (every 50 ms), GEO when its round pushed. At 3 workers
    GEO chooses table by table (geo_table_choice="auto"): this job's table trains async
    throughout (its rounds would move more), so each step is on the PS when it ends and
    its position commits as async's: the same bound (with rounds, the steps since the
    last round, K = 5, up to 2K while a round runs, would be trained again: docs/data.md)."""
    _, visits = run_job(tmp_path, examples, "graph_visits_job.py", 3 if mode == "geo" else 2,
                        ["--mode", mode, "--die_after", "1:30", "--step_delay", "0.01",
                         "--split_bytes", "5000"])
    if mode == "geo":
        chief = (tmp_path / "logs" / "workerlog.0").read_text()
        assert "GEO: table 'visits' trains async" in chief, chief[-3000:]
        assert "tries rounds" not in chief and \
            "every table trains async: a round, which moves nothing" in chief, chief[-3000:]
    assert_each_once(visits, repeats_at_most=4 * BATCH)


@pytest.mark.budget(45, why="tfpsx-run, 1 PS + 2 graph-mode GEO workers, one's session "
                            "created again after an error")
def test_graph_geo_a_session_created_again_skips_nothing(tmp_path, examples):
    """Graph mode's GEO at 2 workers (rounds every K = 5 steps): worker 1's run fails once
    with a broken connection's AbortedError, and TF's MonitoredSession creates its session
    again. The communicator's round in flight ends before TF closes the old session; the
    steps since it are dropped (the dense copies initialized anew, the table's copy takes
    the PS's rows, their positions not committed), and the new iterator reads their
    examples again from the committed positions: nothing skipped, and nothing trained
    twice but the few batches of the commits' granularity."""
    _, visits = run_job(tmp_path, examples, "graph_visits_job.py", 2,
                        ["--mode", "geo", "--abort_after", "1:15", "--step_delay", "0.01",
                         "--split_bytes", "5000"])
    log = (tmp_path / "logs" / "workerlog.1").read_text()
    assert re.search(r"GEO: worker 1's session was created again: the \d+ local step\(s\) "
                     r"since the last round are dropped \(its dense weights initialized anew "
                     r"from the PS, 1 table copy\(ies\) took the PS's rows\)", log), log[-3000:]
    assert_each_once(visits, repeats_at_most=2 * BATCH)
    # Once both ended and pulled once more, each copy equals the PS's table (every row
    # pushed and pulled). Before, worker 1's differed: in 1,385 rows when its readers
    # were registered again (which took the keys they held), and in 300-500 rows in 2 of
    # 5 runs on a loaded machine when TF closed the old session under a round in flight.
    copies = [tfpsx.metrics.read(str(tmp_path / "logs"), "worker", w, "geo_copy")
              for w in (0, 1)]
    assert all(c and c[-1]["differs"] == 0 for c in copies), copies


@pytest.mark.budget(60, why="tfpsx-run, 1 PS + 3 graph-mode workers in sync, a worker "
                            "SIGKILLed and started again in place")
def test_graph_sync_from_splits_a_worker_killed_skips_nothing(tmp_path, examples):
    """Graph mode's sync from splits: the same kill; a worker commits a run's batch once
    its hook saw the chief apply the step, and the chief, its data done first (3x the
    batch), applies the others' last steps."""
    _, visits = run_job(tmp_path, examples, "graph_visits_job.py", 3,
                        ["--mode", "sync", "--die_after", "1:30", "--split_bytes", "5000",
                         "--chief_batch", str(3 * BATCH)])
    assert_each_once(visits, repeats_at_most=2 * BATCH)
    chief = (tmp_path / "logs" / "workerlog.0").read_text()
    assert re.search(r"sync: the chief applied \d+ step\(s\) of the workers still training "
                     "after its own data ended", chief), chief[-3000:]


@pytest.mark.budget(75, why="tfpsx-run, 1 PS + 3 graph-mode workers, the server SIGKILLed: "
                            "the whole job started again")
@pytest.mark.slow
@pytest.mark.parametrize("exact,mode", [(False, "async"), (True, "async"), (True, "sync"),
                                        (True, "geo")],
                         ids=["", "exact_saves", "sync_exact_saves", "geo_exact_saves"])
def test_graph_a_job_restored_from_its_checkpoint_skips_nothing(tmp_path, examples, exact,
                                                                mode):
    """Graph mode's: the server SIGKILLed after the chief's first checkpoint, the job
    restored from it (the position saved before the model); with exact saves every count
    is 1 (sync: the workers ack the save's barrier from their wait for the chief, their
    applied runs' positions committed first; GEO: each worker pushes its unpushed steps
    at the barrier, in a round that commits their positions)."""
    ckpt = tmp_path / "ckpt"
    _, visits = run_job(tmp_path, examples, "graph_visits_job.py", 3,
                        ["--checkpoint", str(ckpt), "--save_steps", "20", "--step_delay",
                         "0.03", "--split_bytes", "5000", "--mode", mode]
                        + ["--exact"] * exact, kill_server_after=ckpt)
    chief = (tmp_path / "logs" / "workerlog.0").read_text()
    assert re.search(r"input input: position restored from .*model\.ckpt-\d+", chief)
    assert "did not pause within" not in chief, chief[-3000:]
    assert_each_once(visits, repeats_at_most=0 if exact else 4 * 3 * BATCH)
    # The chief's TensorBoard run holds the input's scalars beside TF's own.
    done = {}
    for events in ckpt.glob("events.out.tfevents.*"):
        for event in tf.compat.v1.train.summary_iterator(str(events)):
            for value in event.summary.value:
                if value.tag == "input/input/splits_done":
                    done[event.step] = value.simple_value
    # (sync's 40 steps write them at the first step and the last only, when the epoch is
    # done: the next, first open, has none done yet)
    assert done and (mode == "sync" or max(done.values()) >= 1), done


@pytest.mark.budget(60, why="1 PS + 2 Keras workers through the scheduler, a third joining "
                            "while they train")
@pytest.mark.parametrize("mode", ["async", pytest.param("geo", marks=pytest.mark.slow)])
def test_a_slow_worker_takes_fewer_splits_and_a_joiner_takes_its_own(tmp_path, examples,
                                                                     mode):
    """Splits are leased as each worker goes: worker 1, slowed 4x, takes far fewer than
    worker 0, and a worker that joins the running job takes splits (within a lease of its
    start); every example once an epoch, 4 epochs (the job's: the joiner's fit reads no
    epoch past them)."""
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(examples, out / "data")
    c = cluster(tmp_path / "logs", 1, 2, script="visits_job.py", config_mode="scheduler",
                timeout=200, env={"TFPSX_MAX_WORKER_NUM": "3"},
                args=["--out", str(out), "--mode", mode, "--input", "splits",
                      "--examples", str(EXAMPLES),
                      "--epochs", "4", "--step_delay", "0.015", "--slow_worker", "1",
                      "--slow_factor", "4", "--split_bytes", "5000"])
    try:
        c.start()
        deadline = time.monotonic() + 120
        while "ended epoch" not in c.log("worker", 0) and \
                "worker 0 gave back" not in c.log("worker", 0):
            assert time.monotonic() < deadline and c.procs[("worker", 0)].poll() is None, \
                c.logs()[-3000:]
            time.sleep(0.2)
        joiner = c.add_worker()
        codes = c.wait(timeout=200)
        assert all(code == 0 for code in codes.values()), f"{codes}\n{c.logs()[-3000:]}"
    finally:
        c.stop()
    records = {i: c.metrics("worker", i, "visits")[-1] for i in range(3)}
    batches = {i: r["batches"] for i, r in records.items()}
    assert batches[1] * 2 < batches[0], batches  # 4x slower: far fewer of the batches
    assert batches[joiner[1]] >= 1 and records[joiner[1]]["input"]["leases"] >= 1, records
    assert_each_once(dict(zip(*(np.load(out / "visits.npz")[k].tolist()
                                for k in ("ids", "counts")))), repeats_at_most=0, epochs=4)


# The kill matrix: both front-ends, async / GEO / sync, a worker (started again in place),
# the server or the chief (the whole job restarted from its checkpoint) SIGKILLed at a
# moment drawn from the seed, within 2.5 s of the chief's first checkpoint.
MATRIX = [(front, mode, victim) for front in ("keras", "graph")
          for mode in ("async", "geo", "sync") for victim in ("worker", "server", "chief")]


@pytest.mark.slow
@pytest.mark.budget(90, why="tfpsx-run, 1 PS + 3 workers, a process SIGKILLed at a random "
                            "moment, the job (or the worker) started again")
@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("front,mode,victim", MATRIX, ids=["-".join(m) for m in MATRIX])
def test_a_process_killed_at_a_random_moment_skips_nothing(tmp_path, examples, front, mode,
                                                           victim, seed):
    """No example is skipped, whatever dies when; the repeats stay within the bound the
    modes state: the steps in flight, GEO's unpushed round, and (a restored job) the steps
    between a checkpoint's position and its model (docs/data.md)."""
    import random

    delay = random.Random(f"{front}-{mode}-{victim}-{seed}").uniform(0.0, 2.5)
    ckpt = tmp_path / "ckpt"
    if front == "keras":
        script, args = "visits_job.py", ["--input", "splits", "--examples", str(EXAMPLES),
                                         "--checkpoint", str(ckpt), "--save_every", "10"]
    else:
        script, args = "graph_visits_job.py", ["--checkpoint", str(ckpt), "--save_steps", "20"]
    err, visits = run_job(tmp_path, examples, script, 3,
                          args + ["--mode", mode, "--step_delay", "0.03", "--split_bytes",
                                  "5000"], kill_server_after=ckpt, kill=victim, delay=delay)
    print(f"{front} {mode}: {victim} killed {delay:.2f} s after the first checkpoint")
    what = {"worker": "worker 1", "server": "server 0", "chief": "worker 0"}[victim]
    assert re.search(rf"{what} exited with code -9", err), err[-3000:]
    # A save's window (every 10 Keras / 20 graph steps) on each of the 3 workers, and the
    # steps in flight or in GEO's unpushed round (K = 5).
    assert_each_once(visits, repeats_at_most=3 * (20 + 5 + 2) * BATCH)


def _wait_for_log(proc, log, needle, count=1, timeout=150):
    deadline = time.monotonic() + timeout
    while not (log.exists() and log.read_text().count(needle) >= count):
        assert proc.poll() is None, f"the job ended: {proc.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline, f"waited {timeout} s for {needle!r} in {log}"
        time.sleep(0.1)


@pytest.mark.budget(90, why="two runs of tfpsx-run, 1 PS + 2 Keras workers each (3 "
                            "TensorFlow imports a run), each stopped by SIGTERM")
def test_keras_a_stream_trains_files_as_they_land_and_sigterm_stops_it_losing_nothing(
        tmp_path):
    """A job on tfpsx.data.stream: two hours' folders land before it starts, a third
    while it runs; SIGTERM to tfpsx-run stops it in order (exit 0: the workers end their
    datasets, the chief saves its last checkpoint and publishes it); a fourth hour lands
    while it is down; started again, the job restores the position and trains the rest
    of the third hour and the fourth, until SIGTERM again. Every example is in the final
    model (visit counts of 1; a save's window may repeat a few batches), and the
    published sequence goes on across the restart (a new base), as does the global step
    (restored with the checkpoint: it counted from 0 again before). Its own two clusters:
    a stream job ends only when stopped, and its restart from the checkpoint is the
    point; no scenario's records hold that."""
    out, ckpt, published = tmp_path / "out", tmp_path / "ckpt", tmp_path / "published"
    stream = out / "stream"
    hour = 600
    for h in range(2):
        visits_job.write_files(str(stream / f"h{h:02d}"), hour, first=h * hour, marker=True)

    def start(run):
        return subprocess.Popen(
            RUN + ["--log_dir", str(tmp_path / f"logs{run}"), "--server_num", "1",
                   "--worker_num", "2", "--timeout", "200",
                   os.path.join(SCRIPTS, "visits_job.py"), "--out", str(out), "--input",
                   "stream", "--checkpoint", str(ckpt), "--save_every", "5", "--publish",
                   str(published), "--split_bytes", "5000", "--step_delay", "0.01"],
            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True, cwd=str(tmp_path))

    def stop(proc):
        proc.send_signal(15)
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0 and "stopped on SIGTERM: every worker ended on its own" \
            in stderr, stderr[-3000:]

    out.mkdir(exist_ok=True)
    proc = start(1)
    try:
        logs = tmp_path / "logs1"
        for i in range(2):  # (both workers in their fit, the landed hours taken)
            _wait_for_log(proc, logs / f"workerlog.{i}", "waits for files matching")
        visits_job.write_files(str(stream / "h02"), hour, first=2 * hour, marker=True)
        _wait_for_log(proc, logs / "workerlog.0", "h02")  # (the chief's scan appended it)
        stop(proc)
        first = publish.published(str(published))
        assert first["bases"] and not first["partial"], first
        visits_job.write_files(str(stream / "h03"), hour, first=3 * hour, marker=True)
        proc = start(2)
        logs = tmp_path / "logs2"
        chief = logs / "workerlog.0"
        _wait_for_log(proc, chief, "input position(s) of ['input']")  # restored
        for i in range(2):
            _wait_for_log(proc, logs / f"workerlog.{i}", "waits for files matching")
        stop(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait(timeout=30)
    got = np.load(out / "visits.npz")
    visits = dict(zip(got["ids"].tolist(), got["counts"].tolist()))
    counts = np.array([visits.get(i, 0.0) for i in range(4 * hour)])
    histogram = {int(v): int((counts == v).sum()) for v in np.unique(counts)}
    assert counts.min() == 1 and counts.max() <= 2 and histogram.get(2, 0) <= 3 * 2 * BATCH, \
        histogram
    after = publish.published(str(published))
    assert max(after["bases"]) > max(first["bases"] + first["deltas"]), (first, after)

    def step(sequence):
        folder = published / str(sequence)
        manifest = (folder / publish.BASE_MANIFEST if folder.exists() else
                    published / publish.DELTAS / str(sequence) / publish.MANIFEST)
        return json.loads(manifest.read_text())["global_step"]

    # The restored job's global step goes on from its checkpoint's.
    last_before = max(first["bases"] + first["deltas"])
    assert step(last_before + 1) > step(last_before), (step(last_before), after)

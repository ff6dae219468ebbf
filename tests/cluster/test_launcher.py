"""tfpsx-run and the scheduler path, as users drive them: real processes on 127.0.0.1."""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import SCRIPTS, wait_for_log

pytestmark = pytest.mark.timeout(180)
RUN = [sys.executable, "-m", "tfpsx.launcher.run"]


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = SCRIPTS + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _launch(tmp_path, args, env, timeout=150):
    return subprocess.run(RUN + ["--log_dir", str(tmp_path / "logs")] + args, env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=str(tmp_path))


@pytest.mark.parametrize("mode", [
    pytest.param([], id="scheduler"),
    pytest.param(["--no_scheduler"], id="env", marks=pytest.mark.slow),
    pytest.param(["--no_scheduler", "--config", "tf_config"], id="tf_config",
                 marks=pytest.mark.slow)])
def test_job_runs_to_the_end(tmp_path, mode):
    proc = _launch(tmp_path, mode + ["--server_num", "2", "--worker_num", "2",
                                     os.path.join(SCRIPTS, "job.py")],
                   _env(JOB_BARRIERS="2", TFPSX_HEARTBEAT_INTERVAL="0.5"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "job finished: 2 server(s), 2 worker(s) exited 0" in proc.stdout
    assert "[worker 0] BARRIER_PASSED 1" in proc.stdout
    logs = tmp_path / "logs"
    for i in range(2):
        assert "RUN_SERVER_RETURNED stopped=[0, 1] lost=[]" in (logs / f"serverlog.{i}").read_text()
    if not mode:
        sched = (logs / "scheduler.log").read_text()
        assert re.search(r"assigned server rank 1 to 127\.0\.0\.1:\d+", sched)
        assert re.search(r"cluster ready: 2 servers, 2 workers in [\d.]+ s", sched)
        assert "scheduler exiting" in sched


def _pids(pid_dir, count, launcher=None, timeout=90):
    """{role: pid} of the job's processes once ``count`` have written theirs."""
    deadline = time.monotonic() + timeout
    while True:
        pids = {p.read_text(): int(p.name) for p in pid_dir.iterdir() if p.read_text()}
        if len(pids) >= count:
            return pids
        assert time.monotonic() < deadline and (launcher is None or launcher.poll() is None)
        time.sleep(0.1)


def _all_gone(pids, timeout=10):
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not [p for p in pids if _alive(p)]


@pytest.mark.parametrize("mode", [
    pytest.param([], id="scheduler"),
    pytest.param(["--no_scheduler"], id="env", marks=pytest.mark.slow)])
def test_a_failing_chief_stops_the_job_and_nothing_is_left(tmp_path, mode):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    start = time.monotonic()
    proc = _launch(tmp_path, mode + ["--server_num", "1", "--worker_num", "2",
                                     os.path.join(SCRIPTS, "job.py")],
                   _env(JOB_FAIL="0:3", JOB_SLEEP="600", JOB_PID_DIR=str(pid_dir)))
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert time.monotonic() - start < 100
    assert re.search(r"FAILED: worker 0 exited with code 3 .*workerlog\.0", proc.stderr)
    pids = [int(p.name) for p in pid_dir.iterdir()]
    assert len(pids) == 3
    assert _all_gone(pids)


def test_a_failing_non_chief_worker_leaves_the_others_running(tmp_path):
    proc = _launch(tmp_path, ["--server_num", "1", "--worker_num", "3",
                              os.path.join(SCRIPTS, "job.py")],
                   _env(JOB_FAIL="1:3", JOB_SLEEP="3", TFPSX_HEARTBEAT_TIMEOUT="3",
                        TFPSX_HEARTBEAT_INTERVAL="0.5"))
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert re.search(r"worker 1 exited with code 3 \(failed; see .*workerlog\.1\); the other "
                     r"workers go on", proc.stderr), proc.stderr
    logs = tmp_path / "logs"
    for i in (0, 2):  # they ran to their end
        assert f"worker {i} stopped" in (logs / f"workerlog.{i}").read_text()
    assert "RUN_SERVER_RETURNED stopped=[0, 2] lost=[1]" in (logs / "serverlog.0").read_text()
    assert "FAILED: worker 1 exited with code 3" in proc.stderr


# tfpsx-run whose first pick of ports gives server 0 the port in argv[1] (one the test
# holds): the race of a port taken between the launcher's pick and the server's bind,
# made certain.
_TAKEN_FIRST = (
    "import sys\n"
    "import tfpsx.launcher.local as local\n"
    "taken, pick = [int(sys.argv[1])], local.pick_ports\n"
    "def first_taken(count):\n"
    "    ports = pick(count)\n"
    "    if taken:\n"
    "        ports[0] = taken.pop()\n"
    "    return ports\n"
    "local.pick_ports = first_taken\n"
    "from tfpsx.launcher.run import main\n"
    "sys.exit(main(sys.argv[2:]))\n")


@pytest.mark.budget(40, why="a job of 1 server + 1 worker started twice: the first one's "
                            "server finds its port taken")
def test_a_port_taken_before_the_server_binds_starts_the_job_again_on_new_ports(tmp_path):
    """A job of its own: the launcher must be started with a port the test holds, and
    the server that finds it taken must exit, which no scenario's job may do."""
    holder = socket.socket()
    try:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-c", _TAKEN_FIRST, str(port), "--log_dir", str(tmp_path / "logs"),
             "--no_scheduler", "--server_num", "1", "--worker_num", "1",
             os.path.join(SCRIPTS, "job.py")],
            env=_env(), capture_output=True, text=True, timeout=150, cwd=str(tmp_path))
    finally:
        holder.close()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"server 0 could not listen on its address \(another process holds the "
                     r"port; see .*serverlog\.0\); starting the job again on new ports "
                     r"\(1 of 3\)", proc.stderr), proc.stderr
    log = (tmp_path / "logs" / "serverlog.0").read_text()
    assert f"PortTakenError: server 0 could not listen on 127.0.0.1:{port}" in log, log
    assert "RUN_SERVER_RETURNED stopped=[0] lost=[]" in log  # the second start's
    assert "job finished: 1 server(s), 1 worker(s) exited 0" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_launchers_started_together_both_finish(tmp_path):
    """The soak of the race above as users meet it: two tfpsx-run jobs started at one
    instant, three times; every job finishes (a port one took from the other's pick is
    retried on new ports)."""
    for round_ in range(3):
        procs = [subprocess.Popen(
            RUN + ["--log_dir", str(tmp_path / f"logs{round_}_{j}"), "--server_num", "1",
                   "--worker_num", "2", os.path.join(SCRIPTS, "job.py")],
            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            cwd=str(tmp_path)) for j in range(2)]
        try:
            outs = [p.communicate(timeout=120) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        for p, (out, err) in zip(procs, outs):
            assert p.returncode == 0, out + err
            assert "job finished: 1 server(s), 2 worker(s) exited 0" in out


def _start_long_job(tmp_path, extra=(), stdout=subprocess.PIPE):
    """tfpsx-run of 1 server + 2 sleeping workers that write their pids (and roles) to
    tmp_path/pids; returns (launcher, pid_dir)."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    launcher = subprocess.Popen(
        RUN + ["--log_dir", str(tmp_path / "logs"), "--server_num", "1", "--worker_num", "2"] +
        list(extra) + [os.path.join(SCRIPTS, "job.py")],
        env=_env(JOB_SLEEP="600", JOB_PID_DIR=str(pid_dir)), stdout=stdout, stderr=stdout,
        text=True, start_new_session=True, cwd=str(tmp_path))
    return launcher, pid_dir


@pytest.mark.parametrize("mode", [
    pytest.param([], id="scheduler"),
    pytest.param(["--no_scheduler"], id="env", marks=pytest.mark.slow)])
def test_a_killed_server_stops_the_job_naming_it(tmp_path, mode):
    launcher, pid_dir = _start_long_job(tmp_path, mode)
    try:
        pids = _pids(pid_dir, 3, launcher)
        os.kill(pids["server"], signal.SIGKILL)
        killed = time.monotonic()
        out, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert time.monotonic() - killed < 15
    assert launcher.returncode == 128 + signal.SIGKILL, out + err
    assert re.search(r"server 0 exited with code -9 \(killed by SIGKILL\) while workers were "
                     r"running; stopping the job", err), err
    assert re.search(r"FAILED: server 0 exited with code -9 .*serverlog\.0", err), err
    assert _all_gone(pids.values())


def _kill_one_child(launcher, match, ready, timeout):
    """Once ``ready()`` returned, SIGKILLs the one process the launcher started (at any
    depth) that ``match(psutil.Process)`` picks, by PID; returns the launcher's (stdout,
    stderr) when it exits. The launcher's process group is killed if it outlives the test."""
    import psutil

    try:
        ready()
        chosen = [p for p in psutil.Process(launcher.pid).children(recursive=True) if match(p)]
        assert len(chosen) == 1, chosen
        chosen[0].kill()
        return launcher.communicate(timeout=timeout)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()


def test_a_killed_scheduler_is_restarted_and_the_job_goes_on(tmp_path):
    """The scheduler holds no model: killed, it is restarted on its address, takes the
    job back from its journal, and the job ends normally (a barrier after the restart
    passes; the servers see both workers finish)."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    launcher = subprocess.Popen(
        RUN + ["--log_dir", str(tmp_path / "logs"), "--server_num", "1", "--worker_num", "2",
               os.path.join(SCRIPTS, "job.py")],
        env=_env(JOB_SLEEP="6", JOB_LATE_BARRIER="1", JOB_PID_DIR=str(pid_dir),
                 TFPSX_HEARTBEAT_INTERVAL="0.5"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        cwd=str(tmp_path))
    out, err = _kill_one_child(
        launcher, lambda p: "tfpsx.control.scheduler" in " ".join(p.cmdline()),
        ready=lambda: _pids(pid_dir, 3, launcher), timeout=90)  # once the cluster is complete
    assert launcher.returncode == 0, out + err
    assert re.search(r"the scheduler exited with code -9 \(killed by SIGKILL\); restarting it "
                     r"on 127\.0\.0\.1:\d+ \(1 of 3\): the job goes on", err), err
    logs = tmp_path / "logs"
    assert "took back the job journaled in" in (logs / "scheduler.log").read_text()
    for i in range(2):
        assert "LATE_BARRIER_PASSED" in (logs / f"workerlog.{i}").read_text()
    assert "RUN_SERVER_RETURNED stopped=[0, 1] lost=[]" in (logs / "serverlog.0").read_text()
    assert not (logs / "scheduler.state").exists()  # the job ended: nothing to resume


def _saved_step(ckpt) -> int:
    """The global step of the newest checkpoint in ``ckpt`` (-1: none yet)."""
    try:
        text = (ckpt / "checkpoint").read_text()
    except FileNotFoundError:
        return -1
    found = re.search(r'^model_checkpoint_path: ".*-(\d+)"', text, re.M)
    return int(found.group(1)) if found else -1


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_max_restarts_starts_a_lost_worker_again_in_place(tmp_path):
    """--max_restarts 1: a non-chief worker killed mid-training is started again with its
    rank and address; it joins the running job (sync, the hardest case: it takes the lost
    worker's part of each step, so the chief's steps go on) and the job ends normally.
    Async and GEO restart it the same way."""
    mode = "sync"
    import tfpsx

    logs = tmp_path / "logs"
    launcher = subprocess.Popen(
        RUN + ["--log_dir", str(logs), "--server_num", "1", "--worker_num", "2",
               "--max_restarts", "1", "--timeout", "200",
               os.path.join(SCRIPTS, "training_job.py"), "--mode", mode, "--steps", "600",
               "--step_delay", "0.02"],
        env=_env(TFPSX_HEARTBEAT_INTERVAL="0.5"), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True, cwd=str(tmp_path))

    def training():  # worker 1 is in its training loop
        deadline = time.monotonic() + 120
        while "session ready" not in _read(logs / "workerlog.1"):
            assert launcher.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(1.0)

    out, err = _kill_one_child(
        launcher, lambda p: p.environ().get("TFPSX_ROLE") == "worker" and
        p.environ().get("TFPSX_RANK") == "1", ready=training, timeout=200)
    assert launcher.returncode == 0, out[-3000:] + err
    assert re.search(r"worker 1 exited with code -9 \(killed by SIGKILL; see .*workerlog\.1\); "
                     r"starting it again in place \(1 of 1\)", err), err
    assert "restarting the job" not in err  # the others went on: no job restart
    assert "restart 1 of 1 after worker 1 exited with code -9" in _read(logs / "workerlog.1")
    again = tfpsx.metrics.read(str(logs), "worker", 1, "training")
    assert len(again) == 1 and again[0]["local_steps"] > 0, again  # the new one trained
    chief = tfpsx.metrics.read(str(logs), "worker", 0, "training")[-1]
    assert chief["global_step"] >= 600 and chief["eval_loss"] < 0.05, chief


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("tiered", [False, True], ids=["ram", "tiered"])
def test_max_restarts_geo_equals_a_run_resumed_from_the_same_checkpoint(tmp_path, tiered):
    """Deterministic GEO with a table, the server killed with SIGKILL twice at random
    moments of training, --max_restarts 2: every process starts again, the chief resumes
    from its last checkpoint (the table from an incremental chain: a full part every 3
    saves, deltas between), and the job ends with exactly the model of an uninterrupted
    job started from the last restart's checkpoint (nothing of a restart leaks into the
    model). Tiered: the tables on the server's disk beyond their RAM budget
    (TieredBackend), a wide table of ~30k ids with rows on disk at each kill; the
    restarted server discards the files the killed one left and restores the
    checkpoint's rows (the final eval reads them, from RAM and disk)."""
    import random
    import shutil

    import psutil
    import tfpsx

    def job(logs, ckpt, restarts):
        return subprocess.Popen(
            RUN + ["--log_dir", str(logs), "--server_num", "1", "--worker_num", "2",
                   "--max_restarts", str(restarts), "--timeout", "300",
                   os.path.join(SCRIPTS, "training_job.py"), "--mode", "geo", "--k_steps", "5",
                   "--deterministic", "--syncs", "30", "--step_delay", "0.03",
                   "--checkpoint_dir", str(ckpt), "--save_steps", "20", "--table",
                   "--incremental", "3"] + tier,
            env=_env(TFPSX_HEARTBEAT_INTERVAL="0.5"), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, start_new_session=True, cwd=str(tmp_path))

    def disk_files():  # the wide table's segment files on the server's disk
        part = tier_dir / "wide" / "part_0"
        return [n for n in os.listdir(part) if n.startswith("seg_")] if part.exists() else []

    tier_dir = tmp_path / "tables"
    tier = ["--table_ram_bytes", "2000000", "--table_dir", str(tier_dir)] if tiered else []
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    seed = random.randrange(10 ** 6)
    moments = random.Random(seed)
    print(f"kill moments from seed {seed}")
    launcher = job(logs, ckpt, 2)
    snapshot = tmp_path / "snapshot"
    try:
        deadline, after = time.monotonic() + 240, 20
        for restart in (1, 2):
            # A random moment: past a random checkpoint, a random time into the steps.
            target = after + moments.randrange(10, 40)
            while _saved_step(ckpt) < target or (tiered and not disk_files()):
                assert launcher.poll() is None and time.monotonic() < deadline, target
                time.sleep(0.05)
            time.sleep(moments.uniform(0, 0.5))
            server = [p for p in psutil.Process(launcher.pid).children(recursive=True)
                      if p.environ().get("TFPSX_ROLE") == "server"]
            assert len(server) == 1
            server[0].kill()
            # Every old process is gone once the launcher marks the logs; the new chief
            # is still starting: the checkpoints now are what it will resume from.
            while f"===== tfpsx-run: restart {restart} of 2" not in _read(logs / "workerlog.0"):
                assert launcher.poll() is None and time.monotonic() < deadline + 60
                time.sleep(0.02)
            after = _saved_step(ckpt)
        shutil.copytree(ckpt, snapshot)
        state = snapshot / "checkpoint"  # TF's state file names absolute paths
        state.write_text(state.read_text().replace(str(ckpt), str(snapshot)))
        out, err = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert launcher.returncode == 0, out[-3000:] + err
    for restart in (1, 2):
        assert re.search(r"server 0 exited with code -9 \(killed by SIGKILL; see "
                         rf".*serverlog\.0\); restarting the job \({restart} of 2\)", err), err
        assert (f"restart {restart} of 2 after server 0 exited with code -9"
                in _read(logs / "serverlog.0"))
    resumed = [r for r in tfpsx.metrics.read(str(logs), "worker", 0, "resumed")
               if r["checkpoint"] is not None]
    assert len(resumed) == 2 and resumed[0]["global_step"] >= 30, resumed
    assert resumed[1]["global_step"] > resumed[0]["global_step"], resumed
    chief = _read(logs / "workerlog.0")
    assert re.search(r"checkpoint .*model\.ckpt-\d+: tables delta \(\d+ rows", chief), chief[-3000:]
    assert re.search(r"restored .*model\.ckpt-\d+: tables from \d part\(s\)", chief), chief[-3000:]
    if tiered:  # the restarted server's shards, in their folders; the killed one's gone
        assert os.listdir(tier_dir / "bias") == ["part_0"]
        assert os.listdir(tier_dir / "wide") == ["part_0"]
    again = job(tmp_path / "logs_again", snapshot, 0)
    out, err = again.communicate(timeout=200)
    assert again.returncode == 0, out[-3000:] + err
    start = tfpsx.metrics.read(str(tmp_path / "logs_again"), "worker", 0, "resumed")[0]
    assert start["global_step"] == resumed[-1]["global_step"], (start, resumed)
    for i in range(2):
        a = tfpsx.metrics.read(str(logs), "worker", i, "training")[-1]
        b = tfpsx.metrics.read(str(tmp_path / "logs_again"), "worker", i, "training")[-1]
        assert a["global_step"] == b["global_step"], (a, b)
        np.testing.assert_allclose(a["global_w"], b["global_w"], rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(a["global_b"], b["global_b"], rtol=2e-5, atol=1e-6)
        # The eval loss reads the table's rows too: they were restored alike.
        np.testing.assert_allclose(a["eval_loss"], b["eval_loss"], rtol=2e-5, atol=1e-7)


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_max_restarts_brings_a_keras_job_back_from_its_incremental_checkpoint(tmp_path):
    """Keras fit under --max_restarts 1: the server killed after the chief's first
    IncrementalCheckpoint save; the job restarts, the chief restores the tables and
    weights before fit, and the job ends with a trained model."""
    import tfpsx

    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    launcher = subprocess.Popen(
        RUN + ["--log_dir", str(logs), "--server_num", "1", "--worker_num", "2",
               "--max_restarts", "1", "--timeout", "240",
               os.path.join(SCRIPTS, "keras_job.py"), "--mode", "async", "--epochs", "4",
               "--checkpoint", str(ckpt), "--incremental", "2", "--step_delay", "0.005"],
        env=_env(TFPSX_HEARTBEAT_INTERVAL="0.5"), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True, cwd=str(tmp_path))

    def saved():  # the chief saved its first epoch
        deadline = time.monotonic() + 150
        while not (ckpt / "checkpoint.json").exists():
            assert launcher.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)

    out, err = _kill_one_child(launcher, lambda p: p.environ().get("TFPSX_ROLE") == "server",
                               ready=saved, timeout=240)
    assert launcher.returncode == 0, out[-3000:] + err
    assert re.search(r"server 0 exited with code -9 .*; restarting the job \(1 of 1\)", err), err
    chief = _read(logs / "workerlog.0")
    assert re.search(r"restored .*ckpt-\d+\.tables: tables from \d part\(s\), \d+ weights "
                     r"\(step [1-9]\d*\)", chief), chief[-3000:]
    final = tfpsx.metrics.read(str(logs), "worker", 0, "keras")[-1]
    assert final["val_loss"][-1] < 0.45, final  # a trained model (random init: 0.58 .. 0.93)


# (make test-all: make test drives the same restore, Keras GEO from splits, in
# test_data_plane.py::test_keras_a_worker_killed_and_started_again_skips_nothing.)
@pytest.mark.slow
@pytest.mark.budget(90, why="tfpsx-run with 1 PS + 2 Keras workers (3 TensorFlow imports), "
                            "one worker SIGKILLed and started again in place")
@pytest.mark.timeout(300)
def test_a_worker_restarted_in_place_rolls_back_nothing_the_others_trained(tmp_path):
    """Keras async under --max_restarts, the incremental checkpoint every 20 batches on the
    chief and restore(model) before fit on every worker, as docs/recovery.md shows:
    worker 1 SIGKILLed after 25 batches and started again in place. Its restore must not
    roll back the servers (it rolled back what the others trained after the checkpoint):
    a visit counter trained beside the model (tests/cluster/scripts/visits_job.py) says
    each of the chief's examples is in the model exactly once. (Worker 1's own
    part is read again from its start: the static cut's repeats, the data plane's to
    remove.)"""
    import tfpsx

    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    # 400 batches a worker at 20 ms: the chief trains on while worker 1 starts again
    # (before the fix its restore rolled back 250-350 of each other's examples to 0).
    examples, workers = 40000, 2
    proc = subprocess.run(
        RUN + ["--log_dir", str(logs), "--server_num", "1", "--worker_num", str(workers),
               "--max_restarts", "1", "--timeout", "240",
               os.path.join(SCRIPTS, "visits_job.py"), "--out", str(out), "--examples",
               str(examples), "--checkpoint", str(tmp_path / "ckpt"), "--save_every", "20",
               "--die_after", "1:25", "--step_delay", "0.02"],
        env=_env(TFPSX_HEARTBEAT_INTERVAL="0.5"), capture_output=True, text=True,
        timeout=280, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"worker 1 exited with code -9 .*starting it again in place", proc.stderr)
    again = _read(logs / "workerlog.1").split("===== tfpsx-run: restart")[-1]
    assert re.search(r"worker 1 does not restore ckpt-\d+: the chief restores", again), again
    assert "restored" not in again, again
    got = np.load(out / "visits.npz")
    counts = dict(zip(got["ids"].tolist(), got["counts"].tolist()))
    owner = np.arange(examples) % workers  # tfpsx.data.shard: every W-th example
    for w in (0,):
        mine = [counts.get(i, 0.0) for i in np.flatnonzero(owner == w)]
        assert set(mine) == {1.0}, (w, sorted(set(mine)))
    ones = [counts.get(i, 0.0) for i in np.flatnonzero(owner == 1)]
    assert min(ones) >= 1.0 and max(ones) == 2.0, sorted(set(ones))  # read again: repeats
    assert all(r["restored"] is None for r in tfpsx.metrics.read(str(logs), "worker", 1,
                                                                 "visits"))


def _read(path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def test_a_launcher_killed_with_sigkill_leaves_no_orphans(tmp_path):
    launcher, pid_dir = _start_long_job(tmp_path, stdout=subprocess.DEVNULL)
    try:
        pids = _pids(pid_dir, 3, launcher)
        launcher.kill()  # SIGKILL: no handler, no cleanup of its own
        launcher.wait(timeout=10)
        assert _all_gone(list(pids.values()) + [int(p.name) for p in pid_dir.iterdir()])
    finally:
        for p in pid_dir.iterdir():  # whatever survived, by the ids the job wrote
            if _alive(int(p.name)):
                os.kill(int(p.name), signal.SIGKILL)


def test_sigterm_stops_every_process(tmp_path):
    launcher, pid_dir = _start_long_job(tmp_path)
    try:
        _pids(pid_dir, 3, launcher)  # the server and both workers are up
        launcher.send_signal(signal.SIGTERM)
        out, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert launcher.returncode == 128 + signal.SIGTERM, out + err
    assert "interrupted by signal 15; stopped all 4 processes" in err
    pids = [int(p.name) for p in pid_dir.iterdir()]
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)]


def test_plain_tf_config_script_runs_unchanged(tmp_path):
    proc = _launch(tmp_path, ["--no_scheduler", "--config", "tf_config", "--server_grace", "1",
                              "--server_num", "1", "--worker_num", "2",
                              os.path.join(SCRIPTS, "plain_tf_config.py")], _env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[worker 0] PLAIN_TF worker 0 of 2: total" in proc.stdout
    assert "PLAIN_TF worker 1 of 2" in (tmp_path / "logs" / "workerlog.1").read_text()


def test_bad_launcher_arguments(tmp_path):
    proc = _launch(tmp_path, ["--server_num", "two", "x.py"], _env(), timeout=30)
    assert proc.returncode == 2 and "--server_num: expected an integer >= 0, got 'two'" in proc.stderr
    proc = _launch(tmp_path, ["--server_num", "-1", "x.py"], _env(), timeout=30)
    assert proc.returncode == 2 and "--server_num: expected an integer >= 0, got '-1'" in proc.stderr
    proc = _launch(tmp_path, ["--worker_num", "0", "x.py"], _env(), timeout=30)
    assert proc.returncode == 2 and "--worker_num" in proc.stderr
    proc = _launch(tmp_path, ["missing.py"], _env(), timeout=30)
    assert proc.returncode == 2 and "script 'missing.py' not found" in proc.stderr


@pytest.mark.slow
def test_killed_worker_reported_dead_within_heartbeat_timeout(make_cluster):
    c = make_cluster(server_num=1, worker_num=2, config_mode="scheduler",
                     env={"TFPSX_HEARTBEAT_TIMEOUT": "4", "JOB_SLEEP": "12"})
    c.start()
    wait_for_log(c, "worker", 1, "WORKER_READY")
    c.kill("worker", 1)
    killed = time.monotonic()
    while "worker rank 1" not in c.log("scheduler", 0) or "is dead" not in c.log("scheduler", 0):
        assert time.monotonic() - killed < 15, c.logs()
        time.sleep(0.1)
    assert time.monotonic() - killed < 4 + 3  # the timeout plus polling slack
    codes = c.wait([("scheduler", 0), ("server", 0), ("worker", 0)], timeout=90)
    assert set(codes.values()) == {0}, c.logs()
    assert "scheduler reports dead: worker rank 1" in c.log("worker", 0)
    assert "RUN_SERVER_RETURNED stopped=[0] lost=[1]" in c.log("server", 0)


def test_wrong_token_fails_the_node_clearly(make_cluster):
    c = make_cluster(server_num=1, worker_num=1, config_mode="scheduler", token="right",
                     env={"TFPSX_REGISTER_TIMEOUT": "20"})
    c.start([("scheduler", 0), ("server", 0)])
    c.start_task("worker", 0, {"TFPSX_TOKEN": "wrong"})
    codes = c.wait([("worker", 0)], timeout=60)
    assert codes[("worker", 0)] != 0
    log = c.log("worker", 0)
    assert "SchedulerRejectedError" in log and "UNAUTHENTICATED" in log, log
    # the scheduler's operator sees the refusal too
    assert re.search(r"refused a call from .*: UNAUTHENTICATED: wrong or missing token",
                     c.log("scheduler", 0)), c.log("scheduler", 0)


# ----------------------------------------------------------------------- chief, evaluator
TF_PSS = os.path.join(os.path.dirname(os.path.dirname(SCRIPTS)), os.pardir, "examples",
                      "tf_pss", "train.py")


@pytest.mark.budget(40, why="5 processes of TF's own PSS loop, stopped after the chief's grace")
def test_tf_parameter_server_strategy_loop_runs_unchanged_with_a_chief_and_an_evaluator(
        tmp_path):
    """TF's tutorial loop (no tfpsx import): the chief coordinates, workers and the server
    only serve; the job ends when the chief ends, the evaluator saw the last checkpoint."""
    proc = _launch(tmp_path, ["--no_scheduler", "--config", "tf_config", "--chief",
                              "--evaluator", "--server_grace", "2", "--server_num", "1",
                              "--worker_num", "2", os.path.abspath(TF_PSS), "--steps", "100"],
                   _env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[chief] CHIEF step 100 loss" in proc.stdout
    assert "job finished: the chief exited 0" in proc.stdout
    # Servers and workers never return from server.join(): stopped after the grace.
    assert "server 0, worker 0, worker 1 still running 2 s after the chief exited" in proc.stderr
    logs = tmp_path / "logs"
    assert re.search(r"EVAL step 100 mse 0\.0\d+", (logs / "evaluatorlog.0").read_text())


@pytest.mark.parametrize("mode", [
    pytest.param([], id="scheduler"),
    pytest.param(["--no_scheduler", "--config", "tf_config"], id="tf_config",
                 marks=pytest.mark.slow)])
def test_a_tfpsx_job_whose_chief_is_tf_configs_chief(tmp_path, mode):
    proc = _launch(tmp_path, mode + ["--chief", "--evaluator", "--server_grace", "3",
                                     "--server_num", "1", "--worker_num", "2",
                                     os.path.join(SCRIPTS, "job.py")],
                   _env(JOB_BARRIERS="1", TFPSX_HEARTBEAT_INTERVAL="0.5"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    logs = tmp_path / "logs"
    job = "chief:0" if mode else "worker:0"  # the scheduler's cluster names no TF chief job
    assert f"[chief] TASK {job} rank 0 of 3 chief True" in proc.stdout
    for i in range(2):
        task = f"worker:{i}" if mode else f"worker:{i + 1}"
        assert f"TASK {task} rank {i + 1} of 3 chief False" in \
            (logs / f"workerlog.{i}").read_text()
    assert "BARRIER_PASSED 0" in (logs / "workerlog.1").read_text()
    assert "EVALUATOR_UP" in (logs / "evaluatorlog.0").read_text()
    assert "the evaluator still running 3 s after the chief exited; stopping them" in proc.stderr


@pytest.mark.slow
def test_with_a_chief_the_exit_code_is_the_chiefs(tmp_path):
    proc = _launch(tmp_path, ["--no_scheduler", "--chief", "--server_num", "1",
                              "--worker_num", "1", os.path.join(SCRIPTS, "job.py")],
                   _env(JOB_FAIL="0:3", JOB_SLEEP="30"))
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "FAILED: the chief exited with code 3" in proc.stderr


@pytest.mark.slow
def test_an_evaluator_that_fails_is_named_and_training_goes_on(tmp_path):
    proc = _launch(tmp_path, ["--no_scheduler", "--evaluator", "--server_num", "1",
                              "--worker_num", "2", os.path.join(SCRIPTS, "job.py")],
                   _env(JOB_EVAL_EXIT="4", JOB_SLEEP="3", JOB_BARRIERS="1"))
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "the evaluator exited with code 4" in proc.stderr
    assert "training goes on without it" in proc.stderr
    assert "FAILED: the evaluator exited with code 4" in proc.stderr
    logs = tmp_path / "logs"
    assert "WORKER_DONE" in (logs / "workerlog.1").read_text()

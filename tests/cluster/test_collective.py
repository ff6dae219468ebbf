"""Collective mode in Keras 3 fit (tfpsx.keras.CollectiveStrategy): every weight
all-reduced among the workers, no parameter servers. Two workers of
scripts/collective_job.py, as tfpsx-run --server_num 0 starts them."""

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import SCRIPTS, wait_for_log

HEARTBEAT_TIMEOUT, GRACE = 4, 3


def _run(make_cluster, tmp_path, config_mode="env", args=(), env=None, worker_num=2,
         server_num=0):
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    c = make_cluster(server_num, worker_num, script="collective_job.py", timeout=150,
                     config_mode=config_mode, env=env,
                     args=["--out", str(out), *args]).start()
    return c, out, c.wait(timeout=150)


def _local(out, args=()):
    """One process training on the concatenation of the ranks' batches."""
    subprocess.run([sys.executable, os.path.join(SCRIPTS, "collective_job.py"), "--local",
                    "--out", str(out), *args], check=True, timeout=120,
                   capture_output=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    return np.load(out / "local.npy")


@pytest.mark.budget(40, why="a collective job of 2 Keras ranks, then one process training on both"
                            " batches")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("config_mode", [pytest.param("env", marks=pytest.mark.slow), "scheduler",
                                         pytest.param("tf_config", marks=pytest.mark.slow)])
def test_two_ranks_train_as_one_process_on_their_concatenated_batches(
        make_cluster, tmp_path, config_mode):
    """Differently seeded ranks start equal, stay identical after every step, and end
    where one process training on both ranks' batches together ends (SGD)."""
    c, out, codes = _run(make_cluster, tmp_path, config_mode)
    assert set(codes.values()) == {0} and ("worker", 1) in codes, c.logs()
    initial = [np.load(out / f"initial.{r}.npy") for r in range(2)]
    np.testing.assert_array_equal(initial[0], initial[1])
    steps = [np.load(out / f"steps.{r}.npy") for r in range(2)]
    assert steps[0].shape == (2 * 512 // 2 // 16, 161)
    np.testing.assert_allclose(steps[0], steps[1], rtol=0, atol=1e-6)
    final = np.load(out / "final.0.npy")
    assert np.abs(final - initial[0]).max() > 0.05  # it trained
    np.testing.assert_allclose(final, _local(out), rtol=0, atol=1e-5)
    # evaluate, predict and a serving export of the trained model, the same everywhere.
    np.testing.assert_allclose(np.load(out / "eval.0.npy"), np.load(out / "eval.1.npy"),
                               rtol=1e-6)
    np.testing.assert_allclose(np.load(out / "served.npy"), np.load(out / "predicted.npy"),
                               rtol=0, atol=1e-5)
    # Keras's own logs are the worker's own loss, one line an epoch.
    for r in range(2):
        assert len(re.findall(r"16/16 - .* loss: ", c.log("worker", r))) == 2, c.log("worker", r)


@pytest.mark.budget(40, why="the Keras collective job, then the graph-mode one that must end "
                            "where it does")
@pytest.mark.timeout(300)
def test_the_graph_front_end_trains_to_the_keras_values(make_cluster, tmp_path):
    """The same model, data and seed in TF1 graph mode (distributed_optimizer with
    DistributedStrategy(collective=True), tfpsx.MonitoredTrainingSession; rank 1 starts
    from other values) ends where Keras's CollectiveStrategy ends."""
    c, out, codes = _run(make_cluster, tmp_path)
    assert set(codes.values()) == {0}, c.logs()
    c, out, codes = _run(make_cluster, tmp_path, args=["--graph"])
    assert set(codes.values()) == {0}, c.logs()
    graph = [np.load(out / f"graph_final.{r}.npy") for r in range(2)]
    np.testing.assert_array_equal(graph[0], graph[1])
    np.testing.assert_allclose(graph[0], np.load(out / "final.0.npy"), rtol=0, atol=1e-5)
    assert "rank 1 graph steps 32" in c.log("worker", 1)


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_an_uneven_split_gives_every_rank_the_same_steps_and_no_deadlock(make_cluster, tmp_path):
    """514 rows: tfpsx.data.shard_arrays gives each rank 257 (16 batches of 16 and one
    of 1, a retraced step on both ranks); the result still equals one process's."""
    c, out, codes = _run(make_cluster, tmp_path, args=["--examples", "514"])
    assert codes == {("worker", 0): 0, ("worker", 1): 0}, c.logs()
    steps = [np.load(out / f"steps.{r}.npy") for r in range(2)]
    assert steps[0].shape[0] == steps[1].shape[0] == 2 * 17
    np.testing.assert_allclose(steps[0], steps[1], rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.load(out / "final.0.npy"), _local(out, ["--examples", "514"]),
                               rtol=0, atol=1e-5)


@pytest.mark.timeout(240)
def test_a_killed_rank_makes_the_other_exit_within_the_bound_naming_it(make_cluster, tmp_path):
    """Worker 1 dies of SIGSEGV mid-training (as a native crash would): it names its
    native and Python stacks on its way out. Worker 0's collective would wait for it
    until TFPSX_COLLECTIVE_TIMEOUT (600 s); the peer watch names it and the job ends
    with the code a restart policy retries."""
    out = tmp_path / "out"
    out.mkdir()
    c = make_cluster(0, 2, script="collective_job.py", timeout=200,
                     env={"TFPSX_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT),
                          "TFPSX_LOST_GRACE": str(GRACE), "TFPSX_CRASH_TRACE": "1"},
                     args=["--out", str(out), "--epochs", "1000", "--step_delay", "0.02"]).start()
    for r in range(2):
        wait_for_log(c, "worker", r, "Epoch 2/", timeout=120)
    c.kill("worker", 1, signal.SIGSEGV)
    killed = time.monotonic()
    codes = c.wait([("worker", 0)], timeout=60)
    seconds = time.monotonic() - killed
    assert codes[("worker", 0)] == 138, c.logs()
    assert c.procs[("worker", 1)].returncode == -signal.SIGSEGV, c.logs()
    dead = c.log("worker", 1)
    assert "*** tfpsx: fatal SIGSEGV (11) in pid" in dead, dead[-3000:]
    assert "Fatal Python error: Segmentation fault" in dead, dead[-3000:]
    assert seconds < HEARTBEAT_TIMEOUT + GRACE + 10, (seconds, c.logs())
    log = c.log("worker", 0)
    assert re.search(rf"worker 0 lost worker 1 at {re.escape(c.workers[1])}", log), log[-3000:]


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_a_rank_killed_before_stop_worker_ends_the_others_wait_there_naming_it(
        make_cluster, tmp_path):
    """stop_worker() meets every rank before leaving (here: a last all-reduce, no
    scheduler); a rank SIGKILLed after fit never comes, and the other's wait ends within
    the heartbeat bound naming it, not at TFPSX_COLLECTIVE_TIMEOUT."""
    c, _, codes = _run(make_cluster, tmp_path, args=["--die_at_end"],
                       env={"TFPSX_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT),
                            "TFPSX_LOST_GRACE": str(GRACE)})
    assert codes[("worker", 1)] == -9, c.logs()
    assert codes[("worker", 0)] == 138, c.logs()
    log = c.log("worker", 0)
    assert "rank 0 loss" in log, log[-3000:]  # it trained, then waited in stop_worker
    assert re.search(rf"worker 0 lost worker 1 at {re.escape(c.workers[1])}", log), log[-3000:]


@pytest.mark.timeout(200)
def test_misuse_is_a_clear_error(make_cluster, tmp_path):
    # A table in a collective job: it needs parameter servers.
    c, _, codes = _run(make_cluster, tmp_path, args=["--embedding"])
    assert set(codes.values()) == {1}, c.logs()
    assert ("DynamicEmbedding layer 'emb' in a tfpsx.keras.CollectiveStrategy: its table "
            "grows on the parameter servers") in c.log("worker", 0)
    assert "use the hybrid mode" in c.log("worker", 0)  # the way out, named
    # Parameter servers declared in a collective job.
    c, _, codes = _run(make_cluster, tmp_path, server_num=1)
    assert set(codes.values()) == {1}, c.logs()
    for role in ("server", "worker"):
        log = c.log(role, 0)
        assert "1 parameter server(s)" in log and "tfpsx.init(is_collective=True)" in log, log


@pytest.mark.timeout(200)
@pytest.mark.slow
def test_ranks_that_disagree_on_the_world_size_fail_naming_it(make_cluster, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    c = make_cluster(0, 2, script="collective_job.py", timeout=150, args=["--out", str(out)])
    from tfpsx.launcher.local import pick_ports

    c.start_task("worker", 0)
    c.start_task("worker", 1, {"TFPSX_WORKER_ENDPOINTS": ",".join(
        c.workers + [f"127.0.0.1:{pick_ports(1)[0]}"])})
    codes = c.wait(timeout=120)
    assert set(codes.values()) == {1}, c.logs()
    for rank, counts in ((0, 2), (1, 3)):
        log = c.log("worker", rank)
        assert (f"the workers could not form one collective group: rank {rank} counts "
                f"{counts} worker(s)" in log), log[-3000:]
        # TF's own words, as the first of the two to join saw the other.
        assert re.search(r"joining a group with size[23], but that group has size [23]",
                         log), log[-3000:]


@pytest.mark.budget(50, why="a collective job run, killed and run again under tfpsx-run: 4 "
                            "TensorFlow starts")
@pytest.mark.timeout(300)
def test_max_restarts_restarts_the_whole_job_from_rank_0s_checkpoint(tmp_path):
    """tfpsx-run --server_num 0 --max_restarts 1: rank 1 SIGKILLs itself after epoch 2,
    the launcher names it and starts every rank again at once, rank 0 restores epoch 2's
    checkpoint, the others take its weights, and the job ends 0 with equal ranks.

    Under the launcher the survivors are stopped as soon as the loss is seen (a restart
    does not wait for them to notice: up to TFPSX_HEARTBEAT_TIMEOUT + TFPSX_LOST_GRACE),
    so rank 0 may end before it names the lost rank itself (it did on a loaded machine:
    its log then ended in TF's "Socket closed"); what names the loss in every log is the
    launcher's restart line. A rank naming a lost peer by itself:
    test_a_killed_rank_makes_the_other_exit_within_the_bound_naming_it."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    ckpt.mkdir()
    env = dict(os.environ, PYTHONPATH=SCRIPTS + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TFPSX_HEARTBEAT_TIMEOUT=str(HEARTBEAT_TIMEOUT), TFPSX_LOST_GRACE=str(GRACE),
               TFPSX_HEARTBEAT_INTERVAL="0.5")
    proc = subprocess.run(
        [sys.executable, "-m", "tfpsx.launcher.run", "--server_num", "0", "--worker_num", "2",
         "--max_restarts", "1", "--timeout", "200", "--log_dir", str(tmp_path / "logs"),
         os.path.join(SCRIPTS, "collective_job.py"), "--out", str(out), "--epochs", "4",
         "--checkpoint", str(ckpt), "--die_after_epoch", "2",
         "--die_marker", str(tmp_path / "died")],
        env=env, capture_output=True, text=True, timeout=260)
    logs = {r: (tmp_path / "logs" / f"workerlog.{r}").read_text() for r in range(2)}
    assert proc.returncode == 0, proc.stderr[-3000:] + logs[0][-3000:]
    assert (tmp_path / "died").exists()
    assert "restarting the job (1 of 1)" in proc.stderr, proc.stderr[-3000:]
    assert "rank 0 resumes at epoch 2" in logs[0] and "rank 1 resumes at epoch 2" in logs[1]
    assert re.search(r"worker 1 exited with code -9 \(killed by SIGKILL; see .*workerlog\.1\); "
                     r"restarting the job \(1 of 1\)", proc.stderr), proc.stderr[-3000:]
    for r in range(2):  # every rank's log says why it was stopped
        assert "===== tfpsx-run: restart 1 of 1 after worker 1 exited with code -9 =====" in \
            logs[r], logs[r][-3000:]
    steps = np.load(out / "steps.1.npy")
    assert steps.shape[0] == 2 * 16  # epochs 3 and 4 after the restart
    np.testing.assert_array_equal(np.load(out / "final.0.npy"), np.load(out / "final.1.npy"))

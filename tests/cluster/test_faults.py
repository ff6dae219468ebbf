"""A parameter server killed mid-training: every worker fails within a bound, naming the
lost server and what it was doing (graph mode async and GEO, with and without a
scheduler; Keras fit). ``tfpsx-run``'s side is in test_launcher.py."""

import re
import time

import pytest

from conftest import wait_for_log

HEARTBEAT_TIMEOUT, GRACE = 4, 3
ENV = {"TFPSX_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT), "TFPSX_LOST_GRACE": str(GRACE)}


def _kill_server_and_wait(c, started_marker):
    for i in range(2):
        wait_for_log(c, "worker", i, started_marker, timeout=120)
    time.sleep(1.0)
    c.kill("server", 0)
    killed = time.monotonic()
    codes = c.wait([("worker", 0), ("worker", 1)], timeout=60)
    return codes, time.monotonic() - killed


@pytest.mark.budget(40, why="a cluster trains, its server is killed, the workers wait out the "
                            "heartbeat bound")
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode,config_mode", [("geo", "env")])
def test_graph_mode_workers_exit_when_their_server_is_killed(make_cluster, mode, config_mode):
    """(async with a scheduler: the first half of the by-hand restart test below.)"""
    args = ["--mode", mode, "--steps", "1000000", "--step_delay", "0.01"]
    if mode == "geo":
        args += ["--k_steps", "10"]
    c = make_cluster(1, 2, script="training_job.py", env=ENV, timeout=200,
                     config_mode=config_mode, args=args).start()
    codes, seconds = _kill_server_and_wait(c, "session ready")
    # TF alone blocks forever in Session.close(); the watch bounds it.
    assert seconds < HEARTBEAT_TIMEOUT + GRACE + 10, (seconds, c.logs())
    server = c.servers[0]
    for i in range(2):
        assert codes[("worker", i)] == 138, c.logs()
        log = c.log("worker", i)
        assert re.search(rf"worker {i} lost server 0 at {re.escape(server)}: ", log), log[-3000:]
        assert "the main thread was at training_job.py:" in log, log[-3000:]
        assert "exiting with code 138" in log


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_a_worker_cache_fails_naming_the_killed_server(make_cluster):
    """Async through worker caches (misses fetched, evictions pushed and syncs every 5
    updates, all RPCs to the server): the server SIGKILLed, every worker ends within the
    bound, naming it."""
    c = make_cluster(2, 2, script="sparse_job.py", env=ENV, timeout=200,
                     args=["--mode", "async", "--syncs", "1000000", "--cache_size", "8",
                           "--flush_steps", "5"]).start()
    codes, seconds = _kill_server_and_wait(c, "session ready")
    assert seconds < HEARTBEAT_TIMEOUT + GRACE + 10, (seconds, c.logs())
    server = c.servers[0]
    for i in range(2):
        assert codes[("worker", i)] == 138, c.logs()
        log = c.log("worker", i)
        assert re.search(rf"worker {i} lost server 0 at {re.escape(server)}: ", log), log[-3000:]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("cache", [[], pytest.param(["--cache_size", "24"], marks=pytest.mark.slow)],
                         ids=["tables", "cached"])
def test_keras_fit_fails_naming_the_killed_server(make_cluster, cache):
    """cached: worker caches fed by fit's input pipeline, whose staging meets the dead
    server first (the error reaches the step through the dataset)."""
    c = make_cluster(1, 2, script="keras_job.py", env=ENV, timeout=200, config_mode="scheduler",
                     args=["--mode", "async", "--epochs", "100", "--step_delay", "0.01"]
                     + cache).start()
    codes, seconds = _kill_server_and_wait(c, "Epoch 1/")
    assert seconds < HEARTBEAT_TIMEOUT + GRACE + 10, (seconds, c.logs())
    for i in range(2):
        assert codes[("worker", i)] == 138, c.logs()  # retryable: restart wanted
        log = c.log("worker", i)
        assert re.search(rf"ServerUnavailableError: worker {i}: (fit|evaluate)\(\) lost server 0 "
                         rf"at {re.escape(c.servers[0])}", log), log[-3000:]


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_keras_fit_names_a_server_lost_right_before_kerass_own_wait_at_an_epochs_end(
        make_cluster):
    """The window no step can catch: the server dies after the epoch's last step and its
    callbacks, and Keras's own wait at the epoch's end (which reaches every server) is
    the first to meet it. The error still names the server, and the exit code is the
    one a restart policy retries (it was a raw UnavailableError and exit 1)."""
    c = make_cluster(1, 2, script="keras_job.py", env=ENV, timeout=200, config_mode="scheduler",
                     args=["--mode", "async", "--epochs", "100", "--examples", "1024",
                           "--pause_at_epoch_end", "2"]).start()
    for i in range(2):
        wait_for_log(c, "worker", i, "LAST STEP DONE", timeout=120)
    c.kill("server", 0)  # within both workers' pause (before the watch's 4 s could tell)
    codes = c.wait([("worker", 0), ("worker", 1)], timeout=60)
    for i in range(2):
        assert codes[("worker", i)] == 138, c.logs()
        log = c.log("worker", i)
        assert re.search(rf"ServerUnavailableError: worker {i}: fit\(\) lost server 0 "
                         rf"at {re.escape(c.servers[0])}", log), log[-3000:]


@pytest.mark.timeout(120)
def test_without_its_scheduler_a_server_serves_on_then_gives_up_within_its_bound(make_cluster):
    """By hand (no launcher to restart it): a killed scheduler does not take the model with
    it; the server serves on, waiting for a restarted one, and gives up after
    TFPSX_SCHED_LOSS_TIMEOUT with an error that says so."""
    c = make_cluster(1, 2, env={"TFPSX_SCHED_LOSS_TIMEOUT": "4", "JOB_SLEEP": "600"},
                     config_mode="scheduler").start()
    for i in range(2):
        wait_for_log(c, "worker", i, "WORKER_READY")
    c.kill("scheduler", 0)
    killed = time.monotonic()
    time.sleep(2)
    assert c.procs[("server", 0)].poll() is None, c.logs()  # still serving
    codes = c.wait([("server", 0)], timeout=60)
    assert codes[("server", 0)] != 0, c.logs()
    assert time.monotonic() - killed < 4 + 15
    log = c.log("server", 0)
    assert "lost the scheduler" in log and "serving on (the model stays here)" in log, log
    assert re.search(r"was unreachable for \d+ s \(TFPSX_SCHED_LOSS_TIMEOUT=4\); giving up", log)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_by_hand_every_process_restarted_like_an_orchestrator_resumes_the_job(make_cluster,
                                                                              tmp_path):
    """The by-hand (scheduler) setup's recovery policy: the server is killed, the workers
    exit with 138 (retryable) within their bound; an orchestrator (here the test, as a
    Kubernetes restartPolicy would) starts the server and the workers again on their
    addresses while the scheduler runs on: they register again (the scheduler revives
    the nodes it had declared dead), the chief resumes from its last checkpoint and the
    job runs to its end."""
    ckpt = tmp_path / "ckpt"
    c = make_cluster(1, 2, script="training_job.py", env=ENV, timeout=280,
                     config_mode="scheduler",
                     args=["--mode", "async", "--steps", "800", "--step_delay", "0.02",
                           "--checkpoint_dir", str(ckpt), "--save_steps", "50"]).start()
    def saved_step():
        steps = [int(p.name[len("model.ckpt-"):-len(".index")])
                 for p in (ckpt.iterdir() if ckpt.exists() else [])
                 if p.name.startswith("model.ckpt-") and p.name.endswith(".index")]
        return max(steps, default=-1)

    deadline = time.monotonic() + 120
    while saved_step() < 100:
        assert time.monotonic() < deadline, c.logs()
        time.sleep(0.1)
    c.kill("server", 0)
    killed = time.monotonic()
    codes = c.wait([("worker", 0), ("worker", 1)], timeout=60)
    assert codes == {("worker", 0): 138, ("worker", 1): 138}, c.logs()
    # TF alone blocks forever in Session.close(); the watch bounds it, naming the server.
    assert time.monotonic() - killed < HEARTBEAT_TIMEOUT + GRACE + 10, c.logs()
    for i in range(2):
        log = c.log("worker", i)
        assert re.search(rf"worker {i} lost server 0 at {re.escape(c.servers[0])}: ", log), \
            log[-3000:]
        assert "the main thread was at training_job.py:" in log, log[-3000:]
        assert "exiting with code 138" in log
    # Like Kubernetes' restart back-off, start them again once the scheduler has seen every
    # worker die (their heartbeats stop; bounded), so that its keep-the-job policy runs:
    # restarted sooner, they re-register before it notices and nothing is to be kept.
    kept = "every worker died and none finished; keeping the job"
    deadline = time.monotonic() + HEARTBEAT_TIMEOUT + GRACE + 10
    while kept not in c.log("scheduler", 0):
        assert time.monotonic() < deadline, c.log("scheduler", 0)[-3000:]
        time.sleep(0.1)
    for task in [("server", 0), ("worker", 0), ("worker", 1)]:
        c.start_task(*task)
    codes = c.wait([("server", 0), ("worker", 0), ("worker", 1)], timeout=200)
    assert set(codes.values()) == {0}, c.logs()
    resumed = [r for r in c.metrics("worker", 0, "resumed") if r["checkpoint"] is not None]
    assert len(resumed) == 1 and resumed[0]["global_step"] >= 100, resumed
    final = c.metrics("worker", 0, "training")[-1]
    assert final["global_step"] >= 800 and final["eval_loss"] < 0.05, final
    sched = c.log("scheduler", 0)
    assert re.search(r"a worker is back after [\d.]+ s: the job goes on", sched), sched[-3000:]

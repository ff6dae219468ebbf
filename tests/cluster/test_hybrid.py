"""The hybrid mode: DynamicEmbedding tables on the parameter servers (async or GEO),
every dense weight all-reduced among the workers each step
(``DistributedStrategy(dense="allreduce")``). One server and two workers of
scripts/hybrid_job.py."""

import re
import time

import numpy as np
import pytest

from tfpsx.modes.state import HYBRID_PORTS

HEARTBEAT_TIMEOUT, GRACE = 4, 3


def _run(make_cluster, tmp_path, args=(), env=None, config_mode="env"):
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    c = make_cluster(1, 2, script="hybrid_job.py", timeout=150, config_mode=config_mode,
                     env=env, args=["--out", str(out), *args]).start()
    return c, out, c.wait(timeout=150)


def _check_training(out, prefix=""):
    initial = [np.load(out / f"{prefix}initial.{r}.npy") for r in range(2)]
    np.testing.assert_array_equal(initial[0], initial[1])  # differently seeded, equal
    steps = [np.load(out / f"{prefix}steps.{r}.npy") for r in range(2)]
    assert steps[0].shape == steps[1].shape == (2 * 256 // 16, initial[0].size)
    np.testing.assert_allclose(steps[0], steps[1], rtol=0, atol=1e-6)
    assert np.abs(steps[0][-1] - initial[0]).max() > 0.05  # the dense weights trained
    rows, before = np.load(out / f"{prefix}rows.npy"), np.load(out / f"{prefix}rows_before.npy")
    moved = np.abs(rows - before).max(axis=1) > 1e-4
    # Rank 0 trained the even ids only, rank 1 the odd ones: the servers' table has both.
    assert moved[0::2].all() and moved[1::2].all(), moved


@pytest.mark.budget(40, why="a hybrid cluster of 1 PS + 2 Keras workers")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("tables", ["async", pytest.param("geo", marks=pytest.mark.slow)])
def test_keras_hybrid_tables_take_both_workers_updates_and_dense_weights_stay_equal(
        make_cluster, tmp_path, tables):
    c, out, codes = _run(make_cluster, tmp_path, ["--tables", tables])
    assert set(codes.values()) == {0} and ("worker", 1) in codes, c.logs()
    _check_training(out)
    assert "mode hybrid" in c.log("worker", 0)
    for r in range(2):  # the ports vector on PS 0 (met there), under the core's name
        assert f"mode state [{HYBRID_PORTS.name!r}]" in c.log("worker", r)
    losses = [float(m) for r in range(2)
              for m in re.findall(r"eval loss ([\d.]+)", c.log("worker", r))]
    assert len(losses) == 2 and abs(losses[0] - losses[1]) < 1e-3, losses


@pytest.mark.budget(40, why="a hybrid cluster of 1 PS + 2 graph-mode workers")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("tables", [pytest.param("async", marks=pytest.mark.slow), "geo"])
def test_graph_hybrid_tables_take_both_workers_updates_and_dense_weights_stay_equal(
        make_cluster, tmp_path, tables):
    """The same job in TF1 graph mode (model_scope, distributed_optimizer,
    MonitoredTrainingSession); rank 1 starts from other values. The GEO case's table is
    tiered on its PS (TieredBackend, 2 MB: its rows fit)."""
    tier = (["--table_ram_bytes", "2000000", "--table_dir", str(tmp_path / "tables")]
            if tables == "geo" else [])
    c, out, codes = _run(make_cluster, tmp_path, ["--tables", tables, "--graph"] + tier)
    assert set(codes.values()) == {0} and ("worker", 1) in codes, c.logs()
    _check_training(out, "graph_")
    for r in range(2):  # global_step counts the job's steps, which both ran together
        assert "graph steps 32 global_step 32" in c.log("worker", r), c.log("worker", r)
    if tier:
        assert sorted(p.name for p in (tmp_path / "tables" / "emb").iterdir()) == ["part_0"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("front_end,step", [
    pytest.param("keras", 5, marks=pytest.mark.slow),
    pytest.param("graph", 5, marks=pytest.mark.slow),
    # killed later in training (after its first meeting)
    pytest.param("keras", 32, marks=pytest.mark.slow),
    pytest.param("graph", 32, marks=pytest.mark.slow)])
def test_a_killed_worker_makes_the_other_exit_within_the_bound_naming_it(
        make_cluster, tmp_path, front_end, step):
    """Worker 1 SIGKILLs itself at its 5th step (mid-training), or at its 32nd, the last
    (worker 0 then waits for it at the workers' meeting after fit / the session): an
    all-reduce would wait for it until TFPSX_COLLECTIVE_TIMEOUT (600 s); the error or the
    peer watch names it within the heartbeat bound, and worker 0 exits with the code a
    restart policy retries."""
    start = time.monotonic()
    c, out, codes = _run(make_cluster, tmp_path,
                         ["--die_at_step", str(step), "--epochs", "20" if step == 5 else "2"]
                         + (["--graph"] if front_end == "graph" else []),
                         env={"TFPSX_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT),
                              "TFPSX_LOST_GRACE": str(GRACE)})
    assert codes[("worker", 1)] == -9, c.logs()
    assert codes[("worker", 0)] == 138, c.logs()
    log = c.log("worker", 0)
    assert re.search(rf"worker 0 lost worker 1 at {re.escape(c.workers[1])}", log), log[-3000:]
    assert time.monotonic() - start < 100, c.logs()


@pytest.mark.timeout(300)
@pytest.mark.slow
@pytest.mark.parametrize("front_end", ["keras", "graph"])
def test_given_dense_endpoints_are_used_without_meeting_on_the_server(
        make_cluster, tmp_path, front_end):
    """TFPSX_DENSE_ENDPOINTS: each worker binds its own entry's port (no ports met on
    server 0), and the job trains as with met ports."""
    import portpicker

    ports = [portpicker.pick_unused_port() for _ in range(2)]
    c, out, codes = _run(make_cluster, tmp_path, ["--graph"] if front_end == "graph" else [],
                         env={"TFPSX_DENSE_ENDPOINTS": ",".join(f"127.0.0.1:{p}"
                                                                for p in ports)})
    assert set(codes.values()) == {0}, c.logs()
    _check_training(out, "graph_" if front_end == "graph" else "")

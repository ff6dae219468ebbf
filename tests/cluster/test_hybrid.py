"""The hybrid mode: DynamicEmbedding tables on the parameter servers (async or GEO),
every dense weight all-reduced among the workers each step
(``DistributedStrategy(dense="allreduce")``). One server and two workers of
scripts/hybrid_job.py."""

import re

import numpy as np
import pytest

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


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tables", ["async", "geo"])
def test_keras_hybrid_tables_take_both_workers_updates_and_dense_weights_stay_equal(
        make_cluster, tmp_path, tables):
    c, out, codes = _run(make_cluster, tmp_path, ["--tables", tables])
    assert set(codes.values()) == {0} and ("worker", 1) in codes, c.logs()
    _check_training(out)
    assert "mode hybrid" in c.log("worker", 0)
    losses = [float(m) for r in range(2)
              for m in re.findall(r"eval loss ([\d.]+)", c.log("worker", r))]
    assert len(losses) == 2 and abs(losses[0] - losses[1]) < 1e-3, losses

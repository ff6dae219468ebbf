"""The Keras 3 example end to end: under tfpsx-run (GEO) and as one process."""

import os
import subprocess
import sys

import pytest

import tfpsx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples/keras_ctr/train.py")
SMALL = ["--examples", "16384", "--epochs", "2", "--verbose", "0"]


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_keras_ctr_under_the_launcher(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "tfpsx.launcher.run", "--server_num", "1", "--worker_num", "2",
         "--log_dir", str(tmp_path), "--timeout", "240", EXAMPLE, "--mode", "geo",
         "--k_steps", "10"] + SMALL, capture_output=True, text=True, timeout=280,
        cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for i in range(2):
        r = tfpsx.metrics.read(str(tmp_path), "worker", i, "keras_ctr")[-1]
        assert r["eval_loss"] < 0.5 and r["pushes"] >= 1, r  # no learning: ~0.69


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_keras_ctr_without_a_cluster(tmp_path):
    proc = subprocess.run([sys.executable, EXAMPLE, "--mode", "local"] + SMALL,
                          capture_output=True, text=True, timeout=280, cwd=str(tmp_path),
                          env=dict(os.environ, TFPSX_METRICS_DIR=str(tmp_path)))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert tfpsx.metrics.read(str(tmp_path), "local", 0, "keras_ctr")[-1]["eval_loss"] < 0.5

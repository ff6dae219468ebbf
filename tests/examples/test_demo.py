"""The graph-mode CTR example (examples/ctr_demo) end to end through the launcher."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN = [sys.executable, "-m", "tfpsx.launcher.run"]


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_ctr_demo_trains_with_falling_loss(tmp_path):
    proc = subprocess.run(
        RUN + ["--no_scheduler", "--server_num", "1", "--worker_num", "2", "--log_dir",
               str(tmp_path), "--timeout", "240", os.path.join(ROOT, "examples/ctr_demo/train.py"),
               "--steps", "400"],
        capture_output=True, text=True, timeout=280, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "job finished: 1 server(s), 2 worker(s) exited 0" in proc.stdout
    for i in range(2):
        log = (tmp_path / f"workerlog.{i}").read_text()
        final, first = map(float, re.search(
            r"final eval loss ([\d.]+) \(from ([\d.]+)\)", log).groups())
        assert final < first, log
        if i == 0:  # the chief's first eval comes before anyone trained (seeded init: 0.677)
            assert final < first - 0.02, log
    # The chief's lines reach the console with their role prefix.
    assert "[worker 0] worker 0: geo training; eval loss before training" in proc.stdout

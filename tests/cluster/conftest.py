import os
import sys

import pytest

from tfpsx.testing import LocalCluster

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")
sys.path.insert(0, SCRIPTS)


@pytest.fixture
def make_cluster(tmp_path):
    """Builds LocalClusters of tests/cluster/scripts/job.py; kills them all at teardown."""
    made = []

    def make(server_num=1, worker_num=2, env=None, timeout=90, script="job.py", **kwargs):
        base = {"PYTHONPATH": SCRIPTS + os.pathsep + os.environ.get("PYTHONPATH", ""),
                "TFPSX_HEARTBEAT_INTERVAL": "0.5"}
        base.update(env or {})
        c = LocalCluster(os.path.join(SCRIPTS, script), server_num, worker_num, env=base,
                         timeout=timeout, log_dir=str(tmp_path / f"cluster{len(made)}"), **kwargs)
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()


def wait_for_log(c, role, index, text, timeout=60.0):
    """Waits until a task's log contains ``text``; fails (with every log) if it exits first."""
    import time

    deadline = time.monotonic() + timeout
    while text not in c.log(role, index):
        assert c.procs[(role, index)].poll() is None, f"{role} {index} exited:\n{c.logs()}"
        assert time.monotonic() < deadline, f"no {text!r} from {role} {index}:\n{c.logs()}"
        time.sleep(0.1)

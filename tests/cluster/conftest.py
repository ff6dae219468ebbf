import contextlib
import os
import sys

import pytest

from tfpsx.testing import LocalCluster

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")
sys.path.insert(0, SCRIPTS)


def cluster(log_dir, server_num=1, worker_num=2, env=None, timeout=90, script="job.py",
            **kwargs) -> LocalCluster:
    """A LocalCluster of one of tests/cluster/scripts (not started), logging to log_dir."""
    base = {"PYTHONPATH": SCRIPTS + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "TFPSX_HEARTBEAT_INTERVAL": "0.5"}
    base.update(env or {})
    return LocalCluster(os.path.join(SCRIPTS, script), server_num, worker_num, env=base,
                        timeout=timeout, log_dir=str(log_dir), **kwargs)


@pytest.fixture
def make_cluster(tmp_path):
    """Builds LocalClusters of tests/cluster/scripts/job.py; kills them all at teardown."""
    made = []

    def make(server_num=1, worker_num=2, env=None, timeout=90, script="job.py", **kwargs):
        c = cluster(tmp_path / f"cluster{len(made)}", server_num, worker_num, env, timeout,
                    script, **kwargs)
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()


@contextlib.contextmanager
def scenario(tmp_path_factory, name, server_num=1, worker_num=2, **kwargs):
    """A scenario: one job run to its end for the several tests of a module that read its
    records and logs (a module-scoped fixture yields from it), instead of a cluster per
    test. Fails, with every log, when a task exits non-zero; the processes are killed
    (by PID) when the module's tests are done."""
    c = cluster(tmp_path_factory.mktemp(name), server_num, worker_num, **kwargs)
    try:
        c.start()
        c.listeners = watch_listeners(c)
        codes = c.wait()
        assert all(code == 0 for code in codes.values()), f"{name}: {codes}\n{c.logs()}"
        yield c
    finally:
        c.stop()


def watch_listeners(c, timeout=60.0):
    """While ``c`` runs: every address seen listening on its TensorFlow servers' ports
    (read from /proc/net/tcp*), until each port listens, a task exits or ``timeout``
    passes. ``{port: {address, ...}}``."""
    import time

    from tfpsx.launcher import loopback

    ports, seen = c.tf_ports(), {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for port, addresses in loopback.listening(ports).items():
            seen.setdefault(port, set()).update(addresses)
        if len(seen) == len(ports) or any(p.poll() is not None for p in c.procs.values()):
            break
        time.sleep(0.2)
    return seen


def wait_for_log(c, role, index, text, timeout=60.0):
    """Waits until a task's log contains ``text``; fails (with every log) if it exits first."""
    import time

    deadline = time.monotonic() + timeout
    while text not in c.log(role, index):
        assert c.procs[(role, index)].poll() is None, f"{role} {index} exited:\n{c.logs()}"
        assert time.monotonic() < deadline, f"no {text!r} from {role} {index}:\n{c.logs()}"
        time.sleep(0.1)

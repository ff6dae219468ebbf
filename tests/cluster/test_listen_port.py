"""TFPSX_LISTEN_PORT: the cluster lists addresses that are not the processes' own (a NAT,
a container's mapped port; here a forwarding proxy in front of every process, the
benchmarks' network emulation), each process listens on its own port, and a job trains
with every byte between the processes passing the listed addresses: a PS fetching a
worker's pushes dials the worker's listed address, not the port it listens on."""

import os
import sys

import pytest

import tfpsx
from conftest import SCRIPTS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from _proxied import run_job  # noqa: E402  (the benchmarks' harness, under test too)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script,args,record", [
    pytest.param("keras_job.py", ["--mode", "async", "--examples", "2048"], "keras",
                 marks=pytest.mark.slow),
    ("training_job.py", ["--mode", "async", "--steps", "100"], "training"),
])
def test_a_cluster_of_listed_addresses_trains_through_them(script, args, record):
    cmd = [sys.executable, os.path.join(SCRIPTS, script)] + args
    with run_job(cmd, servers=1, workers=2, one_way=0.0001, timeout=240,
                 env={"PYTHONPATH": os.pathsep.join([SCRIPTS, ROOT])}) as job:
        for i in range(2):
            assert tfpsx.metrics.read(job.logs, "worker", i, record), job.outputs[i + 1]
        # Both directions pass the listed addresses: what the workers read from the PS
        # (through its proxy) and what the PS fetches from the workers (through theirs).
        assert job.server_bytes > 100_000, job.server_bytes
        assert job.worker_bytes > 100_000, job.worker_bytes

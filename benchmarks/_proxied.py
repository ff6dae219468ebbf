"""A benchmark job whose processes talk through emulated links (benchmarks/netem.py).

Every server and worker of the job is a process started here with TFPSX_* env (no
scheduler, no launcher: their cluster specs route through the proxies). A
:class:`~netem.DelayProxy` sits in front of every process: every process's cluster lists
the proxies' addresses, its own included, and it listens on its real port
(TFPSX_LISTEN_PORT, TF's ``ServerDef.port``), so every cross-process byte pays the
one-way delay, whoever dials: TF moves a tensor by the receiver asking the sender (a PS fetches a worker's
pushed gradients from the worker), so a worker's pushes pass the worker's proxy and the
rows and weights it reads pass the server's. Each proxy is its process's NIC (``rate``,
per direction, shared by its connections) and counts its bytes. The workers' dense
all-reduce servers (the hybrid mode, TFPSX_DENSE_ENDPOINTS) sit behind proxies of their
own, at the same delay and ``rate``, whose bytes are counted apart.

  with run_job(cmd, servers=1, workers=2, one_way=0.0005, rate=1e9 / 8) as job:
      job.logs            # TFPSX_METRICS_DIR of every process
      job.server_bytes    # bytes through the servers' proxies, both directions
      job.worker_bytes    # bytes through the workers' proxies (what the servers fetched)
      job.dense_bytes     # bytes through the workers' dense all-reduce proxies
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import tempfile
from typing import Dict, List, Optional, Sequence

import portpicker

from netem import DelayProxy

from tfpsx.launcher import loopback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass
class Job:
    logs: str
    outputs: List[str]
    server_bytes: int = 0
    dense_bytes: int = 0
    worker_bytes: int = 0


@contextlib.contextmanager
def run_job(cmd: Sequence[str], servers: int = 1, workers: int = 2, one_way: float = 0.0,
            rate: Optional[float] = None, timeout: float = 900.0,
            env: Optional[Dict[str, str]] = None):
    """Runs ``cmd`` as every server and worker (``one_way`` > 0: through proxies) and
    yields a :class:`Job` once all exited 0; the logs folder is removed afterwards.

    Raises:
      RuntimeError: a process failed (its output's end in the message).
      subprocess.TimeoutExpired: the job ran past ``timeout`` (every process killed).
    """
    n = servers + workers
    ports = [portpicker.pick_unused_port() for _ in range(n)]
    real = [f"127.0.0.1:{p}" for p in ports]
    dense_ports = [portpicker.pick_unused_port() for _ in range(workers)]
    dense_real = [f"127.0.0.1:{p}" for p in dense_ports]
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as logs:
        seen, proxies = list(real), []
        dense_seen, dense_proxies = list(dense_real), []
        if one_way > 0 or rate is not None:
            proxies = [stack.enter_context(DelayProxy(("127.0.0.1", p), one_way, rate=rate))
                       for p in ports]
            seen = [proxy.address for proxy in proxies]
            dense_proxies = [stack.enter_context(DelayProxy(("127.0.0.1", p), one_way,
                                                            rate=rate))
                             for p in dense_ports]
            dense_seen = [proxy.address for proxy in dense_proxies]
        base = dict(os.environ, TFPSX_METRICS_DIR=logs, TF_CPP_MIN_LOG_LEVEL="2",
                    PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        base.update(env or {})
        shim = loopback.shim_path()
        if shim is not None:  # the job's TF servers on loopback, as tfpsx-run's (the
            # proxies dial 127.0.0.1: docs/security.md)
            loopback.confine(base, loopback.preloadable(shim), ports + dense_ports)
        envs = []
        for i in range(n):
            # Every process lists the proxies (its own too: the address the others dial)
            # and listens on its real port.
            addresses = seen
            role, rank = ("server", i) if i < servers else ("worker", i - servers)
            dense = [dense_real[j] if role == "worker" and j == rank else dense_seen[j]
                     for j in range(workers)]
            envs.append(dict(base, TFPSX_ROLE=role, TFPSX_RANK=str(rank),
                             TFPSX_SERVER_ENDPOINTS=",".join(addresses[:servers]),
                             TFPSX_WORKER_ENDPOINTS=",".join(addresses[servers:]),
                             TFPSX_DENSE_ENDPOINTS=",".join(dense), TFPSX_LISTEN_PORT=str(ports[i])))
        procs = []
        try:
            for e in envs:
                procs.append(subprocess.Popen(list(cmd), env=e, stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, text=True))
            outputs = [p.communicate(timeout=timeout)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(p.returncode for p in procs):
            raise RuntimeError(f"{' '.join(cmd[-8:])} failed:\n" + "\n".join(
                f"--- {i}: {o[-3000:]}" for i, o in enumerate(outputs)
                if procs[i].returncode))
        yield Job(logs, outputs,
                  sum(sum(p.bytes.values()) for p in proxies[:servers]),
                  sum(sum(p.bytes.values()) for p in dense_proxies),
                  sum(sum(p.bytes.values()) for p in proxies[servers:]))

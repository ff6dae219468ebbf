"""A collective (or hybrid) worker's start and leave: its collective runtime before any
TensorFlow op, its crash trace, and the last meeting before it exits."""

from __future__ import annotations

import logging
import time
from typing import Callable

from tfpsx import cluster as _cluster
from tfpsx import errors, settings
from tfpsx.control.peers import PeersOnlyCoordinator
from tfpsx.control.protocol import Coordinator
from tfpsx.ops import crash_trace, load_ops

logger = logging.getLogger("tfpsx")

# The collective group of stop_worker's last all-reduce (the training's is another).
GOODBYE_GROUP_KEY = 0x7467


def start(config: _cluster.ClusterConfig) -> None:
    """This worker's collective runtime and (when wanted) its crash trace."""
    trace = crash_trace.wanted()  # a bad value: named before anything starts
    _enable_collectives(config)
    if trace:
        _install_crash_trace(config)


def leave(config: _cluster.ClusterConfig, coord: Coordinator,
          barrier: Callable[[float], None]) -> float:
    """A collective rank leaves only when no peer can still need it: a ring all-reduce
    pulls each chunk from the rank before, so a rank whose last collective completed may
    still be read by a peer whose own has not; exiting then fails that peer ("Socket
    closed"). Every rank meets the others first: at the scheduler's barrier
    (``barrier(timeout)``: a rank reaches it only after its collectives completed), else
    at a last all-reduce of its own, after which the peers' pulls left are that one's few
    bytes. Returns the seconds to linger for them (TFPSX_COLLECTIVE_LINGER; 0 after the
    scheduler's barrier)."""
    from tfpsx import compat

    timeout = settings.get("TFPSX_COLLECTIVE_TIMEOUT")
    start_time = time.monotonic()
    try:
        if isinstance(coord, PeersOnlyCoordinator):
            job, task = config.job_name, config.task_index
            compat.collective_barrier(f"/job:{job}/replica:0/task:{task}/device:CPU:0",
                                      config.worker_num, GOODBYE_GROUP_KEY, timeout)
            return settings.get("TFPSX_COLLECTIVE_LINGER")
        barrier(timeout)
        return 0.0
    except Exception as e:  # noqa: BLE001 — named and re-raised
        raise errors.ClusterTimeoutError(
            f"worker {config.index}: tfpsx.stop_worker() could not meet the other "
            f"{config.worker_num - 1} worker(s) of the collective job within "
            f"{time.monotonic() - start_time:.0f} s (TFPSX_COLLECTIVE_TIMEOUT={timeout:g} s): "
            f"{e}") from e


def _install_crash_trace(config: _cluster.ClusterConfig) -> None:
    """A collective worker runs no tfpsx op, but loads the op library for its crash
    trace (a fatal signal names the native and Python stacks). A library that cannot
    load costs the trace only: a warning names it."""
    try:
        load_ops()
    except errors.OpLibraryError as e:
        logger.warning("worker %d runs without tfpsx's crash trace: %s", config.index, e)


def _enable_collectives(config: _cluster.ClusterConfig) -> None:
    """This worker's collective runtime (an in-process server on its address, the group
    leader worker 0), before any TensorFlow op: TF configures collectives once, at
    program start."""
    from tfpsx import compat

    leader_job, leader_task = config.worker_device_job(0)
    try:
        compat.enable_collectives(config.cluster_spec(), config.job_name, config.task_index,
                                  f"/job:{leader_job}/replica:0/task:{leader_task}",
                                  port=settings.get("TFPSX_LISTEN_PORT"))
    except (RuntimeError, ValueError) as e:
        raise RuntimeError(
            f"tfpsx.init_worker() could not start worker {config.index}'s collectives ({e}): "
            "in a collective job call it right after tfpsx.init(), before any TensorFlow op "
            "runs (TF configures collectives once, at program start)") from e

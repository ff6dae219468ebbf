"""``run_server``: a parameter server serves until every worker stopped (or was lost)."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import List, Optional, Tuple

from tfpsx import cluster as _cluster
from tfpsx import settings
from tfpsx.control import eager_anchor
from tfpsx.control.ports import listening
from tfpsx.control.protocol import Coordinator
from tfpsx.ops import library_info, load_ops

logger = logging.getLogger("tfpsx")


@dataclasses.dataclass
class ServerReport:
    """What ``run_server()`` saw before it returned."""
    stopped: List[int]
    lost: List[int]
    seconds: float


def run_server(config: _cluster.ClusterConfig, coord: Coordinator,
               register_timeout: Optional[float] = None,
               heartbeat_timeout: Optional[float] = None) -> Tuple[object, ServerReport]:
    """Starts this server's ``tf.distribute.Server`` with tfpsx's ops, anchors its eager
    service and serves until the job is over. Returns (the server, its report)."""
    import tensorflow as tf

    from tfpsx import compat

    register_timeout = settings.get("TFPSX_REGISTER_TIMEOUT", register_timeout)
    heartbeat_timeout = settings.get("TFPSX_HEARTBEAT_TIMEOUT", heartbeat_timeout)
    load_ops()  # before the server starts: a bare tf.distribute.Server cannot run our ops
    info = library_info()
    start = time.monotonic()
    with listening(f"server {config.index}", config.servers[config.index]):
        server = tf.distribute.Server(
            compat.server_def(config.cluster_spec(), "ps", config.index,
                              settings.get("TFPSX_LISTEN_PORT")), start=True)
    # Before any worker's eager context can reach it (workers wait for the anchor):
    # TF's CreateContext race (tfpsx.control.eager_anchor).
    eager_anchor.anchor(server.server_def, settings.get("TFPSX_RPC_TIMEOUT"))
    me = f"server {config.index}"
    logger.info("%s serving at %s (tfpsx ops for TF %s, CUDA kernels %s); waiting for %d "
                "worker(s)", me, config.servers[config.index], info["tf_version"],
                "in" if info["cuda"] else "not built", config.worker_num)
    stopped, lost = coord.serve(me, register_timeout, heartbeat_timeout,
                                settings.get("TFPSX_CONNECT_TIMEOUT"))
    report = ServerReport(stopped=sorted(stopped), lost=sorted(lost),
                          seconds=time.monotonic() - start)
    if lost:
        logger.warning("%s: job over with lost worker(s) %s", me, report.lost)
    logger.info("%s: all %d workers done after %.1f s; returning", me, config.worker_num,
                report.seconds)
    return server, report

"""gRPC channels of the control plane: fast reconnects, and the bounded wait for
parameter servers to accept connections that every worker makes before it joins."""

from __future__ import annotations

import time
from typing import Dict

import grpc

from tfpsx import errors

# gRPC's default reconnect backoff starts at 1 s: a node that comes up a moment after
# the one it dials would sit idle for a second. Nodes of one job start together.
FAST_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 50),
                  ("grpc.min_reconnect_backoff_ms", 50),
                  ("grpc.max_reconnect_backoff_ms", 1000)]


def wait_for_servers(addresses: Dict[str, str], timeout: float, log=None,
                     report_every: float = 5.0) -> None:
    """Waits until every server accepts gRPC connections, at most ``timeout`` seconds.

    Args:
      addresses: task name (e.g. "ps:0") -> host:port.
      timeout: seconds to wait in all.
      log: a callable taking one message, called every ``report_every`` seconds while waiting.

    Raises:
      ClusterTimeoutError: naming every task that was still unreachable.
    """
    deadline = time.monotonic() + timeout
    pending = dict(addresses)
    next_report = time.monotonic() + min(1.0, report_every)  # say early what we wait for
    channels = {task: grpc.insecure_channel(addr, options=FAST_RECONNECT)
                for task, addr in pending.items()}
    futures = {task: grpc.channel_ready_future(ch) for task, ch in channels.items()}
    try:
        while True:
            for task in [t for t in pending if futures[t].done()]:
                del pending[task]
            if not pending:
                return
            now = time.monotonic()
            if now >= deadline:
                missing = ", ".join(f"{t} at {a}" for t, a in sorted(pending.items()))
                raise errors.ClusterTimeoutError(
                    f"waited {timeout:g} s for parameter servers to come up; still unreachable: "
                    f"{missing}. Are they running (tfpsx.run_server())? Raise the limit with "
                    "TFPSX_CONNECT_TIMEOUT.")
            if log and now >= next_report:
                log(f"waiting for {', '.join(f'{t} at {a}' for t, a in sorted(pending.items()))} "
                    f"({now - deadline + timeout:.0f} s of {timeout:g} s)")
                next_report = now + report_every
            time.sleep(0.05)
    finally:
        for task, future in futures.items():
            future.cancel()  # stops grpc's polling thread before its channel closes
        for channel in channels.values():
            channel.close()

"""gRPC channels of the control plane: fast reconnects, and the bounded wait for
parameter servers to accept connections that every worker makes before it joins."""

from __future__ import annotations

from typing import Dict

import grpc

from tfpsx import errors
from tfpsx.waits import wait_for

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
    channels = {task: grpc.insecure_channel(addr, options=FAST_RECONNECT)
                for task, addr in addresses.items()}
    futures = {task: grpc.channel_ready_future(ch) for task, ch in channels.items()}

    def unreachable(_left) -> str:
        return ", ".join(f"{t} at {a}" for t, a in sorted(addresses.items())
                         if not futures[t].done())

    try:
        wait_for(unreachable, lambda missing: not missing, timeout,
                 lambda missing, _waited: errors.ClusterTimeoutError(
                     f"waited {timeout:g} s for parameter servers to come up; still "
                     f"unreachable: {missing}. Are they running (tfpsx.run_server())? Raise "
                     "the limit with TFPSX_CONNECT_TIMEOUT."),
                 report=(report_every, lambda missing, waited: log(
                     f"waiting for {missing} ({waited:.0f} s of {timeout:g} s)"))
                 if log else None)
    finally:
        for task, future in futures.items():
            future.cancel()  # stops grpc's polling thread before its channel closes
        for channel in channels.values():
            channel.close()

"""The control plane without a scheduler: counters on PS 0 reached through its master.

Workers mark themselves started/stopped on PS 0, bump heartbeat counters and meet at
barriers; servers read the same counters to know when the job is over. It runs in a
graph and session of its own, so it works the same whether the user's code is in graph
or eager mode.
"""

from __future__ import annotations

import threading
import time
from typing import Dict, List, Optional

import grpc

from tfpsx import errors
from tfpsx._loader import load_ops

STARTED = "workers_started"
STOPPED = "workers_stopped"
SERVERS_DONE = "servers_done"
BARRIER = "worker_barrier"
_PREFIX = "tfpsx/control/"


def heartbeat_name(worker: int) -> str:
    return f"heartbeat/worker_{worker}"


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
    channels = {task: grpc.insecure_channel(addr) for task, addr in pending.items()}
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


class ControlClient:
    """Counter ops on ``/job:ps/task:0``, run through PS 0's own master.

    Args:
      ps0_address: host:port of PS 0.
      worker_num: how many heartbeat counters to prepare.
      timeout: seconds any single call may take.
    """

    def __init__(self, ps0_address: str, worker_num: int, timeout: float = 30.0):
        import tensorflow as tf

        self._tf = tf
        self.address = ps0_address
        self._timeout_ms = int(timeout * 1000)
        ops = load_ops()
        self._graph = tf.Graph()
        self._ops: Dict[str, dict] = {}
        names = [STARTED, STOPPED, SERVERS_DONE, BARRIER] + [
            heartbeat_name(w) for w in range(worker_num)]
        with self._graph.as_default(), tf.compat.v1.device("/job:ps/task:0"):
            self._delta = tf.compat.v1.placeholder(tf.int64, [], name="delta")
            self._member = tf.compat.v1.placeholder(tf.int64, [], name="member")
            for name in names:
                handle = ops.tfpsx_counter_handle_op(shared_name=_PREFIX + name)
                self._ops[name] = {
                    "add": ops.tfpsx_counter_add(handle, self._delta),
                    "read": ops.tfpsx_counter_read(handle),
                    "mark": ops.tfpsx_counter_mark(handle, self._member),
                    "members": ops.tfpsx_counter_members(handle),
                }
        config = tf.compat.v1.ConfigProto(device_filters=["/job:ps/task:0"],
                                          operation_timeout_in_ms=self._timeout_ms)
        self._session = tf.compat.v1.Session(f"grpc://{ps0_address}", graph=self._graph,
                                             config=config)
        self._lock = threading.Lock()

    def _run(self, name: str, kind: str, feed=None):
        return self._run_fetches(self._ops[name][kind], f"{kind} {name!r}", feed)

    def _run_fetches(self, fetches, what: str, feed=None):
        tf = self._tf
        options = tf.compat.v1.RunOptions(timeout_in_ms=self._timeout_ms)
        try:
            with self._lock:
                return self._session.run(fetches, feed_dict=feed, options=options)
        except (tf.errors.NotFoundError, tf.errors.InvalidArgumentError) as e:
            if "Op type not registered 'Tfpsx" in str(e):
                raise errors.OpsNotLoadedOnServerError(
                    f"parameter server ps:0 at {self.address} has not loaded the tfpsx op library "
                    "(a bare tf.distribute.Server cannot run tfpsx ops). Start servers with "
                    "tfpsx.run_server(), or call tfpsx.load_ops() before creating the "
                    f"tf.distribute.Server. TensorFlow said: {e.message.splitlines()[0]}") from e
            raise
        except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
                tf.errors.AbortedError) as e:
            raise errors.ServerUnavailableError(
                f"parameter server ps:0 at {self.address} did not answer {what} within "
                f"{self._timeout_ms / 1000:g} s: {e.message.splitlines()[0]}") from e

    def add(self, name: str, delta: int = 1) -> int:
        return int(self._run(name, "add", {self._delta: delta}))

    def read(self, name: str) -> int:
        return int(self._run(name, "read"))

    def mark(self, name: str, member: int) -> int:
        return int(self._run(name, "mark", {self._member: member}))

    def members(self, name: str) -> List[int]:
        return [int(m) for m in self._run(name, "members")]

    def snapshot(self, heartbeat_names: List[str]):
        """(started members, stopped members, heartbeat values) in one round trip."""
        fetches = [self._ops[STARTED]["members"], self._ops[STOPPED]["members"],
                   [self._ops[n]["read"] for n in heartbeat_names]]
        started, stopped, beats = self._run_fetches(fetches, "snapshot")
        return [int(m) for m in started], [int(m) for m in stopped], [int(b) for b in beats]

    def close(self) -> None:
        self._session.close()


class Heartbeat:
    """Bumps this worker's heartbeat counter on PS 0 every ``interval`` seconds."""

    def __init__(self, client: ControlClient, worker: int, interval: float, log):
        self._client, self._worker, self._interval, self._log = client, worker, interval, log
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tfpsx-heartbeat", daemon=True)
        self.failures = 0

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def _loop(self):
        while not self._stop.wait(self._interval):
            try:
                self._client.add(heartbeat_name(self._worker), 1)
                self.failures = 0
            except (errors.ServerUnavailableError, self._client._tf.errors.OpError) as e:
                self.failures += 1
                self._log(f"heartbeat to ps:0 failed ({self.failures} in a row): {e}")

    def stop(self, timeout: Optional[float] = None) -> None:
        self._stop.set()
        self._thread.join(timeout)

"""The control plane without a scheduler: counters on PS 0 reached through its master.

Workers mark themselves started/stopped on PS 0, bump heartbeat counters and meet at
barriers; servers read the same counters to know when the job is over. It runs in a
graph and session of its own, so it works the same whether the user's code is in graph
or eager mode. Also here: :func:`wait_for_servers`, the bounded wait for servers to
accept gRPC connections that every worker makes before it joins.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Dict, List, Optional

from tfpsx import errors
from tfpsx.background import BackgroundLoop
from tfpsx.control.channels import wait_for_servers
from tfpsx.control.protocol import Coordinator
from tfpsx.ops import bindings
from tfpsx.waits import wait_for

STARTED = "workers_started"
STOPPED = "workers_stopped"
SERVERS_DONE = "servers_done"
BARRIER = "worker_barrier"
_PREFIX = "tfpsx/control/"


def heartbeat_name(worker: int) -> str:
    return f"heartbeat/worker_{worker}"


@contextlib.contextmanager
def ps0_errors(what: str, where: str, timeout: Optional[float] = None):
    """A call to PS 0 (``what``; PS 0 ``where``: "at host:port"), its failures named:
    PS 0 gone or silent (past ``timeout`` seconds) is a ServerUnavailableError (the
    watchdog's retryable exit), a server without the op library OpsNotLoadedOnServerError."""
    import tensorflow as tf

    try:
        yield
    except (tf.errors.NotFoundError, tf.errors.InvalidArgumentError) as e:
        if "Op type not registered 'Tfpsx" in str(e):
            raise errors.OpsNotLoadedOnServerError(
                f"parameter server ps:0 {where} has not loaded the tfpsx op library "
                "(a bare tf.distribute.Server cannot run tfpsx ops). Start servers with "
                "tfpsx.run_server(), or call tfpsx.load_ops() before creating the "
                f"tf.distribute.Server. TensorFlow said: {e.message.splitlines()[0]}") from e
        raise
    except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
            tf.errors.AbortedError) as e:
        within = f" within {timeout:g} s" if timeout else ""
        raise errors.ServerUnavailableError(
            f"parameter server ps:0 {where} did not answer {what}{within}: "
            f"{e.message.splitlines()[0]}") from e


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
        self._graph = tf.Graph()
        self._ops: Dict[str, dict] = {}
        names = [STARTED, STOPPED, SERVERS_DONE, BARRIER] + [
            heartbeat_name(w) for w in range(worker_num)]
        with self._graph.as_default(), tf.compat.v1.device("/job:ps/task:0"):
            self._delta = tf.compat.v1.placeholder(tf.int64, [], name="delta")
            self._member = tf.compat.v1.placeholder(tf.int64, [], name="member")
            for name in names:
                handle = bindings.counter_handle(_PREFIX + name)
                self._ops[name] = {
                    "add": bindings.counter_add(handle, self._delta),
                    "read": bindings.counter_read(handle),
                    "mark": bindings.counter_mark(handle, self._member),
                    "members": bindings.counter_members(handle),
                }
        config = tf.compat.v1.ConfigProto(device_filters=["/job:ps/task:0"],
                                          operation_timeout_in_ms=self._timeout_ms)
        self._session = tf.compat.v1.Session(f"grpc://{ps0_address}", graph=self._graph,
                                             config=config)
        self._lock = threading.Lock()

    def _run(self, name: str, kind: str, feed=None):
        return self._run_fetches(self._ops[name][kind], f"{kind} {name!r}", feed)

    def _run_fetches(self, fetches, what: str, feed=None):
        options = self._tf.compat.v1.RunOptions(timeout_in_ms=self._timeout_ms)
        with ps0_errors(what, f"at {self.address}", self._timeout_ms / 1000), self._lock:
            return self._session.run(fetches, feed_dict=feed, options=options)

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
    """Bumps this worker's heartbeat counter on PS 0 every ``interval`` seconds; a failed
    beat is logged and retried (the servers' own timeout decides when a worker is lost)."""

    def __init__(self, client: ControlClient, worker: int, interval: float, log):
        self._client, self._worker, self._log = client, worker, log
        self._loop = BackgroundLoop("heartbeat to ps:0", self._beat, interval=interval)
        self.failures = 0

    def start(self) -> "Heartbeat":
        self._loop.start()
        return self

    def _beat(self):
        import tensorflow as tf  # loaded already: the client runs TF sessions

        try:
            self._client.add(heartbeat_name(self._worker), 1)
            self.failures = 0
        except (errors.ServerUnavailableError, tf.errors.OpError) as e:
            self.failures += 1
            self._log(f"heartbeat to ps:0 failed ({self.failures} in a row): {e}")

    def stop(self, timeout: Optional[float] = None) -> None:
        self._loop.stop(timeout)


class CounterCoordinator(Coordinator):
    """The job's control plane without a scheduler: counters on PS 0."""

    def __init__(self, config, rpc_timeout: float, heartbeat_interval: float, log):
        self.config, self._rpc_timeout = config, rpc_timeout
        self._heartbeat_interval, self._log = heartbeat_interval, log
        self._client: Optional[ControlClient] = None
        self._heartbeat: Optional[Heartbeat] = None

    def _connect(self) -> ControlClient:
        if self._client is None:
            self._client = ControlClient(self.config.dial(self.config.servers[0]),
                                         self.config.worker_num, self._rpc_timeout)
        return self._client

    # ---------------------------------------------------------------- worker side
    def worker_start(self) -> None:
        self._connect().mark(STARTED, self.config.index)
        self._heartbeat = Heartbeat(self._client, self.config.index, self._heartbeat_interval,
                                    self._log.warning).start()

    def worker_stop(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop(timeout=5)
        self._client.mark(STOPPED, self.config.index)
        self.close()

    def barrier(self, generation: int, timeout: float) -> None:
        num = self.config.worker_num
        target = generation * num
        wait_for(lambda _left: self._client.read(BARRIER), lambda a: a >= target, timeout,
                 lambda a, _waited: errors.ClusterTimeoutError(
                     f"barrier_worker() #{generation} on worker {self.config.index} waited "
                     f"{timeout:g} s; {a - target + num} of {num} workers arrived"),
                 first=self._client.add(BARRIER, 1))

    # ---------------------------------------------------------------- server side
    def serve(self, me: str, register_timeout: float, heartbeat_timeout: float,
              connect_timeout: float, poll_interval: float = 0.25):
        """Waits until every worker stopped or was lost; returns (stopped, lost)."""
        config = self.config
        start = time.monotonic()
        if config.index != 0:
            wait_for_servers({"ps:0": config.servers[0]}, connect_timeout,
                             log=lambda m: self._log.info("%s %s", me, m))
        control = self._connect()
        everyone = set(range(config.worker_num))
        heartbeat_names = [heartbeat_name(w) for w in range(config.worker_num)]
        last_beat = {}   # worker -> (counter value, time it last changed)
        lost: set = set()
        next_report = start + 30
        try:
            while True:
                started, stopped, beats = control.snapshot(heartbeat_names)
                now = time.monotonic()
                started, stopped = set(started), set(stopped)
                for w in sorted(started - stopped - lost):
                    if w not in last_beat or last_beat[w][0] != beats[w]:
                        last_beat[w] = (beats[w], now)
                    elif now - last_beat[w][1] > heartbeat_timeout:
                        lost.add(w)
                        self._log.warning(
                            "%s: worker %d (%s) sent no heartbeat for %.0f s "
                            "(TFPSX_HEARTBEAT_TIMEOUT=%g): reported lost", me, w,
                            config.workers[w], now - last_beat[w][1], heartbeat_timeout)
                if (stopped | lost) >= everyone:
                    break
                never = everyone - started
                if never and now - start > register_timeout:
                    missing = ", ".join(f"worker {w} ({config.workers[w]})" for w in sorted(never))
                    raise errors.ClusterTimeoutError(
                        f"{me} waited {register_timeout:g} s for every worker to call "
                        f"tfpsx.init_worker(); never came: {missing}. Raise the limit with "
                        "TFPSX_REGISTER_TIMEOUT.")
                if now >= next_report:
                    self._log.info("%s: %d/%d workers stopped, running: %s", me, len(stopped),
                                   config.worker_num, sorted(started - stopped - lost))
                    next_report = now + 30
                time.sleep(poll_interval)
            self._finish_servers(heartbeat_timeout)
        finally:
            self.close()
        return sorted(stopped), sorted(lost)

    def _finish_servers(self, timeout: float) -> None:
        # PS 0 holds the counters the other servers read: it leaves only after they have
        # seen the end (or the wait ran out, which it reports).
        config, control = self.config, self._client
        done = control.mark(SERVERS_DONE, config.index)
        if config.index != 0:
            return
        def unconfirmed(_n, _waited) -> errors.ClusterTimeoutError:
            gone = sorted(set(range(config.server_num)) - set(control.members(SERVERS_DONE)))
            return errors.ClusterTimeoutError(
                f"server 0: servers {gone} did not confirm the job end within {timeout:g} s")

        try:
            wait_for(lambda _left: len(control.members(SERVERS_DONE)),
                     lambda n: n >= config.server_num, timeout, unconfirmed, poll=0.1,
                     first=done)
        except errors.ClusterTimeoutError as e:  # reported, not raised: the job is over
            self._log.warning("%s", e)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

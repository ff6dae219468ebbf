"""A userspace network emulator for benchmarks: a TCP proxy that delays every chunk.

The machines' kernels have no netem qdisc, so latency between processes on 127.0.0.1 is
added here: :class:`DelayProxy` listens on a free port and forwards each connection to
its target, holding every chunk ``one_way`` seconds in each direction (a request and its
reply: ``2 * one_way`` more per round trip), in order. With ``rate`` (bytes/s) the proxy is
also a link of that bandwidth, one per direction, shared by all its connections: a chunk
leaves once the chunks before it went through. Put one in front of every server
a process talks to (a cluster spec that lists the proxy's address instead of the
server's) and all cross-process traffic pays the delay.

  with DelayProxy(("127.0.0.1", ps_port), one_way=0.0005) as proxy:
      ...  # clients dial proxy.address
"""

from __future__ import annotations

import asyncio
import threading
from typing import Optional, Tuple

import portpicker


class DelayProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target``, each chunk ``one_way`` s late (and
    no faster than ``rate`` bytes/s in each direction, when given)."""

    def __init__(self, target: Tuple[str, int], one_way: float, port: Optional[int] = None,
                 rate: Optional[float] = None):
        if one_way < 0 or (rate is not None and rate <= 0):
            raise ValueError(f"DelayProxy: one_way must be >= 0 and rate > 0 bytes/s, got "
                             f"one_way={one_way!r}, rate={rate!r}")
        self.target, self.one_way, self.rate = target, float(one_way), rate
        self._link_free = {"up": 0.0, "down": 0.0}  # when each direction's link is idle again
        self.bytes = {"up": 0, "down": 0}  # forwarded, to the target and back
        self.port = port or portpicker.pick_unused_port()
        self.address = f"127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name=f"DelayProxy {self.address}")
        self._server = None

    def start(self) -> "DelayProxy":
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", self.port), self._loop)
        self._server = future.result(timeout=10)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    async def _handle(self, reader, writer):
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(*self.target), timeout=10)
        except (OSError, asyncio.TimeoutError):
            writer.close()
            return
        await asyncio.gather(self._pump(reader, up_writer, "up"),
                             self._pump(up_reader, writer, "down"), return_exceptions=True)

    def _due(self, now: float, size: int, direction: str) -> float:
        """When a chunk of ``size`` bytes that came at ``now`` reaches the other side."""
        if self.rate is None:
            return now + self.one_way
        sent = max(now, self._link_free[direction]) + size / self.rate
        self._link_free[direction] = sent
        return sent + self.one_way

    async def _pump(self, source, sink, direction):
        """Copies ``source`` to ``sink``, each chunk sent ``one_way`` s after it came
        (after the link carried it, with a ``rate``)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        async def send():
            while True:
                due, data = await queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    sink.close()
                    return
                sink.write(data)
                await sink.drain()

        sender = loop.create_task(send())
        try:
            while True:
                data = await source.read(1 << 16)
                self.bytes[direction] += len(data)
                await queue.put((self._due(loop.time(), len(data), direction), data))
                if not data:
                    break
        except (ConnectionError, OSError):
            await queue.put((loop.time(), b""))
        await sender

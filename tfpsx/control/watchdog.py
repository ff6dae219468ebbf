"""A worker's watch over its parameter servers, and the bounded exit when one is lost.

TF's gRPC runtime retries a dead peer without end: with a killed PS, a worker's
``Session.close()`` (and eager calls that reach the PS) block forever (measured: async,
GEO, Keras). Nothing inside TF can be told to give up, so a worker watches its servers
itself and, when one is lost, says so and ends the process within a bound:

* :class:`ServerWatch` probes every server each heartbeat interval with a fresh
  connection and an HTTP/2 handshake (a killed server refuses it; a stopped one never
  answers) and reports one that has not answered for the heartbeat timeout; the
  scheduler's "dead" reports count at once (it applied the same timeout).
* :func:`exit_when_lost` logs the loss with what the main thread was doing, gives the
  training code ``grace`` seconds to fail on its own (an ``UnavailableError`` from the
  step, then TF's close blocks), and then exits the process with :data:`EXIT_PEER_LOST`,
  after dumping every thread's stack. A C-level timer (``faulthandler``) backs it up for
  the case where the interpreter itself is stuck in finalization.
"""

from __future__ import annotations

import atexit
import faulthandler
import logging
import os
import re
import socket
import sys
import threading
import time
import traceback
from typing import Callable, Dict, List, Optional, Tuple

from tfpsx.background import BackgroundLoop
from tfpsx.errors import PeerUnavailableError, PortTakenError, ServerUnavailableError

logger = logging.getLogger("tfpsx")

# The job may succeed when restarted (from its last checkpoint). 138 (128 + SIGUSR1) is
# the code Kubeflow's training operator reserves for "retryable" under its ExitCode
# restart policy (it also retries 130, 137, 143; every other code, EX_TEMPFAIL's 75
# included, is permanent there): deploy/kubeflow relies on it.
EXIT_PEER_LOST = 138
# A task could not listen on its address (errno EADDRINUSE's number on Linux): tfpsx-run
# starts the job again on new ports (tfpsx.control.ports).
EXIT_PORT_TAKEN = 98
# The errors a process exits with EXIT_PEER_LOST for: a restart can succeed.
RETRYABLE = (ServerUnavailableError, PeerUnavailableError)

# The client's HTTP/2 connection preface and an empty SETTINGS frame: a live gRPC
# server answers with its own SETTINGS frame (type 4) at once.
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def probe(address: str, timeout: float) -> bool:
    """True if a gRPC server at ``address`` answers an HTTP/2 handshake within ``timeout``.

    A killed server refuses the connection; a stopped or wedged one accepts it (the
    kernel does) but never answers. A plain socket, not a grpc channel: channels made
    and closed each round in a process that also runs TF's own gRPC broke its poller
    (measured: "epoll_wait error: Bad file descriptor", then a hung worker)."""
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(_PREFACE)
            header = b""
            while len(header) < 9:
                chunk = sock.recv(9 - len(header))
                if not chunk:
                    return False
                header += chunk
            return header[3] == 4  # a SETTINGS frame
    except OSError:
        return False


class ServerWatch:
    """Reports a server that stopped answering.

    Args:
      servers: task name (e.g. "server 0") -> host:port.
      timeout: seconds without an answer after which a server is lost.
      interval: seconds between probe rounds.
      on_lost: called once, from the watch's thread, with (task, address, why).
      reported_dead: optional; returns (task, address) pairs another observer (the
        scheduler) already declared dead.
    """

    def __init__(self, servers: Dict[str, str], timeout: float, interval: float,
                 on_lost: Callable[[str, str, str], None],
                 reported_dead: Optional[Callable[[], List[Tuple[str, str]]]] = None):
        self.servers, self.timeout = dict(servers), timeout
        self._on_lost, self._reported_dead = on_lost, reported_dead
        self._last_ok = {task: time.monotonic() for task in self.servers}
        self._probe_timeout = max(1.0, timeout / 3)  # a loaded machine answers late
        self._loop = BackgroundLoop("server watch", self._round, interval=interval)
        self.lost: Optional[Tuple[str, str, str]] = None

    def start(self) -> "ServerWatch":
        self._loop.start()
        return self

    def stop(self) -> None:
        self._loop.stop(timeout=self._probe_timeout * len(self.servers) + 1)

    def _round(self) -> Optional[bool]:
        for task, address in (self._reported_dead() if self._reported_dead else []):
            return self._lose(task, address, "the scheduler reports it dead (no heartbeat "
                                             f"for {self.timeout:g} s)")
        now = time.monotonic()
        for task, address in self.servers.items():
            if self._loop.stopping:
                return False
            if probe(address, self._probe_timeout):
                self._last_ok[task] = time.monotonic()
            elif now - self._last_ok[task] >= self.timeout:
                return self._lose(task, address, "it has not accepted a connection for "
                                                 f"{now - self._last_ok[task]:.1f} s")
        return None

    def _lose(self, task: str, address: str, why: str) -> bool:
        self.lost = (task, address, why)
        self._on_lost(task, address, why)
        return False  # the watch ends: one loss ends the worker


_PS_TASK = re.compile(r"/job:ps/replica:\d+/task:(\d+)")


def find_in_chain(error: Optional[BaseException], kinds) -> Optional[BaseException]:
    """``error`` or the first exception in its chain of causes (``__cause__``, else
    ``__context__``) that is one of ``kinds``; None when none is."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, kinds):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def lost_server(error: BaseException, servers) -> Optional[Tuple[int, str]]:
    """(rank, address) of the server an ``UnavailableError`` (or an error it caused)
    failed to reach, when its message says which; None otherwise."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = str(error)
        found = _PS_TASK.search(text)
        if found and int(found.group(1)) < len(servers):
            return int(found.group(1)), servers[int(found.group(1))]
        for rank, address in enumerate(servers):
            if address in text:
                return rank, address
        error = error.__cause__ or error.__context__
    return None


def main_thread_activity() -> str:
    """Where the main thread is: the innermost frame of the user's code, then the
    innermost frame overall (what it was waiting in)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "the main thread has ended"
    stack = traceback.extract_stack(frame)
    library = (os.sep + "tensorflow" + os.sep, os.sep + "keras" + os.sep,
               os.sep + "tfpsx" + os.sep, os.sep + "threading.py", "<frozen")
    user = [f for f in stack if not any(part in f.filename for part in library)]
    inner = stack[-1]
    where = f"in {inner.name} ({os.path.basename(inner.filename)}:{inner.lineno})"
    if user:
        u = user[-1]
        return (f"the main thread was at {os.path.basename(u.filename)}:{u.lineno} "
                f"({(u.line or u.name).strip()}), {where}")
    return f"the main thread was {where}"


_exit_lock = threading.Lock()
_exit_armed = False
_hook_installed = False
_exit_on_uncaught = False
_translators: List[Callable[[BaseException], Optional[BaseException]]] = []
_hook = None           # ours, once installed
_previous_hook = None  # the sys.excepthook ours chains to


def _install_hook() -> None:
    """Chains this module's ``sys.excepthook`` in front of the current one (once;
    the caller holds ``_exit_lock``)."""
    global _hook_installed, _hook, _previous_hook
    if _hook_installed:
        return
    _hook_installed = True
    previous = _previous_hook = sys.excepthook

    def hook(kind, value, tb):
        translated = False
        try:
            for translate in list(_translators):
                try:
                    instead = translate(value)
                except Exception:  # noqa: BLE001 — report the original error then
                    instead = None
                if instead is not None:
                    instead.__cause__ = value
                    kind, value, tb, translated = type(instead), instead, None, True
                    break
            previous(kind, value, tb)
        finally:
            if _exit_on_uncaught or translated:
                try:
                    for handler in logger.handlers:
                        handler.flush()
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(exit_code(value))

    sys.excepthook = _hook = hook


def reset_uncaught() -> None:
    """Undoes :func:`exit_if_uncaught` and :func:`translate_uncaught` (``RUNTIME.reset()``):
    no translator, a normal exit, and ``sys.excepthook`` as it was before ours (if nothing
    chained in front of ours since; else ours stays, passing every exception on)."""
    global _hook_installed, _exit_on_uncaught
    with _exit_lock:
        _translators.clear()
        _exit_on_uncaught = False
        if _hook_installed and sys.excepthook is _hook:
            sys.excepthook = _previous_hook
            _hook_installed = False


def exit_code(error: BaseException) -> int:
    """The code a process that an uncaught ``error`` ends exits with."""
    if isinstance(error, RETRYABLE):
        return EXIT_PEER_LOST
    return EXIT_PORT_TAKEN if isinstance(error, PortTakenError) else 1


def exit_if_uncaught() -> None:
    """If the exception being raised now ends the program uncaught, the process leaves
    right after Python prints it, without the interpreter's teardown: TF's input-pipeline
    threads (a ``tf.py_function`` in flight) and sessions towards a lost peer can block it
    for good. The code is :data:`EXIT_PEER_LOST` for a lost server or peer
    (:data:`RETRYABLE`: a restart from the last checkpoint can succeed),
    :data:`EXIT_PORT_TAKEN` for a port another process holds, else 1 as always. A caught exception changes nothing."""
    global _exit_on_uncaught
    with _exit_lock:
        _install_hook()
        _exit_on_uncaught = True


def translate_uncaught(translate: Callable[[BaseException], Optional[BaseException]]) -> None:
    """From now on an exception that ends the program uncaught is first offered to
    ``translate``: where it returns an error (say, a ``ServerUnavailableError`` naming
    the server a raw ``UnavailableError`` lost), that error is what Python prints (the
    original as its cause) and the process leaves as :func:`exit_if_uncaught` says.

    For failures tfpsx cannot catch where they happen: Keras's own wait at an epoch's
    end (outside every step) reaches every server, so a server lost just before it
    surfaces there, raw, out of ``fit``. Where ``translate`` returns None, nothing
    changes: the interpreter ends as usual."""
    with _exit_lock:
        _install_hook()
        if translate not in _translators:
            _translators.append(translate)


def exit_when_lost(message: str, grace: float) -> None:
    """Logs ``message`` and ends the process with :data:`EXIT_PEER_LOST` after ``grace``
    seconds (sooner if the interpreter starts to exit)."""
    global _exit_armed
    with _exit_lock:
        if _exit_armed:
            return
        _exit_armed = True
    logger.error("%s", message)

    def leave(why: str) -> None:
        try:
            sys.stderr.write(f"tfpsx: {message}\ntfpsx: exiting with code {EXIT_PEER_LOST} "
                             f"({why}); the threads' stacks:\n")
            sys.stderr.flush()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            for handler in logger.handlers:
                handler.flush()
            sys.stdout.flush()
        finally:
            os._exit(EXIT_PEER_LOST)

    # The interpreter's exit may block in TF's teardown (a session or server closing
    # towards the dead peer): leave before it.
    atexit.register(leave, "the program ended after the loss")
    # A C-level backstop: it fires even when no Python thread can run any more.
    faulthandler.dump_traceback_later(grace + 15.0, exit=True)

    def later():
        time.sleep(grace)
        leave(f"still running {grace:g} s after the loss")

    threading.Thread(target=later, name="tfpsx-exit-when-lost", daemon=True).start()

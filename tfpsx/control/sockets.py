"""What a task's sockets listen on, and the loopback confinement of a local job's ports.

A local job's launcher (:mod:`tfpsx.launcher.loopback`) preloads a bind shim into each
task and lists the job's TensorFlow ports in :data:`PORTS_ENV`: a wildcard bind on one
of them binds loopback instead. Here, the task's side of it:

* :func:`confine_port` adds a port the task picked itself (a server it starts later) to
  the shim's list in this process;
* :func:`check_confined` runs after a server of the job started (:func:`tfpsx.control.
  ports.listening` calls it): in a confined task whose port listens beyond loopback (the
  shim was not loaded: a path the loader could not parse, a build without it) it raises
  :class:`~tfpsx.errors.ExposedPortError` naming the port and the address, so the job
  stops instead of serving the machine's network;
* :func:`listening` / :func:`exposed` read ``/proc/net/tcp`` and ``/proc/net/tcp6``
  (what the launcher's check, the tests and ``docs/security.md``'s check use).
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
import struct
from typing import Dict, Iterable, List, Optional, Set

from tfpsx.errors import ExposedPortError

# The job's TensorFlow ports, comma-separated: the shim confines wildcard binds on them.
PORTS_ENV = "TFPSX_LOOPBACK_PORTS"
_TCP_LISTEN = "0A"  # st of a listening socket in /proc/net/tcp*


def confined_ports(environ=None) -> Optional[Set[int]]:
    """The ports this task's launcher confined to loopback, or None: the task was not
    started confined (no launcher, or ``--expose``)."""
    value = (os.environ if environ is None else environ).get(PORTS_ENV)
    if value is None:
        return None
    return {int(p) for p in value.replace(" ", "").split(",") if p.isdigit()}


def _shim_function():
    try:
        return ctypes.CDLL(None).tfpsx_loopback_confine_port  # preloaded: in the global scope
    except (AttributeError, OSError):
        return None


def confine_port(port: int) -> None:
    """In a confined task, a server this task starts later on ``port`` (one it picked
    itself) binds loopback too. Does nothing in a task started without confinement."""
    ports = confined_ports()
    if ports is None or int(port) in ports:
        return
    os.environ[PORTS_ENV] = ",".join(str(p) for p in sorted(ports | {int(port)}))
    add = _shim_function()
    if add is not None:
        add(ctypes.c_int(int(port)))
    # Without the shim, check_confined says so once the server listens.


def check_confined(what: str, port: int) -> None:
    """After ``what``'s server started on ``port``: in a task its launcher confined to
    loopback, raises :class:`~tfpsx.errors.ExposedPortError` when the port listens on an
    address other machines reach."""
    ports = confined_ports()
    if ports is None or int(port) not in ports:
        return
    reachable = exposed(listening([port]))
    if reachable:
        preload = os.environ.get("LD_PRELOAD", "")
        raise ExposedPortError(
            f"{what} listens on {', '.join(reachable[int(port)])} port {port}, reachable from "
            "other machines, though its launcher keeps the job on loopback: the bind shim "
            f"was not loaded into this process (LD_PRELOAD={preload!r}; the loader splits it "
            "at spaces and colons, and skips a file it cannot open). Stopping rather than "
            "serving the network; reinstall tfpsx (pip install .), or run the job with "
            "--expose if other machines are meant to reach it (docs/security.md)")


def _address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(hex_addr, 16)))
    # /proc/net/tcp6: four 32-bit words, each in host (little-endian) order.
    words = struct.unpack("<4I", raw)
    return socket.inet_ntop(socket.AF_INET6, struct.pack(">4I", *words))


def listening(ports: Iterable[int]) -> Dict[int, List[str]]:
    """The local addresses listening on each of ``ports`` (TCP, IPv4 and IPv6) in this
    network namespace, read from /proc/net/tcp and /proc/net/tcp6: ``{port: [address,
    ...]}``, a port with no listener left out."""
    wanted = set(int(p) for p in ports)
    found: Dict[int, List[str]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 4 or fields[3] != _TCP_LISTEN:
                continue
            addr, port = fields[1].rsplit(":", 1)
            port = int(port, 16)
            if port in wanted:
                found.setdefault(port, []).append(_address(addr))
    return found


def exposed(listeners: Dict[int, List[str]]) -> Dict[int, List[str]]:
    """The entries of :func:`listening`'s answer that other machines could reach: every
    address but loopback (``::ffff:127.0.0.1`` is IPv4 loopback)."""
    def reachable(address: str) -> bool:
        ip = ipaddress.ip_address(address)
        mapped = getattr(ip, "ipv4_mapped", None)
        return not (mapped or ip).is_loopback

    out = {port: [a for a in addresses if reachable(a)] for port, addresses in listeners.items()}
    return {port: addresses for port, addresses in out.items() if addresses}

"""A local job's TensorFlow servers listen on loopback only.

TF's gRPC server binds ``0.0.0.0:<port>`` whatever address its ClusterSpec gives it
(hard-coded in TF 2.16-2.21; no ServerDef, RPC option or environment variable changes
it), with insecure credentials, and its master, worker and eager services run any op a
client sends, file reads and writes included. A job started on one machine
(``tfpsx-run``, ``make demo``, :class:`~tfpsx.launcher.local.LocalCluster`) has no reason
to be reachable from others, so each of its tasks preloads ``tfpsx/_loopback_bind*.so``
(``custom_ops/loopback/loopback_bind.cc``, built at install): a bind to the wildcard
address binds 127.0.0.1 instead. The tasks still reach each other (and a delay proxy
or a test reaches them) on 127.0.0.1, as before.

Where the library is missing (a build that skipped it, a platform without LD_PRELOAD)
the launcher warns once, naming each port that other machines could reach
(:func:`exposure_warning`). ``tfpsx-run --expose`` (``LocalCluster(loopback_only=False)``)
keeps TF's own behaviour for a user who means to expose the job.

:func:`listening` reads the sockets listening on given ports from ``/proc/net/tcp`` and
``/proc/net/tcp6``: what the tests and ``docs/security.md``'s check use.
"""

from __future__ import annotations

import glob
import ipaddress
import os
import socket
import struct
from typing import Dict, Iterable, List, Optional

_TCP_LISTEN = "0A"  # st of a listening socket in /proc/net/tcp*


def shim_path() -> Optional[str]:
    """The built bind shim's path, or None when it was not built."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = sorted(glob.glob(os.path.join(here, "_loopback_bind*.so")))
    return found[0] if found else None


def confine(env: Dict[str, str], shim: str) -> Dict[str, str]:
    """``env`` with ``shim`` first in LD_PRELOAD (a preload the user set is kept after it)."""
    preload = [p for p in env.get("LD_PRELOAD", "").split() if p and p != shim]
    env["LD_PRELOAD"] = " ".join([shim] + preload)
    return env


def exposure_warning(ports: Iterable[int], reason: str) -> str:
    """The warning for a local job whose TF servers listen on every interface."""
    listed = ", ".join(str(p) for p in sorted(ports))
    return (f"tfpsx: this job's TensorFlow servers listen on every interface of this machine "
            f"(ports {listed}): {reason}. Whoever reaches these ports from another machine "
            "can run any TensorFlow op in the job (read or overwrite the model, read and "
            "write files as this user). Keep the machine on a trusted network or behind a "
            "firewall (docs/security.md).")


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

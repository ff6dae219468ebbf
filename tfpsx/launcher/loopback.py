"""A local job's TensorFlow servers listen on loopback only.

TF's gRPC server binds ``0.0.0.0:<port>`` whatever address its ClusterSpec gives it
(hard-coded in TF 2.16-2.21; no ServerDef, RPC option or environment variable changes
it), with insecure credentials, and its master, worker and eager services run any op a
client sends, file reads and writes included. A job started on one machine
(``tfpsx-run``, ``make demo``, :class:`~tfpsx.launcher.local.LocalCluster`) has no reason
to be reachable from others, so each of its tasks preloads ``tfpsx/_loopback_bind*.so``
(``custom_ops/loopback/loopback_bind.cc``, built at install) and gets the job's TF
ports in ``TFPSX_LOOPBACK_PORTS``: a bind to the wildcard address on one of those ports
binds loopback instead; every other bind of the task (the user's own servers, a
TensorBoard ``--bind_all``) is left alone. The tasks still reach each other (and a delay
proxy or a test reaches them) on 127.0.0.1, as before.

It fails closed: a shim whose path the loader cannot parse (LD_PRELOAD splits at spaces
and colons) is preloaded from a copy (:func:`preloadable`); a task whose server listens
beyond loopback anyway stops with :class:`~tfpsx.errors.ExposedPortError`
(:func:`tfpsx.control.sockets.check_confined`), and the launcher reads the job's sockets
while it starts and stops a job whose port another machine could reach
(``LocalCluster.check_exposure``). Where the library is missing (a build that skipped it,
a platform without LD_PRELOAD) the launcher warns once, naming each port that other
machines could reach (:func:`exposure_warning`). ``tfpsx-run --expose``
(``LocalCluster(loopback_only=False)``) keeps TF's own behaviour for a user who means to
expose the job, and drops a shim its environment inherited.

:func:`listening` reads the sockets listening on given ports from ``/proc/net/tcp`` and
``/proc/net/tcp6``: what the launcher, the tests and ``docs/security.md``'s check use.
"""

from __future__ import annotations

import atexit
import glob
import os
import re
import shutil
import tempfile
from typing import Dict, Iterable, List, Optional

from tfpsx.control.sockets import PORTS_ENV, exposed, listening

__all__ = ["PORTS_ENV", "confine", "exposed", "exposure_warning", "listening", "preloadable",
           "release", "shim_path"]

# The loader splits LD_PRELOAD at spaces and colons, with no escape (ld.so(8)).
_PRELOAD_SEPARATORS = re.compile(r"[ :]+")
_SHIM_NAME = re.compile(r"_loopback_bind[^/]*\.so$")


def shim_path() -> Optional[str]:
    """The built bind shim's path, or None when it was not built."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = sorted(glob.glob(os.path.join(here, "_loopback_bind*.so")))
    return found[0] if found else None


def _loader_can_parse(path: str) -> bool:
    return os.path.isabs(path) and not _PRELOAD_SEPARATORS.search(path)


def preloadable(shim: str) -> str:
    """A path of ``shim`` that LD_PRELOAD can carry: the shim itself, or, when its path
    has a space or a colon (a virtualenv under "My Projects"), a copy in a new private
    folder (0700, removed when this process exits).

    Raises:
      ValueError: no temporary folder without a space or colon to copy it to.
    """
    if _loader_can_parse(shim):
        return shim
    for parent in (tempfile.gettempdir(), "/tmp", "/dev/shm"):
        if not (_loader_can_parse(parent) and os.path.isdir(parent)
                and os.access(parent, os.W_OK | os.X_OK)):
            continue
        folder = tempfile.mkdtemp(prefix="tfpsx-preload-", dir=parent)
        copy = os.path.join(folder, os.path.basename(shim))
        if not _loader_can_parse(copy):
            shutil.rmtree(folder, ignore_errors=True)
            continue
        shutil.copy2(shim, copy)
        atexit.register(shutil.rmtree, folder, True)
        return copy
    raise ValueError(
        f"the loopback bind shim's path {shim!r} has a space or a colon, which LD_PRELOAD "
        "cannot carry, and no temporary folder without one to copy it to (TMPDIR, /tmp, "
        "/dev/shm); set TMPDIR to a writable folder whose path has neither, or install "
        "tfpsx under such a path")


def _without_shim(preload: str) -> List[str]:
    return [p for p in _PRELOAD_SEPARATORS.split(preload) if p and not _SHIM_NAME.search(p)]


def confine(env: Dict[str, str], shim: str, ports: Iterable[int]) -> Dict[str, str]:
    """``env`` with ``shim`` first in LD_PRELOAD (another copy of it dropped; a preload
    the user set is kept after it) and ``ports`` as the ports it keeps on loopback.

    Raises:
      ValueError: ``shim``'s path cannot go into LD_PRELOAD (see :func:`preloadable`).
    """
    if not _loader_can_parse(shim):
        raise ValueError(f"LD_PRELOAD cannot carry the path {shim!r} (a space or a colon, or "
                         "not absolute): give loopback.preloadable(shim)")
    env["LD_PRELOAD"] = " ".join([shim] + _without_shim(env.get("LD_PRELOAD", "")))
    env[PORTS_ENV] = ",".join(str(int(p)) for p in sorted(set(ports)))
    return env


def release(env: Dict[str, str]) -> Dict[str, str]:
    """``env`` without the shim (an exposed job's tasks: one inherited from a confined
    parent's environment is dropped) and without the confined ports."""
    rest = _without_shim(env.get("LD_PRELOAD", ""))
    if rest:
        env["LD_PRELOAD"] = " ".join(rest)
    else:
        env.pop("LD_PRELOAD", None)
    env.pop(PORTS_ENV, None)
    return env


def exposure_warning(ports: Iterable[int], reason: str) -> str:
    """The warning for a local job whose TF servers listen on every interface."""
    listed = ", ".join(str(p) for p in sorted(ports))
    return (f"tfpsx: this job's TensorFlow servers listen on every interface of this machine "
            f"(ports {listed}): {reason}. Whoever reaches these ports from another machine "
            "can run any TensorFlow op in the job (read or overwrite the model, read and "
            "write files as this user). Keep the machine on a trusted network or behind a "
            "firewall (docs/security.md).")

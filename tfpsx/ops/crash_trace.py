"""A native stack trace on stderr when a tfpsx process dies of a fatal signal.

A parameter server that crashes inside a kernel otherwise exits without a word (its
workers see only "connection reset by peer"). When the op library loads, this installs
Python's :mod:`faulthandler` (every Python thread's stack) and, in front of it, the
library's handler (``custom_ops/cc/crash_trace.cc``: the signal, the address and the
native stack). The process still dies of the same signal, and still dumps core where that
is enabled. ``TFPSX_CRASH_TRACE=0`` leaves the process's signal handlers alone.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import sys

from tfpsx import settings

_installed = False


def wanted() -> bool:
    """Whether ``TFPSX_CRASH_TRACE`` (default on) asks for the handlers; a ValueError
    names a value that is not a bool."""
    return settings.get("TFPSX_CRASH_TRACE")


def install(library_path: str) -> bool:
    """Installs the handlers once per process, unless :func:`wanted` says no; returns
    whether they are installed. OSError if the library refuses the signal handlers."""
    global _installed
    if not wanted():
        return False
    if _installed:
        return True
    if not faulthandler.is_enabled():
        faulthandler.enable(file=sys.__stderr__ or sys.stderr, all_threads=True)
    # The op library is loaded already: dlopen hands back the same mapping.
    lib = ctypes.CDLL(library_path)
    err = lib.tfpsx_install_crash_trace(ctypes.c_int(2))
    if err:
        raise OSError(err, f"tfpsx could not install its crash handler: {os.strerror(err)}")
    _installed = True
    return True

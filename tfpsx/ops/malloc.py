"""glibc's malloc, set for a TensorFlow worker's steps (``TFPSX_MALLOC_TUNING``).

A step frees and allocates the same large buffers again and again, from many threads.
With glibc's defaults a freed buffer over the mmap threshold goes back to the kernel,
and a heap whose free top passes the trim threshold is trimmed: the next step's buffer
is then fresh pages, each faulted in and zeroed by the kernel. On the Criteo job's Keras
workers (1 PS + 2, GEO k=10, its input leased split by split) page faults were in 15% of
a worker's CPU samples (``perf record``; 4% on the static cut), and the job ran 16,693-
17,983 examples/s at 99-108 ms of the workers' CPU per 1,000; with the settings below,
22,095 at 79 (``benchmarks/time_to_auc.py --job criteo --workers 2``,
docs/design-notes/geo.md).

So the op library's loader sets, once a process: buffers below 32 MiB (glibc's largest
mmap threshold) from the heap, freed memory kept up to 1 GiB at a heap's top, and the
heap grown 64 MiB at a time. A process keeps memory it freed (its peak, not more),
which is what TensorFlow's own guides get from tcmalloc. Left alone: where the user
tunes malloc already (``MALLOC_*_`` variables, ``GLIBC_TUNABLES``' malloc, a preloaded
allocator), off glibc, and with ``TFPSX_MALLOC_TUNING=0``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from typing import Dict, Optional

from tfpsx import settings

logger = logging.getLogger("tfpsx")

# mallopt's parameters (malloc.h) and the values set.
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
VALUES = {"M_MMAP_THRESHOLD": (M_MMAP_THRESHOLD, 32 << 20),
          "M_TRIM_THRESHOLD": (M_TRIM_THRESHOLD, 1 << 30),
          "M_TOP_PAD": (M_TOP_PAD, 64 << 20)}
_USER_TUNED = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_",
               "MALLOC_MMAP_MAX_", "MALLOC_ARENA_MAX")
_applied: Optional[Dict[str, int]] = None


def why_left_alone(env=None) -> Optional[str]:
    """Why this process's malloc is left as it is, or None (it is set)."""
    env = os.environ if env is None else env
    if not settings.get("TFPSX_MALLOC_TUNING", env=env):
        return "TFPSX_MALLOC_TUNING is off"
    tuned = [name for name in _USER_TUNED if name in env]
    if tuned:
        return f"the user sets {', '.join(tuned)}"
    if "glibc.malloc" in env.get("GLIBC_TUNABLES", ""):
        return "the user sets GLIBC_TUNABLES' glibc.malloc"
    preload = env.get("LD_PRELOAD", "")
    if any(name in preload for name in ("tcmalloc", "jemalloc", "mimalloc")):
        return f"another allocator is preloaded (LD_PRELOAD={preload})"
    if platform.libc_ver()[0] != "glibc":
        return "the C library is not glibc"
    return None


def tune() -> Dict[str, int]:
    """Sets this process's malloc once (see the module doc); returns what was set (empty
    where it is left alone). A value glibc refuses is logged, not raised: the process
    runs with glibc's own."""
    global _applied
    if _applied is not None:
        return _applied
    why = why_left_alone()
    if why is not None:
        logger.debug("tfpsx: malloc left as it is: %s", why)
        _applied = {}
        return _applied
    libc = ctypes.CDLL(None)
    applied = {}
    for name, (param, value) in VALUES.items():
        if libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) == 1:
            applied[name] = value
        else:
            logger.warning("tfpsx: glibc refused mallopt(%s, %d); that one stays glibc's "
                           "(TFPSX_MALLOC_TUNING)", name, value)
    _applied = applied
    return applied

"""The op library's loader sets glibc's malloc for a step's buffers (tfpsx/ops/malloc.py,
TFPSX_MALLOC_TUNING): a buffer freed and allocated again is the heap's, not fresh pages
the kernel faults in again. Checked against the kernel's own count of a process's page
faults (getrusage), in fresh processes with the setting on and off."""

import json
import os
import platform
import subprocess
import sys

import pytest

from tfpsx import settings
from tfpsx.ops import malloc

# A step's buffers: 12 of 1-5 MiB live at once (36 MiB), each written whole, then freed;
# three such steps. With glibc's defaults the freed heap top passes the trim threshold
# and goes back to the kernel, so each step's buffers are fresh pages again; kept, the
# later steps fault nothing in.
_PATTERN = r"""
import ctypes, json, resource
import tfpsx
tfpsx.load_ops()
from tfpsx.ops import malloc
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def step():
    held = []
    for i in range(12):
        size = (i % 5 + 1) << 20
        p = libc.malloc(size)
        ctypes.memset(p, 1, size)
        held.append(p)
    for p in held:
        libc.free(p)
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step()
step()
print(json.dumps({"applied": malloc.tune(),
                  "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def _run(env):
    env = dict(os.environ, **env)
    for name in malloc._USER_TUNED + ("GLIBC_TUNABLES",):
        env.pop(name, None)
    out = subprocess.run([sys.executable, "-c", _PATTERN], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.heavy
def test_a_freed_buffer_is_the_heaps_again_not_fresh_pages():
    on, off = _run({}), _run({"TFPSX_MALLOC_TUNING": "0"})
    assert on["applied"] == {name: value for name, (_, value) in malloc.VALUES.items()}
    assert off["applied"] == {}
    # 2 x 36 MiB written: 18,432 pages (16,832 faulted in again here with glibc's defaults)
    assert off["faults"] > 9_000, off
    assert on["faults"] < 500, on


def test_left_alone_where_the_user_tunes_malloc_or_turns_it_off():
    assert malloc.why_left_alone({}) is None or platform.libc_ver()[0] != "glibc"
    assert malloc.why_left_alone({"TFPSX_MALLOC_TUNING": "0"}) == "TFPSX_MALLOC_TUNING is off"
    assert malloc.why_left_alone({"MALLOC_ARENA_MAX": "2"}) == "the user sets MALLOC_ARENA_MAX"
    assert malloc.why_left_alone({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}) == (
        "the user sets GLIBC_TUNABLES' glibc.malloc")
    assert "preloaded" in malloc.why_left_alone({"LD_PRELOAD": "/usr/lib/libtcmalloc.so.4"})
    with pytest.raises(ValueError, match="TFPSX_MALLOC_TUNING.*'maybe'"):
        settings.get("TFPSX_MALLOC_TUNING", env={"TFPSX_MALLOC_TUNING": "maybe"})


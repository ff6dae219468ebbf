"""The one place that finds and loads the tfpsx op library.

The library is compiled at install time against the TensorFlow that is installed
(``setup.py`` writes ``_tfpsx_ops*.so`` into the ``tfpsx`` package folder, with a build
record compiled into it: the TF version it was built for and whether its CUDA kernels are
in). Loading is lazy, happens once per process, and every failure is an ImportError that
names the running TF, the TF the library was built for, and the command that rebuilds it.
Only :mod:`tfpsx.ops.bindings` uses the loaded module.
"""

from __future__ import annotations

import glob
import os
import re
import threading
from typing import Optional

from tfpsx import settings
from tfpsx.errors import OpLibraryError
from tfpsx.ops import crash_trace, malloc

REBUILD_COMMAND = "pip install --no-build-isolation -e .  (or: make build)"
_BUILD_MARKER = re.compile(rb"tfpsx-build-info:tf=([^;\x00]{1,64});(?:cuda=([01]);)?")
_LIB_GLOB = "_tfpsx_ops*.so"

_lock = threading.Lock()
_loaded = None  # the module returned by tf.load_op_library
_loaded_info: dict = {}  # its build record and path


def _library_dir() -> str:
    # setup.py builds the extension ``tfpsx._tfpsx_ops``: the package folder.
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def find_library(lib_dir: Optional[str] = None) -> str:
    """Returns the path of the op library in ``lib_dir`` (default: next to this module)."""
    lib_dir = lib_dir or _library_dir()
    matches = sorted(glob.glob(os.path.join(lib_dir, _LIB_GLOB)))
    if not matches:
        import tensorflow as tf

        raise OpLibraryError(
            f"tfpsx op library not found: no {_LIB_GLOB} in {lib_dir}. It is compiled at install "
            f"time against the installed TensorFlow (running: {tf.__version__}). Rebuild it with: "
            f"{REBUILD_COMMAND}")
    return matches[-1]


def build_info(path: str) -> dict:
    """What the build recorded inside the library at ``path``:
    ``{"tf_version": "2.21.0", "cuda": False}`` (``cuda``: its CUDA kernels are in)."""
    try:
        with open(path, "rb") as f:
            match = _BUILD_MARKER.search(f.read())
    except OSError as e:
        raise OpLibraryError(f"cannot read tfpsx op library {path}: {e}. "
                             f"Rebuild it with: {REBUILD_COMMAND}") from e
    if match is None:
        raise OpLibraryError(
            f"tfpsx op library {path} carries no build record, so the TensorFlow it was built "
            f"for is unknown. Rebuild it with: {REBUILD_COMMAND}")
    return {"tf_version": match.group(1).decode("ascii", "replace"),
            "cuda": match.group(2) == b"1"}


def load_ops(lib_dir: Optional[str] = None):
    """Loads the tfpsx op library once and returns its op module.

    Args:
      lib_dir: folder holding the library; the package folder by default. Tests pass another folder; users never need to.

    Returns:
      The module ``tf.load_op_library`` returned, whose attributes are the ops
      (``tfpsx_counter_add`` ...).

    Raises:
      OpLibraryError (an ImportError): the library is missing, was built for another
        TensorFlow, or failed to load. The message names both TF versions and the
        rebuild command.
    """
    global _loaded
    if _loaded is not None and lib_dir is None:
        return _loaded
    with _lock:
        if _loaded is not None and lib_dir is None:
            return _loaded
        import tensorflow as tf

        crash_trace.wanted()  # a bad TFPSX_CRASH_TRACE fails before anything loads
        settings.get("TFPSX_TABLE_HUGE_PAGES")  # read by the C++ core: a bad value named here
        malloc.tune()  # (a bad TFPSX_MALLOC_TUNING fails here too, before the library loads)
        path = find_library(lib_dir)
        info = build_info(path)
        built_for = info["tf_version"]
        if built_for != tf.__version__:
            raise OpLibraryError(
                f"tfpsx op library {path} was built for TensorFlow {built_for}, but TensorFlow "
                f"{tf.__version__} is running. tfpsx compiles its ops against the installed TF; "
                f"rebuild them with: {REBUILD_COMMAND}")
        try:
            module = tf.load_op_library(path)
        except Exception as e:  # tf raises NotFoundError for undefined symbols etc.
            raise OpLibraryError(
                f"failed to load tfpsx op library {path} (built for TensorFlow {built_for}, "
                f"running TensorFlow {tf.__version__}): {e}. Rebuild it with: "
                f"{REBUILD_COMMAND}") from e
        if lib_dir is None:
            crash_trace.install(path)
            _loaded_info.update(info, path=path)
            _loaded = module
        return module


def library_info() -> dict:
    """The loaded library's build record: ``{"path", "tf_version", "cuda"}`` (loads it)."""
    load_ops()
    return dict(_loaded_info)

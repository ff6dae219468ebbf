"""The op loader: loads once, and every failure names both TF versions and the rebuild."""

import os
import signal
import subprocess
import sys

import pytest
import tensorflow as tf

import tfpsx
from tfpsx.ops import loader as _loader


def test_loads_once_and_has_control_ops():
    ops = tfpsx.load_ops()
    assert tfpsx.load_ops() is ops
    for name in ("tfpsx_counter_handle_op", "tfpsx_counter_add", "tfpsx_counter_read",
                 "tfpsx_counter_mark", "tfpsx_counter_members"):
        assert hasattr(ops, name), name
    assert _loader.build_info(_loader.find_library())["tf_version"] == tf.__version__


def test_gpu_table_ops_come_only_with_a_cuda_build():
    """The GPU table's ops and kernels are *.cu.cc sources, which only a CUDA build
    (TFPSX_WITH_CUDA=1) compiles (`make cuda-check` compiles them here): a CPU library
    registers the ops it did before the GPU table existed, and none of the GPU table's."""
    ops = tfpsx.load_ops()
    info = _loader.library_info()
    gpu_ops = sorted(n for n in dir(ops) if n.startswith("tfpsx_gpu_table"))
    if info["cuda"]:
        assert "tfpsx_gpu_table_find_or_insert" in gpu_ops, gpu_ops
    else:
        assert gpu_ops == [], (info, gpu_ops)
    assert hasattr(ops, "tfpsx_hash_table_find")


def _copy_with_version(tmp_path, version: str) -> str:
    src = _loader.find_library()
    data = open(src, "rb").read()
    marker = f"tfpsx-build-info:tf={tf.__version__};".encode()
    assert data.count(marker) == 1
    patched = data.replace(marker, f"tfpsx-build-info:tf={version};".encode())
    dst = tmp_path / os.path.basename(src)
    dst.write_bytes(patched)
    return str(tmp_path)


def test_version_mismatch_names_both_versions_and_rebuild(tmp_path):
    lib_dir = _copy_with_version(tmp_path, "2.99.0")
    with pytest.raises(ImportError) as info:
        _loader.load_ops(lib_dir)
    message = str(info.value)
    assert "built for TensorFlow 2.99.0" in message
    assert f"TensorFlow {tf.__version__} is running" in message
    assert _loader.REBUILD_COMMAND in message
    assert isinstance(info.value, tfpsx.OpLibraryError)


def test_missing_library(tmp_path):
    with pytest.raises(ImportError, match=r"not found.*running: " + tf.__version__ + ".*Rebuild"):
        _loader.load_ops(str(tmp_path))


def test_library_without_build_record(tmp_path):
    (tmp_path / "_tfpsx_ops.so").write_bytes(b"\x7fELF not really a library")
    with pytest.raises(ImportError, match="no build record.*Rebuild it with"):
        _loader.load_ops(str(tmp_path))


def test_corrupt_library_chains_the_cause(tmp_path):
    lib = tmp_path / "_tfpsx_ops.so"
    lib.write_bytes(b"junk tfpsx-build-info:tf=" + tf.__version__.encode() + b"; junk")
    with pytest.raises(ImportError, match="failed to load.*Rebuild") as info:
        _loader.load_ops(str(tmp_path))
    assert info.value.__cause__ is not None


_CRASH = ("from tfpsx.ops import loader; loader.load_ops(); import ctypes; "
          "print('loaded', flush=True); ctypes.string_at(0)")


def _crash(env_value):
    env = {k: v for k, v in os.environ.items() if k != "TFPSX_CRASH_TRACE"}
    if env_value is not None:
        env["TFPSX_CRASH_TRACE"] = env_value
    return subprocess.run([sys.executable, "-c", _CRASH], env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.heavy
def test_a_fatal_signal_prints_the_native_and_python_stacks():
    # A server that segfaults in a kernel says where, then still dies of the signal.
    proc = _crash(None)
    assert proc.returncode == -signal.SIGSEGV, proc
    err = proc.stderr
    assert "*** tfpsx: fatal SIGSEGV (11) in pid" in err, err
    assert "address 0x0; native stack" in err, err
    stack = err.split("native stack (innermost first):", 1)[1].split("*** end of native stack")[0]
    assert "_tfpsx_ops" in stack and "libc.so" in stack, stack  # frames, named by library
    # then Python's faulthandler: the Python frames of the thread that faulted
    assert "Fatal Python error: Segmentation fault" in err, err
    assert "in string_at" in err, err


@pytest.mark.heavy
def test_a_call_through_a_null_pointer_names_its_caller():
    # Nothing unwinds from address 8 (a call through a null pointer, as in a use after
    # free): the trace gives the faulting instruction and the caller's return address on
    # top of the stack (here libffi, ctypes' call).
    proc = subprocess.run(
        [sys.executable, "-c", "from tfpsx.ops import loader; loader.load_ops(); import ctypes; "
                               "ctypes.CFUNCTYPE(None)(8)()"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGSEGV, proc
    err = proc.stderr
    assert "*** faulting instruction:\n[0x8]" in err, err
    caller = err.split("*** a jump to a null address; called from:\n", 1)[1].split("\n", 1)[0]
    assert "libffi" in caller, err
    # The unwinder is not tried from there (it faults): the chain still runs.
    assert "Fatal Python error: Segmentation fault" in err, err


@pytest.mark.heavy
def test_crash_trace_can_be_turned_off_and_rejects_bad_values():
    proc = _crash("0")
    assert proc.returncode == -signal.SIGSEGV, proc
    assert "tfpsx: fatal" not in proc.stderr, proc.stderr
    proc = _crash("maybe")
    assert proc.returncode == 1 and "loaded" not in proc.stdout, proc
    assert "TFPSX_CRASH_TRACE: expected one of" in proc.stderr, proc.stderr
    assert "'maybe'" in proc.stderr, proc.stderr


def _load_in_a_process(env):
    code = "import tfpsx; tfpsx.load_ops(); print('loaded')"
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120)


@pytest.mark.heavy
def test_the_cores_boolean_settings_take_the_registry_spellings():
    # The C++ core reads TFPSX_TABLE_HUGE_PAGES itself (env_bool.cc: the same spellings,
    # natively tested); the loader names a bad value before the library loads.
    proc = _load_in_a_process({"TFPSX_TABLE_HUGE_PAGES": "On"})
    assert proc.returncode == 0 and "loaded" in proc.stdout, proc
    proc = _load_in_a_process({"TFPSX_TABLE_HUGE_PAGES": "maybe"})
    assert proc.returncode == 1 and "loaded" not in proc.stdout, proc
    assert "TFPSX_TABLE_HUGE_PAGES: expected one of 1, true, yes, on, 0, false, no, off, " \
           "got 'maybe'" in proc.stderr, proc.stderr


@pytest.mark.parametrize("value, expected", [("yes", "True"), ("off", "False"), ("1", "True")])
def test_setup_py_parses_booleans_as_the_registry_does(value, expected):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("import runpy, sys; sys.argv = ['setup.py']; "
            "import setuptools; setuptools.setup = lambda **kw: None; "
            "g = runpy.run_path('setup.py'); print(g['cuda_wanted']())")
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "TFPSX_WITH_CUDA": value})
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1] == expected, proc
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "TFPSX_WITH_CUDA": "2"})
    assert proc.returncode == 1, proc
    assert "TFPSX_WITH_CUDA: expected one of 1, true, yes, on, 0, false, no, off, got '2'" \
        in proc.stderr, proc.stderr

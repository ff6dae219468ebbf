"""The op loader: loads once, and every failure names both TF versions and the rebuild."""

import os
import shutil

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

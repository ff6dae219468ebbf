"""The package's map stays readable: layers and no cycles (import-linter, .importlinter),
and no module past ~600 lines."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(120)
def test_import_contracts_hold():
    exe = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or \
        shutil.which("lint-imports")
    assert exe, "lint-imports not installed: pip install -e '.[test]'"
    proc = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def test_no_module_past_600_lines():
    big = []
    for folder, _, files in os.walk(os.path.join(ROOT, "tfpsx")):
        for name in files:
            if name.endswith(".py") and "_pb2" not in name:
                path = os.path.join(folder, name)
                lines = sum(1 for _ in open(path, encoding="utf-8"))
                if lines > 600:
                    big.append(f"{os.path.relpath(path, ROOT)} ({lines} lines)")
    assert not big, f"split these by concept: {big}"


def test_private_tensorflow_symbols_are_reached_through_compat_only():
    # tfpsx/compat.py names each private TF symbol with why and on which TF versions.
    found = []
    for folder, _, files in os.walk(os.path.join(ROOT, "tfpsx")):
        for name in files:
            path = os.path.join(folder, name)
            if not name.endswith(".py") or path.endswith(os.path.join("tfpsx", "compat.py")):
                continue
            text = open(path, encoding="utf-8").read()
            for needle in ("tensorflow.python", "tf.__internal__", "keras.src"):
                if needle in text:
                    found.append(f"{os.path.relpath(path, ROOT)}: {needle}")
    assert not found, f"import these through tfpsx.compat: {found}"

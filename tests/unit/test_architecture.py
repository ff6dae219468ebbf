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


def test_no_class_name_is_defined_twice():
    # Two classes of one name (graph_state's registry and graph mode's state factory were
    # both GraphState) send a reader to the wrong one.
    import ast

    where = {}
    for path in _tfpsx_modules():
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(os.path.relpath(path, ROOT))
    twice = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not twice, f"name each class once: {twice}"


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


def _tfpsx_modules():
    for folder, _, files in os.walk(os.path.join(ROOT, "tfpsx")):
        for name in files:
            if name.endswith(".py") and "_pb2" not in name:  # (generated protobuf code)
                yield os.path.join(folder, name)


def test_private_attributes_of_tf_and_keras_objects_are_read_in_compat_only():
    """A read of ``obj._name`` outside compat.py where tfpsx itself defines no ``_name``
    (no def, class, assignment, argument or import of that name anywhere in the package)
    is a private attribute of someone else's object: TF's or Keras's. A subclass's own
    ``self._x`` / ``cls._x`` is its business, and ``sys._current_frames`` / ``os._exit``
    are the standard library's documented names."""
    import ast

    defined, reads = set(), []
    for path in _tfpsx_modules():
        tree = ast.parse(open(path, encoding="utf-8").read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Load):
                defined.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.id)
            elif isinstance(node, ast.arg):
                defined.add(node.arg)
            elif isinstance(node, ast.alias):
                defined.add(node.asname or node.name.split(".")[-1])
            elif isinstance(node, ast.keyword) and node.arg:
                defined.add(node.arg)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
                  and node.attr.startswith("_") and not node.attr.startswith("__")
                  and not path.endswith(os.path.join("tfpsx", "compat.py"))):
                owner = node.value.id if isinstance(node.value, ast.Name) else None
                if owner not in ("self", "cls", "sys", "os"):
                    reads.append((os.path.relpath(path, ROOT), node.lineno, node.attr))
    foreign = [f"{path}:{line} .{attr}" for path, line, attr in reads if attr not in defined]
    assert not foreign, f"read these through tfpsx.compat (with why and which TF): {foreign}"

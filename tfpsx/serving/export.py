"""``export_serving``: a SavedModel that stock TensorFlow and TF Serving run, in TF
Serving's layout (``<path>/<version>/saved_model.pb``, signature ``serving_default``)."""

from __future__ import annotations

import os
import shutil
import threading
import uuid
from typing import Dict, Optional

import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2

SERVING_DEFAULT = "serving_default"
OP_PREFIX = "Tfpsx"


def _versions(base: str):
    return [int(name) for name in os.listdir(base) if name.isdigit() and
            os.path.isdir(os.path.join(base, name))]


def version_dir(path: str, version: Optional[int]) -> str:
    """``path/<version>``: ``version``, or the next free integer (1 for a new path).

    Raises:
      ValueError: a version that is not a positive int, or ``path`` is a file.
      FileExistsError: ``path/<version>`` exists already.
    """
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"export_serving: {path!r} is a file; the path must be a folder (TF "
                         "Serving's model base path), new or holding numbered versions")
    if version is not None and (isinstance(version, bool) or not isinstance(version, int)
                                or version < 1):
        raise ValueError(f"export_serving: version must be a positive int (TF Serving loads "
                         f"the highest numbered folder) or None for the next free one, got "
                         f"{version!r}")
    if version is None:
        version = max(_versions(path), default=0) + 1 if os.path.isdir(path) else 1
    target = os.path.join(path, str(version))
    if os.path.exists(target):
        raise FileExistsError(f"export_serving: {target!r} exists already; pick another "
                              "version, or version=None for the next free one")
    return target


def in_clean_thread(fn):
    """``fn()`` in a new thread: TF2's eager context and no strategy scope, default graph or
    table updater scope of the caller's (all are per thread), so that what the export
    creates is plain local state, wherever ``export_serving`` was called from (inside a
    ``with tf.Graph().as_default():`` of a TF1 job, or a strategy's ``scope()``)."""
    result: Dict[str, object] = {}

    def run():
        try:
            if not tf.executing_eagerly():
                raise RuntimeError(
                    "export_serving needs TF2 behavior in the process (eager execution "
                    "enabled; the model itself may be a tf.compat.v1 graph): it cannot run "
                    "after tf.compat.v1.disable_eager_execution() or disable_v2_behavior()")
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 — re-raised in the caller's thread
            result["error"] = e

    thread = threading.Thread(target=run, name="tfpsx-export-serving")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def tfpsx_ops(saved_model_dir: str) -> Dict[str, int]:
    """Op types starting with ``Tfpsx`` in a SavedModel's graphs and functions, counted."""
    proto = saved_model_pb2.SavedModel()
    with open(os.path.join(saved_model_dir, "saved_model.pb"), "rb") as f:
        proto.ParseFromString(f.read())
    found: Dict[str, int] = {}
    for meta in proto.meta_graphs:
        nodes = list(meta.graph_def.node)
        for fn in meta.graph_def.library.function:
            nodes.extend(fn.node_def)
        for node in nodes:
            if node.op.startswith(OP_PREFIX):
                found[node.op] = found.get(node.op, 0) + 1
    return found


def write(module: tf.Module, signatures, path: str, version: Optional[int],
          extra_files: Optional[Dict[str, bytes]] = None) -> str:
    """Saves ``module`` with ``signatures`` (``{name: concrete function}``, or one
    concrete function: ``serving_default``) into the next version folder of ``path``,
    atomically (a temporary folder renamed into place, so TF Serving, which
    polls the base path, never loads a half-written version). ``extra_files``: {path in
    the version folder: bytes} written in before it is renamed into place."""
    target = version_dir(path, version)
    os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
    # TF Serving ignores folders whose names are not numbers.
    tmp = os.path.join(os.path.dirname(target), f".tmp-{os.path.basename(target)}-"
                                                f"{uuid.uuid4().hex[:8]}")
    try:
        if not isinstance(signatures, dict):
            signatures = {SERVING_DEFAULT: signatures}
        tf.saved_model.save(module, tmp, signatures=signatures)
        for name, data in (extra_files or {}).items():
            file = os.path.join(tmp, name)
            os.makedirs(os.path.dirname(file), exist_ok=True)
            with open(file, "wb") as f:
                f.write(data)
        leftover = tfpsx_ops(tmp)
        if leftover:
            raise RuntimeError(f"export_serving: the served graph still holds tfpsx ops "
                               f"{leftover}; a server without tfpsx could not run it (a "
                               "table the export did not replace?)")
        os.rename(tmp, target)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
    return target

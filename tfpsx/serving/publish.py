"""Publishing a training model for serving, a base then deltas, from the chief's saves.

``IncrementalCheckpoint(publisher=Publisher(directory))`` gives each save of the chief
to the :class:`Publisher`, which turns it into what a served model takes:

* a save whose tables are a full part becomes a **base**: an export
  (``export_serving``, stock TF only) in ``directory/<sequence>/``, TF Serving's
  version folder, written whole and renamed into place; its ``applied_sequence`` is
  ``sequence``;
* a delta part becomes a **delta**: ``directory/deltas/<sequence>/`` holding
  ``delta.index`` and ``delta.data-*`` (a stock TF bundle, written by ``SaveV2``; its
  tensors are named as the ``apply_delta`` inputs of :mod:`tfpsx.serving.delta`: per
  table the rows written since the last save with their absolute values, and the keys
  removed or evicted, from the part the save just wrote; every weight whole), then
  ``manifest.json`` (base, sequence, global step, the checkpoint it came from, rows),
  then ``DONE`` last: a delta without it is partial and never applied.

Sequence numbers count bases and deltas together, so that a follower
(``tfpsx/serving/follower.py``) applies ``n + 1`` after ``n``, whether a delta of its
base or a new base. A delta follows the save before it, so a delta is published only
when the one before it was: after a failed publish, a restarted chief, or a restore
(each makes the next save a full one) the next publish is a base. A publisher that
starts removes partial deltas and continues the sequence after the highest published.
The last ``keep_bases`` bases and their deltas are kept.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from typing import Dict, List, Optional

import numpy as np
import tensorflow as tf

from tfpsx.checkpoint import parts
from tfpsx.serving import delta
from tfpsx.serving.export import in_clean_thread

logger = logging.getLogger("tfpsx.serving")

DELTAS = "deltas"
BUNDLE = "delta"
MANIFEST = "manifest.json"
DONE = "DONE"
BASE_MANIFEST = os.path.join("assets.extra", "tfpsx_manifest.json")


def published(directory: str) -> Dict[str, List[int]]:
    """``{"bases": [...], "deltas": [...], "partial": [...]}``: the sequences published
    in ``directory`` (a base: a version folder with its ``saved_model.pb``; a delta: its
    folder with ``DONE``; partial: a delta folder without), sorted."""
    out = {"bases": [], "deltas": [], "partial": []}
    if not os.path.isdir(directory):
        return out
    for name in os.listdir(directory):
        if name.isdigit() and os.path.isfile(os.path.join(directory, name, "saved_model.pb")):
            out["bases"].append(int(name))
    folder = os.path.join(directory, DELTAS)
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        if name.isdigit():
            done = os.path.isfile(os.path.join(folder, name, DONE))
            out["deltas" if done else "partial"].append(int(name))
    return {k: sorted(v) for k, v in out.items()}


class Publisher:
    """Publishes the chief's saves into ``directory`` (see the module doc).

    Args:
      directory: the model base path a follower (or TF Serving, for the bases) reads.
      keep_bases: bases kept, with the deltas after each (older ones are deleted).
      inputs, outputs: the export's (``export_serving``'s): a subclassed Keras model's
        input specs; a graph's ``{name: placeholder}`` and ``{name: tensor}`` (required
        to publish a graph-mode job, ``IncrementalSaver(publisher=...)``).

    Raises:
      ValueError: ``directory`` is a file, or ``keep_bases`` < 1.
    """

    def __init__(self, directory: str, keep_bases: int = 2, inputs=None, outputs=None):
        self.directory = os.fspath(directory)
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise ValueError(f"Publisher: {self.directory!r} is a file; it must be a folder "
                             "(new, or one this job published into before)")
        if isinstance(keep_bases, bool) or not isinstance(keep_bases, int) or keep_bases < 1:
            raise ValueError(f"keep_bases must be an int >= 1 (bases kept with their deltas), "
                             f"got {keep_bases!r}")
        self.keep_bases, self.inputs, self.outputs = keep_bases, inputs, outputs
        self._graph_weights: Dict[str, str] = {}  # a graph base's: input -> variable
        self._started = False
        self._sequence = 0          # the last sequence published
        self._base: Optional[int] = None
        self._follows: Optional[str] = None  # the checkpoint part the last publish is of
        self.last: Dict[str, object] = {}

    def _start(self) -> None:
        """Continues the sequence after what ``directory`` holds; partial deltas (a chief
        killed while writing one) removed."""
        got = published(self.directory)
        for folder in (self.directory, os.path.join(self.directory, DELTAS)):
            for name in os.listdir(folder) if os.path.isdir(folder) else []:
                if name.startswith(".tmp-"):  # a base or a delta its writer left
                    shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
        for seq in got["partial"]:
            path = os.path.join(self.directory, DELTAS, str(seq))
            logger.warning("publish: removing the partial delta %s (no %s: its writer "
                           "stopped before it was complete)", path, DONE)
            shutil.rmtree(path, ignore_errors=True)
        self._sequence = max(got["bases"] + got["deltas"], default=0)
        self._started = True

    def publish(self, model, part: str, info: Dict[str, object], step: int,
                weights: Optional[Dict[int, np.ndarray]] = None) -> Dict[str, object]:
        """Publishes the save that wrote ``part`` (``ChainWriter.last`` as ``info``):
        a base when it is full or when its chain does not follow the last publish, else
        a delta. ``model``: the Keras model, or a graph-mode job's session. ``weights``
        (Keras): the saved weights by position in ``model.weights``; a graph's are read
        with the session.
        Returns what it wrote (kind, sequence, path, rows, removed, bytes, seconds)."""
        if not self._started:
            self._start()
        started = time.monotonic()
        chain = list(info["chain"])
        sequence = self._sequence + 1
        try:
            if info["kind"] == parts.FULL or self._base is None or len(chain) < 2 \
                    or chain[-2] != self._follows:
                out = self._base_of(model, part, step, sequence)
            else:
                out = self._delta_of(model, part, step, sequence, weights)
        except BaseException:
            self._follows = None  # the next publish is a base
            raise
        self._sequence, self._follows = sequence, os.path.basename(part)
        out["seconds"] = time.monotonic() - started
        self.last = out
        self._prune()
        logger.info("publish: %s %d (step %d) in %s, %.2f s", out["kind"], sequence, step,
                    out["path"], out["seconds"])
        return out

    def _manifest(self, kind: str, part: str, step: int, sequence: int, **more) -> dict:
        return dict({"kind": kind, "sequence": sequence, "base": self._base if kind ==
                     "delta" else sequence, "global_step": int(step),
                     "checkpoint": os.path.basename(part), "created": time.time()}, **more)

    def _base_of(self, model, part: str, step: int, sequence: int) -> Dict[str, object]:
        manifest = {BASE_MANIFEST: json.dumps(self._manifest("base", part, step, sequence),
                                              indent=1).encode()}
        if _is_session(model):
            from tfpsx.serving import graph as _graph

            if not self.inputs or not self.outputs:
                raise ValueError("Publisher of a graph-mode job: give inputs={name: "
                                 "placeholder} and outputs={name: tensor} (the inference "
                                 "to serve, as export_serving takes them)")
            path = _graph.export(model, self.directory, sequence, self.inputs, self.outputs,
                                 sequence, manifest)
            with open(os.path.join(path, _graph.WEIGHTS_FILE)) as f:
                self._graph_weights = json.load(f)
        else:
            from tfpsx.serving import keras as _keras

            path = _keras.export(model, self.directory, sequence, self.inputs, sequence,
                                 manifest, job_values=True)  # the checkpoint's, as deltas
        self._base = sequence
        return {"kind": "base", "sequence": sequence, "path": path,
                "bytes": _bytes(path)}

    def _delta_of(self, model, part: str, step: int, sequence: int,
                  weights: Optional[Dict[int, np.ndarray]]) -> Dict[str, object]:
        from tfpsx.serving import keras as _keras

        index = parts.read_index(part)
        tensors: Dict[str, np.ndarray] = {delta.SEQUENCE: np.int64(sequence)}
        rows = removed = 0
        for name, entry in index["tables"].items():
            stem = os.path.join(part, entry["file"])
            keys = np.load(f"{stem}.keys.npy", allow_pickle=False)
            tensors[delta.table_input(name, "keys")] = keys
            tensors[delta.table_input(name, "rows")] = np.load(f"{stem}.values.npy",
                                                               allow_pickle=False)
            gone = np.load(f"{stem}.removed.npy", allow_pickle=False)
            tensors[delta.table_input(name, "removed")] = gone
            rows, removed = rows + len(keys), removed + len(gone)
        if _is_session(model):
            from tfpsx.serving import graph as _graph

            values = _graph.read_variables(model, sorted(set(self._graph_weights.values())))
            wanted = sorted(self._graph_weights)
            for key in wanted:
                tensors[key] = np.asarray(values[self._graph_weights[key]])
        else:
            wanted = _keras.delta_weights(model)
            for key in wanted:
                tensors[key] = np.asarray(weights[int(key.rsplit("_", 1)[1])])
        folder = os.path.join(self.directory, DELTAS)
        os.makedirs(folder, exist_ok=True)
        final = os.path.join(folder, str(sequence))
        tmp = os.path.join(folder, f".tmp-{sequence}-{uuid.uuid4().hex[:8]}")
        try:
            os.makedirs(tmp)
            in_clean_thread(lambda: _save_bundle(os.path.join(tmp, BUNDLE), tensors))
            manifest = self._manifest("delta", part, step, sequence, rows=rows,
                                      removed=removed, weights=len(wanted))
            _write_synced(os.path.join(tmp, MANIFEST), json.dumps(manifest, indent=1).encode())
            os.rename(tmp, final)
        finally:
            if os.path.exists(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
        try:
            _write_synced(os.path.join(final, DONE), b"")  # last: the delta is complete
        except BaseException:
            shutil.rmtree(final, ignore_errors=True)
            raise
        return {"kind": "delta", "sequence": sequence, "path": final, "rows": rows,
                "removed": removed, "bytes": _bytes(final)}

    def _prune(self) -> None:
        """Keeps the last ``keep_bases`` bases and the deltas after the oldest kept."""
        got = published(self.directory)
        if len(got["bases"]) <= self.keep_bases:
            return
        oldest = got["bases"][-self.keep_bases]
        for seq in got["bases"][:-self.keep_bases]:
            shutil.rmtree(os.path.join(self.directory, str(seq)), ignore_errors=True)
        for seq in got["deltas"]:
            if seq < oldest:
                shutil.rmtree(os.path.join(self.directory, DELTAS, str(seq)),
                              ignore_errors=True)


def _is_session(model) -> bool:
    return not hasattr(model, "weights") and callable(getattr(model, "run", None))


def _save_bundle(prefix: str, tensors: Dict[str, np.ndarray]) -> None:
    """A stock TF bundle (``SaveV2``) of ``tensors``, by name."""
    names = sorted(tensors)
    with tf.device("/cpu:0"):
        tf.raw_ops.SaveV2(prefix=prefix, tensor_names=names, shape_and_slices=[""] * len(names),
                          tensors=[tf.constant(tensors[n]) for n in names])
    for file in os.listdir(os.path.dirname(prefix)):
        parts.fsync_path(os.path.join(os.path.dirname(prefix), file))


def _write_synced(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    parts.fsync_path(os.path.dirname(path))


def _bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f))
               for root, _, files in os.walk(path) for f in files)

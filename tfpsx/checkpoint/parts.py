"""The on-disk form of incremental table checkpoints: parts and chains.

A *part* is one save of every table: a directory ``<prefix>.tables`` beside the
checkpoint ``<prefix>`` (TF's ``model.ckpt-<step>``) holding, per table, one ``.npy`` file
per field (keys, values, slots, freq, step, and for a delta the removed keys) and an
``index.json`` naming the tables, the kind (``full`` or ``delta``), the step and the
*chain*: the parts, oldest first (a full one, then the deltas since), whose application
in order gives this moment's tables.

Writes are atomic: a part is written into a temporary directory, its files and the
directory synced, and renamed into place; the checkpoint that refers to it is only
recorded afterwards (by TF's ``checkpoint`` state file), so a crash during a save leaves
the previous checkpoint and its chain as they were. Parts are never modified once
written; the ones no kept checkpoint's chain names are deleted.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from typing import Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

import numpy as np

from tfpsx import errors

SUFFIX = ".tables"
INDEX = "index.json"
EXTRA = "extra.npz"
FORMAT = 1
FULL, DELTA = "full", "delta"
# Where TF's ``checkpoint`` state file is absent (Keras's IncrementalCheckpoint): the
# latest save and the kept ones, {"latest": name, "kept": [names]}.
STATE = "checkpoint.json"
FIELDS = ("keys", "values", "slots", "freq", "step")
DELTA_FIELDS = FIELDS + ("removed",)


def part_path(checkpoint_prefix: str) -> str:
    """Where the tables of checkpoint ``checkpoint_prefix`` go."""
    return checkpoint_prefix + SUFFIX


def fsync_path(path: str) -> None:
    """fsync a file or a folder (a rename's folder: the rename is then durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write(path: str, tables: Dict[str, Dict[str, np.ndarray]], kind: str, step: int,
          chain: List[str], name: Optional[str] = None,
          extra: Optional[Dict[str, np.ndarray]] = None) -> None:
    """Writes the part ``path`` atomically.

    Args:
      path: the part's directory (``part_path(prefix)``); must not exist yet.
      tables: table name -> field -> array (FIELDS, and "removed" for a delta), or the
        table's pages (a ``pages.Pages``: field dicts, each written as it comes, and a
        delta's ``removed``).
      kind: FULL or DELTA.
      step: the global step of the save.
      chain: the basenames of the parts before this one in its chain (empty for FULL).
      name: the part's name in its chain, if it is written elsewhere first and renamed
        (default: ``path``'s basename).
      extra: arrays by name kept with the part (``EXTRA``; the Keras callback's dense
        weights), read back by :func:`load_extra`.
    """
    if kind not in (FULL, DELTA):
        raise ValueError(f"part kind must be {FULL!r} or {DELTA!r}, got {kind!r}")
    if os.path.exists(path):
        raise FileExistsError(f"checkpoint part {path} exists already; parts are never "
                              "overwritten (was this step saved before?)")
    tmp = f"{path}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    index = {"format": FORMAT, "kind": kind, "step": int(step),
             "chain": list(chain) + [name or os.path.basename(path)], "tables": {}}
    for t, (name, fields) in enumerate(sorted(tables.items())):
        stem = f"t{t}"
        if not isinstance(fields, Mapping):  # pages; a delta's removed keys beside them
            rows = _write_pages(os.path.join(tmp, stem), fields)
            index["tables"][name] = {"file": stem, "rows": rows,
                                     "removed": len(fields.removed)}
            if kind == DELTA:
                _save(os.path.join(tmp, f"{stem}.removed.npy"), fields.removed)
            continue
        index["tables"][name] = {"file": stem, "rows": int(len(fields["keys"])),
                                 "removed": int(len(fields.get("removed", ())))}
        for field in (DELTA_FIELDS if kind == DELTA else FIELDS):
            _save(os.path.join(tmp, f"{stem}.{field}.npy"), fields[field])
    if extra is not None:
        index["extra"] = sorted(extra)
        with open(os.path.join(tmp, EXTRA), "wb") as f:
            np.savez(f, **extra)
            f.flush()
            os.fsync(f.fileno())
    with open(os.path.join(tmp, INDEX), "w") as f:
        json.dump(index, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(tmp)
    os.rename(tmp, path)
    fsync_path(os.path.dirname(os.path.abspath(path)))


def _save(file: str, array) -> None:
    with open(file, "wb") as f:
        np.save(f, np.ascontiguousarray(array), allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())


# A .npy file written page by page starts with a header of this many bytes, room for any
# row count, rewritten with the final shape at the end (format 1.0: magic, version, a
# 2-byte length, the header's text padded with spaces to a 64-byte boundary).
_STREAM_HEADER = 128


def _write_pages(stem: str, pages: Iterable[Mapping[str, np.ndarray]]) -> int:
    """Writes a table's pages as its FIELDS' .npy files (``stem.<field>.npy``), each
    page appended as it comes; returns the rows written."""
    files = {f: open(f"{stem}.{f}.npy", "wb") for f in FIELDS}
    shapes: Dict[str, Tuple[np.dtype, tuple]] = {}
    rows = 0
    try:
        for f in files.values():
            f.write(b"\0" * _STREAM_HEADER)
        for page in pages:
            for field, f in files.items():
                array = np.ascontiguousarray(page[field])
                kind = (array.dtype, array.shape[1:])
                if shapes.setdefault(field, kind) != kind:
                    raise ValueError(f"checkpoint pages of {field!r} differ: {kind} after "
                                     f"{shapes[field]}")
                f.write(array.tobytes())
            rows += len(page["keys"])
        for field, f in files.items():
            dtype, tail = shapes.get(field, (np.dtype(np.int64), ()))
            text = repr({"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
                         "shape": (rows,) + tuple(tail)}).encode("latin1")
            pad = _STREAM_HEADER - 10 - len(text) - 1
            f.seek(0)
            f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", _STREAM_HEADER - 10) + text +
                    b" " * pad + b"\n")
            f.flush()
            os.fsync(f.fileno())
    finally:
        for f in files.values():
            f.close()
    return rows


def read_index(path: str) -> dict:
    """The index of part ``path``.

    Raises:
      CheckpointError: no part there (or one that never finished: no index).
      ValueError: an index of another format.
    """
    file = os.path.join(path, INDEX)
    if not os.path.exists(file):
        raise errors.CheckpointError(f"no incremental checkpoint part at {path} (no {INDEX})")
    with open(file) as f:
        index = json.load(f)
    if index.get("format") != FORMAT:
        raise ValueError(f"checkpoint part {path}: format {index.get('format')!r}, expected "
                         f"{FORMAT}")
    return index


def chain(path: str) -> List[str]:
    """The parts to apply, oldest first, for the tables of part ``path`` (full paths).

    Raises:
      CheckpointError: naming the first part of the chain that is missing.
    """
    index = read_index(path)
    directory = os.path.dirname(os.path.abspath(path))
    parts = [os.path.join(directory, name) for name in index["chain"]]
    for p in parts:
        if not os.path.exists(os.path.join(p, INDEX)):
            raise errors.CheckpointError(
                f"incremental checkpoint {path} needs part {p}, which is missing: its chain "
                f"is {index['chain']}")
    return parts


def table_pages(path: str, index: dict, name: str,
                page_rows: Optional[int]) -> Iterator[Tuple[str, Dict[str, np.ndarray]]]:
    """One table's part in pages of ``page_rows`` rows (None: one page), read from the
    files as they are needed: ``(kind, fields)`` to apply in order. The first page is of
    the part's kind (a full one clears the table first; a delta's removals go with it);
    the rest are deltas of rows alone, so a restore never holds more than a page."""
    entry = index["tables"][name]
    stem = os.path.join(path, entry["file"])
    removed = (np.load(f"{stem}.removed.npy", allow_pickle=False) if index["kind"] == DELTA
               else np.zeros([0], np.int64))
    # Read page by page from the files (not mapped: mapped pages would count in the
    # process's resident memory until the whole part had been read).
    files = {f: open(f"{stem}.{f}.npy", "rb") for f in FIELDS}
    try:
        heads = {f: _npy_header(fh) for f, fh in files.items()}
        n = heads["keys"][0][0]
        step = max(1, page_rows or n)
        for start in range(0, max(n, 1), step):
            page = {}
            for f, fh in files.items():
                shape, dtype = heads[f]
                rows = min(step, n - start)
                per_row = int(np.prod(shape[1:], dtype=np.int64))
                page[f] = np.fromfile(fh, dtype, count=rows * per_row).reshape(
                    (rows,) + tuple(shape[1:]))
            first = start == 0
            page["removed"] = removed if first else removed[:0]
            yield (index["kind"] if first else DELTA), page
    finally:
        for fh in files.values():
            fh.close()


def _npy_header(f) -> Tuple[tuple, np.dtype]:
    """(shape, dtype) of the .npy file open at its start; leaves it at its data."""
    version = np.lib.format.read_magic(f)
    read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
            else np.lib.format.read_array_header_2_0)
    shape, fortran, dtype = read(f)
    if fortran:
        raise ValueError(f"checkpoint file {f.name}: Fortran order, expected C order")
    return shape, dtype


def load_extra(path: str) -> Dict[str, np.ndarray]:
    """The ``extra`` arrays of part ``path`` (empty when it has none)."""
    file = os.path.join(path, EXTRA)
    if not os.path.exists(file):
        return {}
    with np.load(file, allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


def referenced(parts: Iterable[str]) -> set:
    """The basenames of every part the chains of ``parts`` (paths) need."""
    needed = set()
    for p in parts:
        try:
            needed.update(read_index(p)["chain"])
        except (errors.CheckpointError, ValueError, OSError):
            continue
    return needed


def remove_unreferenced(directory: str, base: str, keep: Iterable[str]) -> List[str]:
    """Deletes the parts (and unfinished temporaries) of checkpoints named ``base``-* in
    ``directory`` that no part of ``keep`` (paths) needs; returns what went."""
    needed = referenced(keep)
    gone = []
    for entry in sorted(os.listdir(directory)):
        if not entry.startswith(base + "-"):
            continue
        finished = entry.endswith(SUFFIX)
        unfinished = SUFFIX + ".tmp-" in entry
        if (finished and entry not in needed) or unfinished:
            shutil.rmtree(os.path.join(directory, entry), ignore_errors=True)
            gone.append(entry)
    return gone


def latest_state(directory: str) -> Optional[dict]:
    """``checkpoint.json`` of ``directory`` ({"latest": name, "kept": [names]}), or None."""
    file = os.path.join(os.fspath(directory), STATE)
    if not os.path.exists(file):
        return None
    with open(file) as f:
        return json.load(f)

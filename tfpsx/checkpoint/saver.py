"""``IncrementalSaver``: a ``tf.compat.v1.train.Saver`` that saves tables incrementally.

Dense variables (and every other saveable but tfpsx tables) go into TF's own checkpoint
``<prefix>`` as with a plain ``Saver``. Tables go into ``<prefix>.tables`` (parts.py): a
full export every ``full_every`` saves and, in between, deltas — the rows written and the
keys removed since the previous save (``ShardedTable.checkpoint_export``), a few percent
of a large table. Restore applies the chain (full, then every delta in order) and is
bit-exact with a full save of the same moment.

It plugs in wherever a Saver does (``Scaffold(saver=...)``, so TF's
``CheckpointSaverHook`` saves through it and the chief's session creator restores
through it); ``tfpsx.MonitoredTrainingSession(incremental_checkpoints=M)`` sets it up.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from typing import Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from tfpsx import settings
from tfpsx.checkpoint import parts
from tfpsx.embedding.saveable import TableSaveable

logger = logging.getLogger("tfpsx")

_SAVEABLES = tf.compat.v1.GraphKeys.SAVEABLE_OBJECTS


def graph_tables(graph=None) -> list:
    """The tfpsx tables a default Saver of ``graph`` would save."""
    graph = graph or tf.compat.v1.get_default_graph()
    return [s.table for s in graph.get_collection(_SAVEABLES) if isinstance(s, TableSaveable)]


class _TableOps:
    """One table's export and restore ops in the saver's graph."""

    def __init__(self, table, full: tf.Tensor):
        self.table = table
        self.export = table.checkpoint_export(full)
        dim, slots = table.dim, table.num_slots
        ph = tf.compat.v1.placeholder
        self.feeds = {"keys": ph(tf.int64, [None]), "values": ph(tf.float32, [None, dim]),
                      "slots": ph(tf.float32, [None, slots, dim]), "freq": ph(tf.int64, [None]),
                      "step": ph(tf.int64, [None]), "removed": ph(tf.int64, [None])}
        self.apply = {parts.FULL: table.apply_checkpoint(self.feeds, full=True),
                      parts.DELTA: table.apply_checkpoint(self.feeds, full=False)}

    def check(self, name: str, data: Dict[str, np.ndarray], part: str) -> None:
        """Refuses a part's rows that do not fit this table (before any table changes)."""
        want = {"values": (self.table.dim,), "slots": (self.table.num_slots, self.table.dim)}
        for field, tail in want.items():
            shape = tuple(data[field].shape[1:])
            if len(data[field]) and shape != tail:
                raise ValueError(
                    f"incremental checkpoint part {part}: table {name!r} has {field} of shape "
                    f"{list(data[field].shape)}, this table expects [n, "
                    f"{', '.join(map(str, tail))}] (dim={self.table.dim}, "
                    f"num_slots={self.table.num_slots}); was it saved from another model?")


class IncrementalSaver(tf.compat.v1.train.Saver):
    """A ``Saver`` whose tables are saved as a full export every ``full_every`` saves and
    as deltas in between.

    Args:
      full_every: saves per full table export (1: every save is full).
      tables: the tables to save (default: every tfpsx table of the graph).
      var_list: what TF's checkpoint holds (default: what a default Saver saves, minus
        the tables).
      **kwargs: ``tf.compat.v1.train.Saver``'s other arguments (``max_to_keep``...).

    Build it after the model (its export and restore ops are added to the graph).
    """

    def __init__(self, full_every: int = 10, tables: Optional[Sequence] = None,
                 var_list=None, **kwargs):
        self.full_every = settings.parse_int(full_every, "IncrementalSaver(full_every=...)",
                                             minimum=1)
        graph = tf.compat.v1.get_default_graph()
        tables = list(graph_tables(graph) if tables is None else tables)
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"IncrementalSaver: table names must be unique, got {names}")
        if var_list is None:
            var_list = (tf.compat.v1.global_variables() +
                        [s for s in graph.get_collection(_SAVEABLES)
                         if not isinstance(s, TableSaveable)])
        super().__init__(var_list=var_list, **kwargs)
        self._full_flag = tf.compat.v1.placeholder_with_default(False, [], name="tfpsx_full")
        self._tables = {t.name: _TableOps(t, self._full_flag) for t in tables}
        # Checkpoints written by a plain Saver hold the tables as TableSaveables: restore
        # reads those when a checkpoint has no ``.tables`` part.
        self._plain = (tf.compat.v1.train.Saver(var_list=[t.saveable() for t in tables],
                                                sharded=False)
                       if tables else None)
        self._chain: Optional[List[str]] = None  # None: the next save is full
        self._deltas = 0
        self.last_save: Dict[str, object] = {}

    # ------------------------------------------------------------------ save
    def save(self, sess, save_path, global_step=None, *args, **kwargs):
        """Saves as ``Saver.save`` does; the tables first, into ``<prefix>.tables``."""
        if global_step is not None and not isinstance(global_step, (int, np.integer)):
            global_step = tf.compat.v1.train.global_step(sess, global_step)
        prefix = save_path if global_step is None else f"{save_path}-{int(global_step)}"
        part = parts.part_path(prefix)
        started = time.monotonic()
        # The same prefix again (a restarted chief saves the step it restored) is a new
        # full part in place of the old one, never a delta on top of itself.
        full = (self._chain is None or self._deltas + 1 >= self.full_every or
                os.path.exists(part))
        try:
            rows = self._export(sess, full)
            if not full and not all(bool(r["complete"]) for r in rows.values()):
                # A restarted server (or a clearing import) since the base: no delta.
                full = True
                rows = self._export(sess, True)
            kind = parts.FULL if full else parts.DELTA
            self._write(part, rows, kind, int(global_step or 0),
                        [] if full else list(self._chain))
            path = super().save(sess, save_path, global_step, *args, **kwargs)
        except BaseException:
            self._chain = None  # this save's marks were taken: the next one must be full
            raise
        name = os.path.basename(part)
        self._chain = [name] if full else self._chain + [name]
        self._deltas = 0 if full else self._deltas + 1
        self.last_save = {"kind": kind, "part": part, "chain": list(self._chain),
                          "rows": sum(len(r["keys"]) for r in rows.values()),
                          "removed": sum(len(r["removed"]) for r in rows.values()),
                          "seconds": time.monotonic() - started}
        logger.info("checkpoint %s: tables %s (%d rows, %d removed) in %.2f s", prefix, kind,
                    self.last_save["rows"], self.last_save["removed"],
                    self.last_save["seconds"])
        self._collect(save_path)
        return path

    def _export(self, sess, full: bool) -> Dict[str, Dict[str, np.ndarray]]:
        fetches = {name: ops.export for name, ops in self._tables.items()}
        return sess.run(fetches, feed_dict={self._full_flag: full}) if fetches else {}

    @staticmethod
    def _write(part, rows, kind, step, chain) -> None:
        if not os.path.exists(part):
            parts.write(part, rows, kind, step, chain)
            return
        fresh = f"{part}.new-{os.getpid()}"
        shutil.rmtree(fresh, ignore_errors=True)
        parts.write(fresh, rows, kind, step, chain, name=os.path.basename(part))
        old = f"{part}.old-{os.getpid()}"
        os.rename(part, old)
        os.rename(fresh, part)
        shutil.rmtree(old, ignore_errors=True)

    def _collect(self, save_path: str) -> None:
        """Deletes the parts no kept checkpoint needs (TF deleted their dense files)."""
        directory = os.path.dirname(os.path.abspath(save_path))
        keep = [parts.part_path(p) for p in self.last_checkpoints]
        parts.remove_unreferenced(directory, os.path.basename(save_path), keep)

    # ------------------------------------------------------------------ restore
    def restore(self, sess, save_path):
        """Restores as ``Saver.restore`` does, then the tables from the chain of
        ``<save_path>.tables`` (or, for a checkpoint without one, from TF's checkpoint).

        Raises:
          CheckpointError: a part of the chain is missing (naming it), before any table
            changes; ValueError: a part's rows do not fit a table.
        """
        part = parts.part_path(save_path)
        if self._tables and os.path.exists(part):
            plan = self._plan(part)  # every part read and checked before any change
            super().restore(sess, save_path)
            for path, index in plan:
                for name, ops in self._tables.items():
                    data = parts.load_table(path, index, name)
                    sess.run(ops.apply[index["kind"]],
                             feed_dict={ops.feeds[f]: data[f] for f in ops.feeds})
            logger.info("restored %s: tables from %d part(s) (%s)", save_path, len(plan),
                        ", ".join(os.path.basename(p) for p, _ in plan))
        else:
            super().restore(sess, save_path)
            if self._plain is not None:
                self._plain.restore(sess, save_path)
        self._chain = None  # the tables were replaced: the next save is a full one

    def _plan(self, part: str):
        plan = []
        for path in parts.chain(part):
            index = parts.read_index(path)
            missing = sorted(set(self._tables) - set(index["tables"]))
            if missing:
                raise ValueError(f"incremental checkpoint part {path} has no table(s) {missing}; "
                                 f"it holds {sorted(index['tables'])}")
            for name, ops in self._tables.items():
                entry = index["tables"][name]
                header = {f: np.load(os.path.join(path, f"{entry['file']}.{f}.npy"),
                                     mmap_mode="r", allow_pickle=False)
                          for f in ("values", "slots")}
                ops.check(name, header, path)
            plan.append((path, index))
        return plan

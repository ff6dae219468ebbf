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
from typing import Dict, Optional, Sequence

import numpy as np
import tensorflow as tf

from tfpsx.checkpoint import pages, parts
from tfpsx.checkpoint.chain import ChainWriter, check_publisher, plan, publish_save
from tfpsx.embedding.saveable import TableSaveable

logger = logging.getLogger("tfpsx")

_SAVEABLES = tf.compat.v1.GraphKeys.SAVEABLE_OBJECTS


def graph_tables(graph=None) -> list:
    """The tfpsx tables a default Saver of ``graph`` would save."""
    graph = graph or tf.compat.v1.get_default_graph()
    return [s.table for s in graph.get_collection(_SAVEABLES) if isinstance(s, TableSaveable)]


def refused_saveables(graph=None) -> list:
    """The tables of ``graph`` a default Saver would refuse to take whole (a disk tier,
    built outside ``tfpsx.embedding.whole_table_saves()``): their names."""
    graph = graph or tf.compat.v1.get_default_graph()
    return [s.table.name for s in graph.get_collection(_SAVEABLES)
            if isinstance(s, TableSaveable) and s.refused]


class _TableOps:
    """One table's export and restore ops in the saver's graph."""

    def __init__(self, table, full: tf.Tensor):
        self.table = table
        self.shape = (table.dim, table.num_slots)
        # A table with a disk tier saves in pages (pages.py): full parts and deltas.
        self.paged = table.paged
        if not self.paged:
            self.export = table.checkpoint_export(full)
        else:
            self.bounds = table.page_bounds(True)
            self.delta = table.delta_begin()
            self.lo = tf.compat.v1.placeholder(tf.int64, [])
            self.hi = tf.compat.v1.placeholder(tf.int64, [])
            self.page = {delta: [table.export_range(i, self.lo, self.hi, delta=delta)
                                 for i in range(table.num_shards)]
                         for delta in (False, True)}
        dim, slots = self.shape
        ph = tf.compat.v1.placeholder
        self.feeds = {"keys": ph(tf.int64, [None]), "values": ph(tf.float32, [None, dim]),
                      "slots": ph(tf.float32, [None, slots, dim]), "freq": ph(tf.int64, [None]),
                      "step": ph(tf.int64, [None]), "removed": ph(tf.int64, [None])}
        self.apply = {parts.FULL: table.apply_checkpoint(self.feeds, full=True),
                      parts.DELTA: table.apply_checkpoint(self.feeds, full=False)}

    def paged_rows(self, sess, begun, full: bool) -> pages.Pages:
        """This table's part in pages, from what its begin op returned (run)."""
        page = self.page[not full]
        return pages.Pages.begun(begun, lambda i, lo, hi: sess.run(
            page[i], feed_dict={self.lo: lo, self.hi: hi}))


class IncrementalSaver(tf.compat.v1.train.Saver):
    """A ``Saver`` whose tables are saved as a full export every ``full_every`` saves and
    as deltas in between.

    Args:
      full_every: saves per full table export (1: every save is full).
      tables: the tables to save (default: every tfpsx table of the graph).
      var_list: what TF's checkpoint holds (default: what a default Saver saves, minus
        the tables).
      publisher: what publishes each save for serving (a ``tfpsx.serving.Publisher``
        given the inference's ``inputs`` and ``outputs``: a full save as a base, an
        export that stock TF loads, a delta save as a delta of the rows it holds, with
        the inference's variables read with the session); None: nothing published.
      **kwargs: ``tf.compat.v1.train.Saver``'s other arguments (``max_to_keep``...).

    Build it after the model (its export and restore ops are added to the graph).
    """

    def __init__(self, full_every: int = 10, tables: Optional[Sequence] = None,
                 var_list=None, publisher=None, **kwargs):
        check_publisher(publisher, "IncrementalSaver")
        self._publisher = publisher
        self._writer = ChainWriter(full_every, "IncrementalSaver")
        self.full_every = self._writer.full_every
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

    @property
    def last_save(self) -> Dict[str, object]:
        """What the last save wrote: kind, part, chain, rows, removed, pages (the parts of
        tables with a disk tier, read page by page), seconds."""
        return self._writer.last

    # ------------------------------------------------------------------ save
    def save(self, sess, save_path, global_step=None, *args, **kwargs):
        """Saves as ``Saver.save`` does; the tables first, into ``<prefix>.tables``."""
        if global_step is not None and not isinstance(global_step, (int, np.integer)):
            global_step = tf.compat.v1.train.global_step(sess, global_step)
        prefix = save_path if global_step is None else f"{save_path}-{int(global_step)}"

        def export(full: bool):
            paged = {n: ops for n, ops in self._tables.items() if ops.paged}
            fetches = ({n: ops.export for n, ops in self._tables.items() if n not in paged},
                       {n: ops.bounds if full else ops.delta for n, ops in paged.items()})
            rows, begun = sess.run(fetches, feed_dict={self._full_flag: full})
            for name, ops in paged.items():
                rows[name] = ops.paged_rows(sess, begun[name], full)
            return rows

        info = self._writer.save(parts.part_path(prefix), export, int(global_step or 0))
        try:
            path = super().save(sess, save_path, global_step, *args, **kwargs)
        except BaseException:
            self._writer.reset()  # the part's checkpoint was never recorded
            raise
        logger.info("checkpoint %s: tables %s (%d rows, %d removed) in %.2f s", prefix,
                    info["kind"], info["rows"], info["removed"], info["seconds"])
        if self._max_to_keep:  # else TF keeps every checkpoint: so do we
            directory = os.path.dirname(os.path.abspath(save_path))
            parts.remove_unreferenced(directory, os.path.basename(save_path),
                                      [parts.part_path(p) for p in self.last_checkpoints])
        if self._publisher is not None:
            publish_save(self._writer, self._publisher, sess, parts.part_path(prefix),
                         int(global_step or 0))
        return path

    # ------------------------------------------------------------------ restore
    def restore(self, sess, save_path):
        """Restores the tables from the chain of ``<save_path>.tables`` (or, for a
        checkpoint without one, from TF's checkpoint), then as ``Saver.restore`` does.

        The tables first: the other workers of a job wait for the chief's variables (a
        MonitoredTrainingSession's readiness), so none trains before every table holds
        the checkpoint's rows (measured before this order: a worker trained on tables
        still being imported, and two jobs resumed from one checkpoint ended apart).

        Raises:
          CheckpointError: a part of the chain is missing (naming it), before any table
            changes; ValueError: a part's rows do not fit a table.
        """
        part = parts.part_path(save_path)
        if self._tables and os.path.exists(part):
            steps = plan(part, {n: ops.shape for n, ops in self._tables.items()})
            for path, index in steps:
                for name, ops in self._tables.items():
                    for kind, data in parts.table_pages(path, index, name,
                                                        ops.table.page_rows):
                        sess.run(ops.apply[kind],
                                 feed_dict={ops.feeds[f]: data[f] for f in ops.feeds})
            super().restore(sess, save_path)
            logger.info("restored %s: tables from %d part(s) (%s)", save_path, len(steps),
                        ", ".join(os.path.basename(p) for p, _ in steps))
        else:
            if self._plain is not None:
                self._plain.restore(sess, save_path)
            super().restore(sess, save_path)
        self._writer.reset()  # the tables were replaced: the next save is a full one

"""Checkpoint glue for tables: the shard-free saved form.

A table saves all its rows (keys, values, optimizer slots, frequency, last-update step)
merged over its shards, so it restores bit-exactly into any shard count. TF2
checkpoints use the table's Trackable methods (``tf.train.Checkpoint(table=emb)``);
TF1's ``Saver`` uses :class:`TableSaveable`, which a table adds to its graph's
``SAVEABLE_OBJECTS`` collection (as TF's own ``MutableHashTable`` does). Both restore
through ``import_rows``: a checkpoint whose rows do not fit the table (another dim or
slot count) is refused before any shard changes.

These savers take a table whole: its rows in the saving process's RAM, several times
the table's size. For a table with a disk tier (larger than its server's RAM) that is an
out-of-memory kill, not a save: they refuse it (:func:`refuse_whole_save`), naming the
savers that read it in pages (``tfpsx.keras.IncrementalCheckpoint``,
``tfpsx.checkpoint.IncrementalSaver``, ``MonitoredTrainingSession(
incremental_checkpoints=M)``), unless the user says the table fits
(:func:`whole_table_saves`).
"""

from __future__ import annotations

import contextlib
import threading

import tensorflow as tf

from tfpsx import compat

from tfpsx.embedding.sharding import EXPORT_FIELDS

_whole = threading.local()


@contextlib.contextmanager
def whole_table_saves():
    """Within it (this thread), TF's and Keras's own savers take a table with a disk tier
    whole, as they take a table in RAM: for one that fits in the saving process's RAM
    several times over. ``model.save`` and ``tf.train.Checkpoint`` called within it; a
    TF1 ``Saver`` (``MonitoredTrainingSession(checkpoint_dir=...)``'s too) of a graph
    whose tables were built within it.

    Example:
      >>> with tfpsx.embedding.whole_table_saves():
      ...     model.save("model.keras")
    """
    depth = getattr(_whole, "depth", 0)
    _whole.depth = depth + 1
    try:
        yield
    finally:
        _whole.depth = depth


def whole_saves_allowed() -> bool:
    """Inside :func:`whole_table_saves` (this thread)."""
    return getattr(_whole, "depth", 0) > 0


def whole_save_error(table, saver: str) -> str:
    """Why ``saver`` refuses ``table`` (a table with a disk tier), and what to do."""
    return (f"{saver} would take table {table.name!r} whole, but it has a disk tier "
            "(TieredBackend): its rows, most of them on disk, would all be held in RAM at "
            "once, several times the table's size (a table larger than RAM: an "
            "out-of-memory kill). Save it with tfpsx.keras.IncrementalCheckpoint (Keras), "
            "tfpsx.checkpoint.IncrementalSaver or MonitoredTrainingSession("
            "incremental_checkpoints=M) (graph mode), which read it page by page; or, for a "
            "table that fits in RAM, save within tfpsx.embedding.whole_table_saves()")


def refuse_whole_save(table, saver: str) -> None:
    """Raises ValueError (:func:`whole_save_error`) when ``saver`` would take ``table``
    whole and it has a disk tier, outside :func:`whole_table_saves`; before anything is
    read or written."""
    if getattr(table, "paged", False) and not whole_saves_allowed():
        raise ValueError(whole_save_error(table, saver))


class TableSaveable(compat.SaveableObject):
    """Saver glue: exports all shards on save; re-shards into the current table on restore.
    Tensors are named ``<table>-keys``, ``-values``, ``-slots``, ``-freq``, ``-step``."""

    def __init__(self, table):
        self.table = table
        # Built with the table's first op of a graph (its SAVEABLE_OBJECTS entry, which
        # every Saver of the graph takes, MonitoredTrainingSession's default one too, that
        # may only restore): the save, when it runs, fails naming why, unless the graph
        # was built within whole_table_saves().
        self.refused = getattr(table, "paged", False) and not whole_saves_allowed()
        if self.refused:
            check = tf.debugging.Assert(
                tf.constant(False), [whole_save_error(table, "a tf.compat.v1.train.Saver")],
                name=f"{table.name}_refuses_whole_save")
            with tf.control_dependencies([check]):
                rows = table.export()
        else:
            rows = table.export()
        specs = [compat.SaveSpec(rows[k], "", f"{table.name}-{k}")
                 for k in EXPORT_FIELDS]
        super().__init__(rows["keys"], specs, table.name)

    def restore(self, restored_tensors, restored_shapes):
        return self.table.import_rows(dict(zip(EXPORT_FIELDS, restored_tensors)), clear=True)

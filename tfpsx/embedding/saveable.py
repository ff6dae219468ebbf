"""Checkpoint glue for tables: the shard-free saved form.

A table saves all its rows (keys, values, optimizer slots, frequency, last-update step)
merged over its shards, so it restores bit-exactly into any shard count. TF2
checkpoints use the table's Trackable methods (``tf.train.Checkpoint(table=emb)``);
TF1's ``Saver`` uses :class:`TableSaveable`, which a table adds to its graph's
``SAVEABLE_OBJECTS`` collection (as TF's own ``MutableHashTable`` does). Both restore
through ``import_rows``: a checkpoint whose rows do not fit the table (another dim or
slot count) is refused before any shard changes.
"""

from __future__ import annotations

from tfpsx import compat

from tfpsx.embedding.sharding import EXPORT_FIELDS


class TableSaveable(compat.SaveableObject):
    """Saver glue: exports all shards on save; re-shards into the current table on restore.
    Tensors are named ``<table>-keys``, ``-values``, ``-slots``, ``-freq``, ``-step``."""

    def __init__(self, table):
        self.table = table
        rows = table.export()
        specs = [compat.SaveSpec(rows[k], "", f"{table.name}-{k}")
                 for k in EXPORT_FIELDS]
        super().__init__(rows["keys"], specs, table.name)

    def restore(self, restored_tensors, restored_shapes):
        return self.table.import_rows(dict(zip(EXPORT_FIELDS, restored_tensors)), clear=True)

"""Dynamic embedding tables that live on the parameter servers and grow with new ids.

Layers, each using only the ones listed before it:

* :mod:`~tfpsx.embedding.initializers`, :mod:`~tfpsx.embedding.optimizers`: a new key's
  row, and the server-side optimizers (specs; the math is the C++ core's);
* :mod:`~tfpsx.embedding.storage`: one shard behind the ``TableStorage`` interface,
  created by a ``Backend`` (today the C++ hash table; a cache or GPU store plug in here);
* :mod:`~tfpsx.embedding.checks`: every write's input checked whole before any shard
  changes (names the table, the field, what it got and what was expected);
* :mod:`~tfpsx.embedding.sharding`: ``ShardedTable``, keys partitioned over the shards,
  every operation written once; mode-free;
* :mod:`~tfpsx.embedding.updaters`: the seam where a training mode decides where a
  table's lookups read and its gradients go;
* :mod:`~tfpsx.embedding.cache`: a table's worker cache (options and eviction policies,
  the admission sketch, the sync schedule);
* :mod:`~tfpsx.embedding.table`: ``DynamicTable``, the user's table (training via its
  updater, checkpoints via :mod:`~tfpsx.embedding.saveable`).
"""

from tfpsx.embedding.cache import LFU, LRU, EvictionPolicy
from tfpsx.embedding.initializers import Initializer, constant, normal, uniform, zeros
from tfpsx.embedding.optimizers import OPTIMIZERS, SGD, Adagrad, Adam, Ftrl, SparseOptimizer
from tfpsx.embedding.sharding import EmbeddingLookup, ShardedTable
from tfpsx.embedding.storage import (HASH_TABLE, Backend, HashTableBackend, ShardSpec,
                                     TableStorage, TieredBackend)
from tfpsx.embedding.saveable import whole_table_saves
from tfpsx.embedding.table import DynamicTable
from tfpsx.embedding.updaters import TableUpdater, updater_scope

__all__ = [
    "DynamicTable", "EmbeddingLookup", "ShardedTable", "Initializer", "zeros", "constant",
    "uniform", "normal", "SparseOptimizer", "SGD", "Adagrad", "Adam", "Ftrl", "OPTIMIZERS",
    "TableStorage", "Backend", "HashTableBackend", "HASH_TABLE", "TieredBackend", "ShardSpec", "TableUpdater",
    "updater_scope", "EvictionPolicy", "LFU", "LRU", "whole_table_saves",
]


def __getattr__(name):
    # The table's former name: it was the Keras layer's name too
    # (tfpsx.keras.DynamicEmbedding), so a traceback could not tell them apart.
    if name == "DynamicEmbedding":
        import warnings

        warnings.warn("tfpsx.embedding.DynamicEmbedding is now tfpsx.embedding.DynamicTable "
                      "(tfpsx.keras.DynamicEmbedding is the Keras layer)", DeprecationWarning,
                      stacklevel=2)
        return DynamicTable
    raise AttributeError(f"module 'tfpsx.embedding' has no attribute {name!r}")

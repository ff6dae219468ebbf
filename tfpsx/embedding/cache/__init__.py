"""The worker cache of a table (``DynamicTable(..., cache_size=N)``): the hot rows on
the worker, the rest on the PS.

* :mod:`~tfpsx.embedding.cache.worker_cache`: :class:`WorkerCache`, lookups, local
  training, eviction and the GEO-rule sync with the PS;
* :mod:`~tfpsx.embedding.cache.options`: :class:`CacheOptions` and the eviction policies
  :class:`LFU` and :class:`LRU`;
* :mod:`~tfpsx.embedding.cache.admission`: :class:`AdmissionSketch`, the count-min
  sketch that admits a missed row at its K-th recent sighting;
* :mod:`~tfpsx.embedding.cache.sync`: when caches sync outside a step (the flush
  schedule; the eager caches Keras ``fit`` flushes).
"""

from tfpsx.embedding.cache.admission import AdmissionSketch
from tfpsx.embedding.cache.options import (LFU, LRU, POLICIES, CacheOptions, EvictionPolicy,
                                           eviction_policy)
from tfpsx.embedding.cache.sync import (FlushSchedule, eager_caches, flush_due_eager_caches,
                                        flush_eager_caches, report)
from tfpsx.embedding.cache.worker_cache import COUNTER_FIELDS, WorkerCache

__all__ = ["WorkerCache", "CacheOptions", "EvictionPolicy", "LFU", "LRU", "POLICIES",
           "eviction_policy", "AdmissionSketch", "FlushSchedule", "eager_caches",
           "flush_eager_caches", "flush_due_eager_caches", "report", "COUNTER_FIELDS"]

"""Worker caches fed by ``fit``'s input pipeline: a cached training step runs no PS op.

Without it a step of a table with a worker cache (``DynamicEmbedding(cache_size=N)``)
fetches its misses from the parameter servers and pushes its evictions' deltas inside
the step: every step waits for the PS. With it, ``fit``'s dataset (which Keras hands to
the strategy's ``experimental_distribute_dataset``) passes each batch through a staging
step before the train step takes it:

* the batch's ids, as each cached layer will look them up (the model called with its
  layers' rows read from a recorder, :func:`tfpsx.keras.row_sources.reading_rows_from`:
  only the id handling runs), are staged: the rows the cache lacks are fetched from the
  PS and cached (:meth:`~tfpsx.embedding.cache.WorkerCache.stage`);
* a cache over its size evicts, its victims' deltas pushed, never a row of a batch
  staged and not trained yet (the last ``2 * steps_per_execution + 3`` batches: the one
  in the step, the one the pipeline holds ready, the one being staged, with room);
* an async / staleness table's cache syncs with the PS every ``flush_steps`` batches
  in the feeder's flusher thread, beside the stagings and steps (GEO's communicator
  syncs GEO's).

The staging runs for tf.data's thread (a ``tf.py_function`` waiting on the feeder's
daemon thread, then a one-batch prefetch),
so the PS round trips overlap the training step instead of lengthening it. The train
step reads the cache only (:attr:`WorkerCache.fed`); an id it does not find fails the
step with an error naming the table.

Caches that admit a row at its K-th sighting (``cache_admit_after`` > 1) stay unfed
(a row not admitted trains on the PS from the step).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Dict, List, Optional

import keras
import tensorflow as tf

from tfpsx import compat, errors, settings
from tfpsx.embedding import DynamicTable
from tfpsx.embedding.cache.staging import Stager
from tfpsx.keras.row_sources import reading_rows_from

logger = logging.getLogger("tfpsx")


def fed_layers(model) -> Dict[object, list]:
    """The model's ``DynamicEmbedding`` layers (those over a ``DynamicTable``) whose worker cache can be fed, by cache."""
    out: Dict[object, list] = {}
    for layer in compat.flatten_layers(model, include_self=False):
        table = getattr(layer, "table", None)
        cache = table.cache if isinstance(table, DynamicTable) else None
        if cache is not None and cache.options.admit_after == 1:
            out.setdefault(cache, []).append(layer)
    return out


def features(element):
    """The ``x`` of a batch (Keras's ``(x, y, sample_weight)`` unpacking)."""
    return keras.utils.unpack_x_y_sample_weight(element)[0]


def each_batch(dataset: tf.data.Dataset, fn, name: str) -> tf.data.Dataset:
    """``dataset`` whose batches pass ``fn(element)`` (a Python call, in tf.data's
    thread, through a ``py_function`` named ``name``) before they are taken, in order."""
    spec = dataset.element_spec

    def call(*flat):
        fn(tf.nest.pack_sequence_as(spec, list(flat), expand_composites=True))
        return True

    def mapped(*args):
        element = args if isinstance(spec, tuple) else args[0]
        flat = tf.nest.flatten(element, expand_composites=True)
        done = tf.py_function(call, flat, Tout=tf.bool, name=name)
        with tf.control_dependencies([done]):
            flat = [tf.identity(t) for t in flat]
        return tf.nest.pack_sequence_as(element, flat, expand_composites=True)

    return dataset.map(mapped)


def _function(build_op, *signature):
    """A ``tf.function`` of ``signature`` (traced once) running the op ``build_op(*args)``
    builds (a tf.function runs every stateful op it traced)."""
    def run(*args):
        build_op(*args)
    return tf.function(run, autograph=False, input_signature=signature)


class RowFeeder(Stager):
    """Stages a ``fit``'s batches into the worker caches (see the module doc). One per
    strategy; :meth:`wrap` takes the datasets, :meth:`begin` / :meth:`end` bracket a
    ``fit``."""

    def __init__(self):
        super().__init__()
        self._active = False
        self._spec = None            # the features' spec of the last wrapped dataset
        self._layers: Dict[object, list] = {}
        self._stage_fn = None
        self._evict_fns: Dict[object, object] = {}
        self._flush_fns: Dict[object, object] = {}
        self._failure = None           # a staging's TF error, for the step to name
        self._queue: Optional[queue.Queue] = None

    # ------------------------------------------------------------------ the pipeline
    def wrap(self, dataset: tf.data.Dataset) -> tf.data.Dataset:
        """``dataset`` with each batch staged before it is taken (while a ``fit`` is
        active; otherwise batches pass unchanged)."""
        self._spec = features(dataset.element_spec)
        return each_batch(dataset, self.stage, "tfpsx_stage_rows").prefetch(1)

    def stage(self, element) -> None:
        """Stages one batch (tf.data's thread calls it, through the ``py_function``).

        The staging itself runs in a daemon thread of the feeder's; this waits for it,
        and stops waiting when the ``fit`` ends (a staging stuck on a lost server must
        not hold tf.data's thread: the process could not exit) or after
        TFPSX_RPC_TIMEOUT."""
        if not self._active:
            return
        done, box = threading.Event(), {}
        self._worker().put((element, done, box))
        bound = settings.get("TFPSX_RPC_TIMEOUT")
        deadline = time.monotonic() + bound
        while not done.wait(0.05):
            if not self._active:
                return  # (the fit ended: nobody takes this batch)
            if time.monotonic() > deadline:
                raise errors.ClusterTimeoutError(
                    f"fit(): staging a batch's rows into the worker caches took more than "
                    f"TFPSX_RPC_TIMEOUT={bound:g} s (a parameter server does not answer)")
        if "error" in box:
            raise box["error"]

    def _worker(self) -> queue.Queue:
        """The queue of the daemon thread that stages (started on first use)."""
        if self._queue is None:
            self._queue = queue.Queue()
            threading.Thread(target=self._serve, args=(self._queue,), daemon=True,
                             name="tfpsx-row-feeder").start()
        return self._queue

    def _serve(self, jobs: queue.Queue) -> None:
        while True:
            element, done, box = jobs.get()
            try:
                with self._lock:
                    if self._active:
                        self._stage(element)
            except tf.errors.OpError as e:
                self._failure = e  # the step that wanted this batch fails with it
                box["error"] = e
            except Exception as e:  # noqa: BLE001 — reported by the waiting py_function
                box["error"] = e
            finally:
                done.set()

    def take_failure(self):
        """The TF error of a failed staging (a PS lost), once; else None."""
        failure, self._failure = self._failure, None
        return failure

    def _stage(self, element) -> None:
        got = self._stage_fn(features(element))
        self.staged([k for k, _ in got], [n for _, n in got])

    def _evict(self, cache, keep) -> None:
        self._evict_fns[cache](keep)

    def _flush(self, cache) -> None:
        self._flush_fns[cache]()

    # ------------------------------------------------------------------ a fit
    def begin(self, model) -> bool:
        """A ``fit`` of ``model`` starts: its cached layers' caches are fed when the
        dataset was wrapped. Returns whether any is."""
        with self._lock:
            self._layers = fed_layers(model) if self._spec is not None else {}
            if not self._layers:
                return False
            per_call = int(getattr(model, "steps_per_execution", 1) or 1)
            self._start(list(self._layers), depth=2 * per_call + 3)
            for cache in self._caches:
                cache.fed = True
                if cache not in self._evict_fns:
                    self._evict_fns[cache] = _function(cache.evict_except,
                                                      tf.TensorSpec([None], tf.int64))
                    self._flush_fns[cache] = _function(cache.flush)
            self._stage_fn = self._build_stage(model)
            self.open_flushes()
            self._active = True
            return True

    def end(self, wait: bool = True) -> None:
        """The ``fit`` ended: stagings stop. With ``wait``, one in progress finishes
        first (at most TFPSX_RPC_TIMEOUT: the caches' final flush must not run beside
        its eviction); a failed ``fit`` does not wait (a staging may be stuck on the
        server that failed it)."""
        self._active = False  # (read by the next staging)
        for cache in self._caches:
            cache.fed = False
        if not wait:
            self.finish_flushes(0, raise_error=False)
            return
        bound = settings.get("TFPSX_RPC_TIMEOUT")
        if not self._lock.acquire(timeout=bound):
            self.finish_flushes(0, raise_error=False)
            raise errors.ClusterTimeoutError(
                f"fit(): the worker caches' staging of a batch did not finish within "
                f"TFPSX_RPC_TIMEOUT={bound:g} s after fit ended (a parameter server does "
                "not answer)")
        self._lock.release()
        if not self.finish_flushes(bound):
            raise errors.ClusterTimeoutError(
                f"fit(): a worker cache's sync did not finish within TFPSX_RPC_TIMEOUT="
                f"{bound:g} s after fit ended (a parameter server does not answer)")

    def _build_stage(self, model):
        caches = list(self._layers.items())
        layers = [layer for _, group in caches for layer in group]
        ids_of = id_function(model, layers)

        def stage(x):
            seen = ids_of(x)
            out = []
            for cache, group in caches:
                ids = [i for layer in group for i in seen.get(layer, [])]
                step = tf.reduce_max(tf.stack([tf.convert_to_tensor(layer._step.value)
                                               for layer in group]))
                out.append(cache.stage(tf.concat(ids, 0) if ids else
                                       tf.zeros([0], tf.int64), step))
            return out

        fn = tf.function(stage, autograph=False,
                         input_signature=[self._spec] if self._spec is not None else None)
        # Traced here, in fit's thread (tf.data's thread would trace the model beside
        # Keras tracing its train step).
        fn.get_concrete_function()
        return fn


def id_function(model, layers, sub_model_only: bool = False):
    """``ids_of(x)``: the flat ids each of ``layers`` looks up for the features ``x``
    (a dict by layer, a list of id vectors each).

    A functional model: the sub-model from its inputs to the layers' inputs, then each
    layer's id handling: only what the ids depend on runs. Otherwise (a subclassed
    model, a layer called twice): the whole model with the layers' rows read from a
    recorder (its dense weights read too, a PS round trip in async mode); with
    ``sub_model_only``, None then."""
    try:
        sub = keras.Model(model.input, [layer.input for layer in layers])
    except (AttributeError, ValueError, TypeError):
        sub = None
    if sub is None and sub_model_only:
        return None
    if sub is not None:
        def ids_of(x):
            inputs = sub(x, training=False)
            inputs = inputs if isinstance(inputs, (list, tuple)) else [inputs]
            return {layer: [layer._ids(i)[0]] for layer, i in zip(layers, inputs)}
        return ids_of

    def recorded(x):
        seen: Dict[object, List[tf.Tensor]] = {}

        def recorder(layer):
            def rows(ids):
                seen.setdefault(layer, []).append(ids)
                return tf.zeros([tf.size(ids), layer.dim])
            return rows

        with reading_rows_from({layer: recorder(layer) for layer in layers}):
            model(x, training=False)
        return seen
    return recorded


__all__ = ["RowFeeder", "each_batch", "fed_layers", "features", "id_function"]

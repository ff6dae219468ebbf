"""``IncrementalCheckpoint``: Keras's side of incremental checkpoints.

A callback for ``model.fit`` on the chief (or on one machine without a cluster): the
tables of the model's ``DynamicEmbedding`` layers are saved as a full export every
``full_every`` saves and as deltas in between (``tfpsx.checkpoint``'s parts and chains);
the model's weights (what ``save_weights`` holds) go whole into every part. The
directory's ``checkpoint.json`` names the latest save and the kept ones; it is replaced
atomically after the part is complete, so a crash during a save leaves the previous
checkpoint as it was. ``restore(model)`` before ``fit`` loads the latest one; on a cluster
call it on every worker: the chief alone restores, into new servers only, and its ``fit``
then publishes it, as after ``load_weights``; a worker started again in place, or a
chief whose servers ran on, trains on the model the servers hold. At the end of
``fit`` the chief marks training done (its last state saved first), so an evaluator task
(:func:`evaluate_checkpoints`) knows when the last checkpoint is in.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Callable, Dict, List, Optional

import keras
import numpy as np
import tensorflow as tf

from tfpsx import compat, settings
from tfpsx.checkpoint import evaluation, pages, parts
from tfpsx.checkpoint.chain import ChainWriter, check_publisher, plan, publish_save
from tfpsx.checkpoint.parts import STATE, latest_state
from tfpsx.control import splits
from tfpsx.keras.fit import flush_commits
from tfpsx.keras.layers import DynamicEmbedding
from tfpsx.keras.strategy import ParameterServerStrategy
from tfpsx.runtime import RUNTIME

logger = logging.getLogger("tfpsx")

BASE = "ckpt"
INPUT = "input:"  # an input's position among a part's extra arrays


def _tables(model) -> Dict[str, object]:
    layers = [layer for layer in compat.flatten_layers(model)
              if isinstance(layer, DynamicEmbedding)]
    unbuilt = [layer.name for layer in layers if layer.table is None]
    if unbuilt:
        raise ValueError(f"IncrementalCheckpoint: DynamicEmbedding layer(s) {unbuilt} are not "
                         "built yet; build the model (call it, or fit) first")
    return {layer.table.name: layer.table for layer in layers}


def _weights(model) -> Dict[str, object]:
    """The model's weights by position (as ``save_weights`` matches them: layer names of
    a rebuilt model differ, e.g. ``dense_1``)."""
    return {f"{i:04d}": v for i, v in enumerate(model.weights)}


class IncrementalCheckpoint(keras.callbacks.Callback):
    """Saves the model into ``directory`` at the end of every epoch (or every
    ``save_freq`` batches, or every ``save_seconds``), on the chief only; tables
    incrementally.

    Args:
      directory: where the parts and ``checkpoint.json`` go.
      full_every: saves per full table export (1: every save is full).
      save_freq: ``"epoch"``, or a number of batches.
      save_seconds: also save at the first batch end this long after the last save (an
        online job's freshness: a stream's epoch never ends); None: not by time.
      max_to_keep: checkpoints kept (their chains' parts too); older ones are deleted.
      publisher: what publishes each save for serving (a
        ``tfpsx.serving.Publisher("/models/ctr")``: a full save as a base, an export
        that stock TF loads, a delta save as a delta of the rows it holds, which
        ``tfpsx/serving/follower.py`` applies to a loaded base); None: nothing published.
    """

    def __init__(self, directory: str, full_every: int = 10, save_freq="epoch",
                 max_to_keep: int = 5, publisher=None, save_seconds: Optional[float] = None):
        super().__init__()
        if save_seconds is not None and (isinstance(save_seconds, bool) or not isinstance(
                save_seconds, (int, float)) or save_seconds <= 0):
            raise ValueError(f"IncrementalCheckpoint(save_seconds=...): expected seconds > 0 "
                             f"or None, got {save_seconds!r}")
        self.save_seconds = save_seconds
        self._saved_at = time.monotonic()
        check_publisher(publisher, "IncrementalCheckpoint")
        self._publisher = publisher
        if save_freq != "epoch":
            save_freq = settings.parse_int(save_freq, "IncrementalCheckpoint(save_freq=...) "
                                           "('epoch' or batches)", minimum=1)
        self.directory = os.fspath(directory)
        self.save_freq = save_freq
        self.max_to_keep = settings.parse_int(max_to_keep, "IncrementalCheckpoint("
                                              "max_to_keep=...)", minimum=1)
        self._writer = ChainWriter(full_every, "IncrementalCheckpoint")
        self._batches = 0
        self._saved_step: Optional[int] = None

    @staticmethod
    def _step(model) -> int:
        """The job's global step (a strategy's: the one on the servers, which the
        chief's copy lags by the others' steps since its own last)."""
        if model.optimizer is None:
            return 0
        strategy = getattr(model, "distribute_strategy", None)
        iterations = model.optimizer.iterations
        if isinstance(strategy, ParameterServerStrategy):
            return int(strategy.job_value(iterations).numpy())
        return int(iterations.numpy())

    @property
    def last_save(self) -> Dict[str, object]:
        """What the last save wrote: kind, part, chain, rows, removed, pages (the parts of
        tables with a disk tier, read page by page), seconds."""
        return self._writer.last

    # ------------------------------------------------------------------ callback
    def _is_chief(self) -> bool:
        return RUNTIME.config is None or RUNTIME.config.is_chief

    def on_train_begin(self, logs=None):
        if self._is_chief():
            evaluation.clear_training_done(self.directory)  # an evaluator waits for us

    def on_train_end(self, logs=None):
        if not self._is_chief():
            return
        self.save_if_changed()  # the last batches since a save_freq save
        evaluation.mark_training_done(self.directory, self._saved_step)

    def on_train_batch_end(self, batch, logs=None):
        self._batches += 1
        if self.save_freq != "epoch" and self._batches % self.save_freq == 0:
            self.save()
        elif self.save_seconds is not None and \
                time.monotonic() - self._saved_at >= self.save_seconds:
            self.save()

    def on_epoch_end(self, epoch, logs=None):
        if self.save_freq == "epoch":
            self.save_if_changed()  # (a save by time may have just saved this step)

    # ------------------------------------------------------------------ save
    def save(self, model=None) -> Optional[str]:
        """Saves ``model`` (default: the fitted one) now; returns the part's path (None
        on a worker other than the chief, which saves nothing)."""
        if not self._is_chief():
            return None
        model = model or self.model
        tables = _tables(model)
        step = self._step(model)
        os.makedirs(self.directory, exist_ok=True)
        name = f"{BASE}-{step}"
        part = parts.part_path(os.path.join(self.directory, name))

        def export(full: bool):
            out = {}
            for n, t in tables.items():
                if not t.paged:
                    out[n] = {k: v.numpy() for k, v in t.checkpoint_export(full).items()}
                    continue

                def read(i, lo, hi, t=t):  # a disk tier: its part in pages (pages.py)
                    return {k: v.numpy()
                            for k, v in t.export_range(i, lo, hi, delta=not full).items()}

                begun = t.page_bounds(True) if full else t.delta_begin()
                out[n] = pages.Pages.begun(tf.nest.map_structure(lambda x: x.numpy(), begun),
                                           read)
            return out

        # The input's position first, then the model: a restore repeats the steps
        # trained between the two, never skips one (tfpsx.data); none with an input's
        # exact_saves, whose barrier holds every worker's steps around the save.
        # (GEO: the barrier's flush pushes each worker's unpushed steps, and the dense
        # weights saved are the job's, on the servers, not the chief's copy.)
        strategy = getattr(model, "distribute_strategy", None)
        ours = isinstance(strategy, ParameterServerStrategy)
        with splits.save_barrier(strategy.flush_for_save if ours else flush_commits):
            positions = {INPUT + name: np.frombuffer(source.position_state(), np.uint8)
                         for name, source in splits.registered().items()}
            dense = {key: np.asarray((strategy.job_value(v) if ours else v).numpy())
                     for key, v in _weights(model).items()}
            info = self._writer.save(part, export, step, extra=dict(dense, **positions))
        try:
            kept = [n for n in self._state().get("kept", []) if n != name] + [name]
            kept = kept[-self.max_to_keep:]
            self._write_state({"latest": name, "kept": kept})
        except BaseException:
            self._writer.reset()
            raise
        parts.remove_unreferenced(self.directory, BASE, [
            parts.part_path(os.path.join(self.directory, n)) for n in kept])
        self._saved_step = step
        self._saved_at = time.monotonic()
        logger.info("checkpoint %s: tables %s (%d rows, %d removed), %d weights, in %.2f s",
                    part, info["kind"], info["rows"], info["removed"], len(dense),
                    info["seconds"])
        if self._publisher is not None:
            publish_save(self._writer, self._publisher, model, part, step,
                         {int(k): v for k, v in dense.items()})
        return part

    @property
    def last_publish(self) -> Dict[str, object]:
        """What the last publish wrote (``publisher``): kind, sequence, path, rows,
        removed, bytes, seconds; empty before one."""
        return self._publisher.last if self._publisher is not None else {}

    def save_if_changed(self, model=None) -> Optional[str]:
        """Saves unless the job's global step is the last save's (what ``fit``'s end
        does; call it again once every worker ended, after ``tfpsx.barrier_worker()``,
        for the other workers' last steps); returns the part, or None."""
        if not self._is_chief():
            return None
        model = model or self.model
        return self.save(model) if self._step(model) != self._saved_step else None

    def _state(self) -> dict:
        return latest_state(self.directory) or {}

    def _write_state(self, state: dict) -> None:
        file = os.path.join(self.directory, STATE)
        with open(file + ".tmp", "w") as f:
            json.dump(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(file + ".tmp", file)

    # ------------------------------------------------------------------ restore
    def restore(self, model, name: Optional[str] = None, *, force: bool = False
                ) -> Optional[int]:
        """Loads the latest checkpoint of ``directory`` (or ``name``, e.g. "ckpt-300")
        into ``model``: tables (full part, then every delta) and weights. Returns the
        step it was saved at, or None when there is none or nothing was restored. Call
        it before ``fit``, on every worker: on a cluster the chief alone restores, and
        only into new servers.

        A model of ``tfpsx.keras.ParameterServerStrategy`` restores into the parameter
        servers, which every worker shares: a non-chief restores nothing (it trains on
        the model the servers hold; a worker started again in place must not roll back
        the others), and the chief restores only when the servers are new (a new job, or
        ``tfpsx-run --max_restarts`` starting the whole job again): servers that already
        hold the job's model (the chief alone started again while they ran on) are left
        as they are, logged. ``force=True`` rolls them back on purpose. A model without
        a cluster (an evaluator's) always restores.

        Raises:
          CheckpointError: a part of the chain is missing; ValueError: the checkpoint
            is of another model (tables or weights that do not match), before any change.
        """
        if name is None:
            name = (latest_state(self.directory) or {}).get("latest")
            if name is None:
                return None
        strategy = getattr(model, "distribute_strategy", None)
        if isinstance(strategy, ParameterServerStrategy) and not force:
            if not strategy.is_chief:
                logger.info("worker %d does not restore %s: the chief restores into new "
                            "servers; this worker trains on the model they hold",
                            RUNTIME.config.index, name)
                return None
            if strategy.servers_hold_model():
                logger.warning(
                    "the chief does not restore %s: the parameter servers already hold the "
                    "job's model (they ran on while this chief started again), and a "
                    "restore would roll back what every worker trained since that "
                    "checkpoint; training goes on from their model (restore(model, "
                    "force=True) rolls back on purpose)", name)
                return None
        part = parts.part_path(os.path.join(self.directory, name))
        tables = _tables(model)
        steps = plan(part, {n: (t.dim, t.num_slots) for n, t in tables.items()})
        dense = parts.load_extra(part)
        positions = {k[len(INPUT):]: bytes(dense.pop(k).tobytes()) for k in list(dense)
                     if k.startswith(INPUT)}
        weights = _weights(model)
        if sorted(dense) != sorted(weights):
            raise ValueError(f"checkpoint {part} holds {len(dense)} weights, this model has "
                             f"{len(weights)}: was it saved from another model?")
        wrong = [f"{v.path}: {list(v.shape)} here, {list(dense[k].shape)} saved"
                 for k, v in weights.items() if tuple(v.shape) != dense[k].shape]
        if wrong:
            raise ValueError(f"checkpoint {part}: weights of other shapes: {wrong}")
        # (refuses another input's first). The chief alone restores a position: the
        # coordinator is the job's (a collective job's ranks each restore their weights).
        if RUNTIME.config is None or RUNTIME.config.is_chief:
            for input_name, state in positions.items():
                splits.restore(input_name, state)
        for path, index in steps:
            for n, t in tables.items():
                for kind, data in parts.table_pages(path, index, n, t.page_rows):
                    t.apply_checkpoint({k: tf.constant(v) for k, v in data.items()},
                                       full=kind == parts.FULL)
        for key, v in weights.items():
            v.assign(dense[key])
        index = parts.read_index(part)
        if model.optimizer is not None:
            # The global step goes on from the checkpoint's (the next saves' names, a
            # learning-rate schedule, the published deltas' steps); before, a restored
            # job counted from 0 again and its saves took the names of older ones.
            model.optimizer.iterations.assign(int(index["step"]))
        self._writer.reset()
        logger.info("restored %s: tables from %d part(s), %d weights (step %d)%s", part,
                    len(steps), len(weights), index["step"],
                    f", input position(s) of {sorted(positions)}" if positions else "")
        return int(index["step"])


def evaluate_checkpoints(model, checkpoint_dir: str, data=None,
                         evaluate: Optional[Callable[[object], Dict[str, float]]] = None,
                         summary_dir: Optional[str] = None, poll_seconds: float = 0.5,
                         timeout: Optional[float] = None) -> List[Dict[str, float]]:
    """An evaluator task's loop: each new checkpoint the chief's
    :class:`IncrementalCheckpoint` writes to ``checkpoint_dir`` is restored into
    ``model`` (built and compiled here, without a strategy: its tables are local) and
    evaluated, until the chief's last checkpoint is.

    Args:
      model: the training model's architecture, compiled with the metrics to report.
      data: held-out data for ``model.evaluate`` (a dataset, or an ``(x, y)`` tuple);
        the records hold its ``return_dict``.
      evaluate: instead of ``data``: ``evaluate(model)`` returns the metrics.
      summary_dir, poll_seconds, timeout: as :func:`tfpsx.evaluate_checkpoints`.

    Returns:
      One record per checkpoint: ``step``, ``checkpoint`` and the metrics (also written to
      TensorBoard under ``eval/`` and to the metrics sink as ``evaluation`` events).
    """
    if (data is None) == (evaluate is None):
        raise ValueError("tfpsx.keras.evaluate_checkpoints: give either data (for "
                         "model.evaluate) or evaluate(model) -> metrics, not "
                         f"{'both' if data is not None else 'neither'}")
    saver = IncrementalCheckpoint(checkpoint_dir)

    def run(path: str, step: int) -> Dict[str, float]:
        saver.restore(model, os.path.basename(path))
        if evaluate is not None:
            return evaluate(model)
        x, y = data if isinstance(data, tuple) else (data, None)  # (x, y) or a dataset
        return model.evaluate(x, y, return_dict=True, verbose=0)

    return evaluation.evaluate_checkpoints(checkpoint_dir, run, summary_dir=summary_dir,
                                           poll_seconds=poll_seconds, timeout=timeout)


__all__: List[str] = ["IncrementalCheckpoint", "evaluate_checkpoints", "latest_state"]

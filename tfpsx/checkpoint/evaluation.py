"""Side-car evaluation: an evaluator task evaluates each new checkpoint of the chief.

The chief marks the end of training beside its checkpoints (``training_done.json``, with
the step of its last checkpoint): Keras's :class:`tfpsx.keras.IncrementalCheckpoint` at
the end of ``fit``, ``tfpsx.MonitoredTrainingSession`` when the chief's session closes.
:func:`evaluate_checkpoints` evaluates the latest checkpoint each time it changes (like
TF's ``checkpoints_iterator``, a checkpoint written while one is evaluated may be skipped,
never the last one), writes the metrics as TensorBoard scalars and to the metrics sink
(event ``evaluation``), and returns once the chief's last checkpoint is evaluated.

Both checkpoint layouts are read: tfpsx's ``checkpoint.json`` (Keras) and TF's own
``checkpoint`` state file (``tf.train.Saver``, ``CheckpointManager``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from typing import Callable, Dict, List, Optional, Tuple

import tensorflow as tf

from tfpsx import metrics, settings
from tfpsx.checkpoint import parts
from tfpsx.errors import ClusterTimeoutError

logger = logging.getLogger("tfpsx")

DONE = "training_done.json"
_STEP = re.compile(r"-(\d+)$")


def mark_training_done(directory: str, step: int) -> None:
    """Records that training ended with its last checkpoint at ``step`` (atomically)."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, DONE)
    with open(path + ".tmp", "w") as f:
        json.dump({"step": int(step), "time": time.time()}, f)
    os.replace(path + ".tmp", path)


def clear_training_done(directory: str) -> None:
    """Training (again) in progress: an evaluator waits for its checkpoints."""
    path = os.path.join(os.fspath(directory), DONE)
    if os.path.exists(path):
        os.remove(path)


def training_done(directory: str) -> Optional[int]:
    """The step of the last checkpoint once the chief marked training done, else None."""
    path = os.path.join(os.fspath(directory), DONE)
    try:
        with open(path) as f:
            return int(json.load(f)["step"])
    except FileNotFoundError:
        return None


def latest_checkpoint(directory: str) -> Optional[Tuple[str, int]]:
    """(path, step) of the newest checkpoint in ``directory``, or None."""
    directory = os.fspath(directory)
    state = parts.latest_state(directory)  # tfpsx.keras.IncrementalCheckpoint's
    if state is not None:
        path = os.path.join(directory, state["latest"]) if state.get("latest") else None
    else:
        path = tf.train.latest_checkpoint(directory)
    if not path:
        return None
    match = _STEP.search(path)
    if not match:
        raise ValueError(f"checkpoint {path!r} has no step suffix ('-N'); expected names "
                         "like ckpt-100 or model.ckpt-100")
    return path, int(match.group(1))


def evaluate_checkpoints(checkpoint_dir: str, evaluate: Callable[[str, int], Dict[str, float]],
                         summary_dir: Optional[str] = None, poll_seconds: float = 0.5,
                         timeout: Optional[float] = None) -> List[Dict[str, float]]:
    """Evaluates every new checkpoint of ``checkpoint_dir`` until training ended.

    Args:
      checkpoint_dir: the chief's checkpoint directory.
      evaluate: ``evaluate(path, step)`` loads the checkpoint and returns its metrics
        (name -> number).
      summary_dir: TensorBoard scalars ``eval/<name>`` at each checkpoint's step.
      poll_seconds: how often the directory is read.
      timeout: the longest wait for a new checkpoint or the end of training
        (TFPSX_EVAL_TIMEOUT, 900 s).

    Returns:
      One record per evaluated checkpoint: ``step``, ``checkpoint`` and the metrics.

    Raises:
      ClusterTimeoutError: ``timeout`` passed with no new checkpoint and no end of
        training (the chief died or saves too rarely); the message names the directory
        and the last checkpoint evaluated.
    """
    directory = os.fspath(checkpoint_dir)
    poll = settings.parse_float(poll_seconds, "evaluate_checkpoints(poll_seconds=...)")
    limit = settings.get("TFPSX_EVAL_TIMEOUT", timeout)
    if not callable(evaluate):
        raise TypeError(f"evaluate_checkpoints: evaluate must be callable(path, step), got "
                        f"{evaluate!r}")
    writer = (None if summary_dir is None
              else tf.summary.create_file_writer(os.fspath(summary_dir)))
    records: List[Dict[str, float]] = []
    last: Optional[str] = None
    waited_since = time.monotonic()
    while True:
        # The end mark first: a checkpoint read after it is at least the last one.
        done = training_done(directory)
        newest = latest_checkpoint(directory)
        if newest is not None and newest[0] != last:
            path, step = newest
            values = {k: float(v) for k, v in evaluate(path, step).items()}
            record = {"step": step, "checkpoint": path, **values}
            records.append(record)
            metrics.emit("evaluation", **record)
            if writer is not None:
                with writer.as_default():
                    for name, value in values.items():
                        tf.summary.scalar(f"eval/{name}", value, step=step)
                writer.flush()
            logger.info("evaluated %s (step %d): %s", path, step,
                        ", ".join(f"{k} {v:.6g}" for k, v in values.items()))
            last = path
            waited_since = time.monotonic()
            continue
        if done is not None and records and records[-1]["step"] >= done:
            return records
        if done is not None and newest is None:
            raise ValueError(f"evaluate_checkpoints: training in {directory!r} ended (step "
                             f"{done}) without a checkpoint to evaluate")
        if time.monotonic() - waited_since > limit:
            raise ClusterTimeoutError(
                f"evaluate_checkpoints waited {limit:g} s for a new checkpoint in "
                f"{directory!r} or the end of training (last evaluated: {last or 'none'}); "
                "the chief died or saves less often than that (TFPSX_EVAL_TIMEOUT)")
        time.sleep(poll)

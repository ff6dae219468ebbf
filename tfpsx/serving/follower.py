"""A served model that follows training: loads the latest base a tfpsx job published and
applies its deltas in order, with stock TensorFlow only.

This file imports nothing of tfpsx (copy it next to a server; it needs TensorFlow alone).
The folder it follows is what ``IncrementalCheckpoint(publisher=Publisher(model_dir))`` writes
(``tfpsx/serving/publish.py``):

    <model_dir>/<sequence>/              a base: a SavedModel (TF Serving's version folder)
    <model_dir>/deltas/<sequence>/       a delta: delta.index, delta.data-*, manifest.json,
                                         DONE (last; a delta without it is not applied)

Sequences count bases and deltas together. The follower applies ``n + 1`` after ``n``:
a delta through the model's ``apply_delta`` signature (which refuses any other
sequence), a base by loading it in place of the model it serves (the old one answers
until the new one is loaded). Started again, it loads the latest base and replays the
deltas after it. When the next sequence is gone (pruned by the publisher) it moves to
the latest base.

    python follower.py --model_dir /models/ctr [--poll_seconds 1] [--once]

or in a serving process::

    follower = Follower("/models/ctr")
    follower.catch_up()                        # and again, e.g. from a thread
    follower.predict(ids=tf.constant(...))     # serving_default of the current model
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from typing import Dict, List, Optional

# Run as a script, this file's folder leads sys.path, and it holds tfpsx modules named
# like libraries (keras.py): TensorFlow must not import them.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import tensorflow as tf  # noqa: E402

logger = logging.getLogger("tfpsx_follower")

DELTAS = "deltas"
BUNDLE = "delta"
MANIFEST = "manifest.json"
DONE = "DONE"
APPLY = "apply_delta"
APPLIED = "applied_sequence"
SERVING_DEFAULT = "serving_default"


def _bases(model_dir: str) -> List[int]:
    return sorted(int(n) for n in os.listdir(model_dir) if n.isdigit() and
                  os.path.isfile(os.path.join(model_dir, n, "saved_model.pb")))


def _delta_dir(model_dir: str, sequence: int) -> Optional[str]:
    """The complete delta ``sequence`` (with its ``DONE``), or None."""
    path = os.path.join(model_dir, DELTAS, str(sequence))
    return path if os.path.isfile(os.path.join(path, DONE)) else None


def read_delta(path: str) -> Dict[str, tf.Tensor]:
    """The tensors of the delta folder ``path``, by name (``apply_delta``'s inputs)."""
    reader = tf.train.load_checkpoint(os.path.join(path, BUNDLE))
    return {name: tf.constant(reader.get_tensor(name))
            for name in reader.get_variable_to_shape_map()}


def _read(path: str):
    """(manifest, tensors) of the delta folder ``path``, or None when it went while it
    was read (the publisher pruned it)."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
        return manifest, read_delta(path)
    except (OSError, tf.errors.NotFoundError):
        if os.path.isdir(path):
            raise
        return None


class Follower:
    """Serves the latest base of ``model_dir`` with the deltas published after it.

    Raises:
      FileNotFoundError: ``model_dir`` holds no base yet (the job publishes its first
        with its first save).
    """

    def __init__(self, model_dir: str):
        self.model_dir = os.fspath(model_dir)
        if not os.path.isdir(self.model_dir) or not _bases(self.model_dir):
            raise FileNotFoundError(
                f"follower: no base in {self.model_dir!r} (a folder <sequence>/ with a "
                "saved_model.pb); a job publishes one with its first save "
                "(IncrementalCheckpoint(publisher=tfpsx.serving.Publisher(...)))")
        self._lock = threading.Lock()
        self.base: Optional[int] = None
        self.model = None
        self.applied = 0
        self._load(_bases(self.model_dir)[-1])

    def _load(self, base: int) -> None:
        model = tf.saved_model.load(os.path.join(self.model_dir, str(base)))
        applied = int(model.signatures[APPLIED]()[APPLIED])
        self.model, self.base, self.applied = model, base, applied  # the swap
        logger.info("follower: loaded base %d (sequence %d)", base, applied)

    def predict(self, **inputs) -> Dict[str, tf.Tensor]:
        """``serving_default`` of the model served now."""
        return self.model.signatures[SERVING_DEFAULT](**inputs)

    def step(self) -> Optional[str]:
        """Applies the next sequence if it is published: "delta", "base" (loaded), or
        None (nothing new yet)."""
        with self._lock:
            following = self.applied + 1
            if os.path.isfile(os.path.join(self.model_dir, str(following), "saved_model.pb")):
                self._load(following)
                return "base"
            path = _delta_dir(self.model_dir, following)
            delta = _read(path) if path else None
            if delta is not None:
                manifest, tensors = delta
                if manifest["base"] != self.base:
                    raise RuntimeError(
                        f"follower: delta {following} in {path} follows base "
                        f"{manifest['base']}, this model was loaded from base {self.base}; "
                        "the folder holds two jobs' publishes? (start the follower again: it "
                        "loads the latest base)")
                got = self.model.signatures[APPLY](**tensors)
                self.applied = int(got[APPLIED])
                logger.info("follower: applied delta %d (%d rows, %d removed)", following,
                            manifest.get("rows", -1), manifest.get("removed", -1))
                return "delta"
            newer = [b for b in _bases(self.model_dir) if b > following]
            if newer:  # the next one was pruned: the latest base
                logger.warning("follower: sequence %d is gone (pruned); loading the latest "
                               "base %d", following, newer[-1])
                self._load(newer[-1])
                return "base"
            return None

    def catch_up(self) -> int:
        """Applies every sequence published after the current one; returns how many."""
        count = 0
        while self.step() is not None:
            count += 1
        return count


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--poll_seconds", type=float, default=1.0)
    parser.add_argument("--once", action="store_true",
                        help="catch up with what is published, print the sequence, exit")
    args = parser.parse_args(argv)
    if args.poll_seconds <= 0:
        parser.error(f"--poll_seconds must be > 0, got {args.poll_seconds}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    follower = Follower(args.model_dir)
    while True:
        try:
            follower.catch_up()
        except (OSError, tf.errors.OpError) as e:  # a publisher mid-write; tried again
            if args.once:
                raise
            logger.error("follower: %s: %s (tried again in %g s)", type(e).__name__, e,
                         args.poll_seconds)
        if args.once:
            print(json.dumps({"base": follower.base, "applied_sequence": follower.applied}))
            return 0
        time.sleep(args.poll_seconds)


if __name__ == "__main__":
    sys.exit(main())

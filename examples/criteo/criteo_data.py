"""Reading Criteo Kaggle / Criteo 1TB text files with ``tf.data``.

A line: the label, 13 integer fields, 26 categorical fields, tab-separated; any field
may be empty. Files are given as paths or globs (comma-separated). Lines are read as a
stream (``TextLineDataset``, several files at once), never loaded whole; each worker
takes its part (whole files when there are at least as many files as workers, else
every W-th line), batches of lines are parsed at once (``tf.io.decode_csv``, in
parallel) into ``{"dense": float32 [B, 13], "cat": string [B, 26]}`` and the label.
Integers become ``log1p(max(x, 0))`` (empty: 0); a categorical value stays a string
(empty: ""), made field-aware by the model.

Every worker runs the same number of steps per epoch (sync must not wait for a worker's
extra batch): the line counts of the files give each worker's part, and all take the
smallest part's batches.
"""

from __future__ import annotations

import os
from typing import List, Optional, Tuple

import tensorflow as tf

INT_FIELDS, CAT_FIELDS = 13, 26
_DEFAULTS = [[0.0]] + [[0.0]] * INT_FIELDS + [[""]] * CAT_FIELDS


def files_of(patterns: str, flag: str) -> List[str]:
    """The files of a comma-separated list of paths and globs, sorted.

    Raises:
      ValueError: a pattern matches nothing (named, with the flag it came from).
    """
    if not patterns:
        raise ValueError(f"--{flag}: no file given; expected a Criteo-format file or glob")
    files = []
    for pattern in patterns.split(","):
        pattern = pattern.strip()
        found = sorted(tf.io.gfile.glob(pattern))
        if not found:
            raise ValueError(f"--{flag}: {pattern!r} matches no file; expected a Criteo-format "
                             "text file or glob (examples/criteo/make_data.py writes some)")
        files += [f for f in found if not tf.io.gfile.isdir(f)]
    return sorted(set(files))


def count_lines(path: str) -> int:
    """The lines of a file (read in 4 MiB blocks; its ``<path>.lines`` sidecar when
    present and newer than the file)."""
    sidecar = path + ".lines"
    if os.path.exists(sidecar) and os.path.getmtime(sidecar) >= os.path.getmtime(path):
        with open(sidecar) as f:
            return int(f.read())
    count = 0
    with tf.io.gfile.GFile(path, "rb") as f:
        while True:
            block = f.read(4 << 20)
            if not block:
                break
            count += block.count(b"\n")
    return count


def parts(files: List[str], workers: int) -> Tuple[bool, List[int]]:
    """(whether workers take whole files, each worker's line count)."""
    counts = [count_lines(f) for f in files]
    if len(files) >= workers:
        return True, [sum(counts[w::workers]) for w in range(workers)]
    total = sum(counts)
    return False, [len(range(w, total, workers)) for w in range(workers)]


def parse(lines: tf.Tensor):
    """A batch of lines -> ({"dense": [B, 13] float32, "cat": [B, 26] string}, label [B])."""
    fields = tf.io.decode_csv(lines, _DEFAULTS, field_delim="\t", use_quote_delim=False)
    label = fields[0]
    dense = tf.stack(fields[1:1 + INT_FIELDS], axis=1)
    dense = tf.math.log1p(tf.maximum(dense, 0.0))
    cat = tf.stack(fields[1 + INT_FIELDS:], axis=1)
    return {"dense": dense, "cat": cat}, label


def dataset(patterns: str, batch_size: int, workers: int = 1, index: int = 0,
            shuffle: Optional[int] = None, seed: int = 0, flag: str = "train_data"):
    """Worker ``index``'s batches of the files ``patterns``, and its steps per epoch
    (the same on every worker). ``shuffle``: a buffer of lines reshuffled each epoch."""
    files = files_of(patterns, flag)
    by_file, counts = parts(files, workers)
    steps = min(counts) // batch_size
    if steps == 0:
        raise ValueError(f"--{flag}: {min(counts)} lines for a worker, fewer than one batch of "
                         f"{batch_size}; give more data or a smaller --batch_size")
    if by_file:
        names = tf.data.Dataset.from_tensor_slices(files[index::workers])
        lines = names.interleave(tf.data.TextLineDataset, cycle_length=4, block_length=64,
                                 num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    else:
        lines = tf.data.TextLineDataset(files).shard(workers, index)
    if shuffle:
        lines = lines.shuffle(shuffle, seed=seed, reshuffle_each_iteration=True)
    batches = lines.batch(batch_size, drop_remainder=True).take(steps)
    batches = batches.map(parse, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)
    # No autotuning thread: in a worker process connected to its cluster, TF 2.21 let the
    # deletion of fit's iterator wait out that thread's sleep (up to 60 s, not woken by
    # the iterator's cancellation), so fit returned up to a minute after its last step
    # (measured: a 4-worker job's fit 145-149 s against 82-99 s, in 6 of 11 runs; none
    # in 3 runs without it, at the same steps/s: AUTOTUNE keeps TF's defaults, untuned).
    options = tf.data.Options()
    options.autotune.enabled = False
    return batches.with_options(options), steps

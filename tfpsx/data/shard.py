"""Each worker's part of the input, in equal sizes.

Data parallelism: every worker trains on its own part of the data. :func:`shard` (a
``tf.data.Dataset``) and :func:`shard_arrays` (numpy arrays) give this worker every
W-th example, cut to the same count on every worker (the remainder, fewer than W
examples, is dropped), so that every worker runs the same number of steps and sync
training never waits for a worker that has one batch more.

Example::

  train = tfpsx.data.shard(tf.data.Dataset.from_tensor_slices((x, y))).batch(256)
  x_part, y_part = tfpsx.data.shard_arrays(x, y)
"""

from __future__ import annotations

from typing import Optional, Tuple

from tfpsx.runtime import RUNTIME


def _part(num_shards: Optional[int], index: Optional[int], what: str) -> Tuple[int, int]:
    if num_shards is None or index is None:
        config = RUNTIME.require_role(what, "worker")
        num_shards = config.worker_num if num_shards is None else num_shards
        index = config.index if index is None else index
    for name, value, low in (("num_shards", num_shards, 1), ("index", index, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{what}: {name} must be an int >= {low}, got {value!r}")
    if index >= num_shards:
        raise ValueError(f"{what}: index {index} is out of range for {num_shards} shards; "
                         f"expected 0..{num_shards - 1}")
    return num_shards, index


def shard(dataset, num_shards: Optional[int] = None, index: Optional[int] = None,
          shuffle_buffer: Optional[int] = None, seed: Optional[int] = None):
    """This worker's part of ``dataset`` (unbatched examples: shard first, then batch).

    Args:
      dataset: a ``tf.data.Dataset``.
      num_shards, index: default: the cluster's worker count and this worker's rank.
      shuffle_buffer: shuffle the whole dataset before sharding, again every epoch
        (``reshuffle_each_iteration``), with a buffer of this many examples. Needs
        ``seed``.
      seed: the seed every worker shares: each epoch they draw the same order of the
        whole dataset, so their parts never overlap and every example is seen once.

    Returns:
      Every ``num_shards``-th element from ``index``, the same count on every worker when
      the dataset's size is known (``cardinality``): a collective, which waits for every
      rank, never meets a rank with one batch more. For an infinite or unknown-size
      dataset, pass ``steps_per_epoch`` to ``fit``.

    Raises:
      ValueError: a bad shard count or index, or ``shuffle_buffer`` without ``seed``.
    """
    num_shards, index = _part(num_shards, index, "tfpsx.data.shard")
    if shuffle_buffer is not None:
        checks = (("shuffle_buffer", shuffle_buffer, 1, ""),
                  ("seed", seed, 0, "; every worker must pass the same seed, or their "
                   "parts overlap"))
        for name, value, low, why in checks:
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"tfpsx.data.shard: {name} must be an int >= {low}, got "
                                 f"{value!r}{why}")
        size = int(dataset.cardinality())
        dataset = dataset.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
        part = dataset.shard(num_shards, index)
        return part.take(size // num_shards) if size >= 0 else part
    part = dataset.shard(num_shards, index)
    size = int(dataset.cardinality())
    # Known size: cut every part to the smallest one's (negative: infinite or unknown).
    return part.take(size // num_shards) if size >= 0 else part


def shard_arrays(*arrays, num_shards: Optional[int] = None, index: Optional[int] = None):
    """This worker's rows of numpy arrays (same first dimension), the same count on
    every worker. Returns one array, or a tuple for several."""
    num_shards, index = _part(num_shards, index, "tfpsx.data.shard_arrays")
    sizes = {len(a) for a in arrays}
    if len(sizes) != 1:
        raise ValueError(f"tfpsx.data.shard_arrays: the arrays have different lengths "
                         f"{sorted(sizes)}; expected one row count")
    per_worker = sizes.pop() // num_shards
    parts = tuple(a[index::num_shards][:per_worker] for a in arrays)
    return parts[0] if len(parts) == 1 else parts

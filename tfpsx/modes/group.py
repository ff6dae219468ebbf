"""The group of workers a mode waits on: a per-worker vector on PS 0 (sync's pushed
steps, bounded staleness's clocks) where a worker whose training ended is marked
:data:`DONE`, so nobody waits for it again (a dead one is named by the heartbeat
watch instead). The ops on it build the same in a TF1 graph and a ``tf.function``."""

from __future__ import annotations

import tensorflow as tf

DONE = 2 ** 62  # a finished worker's entry: never the slowest, never waited for
# sync's chief whose own data ended while others still train: it pushes no gradient (no
# step waits for it, as DONE) but applies the others' steps until they leave.
DRAINING = DONE + 1


def op_of(x):
    """The op of a variable update's result (in graph mode a resource variable's
    ``scatter_*`` returns the variable), to wait on."""
    return getattr(x, "op", x)


def entry(index: int, value) -> tf.IndexedSlices:
    """``value`` for worker ``index``'s entry of a per-worker int64 vector."""
    return tf.IndexedSlices(tf.reshape(tf.cast(value, tf.int64), [1]), tf.constant([index]))


def set_entry(vector, index: int, value):
    """The op: ``vector[index] = value``."""
    return op_of(vector.scatter_update(entry(index, value)))


def add_to_entry(vector, index: int, value):
    """The op: ``vector[index] += value``."""
    return op_of(vector.scatter_add(entry(index, value)))


def leave(vector, index: int):
    """The op marking worker ``index`` done: nobody waits for it again."""
    return set_entry(vector, index, DONE)


# Modes whose protocol holds one entry per worker the job started with: a joiner has none.
_FIXED_GROUP_MODES = ("sync", "staleness", "collective")


def refuse_a_late_join(options, config) -> None:
    """A worker that joined a running job (``config.joined``) trains in async and GEO; sync
    and bounded staleness wait on a fixed group, and the hybrid mode all-reduces its dense
    weights in one, so they refuse it at once, naming why. ``options``: the job's
    ``DistributedStrategy`` (its ``mode``, and ``hybrid``: dense weights all-reduced).

    Raises:
      ValueError: the mode needs a fixed group and this worker joined late.
    """
    if not config.joined:
        return
    if getattr(options, "hybrid", False):
        raise ValueError(
            f"hybrid (dense='allreduce'): worker {config.index} joined a running job of "
            f"{config.initial_worker_num} workers, but the hybrid mode all-reduces the dense "
            "weights among the workers the job started with (a collective group of fixed "
            "size); a joining worker can train in async or GEO with dense='ps' only. Start "
            "it with the job (TFPSX_WORKER_NUM) instead.")
    mode = options.mode
    if mode in _FIXED_GROUP_MODES:
        raise ValueError(
            f"{mode}: worker {config.index} joined a running job of "
            f"{config.initial_worker_num} workers, but {mode} training waits on the workers "
            "the job started with (one entry each on PS 0); a joining worker can train in "
            "async or GEO only. Start it with the job (TFPSX_WORKER_NUM) instead.")

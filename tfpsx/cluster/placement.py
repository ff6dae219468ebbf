"""Which parameter server a variable goes to: balanced by bytes (TF 1.x contrib's
``GreedyLoadBalancingStrategy``, which TF 2 no longer ships). Both front-ends place by it:
graph mode through ``replica_device_setter``, Keras through its variable creator."""

from __future__ import annotations

import tensorflow as tf


class GreedyByBytes:
    """A ps strategy: each variable goes to the server with the fewest bytes so far
    (TF 1.x contrib's GreedyLoadBalancingStrategy, which TF 2 no longer ships)."""

    def __init__(self, num_tasks: int):
        self.loads = [0] * num_tasks

    def __call__(self, op) -> int:
        return self.place(_variable_bytes(op))

    def place(self, nbytes: int) -> int:
        """The task for a variable of ``nbytes`` (now counted on it)."""
        task = min(range(len(self.loads)), key=self.loads.__getitem__)
        self.loads[task] += nbytes
        return task


def _variable_bytes(op) -> int:
    try:
        shape = tf.TensorShape(op.get_attr("shape"))
        dtype = tf.as_dtype(op.get_attr("dtype"))
    except ValueError:  # an op without shape / dtype attrs: count it as small
        return 1
    elements = 1
    for dim in shape.as_list() if shape.rank is not None else []:
        elements *= dim if dim is not None and dim > 0 else 1
    return max(1, elements * dtype.size)

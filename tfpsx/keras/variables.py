"""Variables that live on a parameter server under a stable name, for eager (Keras 3) code.

A plain eager ``tf.Variable`` gets an anonymous resource that no other client can reach
(measured). :class:`SharedVariable` binds an eager variable to the resource
``shared_name`` on a PS device instead: every worker that names it reaches the same
variable, and dropping the Python object leaves the resource where it is (its handle is
not reference counted), so a worker that exits takes nothing with it.

Initialization is the chief's: :func:`initialize` assigns the initial value once (the
first to come does it); the other workers wait, bounded, until it is there.
"""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from tfpsx import compat, errors
from tfpsx.compat import gen_resource_variable_ops as gen_rv
from tfpsx.waits import bounded_wait


class SharedVariable(compat.BaseResourceVariable):
    """An eager resource variable named ``shared_name`` on ``device``.

    Keyword-only on purpose: ``tf.Variable``'s metaclass forwards positional arguments to
    its own signature.
    """

    def __init__(self, *, shared_name: str, shape, dtype, device: str, trainable: bool = True,
                 name: Optional[str] = None,
                 aggregation=tf.VariableAggregation.NONE,
                 synchronization=tf.VariableSynchronization.AUTO, distribute_strategy=None):
        shape, dtype = tf.TensorShape(shape), tf.as_dtype(dtype)
        with tf.init_scope(), tf.device(device):
            handle = gen_rv.var_handle_op(shape=shape, dtype=dtype, shared_name=shared_name,
                                          container="", debug_name=name or shared_name)
            compat.set_handle_shapes_and_types(handle, shape, dtype)
        super().__init__(trainable=trainable, shape=shape, dtype=dtype, handle=handle,
                         unique_id=shared_name, handle_name=name or shared_name,
                         in_graph_mode=False, aggregation=aggregation,
                         synchronization=synchronization,
                         distribute_strategy=distribute_strategy)
        self.shared_name = shared_name

    def initialized(self) -> bool:
        with tf.init_scope():
            return bool(gen_rv.var_is_initialized_op(self.handle))


def initialize(var: SharedVariable, initial_value, is_chief: bool, timeout: float,
               poll: float = 0.05) -> None:
    """The chief assigns ``initial_value`` unless the variable holds a value already (a
    restarted chief keeps the trained one); the others wait until it does.

    Raises:
      ClusterTimeoutError: a non-chief waited ``timeout`` seconds (TFPSX_SESSION_TIMEOUT)
        for the chief.
    """
    with tf.init_scope():
        if is_chief:
            if not var.initialized():
                value = initial_value() if callable(initial_value) else initial_value
                var.assign(tf.convert_to_tensor(value, var.dtype))
            return
        bounded_wait(var.initialized, timeout, lambda _: errors.ClusterTimeoutError(
            f"waited {timeout:g} s (TFPSX_SESSION_TIMEOUT) for the chief (worker 0) to "
            f"initialize {var.shared_name!r} on {var.device}; is it running and building "
            "the same model?"), poll)


def fit_variables(model) -> list:
    """What a ``fit`` trains with on this worker: the model's weights and, once built,
    its optimizer's variables (what a rank takes from rank 0 when ``fit`` starts)."""
    variables = list(model.weights)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and getattr(optimizer, "built", False):
        variables += list(optimizer.variables)
    return variables

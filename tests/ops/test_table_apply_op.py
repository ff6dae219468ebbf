"""TfpsxHashTableApply: one op for every server-side optimizer, found by name in the native
registry. The per-optimizer ops it replaces stay registered (saved graphs name them) and
are served by the same kernel, so both must give bit-identical rows and slots."""

import itertools

import numpy as np
import pytest
import tensorflow as tf

import tfpsx

from tfpsx.embedding.optimizers import OPTIMIZERS as SPECS
from tfpsx.ops import bindings

# What the op library registers (the single source of truth): name -> (slot_init,
# hyperparameters in the op's order, the legacy op). Values: the spec's defaults, with a
# larger learning rate so that rows move visibly.
REGISTRY = bindings.optimizer_registry()
OPTIMIZERS = {}
for _name, _slots, _hparams in REGISTRY:
    _spec = SPECS[_name](**({"learning_rate": 0.05}))
    OPTIMIZERS[_name] = (tuple(_spec.slot_init),
                         tuple(float(getattr(_spec, h)) for h in _hparams),
                         f"tfpsx_hash_table_apply_{_name}")
DIM = 6
_names = itertools.count()


@pytest.fixture(scope="module")
def ops():
    return tfpsx.load_ops()


def new_table(ops, slot_init=()):
    name = f"apply_op/t{next(_names)}"
    handle = ops.tfpsx_hash_table_handle_op(
        shared_name=name, dim=DIM, num_slots=len(slot_init), slot_init=list(slot_init),
        initializer="normal", init_b=0.1, seed=5)
    return name, handle


def export(ops, handle):
    keys, values, slots, freq, step = ops.tfpsx_hash_table_export(
        handle, tf.constant(np.iinfo(np.int64).min, tf.int64))
    return keys.numpy(), values.numpy(), slots.numpy(), freq.numpy(), step.numpy()


def step_of(step):
    return tf.constant(step, tf.int64)


@pytest.mark.parametrize("name", [name for name, _, _ in REGISTRY])
def test_apply_equals_legacy_op(ops, name):
    slot_init, hparams, legacy = OPTIMIZERS[name]
    _, new = new_table(ops, slot_init)
    _, old = new_table(ops, slot_init)

    @tf.function
    def apply_in_graph(keys, grads, step):
        ops.tfpsx_hash_table_apply(new, keys, grads, tf.constant(hparams, tf.float32), step,
                                   optimizer=name)

    rng = np.random.default_rng(3)
    for step in range(0, 6):  # step 0: Adam takes 1 for its bias correction
        keys = tf.constant(rng.choice(200, 40, replace=False) - 100, tf.int64)
        grads = tf.constant(rng.standard_normal((40, DIM)), tf.float32)
        if step % 2:
            apply_in_graph(keys, grads, step_of(step))
        else:
            ops.tfpsx_hash_table_apply(new, keys, grads, tf.constant(hparams, tf.float32),
                                       step_of(step), optimizer=name)
        getattr(ops, legacy)(old, keys, grads, *[tf.constant(h, tf.float32) for h in hparams],
                             step_of(step))
    got, want = export(ops, new), export(ops, old)
    assert len(got[0]) > 40
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    # The rows moved away from their initial values.
    _, fresh = new_table(ops, slot_init)
    initial, _ = ops.tfpsx_hash_table_find(fresh, tf.constant(got[0]))
    assert not np.any(np.all(initial.numpy() == got[1], axis=1))


def test_errors_name_table_optimizer_expected_and_given(ops):
    keys, grads = tf.constant([1, 2, 3], tf.int64), tf.ones([3, DIM])
    name, adam_table = new_table(ops, (0.0, 0.0))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=f"tfpsx table '{name}': unknown optimizer 'rmsprop'; "
                             "expected one of sgd, adagrad, adam, ftrl"):
        ops.tfpsx_hash_table_apply(adam_table, keys, grads, [0.1], step_of(1), optimizer="rmsprop")
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=rf"tfpsx table '{name}': optimizer 'adam' takes 4 "
                             r"hyperparameter\(s\) \[learning_rate, beta1, beta2, epsilon\] as a vector, "
                             r"got hparams of shape \[2\]"):
        ops.tfpsx_hash_table_apply(adam_table, keys, grads, [0.1, 0.9], step_of(1),
                                   optimizer="adam")
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=rf"tfpsx table '{name}' has 2 optimizer slot\(s\) but optimizer "
                             r"'adagrad' \(TfpsxHashTableApply\) needs 1"):
        ops.tfpsx_hash_table_apply(adam_table, keys, grads, [0.1, 0.0], step_of(1),
                                   optimizer="adagrad")
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=rf"tfpsx table '{name}': grads must have shape \[3,{DIM}\].*"
                             rf"got \[3,{DIM + 1}\]"):
        ops.tfpsx_hash_table_apply(adam_table, keys, tf.ones([3, DIM + 1]),
                                   [0.1, 0.9, 0.999, 1e-7], step_of(1), optimizer="adam")
    # The legacy ops name the hyperparameter that is not a scalar.
    _, sgd_table = new_table(ops)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"learning_rate must be a scalar, got shape \[2\]"):
        ops.tfpsx_hash_table_apply_sgd(sgd_table, keys, grads, [0.1, 0.2], step_of(1))
    # Nothing was applied by any failed call.
    assert len(export(ops, adam_table)[0]) == 0 and len(export(ops, sgd_table)[0]) == 0


def test_graph_rejects_hparams_that_are_not_a_vector(ops):
    with tf.Graph().as_default():
        _, handle = new_table(ops)
        with pytest.raises(ValueError, match="must be rank 1"):
            ops.tfpsx_hash_table_apply(handle, tf.constant([1], tf.int64), tf.ones([1, DIM]),
                                       tf.constant([[0.1]]), tf.constant(1, tf.int64),
                                       optimizer="sgd")

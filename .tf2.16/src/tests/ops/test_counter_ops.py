"""The control counter ops in one process, eagerly and in a graph."""

import numpy as np
import pytest
import tensorflow as tf

import tfpsx


@pytest.fixture(scope="module")
def ops():
    return tfpsx.load_ops()


def test_eager_counter(ops):
    h = ops.tfpsx_counter_handle_op(shared_name="test/eager")
    assert int(ops.tfpsx_counter_read(h)) == 0
    assert int(ops.tfpsx_counter_add(h, tf.constant(5, tf.int64))) == 5
    assert int(ops.tfpsx_counter_add(h, tf.constant(-2, tf.int64))) == 3
    # Same shared_name, new handle: same counter.
    h2 = ops.tfpsx_counter_handle_op(shared_name="test/eager")
    assert int(ops.tfpsx_counter_read(h2)) == 3
    other = ops.tfpsx_counter_handle_op(shared_name="test/other")
    assert int(ops.tfpsx_counter_read(other)) == 0


def test_marks_are_idempotent_and_sorted(ops):
    h = ops.tfpsx_counter_handle_op(shared_name="test/members")
    for member, count in ((3, 1), (1, 2), (3, 2), (0, 3)):
        assert int(ops.tfpsx_counter_mark(h, tf.constant(member, tf.int64))) == count
    np.testing.assert_array_equal(ops.tfpsx_counter_members(h).numpy(), [0, 1, 3])


def test_graph_mode_and_shapes(ops):
    with tf.Graph().as_default() as g:
        h = ops.tfpsx_counter_handle_op(shared_name="test/graph")
        delta = tf.compat.v1.placeholder(tf.int64, [])
        add = ops.tfpsx_counter_add(h, delta)
        members = ops.tfpsx_counter_members(h)
        assert add.shape.rank == 0 and members.shape.rank == 1
        with tf.compat.v1.Session(graph=g) as sess:
            assert [sess.run(add, {delta: 2}) for _ in range(3)] == [2, 4, 6]


def test_bad_inputs_are_clear(ops):
    h = ops.tfpsx_counter_handle_op(shared_name="test/bad")
    with pytest.raises(tf.errors.InvalidArgumentError, match="member must be >= 0.*got -4"):
        ops.tfpsx_counter_mark(h, tf.constant(-4, tf.int64))
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="scalar|rank"):
        ops.tfpsx_counter_add(h, tf.constant([1, 2], tf.int64))
    with pytest.raises((TypeError, tf.errors.InvalidArgumentError, ValueError), match="int64|int32"):
        ops.tfpsx_counter_add(h, tf.constant(1.5))

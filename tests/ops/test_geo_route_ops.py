"""GEO's row routing ops (custom_ops/cc/ops/geo_route_ops.cc): a batch's unique keys and
their rows split between the PS and the worker's copy by the table's async flag and a hot
mask, and the rows stitched back in the keys' order. The expected values are numpy's
boolean indexing of the same keys and rows; bad input fails naming the value and what
was expected."""

import numpy as np
import pytest
import tensorflow as tf

from tfpsx.ops import bindings

ON, OFF = tf.constant(True), tf.constant(False)


def test_with_the_flag_on_every_key_and_row_is_the_pss_and_the_tails_are_empty():
    keys = tf.constant([7, 3, 9], tf.int64)
    rows = tf.constant(np.arange(6, dtype=np.float32).reshape(3, 2))
    hot, ps_keys, tail_keys, at_hot, at_tail, held = bindings.geo_split_keys(
        ON, keys, tf.zeros([0], tf.bool))  # (the mask is not read)
    assert hot.numpy().tolist() == [True] * 3
    assert held.numpy().tolist() == [3, 3]  # (keys, the PS's)
    assert ps_keys.numpy().tolist() == [7, 3, 9]
    assert [t.numpy().size for t in (tail_keys, at_hot, at_tail)] == [0, 0, 0]
    ps_k, ps_rows, tail_k, tail_rows = bindings.geo_split_rows(
        ON, keys, rows, tf.constant([False, True, False]))
    assert ps_k.numpy().tolist() == [7, 3, 9] and tail_k.numpy().size == 0
    np.testing.assert_array_equal(ps_rows.numpy(), rows.numpy())
    assert tail_rows.shape == (0, 2)
    np.testing.assert_array_equal(
        bindings.geo_stitch_rows(ON, ps_rows, tf.zeros([5, 9]), at_hot, at_tail).numpy(),
        rows.numpy())


@pytest.mark.parametrize("dtype,width", [(tf.float32, (4,)), (tf.float16, (3,)),
                                         (tf.bfloat16, (2,)), (tf.float64, (2, 3))])
def test_with_the_flag_off_the_mask_splits_and_the_stitch_puts_every_row_back(dtype, width):
    rng = np.random.default_rng(5)
    n = 200
    keys = rng.permutation(10 ** 6)[:n].astype(np.int64)
    mask = rng.random(n) < 0.3
    rows = rng.normal(size=(n,) + width).astype(np.float32)
    hot, ps_keys, tail_keys, at_hot, at_tail, held = bindings.geo_split_keys(OFF, keys, mask)
    assert hot.numpy().tolist() == mask.tolist()
    assert held.numpy().tolist() == [n, int(mask.sum())]
    assert ps_keys.numpy().tolist() == keys[mask].tolist()
    assert tail_keys.numpy().tolist() == keys[~mask].tolist()
    assert at_hot.numpy().tolist() == np.flatnonzero(mask).tolist()
    assert at_tail.numpy().tolist() == np.flatnonzero(~mask).tolist()

    typed = tf.cast(rows, dtype)
    ps_k, ps_rows, tail_k, tail_rows = bindings.geo_split_rows(OFF, keys, typed, mask)
    assert ps_k.numpy().tolist() == keys[mask].tolist()
    assert tail_k.numpy().tolist() == keys[~mask].tolist()
    expected = typed.numpy()
    np.testing.assert_array_equal(ps_rows.numpy(), expected[mask])
    np.testing.assert_array_equal(tail_rows.numpy(), expected[~mask])
    back = bindings.geo_stitch_rows(OFF, ps_rows, tail_rows, at_hot, at_tail)
    assert back.dtype == dtype
    np.testing.assert_array_equal(back.numpy(), expected)


def test_an_empty_mask_with_the_flag_off_makes_every_key_the_copys():
    keys = tf.constant([4, 2], tf.int64)
    none = tf.zeros([0], tf.bool)
    hot, ps_keys, tail_keys, at_hot, at_tail, held = bindings.geo_split_keys(OFF, keys, none)
    assert hot.numpy().tolist() == [False, False]
    assert held.numpy().tolist() == [2, 0]
    assert ps_keys.numpy().size == 0 and tail_keys.numpy().tolist() == [4, 2]
    assert at_tail.numpy().tolist() == [0, 1]
    ps_k, _, tail_k, tail_rows = bindings.geo_split_rows(
        OFF, keys, tf.constant([[1.], [2.]]), none)
    assert ps_k.numpy().size == 0 and tail_k.numpy().tolist() == [4, 2]
    assert tail_rows.numpy().tolist() == [[1.], [2.]]
    # (no keys at all)
    out = bindings.geo_split_keys(OFF, tf.zeros([0], tf.int64), none)
    assert [t.numpy().size for t in out[:5]] == [0] * 5
    assert out[5].numpy().tolist() == [0, 0]


def test_bad_input_names_the_value_and_what_was_expected():
    keys = tf.constant([1, 2, 3], tf.int64)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"hot must hold one flag per key \(3\) or none .*got shape \[2\]"):
        bindings.geo_split_keys(OFF, keys, tf.constant([True, False]))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"rows must hold one row per key \(3\), got shape \[2,4\]"):
        bindings.geo_split_rows(OFF, keys, tf.zeros([2, 4]), tf.constant([True] * 3))
    with pytest.raises(tf.errors.InvalidArgumentError, match="on_ps must be a scalar"):
        bindings.geo_split_keys(tf.constant([True]), keys, tf.constant([True] * 3))
    ps_rows, tail_rows = tf.zeros([1, 2]), tf.zeros([2, 2])
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"at_tail\[1\] = 0: expected each of the 3 positions"):
        bindings.geo_stitch_rows(OFF, ps_rows, tail_rows, tf.constant([0]), tf.constant([1, 0]))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"at_hot\[0\] = 5: expected each of the 3 positions"):
        bindings.geo_stitch_rows(OFF, ps_rows, tail_rows, tf.constant([5]), tf.constant([1, 2]))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"tail_rows must hold one row per position of at_tail \(2\) as "
                             r"wide as ps_rows \[1,2\], got shape \[2,3\]"):
        bindings.geo_stitch_rows(OFF, ps_rows, tf.zeros([2, 3]), tf.constant([0]),
                                 tf.constant([1, 2]))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"ps_rows must hold one row per position of at_hot \(2\)"):
        bindings.geo_stitch_rows(OFF, ps_rows, tail_rows, tf.constant([0, 1]),
                                 tf.constant([2, 3]))

"""How tfpsx.keras cuts large weights: the partitioner's answer, checked before anything is
created (the cluster tests in tests/cluster/test_keras.py train partitioned models)."""

import pytest
import tensorflow as tf

from tfpsx.keras.partitioned import (DEFAULT_MIN_SHARD_BYTES, partitions, resolve_partitioner,
                                     slice_rows)

F32 = tf.float32


def test_the_default_cuts_large_weights_one_slice_per_server():
    auto = resolve_partitioner("auto", server_num=4)
    rows = DEFAULT_MIN_SHARD_BYTES // (4 * 64)  # rows of 64 floats in 256 KiB
    assert partitions(auto, "small", tf.TensorShape([rows - 1, 64]), F32) == 1
    assert partitions(auto, "two", tf.TensorShape([2 * rows, 64]), F32) == 2
    assert partitions(auto, "huge", tf.TensorShape([100 * rows, 64]), F32) == 4  # 4 servers
    assert partitions(auto, "scalar", tf.TensorShape([]), F32) == 1
    assert partitions(resolve_partitioner("auto", 1), "one server",
                      tf.TensorShape([100 * rows, 64]), F32) == 1


def test_no_partitioner_keeps_every_variable_whole():
    assert resolve_partitioner(None, 4) is None
    assert partitions(None, "w", tf.TensorShape([10 ** 6, 64]), F32) == 1


def test_tf_partitioners_are_taken_as_they_are():
    fixed = resolve_partitioner(tf.distribute.experimental.partitioners.FixedShardsPartitioner(3),
                                2)
    assert partitions(fixed, "w", tf.TensorShape([10, 4]), F32) == 3
    assert partitions(fixed, "bias", tf.TensorShape([1]), F32) == 1  # never more than rows


@pytest.mark.parametrize("answer,words", [
    ([1, 2], "only axis 0"),
    ([0, 1], "positive counts"),
    ([2], "a list of 2"),
    (None, "a list of 2"),
    ([11, 1], "more than its 10 rows"),
])
def test_a_bad_partitioner_answer_names_the_variable_and_what_was_expected(answer, words):
    with pytest.raises(ValueError, match=words) as e:
        partitions(lambda shape, dtype: answer, "dense/kernel", tf.TensorShape([10, 4]), F32)
    assert "dense/kernel" in str(e.value)


@pytest.mark.parametrize("value", [4, "even", 2.5])
def test_a_partitioner_that_is_not_one_is_refused(value):
    with pytest.raises(ValueError, match="variable_partitioner must be 'auto', None or a callable"):
        resolve_partitioner(value, 2)


def test_slices_are_as_even_as_possible():
    assert slice_rows(10, 3) == [4, 3, 3]
    assert slice_rows(6, 2) == [3, 3]
    assert sum(slice_rows(1001, 7)) == 1001

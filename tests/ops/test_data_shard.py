"""tfpsx.data.shard: equal steps on every rank, and one shared reshuffle each epoch."""

import numpy as np
import pytest
import tensorflow as tf

import tfpsx


def _epochs(part, n):
    it = [np.array([int(v) for v in part]) for _ in range(n)]
    return it


def test_an_uneven_dataset_gives_every_rank_the_same_count():
    data = tf.data.Dataset.range(103)
    parts = [list(tfpsx.data.shard(data, 4, i).as_numpy_iterator()) for i in range(4)]
    assert [len(p) for p in parts] == [25] * 4
    assert len(set().union(*parts)) == 100


def test_a_shared_seed_reshuffles_every_epoch_without_overlap():
    data = tf.data.Dataset.range(64)
    parts = [tfpsx.data.shard(data, 2, i, shuffle_buffer=64, seed=7) for i in range(2)]
    epochs = [_epochs(p, 3) for p in parts]
    for e in range(3):
        mine, theirs = epochs[0][e], epochs[1][e]
        assert len(mine) == len(theirs) == 32
        assert sorted(np.concatenate([mine, theirs])) == list(range(64))  # each once
    assert not np.array_equal(epochs[0][0], epochs[0][1])  # a new order each epoch
    again = _epochs(tfpsx.data.shard(data, 2, 0, shuffle_buffer=64, seed=7), 3)
    for e in range(3):
        np.testing.assert_array_equal(again[e], epochs[0][e])  # the seed decides it


@pytest.mark.parametrize("kwargs,words", [
    ({"shuffle_buffer": 64}, ["seed must be an int >= 0, got None", "same seed"]),
    ({"shuffle_buffer": 0, "seed": 1}, ["shuffle_buffer must be an int >= 1, got 0"]),
])
def test_bad_shuffle_arguments_are_clear_errors(kwargs, words):
    with pytest.raises(ValueError) as e:
        tfpsx.data.shard(tf.data.Dataset.range(8), 2, 0, **kwargs)
    for w in words:
        assert w in str(e.value)

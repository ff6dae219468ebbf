"""tfpsx.keras.ScaledLearningRate: the linear scaling rule with a warm-up."""

import keras
import numpy as np
import pytest

import tfpsx


def test_the_rate_ramps_to_the_scaled_one_and_stays():
    lr = tfpsx.keras.ScaledLearningRate(0.1, base_batch=32, global_batch=128, warmup_steps=10)
    values = [float(lr(s)) for s in (0, 5, 10, 1000)]
    np.testing.assert_allclose(values, [0.1, 0.25, 0.4, 0.4], rtol=1e-6)
    flat = tfpsx.keras.ScaledLearningRate(0.1, base_batch=32, global_batch=64)
    assert float(flat(0)) == pytest.approx(0.2)


def test_an_optimizer_uses_it_and_it_round_trips_through_a_config():
    lr = tfpsx.keras.ScaledLearningRate(0.01, 64, 256, warmup_steps=4)
    opt = keras.optimizers.SGD(lr)
    opt.iterations.assign(2)
    assert float(opt.learning_rate) == pytest.approx(0.01 + 0.03 * 0.5)
    again = keras.optimizers.SGD.from_config(opt.get_config())
    again.iterations.assign(2)
    assert float(again.learning_rate) == pytest.approx(float(opt.learning_rate))


@pytest.mark.parametrize("kwargs,words", [
    ({"base_lr": 0, "base_batch": 32, "global_batch": 64}, ["base_lr", "> 0", "0"]),
    ({"base_lr": 0.1, "base_batch": 32, "global_batch": 0}, ["global_batch", "> 0"]),
    ({"base_lr": 0.1, "base_batch": 32.0, "global_batch": 64}, ["base_batch", "32.0"]),
    ({"base_lr": 0.1, "base_batch": 32, "global_batch": 64, "warmup_steps": -1},
     ["warmup_steps", ">= 0", "-1"]),
])
def test_bad_arguments_are_clear_errors(kwargs, words):
    with pytest.raises(ValueError) as e:
        tfpsx.keras.ScaledLearningRate(**kwargs)
    for w in words:
        assert w in str(e.value)

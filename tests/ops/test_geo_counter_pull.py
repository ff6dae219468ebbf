"""GEO's rule for a variable that its step writes by a read and an assign (Keras 3's
``optimizer.iterations``, ``assign(self + 1)``; a weight under FTRL or a constraint):
rounds in another thread never lose a change of it; which weights of a Keras model are
such, and which optimizers assign the weights their moving average
(tfpsx.keras.read_assign)."""

import threading

import keras
import pytest
import tensorflow as tf

from tfpsx.modes.geo import GeoVariable, dense_pull, dense_push, fold_pulled

STEPS, ROUNDS, OTHERS = 6000, 1500, 3  # OTHERS: the steps another worker pushes a round


def _count_beside_rounds(pair, counter):
    @tf.function
    def step():
        fold_pulled(pair)  # (KerasGeo.before_step)
        counter.assign_add(1)  # Keras's: assign(self + 1)

    @tf.function
    def round_():
        other = pair.global_.assign_add(OTHERS)  # another worker's push
        with tf.control_dependencies([other]):
            pushed = dense_push(pair, 1)
        dense_pull(pair, [pushed])

    failed = []

    def rounds():
        try:
            for _ in range(ROUNDS):
                round_()
        except BaseException as e:  # (raised in the test's thread below)
            failed.append(e)

    thread = threading.Thread(target=rounds, daemon=True)
    thread.start()
    for _ in range(STEPS):
        step()
    thread.join(timeout=120)
    assert not thread.is_alive() and not failed, failed
    tf.function(lambda: dense_push(pair, 1) and None)()  # the final round's push
    return int(pair.global_.numpy())


def _pair(dtype):
    local, old, global_, pulled = (tf.Variable(tf.zeros([], dtype)) for _ in range(4))
    return GeoVariable(local, old, global_, pulled), keras.Variable(local)


# int64: the step count; float32: a weight that its step writes by a read and an assign
# (whole numbers: exact in float32 up to 2**24)
@pytest.mark.parametrize("dtype", [tf.int64, tf.float32])
def test_a_round_beside_keras_read_and_assign_increment_loses_no_step(dtype):
    """(Without ``pulled``, the pull adding to ``local`` itself, this lost 54 of 29,000
    steps here, 3,000 rounds: a pull between Keras's read and assign is overwritten.)"""
    pair, counter = _pair(dtype)
    assert _count_beside_rounds(pair, counter) == STEPS + OTHERS * ROUNDS
    # the worker's count: its steps and every pulled one, once folded in
    fold_pulled(pair)
    assert int(pair.local.numpy()) == STEPS + OTHERS * ROUNDS



def _model(optimizer):
    x = keras.Input((3,))
    constrained = keras.layers.Dense(4, kernel_constraint=keras.constraints.NonNeg())
    norm = keras.layers.BatchNormalization()
    plain = keras.layers.Dense(1)
    model = keras.Model(x, plain(norm(constrained(x))))
    model.compile(optimizer, "mse")
    return model, constrained, norm, plain


class _OwnAdam(keras.optimizers.Adam):
    """A user's optimizer (its update is not known to add)."""


@pytest.mark.parametrize("optimizer,adds", [
    (keras.optimizers.Adam(), True), (keras.optimizers.SGD(momentum=0.9), True),
    (keras.optimizers.AdamW(weight_decay=0.01), True), (keras.optimizers.Adagrad(), True),
    (keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()), True),
    (keras.optimizers.Ftrl(), False), (keras.optimizers.Muon(), False), (_OwnAdam(), False)],
    ids=["adam", "sgd", "adamw", "adagrad", "loss_scale_adam", "ftrl", "muon", "own"])
def test_the_weights_a_keras_step_writes_by_a_read_and_an_assign(optimizer, adds):
    """An optimizer that adds to the weights (its weight decay too): the constrained
    kernel; one that assigns them (FTRL; Muon's weight decay), or one not known: every
    trainable weight. Never a layer's non-trainable state (GEO does not pair it:
    BatchNormalization's moving statistics stay per worker)."""
    from tfpsx.keras.read_assign import read_and_assigned

    model, constrained, norm, plain = _model(optimizer)
    if adds:
        want = [(constrained.kernel.value, "a constraint")]
    else:
        assigned = f"its optimizer ({type(optimizer).__name__}) assigns them"
        want = [(v.value, assigned) for v in (constrained.kernel, constrained.bias, norm.gamma,
                                              norm.beta, plain.kernel, plain.bias)]
    assert read_and_assigned(model) == {id(v): why for v, why in want}


@pytest.mark.parametrize("optimizer,averages", [
    (keras.optimizers.Adam(), False), (keras.optimizers.Adam(use_ema=True), True),
    (keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(use_ema=True)), True),
    (keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()), False)],
    ids=["adam", "adam_ema", "loss_scale_sgd_ema", "loss_scale_sgd"])
def test_an_optimizer_that_assigns_the_weights_their_moving_average(optimizer, averages):
    """(GEO refuses it for its dense copies: tests/cluster/test_keras.py's misuse case.)
    A LossScaleOptimizer's is its inner optimizer's: its own use_ema stays False."""
    from tfpsx.keras.read_assign import averaging

    assert averaging(optimizer) is averages

"""tfpsx's fit callback (tfpsx.keras.fit.StrategyCallback) in a plain Keras fit, no
cluster: what it tells the strategy after each execution of the train function."""

import keras
import numpy as np
import pytest

from tfpsx.keras.fit import StrategyCallback


class RecordingStrategy:
    """The strategy side of the callback, recording what fit told it."""

    def __init__(self, stale_after=()):
        self.calls = []
        self.stale_after = list(stale_after)  # the batch_end calls after which the
        self.batches = 0  # mode's state changed (GEO's choice): the step is traced again

    def begin_fit(self, model, epoch_steps=None):
        self.calls.append("begin")
        self.epoch_steps = epoch_steps

    def batch_end(self, model, steps_left=None):
        self.calls.append(steps_left)
        self.batches += 1

    def steps_stale(self):
        return self.batches in self.stale_after

    def end_fit(self, model, failed=False):
        self.calls.append("end")

    def translating(self, step, *args, **kwargs):
        return step(*args, **kwargs)

    def flush_for_save(self):
        """(An exact save's flush at a step boundary: no input here has exact saves.)"""


@pytest.mark.parametrize("per_call,initial_epoch,expected", [
    (1, 0, list(range(14, -1, -1))),       # 3 epochs of 5 steps
    (2, 0, [13, 11, 10, 8, 6, 5, 3, 1, 0]),  # executions of 2 steps; an epoch's last of 1
    (1, 1, list(range(9, -1, -1))),        # resumed at the second epoch: 2 epochs left
])
def test_the_strategy_learns_the_steps_fit_has_left_after_each_execution(
        per_call, initial_epoch, expected):
    """GEO's schedule starts no background round it could not follow with K steps of
    training (tfpsx.modes.geo): fit's callback gives it the count."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse", steps_per_execution=per_call)
    strategy = RecordingStrategy()
    x, y = np.zeros((10, 3), np.float32), np.zeros((10, 1), np.float32)
    model.fit(x, y, batch_size=2, epochs=3, initial_epoch=initial_epoch, verbose=0,
              callbacks=[StrategyCallback(strategy)])
    assert strategy.calls == ["begin"] + expected + ["end"]
    assert strategy.epoch_steps == 5  # (GEO warns when K leaves too few rounds in one)


def test_an_epoch_of_unknown_length_leaves_the_count_unknown():
    import tensorflow as tf

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    strategy = RecordingStrategy()
    data = tf.data.Dataset.from_tensor_slices(
        (np.zeros((6, 3), np.float32), np.zeros((6, 1), np.float32))).batch(2).filter(
        lambda x, y: True)  # (a filter: no cardinality)
    model.fit(data, epochs=2, verbose=0, shuffle=False, callbacks=[StrategyCallback(strategy)])
    assert strategy.calls == ["begin"] + [None] * 6 + ["end"]
    assert strategy.epoch_steps is None


def test_an_epoch_of_unknown_length_from_splits_waits_for_its_ops_only_near_its_end(
        monkeypatch):
    """An epoch of unknown length may end at any step, so the wrapped step waits for its
    ops in flight (a remote error then comes out named, not from Keras's own wait at the
    epoch's end); that wait syncs the remote executors, a round trip to every server. An
    epoch from tfpsx.data.splits whose iteration still has splits to take is at least a
    split from its end: no wait (with it, the Criteo job ran 12% slower than a static
    cut)."""
    import tensorflow as tf

    from tfpsx import compat
    from tfpsx.control import splits

    waits = []
    monkeypatch.setattr(compat, "async_wait", lambda: waits.append(1))

    class Input:
        left = True

        def leases_left(self):
            return self.left

    source = Input()
    monkeypatch.setattr(splits, "registered", lambda: {"input": source})
    strategy = RecordingStrategy()
    strategy.extended = type("Extended", (), {"feeds_splits": True})()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    data = tf.data.Dataset.from_tensor_slices(
        (np.zeros((6, 3), np.float32), np.zeros((6, 1), np.float32))).batch(2).filter(
        lambda x, y: True)  # (a filter: no cardinality)
    model.fit(data, epochs=1, verbose=0, shuffle=False, callbacks=[StrategyCallback(strategy)])
    assert waits == []
    source.left = False  # its last split taken: every step may be the epoch's last
    model.fit(data, epochs=1, verbose=0, shuffle=False, callbacks=[StrategyCallback(strategy)])
    assert len(waits) == 2 * 3  # after each of the 3 steps, and after its callback's ops


def _counted(traced: list):
    """A compiled model whose train and test steps append "train" / "test" to ``traced``
    each time Keras traces them (Python in a step runs when it is traced)."""

    class Counted(keras.Sequential):
        def train_step(self, data):
            traced.append("train")
            return super().train_step(data)

        def test_step(self, data):
            traced.append("test")
            return super().test_step(data)

    model = Counted([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    return model


def test_a_step_whose_mode_changed_is_traced_again_before_the_next_step():
    """GEO's choice between rounds and async changed (a table's lookups go another way):
    the callback has Keras trace the train step again, once per change, and keeps
    wrapping it; evaluate traces its step anew too."""
    traced = []
    model = _counted(traced)
    x, y = np.ones((10, 3), np.float32), np.ones((10, 1), np.float32)
    model.evaluate(x, y, batch_size=2, verbose=0)
    strategy = RecordingStrategy(stale_after=[2, 4])
    callback = StrategyCallback(strategy)
    model.fit(x, y, batch_size=2, epochs=1, verbose=0, callbacks=[callback])
    assert traced.count("train") == 3  # the first trace, and after steps 2 and 4
    assert strategy.calls == ["begin", 4, 3, 2, 1, 0, "end"]
    assert callback._originals == {}  # fit's own step restored when it ended
    model.evaluate(x, y, batch_size=2, verbose=0)
    assert traced.count("test") == 2  # traced again: the first was for the old choice


def test_a_step_an_earlier_fit_traced_is_traced_again_when_the_mode_says_so_at_the_start():
    """GEO found, as the second fit began, weights to pull beside (a read-and-assign
    update: tfpsx.keras.read_assign) that the first fit's step does not fold in: the
    callback has Keras trace the step again before the second fit's first step, where
    Keras would reuse the first fit's."""
    traced = []
    model = _counted(traced)
    x, y = np.ones((10, 3), np.float32), np.ones((10, 1), np.float32)
    model.fit(x, y, batch_size=2, epochs=1, verbose=0,
              callbacks=[StrategyCallback(RecordingStrategy())])
    model.fit(x, y, batch_size=2, epochs=1, verbose=0,
              callbacks=[StrategyCallback(RecordingStrategy())])
    assert traced.count("train") == 1  # (Keras reuses the first fit's step)
    model.fit(x, y, batch_size=2, epochs=1, verbose=0,
              callbacks=[StrategyCallback(RecordingStrategy(stale_after=[0]))])
    assert traced.count("train") == 2

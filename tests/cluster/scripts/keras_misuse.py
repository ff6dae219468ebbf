"""Keras misuse on a 1 PS + 1 worker cluster: each case's error, in one "misuse" record."""
import sys

import keras
import numpy as np

import tfpsx

tfpsx.init()
if tfpsx.is_server():
    tfpsx.run_server()
    sys.exit(0)
errors = {}


def record(case, fn):
    try:
        fn()
        errors[case] = None
    except Exception as e:  # noqa: BLE001 — the test reads type and message
        errors[case] = f"{type(e).__name__}: {e}"


record("before_init_worker", lambda: tfpsx.keras.ParameterServerStrategy())
tfpsx.init_worker()
keras_own = {name: getattr(keras.Model, name) for name in ("fit", "evaluate", "predict")}
strategy = tfpsx.keras.ParameterServerStrategy()
untouched = {name: getattr(keras.Model, name) is keras_own[name] for name in keras_own}
x, y = np.ones((8, 2), np.float32), np.ones((8, 1), np.float32)


def dense_model():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    return model


def outside_scope():
    """A model built elsewhere trains locally, as Keras trains it: its weights change and
    no variable of it is on a parameter server."""
    model = dense_model()
    model.compile(keras.optimizers.SGD(0.1), "mse")
    before = model.get_weights()[0].copy()
    history = model.fit(x, y, epochs=3, verbose=0)
    assert not np.allclose(before, model.get_weights()[0]), "did not train"
    assert history.history["loss"][-1] < history.history["loss"][0], history.history
    devices = {v.value.device for v in model.weights}
    assert all("job:ps" not in d for d in devices), devices
    model.evaluate(x, y, verbose=0)
    model.predict(x, verbose=0)


def compiled_outside():
    with strategy.scope():
        model = dense_model()
    model.compile("sgd", "mse")
    model.fit(x, y, verbose=0, callbacks=strategy.callbacks())


def jit():
    with strategy.scope():
        model = dense_model()
        model.compile("sgd", "mse", jit_compile=True)
    model.fit(x, y, verbose=0, callbacks=strategy.callbacks())


def accumulation():
    with strategy.scope():
        model = dense_model()
        model.compile(keras.optimizers.SGD(0.1, gradient_accumulation_steps=4), "mse")
    model.fit(x, y, verbose=0, callbacks=strategy.callbacks())


class Subclassed(keras.Model):
    """Its weights are made at its first call, not when it is constructed."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)

    def call(self, inputs):
        return self.dense(inputs)


def built_outside(optimizer):
    """A subclassed model constructed in the scope but first called (built) outside it,
    then compiled in it: Adam's slots cannot go beside a weight made elsewhere (TF's own
    error named nothing to do), and with SGD it would train on this worker alone."""
    def case():
        with strategy.scope():
            model = Subclassed()
        model(x[:1])  # its weights are made here, outside the scope
        with strategy.scope():
            model.compile(optimizer, "mse")
        model.fit(x, y, verbose=0, callbacks=strategy.callbacks())
    return case


def fine():
    with strategy.scope():
        model = dense_model()
        model.compile("sgd", "mse")
    model.fit(x, y, verbose=0, callbacks=strategy.callbacks())
    model.evaluate(x, y, verbose=0)  # evaluate and predict need no callbacks
    model.predict(x, verbose=0)


def without_callbacks():
    with strategy.scope():
        model = dense_model()
        model.compile("sgd", "mse")
    model.fit(x, y, verbose=0)


def callbacks_then_without():
    # The second fit reuses the step the first traced: the check runs in the step.
    with strategy.scope():
        model = dense_model()
        model.compile("sgd", "mse")
    model.fit(x, y, verbose=0, callbacks=strategy.callbacks())
    model.fit(x, y, verbose=0)


record("outside_scope", outside_scope)
record("compiled_outside", compiled_outside)
record("jit_compile", jit)
record("gradient_accumulation", accumulation)
record("built_outside_adam", built_outside("adam"))
record("built_outside_sgd", built_outside("sgd"))
record("fine", fine)
record("without_callbacks", without_callbacks)
record("callbacks_then_without", callbacks_then_without)
def splits_in(options, exact=False):
    """fit from tfpsx.data.splits under a strategy whose steps take every worker's
    batch (or, with ``exact``, exact saves in the hybrid or GEO's deterministic rounds:
    the save's barrier would hold the others inside their step): refused when the step
    is traced, before it trains."""
    def case():
        import os
        import tempfile

        import tensorflow as tf

        folder = tempfile.mkdtemp(prefix="tfpsx_misuse_")
        with open(os.path.join(folder, "part-0.txt"), "w") as f:
            f.write("1,2,3\n" * 64)

        def parse(lines):
            values = tf.strings.to_number(tf.strings.split(lines, ",").to_tensor(), tf.float32)
            return values[:, :2], values[:, 2:]

        data = tfpsx.data.splits(os.path.join(folder, "part-*.txt"), parse, 8,
                                 split_bytes=64, exact_saves=exact,
                                 name=f"misuse_{options.get('dense', 'sync')}_{exact}")
        other = tfpsx.keras.ParameterServerStrategy(tfpsx.DistributedStrategy(**options))
        with other.scope():
            model = dense_model()
            model.compile("sgd", "mse")
        model.fit(data, verbose=0, callbacks=other.callbacks())
    return case


def geo_with_ema():
    """GEO at 1 worker keeps dense copies: an EMA's overwrite would be pushed as training."""
    geo = tfpsx.keras.ParameterServerStrategy(tfpsx.DistributedStrategy(
        a_sync=True, a_sync_configs={"k_steps": 4}))
    with geo.scope():
        model = dense_model()
        model.compile(keras.optimizers.Adam(0.01, use_ema=True), "mse")
    before = model.get_weights()[0].copy()
    try:
        model.fit(x, y, verbose=0, callbacks=geo.callbacks())
    finally:  # refused before a step: the weights are as they were
        errors["geo_with_ema_untouched"] = bool(np.array_equal(before,
                                                               model.get_weights()[0]))


record("geo_with_ema", geo_with_ema)
record("bad_options", lambda: tfpsx.keras.ParameterServerStrategy(
    tfpsx.DistributedStrategy(a_sync=True, a_sync_configs={"k_step": 3})))
record("splits_exact_hybrid_geo", splits_in({"dense": "allreduce", "a_sync": True,
                                            "a_sync_configs": {"k_steps": 4}}, exact=True))
record("splits_exact_geo_in_step", splits_in(
    {"a_sync": True, "a_sync_configs": {"k_steps": 4, "geo_sync_in_train_thread": True}},
    exact=True))
errors["untouched"] = untouched
tfpsx.metrics.emit("misuse", **errors)
tfpsx.stop_worker()

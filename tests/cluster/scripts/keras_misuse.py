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
strategy = tfpsx.keras.ParameterServerStrategy()
x, y = np.ones((8, 2), np.float32), np.ones((8, 1), np.float32)


def dense_model():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    return model


def outside_scope():
    model = dense_model()
    model.compile("sgd", "mse")
    model.fit(x, y, verbose=0)


def compiled_outside():
    with strategy.scope():
        model = dense_model()
    model.compile("sgd", "mse")
    model.fit(x, y, verbose=0)


def jit():
    with strategy.scope():
        model = dense_model()
        model.compile("sgd", "mse", jit_compile=True)
    model.fit(x, y, verbose=0)


def accumulation():
    with strategy.scope():
        model = dense_model()
        model.compile(keras.optimizers.SGD(0.1, gradient_accumulation_steps=4), "mse")
    model.fit(x, y, verbose=0)


def fine():
    with strategy.scope():
        model = dense_model()
        model.compile("sgd", "mse")
    model.fit(x, y, verbose=0)


record("outside_scope", outside_scope)
record("compiled_outside", compiled_outside)
record("jit_compile", jit)
record("gradient_accumulation", accumulation)
record("fine", fine)
record("bad_options", lambda: tfpsx.keras.ParameterServerStrategy(
    tfpsx.DistributedStrategy(a_sync=True, a_sync_configs={"k_step": 3})))
tfpsx.metrics.emit("misuse", **errors)
tfpsx.stop_worker()

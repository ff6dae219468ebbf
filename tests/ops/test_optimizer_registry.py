"""The op library's optimizer registry is the single source of truth: the Python specs
are checked against it, and a mismatch names both sides."""

import pytest

from tfpsx.embedding import optimizers
from tfpsx.ops import bindings


def test_the_python_specs_match_the_library_they_run_on():
    native = bindings.optimizer_registry()
    assert [name for name, _, _ in native] == list(optimizers.OPTIMIZERS)
    optimizers.check_registry(native)  # raises on any difference
    for name, slots, hparams in native:
        spec = optimizers.OPTIMIZERS[name]()
        assert len(spec.slot_init) == slots
        # hyperparameters() sends the spec's values in the library's order
        assert spec.hyperparameters().numpy().tolist() == pytest.approx(
            [float(getattr(spec, h)) for h in hparams])


def _with(native, name, slots=None, hparams=None):
    return [(n, slots if n == name and slots is not None else k,
             hparams if n == name and hparams is not None else h) for n, k, h in native]


@pytest.mark.parametrize("change, message", [
    (lambda r: _with(r, "adam", hparams=("learning_rate", "beta2", "beta1", "epsilon")),
     r"'adam': the op library takes hyperparameters \[learning_rate, beta2, beta1, epsilon\], "
     r"Adam sends \[learning_rate, beta1, beta2, epsilon\]"),
    (lambda r: _with(r, "adagrad", slots=2),
     r"'adagrad': the op library keeps 2 slot\(s\), Adagrad initializes 1"),
    (lambda r: r + [("rmsprop", 2, ("learning_rate", "rho"))],
     r"'rmsprop' is in the op library's registry but has no Python spec"),
    (lambda r: [e for e in r if e[0] != "ftrl"],
     r"'ftrl' has a Python spec \(Ftrl\) but is not in the op library's registry"),
])
def test_a_mismatch_is_an_error_naming_both_sides(change, message):
    with pytest.raises(optimizers.RegistryMismatchError, match=message):
        optimizers.check_registry(change(bindings.optimizer_registry()))


def test_a_table_optimizer_is_checked_when_first_resolved(monkeypatch):
    monkeypatch.setattr(optimizers, "_checked", False)
    monkeypatch.setattr(bindings, "optimizer_registry",
                        lambda: [("sgd", 0, ("lr",))])
    with pytest.raises(optimizers.RegistryMismatchError, match=r"'sgd': the op library takes "
                       r"hyperparameters \[lr\], SGD sends \[learning_rate\]"):
        optimizers.resolve("sgd")

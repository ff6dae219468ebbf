"""How a new key's row is drawn: a pure function of (seed, key), so every PS and every
restart draws the same row (the math is the C++ core's ``initializer.h``)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Initializer:
    """A table's initializer: ``kind`` (zeros, constant, uniform, normal) and its two
    parameters (constant value / uniform low / normal mean, uniform high / normal stddev)."""
    kind: str
    a: float = 0.0
    b: float = 0.0


def zeros() -> Initializer:
    return Initializer("zeros")


def constant(value: float) -> Initializer:
    return Initializer("constant", float(value))


def uniform(minval: float = -0.05, maxval: float = 0.05) -> Initializer:
    if not minval < maxval:
        raise ValueError(f"uniform initializer: expected minval < maxval, got {minval}, {maxval}")
    return Initializer("uniform", float(minval), float(maxval))


def normal(mean: float = 0.0, stddev: float = 0.05) -> Initializer:
    if stddev < 0:
        raise ValueError(f"normal initializer: expected stddev >= 0, got {stddev}")
    return Initializer("normal", float(mean), float(stddev))

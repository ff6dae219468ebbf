"""The keras_ctr example's data: numpy only, so the tf-keras peer benchmark
(benchmarks/keras_tfkeras_pss.py) trains on exactly the same examples."""

import numpy as np

FEATURES, TAGS, WIDTH = 16, 1000, 6


def click_data(seed: int, n: int, users: int):
    """Dense features, a user id string, tags padded with -1, and a planted click."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype(np.float32)
    user = rng.integers(0, users, size=n)
    tags = rng.integers(0, TAGS, size=(n, WIDTH))
    tags[rng.random((n, WIDTH)) < 0.4] = -1
    valid = tags >= 0
    score = (x @ np.linspace(-1.0, 1.0, FEATURES) + np.where(user % 3 == 0, 1.5, -0.8)
             + np.where(valid, np.where(tags % 2 == 0, 1.2, -1.2), 0).sum(1) / np.maximum(
                 valid.sum(1), 1))
    label = (score > 0).astype(np.float32)[:, None]
    names = np.array([f"user-{u}" for u in user], dtype=object)[:, None]
    return {"x": x, "user": names, "tags": tags.astype(np.int64)}, label

"""geo_pull_ahead's rule (tfpsx.modes.geo.ahead) without a cluster: which rounds pull
ahead, the window they read, and the keys' bytes a round counts."""

import types

import numpy as np

from tfpsx.modes.geo.ahead import AheadPulls, key_bytes, read_ahead_depth, window_steps
from tfpsx.modes.geo.choice import IDLE, PULL, SKIP


def test_every_s_rounds_ahead_one_pulls_every_changed_row_and_a_short_read_resets():
    asked = []

    def window(first, length):
        asked.append((first, length))
        return None if first == 30 else [np.array([first, first + 1], np.int64)]

    ahead = AheadPulls(every=2, depth=40)
    ahead.begin(reading=True, k_steps=10, per_call=2)
    assert ahead.steps == window_steps(10, 2) == 2 * 10 + 2 * 2 + 2
    counted = types.SimpleNamespace(n=0, add=lambda pulls_ahead: setattr(
        counted, "n", counted.n + pulls_ahead))
    got = [ahead.among(s, window, counted) for s in (0, 10, 20, 30, 40, 50, 60)]
    # ahead, ahead, every row (after 2 ahead); at 30 the input was not read that far:
    # every row, and the count starts again: ahead at 40 and 50, every row at 60
    assert [g is not None for g in got] == [True, True, False, False, True, True, False]
    assert [int(g[0][0]) for g in got if g is not None] == [0, 10, 40, 50]
    assert counted.n == 4
    assert (30, 26) in asked and (20, 26) not in asked  # (20: the 3rd round, none asked)


def test_the_depth_covers_the_window_at_the_largest_k_and_the_keys_count_where_they_travel():
    auto = types.SimpleNamespace(k_auto=True, k_steps=10)
    assert read_ahead_depth(auto, 4) == 2 * (20 // 4) + 8
    assert read_ahead_depth(types.SimpleNamespace(k_auto=False, k_steps=7), 4) == 22
    assert window_steps(20 // 4, 1) <= read_ahead_depth(auto, 4)
    tables = [types.SimpleNamespace(cached=c) for c in (False, True, False, False)]
    among = [np.zeros(3), np.zeros(5), np.zeros(7), np.zeros(11)]
    # a worker cache's pull and an async table's (SKIP, IDLE) send no keys
    assert key_bytes(tables, among, [PULL, PULL, SKIP, PULL]) == 8 * (3 + 11)
    assert key_bytes(tables, among, [PULL, PULL, PULL, IDLE]) == 8 * (3 + 7)
    assert key_bytes(tables, among, None) == 8 * (3 + 7 + 11)
    assert key_bytes(tables, None, None) == 0

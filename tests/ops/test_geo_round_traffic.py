"""benchmarks/geo_round_traffic.py, the replay of a job's ids through GEO's choice of hot
rows (issue 40): its counts on streams whose answer is known by hand."""

import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import geo_round_traffic as traffic  # noqa: E402

A, B, C = (np.arange(26, dtype=np.int64) + base for base in (0, 100, 200))


def _replay(lines, hot_count=100):
    # 2 workers, rounds of 2 steps, one line a step; bound 1000: no row is contended
    return traffic.replay(np.stack(lines), n=2, k=2, batch=1, bound=1000,
                          hot_count=hot_count, width=1 << 10)


def test_a_round_pushes_a_repeated_row_once_and_pulls_the_others_rows():
    # worker 0 (lines 0, 2) meets A twice; worker 1 (lines 1, 3) meets B, then C
    r = _replay([A, B, A, C])
    per = 2 * 2  # workers x steps
    assert r["step_rows"] == 26
    assert r["pushed"] == (26 + 52) / per
    assert r["pulled"] == (52 + 26) / per        # each pulls the other's rows
    assert r["reuse"] == 26 / ((26 + 52) / per)
    assert r["async"] == 2 * 26                  # a read and a gradient a row and step
    assert r["rule"] == 2 * r["pushed"] + 2 * r["pulled"]  # rows with their slots
    assert r["earlier"] == r["pushed"] + r["pulled"]


def test_a_hot_row_trains_on_the_ps_every_step_and_every_worker_pulls_it():
    hot = np.full(26, 999, np.int64)             # one id, 26 times in its batch
    r = _replay([hot, B, A, C], hot_count=4)
    per = 4
    assert r["hot_steps"] == 1 / per
    assert r["pushed"] == (26 + 52) / per        # the hot row is not pushed
    # worker 0 pulls B, C and the hot row; worker 1 pulls A and the hot row
    assert r["pulled"] == (53 + 27) / per
    assert r["hot_pulled"] == 2 / per
    assert r["rule"] == 2 * r["hot_steps"] + 2 * r["pushed"] + 2 * r["pulled"]
    # the earlier rule has no hot rows: the row is pushed and pulled as any
    assert r["earlier"] == (27 + 52 + 52 + 27) / per


def test_a_contended_row_trains_on_the_ps_until_its_rate_shows():
    # K x N = 4 > bound 1: every row starts hot (the estimate's start), as in the product
    r = traffic.replay(np.stack([A, B, A, C]), n=2, k=2, batch=1, bound=1,
                       hot_count=100, width=1 << 10)
    assert r["hot_steps"] > 0
    assert r["step_rows"] == 26

"""Counters and the JSON-lines sink that examples, tests and benchmarks read."""

import pytest

from tfpsx import metrics


class _Demo(metrics.Counters):
    GROUP = "demo"
    FIELDS = ("events", "bytes")


class _Gone(metrics.Counters):
    GROUP = "gone"
    FIELDS = ("events",)


def test_counters_add_snapshot_and_group_sums():
    a, b = _Demo(), _Demo()
    a.add(events=1, bytes=10)
    b.add(events=2)
    assert a.events == 1 and a.snapshot() == {"events": 1, "bytes": 10}
    assert metrics.snapshot()["demo"] == {"events": 3, "bytes": 10}
    with pytest.raises(KeyError, match=r"no counter\(s\) \['rows'\].*events"):
        a.add(rows=1)


def test_the_registry_is_bounded_and_keeps_the_totals_of_groups_that_are_gone():
    from tfpsx.metrics import counters

    before = metrics.snapshot().get("gone", {}).get("events", 0)
    live = len(counters._REGISTRY)
    for _ in range(1000):
        _Gone().add(events=2)  # each dies at once
    keep = _Gone()
    keep.add(events=1)
    assert len(counters._REGISTRY) <= live + 1  # not 1001 more
    assert metrics.snapshot()["gone"]["events"] == before + 2001


def test_emit_appends_records_that_read_returns(tmp_path, monkeypatch):
    monkeypatch.setenv("TFPSX_METRICS_DIR", str(tmp_path))
    metrics.set_identity("worker", 3)
    try:
        metrics.emit("eval", step=10, loss=0.5)
        metrics.emit("other", x=1)
        metrics.emit("eval", step=20, loss=0.25)
    finally:
        metrics.set_identity(None, None)
    got = metrics.read(str(tmp_path), "worker", 3, "eval")
    assert [(r["step"], r["loss"]) for r in got] == [(10, 0.5), (20, 0.25)]
    assert got[0]["role"] == "worker" and got[0]["rank"] == 3
    assert len(metrics.read(str(tmp_path), "worker", 3)) == 3
    assert metrics.read(str(tmp_path), "worker", 9) == []


def test_emit_without_a_folder_only_returns_the_record(tmp_path, monkeypatch):
    monkeypatch.delenv("TFPSX_METRICS_DIR", raising=False)
    record = metrics.emit("eval", loss=1.0)
    assert record["event"] == "eval" and record["loss"] == 1.0

"""The word2vec example end to end through the launcher (1 PS + 2 workers)."""

import os
import subprocess
import sys

import pytest

import tfpsx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN = [sys.executable, "-m", "tfpsx.launcher.run"]


@pytest.mark.budget(40, why="the word2vec example under tfpsx-run: a scheduler, 1 PS, 2 workers")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode,extra", [
    # the rounds' pulls read ahead the sampled batches' ids (tfpsx.GeoReadAhead)
    ("geo", ["--geo_pull_ahead", "2"]), pytest.param("sync", [], marks=pytest.mark.slow),
    # a worker cache of a quarter of the vocabulary staged 4 batches per run, the
    # chief's eval loss every 100 steps
    pytest.param("async", ["--cache_size", "500", "--stage_batches", "4", "--eval_every", "100"],
                 marks=pytest.mark.slow),
    # the corpus's sentences read split by split (tfpsx.data.splits), one epoch
    pytest.param("async", ["--input", "splits", "--epochs", "1"], marks=pytest.mark.slow)])
def test_word2vec_learns_the_planted_topics(tmp_path, mode, extra):
    proc = subprocess.run(
        RUN + ["--server_num", "1", "--worker_num", "2", "--log_dir", str(tmp_path),
               "--timeout", "240", os.path.join(ROOT, "examples/word2vec/train.py"),
               "--mode", mode, "--k_steps", "50", "--steps", "300"] + extra,
        capture_output=True, text=True, timeout=280, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if "--geo_pull_ahead" in extra:  # every worker's rounds read 2 x 50 + 4 batches ahead
        logs = "".join(open(os.path.join(tmp_path, f"workerlog.{i}")).read() for i in range(2))
        assert logs.count("a round pulls the changed rows among the ids of the next 104 "
                          "batches (read ahead), every changed row after 2 such rounds") == 2
    if "splits" in extra:
        # Every pair of every sentence trained once: the workers' pairs sum to the
        # corpus's (counted here: each word with its neighbours within the window of 2).
        with open(os.path.join(ROOT, "examples/word2vec/corpus.txt")) as f:
            lengths = [len(line.split()) for line in f]
        pairs = sum(min(n, i + 3) - max(0, i - 2) - 1 for n in lengths for i in range(n))
        got = [tfpsx.metrics.read(str(tmp_path), "worker", i, "word2vec")[-1] for i in range(2)]
        assert sum(r["examples"] for r in got) == pairs, (pairs, got)
        assert all(r["input_stats"]["leases"] >= 1 for r in got), got
    for i in range(2):
        r = tfpsx.metrics.read(str(tmp_path), "worker", i, "word2vec")[-1]
        # Before training: loss 6 x log(2) = 4.16 per pair, topic similarity gap ~0.
        assert r["eval_loss"] < 3.0, r
        assert r["similarity_gap"] > 0.2, r
        assert r["vocab_rows"] == 2000  # every word got a row: ids are word hashes
        if mode == "geo":
            assert r["pushes"] >= 300 // 50
            # Two rounds of three pull ahead, the third and the final one every changed
            # row (a round may end early: then it ran as one more of the pattern).
            assert 2 <= r["pulls_ahead"] <= r["pushes"] - (r["pushes"] + 2) // 3, r
        if mode == "async" and "splits" not in extra:
            # Every step of both workers counted (with a cache: by the stagers, not the steps).
            assert r["global_step"] == 2 * 300, r
        if "--eval_every" in extra:
            # The chief's view of the shared tables during training (every 100 steps,
            # then after every worker's last push), its pauses left out of the timeline.
            points = r["points"]
            if i == 0:
                assert [p["step"] for p in points] == [100, 200, 300, 300], points
                # The PS's rows: with a cache, as of its last sync every 100 steps, which
                # runs beside the steps: at step 100 the first may not have landed (the
                # untrained 6 x log(2) = 4.16); from step 200 on, below it.
                assert all(p["loss"] < 4.0 for p in points[1:]), points
                assert all(a["seconds"] <= b["seconds"] for a, b in zip(points, points[1:]))
            else:
                assert points == [], points

"""The first-contact rule (tfpsx.control.eager_anchor): eager clients that reach a server at
one instant never crash it (TF's CreateContext race, docs/eager-anchor.md).

Without the rule, 4 plain-TF clients connecting together killed the server (SIGSEGV) in 3
of 6 rounds with MALLOC_PERTURB_ on the server (it poisons freed memory, so the
use-after-free crashes at once instead of by chance): two rounds here catch a regression
3 times in 4, and every later round of the suite's Keras tests adds to that.
"""
import os
import time

import pytest

from conftest import wait_for_log

ROUNDS = 2


@pytest.mark.timeout(420)
@pytest.mark.parametrize("servers,workers", [(1, 4), (2, 3)])
def test_keras_workers_connecting_at_one_instant_never_crash_a_server(
        make_cluster, tmp_path, servers, workers):
    for round_ in range(ROUNDS):
        go = tmp_path / f"go{servers}.{round_}"
        c = make_cluster(servers, workers, script="connect_together.py", timeout=180,
                         env={"GO_FILE": str(go), "TFPSX_HEARTBEAT_TIMEOUT": "20"})
        for s in range(servers):
            c.start_task("server", s, extra_env={"MALLOC_PERTURB_": "165"})
        for w in range(workers):
            c.start_task("worker", w)
        for w in range(workers):
            wait_for_log(c, "worker", w, "READY", timeout=150)
        go.write_text(f"{time.time() + 0.5:.6f}")
        codes = c.wait()
        logs = c.logs()
        assert "fatal SIGSEGV" not in logs, logs
        assert all(code == 0 for code in codes.values()), f"round {round_}: {codes}\n{logs}"
        for w in range(workers):
            assert "WORKER_OK" in c.log("worker", w), logs
        # Every worker began its connect at the start time: the test made the creations
        # overlap, it did not only run a cluster.
        late = [float(c.log("worker", w).split("CONNECTING ")[1].split(" s")[0])
                for w in range(workers)]
        assert max(late) < 0.3, late

"""The first-contact rule (tfpsx.control.eager_anchor): eager clients that reach a server at
one instant never crash it (TF's CreateContext race, docs/eager-anchor.md).

The storm test drives the race itself: 8 contexts created on the server by 8 threads
released together, a NoOp run in each (a new kernel: the use of a freed manager), all
closed (so a server without the anchor has no context again), 30 rounds. A plain
tf.distribute.Server with MALLOC_PERTURB_ (freed memory poisoned: a use-after-free crashes
at once) died of SIGSEGV within 3 rounds in 3 of 3 runs on the 2-core machine; a
tfpsx server lives through all 30. The Keras test runs the user's path: workers whose
connects begin at one instant.
"""
import random
import threading
import time

import grpc
import pytest
from tensorflow.core.protobuf import tensorflow_server_pb2

from conftest import wait_for_log
from tfpsx.control.proto import tf_eager_pb2 as pb

CONTEXTS, STORM_ROUNDS = 8, 30


@pytest.mark.timeout(420)
@pytest.mark.slow
@pytest.mark.parametrize("servers,workers,rounds", [
    (1, 4, 1),
    # Two servers, each anchored, and a second round on a fresh cluster.
    pytest.param(2, 3, 2, marks=pytest.mark.slow)])
def test_keras_workers_connecting_at_one_instant_never_crash_a_server(
        make_cluster, tmp_path, servers, workers, rounds):
    """Each round a new cluster: a cluster of its own because the servers must start with
    MALLOC_PERTURB_ in their environment (glibc reads it at start) and the workers hold
    their connects for one instant."""
    for round_ in range(rounds):
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


def _rpc(channel, method, request_type, response_type):
    return channel.unary_unary(f"/tensorflow.eager.EagerService/{method}",
                               request_serializer=request_type.SerializeToString,
                               response_deserializer=response_type.FromString)


def context_storm(address: str, contexts: int, rounds: int) -> None:
    """``rounds`` times: ``contexts`` CreateContext requests released at one instant, a
    NoOp in each new context, then every one closed. Raises grpc.RpcError when the
    server stops answering."""
    server_def = tensorflow_server_pb2.ServerDef(job_name="ps", task_index=0, protocol="grpc")
    server_def.cluster.job.add(name="ps").tasks[0] = address
    raw = server_def.SerializeToString()
    channels = [grpc.insecure_channel(address) for _ in range(contexts)]
    try:
        for _ in range(rounds):
            ids = [random.getrandbits(63) | 1 for _ in range(contexts)]
            release, failures = threading.Barrier(contexts), []

            def client(i):
                release.wait(timeout=30)
                try:
                    _rpc(channels[i], "CreateContext", pb.CreateContextRequest,
                         pb.CreateContextResponse)(
                        pb.CreateContextRequest(server_def=raw, context_id=ids[i]), timeout=30)
                    enqueue = pb.EnqueueRequest(context_id=ids[i])
                    enqueue.queue.add().operation.CopyFrom(pb.Operation(
                        id=1, name="NoOp", device="/job:ps/replica:0/task:0/device:CPU:0"))
                    _rpc(channels[i], "Enqueue", pb.EnqueueRequest, pb.EnqueueResponse)(
                        enqueue, timeout=30)
                except grpc.RpcError as e:
                    failures.append(e)

            threads = [threading.Thread(target=client, args=(i,)) for i in range(contexts)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            if failures:
                raise failures[0]
            for i, channel in enumerate(channels):
                _rpc(channel, "CloseContext", pb.CloseContextRequest, pb.CloseContextResponse)(
                    pb.CloseContextRequest(context_id=ids[i]), timeout=30)
    finally:
        for channel in channels:
            channel.close()


@pytest.mark.timeout(240)
def test_a_storm_of_simultaneous_contexts_never_crashes_a_tfpsx_server(make_cluster):
    c = make_cluster(1, 1, timeout=200, env={"TFPSX_REGISTER_TIMEOUT": "180"})
    c.start_task("server", 0, extra_env={"MALLOC_PERTURB_": "165"})
    wait_for_log(c, "server", 0, "serving at", timeout=120)
    context_storm(c.servers[0], CONTEXTS, STORM_ROUNDS)
    time.sleep(0.5)
    assert c.procs[("server", 0)].poll() is None, c.logs()
    assert "fatal SIGSEGV" not in c.logs(), c.logs()


@pytest.mark.timeout(240)
def test_a_worker_waiting_for_the_anchor_of_a_killed_server_fails_naming_it(make_cluster):
    from tfpsx import errors
    from tfpsx.control import eager_anchor

    c = make_cluster(1, 1, timeout=200, env={"TFPSX_REGISTER_TIMEOUT": "180"})
    c.start_task("server", 0)
    wait_for_log(c, "server", 0, "serving at", timeout=120)
    eager_anchor.wait_anchored({"ps:0": c.servers[0]}, timeout=10)  # anchored while alive
    c.kill("server", 0)  # SIGKILL
    started = time.monotonic()
    with pytest.raises(errors.ClusterTimeoutError,
                       match=rf"ps:0 at {c.servers[0]} does not answer \(UNAVAILABLE\)"):
        eager_anchor.wait_anchored({"ps:0": c.servers[0]}, timeout=3)
    assert time.monotonic() - started < 10

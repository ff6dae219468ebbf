"""The scheduler service and its client, in one process over real gRPC on 127.0.0.1."""

import logging
import re
import subprocess
import threading
import time

import grpc
import pytest
from concurrent import futures

from tfpsx import cluster, errors
from tfpsx.control.proto import scheduler_pb2_grpc as pb_grpc
from tfpsx.control.journal import Journal
from tfpsx.control.sched_client import SchedulerClient
from tfpsx.control.scheduler import SchedulerService, serve
from tfpsx.control.tls import TlsConfig
from tfpsx.testing import pick_ports

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def sched():
    """Starts a scheduler service; yields a factory of (service, client maker)."""
    servers = []

    def start(server_num=2, worker_num=2, token=None, heartbeat_timeout=60.0, tls=None,
              journal=None, address=None, max_worker_num=None):
        service = SchedulerService(server_num, worker_num, token, heartbeat_timeout, journal,
                                   max_worker_num=max_worker_num)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        pb_grpc.add_SchedulerServicer_to_server(service, server)
        service.grpc_server = server  # a test stops it to kill "the scheduler"
        address = address or f"127.0.0.1:{pick_ports(1)[0]}"
        if tls:
            server.add_secure_port(address, tls.server_credentials())
        else:
            server.add_insecure_port(address)
        server.start()
        servers.append(server)
        info = cluster.SchedulerInfo(address, server_num, worker_num, token)

        def client(role, node_id, client_token=token, client_tls=tls):
            return SchedulerClient(cluster.SchedulerInfo(address, server_num, worker_num,
                                                         client_token),
                                   role, rpc_timeout=5, tls=client_tls, node_id=node_id)
        return service, client, info

    yield start
    for server in servers:
        server.stop(grace=0)


def _addr(i):
    return f"127.0.0.1:{20000 + i}"


def test_ranks_in_arrival_order_and_stable_on_retry(sched, caplog):
    caplog.set_level(logging.INFO, logger="tfpsx")
    service, client, _ = sched(server_num=2, worker_num=3)
    got = [client(role, f"n{i}").register(_addr(i), None, 5)[0]
           for i, role in enumerate(["worker", "server", "worker", "server"])]
    assert got == [0, 0, 1, 1]
    # A retry of node n2 (same id) keeps its rank even though worker rank 2 is still free.
    assert client("worker", "n2").register(_addr(2), None, 5)[0] == 1
    assert "assigned server rank 1 to 127.0.0.1:20003" in caplog.text
    assert client("worker", "n4").register(_addr(4), None, 5)[0] == 2
    assert "cluster ready: 2 servers, 3 workers in" in caplog.text
    servers, workers, started_with = client("worker", "n0").wait_cluster(5)
    assert servers == (_addr(1), _addr(3)) and workers == (_addr(0), _addr(2), _addr(4))
    assert started_with == 3


def test_workers_beyond_the_start_join_up_to_the_maximum(sched, caplog):
    caplog.set_level(logging.INFO, logger="tfpsx")
    service, client, _ = sched(server_num=1, worker_num=2, max_worker_num=4)
    for i, role in enumerate(["server", "worker", "worker"]):
        client(role, f"n{i}").register(_addr(i), None, 5)
    assert service.ready()
    joiner = client("worker", "late")
    with pytest.raises(errors.SchedulerRejectedError, match="rank 3 joins the job but rank 2 "
                       "is free; a joining worker takes the next rank"):
        joiner.register(_addr(3), 3, 5)
    assert joiner.register(_addr(3), None, 5)[0] == 2
    assert "worker 127.0.0.1:20003 joins the running job as rank 2 (3 of at most 4" in \
        caplog.text
    servers, workers, started_with = joiner.wait_cluster(5)
    assert workers == (_addr(1), _addr(2), _addr(3)) and started_with == 2
    second = client("worker", "second")
    assert second.register(_addr(4), None, 5)[0] == 3
    with pytest.raises(errors.SchedulerRejectedError, match="too many workers: "
                       "TFPSX_MAX_WORKER_NUM is 4 and ranks 0..3 are taken"):
        client("worker", "one-more").register(_addr(5), None, 5)
    # The job ends when every worker, the joiners included, finished or died.
    for node in ("n1", "n2", "second"):
        client("worker", node).finish()
    assert not service.job_over()
    joiner.finish()
    assert service.job_over()
    with pytest.raises(ValueError, match="TFPSX_MAX_WORKER_NUM=1 is below TFPSX_WORKER_NUM=2"):
        SchedulerService(1, 2, max_worker_num=1)


def test_requested_ranks(sched):
    _, client, _ = sched(server_num=1, worker_num=3)
    assert client("worker", "a").register(_addr(0), 2, 5)[0] == 2
    assert client("worker", "b").register(_addr(1), None, 5)[0] == 0
    with pytest.raises(errors.SchedulerRejectedError, match="worker rank 2 is already taken"):
        client("worker", "c").register(_addr(2), 2, 5)
    with pytest.raises(errors.SchedulerRejectedError, match="rank 7 is out of range.*0..2"):
        client("worker", "d").register(_addr(3), 7, 5)


def test_too_many_nodes_refused_on_both_sides(sched, caplog):
    caplog.set_level(logging.INFO, logger="tfpsx")
    _, client, _ = sched(server_num=1, worker_num=1)
    client("server", "s0").register(_addr(0), None, 5)
    with pytest.raises(errors.SchedulerRejectedError) as info:
        client("server", "s1").register(_addr(1), None, 5)
    message = str(info.value)
    assert "RESOURCE_EXHAUSTED" in message and "too many servers: server_num is 1" in message
    assert _addr(1) in message and "node s1" in message
    assert "RESOURCE_EXHAUSTED: too many servers" in caplog.text and "refused a call from" in caplog.text


def test_wrong_role_and_duplicate_address(sched):
    _, client, _ = sched()
    with pytest.raises(errors.SchedulerRejectedError, match="role 'trainer' cannot register"):
        client("trainer", "t").register(_addr(0), None, 5)
    client("server", "s0").register(_addr(0), None, 5)
    with pytest.raises(errors.SchedulerRejectedError, match="cannot re-register as a worker"):
        client("worker", "s0").register(_addr(5), None, 5)
    with pytest.raises(errors.SchedulerRejectedError, match="address 127.0.0.1:20000 is already"):
        client("worker", "w0").register(_addr(0), None, 5)


def test_wrong_token_rejected(sched):
    _, client, _ = sched(token="s3cret")
    with pytest.raises(errors.SchedulerRejectedError, match="UNAUTHENTICATED.*token"):
        client("server", "s0", client_token="guess").register(_addr(0), None, 5)
    with pytest.raises(errors.SchedulerRejectedError, match="UNAUTHENTICATED"):
        client("server", "s0", client_token=None).register(_addr(0), None, 5)
    assert client("server", "s0").register(_addr(0), None, 5)[0] == 0


def test_missing_nodes_time_out_with_their_ranks(sched):
    _, client, _ = sched(server_num=2, worker_num=3)
    c = client("worker", "w0")
    c.register(_addr(0), None, 5)
    client("server", "s0").register(_addr(1), None, 5)
    start = time.monotonic()
    with pytest.raises(errors.ClusterTimeoutError) as info:
        c.wait_cluster(1.0)
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert "server rank 1 (1 of 2 servers registered)" in message
    assert "worker ranks 1, 2 (1 of 3 workers registered)" in message


def test_scheduler_register_timeout_fails_waiting_nodes():
    address = f"127.0.0.1:{pick_ports(1)[0]}"
    outcome = {}

    def run():
        try:
            serve(address, 1, 2, register_timeout=2.0, heartbeat_timeout=30)
        except errors.ClusterTimeoutError as e:
            outcome["scheduler"] = str(e)

    thread = threading.Thread(target=run)
    thread.start()
    c = SchedulerClient(cluster.SchedulerInfo(address, 1, 2), "worker", 5, node_id="w0")
    c.register(_addr(0), None, 10)
    with pytest.raises(errors.ClusterTimeoutError) as info:
        c.wait_cluster(30)
    thread.join(15)
    c.close()
    assert "missing: server rank 0 (0 of 1 servers registered); worker rank 1" in str(info.value)
    assert "cluster not complete after 2 s" in outcome["scheduler"]


def test_silent_node_reported_dead(sched, caplog):
    caplog.set_level(logging.INFO, logger="tfpsx")
    service, client, _ = sched(server_num=1, worker_num=2, heartbeat_timeout=0.5)
    alive = client("worker", "w0")
    alive.register(_addr(0), None, 5)
    client("worker", "w1").register(_addr(1), None, 5)  # never heartbeats
    server = client("server", "s0")
    server.register(_addr(2), None, 5)
    alive.start_heartbeat(0.1)
    server.start_heartbeat(0.1)
    deadline = time.monotonic() + 10
    while not alive.dead:
        service.check_heartbeats()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    alive.stop_heartbeat()
    assert [(n.role, n.rank) for n in alive.dead] == [("worker", 1)]
    assert "worker rank 1 (127.0.0.1:20001) is dead: no heartbeat" in caplog.text
    # The barrier and the job end go on without the dead worker.
    alive.barrier(1, timeout=5)
    alive.finish()
    assert server.status().over
    server.close()


def test_barrier_and_job_end(sched):
    _, client, _ = sched(server_num=1, worker_num=2)
    workers = [client("worker", f"w{i}") for i in range(2)]
    server = client("server", "s0")
    for i, c in enumerate(workers + [server]):
        c.register(_addr(i), None, 5)
    with pytest.raises(errors.ClusterTimeoutError, match="1 of 2 workers arrived"):
        workers[0].barrier(1, timeout=0.5)
    done = []
    t = threading.Thread(target=lambda: (workers[0].barrier(2, 10), done.append(1)))
    t.start()
    workers[1].barrier(1, 10)  # worker 0 already arrived at barrier 1
    workers[1].barrier(2, 10)
    t.join(10)
    assert done == [1]
    ended = []
    t = threading.Thread(target=lambda: ended.append(server.wait_job_end()))
    t.start()
    for c in workers:
        c.finish()
    t.join(10)
    assert ended and ended[0].over and sorted(n.rank for n in ended[0].finished) == [0, 1]


def test_unreachable_scheduler_is_a_bounded_error():
    address = f"127.0.0.1:{pick_ports(1)[0]}"
    c = SchedulerClient(cluster.SchedulerInfo(address, 1, 1), "worker", 5, node_id="w")
    start = time.monotonic()
    with pytest.raises(errors.ClusterTimeoutError, match=f"scheduler at {address}.*TFPSX_CONNECT"):
        c.register(_addr(0), None, 1.0)
    assert time.monotonic() - start < 10


def _make_cert(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True, timeout=60)
    return str(cert), str(key)


def test_tls(sched, tmp_path):
    cert, key = _make_cert(tmp_path)
    server_tls = TlsConfig(cert=cert, key=key)
    _, client, _ = sched(server_num=1, worker_num=1, tls=server_tls)
    assert client("server", "s0", client_tls=TlsConfig(ca=cert)).register(_addr(0), None, 5)[0] == 0
    with pytest.raises(errors.ClusterTimeoutError):  # plaintext client never gets a channel
        client("worker", "w0", client_tls=None).register(_addr(1), None, 1.0)


def test_tls_env_validation(tmp_path):
    with pytest.raises(ValueError, match="TFPSX_TLS_CA.*does not exist"):
        TlsConfig.from_env({"TFPSX_TLS_CA": str(tmp_path / "nope.pem")})
    (tmp_path / "c.pem").write_text("x")
    with pytest.raises(ValueError, match="go together"):
        TlsConfig.from_env({"TFPSX_TLS_CERT": str(tmp_path / "c.pem")})
    assert TlsConfig.from_env({}) is None


# ----------------------------------------------------------------------------- scheduler loss

def _job(sched, journal=None, token=None):
    """1 server + 2 workers registered with a scheduler; returns (service, info, workers,
    server)."""
    service, client, info = sched(server_num=1, worker_num=2, token=token, journal=journal)
    workers = [client("worker", f"w{i}") for i in range(2)]
    server = client("server", "s0")
    for i, c in enumerate(workers + [server]):
        c.register(_addr(i), None, 5)
    return service, info, workers, server


def test_a_restarted_scheduler_takes_the_job_back_from_its_journal(sched, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tfpsx")
    state = str(tmp_path / "scheduler.state")
    first, info, workers, server = _job(sched, Journal(state, 1, 2, "tok"), token="tok")
    workers[0].finish()
    first.grpc_server.stop(grace=0)  # the scheduler dies
    again, _, _ = sched(server_num=1, worker_num=2, token="tok",
                        journal=Journal(state, 1, 2, "tok"), address=info.address)
    assert {(n.role, n.rank, n.address, n.state) for n in again.nodes.values()} == {
        ("worker", 0, _addr(0), "finished"), ("worker", 1, _addr(1), "registered"),
        ("server", 0, _addr(2), "registered")}
    assert again.ready_at is not None
    assert "took back the job journaled in" in caplog.text
    # The nodes' own channels reach the new scheduler; the job ends as it would have.
    workers[1]._beat()
    assert workers[1]._heartbeat_failures == 0
    workers[1].finish()
    reply = server.wait_job_end(loss_timeout=5)
    assert reply.over and sorted(n.rank for n in reply.finished) == [0, 1]


def test_a_journal_is_written_whole_or_not_at_all(tmp_path):
    state = str(tmp_path / "scheduler.state")
    journal = Journal(state, 1, 2, None)
    journal.save([{"role": "server", "rank": 0, "address": _addr(0), "node_id": "s0",
                   "state": "registered", "last_seen": 0.0}])
    with open(state + ".tmp", "w") as f:  # a save that died halfway
        f.write('{"version": 1, "nod')
    assert [n["node_id"] for n in journal.load()] == ["s0"]
    journal.remove()
    assert journal.load() is None and not (tmp_path / "scheduler.state.tmp").exists()


@pytest.mark.parametrize("other,words", [
    (dict(server_num=2), "server_num 1 (expected 2)"),
    (dict(token="other"), "token_sha256"),
])
def test_another_jobs_journal_is_refused(tmp_path, other, words):
    state = str(tmp_path / "scheduler.state")
    Journal(state, 1, 2, "tok").save([])
    kwargs = dict(server_num=1, worker_num=2, token="tok")
    kwargs.update(other)
    with pytest.raises(ValueError, match=re.escape(words)) as e:
        SchedulerService(kwargs["server_num"], kwargs["worker_num"], kwargs["token"],
                         journal=Journal(state, **kwargs))
    assert state in str(e.value) and "remove it to start a new job" in str(e.value)
    with open(state, "w") as f:
        f.write("not json")
    with pytest.raises(ValueError, match="cannot be read"):
        Journal(state, 1, 2, "tok").load()


def test_a_scheduler_restarted_without_journal_gets_the_nodes_again(sched, caplog):
    first, info, workers, server = _job(sched)
    first.grpc_server.stop(grace=0)
    again, _, _ = sched(server_num=1, worker_num=2, address=info.address)
    for c in workers + [server]:  # their next heartbeat re-registers them, same ranks
        c._beat()
    assert {(n.role, n.rank, n.address) for n in again.nodes.values()} == {
        ("worker", 0, _addr(0)), ("worker", 1, _addr(1)), ("server", 0, _addr(2))}
    assert "registering again as rank 1" in caplog.text


def test_a_server_serves_on_without_the_scheduler_for_a_bounded_time(sched):
    first, _, workers, server = _job(sched)
    first.grpc_server.stop(grace=0)
    start = time.monotonic()
    with pytest.raises(errors.ClusterTimeoutError,
                       match=r"server rank 0: the scheduler at .* was unreachable for \d+ s "
                             r"\(TFPSX_SCHED_LOSS_TIMEOUT=1\.5\)"):
        server.wait_job_end(loss_timeout=1.5)
    assert time.monotonic() - start < 10
    assert workers[0].finish(patience=0.5) is None  # logged, not raised: training is done
    with pytest.raises(errors.ClusterTimeoutError,
                       match=r"barrier_worker\(\) #1 on worker 1 waited 1\.5 s; the scheduler "
                             r"did not answer"):
        workers[1].barrier(1, timeout=1.5)


def test_a_node_reported_dead_that_registers_again_is_alive(sched, caplog):
    """A worker restarted with its node id (by hand, or after a long pause) is alive again:
    the job end waits for it, not past it."""
    service, client, _ = sched(server_num=1, worker_num=2, heartbeat_timeout=0.3)
    workers = [client("worker", f"w{i}") for i in range(2)]
    server = client("server", "s0")
    for i, c in enumerate(workers + [server]):
        c.register(_addr(i), None, 5)
    time.sleep(0.5)
    service.check_heartbeats()
    assert {n.state for n in service.nodes.values()} == {"dead"}
    again = client("worker", "w1")
    assert again.register(_addr(1), None, 5) == (1, _addr(1))
    assert service.nodes["w1"].state == "registered"
    assert "reported dead, registered again: alive, same rank" in caplog.text
    workers[0].finish()
    assert not server.status().over  # worker 1 is alive again: the job is not over
    again.finish()
    assert server.status().over

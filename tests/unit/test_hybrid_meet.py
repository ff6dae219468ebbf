"""The hybrid mode's start-up (tfpsx.modes.hybrid): the dense all-reduce's addresses,
given (TFPSX_DENSE_ENDPOINTS) or met through a vector on server 0, and their errors."""

import pytest

from tfpsx import errors
from tfpsx.modes import hybrid


def test_given_addresses_are_one_host_port_per_worker():
    assert hybrid.dense_endpoints(" 10.0.0.1:2223, 10.0.0.2:2223 ", 2) == [
        "10.0.0.1:2223", "10.0.0.2:2223"]
    with pytest.raises(ValueError, match=r"expected 2 host:port address\(es\), one per "
                                         r"worker in rank order; it lists 1"):
        hybrid.dense_endpoints("10.0.0.1:2223", 2)
    with pytest.raises(ValueError, match=r"not host:port: \['10.0.0.2', ':7'\]"):
        hybrid.dense_endpoints("10.0.0.1:2223,10.0.0.2,:7", 3)


def test_workers_meet_when_every_port_is_there():
    ports = [0, 0, 0]
    reads = []

    def write(rank, port):
        ports[rank] = port

    def read():
        reads.append(1)
        if len(reads) == 3:  # the others arrive while this worker waits
            ports[0], ports[2] = 4000, 4002
        return list(ports)

    assert hybrid.meet(1, 3, 4001, write, read, timeout=5, poll=0.001) == [4000, 4001, 4002]
    assert len(reads) == 3


def test_a_worker_that_never_comes_is_named_within_the_bound():
    ports = [0, 0]
    with pytest.raises(errors.ClusterTimeoutError,
                       match=r"worker 0 waited 0.05 s .* for worker\(s\) \[1\]"):
        hybrid.meet(0, 2, 4000, lambda r, p: ports.__setitem__(r, p), lambda: ports,
                    timeout=0.05, poll=0.01)
    with pytest.raises(ValueError, match="hold 3 workers' ports, this worker counts 2"):
        hybrid.meet(0, 2, 4000, lambda r, p: None, lambda: [1, 2, 3], timeout=1)

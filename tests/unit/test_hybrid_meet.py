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


@pytest.mark.parametrize("tables", ["async", "geo"])
def test_a_worker_joining_a_running_hybrid_job_is_refused_at_once_naming_why(tables):
    """The hybrid mode's dense all-reduce is a group of the workers the job started with:
    a joiner is refused when its strategy is made (it passed before: the check looked at
    the tables' mode only), while async or GEO with dense weights on the PS admit it."""
    from types import SimpleNamespace

    from tfpsx.modes.group import refuse_a_late_join
    from tfpsx.modes.strategy import DistributedStrategy

    configs = {"k_steps": 10} if tables == "geo" else {}
    joiner = SimpleNamespace(joined=True, index=2, initial_worker_num=2)
    with pytest.raises(ValueError, match=r"hybrid \(dense='allreduce'\): worker 2 joined a "
                       r"running job of 2 workers, but the hybrid mode all-reduces"):
        refuse_a_late_join(DistributedStrategy(a_sync_configs=configs, dense="allreduce"),
                           joiner)
    refuse_a_late_join(DistributedStrategy(a_sync_configs=configs), joiner)  # dense on the PS
    refuse_a_late_join(DistributedStrategy(a_sync_configs=configs, dense="allreduce"),
                       SimpleNamespace(joined=False, index=1, initial_worker_num=2))
    with pytest.raises(ValueError, match="sync: worker 2 joined a running job of 2"):
        refuse_a_late_join(DistributedStrategy(a_sync=False), joiner)

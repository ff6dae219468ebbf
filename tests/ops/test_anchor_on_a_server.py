"""The anchor context (tfpsx.control.eager_anchor) on a real tf.distribute.Server in this
process: a server without one is named and explained; with one, clients may connect; it
is idempotent; an address with no server is named as not answering."""
import pytest
import tensorflow as tf

import tfpsx
from tfpsx import errors
from tfpsx.control import eager_anchor
from tfpsx.launcher.local import pick_ports


@pytest.fixture
def server():
    """A server of the test's own (in this process, started in ~10 ms): the anchor one
    test adds must not reach another, whatever their order (a module's shared server made
    the unanchored test fail after the anchoring one)."""
    port, = pick_ports(1)
    address = f"127.0.0.1:{port}"
    server = tf.distribute.Server(tf.train.ClusterSpec({"ps": [address]}), job_name="ps",
                                  task_index=0, start=True)
    return server, address


@pytest.mark.timeout(60)
def test_a_server_without_the_anchor_is_named_with_what_to_do(server):
    _, address = server
    with pytest.raises(errors.ClusterTimeoutError) as e:
        eager_anchor.wait_anchored({"ps:0": address}, timeout=0.5)
    message = str(e.value)
    assert f"ps:0 at {address} answers, but has no tfpsx anchor context" in message
    assert "tfpsx.run_server()" in message and "tfpsx.anchor_eager_service" in message


@pytest.mark.timeout(60)
def test_anchored_server_lets_clients_connect_and_anchoring_again_is_harmless(server):
    srv, address = server
    tfpsx.anchor_eager_service(srv)
    eager_anchor.wait_anchored({"ps:0": address}, timeout=5)
    tfpsx.anchor_eager_service(srv)  # already there: kept, no error
    eager_anchor.wait_anchored({"ps:0": address}, timeout=5)


@pytest.mark.timeout(60)
def test_an_address_with_no_server_is_named_as_not_answering():
    port, = pick_ports(1)
    with pytest.raises(errors.ClusterTimeoutError, match=rf"ps:1 at 127.0.0.1:{port} does "
                       r"not answer \(UNAVAILABLE\)"):
        eager_anchor.wait_anchored({"ps:1": f"127.0.0.1:{port}"}, timeout=0.5)

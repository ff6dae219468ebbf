"""The session creators (tfpsx.training.session) without a cluster: which servers the
chief's check of a live model covers, and what a session's close does first and its
bound."""

import threading

import pytest
import tensorflow as tf

from tfpsx import errors
from tfpsx.training.session import _ChiefSessionCreator, _stops_before_close


def test_a_server_holding_no_variable_is_named_so_the_live_model_check_is_not_trusted():
    """A server holding only table shards (no variable says they were made) could have
    restarted unseen: a session created again then takes TF's path (restore or init)."""
    graph = tf.Graph()
    with graph.as_default():
        with tf.compat.v1.device("/job:ps/task:0"):
            tf.compat.v1.get_variable("w", [2], initializer=tf.zeros_initializer())
        with tf.compat.v1.device("/job:ps/replica:0/task:2/device:CPU:0"):
            tf.compat.v1.get_variable("b", [], initializer=tf.zeros_initializer())
        with tf.compat.v1.device("/job:worker/task:0"):  # a worker's own: not a server's
            tf.compat.v1.get_variable("step", [], initializer=tf.zeros_initializer())
        assert _ChiefSessionCreator(servers=3)._uncovered_servers(graph) == [1]
        assert _ChiefSessionCreator(servers=1)._uncovered_servers(graph) == []
        assert _ChiefSessionCreator(servers=0)._uncovered_servers(graph) == []  # collective


class _Session:
    """A stand-in for TF's session: its close counts, or blocks until released."""

    def __init__(self, release=None):
        self.closed, self._release = 0, release

    def close(self):
        if self._release is not None:
            self._release.wait(30)
        self.closed += 1


def test_the_hooks_threads_stop_before_the_close_once():
    """The stops (GEO's communicator, the inputs' iterators) run before TF's close, once:
    a later close (TF's own when the session is collected, from whichever thread) stops
    nothing (it ran on the next session's communicator before)."""
    order = []
    session = _Session()
    session = _stops_before_close(session, [lambda: order.append(session.closed)])
    session.close()
    assert order == [0] and session.closed == 1
    session.close()
    assert order == [0] and session.closed == 2


def test_a_close_past_its_bound_is_a_named_error(monkeypatch):
    monkeypatch.setenv("TFPSX_SESSION_CLOSE_TIMEOUT", "0.2")
    release = threading.Event()
    stopped = []
    session = _stops_before_close(_Session(release), [lambda: stopped.append(1)])
    try:
        with pytest.raises(errors.ClusterTimeoutError,
                           match=r"close of the training session did not end within "
                                 r"TFPSX_SESSION_CLOSE_TIMEOUT=0.2 s"):
            session.close()
        assert stopped == [1]
    finally:
        release.set()

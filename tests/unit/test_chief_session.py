"""The session creators (tfpsx.training.session) without a cluster: which servers the
chief's check of a live model covers, and what a session's close does first and its
bound."""

import threading

import pytest
import tensorflow as tf

from tfpsx import errors
from tfpsx.training.closing import SessionCloser, closing_stops
from tfpsx.training.session import _ChiefSessionCreator


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


def test_the_stops_run_before_the_close_once_and_only_for_the_latest_session():
    """The stops (GEO's communicator, the inputs' iterators) run before TF's close, once:
    a later close (TF's own when the session is collected, from whichever thread) stops
    nothing, nor does the close of a session that is not the creator's latest (one
    whose creation failed after it was made: the hooks run on the next)."""
    order, closed = [], []
    closer = SessionCloser([lambda: order.append("a"),
                            lambda: (order.append("b"), closed.append(current[0].closed))])
    first = closer.wrap(_Session())
    current = [first]
    first.close()
    assert order == ["a", "b"] and closed == [0] and first.closed == 1  # (stops first)
    first.close()
    assert order == ["a", "b"] and first.closed == 2
    leaked, latest = closer.wrap(_Session()), closer.wrap(_Session())
    leaked.close()
    assert order == ["a", "b"] and leaked.closed == 1
    current[0] = latest
    latest.close()
    assert order == ["a", "b", "a", "b"] and closed == [0, 0] and latest.closed == 1


def test_a_failed_stop_still_runs_the_others_and_the_creator_raises_it_next():
    """TF's _CoordinatedSession.close swallows what the close raises: the failure is
    kept, and the next session's creation raises it (once)."""
    ran = []

    def fails():
        raise errors.ClusterTimeoutError("GEO communicator: the round in flight did not end")

    closer = SessionCloser([fails, lambda: ran.append(1)])
    session = closer.wrap(_Session())
    with pytest.raises(errors.ClusterTimeoutError, match="round in flight"):
        session.close()
    assert ran == [1] and session.closed == 1
    with pytest.raises(errors.ClusterTimeoutError, match="round in flight"):
        closer.check()
    closer.check()  # (once)


def test_a_close_past_its_bound_is_a_named_error(monkeypatch):
    monkeypatch.setenv("TFPSX_SESSION_CLOSE_TIMEOUT", "0.2")
    release = threading.Event()
    closer = SessionCloser([lambda: None])
    session = closer.wrap(_Session(release))
    try:
        with pytest.raises(errors.ClusterTimeoutError,
                           match=r"close of the training session did not end within "
                                 r"TFPSX_SESSION_CLOSE_TIMEOUT=0.2 s"):
            session.close()
        with pytest.raises(errors.ClusterTimeoutError):
            closer.check()
    finally:
        release.set()


def test_the_stops_are_the_hooks_then_the_inputs_read_from_splits(tmp_path, monkeypatch):
    """MonitoredTrainingSession's stops: each hook's session_closing, then, when the graph
    reads splits, each of the process's inputs' abandon."""
    import tfpsx
    from tfpsx.control import splits

    monkeypatch.setattr(splits, "_INPUTS", {})  # (this test's input only)
    (tmp_path / "part-0.txt").write_text("".join(f"{i}\n" for i in range(100)))
    tfpsx.data.splits(str(tmp_path / "part-*.txt"), lambda lines: lines, 10,
                      split_bytes=100, epochs=1, name="closing")

    class Hook:
        def session_closing(self):
            pass

    hook = Hook()
    source = splits.registered()["closing"]
    assert closing_stops([object(), hook], reads_splits=True) == [hook.session_closing,
                                                                  source.abandon]
    assert closing_stops([hook], reads_splits=False) == [hook.session_closing]


def test_a_failure_of_a_session_not_the_latest_fails_no_creation():
    """A session whose creation failed after it was made (TF does not close it: it is
    collected later) stops nothing when it closes, and its close's failure is logged,
    not raised by the next creation."""
    class Failing(_Session):
        def close(self):
            raise RuntimeError("the leaked session's close failed")

    stopped = []
    closer = SessionCloser([lambda: stopped.append(1)])
    leaked = closer.wrap(Failing())
    closer.wrap(_Session())
    with pytest.raises(RuntimeError):
        leaked.close()
    assert stopped == []
    closer.check()  # (nothing kept)

"""The chief's session creator (tfpsx.training.session) without a cluster: which servers
its check of a live model covers."""

import tensorflow as tf

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

"""The protocol variables of every mode are the core's (tfpsx.modes.state), in graph mode
built here in one process (the Keras front-end's are checked in its cluster scenarios:
tests/cluster/test_keras.py and test_hybrid.py read what each worker created)."""

import pytest
import tensorflow as tf

import tfpsx
from tfpsx.modes.state import MODE_STATE, SYNC_STEP, states_of
from tfpsx.training.modes.base import mode_of
from test_training_api import worker  # noqa: F401  (this process as worker 1 of 2)

STRATEGIES = {
    "async": tfpsx.DistributedStrategy(),
    "sync": tfpsx.DistributedStrategy(a_sync=False),
    "geo": tfpsx.DistributedStrategy(a_sync_configs={"k_steps": 10}),
    "staleness": tfpsx.DistributedStrategy(a_sync_configs={"max_staleness": 2}),
    "hybrid": tfpsx.DistributedStrategy(dense="allreduce"),
}


def protocol_variables(graph) -> dict:
    """{shared name: device} of every resource variable on the servers that a
    front-end made under a tfpsx name (the model's own are the user's names)."""
    out = {}
    for op in graph.get_operations():
        if op.type == "VarHandleOp":
            name = op.get_attr("shared_name").decode()
            if name.startswith("tfpsx") and "/job:ps" in op.device:
                out[name] = op.device
    return out


@pytest.mark.parametrize("mode", sorted(STRATEGIES))
def test_graph_mode_creates_exactly_the_cores_state_of_each_mode(worker, mode):
    strategy = STRATEGIES[mode]
    with tf.Graph().as_default() as graph:
        with tfpsx.model_scope(strategy):
            w = tf.compat.v1.get_variable("w", [3], initializer=tf.ones_initializer())
            step = tf.compat.v1.train.get_or_create_global_step()
            opt = tfpsx.distributed_optimizer(
                tf.compat.v1.train.GradientDescentOptimizer(0.1), strategy)
            with tf.compat.v1.variable_scope("user_scope"):  # the names stay the core's
                opt.minimize(tf.reduce_sum(w * w), global_step=step)
        for hook in mode_of(graph).hooks():  # as MonitoredTrainingSession does
            hook.begin()
        made = protocol_variables(graph)
    assert sorted(made) == sorted(s.name for s in states_of(mode)), made
    assert all(d.startswith("/job:ps/task:0") for d in made.values()), made
    # checkpointed ones are global variables (restored by the chief); the others not
    saved = {v.op.name for v in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)}
    for s in states_of(mode):
        assert (s.name in saved) == s.checkpointed, (s, saved)


def test_every_mode_is_declared_and_an_unknown_one_is_named():
    assert set(MODE_STATE) == {"async", "sync", "geo", "staleness", "collective", "hybrid"}
    assert SYNC_STEP.shape(4) == [] and MODE_STATE["sync"][1].shape(4) == [4]
    with pytest.raises(ValueError, match=r"unknown mode 'fast'.*'async'"):
        states_of("fast")

"""sync's step protocol (tfpsx.modes.sync) in one process, no cluster: worker threads
share one TF1 session over local variables and run the phases the front-ends run
(push, mark, the chief's wait / take / apply / advance, the others' wait / follow)."""

import threading
import time

import numpy as np
import pytest
import tensorflow as tf

from tfpsx import errors
from tfpsx.modes import DONE, GradientAccumulators, SyncGroup
from tfpsx.modes.group import DRAINING


def test_the_chief_waits_for_replicas_of_the_workers_still_in_the_group():
    g = SyncGroup(None, None, None, 0, 3, 3, lambda: [])
    assert g.gradients_ready(np.array([1, 1, 0]), 0) is None
    assert g.gradients_ready(np.array([1, 1, 1]), 0) == 3
    # A worker that left is not waited for; one that pushed an older step is.
    assert g.gradients_ready(np.array([5, DONE, 4]), 4) is None
    assert g.gradients_ready(np.array([5, DONE, 5]), 4) == 2
    g1 = SyncGroup(None, None, None, 0, 3, 1, lambda: [])  # replicas_to_aggregate=1
    assert g1.gradients_ready(np.array([1, 0, 0]), 0) == 1
    assert g1.gradients_ready(np.array([DONE, DONE, 0]), 0) is None
    assert g1.missing(np.array([3, 2, DONE]), 2) == [1]


def test_a_worker_goes_on_once_the_step_passed_its_own_and_stops_when_the_chief_left():
    g = SyncGroup(None, None, None, 1, 2, 2, lambda: [])
    assert g.step_ready(4, False, 4) is None
    # A draining chief (its data ended) counts as out of the group for the gradients
    # a step needs, and applies on: the others wait for it.
    chief = SyncGroup(None, None, None, 0, 3, 3, lambda: [])
    assert chief.gradients_ready(np.array([DRAINING, 5, 4]), 4) is None
    assert chief.gradients_ready(np.array([DRAINING, 5, 5]), 4) == 2
    assert chief.others_training(np.array([DRAINING, DONE, 5]))
    assert not chief.others_training(np.array([DRAINING, DONE, DONE]))
    assert g.step_ready(5, True, 4) == 5  # the chief's last step, then it left
    with pytest.raises(tf.errors.OutOfRangeError, match="chief .* finished training"):
        g.step_ready(4, True, 4)


class Job:
    """``workers`` threads training a scalar ``v`` by sync SGD (lr 1) in one session; a
    worker's gradient at step s is ``grads(w, s)``."""

    def __init__(self, workers, replicas=None, dead=(), drains=False):
        self.workers, self.graph = workers, tf.Graph()
        self.drains = drains  # the chief applies the others' steps after its own
        self.dead = list(dead)
        with self.graph.as_default():
            self.v = tf.compat.v1.get_variable("v", [], initializer=tf.zeros_initializer(),
                                               use_resource=True)
            step = tf.compat.v1.get_variable("step", [], tf.int64,
                                             initializer=tf.zeros_initializer(),
                                             use_resource=True)
            pushed = tf.compat.v1.get_variable("pushed", [workers], tf.int64,
                                               initializer=tf.zeros_initializer(),
                                               use_resource=True)
            self.groups, self.ops = [], []
            for w in range(workers):
                local = tf.compat.v1.get_variable(f"local_{w}", [], tf.int64,
                                                  initializer=tf.zeros_initializer(),
                                                  use_resource=True)
                g = SyncGroup(step, pushed, local, w, workers, replicas or workers,
                              lambda: self.dead)
                grad = tf.compat.v1.placeholder(tf.float32, [])
                accs = GradientAccumulators([grad], lambda i, n: "/cpu:0", prefix="acc_")
                ops = {"grad": grad, "join": g.join(), "leave": g.leave(), "drain": g.drain(),
                       "mark": g.mark_pushed(accs.push([grad], local.read_value())),
                       "pushed": pushed.read_value(), "step": step.read_value()}
                if w == 0:
                    ops["count"] = count = tf.compat.v1.placeholder(tf.int32, [])
                    (avg,) = accs.take(count)
                    with tf.control_dependencies([avg]):
                        stale = accs.set_global_step(local.read_value() + 1)
                    with tf.control_dependencies(stale):
                        apply = self.v.assign_sub(avg)
                    ops["apply"] = g.advance([apply])
                ops["new"] = new = tf.compat.v1.placeholder(tf.int64, [])
                ops["follow"] = g.follow(new)
                self.groups.append(g)
                self.ops.append(ops)
            self.session = tf.compat.v1.Session(graph=self.graph)
            self.session.run(tf.compat.v1.global_variables_initializer())
        self.errors = {}
        self.seen = {w: [] for w in range(workers)}  # the steps each worker trained

    def worker(self, w, steps, grads, delay=0.0):
        if steps is None:  # a worker that is dead from the start
            return
        run, ops, g = self.session.run, self.ops[w], self.groups[w]
        try:
            run(ops["join"])
            s = int(run(ops["step"]))
            for _ in range(steps):
                self.seen[w].append(s)
                run(ops["mark"], {ops["grad"]: grads(w, s)})
                pushed = lambda: run(ops["pushed"])  # noqa: E731
                if w == 0:
                    count = g.wait_for_gradients(s, pushed)
                    s = int(run(ops["apply"], {ops["count"]: count}))
                else:
                    s = g.wait_for_step(s, lambda: run(ops["step"]), pushed)
                    run(ops["follow"], {ops["new"]: s})
                time.sleep(delay)
            if w == 0 and self.drains:
                run(ops["drain"])
                s = g.apply_until_left(
                    s, lambda: run(ops["pushed"]),
                    apply=lambda count: int(run(ops["apply"], {ops["count"]: count})))
            run(ops["leave"])
        except BaseException as e:  # noqa: BLE001 — the test reads it
            self.errors[w] = e

    def run(self, steps, grads, delays=None, join_timeout=60):
        threads = [threading.Thread(target=self.worker,
                                    args=(w, steps[w], grads, (delays or {}).get(w, 0.0)))
                   for w in range(self.workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(join_timeout)
            assert not t.is_alive(), "a worker's wait did not end"
        return float(self.session.run(self.v)), int(self.session.run(self.ops[0]["step"]))


def grad_of(w, s):
    return float(10 ** w * (s + 1))


@pytest.mark.timeout(120)
def test_each_step_averages_exactly_one_gradient_of_each_worker():
    job = Job(3)
    # Worker 2 is slow: a fast worker that supplied two gradients of a step would show.
    v, step = job.run({0: 6, 1: 6, 2: 6}, grad_of, delays={2: 0.02})
    assert job.errors == {}
    assert step == 6
    want = -sum(np.mean([grad_of(w, s) for w in range(3)]) for s in range(6))
    assert v == pytest.approx(want, rel=1e-6)
    assert all(job.seen[w] == list(range(6)) for w in range(3))


@pytest.mark.timeout(120)
def test_a_worker_that_finished_leaves_the_group():
    job = Job(2)
    v, step = job.run({0: 8, 1: 3}, grad_of)
    assert job.errors == {} and step == 8
    want = -sum(np.mean([grad_of(w, s) for w in range(2)]) for s in range(3)) \
        - sum(grad_of(0, s) for s in range(3, 8))
    assert v == pytest.approx(want, rel=1e-6)


@pytest.mark.timeout(120)
def test_when_the_chief_leaves_the_others_stop_after_its_last_step():
    job = Job(2)
    job.run({0: 4, 1: 10}, grad_of)
    assert isinstance(job.errors.get(1), tf.errors.OutOfRangeError), job.errors
    assert job.seen[1] == [0, 1, 2, 3, 4]  # its push for step 4 found no chief to apply it
    assert 0 not in job.errors


@pytest.mark.timeout(120)
def test_a_chief_whose_data_ended_applies_the_others_steps_until_they_leave():
    """(tfpsx.data.splits: the workers' data ends at different steps.) The chief trains
    3 steps and drains: the next steps average only the others' gradients, each applied
    once, and nobody stops early."""
    job = Job(3, drains=True)
    v, step = job.run({0: 3, 1: 8, 2: 5}, grad_of, delays={1: 0.01})
    assert job.errors == {}
    assert step == 8
    assert job.seen[1] == list(range(8)) and job.seen[2] == list(range(5))
    want = (-sum(np.mean([grad_of(w, s) for w in range(3)]) for s in range(3))
            - sum(np.mean([grad_of(w, s) for w in (1, 2)]) for s in range(3, 5))
            - sum(grad_of(1, s) for s in range(5, 8)))
    assert v == pytest.approx(want, rel=1e-6)


@pytest.mark.timeout(120)
def test_fewer_replicas_than_workers_go_on_without_the_straggler():
    job = Job(2, replicas=1)
    job.run({0: 150, 1: 4}, grad_of, delays={0: 0.01, 1: 0.1})
    assert job.errors == {}
    assert job.seen[0] == list(range(150))  # the chief waited for nobody
    assert job.seen[1][-1] > 10  # the straggler went on from the newest step each time


@pytest.mark.timeout(120)
def test_a_dead_worker_is_named_at_once_and_a_silent_one_after_the_step_timeout(monkeypatch):
    monkeypatch.setenv("TFPSX_SYNC_STEP_TIMEOUT", "60")
    job = Job(2, dead=[(1, "127.0.0.1:4242")])
    start = time.monotonic()
    job.run({0: 1, 1: None}, grad_of)  # worker 1 never pushes, never leaves: dead
    assert time.monotonic() - start < 10
    assert isinstance(job.errors[0], errors.ClusterTimeoutError)
    assert "sync: worker 0 waited" in str(job.errors[0])
    assert "for step 0, which cannot complete: worker 1 at 127.0.0.1:4242 died" in \
        str(job.errors[0])

    monkeypatch.setenv("TFPSX_SYNC_STEP_TIMEOUT", "0.5")
    job = Job(2)
    job.run({0: None, 1: 1}, grad_of)  # the chief never applies, never leaves
    e = job.errors[1]
    assert isinstance(e, errors.ClusterTimeoutError)
    assert "waited 0.5 s (TFPSX_SYNC_STEP_TIMEOUT=0.5 s) for the chief to apply step 0" in \
        str(e)

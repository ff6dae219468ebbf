"""GEO (k-step geometric SGD): each worker trains a local copy; every K local steps it
syncs with the parameter servers. Dense variables and tables, one rule:

* push: ``delta = (local - old) / N``; ``old += delta``; the PS value ``+= delta`` (a
  table pushes only the rows changed in the worker's copy since its last push);
* pull: ``local += global - old``; ``old = global`` (a table pulls the rows any worker
  changed on the PS since this worker's last pull: the PS keeps a changed-key set per
  worker).

The table rule lives with the tables (:mod:`tfpsx.embedding.geo_rule`: a worker cache
flushes by it too); the dense rule is here. The push and pull run in a background communicator thread while training goes on
(Paddle's GeoCommunicator), or, with ``geo_sync_in_train_thread=True``, in the training
thread between steps (deterministic: all workers push, meet at a barrier, pull, meet
again). The rule itself is the functions :func:`dense_push`, :func:`dense_pull`,
:func:`table_push`, :func:`table_pull` over variables and tables: they build ops in
graph mode and run in eager mode or ``tf.function``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Dict, List, Optional

import tensorflow as tf

from tfpsx import errors, metrics, settings
from tfpsx.background import BackgroundLoop
from tfpsx.embedding.cache import WorkerCache
from tfpsx.embedding.geo_rule import GeoTable, table_pull, table_push, table_readers
from tfpsx.embedding.sharding import ShardedTable, as_step
from tfpsx.embedding.updaters import TableUpdater
from tfpsx.runtime import RUNTIME
from tfpsx.training.hooks import TrainStepDetector
from tfpsx.training.modes.base import Mode, WrappedOptimizer
from tfpsx.training.placement import worker_device_of

logger = logging.getLogger("tfpsx")


class GeoCounters(metrics.Counters):
    """What the GEO communicator did on this worker (``metrics.snapshot()["geo"]``)."""
    GROUP = "geo"
    FIELDS = ("pushes", "rows_sent", "rows_received", "bytes_sent", "bytes_received",
              "sync_seconds")  # sync_seconds: total time spent in push + pull

    @property
    def mean_sync_seconds(self) -> float:
        return self.sync_seconds / self.pushes if self.pushes else 0.0


# ----------------------------------------------------------------------------- the rule

@dataclasses.dataclass
class GeoVariable:
    """A dense variable in GEO: the PS value, this worker's copy and its snapshot."""
    local: tf.Variable     # trained by this worker
    old: tf.Variable       # the global value at the last pull (plus this worker's pushes)
    global_: tf.Variable   # on the parameter server


def dense_push(v: GeoVariable, n: float):
    """delta = (local - old) / n; old += delta; global += delta (n = 1: a counter, e.g.
    the step count, whose global value is the sum of every worker's)."""
    with tf.compat.v1.device(v.local.device):
        delta = v.local.read_value() - v.old.read_value()
        if n != 1:
            delta = delta / n
        bump_old = v.old.assign_add(delta)
    with tf.compat.v1.device(v.global_.device):
        push = v.global_.assign_add(delta)
    return tf.group(bump_old, push)


def dense_pull(v: GeoVariable, after=()):
    """After the ops ``after``: local += global - old; old = global."""
    with tf.control_dependencies(list(after)):
        with tf.compat.v1.device(v.global_.device):
            g = v.global_.read_value()
    with tf.compat.v1.device(v.local.device):
        g = tf.identity(g)  # one transfer, used twice
        with tf.control_dependencies([v.local.assign_add(g - v.old.read_value())]):
            return v.old.assign(g)


# ----------------------------------------------------------------------------- the mode

class GeoMode(Mode):
    """GEO for one graph: the dense pairs and tables to sync, the train ops that count as
    local steps, the counters, and the communicator hook."""
    NAME = "geo"

    def __init__(self, strategy, config, graph):
        super().__init__(strategy, config, graph)
        self.k_steps = strategy.k_steps
        self.in_train_thread = strategy.geo_sync_in_train_thread
        self.worker_num, self.worker_index = config.worker_num, config.index
        self.worker_device = worker_device_of(config)
        self.dense: List[GeoVariable] = []
        self.tables: List[GeoTable] = []
        self.train_ops = []
        self.counters = GeoCounters()
        self.add_hook(_GeoSyncHook(self))

    @classmethod
    def wrap_optimizer(cls, optimizer, strategy, config):
        if isinstance(optimizer, tf.compat.v1.train.SyncReplicasOptimizer):
            raise ValueError("distributed_optimizer: GEO trains a local copy on each worker, "
                             "so it needs an optimizer with a local form; "
                             "SyncReplicasOptimizer aggregates across workers and has none "
                             "(wrap its inner optimizer instead)")
        return GeoOptimizer(optimizer, strategy, config)

    def variable_creator(self):
        """Each trainable variable is created on the PS under its own name (checkpoints are
        the same as in async mode) and the model reads a local copy ``<name>_geo_local``
        on this worker, initialized from the PS value, with its snapshot ``<name>_geo_old``."""
        worker = self.worker_device

        def creator(next_creator, **kwargs):
            if not kwargs.get("trainable", True) or kwargs.get("name") is None:
                return next_creator(**kwargs)
            name = kwargs["name"]
            global_ = next_creator(**dict(kwargs, trainable=False))  # on the PS
            with tf.compat.v1.device(global_.device):
                start = global_.read_value()  # read on the PS, then one transfer
            local_kwargs = dict(
                kwargs, initial_value=start, trainable=True,
                collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES,
                             tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES],
                caching_device=None)
            local_kwargs.pop("partitioner", None)
            with tf.compat.v1.device(worker):
                local = next_creator(**dict(local_kwargs, name=f"{name}_geo_local"))
                old = next_creator(**dict(local_kwargs, name=f"{name}_geo_old", trainable=False,
                                          collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES]))
            self.dense.append(GeoVariable(local, old, global_))
            return local

        return creator

    def table_updater(self, table) -> TableUpdater:
        return GeoTableUpdater(self)


class GeoTableUpdater(TableUpdater):
    """Lookups read this worker's copy; gradients train it (its optimizer, locally).

    ``mode`` is the GEO state the table joins (graph mode's ``GeoMode`` or the Keras
    strategy's): it has ``worker_index``, ``worker_num``, ``worker_device``, ``tables``
    and ``train_ops``. A table with ``cache_size`` keeps a bounded copy: a worker cache
    (:mod:`tfpsx.embedding.cache`) whose sync is the mode's every K steps, with n = N.
    """

    def __init__(self, mode):
        super().__init__()
        self._mode = mode
        self._geo: Optional[GeoTable] = None

    def attach(self, table) -> None:
        mode, me = self._mode, self._mode.worker_index
        options = getattr(table, "cache_options", None)
        if options is not None:
            self.cache = WorkerCache(table, options, mode.worker_device, me,
                                     scale=float(mode.worker_num), flush_in_step=False)
            self._geo = self.cache.geo
            mode.tables.append(self._geo)
            return
        copy = dict(initializer=table.initializer, seed=table.seed,
                    devices=[mode.worker_device])
        local = ShardedTable(f"{table.name}/geo_local_w{me}", table.dim,
                             optimizer=table.optimizer, min_frequency=table.min_frequency, **copy)
        old = ShardedTable(f"{table.name}/geo_old_w{me}", table.dim, **copy)
        self._geo = GeoTable(table, local, old, mode.worker_device, me)
        mode.tables.append(self._geo)

    def lookup_source(self, table):
        return self._geo.local

    def apply_gradients(self, table, keys, grads, step):
        op = self._geo.local.apply(keys, grads, step)
        self._mode.train_ops.append(op)
        return op


class GeoOptimizer(WrappedOptimizer):
    """GEO k-step SGD around any ``tf.compat.v1.train`` optimizer (see the module doc).

    The wrapped optimizer trains the local copies that ``model_scope`` made; its slots
    stay on the worker (local variables). The sync is a hook that
    ``tfpsx.MonitoredTrainingSession`` runs; ``counters`` says what it did.
    """

    def __init__(self, optimizer, strategy, config):
        super().__init__(optimizer, "Geo")
        self._strategy, self._config = strategy, config
        self._mode: Optional[GeoMode] = None

    @property
    def counters(self) -> GeoCounters:
        if self._mode is None:
            raise ValueError("GEO: counters exist once minimize / apply_gradients built the "
                             "train op")
        return self._mode.counters

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        graph = tf.compat.v1.get_default_graph()
        grads_and_vars = list(grads_and_vars)
        mode = GeoMode.for_graph(self._strategy, self._config, graph) \
            if RUNTIME.config is not None else None
        pairs = {id(p.local) for p in mode.dense} if mode else set()
        stray = [v.name for g, v in grads_and_vars if g is not None and id(v) not in pairs]
        if stray:
            raise ValueError("GEO: these variables were not created inside "
                             f"tfpsx.model_scope(strategy): {stray}; GEO can only train the "
                             "local copies model_scope makes")
        self._mode = mode
        global_vars = set(graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES))
        with tf.compat.v1.device(mode.worker_device):
            apply = self._opt.apply_gradients(grads_and_vars, name=name)
            # The optimizer's slots are worker state: only this worker can initialize them,
            # and the chief's checkpoint must not expect them.
            made = [v for v in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
                    if v not in global_vars]
            global_ref = graph.get_collection_ref(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
            for v in made:
                global_ref.remove(v)
                graph.add_to_collection(tf.compat.v1.GraphKeys.LOCAL_VARIABLES, v)
            train = tf.group(apply, name="geo_train")
        mode.train_ops.append(train)
        return train


# ----------------------------------------------------------------------------- the hook

class _GeoSyncHook(tf.compat.v1.train.SessionRunHook):
    """Runs GEO's push + pull every k local steps (background thread, or in line)."""

    def __init__(self, mode: GeoMode):
        self._mode = mode
        self._session = None
        self._loop: Optional[BackgroundLoop] = None
        self._steps = 0          # local steps run
        self._pushed_steps = 0   # local steps reported to global_step
        self._built = False

    # -------------------------------------------------------------- graph
    def begin(self):
        # Called before the session finalizes the graph: build the sync ops now, when
        # every GEO variable and table of the model exists.
        if self._built:
            return
        self._built = True
        mode = self._mode
        n = float(mode.worker_num)
        step = as_step(tf.compat.v1.train.get_global_step())
        pushes = [dense_push(v, n) for v in mode.dense]
        sent, registrations = [], []
        for t in mode.tables:
            push, rows = table_push(t, n, step)
            pushes.append(push)
            sent.append((rows, t.global_.dim))
            registrations.extend(table_readers(t))
        self._new_steps = tf.compat.v1.placeholder(tf.int64, [], name="geo_new_steps")
        global_step = tf.compat.v1.train.get_global_step()
        with tf.control_dependencies(pushes):
            # global_step counts every worker's local steps, reported at each push.
            report = ([tf.compat.v1.assign_add(global_step, self._new_steps)]
                      if global_step is not None else [])
            self._push = dict(_row_counts(sent), done=tf.group(*report, name="geo_push"))
        self._push_pull = None
        if mode.in_train_thread:
            # Deterministic: push, a barrier (every worker's push is in), then the pull.
            self._pull = self._pull_ops([])
        else:
            # Background: the pull runs right after the push in the same step (one
            # round of RPCs less per sync).
            self._pull = self._pull_ops(list(self._push.values()))
            self._push_pull = {"push": self._push, "pull": self._pull}
        self._register = tf.group(*registrations, name="geo_register")
        self._dense_rows = sum(int(v.local.shape[0]) if v.local.shape.rank else 1
                               for v in mode.dense)
        self._dense_bytes = sum(4 * int(v.local.shape.num_elements()) for v in mode.dense)
        self._detector = TrainStepDetector(mode.train_ops)

    def _pull_ops(self, after):
        """The pull of every GEO variable and table, after the ops ``after``."""
        pulls = [dense_pull(v, after) for v in self._mode.dense]
        received = []
        for t in self._mode.tables:
            pull, rows = table_pull(t, after)
            pulls.append(pull)
            received.append((rows, t.global_.dim))
        return dict(_row_counts(received), done=tf.group(*pulls, name="geo_pull"))

    # -------------------------------------------------------------- session
    def after_create_session(self, session, coord):
        self._session = session
        # Sparse tables: this worker's reader of changed keys must exist before anyone
        # pushes (the table tracks changes only for readers it knows).
        session.run(self._register)
        if self._mode.in_train_thread:
            # Deterministic mode: no worker trains (and pushes) before every worker has
            # copied the initial global values and registered its readers.
            RUNTIME.barrier_worker()
        elif self._loop is None:
            self._loop = BackgroundLoop("GEO communicator",
                                        lambda: self._sync(barrier=False)).start()

    def after_run(self, run_context, run_values):
        if self._loop is not None:
            self._loop.check()
        if not self._detector.ran_training(run_context):
            return  # an eval or a global_step read, not a local step
        self._steps += 1
        if self._steps % self._mode.k_steps:
            return
        if self._mode.in_train_thread:
            self._sync(barrier=True)
        else:
            self._loop.wake()

    def end(self, session):
        # The last local steps must reach the PS before the worker stops.
        failed = False
        if self._loop is not None:
            timeout = settings.get("TFPSX_RPC_TIMEOUT")
            if not self._loop.stop(timeout):
                raise errors.ClusterTimeoutError(
                    "GEO communicator: the last sync did not finish within TFPSX_RPC_TIMEOUT="
                    f"{timeout:g} s")
            failed = self._loop.error is not None
        if self._steps > self._pushed_steps and not failed:
            self._sync(barrier=False, session=session)

    def _sync(self, barrier: bool, session=None):
        session = session or self._session
        start = time.monotonic()
        steps = self._steps
        new_steps = {self._new_steps: steps - self._pushed_steps}
        if barrier or self._push_pull is None:
            if barrier and any(t.cached for t in self._mode.tables):
                # A worker cache reads the PS on a miss: no push may land while another
                # worker still runs its local steps (deterministic: as uncached GEO).
                RUNTIME.barrier_worker()
            pushed = session.run(self._push, new_steps)
            if barrier:
                RUNTIME.barrier_worker()
            pulled = session.run(self._pull)
            if barrier:
                RUNTIME.barrier_worker()
        else:
            done = session.run(self._push_pull, new_steps)
            pushed, pulled = done["push"], done["pull"]
        self._pushed_steps = steps
        self._mode.counters.add(
            pushes=1, rows_sent=self._dense_rows + int(pushed["rows"]),
            rows_received=self._dense_rows + int(pulled["rows"]),
            bytes_sent=self._dense_bytes + int(pushed["bytes"]),
            bytes_received=self._dense_bytes + int(pulled["bytes"]),
            sync_seconds=time.monotonic() - start)


def _row_counts(rows_and_dims) -> Dict[str, tf.Tensor]:
    """Rows and bytes (key + row of floats each) moved by the tables' pushes or pulls."""
    return {"rows": tf.add_n([tf.constant(0)] + [r for r, _ in rows_and_dims]),
            "bytes": tf.add_n([tf.constant(0, tf.int64)] +
                              [tf.cast(r, tf.int64) * (8 + 4 * dim) for r, dim in rows_and_dims])}

"""GEO (k-step geometric SGD), once for both front-ends: the rule, the round, the
schedule.

Each worker trains a local copy; every K local steps it syncs with the parameter servers.
Dense variables and tables, one rule:

* push: ``delta = (local - old) / N``; ``old += delta``; the PS value ``+= delta`` (a
  table pushes only the rows changed in the worker's copy since its last push, whole:
  n = 1, and the PS averages the pushes of a row that several workers trained from the
  same value, see :mod:`tfpsx.embedding.geo_rule`);
* pull: ``local += global - old``; ``old = global`` (a table pulls the rows any worker
  changed on the PS since this worker's last pull: the PS keeps a changed-key set per
  worker).

The dense rule is :func:`dense_push` / :func:`dense_pull` here, the table rule lives with
the tables (:mod:`tfpsx.embedding.geo_rule`: a worker cache flushes by it too). Both
build ops in graph mode and run in eager mode or ``tf.function``.

A **round** is a sequence of phases (:func:`round_phases`): in the background
communicator (Paddle's GeoCommunicator) a push and the pull right after it; in the
deterministic schedule (``geo_sync_in_train_thread=True``) push, every worker meets,
pull, every worker meets again (with a worker cache, which reads the PS on a miss, they
meet first too). A front-end interprets the phases: a TF1 session runs them one
``session.run`` each; Keras chains them inside its compiled step.

The **schedule** (:class:`GeoSchedule`) says when a round runs, for both front-ends: a
round starts once K local steps were trained since the last one started
(:meth:`GeoSchedule.due`; training starts with every step pushed), a final round runs
when training ends with local steps not yet pushed, and the communicator stops in a
bound. A front-end only says how a step and a round run: graph mode runs a deterministic
round between two ``session.run`` of the step; Keras chains it inside its compiled step
(``steps_per_execution`` steps may run in one call), deciding by the same
:meth:`GeoSchedule.due` on its step counters and reporting the round
(:meth:`GeoSchedule.ran_in_step`).

A background round starts only when at least K + L local steps are left to train, L
being the steps trained while the last round ran (K before any round), when the
front-end knows how many are left (Keras ``fit`` does; graph mode does not): else the
final round pushes them (checked at the wake-up and again when the round would start).
A round still in flight when the next is due (it took longer than K local steps) holds
the training thread until it ends (bounded by TFPSX_RPC_TIMEOUT; logged once, counted
in ``round_waits`` / ``round_wait_seconds``): rounds stay K steps apart and a pull lands
within K steps of its push (left to run on, a slow round made the rounds as far apart
as it was long, K x N past what the rule holds at: docs/modes.md, "GEO at N workers").
A background pull lands L steps after its round started, while the copy trains on; after
it the copy holds the global model plus its own unpushed delta, and the steps after the
pull are what bring it back from overshooting (the others' moves and its own delta both
carry what every worker learned). A pull that lands at the end of training leaves no
such steps, and the final push adds every copy's uncorrected rest to a global that has
everyone's move already. Measured on the Criteo job, 1 PS + 4 workers, 146 steps per
worker, one round moving ~145k rows out and ~330k in (4-5 s, L ~ 26 steps): K = 120
ended at AUC 0.720 / log loss 0.85 (four runs), 0.759-0.763 / 0.48 with the same rounds
run while training paused, 0.761 / 0.50 with this rule; K = 50: 0.723 (K-only rule:
0.748, 0.752; this rule: 0.760).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from typing import Callable, Dict, List, Optional, Protocol, Tuple

import tensorflow as tf

from tfpsx import errors, metrics, settings
from tfpsx.background import BackgroundLoop
from tfpsx.embedding.cache import WorkerCache
from tfpsx.embedding.geo_rule import GeoTable, HotRows, combine_for, table_pull, table_push
from tfpsx.embedding.sharding import ShardedTable
from tfpsx.embedding.updaters import TableUpdater

PUSH, PULL, BARRIER = "push", "pull", "barrier"
# GEO's quality holds only with at least this many rounds in an epoch (docs/modes.md,
# "GEO at N workers": with fewer, no table rule kept async's AUC at 4 workers or more).
MIN_ROUNDS_PER_EPOCH = 8
# k_steps="auto" (docs/modes.md, "GEO at N workers"): K = the epoch's local steps //
# MIN_ROUNDS_PER_EPOCH, and K x N at most GEO_AUTO_KN (word2vec in the harness: within 1%
# of async's loss up to K x N = 40, 2% over at 80; the Criteo job held further); where no
# epoch length is known (graph mode), GEO_K_WITHOUT_EPOCH within the same bound.
GEO_AUTO_KN = 40
GEO_K_WITHOUT_EPOCH = 10

logger = logging.getLogger("tfpsx")


class GeoCounters(metrics.Counters):
    """What the GEO communicator did on this worker (``metrics.snapshot()["geo"]``)."""
    GROUP = "geo"
    # sync_seconds: total time spent in push + pull; round_waits / round_wait_seconds:
    # the training thread waited for a background round in flight (GeoSchedule)
    FIELDS = ("pushes", "rows_sent", "rows_received", "bytes_sent", "bytes_received",
              "sync_seconds", "round_waits", "round_wait_seconds")

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


def push_ops(dense: List[GeoVariable], tables: List[GeoTable], n: float, step=None,
             counters: List[GeoVariable] = ()):
    """The push phase: every dense pair (``delta / n``), every counter pair (n = 1: the
    job's step count) and every table's changed rows (whole deltas, n = 1: a row is
    rarely trained by every worker between two syncs). Returns (ops, (rows, bytes) the
    tables sent)."""
    ops = [dense_push(v, n) for v in dense] + [dense_push(v, 1) for v in counters]
    rows = []
    for t in tables:
        op, count = table_push(t, 1.0, step)
        ops.append(op)
        rows.append((count, t.global_.dim, _value_bytes(t)))
    return ops, rows_and_bytes(rows)


def pull_ops(variables: List[GeoVariable], tables: List[GeoTable], after=()):
    """The pull phase, after the ops ``after``: every pair and the rows any worker
    changed on the PS. Returns (ops, (rows, bytes) the tables received)."""
    ops = [dense_pull(v, after) for v in variables]
    rows = []
    for t in tables:
        op, count = table_pull(t, after)
        ops.append(op)
        rows.append((count, t.global_.dim, _value_bytes(t)))
    return ops, rows_and_bytes(rows)


def _value_bytes(t: GeoTable) -> int:
    return 4 if t.wire is None else t.wire.size


def rows_and_bytes(rows) -> Tuple[tf.Tensor, tf.Tensor]:
    """(rows, bytes) as int64 tensors of ``(count, dim, value_bytes)`` entries: a row
    moves its key and ``dim`` values."""
    counts = [(tf.cast(r, tf.int64), dim, size) for r, dim, size in rows]
    return (tf.add_n([tf.constant(0, tf.int64)] + [r for r, _, _ in counts]),
            tf.add_n([tf.constant(0, tf.int64)] +
                     [r * (8 + size * dim) for r, dim, size in counts]))


# GEO's rule for many workers (docs/modes.md, "GEO at N workers"): its keys' values. A
# key left unnamed is chosen by the job's worker count: this rule from GEO_MANY_WORKERS
# workers on, the earlier rule (GEO_EARLIER) below, where it kept async's quality and is
# faster. A table with a worker cache, and the hybrid mode's all-reduced dense weights,
# keep their own unless the key is named (then a combination that does not apply is an
# error).
GEO_MANY_WORKERS = 3
GEO_FOR_MANY = {"geo_table_rule": "shared_slots", "geo_dense": "async", "geo_hot_count": 4}
GEO_EARLIER = {"geo_table_rule": "average", "geo_dense": "copies", "geo_hot_count": 0}


def rule_for(options, worker_num: int) -> Dict[str, object]:
    """GEO's rule for a job of ``worker_num`` workers: ``geo_table_rule``, ``geo_dense``,
    ``geo_hot_count``. A key the user named keeps its value; the others come from the
    rule for many workers at ``GEO_MANY_WORKERS`` workers or more, else from the
    earlier rule (docs/modes.md, "GEO at N workers"). The hybrid mode's dense weights
    are all-reduced: its ``geo_dense`` is "copies" (unused)."""
    base = GEO_FOR_MANY if worker_num >= GEO_MANY_WORKERS else GEO_EARLIER
    rule = {key: getattr(options, key, None) for key in base}
    rule = {key: base[key] if value is None else value for key, value in rule.items()}
    if getattr(options, "dense", "ps") == "allreduce":
        rule["geo_dense"] = "copies"
    return rule


def shares_slots(options, worker_num: int) -> bool:
    """Whether GEO's tables travel with their optimizer slots, summed on the PS
    (``geo_table_rule="shared_slots"``; :func:`rule_for`)."""
    return rule_for(options, worker_num)["geo_table_rule"] == "shared_slots"


def dense_async(options, worker_num: int) -> bool:
    """Whether GEO's dense weights train async on the PS (``geo_dense="async"``) rather
    than as worker copies synced every K steps (:func:`rule_for`)."""
    return rule_for(options, worker_num)["geo_dense"] == "async"


def hot_count(options, worker_num: int) -> int:
    """How often an id must occur in a worker's batch for GEO to train its row on the PS
    (``geo_hot_count``, 0: never; :func:`rule_for`)."""
    return int(rule_for(options, worker_num)["geo_hot_count"] or 0)


def named_rule_keys(options) -> frozenset:
    """The GEO rule's keys the user named (a default gives way where it does not apply)."""
    return getattr(options, "geo_explicit", frozenset())


def log_rule(options, worker_num: int) -> None:
    """Says which GEO rule the job runs, and why (once per process and rule)."""
    rule = rule_for(options, worker_num)
    line = ", ".join(f"{key}={value!r}" for key, value in rule.items())
    if line not in _LOGGED_RULES:
        _LOGGED_RULES.add(line)
        named = sorted(named_rule_keys(options))
        logger.info("GEO at %d worker(s): %s (%s)", worker_num, line,
                    f"named: {', '.join(named)}; the others by the worker count" if named else
                    "by the worker count: the rule for many workers from 3, docs/modes.md")


_LOGGED_RULES: set = set()


def wire_dtype(options) -> Optional[tf.DType]:
    """The dtype GEO's table rows travel in (None: float32), from a
    ``DistributedStrategy``'s ``geo_wire_dtype``."""
    name = getattr(options, "geo_wire_dtype", "float32")
    return None if name == "float32" else tf.as_dtype(name)


# ----------------------------------------------------------------------------- the round

def round_phases(deterministic: bool, cached: bool) -> Tuple[str, ...]:
    """One sync round's phases, in order.

    Background: push, then pull (one round trip less: the pull may follow in the same
    step). Deterministic: push, every worker meets (every push is in), pull, they meet
    again (nobody pushes before everyone pulled); with a worker cache they also meet
    first (a cache reads the PS on a miss: no push may land while another worker still
    runs its local steps)."""
    if not deterministic:
        return (PUSH, PULL)
    return ((BARRIER,) if cached else ()) + (PUSH, BARRIER, PULL, BARRIER)


@contextlib.contextmanager
def caches_locked(tables: List[GeoTable]):
    """Holds the sync locks of the worker caches among ``tables`` (a round's push must
    not run beside a stager's eviction push of the same rows)."""
    with contextlib.ExitStack() as stack:
        for t in tables:
            if t.cached:
                stack.enter_context(t.local.sync_lock)
        yield


def dense_size(dense: List[GeoVariable]) -> Tuple[int, int]:
    """(rows, bytes) a round moves for the dense copies, each way (float32)."""
    rows = sum(int(v.local.shape[0]) if v.local.shape.rank else 1 for v in dense)
    return rows, sum(4 * int(v.local.shape.num_elements()) for v in dense)


def count_round(counters: GeoCounters, start: float, dense: Tuple[int, int],
                sent: Tuple[int, int], received: Tuple[int, int]) -> None:
    """Adds one round to ``counters``: ``sent`` / ``received`` are the tables' (rows,
    bytes); ``dense`` the dense copies' (:func:`dense_size`), moved each way."""
    counters.add(pushes=1, rows_sent=dense[0] + int(sent[0]), bytes_sent=dense[1] + int(sent[1]),
                 rows_received=dense[0] + int(received[0]),
                 bytes_received=dense[1] + int(received[1]),
                 sync_seconds=time.monotonic() - start)


# ----------------------------------------------------------------------------- the schedule

def auto_k_steps(epoch_steps: Optional[int], worker_num: int) -> int:
    """``k_steps="auto"``'s K for an epoch of ``epoch_steps`` local steps (None: unknown)
    at ``worker_num`` workers: :data:`MIN_ROUNDS_PER_EPOCH` rounds an epoch, K x N at
    most :data:`GEO_AUTO_KN`."""
    k = GEO_AUTO_KN // max(1, worker_num)
    k = min(k, epoch_steps // MIN_ROUNDS_PER_EPOCH if epoch_steps else GEO_K_WITHOUT_EPOCH)
    return max(1, k)


def few_rounds(k_steps: int, epoch_steps: Optional[int]) -> Optional[str]:
    """The warning for a K that leaves fewer than :data:`MIN_ROUNDS_PER_EPOCH` rounds in
    an epoch of ``epoch_steps`` local steps (None if it does not, or the length is
    unknown)."""
    if not epoch_steps or epoch_steps // k_steps >= MIN_ROUNDS_PER_EPOCH:
        return None
    return (f"GEO: k_steps={k_steps} leaves {epoch_steps // k_steps} round(s) in an epoch of "
            f"{epoch_steps} local steps on this worker; with fewer than "
            f"{MIN_ROUNDS_PER_EPOCH} rounds per epoch GEO loses model quality against async "
            f"(docs/modes.md, 'GEO at N workers'): k_steps <= "
            f"{max(1, epoch_steps // MIN_ROUNDS_PER_EPOCH)} keeps {MIN_ROUNDS_PER_EPOCH}")


class GeoSchedule:
    """When this worker syncs, for either front-end.

    Args:
      k_steps: local steps between rounds.
      deterministic: rounds inline every K steps with barriers (else a background
        communicator, woken once K steps are unpushed).
      run_round: ``run_round(phases)`` runs one round now (the front-end's executor).
      cached: whether any table of the mode has a worker cache (read when a round runs).
      barrier: all workers meet (``RUNTIME.barrier_worker``).
      first_round: the background communicator's first wake-up runs this instead of a
        round (Keras traces its sync function there, off ``fit``'s path).
      rounds_in_step: the front-end runs deterministic rounds inside its step (Keras:
        several steps may run in one call), when :meth:`due` says, and reports each by
        :meth:`ran_in_step`; ``run_round`` then runs the final round only. False: they
        run from :meth:`step_done`.
    """

    def __init__(self, k_steps: int, deterministic: bool,
                 run_round: Callable[[Tuple[str, ...]], None],
                 cached: Callable[[], bool], barrier: Callable[[], None],
                 first_round: Optional[Callable[[], None]] = None,
                 rounds_in_step: bool = False, auto_workers: int = 0,
                 counters: Optional[GeoCounters] = None):
        self.k_steps, self.deterministic = k_steps, deterministic
        # k_steps="auto" in a job of this many workers: K chosen by the first fit_length
        self._auto_workers = auto_workers
        self._run_round, self._cached, self._barrier = run_round, cached, barrier
        self._first_round, self._inline = first_round, not rounds_in_step
        self.pushed = 0  # local steps counted at the start of the last round
        self._steps = 0  # local steps reported by step_done
        self._loop: Optional[BackgroundLoop] = None
        # Local steps trained while the last background round ran (before any: K).
        self.lag = k_steps
        # The background round: asked for and not started yet (_requested); none in
        # flight (_idle). A worker waits for the round in flight before the next is due
        # (its pull lands within K local steps of its start: see the module doc).
        self._requested = False
        self._idle = threading.Event()
        self._idle.set()
        self._counters = counters
        self._steps_left: Optional[int] = None  # as the front-end last said
        self._warned = set()  # the epoch lengths check_epoch warned of
        self._told_wait = False  # the first wait for a round in flight was logged

    @property
    def running(self) -> bool:
        """A background communicator is running."""
        return self._loop is not None

    def phases(self, deterministic: Optional[bool] = None) -> Tuple[str, ...]:
        return round_phases(self.deterministic if deterministic is None else deterministic,
                            self._cached())

    def start(self, steps: int) -> None:
        """Training starts with ``steps`` local steps run so far (all pushed)."""
        self.pushed = self._steps = steps
        if self.deterministic:
            # No worker trains (and pushes) before every worker copied the global values
            # and registered its table readers.
            self._barrier()
        elif self._loop is None:
            self._requested = False
            self._idle.set()
            self._loop = BackgroundLoop("GEO communicator", self._background).start()
            if self._first_round is not None:
                self._loop.wake()

    def due(self, steps, pushed):
        """The rule of when a round starts, in both front-ends: K local steps trained since
        the last round started (``pushed``). Python ints, or tensors (a round decided
        inside a compiled step)."""
        return steps - pushed >= self.k_steps

    def fit_length(self, epoch_steps: Optional[int]) -> None:
        """A ``fit`` starts whose epochs hold ``epoch_steps`` local steps (None: unknown):
        with ``k_steps="auto"`` the first one chooses K (kept after: a compiled step holds
        it), then :meth:`check_epoch`."""
        if self._auto_workers:
            n, self._auto_workers = self._auto_workers, 0
            self.k_steps = self.lag = auto_k_steps(epoch_steps, n)
            logger.info("GEO: k_steps='auto' is %d (%s; K x %d workers at most %d)",
                        self.k_steps,
                        f"{MIN_ROUNDS_PER_EPOCH} rounds in an epoch of {epoch_steps} local "
                        "steps" if epoch_steps else "the epoch's length is unknown",
                        n, GEO_AUTO_KN)
        self.check_epoch(epoch_steps)

    def check_epoch(self, epoch_steps: Optional[int]) -> Optional[str]:
        """Warns (the ``tfpsx`` logger, once per epoch length) when K leaves fewer than
        :data:`MIN_ROUNDS_PER_EPOCH` rounds in an epoch of ``epoch_steps`` local steps
        (None: unknown, nothing said). Returns the warning."""
        message = few_rounds(self.k_steps, epoch_steps)
        if message and epoch_steps not in self._warned:
            self._warned.add(epoch_steps)
            logger.warning(message)
        return message

    def step_done(self, steps: int, steps_left: Optional[int] = None) -> None:
        """``steps`` local steps have run (after a step, or an execution of several);
        ``steps_left``: how many training will still run, when the front-end knows (a
        background round then starts only with at least K + :attr:`lag` of them left:
        see the module doc)."""
        self._steps, self._steps_left = steps, steps_left
        if self._loop is not None:
            self._loop.check()
            if not self._requested and self.due(steps, self.pushed) and self._time_left():
                self._wait_for_round(steps)
                self._requested = True
                self._idle.clear()
                self._loop.wake()
        elif self.deterministic and self._inline and self.due(steps, self.pushed):
            self.round(steps, self.phases())

    def round(self, steps: int, phases: Tuple[str, ...]) -> None:
        """One round now. Counted from its start: the K steps trained while it runs wake
        the next one (counted after it, a wake-up during a slow round would run a
        redundant round)."""
        self.pushed = steps
        self._run_round(phases)

    def _time_left(self) -> bool:
        """Enough steps are left for a background round (or their count is unknown)."""
        left = self._steps_left
        return left is None or left >= self.k_steps + self.lag

    def restart(self, steps: int) -> None:
        """The front-end's session was created again (TF's MonitoredSession, after an
        error): the communicator's round in flight ran on the closed session, and its
        failure is that session's, not a new one; the communicator starts again."""
        self._stop_loop("the round in flight when the session was created again")
        self._first_round = None
        if self.deterministic:  # (no barrier: the others are not meeting now)
            self.pushed = self._steps = steps
            return
        self.start(steps)

    def _stop_loop(self, what: str) -> Optional[BackgroundLoop]:
        """Stops the communicator after its round in flight (bounded by
        TFPSX_RPC_TIMEOUT, else a ClusterTimeoutError naming ``what``); the stopped loop."""
        loop, self._loop = self._loop, None
        timeout = settings.get("TFPSX_RPC_TIMEOUT")
        if loop is not None and not loop.stop(timeout):
            raise errors.ClusterTimeoutError(
                f"GEO communicator: {what} did not finish within TFPSX_RPC_TIMEOUT="
                f"{timeout:g} s")
        return loop

    def ran_in_step(self, steps: int) -> None:
        """A deterministic round started inside the step after ``steps`` local steps
        (``rounds_in_step``)."""
        self.pushed = steps

    def _wait_for_round(self, steps: int) -> None:
        """Waits for the background round in flight, started K or more local steps ago
        (its pull then lands within K steps of its start, as the rule's quality needs:
        docs/modes.md, "GEO at N workers"), bounded by TFPSX_RPC_TIMEOUT. A failed round
        raises its error (BackgroundTaskError)."""
        if self._idle.is_set():
            return
        timeout = settings.get("TFPSX_RPC_TIMEOUT")
        began = time.monotonic()
        while not self._idle.wait(0.05):
            self._loop.check()
            if time.monotonic() - began > timeout:
                raise errors.ClusterTimeoutError(
                    f"GEO communicator: the round started at local step {self.pushed} still "
                    f"ran at local step {steps} after TFPSX_RPC_TIMEOUT={timeout:g} s of "
                    f"waiting (a worker trains at most k_steps={self.k_steps} steps beside "
                    "a round); is a parameter server alive?")
        self._loop.check()
        waited = time.monotonic() - began
        if self._counters is not None:
            self._counters.add(round_waits=1, round_wait_seconds=waited)
        if not self._told_wait:
            self._told_wait = True
            logger.info("GEO: the round started at local step %d still ran %d steps later "
                        "(k_steps=%d): this worker waits for a round in flight before the "
                        "next (%.2f s this time; metrics 'geo' round_wait_seconds). A "
                        "round takes longer than K steps: a larger k_steps (K x N at most "
                        "%d, docs/modes.md) or async trains on instead",
                        self.pushed, steps - self.pushed, self.k_steps, waited, GEO_AUTO_KN)

    def _background(self) -> None:
        if self._first_round is not None:
            first, self._first_round = self._first_round, None
            first()
            return
        try:
            if not self._time_left():
                # A wake-up during a round that ran long: the steps left now are too few.
                self._requested = False
                return
            started = self.pushed = self._steps
            self._requested = False  # (after pushed: step_done asks for the next K on)
            self._run_round(self.phases())
            self.lag = self._steps - started
        finally:
            self._idle.set()

    def end(self, steps: int, raise_failure: bool = True) -> bool:
        """Training ended after ``steps`` local steps: the communicator stops (bounded by
        TFPSX_RPC_TIMEOUT) and the steps not pushed yet reach the PS in a final round
        (push, pull: no barrier, the others may be done). If the communicator had
        failed, nothing more is sent and its error is raised (``raise_failure``; a
        BackgroundTaskError), else False is returned."""
        self._steps = steps
        loop = self._stop_loop("the last sync")
        if loop is not None:
            if loop.error is not None:
                if raise_failure:
                    loop.check()
                return False
        if steps > self.pushed:
            self.round(steps, self.phases(deterministic=False))
        return True


# ----------------------------------------------------------------------------- tables

class GeoState(Protocol):
    """What a table joins in GEO (graph mode's ``GeoMode``, Keras's ``KerasGeo``)."""
    worker_index: int
    worker_num: int
    worker_device: str
    tables: List[GeoTable]
    wire_dtype: Optional[tf.DType]  # the rows travel in it (None: float32)
    in_train_thread: bool  # deterministic rounds (the PS combines a round's pushes)
    share_slots: bool  # rows travel with their optimizer slots, summed (geo_table_rule)
    hot_count: int  # ids seen this often in a batch train on the PS (0: none)
    named: frozenset  # the rule's keys the user named (named_rule_keys)

    def local_train_op(self, op) -> None:
        """A table's local training op was built (graph mode counts local steps by it)."""


class GeoTableUpdater(TableUpdater):
    """Lookups read this worker's copy; gradients train it (its optimizer, locally).

    A table with ``cache_size`` keeps a bounded copy: a worker cache
    (:mod:`tfpsx.embedding.cache`) whose sync is the mode's every K steps (n = 1, as
    every table row in GEO).
    """

    def __init__(self, mode: GeoState):
        super().__init__()
        self._mode = mode
        self._geo: Optional[GeoTable] = None
        self._hot = 0  # this table's hot count (none with a worker cache)

    def attach(self, table) -> None:
        mode, me = self._mode, self._mode.worker_index
        options = getattr(table, "cache_options", None)
        share, hot = mode.share_slots, mode.hot_count
        if options is not None:
            # A worker cache syncs rows without their slots and reads them through the
            # cache: a named rule that cannot apply is an error, a default gives way.
            if share and "geo_table_rule" in mode.named:
                raise ValueError(f"table {table.name!r}: a worker cache (cache_size) syncs "
                                 "its rows without their optimizer slots; a_sync_configs"
                                 "['geo_table_rule']='shared_slots' does not apply to it "
                                 "(use 'average', or no cache)")
            if hot and "geo_hot_count" in mode.named:
                raise ValueError(f"table {table.name!r}: a worker cache (cache_size) reads "
                                 "its rows through the cache; a_sync_configs"
                                 f"['geo_hot_count']={hot} (hot rows trained on the PS) "
                                 "does not apply to it (use geo_hot_count=0, or no cache)")
            if share or hot:
                logger.info("GEO: table %r has a worker cache: its rows are averaged and "
                            "none trains on the PS (the rule for many workers applies to "
                            "tables without a cache)", table.name)
            share = hot = False
        self._hot = hot
        if options is not None:
            self.cache = WorkerCache(table, options, mode.worker_device, me,
                                     scale=1.0, flush_in_step=False, wire=mode.wire_dtype,
                                     combine=combine_for(mode.in_train_thread))
            self._geo = self.cache.geo
            mode.tables.append(self._geo)
            return
        copy = dict(initializer=table.initializer, seed=table.seed,
                    devices=[mode.worker_device])
        local = ShardedTable(f"{table.name}/geo_local_w{me}", table.dim,
                             optimizer=table.optimizer, min_frequency=table.min_frequency, **copy)
        # With shared slots, old keeps the slots a row had at the last pull too.
        old = ShardedTable(f"{table.name}/geo_old_w{me}", table.dim,
                           optimizer=table.optimizer if share else None, **copy)
        self._geo = GeoTable(table, local, old, mode.worker_device, me, wire=mode.wire_dtype,
                             combine="sum" if share else combine_for(mode.in_train_thread),
                             share_slots=share)
        mode.tables.append(self._geo)

    def lookup_source(self, table):
        if self._hot:
            return HotRows(self._geo, self._hot)
        return self._geo.local

    def rows_source(self, table):
        # The copy, whole: the hot rows' PS moves reach it at every pull (the last one in
        # the final sync), as an evaluation reads it (HotRows.lookup).
        return self._geo.local

    def apply_gradients(self, table, keys, grads, step, hot=None):
        if hot is not None:  # the hot rows on the PS, the rest in the copy
            op = HotRows(self._geo, self._hot).apply(keys, grads, hot, step)
        else:
            op = self._geo.local.apply(keys, grads, step)
        self._mode.local_train_op(op)
        return op

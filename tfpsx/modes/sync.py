"""sync, once for both front-ends: each step applies the average of the gradients of
``replicas_to_aggregate`` workers, exactly one gradient from each, once.

The protocol (:class:`SyncGroup`), per step ``s``:

1. every worker pushes its gradients, stamped ``s`` (its local step): dense ones into one
   accumulator per gradient on the PS (:class:`GradientAccumulators`), a table's row
   gradients into its shards' accumulators (:class:`TableAccumulators`); then it marks
   ``pushed[me] = s + 1`` in a vector on PS 0 (:meth:`SyncGroup.mark_pushed`);
2. the chief waits (:meth:`SyncGroup.wait_for_gradients`) until ``replicas_to_aggregate``
   of the workers still in the group have pushed for ``s``, takes that many gradients
   from every accumulator (their average), marks older ones stale, applies the average
   once and bumps the step on PS 0 (:meth:`SyncGroup.advance`);
3. every other worker waits (:meth:`SyncGroup.wait_for_step`) until the step passed
   ``s`` and trains the next one from there: the step is the token, so no worker can
   supply two gradients of one step.

A worker whose training ends leaves the group (``pushed[me] = DONE``): nobody waits for
it again. The chief applies the steps: when it leaves, the sync steps are over and the
others end their training (graph mode: the session stops; Keras: the epoch's data ends).
Every wait is bounded (TFPSX_SYNC_STEP_TIMEOUT) and checks every half second whether the
scheduler declared a worker it waits for dead (no heartbeat for TFPSX_HEARTBEAT_TIMEOUT):
then it fails at once, naming the worker and its address.

The ops are built the same way in a TF1 graph and in a ``tf.function``; the waits are
Python, given a way to read PS 0's values (a ``session.run`` or an eager read). A
front-end decides only how a step runs them: graph mode in its session hook
(:mod:`tfpsx.training.modes.sync`), Keras inside its compiled step
(:mod:`tfpsx.keras.modes.sync`).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, List, Optional, Protocol, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tfpsx import errors, settings
from tfpsx.embedding.updaters import TableUpdater
from tfpsx.modes.group import DONE, DRAINING, leave, op_of, set_entry
from tfpsx.modes.state import SYNC_LOCAL_STEP, SYNC_PUSHED, SYNC_STEP, StateFactory

logger = logging.getLogger("tfpsx")


def replicas_to_aggregate(strategy, workers: int, what: str) -> int:
    """The strategy's replicas_to_aggregate (default: every worker), checked."""
    replicas = strategy.replicas_to_aggregate
    replicas = workers if replicas is None else replicas
    if isinstance(replicas, bool) or not isinstance(replicas, int) or \
            not 1 <= replicas <= workers:
        raise ValueError(f"{what}: sync needs replicas_to_aggregate in 1..{workers} (the "
                         f"cluster's worker count), got {replicas!r}")
    return replicas


# ----------------------------------------------------------------------------- the group

DRAINED = object()  # (a draining chief's wait: no other worker is left in the group)


class SyncGroup:
    """The step protocol of one worker (see the module doc).

    Args:
      step: int64 scalar variable on PS 0: the steps applied so far.
      pushed: int64 ``[workers]`` variable on PS 0: per worker, 1 + the step it pushed
        gradients for last (0: not yet; :data:`DONE`: it left).
      local_step: int64 scalar variable on this worker: the step it trains (the stamp of
        its gradients).
      me, workers, replicas: this worker's index, the worker count, replicas_to_aggregate.
      dead_workers: ``() -> [(rank, address)]``, the workers the scheduler declared dead.
    """

    def __init__(self, step, pushed, local_step, me: int, workers: int, replicas: int,
                 dead_workers: Callable[[], List[Tuple[int, str]]]):
        self.step, self.pushed, self.local_step = step, pushed, local_step
        self.me, self.workers, self.replicas = me, workers, replicas
        self.is_chief = me == 0
        self._dead_workers = dead_workers
        self._required: Optional[int] = None  # the last count a blocking take waited for
        # Called now and then while a worker waits for the chief (its front-end's: an
        # exact save's ack, tfpsx.data.splits's waiting points).
        self.while_waiting: Optional[Callable[[], None]] = None

    @classmethod
    def create(cls, factory: StateFactory, me: int, workers: int, replicas: int,
               dead_workers: Callable[[], List[Tuple[int, str]]]) -> "SyncGroup":
        """The group, its variables made by a front-end's ``factory``: the step and the
        pushed vector on PS 0 (:data:`~tfpsx.modes.state.SYNC_STEP`,
        :data:`~tfpsx.modes.state.SYNC_PUSHED`), this worker's local step starting at
        the step."""
        step = factory.shared(SYNC_STEP, workers)
        pushed = factory.shared(SYNC_PUSHED, workers)
        local_step = factory.local(SYNC_LOCAL_STEP, step.read_value)
        return cls(step, pushed, local_step, me, workers, replicas, dead_workers)

    # ------------------------------------------------------------------ ops
    def join(self) -> list:
        """This worker (re)joins: it trains the current step (a restarted worker's
        gradients are not stale) and counts as pushed up to it."""
        now = self.step.read_value()
        return [op_of(self.local_step.assign(now)), set_entry(self.pushed, self.me, now)]

    def mark_pushed(self, after: Sequence = (), stamp=None):
        """After the ops ``after`` (this step's pushes): ``pushed[me] = s + 1``, where
        ``s`` is ``stamp`` (the step the pushes were stamped with) or the local step."""
        with tf.control_dependencies(list(after)):
            s = self.local_step.read_value() if stamp is None else stamp
            return set_entry(self.pushed, self.me, s + 1)

    def leave(self):
        """This worker's training ended: nobody waits for it again."""
        return leave(self.pushed, self.me)

    def drain(self):
        """The chief's own data ended while others still train (an input leased as each
        worker goes, tfpsx.data.splits): it pushes no more gradients, but applies the
        others' steps until they leave (:meth:`wait_to_drain`), then leaves."""
        return set_entry(self.pushed, self.me, DRAINING)

    def advance(self, after: Sequence = (), follow: bool = True):
        """The chief, after the ops ``after`` (the step's apply): the step + 1, and (with
        ``follow``) this worker's local step follows; returns the new step (read after
        both). Without ``follow`` the ops stay on PS 0 (graph mode feeds its stamps)."""
        with tf.control_dependencies(list(after)):
            bump = self.step.assign_add(1, read_value=False)
        with tf.control_dependencies([op_of(bump)]):
            new = self.step.read_value()
        with tf.control_dependencies([self.follow(new)] if follow else []):
            return tf.identity(new)

    def take_step(self, accumulators: Sequence["GradientAccumulators"],
                  tables: "TableAccumulators", count, s, after: Sequence = ()):
        """The chief's step ``s``, its first half (both front-ends): after the ops
        ``after``, ``count`` gradients from every set of dense accumulators (their
        average, for the front-end's optimizer to apply), the older ones marked stale,
        and the tables' average applied by their server-side optimizers. Returns (the
        averages, one list per set; the stale marks; the tables' applies)."""
        after = list(after)
        with tf.control_dependencies(after):
            taken = [accs.take(count) for accs in accumulators]
        with tf.control_dependencies([g for grads in taken for g in grads] + after):
            # Gradients stamped before the next step are stale once this step's are out.
            stale = [op for accs in accumulators for op in accs.set_global_step(s + 1)]
        with tf.control_dependencies(after):
            applied = tables.apply(count, s + 1)  # the step applied, from 1
        return taken, stale, applied

    def end_step(self, applied: Sequence, tables: "TableAccumulators", s,
                 follow: bool = True):
        """The chief's step ``s``, its second half: after the ops ``applied`` (the
        dense averages applied), the tables' older gradients marked stale and the step
        bumped (:meth:`advance`); returns the new step."""
        with tf.control_dependencies(list(applied)):
            stale = tables.set_global_step(s + 1)
        return self.advance(list(applied) + stale, follow=follow)

    def follow(self, new):
        """This worker trains step ``new`` next."""
        return op_of(self.local_step.assign(new, read_value=False))

    # ------------------------------------------------------------------ the waits
    def required(self, pushed: np.ndarray) -> int:
        """The gradients a step needs: ``replicas_to_aggregate`` of the workers still in
        the group (fewer when fewer remain)."""
        return max(1, min(self.replicas, int((pushed < DONE).sum())))

    def gradients_ready(self, pushed: np.ndarray, s: int) -> Optional[int]:
        """How many workers pushed for step ``s``, once :meth:`required` have; else None."""
        arrived = int(((pushed >= s + 1) & (pushed < DONE)).sum())
        return arrived if arrived >= self.required(pushed) else None

    def step_ready(self, step: int, chief_left: bool, s: int) -> Optional[int]:
        """The new step once it passed ``s``; None while it did not.

        Raises:
          OutOfRangeError: the chief left before applying ``s``: no more sync steps.
        """
        if step > s:
            return step
        if chief_left:
            raise tf.errors.OutOfRangeError(
                None, None, "sync: the chief (worker 0) finished training; no more sync steps")
        return None

    def wait_for_gradients(self, s: int, read_pushed: Callable[[], np.ndarray],
                           take: Optional[Callable[[int], object]] = None):
        """The chief's wait for the gradients of step ``s``.

        Without ``take`` it polls the pushed vector and returns the gradients' count.
        With ``take``, ``take(required)`` is one bounded blocking attempt (graph mode: a
        run that waits in the accumulators themselves, no polling) returning its result,
        or None when its bound ran out (then the group is read again: a worker may have
        left, or died); the result is returned."""
        if take is None:
            def ready():
                return self.gradients_ready(read_pushed(), s)
        else:
            def ready():
                if self._required is None:
                    self._required = self.required(read_pushed())
                result = take(self._required)
                if result is None:
                    self._required = None
                return result
        return self._poll(ready, lambda t: (
            f"sync: the chief waited {t:g} s (TFPSX_SYNC_STEP_TIMEOUT={t:g} s) for the "
            f"gradients of step {s} from worker(s) {self.missing(read_pushed(), s)}; is it "
            "dead? (lower replicas_to_aggregate to go on without stragglers)"),
            s, read_pushed)

    def wait_for_step(self, s: int, read_step: Callable[[], int],
                      read_pushed: Callable[[], np.ndarray],
                      take: Optional[Callable[[], Optional[int]]] = None) -> int:
        """A worker's wait for the chief to apply step ``s``; the new step.

        Without ``take`` it polls the step. With ``take``, ``take()`` is one bounded
        blocking attempt (graph mode: this worker's token queue, where the chief's apply
        puts the new step) returning a step, or None when its bound ran out; between
        attempts the step and the chief's place in the group are read again."""
        def check():
            # The chief bumps the step before it leaves: a "left" read first, then the
            # step, never misses its last step.
            chief_left = int(read_pushed()[0]) == DONE  # (DRAINING: it applies on)
            return self.step_ready(int(read_step()), chief_left, s)

        def ready():
            new = take() if take is not None else None
            return new if new is not None and s < new < DONE else check()

        return self._poll(ready, lambda t: (
            f"sync: worker {self.me} waited {t:g} s (TFPSX_SYNC_STEP_TIMEOUT={t:g} s) for "
            f"the chief to apply step {s}; still missing the gradients of worker(s) "
            f"{self.missing(read_pushed(), s)}. Is a worker or the chief dead?"),
            s, read_pushed, needed=(0,))

    def others_training(self, pushed: np.ndarray) -> bool:
        """Whether a worker other than this one is still in the group."""
        return bool(np.delete(pushed < DONE, self.me).any())

    def wait_to_drain(self, s: int, read_pushed: Callable[[], np.ndarray],
                      take: Optional[Callable[[int], object]] = None):
        """The draining chief's wait for step ``s`` (:meth:`drain`): as
        :meth:`wait_for_gradients`, but None once no other worker is in the group (the
        last one left rather than push)."""
        if take is None:
            def poll():
                pushed = read_pushed()
                return (self.gradients_ready(pushed, s) if self.others_training(pushed)
                        else DRAINED)
            result = self._poll(poll, lambda t: (
                f"sync: the chief, its own data done, waited {t:g} s "
                f"(TFPSX_SYNC_STEP_TIMEOUT) for the gradients of step {s} from worker(s) "
                f"{self.missing(read_pushed(), s)}; is it dead?"), s, read_pushed)
        else:
            def attempt(count):
                if not self.others_training(read_pushed()):
                    return DRAINED
                return take(count)
            result = self.wait_for_gradients(s, read_pushed, take=attempt)
        return None if result is DRAINED else result

    def apply_until_left(self, s: int, read_pushed: Callable[[], np.ndarray],
                         apply: Optional[Callable[[int], int]] = None,
                         take: Optional[Callable[[int], object]] = None) -> int:
        """The draining chief (:meth:`drain`), from step ``s``: each step the others
        push is applied, until none of them is left in the group; returns the step then.
        A step is ``apply(count)`` once :meth:`wait_to_drain` polled ``count`` gradients
        in (Keras), or ``take(count)`` itself, one bounded attempt that applies and
        returns the new step (graph mode)."""
        drained = 0
        while True:
            result = self.wait_to_drain(s, read_pushed, take=take)
            if result is None:
                break
            s = int(result) if take is not None else apply(result)
            drained += 1
        if drained:
            logger.info("sync: the chief applied %d step(s) of the workers still training "
                        "after its own data ended", drained)
        return s

    def missing(self, pushed: np.ndarray, s: int) -> List[int]:
        """The workers in the group that did not push for step ``s``."""
        return [w for w in range(self.workers) if pushed[w] < s + 1]

    def _poll(self, ready, timeout_message, s: int, read_pushed, needed=()):
        """Polls ``ready()`` until it answers, bounded by TFPSX_SYNC_STEP_TIMEOUT; every
        half second, a worker the step waits for (one that did not push for ``s``, or
        one of ``needed``) that the scheduler declared dead fails the wait at once."""
        timeout = settings.get("TFPSX_SYNC_STEP_TIMEOUT")
        start = time.monotonic()
        deadline, pause, checked = start + timeout, 0.0002, start
        while True:
            result = ready()
            if result is not None:
                return result
            now = time.monotonic()
            if now > deadline:
                raise errors.ClusterTimeoutError(timeout_message(timeout))
            if self.while_waiting is not None and not self.is_chief:
                self.while_waiting()
            if now - checked > 0.5:
                checked = now
                self._fail_if_dead(s, now - start, read_pushed, needed)
            time.sleep(pause)
            pause = min(0.001, pause * 2)

    def _fail_if_dead(self, s: int, waited: float, read_pushed, needed=()) -> None:
        reported = self._dead_workers()
        if not reported:
            return
        waiting_for = set(self.missing(read_pushed(), s)) | set(needed)
        dead = [(rank, address) for rank, address in reported if rank in waiting_for]
        if dead:
            raise errors.ClusterTimeoutError(self.lost_message(dead, f"step {s}", waited))

    def lost_message(self, dead, waited_for: str, waited: float) -> str:
        names = ", ".join(f"worker {rank} at {address}" for rank, address in dead)
        return (f"sync: worker {self.me} waited {waited:.1f} s for {waited_for}, which cannot "
                f"complete: {names} died (the scheduler heard no heartbeat for "
                f"TFPSX_HEARTBEAT_TIMEOUT={settings.get('TFPSX_HEARTBEAT_TIMEOUT'):g} s); "
                "restart the job from its last checkpoint (sync needs every worker; "
                "tfpsx-run --max_restarts restarts a lost worker in place)")


# ----------------------------------------------------------------------------- gradients

class GradientAccumulators:
    """One accumulator per gradient of the model (the same model on every worker gives
    the same order) on a PS, named ``<prefix><i>``: a ConditionalAccumulator for a dense
    gradient, a SparseConditionalAccumulator for an ``IndexedSlices`` one. Gradients
    stamped with a step older than the accumulator's are dropped.

    Args:
      place: ``(i, nbytes) -> device``: where the accumulator of gradient ``i`` (of
        ``nbytes``) goes.
      prefix: the accumulators' shared-name prefix.
      reduction: "mean" or "sum" (the strategy's ``sync_reduction``).
    """

    def __init__(self, grads: Sequence, place: Callable[[int, int], str], prefix: str,
                 reduction: str = "mean"):
        self.accumulators = []
        for i, g in enumerate(grads):
            sparse = isinstance(g, tf.IndexedSlices)
            shape = g.dense_shape if sparse else g.shape
            shape = tf.TensorShape(tf.get_static_value(shape) if sparse else shape)
            size = max(1, shape.num_elements() or 1) * g.dtype.size
            cls = (tf.compat.v1.SparseConditionalAccumulator if sparse
                   else tf.compat.v1.ConditionalAccumulator)
            with tf.compat.v1.device(place(i, size)):
                self.accumulators.append(cls(g.dtype, shape=shape,
                                             shared_name=f"{prefix}{i}",
                                             reduction_type=reduction.upper()))

    def push(self, grads: Sequence, local_step) -> list:
        """This worker's gradients, stamped ``local_step``."""
        return [acc.apply_indexed_slices_grad(g, local_step)
                if isinstance(g, tf.IndexedSlices) else acc.apply_grad(g, local_step)
                for acc, g in zip(self.accumulators, grads)]

    def take(self, count) -> list:
        """The average (``reduction="sum"``: the sum) of ``count`` gradients from each
        accumulator (waits for them)."""
        return [acc.take_indexed_slices_grad(count)
                if isinstance(acc, tf.compat.v1.SparseConditionalAccumulator)
                else acc.take_grad(count) for acc in self.accumulators]

    def set_global_step(self, step) -> list:
        """Gradients stamped before ``step`` are stale from now on."""
        return [acc.set_global_step(step) for acc in self.accumulators]


class TableAccumulators:
    """The sync path of tables: each table shard's row gradients go into a
    SparseConditionalAccumulator on that shard's PS, stamped with the worker's local step
    (stale ones are dropped); the chief takes ``count`` of them, sums each key's rows,
    divides by ``count`` (``reduction="sum"``: does not) and applies the table's
    server-side optimizer once.

    The accumulators are graph objects: a graph (a TF1 graph, a trace of Keras's step)
    pushes to and takes from its own, named by table, shard and the push's order within
    the step, so every trace of a step names the same resources on the servers. A graph
    that pushes nothing (sync's chief applying the steps of workers still training after
    its own data ended) takes from those the last pushing graph named."""

    def __init__(self, reduction: str = "mean"):
        self.reduction = reduction
        self.entries = []   # (table, shard index, accumulator, shared name): this graph's
        self.pushes = []    # the push ops of the current graph
        self._graph = None

    def _current(self) -> None:
        """A new graph starts a new set of entries (a step's trace pushes anew)."""
        graph = tf.compat.v1.get_default_graph()
        if graph is not self._graph:
            self._graph, self.entries, self.pushes = graph, [], []

    def push(self, table, keys, grads, local_step):
        """The op that sends a table's row gradients to its shards' accumulators."""
        self._current()

        def to_accumulator(i, shard, shard_keys, shard_grads):
            serial = sum(1 for t, s, *_ in self.entries if t is table and s == i)
            name = f"{table.name}/part_{i}/sync_grads_{serial}"
            acc = _table_accumulator(table, name)
            self.entries.append((table, i, acc, name))
            return acc.apply_grad(shard_keys, shard_grads, local_step=local_step)

        push = tf.group(*table.on_shards(to_accumulator, keys, [grads]), name="table_sync_push")
        self.pushes.append(push)
        return push

    def _in_this_graph(self) -> list:
        """(table, shard, accumulator) of the current graph: its own entries, or (a graph
        that pushed nothing) the last pushing graph's, made again here by name."""
        if self._graph is tf.compat.v1.get_default_graph():
            return [(t, i, acc) for t, i, acc, _ in self.entries]
        made = []
        for table, i, _, name in self.entries:
            with tf.compat.v1.device(table.shards[i].device):
                made.append((table, i, _table_accumulator(table, name)))
        return made

    def apply(self, count, step) -> list:
        """The chief's ops: take ``count`` (an int or int32 tensor) gradients per shard
        and apply them once."""
        updates = []
        for table, i, acc in self._in_this_graph():
            shard = table.shards[i]
            with tf.compat.v1.device(shard.device):
                taken = acc.take_indexed_slices_grad(count)
                # A key may come from several workers (the accumulator keeps each
                # gradient's rows): one summed row per key, then one optimizer step.
                keys, where = tf.unique(taken.indices)
                grads = tf.math.unsorted_segment_sum(taken.values, where, tf.size(keys))
                if self.reduction == "mean":
                    grads = grads / tf.cast(count, tf.float32)
                updates.append(shard.apply(table.optimizer, keys, grads, step))
        return updates

    def set_global_step(self, step) -> list:
        """Gradients stamped before ``step`` are stale from now on."""
        return [acc.set_global_step(step) for _, _, acc in self._in_this_graph()]


def _table_accumulator(table, name: str):
    return tf.compat.v1.SparseConditionalAccumulator(
        tf.float32, shape=tf.TensorShape([None, table.dim]), reduction_type="SUM",
        shared_name=name)


class SyncState(Protocol):
    """What a table joins in sync (graph mode's ``SyncMode``, Keras's ``KerasSync``)."""

    def push(self, table, keys, grads):
        """The op sending a table's row gradients to the step's aggregation."""


class SyncTableUpdater(TableUpdater):
    """Row gradients go to the sync accumulators of ``mode`` (a :class:`SyncState`)."""

    #: A cache's rows train locally between syncs: no per-step aggregation of them.
    supports_cache = False

    def __init__(self, mode: "SyncState"):
        super().__init__()
        self._mode = mode

    def attach(self, table) -> None:
        pass

    def apply_gradients(self, table, keys, grads, step):
        return self._mode.push(table, keys, grads)

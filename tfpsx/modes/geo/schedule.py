"""GEO's schedule (:class:`GeoSchedule`): when a round runs, for both front-ends.

A round starts once K local steps were trained since the last one started
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
A background pull lands L steps after its round started, while the copy trains on; after
it the copy holds the global model plus its own unpushed delta, and the steps after the
pull are what bring it back from overshooting (the others' moves and its own delta both
carry what every worker learned). A pull that lands at the end of training leaves no
such steps, and the final push would add every copy's uncorrected rest to a global that
has everyone's move already (measured: docs/modes.md, "No background round at the end
of fit").

A round still in flight when the next is due (it took longer than K local steps) holds
the training thread until it ends (bounded by TFPSX_RPC_TIMEOUT; logged once, counted
in ``round_waits`` / ``round_wait_seconds``): rounds stay K steps apart and a pull lands
within K steps of its push (left to run on, a slow round made the rounds as far apart
as it was long, K x N past what the rule holds at: docs/modes.md, "GEO at N workers").

While every table trains async and no dense copy syncs (``quiet``: under
``geo_table_choice="auto"``), a round moves nothing: it reports the steps, reads the
job's choice and gives the chief its estimate, and the steps' input positions commit as
async's do (their updates are on the PS when they end). Such a round then starts K
steps and at least TFPSX_GEO_QUIET_ROUND_SECONDS after the last one started: at K=2 a
round every second step cost a word2vec worker at 8 workers 20 ms of CPU per 1,000
examples against async's 13 (docs/design-notes/geo.md).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional, Tuple

from tfpsx import errors, settings
from tfpsx.background import BackgroundLoop
from tfpsx.modes.geo.round import GeoCounters, round_phases
from tfpsx.modes.geo.rule import auto_kn
from tfpsx.waits import bounded_wait

# GEO's quality holds only with at least this many rounds in an epoch (docs/modes.md,
# "GEO at N workers": with fewer, no table rule kept async's AUC at 4 workers or more).
MIN_ROUNDS_PER_EPOCH = 8
# k_steps="auto" where no epoch length is known (graph mode): within auto_kn's bound.
GEO_K_WITHOUT_EPOCH = 10

logger = logging.getLogger("tfpsx")


def auto_k_steps(epoch_steps: Optional[int], worker_num: int, *, deterministic: bool) -> int:
    """``k_steps="auto"``'s K for an epoch of ``epoch_steps`` local steps (None: unknown)
    at ``worker_num`` workers: :data:`MIN_ROUNDS_PER_EPOCH` rounds an epoch, K x N at
    most :func:`auto_kn` (``deterministic``: the rounds' kind)."""
    k = auto_kn(deterministic) // max(1, worker_num)
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
                 counters: Optional[GeoCounters] = None,
                 quiet: Callable[[], bool] = lambda: False,
                 clock: Callable[[], float] = time.monotonic):
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
        self._requested_at = 0  # the local steps when the round was asked for
        self._idle = threading.Event()
        self._idle.set()
        self._counters = counters
        self._steps_left: Optional[int] = None  # as the front-end last said
        self._warned = set()  # the epoch lengths check_epoch warned of
        self._told_wait = False  # the first wait for a round in flight was logged
        self._quiet, self._clock = quiet, clock
        self._started_at = float("-inf")  # when the last background round started
        self._told_quiet = False

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
            self._loop = BackgroundLoop("GEO communicator", self._background,
                                        final_round_matters=True).start()
            if self._first_round is not None:
                self._loop.wake()

    def due(self, steps, pushed):
        """The rule of when a round starts, in both front-ends: K local steps trained since
        the last round started (``pushed``). Python ints, or tensors (a round decided
        inside a compiled step)."""
        return steps - pushed >= self.k_steps

    def may_round(self, steps: int) -> bool:
        """Whether a background round is due after ``steps`` local steps: :meth:`due`,
        and while quiet, TFPSX_GEO_QUIET_ROUND_SECONDS since the last one started."""
        if not self.due(steps, self.pushed):
            return False
        if self._loop is None or not self._quiet():
            return True
        gap = settings.get("TFPSX_GEO_QUIET_ROUND_SECONDS")
        if not self._told_quiet:
            self._told_quiet = True
            logger.info("GEO: every table trains async: a round, which moves nothing then, "
                        "runs at most every TFPSX_GEO_QUIET_ROUND_SECONDS=%g s (and K=%d "
                        "steps); the steps' input positions commit as async's", gap,
                        self.k_steps)
        return self._clock() - self._started_at >= gap

    def fit_length(self, epoch_steps: Optional[int],
                   job_k: Optional[Callable[[int], int]] = None) -> None:
        """A ``fit`` starts whose epochs hold ``epoch_steps`` local steps (None: unknown):
        with ``k_steps="auto"`` the first one chooses K (kept after: a compiled step holds
        it), then :meth:`check_epoch`. ``job_k(this worker's K)`` returns the job's K
        (the chief's: workers whose epochs differ, a joiner's, take the same K)."""
        if self._auto_workers:
            n, self._auto_workers = self._auto_workers, 0
            own = auto_k_steps(epoch_steps, n, deterministic=self.deterministic)
            self.k_steps = self.lag = own if job_k is None else int(job_k(own))
            logger.info("GEO: k_steps='auto' is %d (%s; K x %d workers at most %d in %s "
                        "rounds)%s", self.k_steps,
                        f"{MIN_ROUNDS_PER_EPOCH} rounds in an epoch of {epoch_steps} local "
                        "steps" if epoch_steps else "the epoch's length is unknown",
                        n, auto_kn(self.deterministic),
                        "deterministic" if self.deterministic else "background",
                        f"; the job's K, chosen by the chief (this worker's epoch would "
                        f"give {own})" if self.k_steps != own else "")
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

    def step_done(self, steps: int, steps_left: Optional[int] = None,
                  may_round: Optional[bool] = None) -> None:
        """``steps`` local steps have run (after a step, or an execution of several);
        ``steps_left``: how many training will still run, when the front-end knows (a
        background round then starts only with at least K + :attr:`lag` of them left:
        see the module doc); ``may_round``: :meth:`may_round` as the front-end asked it
        for this count (Keras reads its exact count only then: asked again, the clock
        could say otherwise)."""
        self._steps, self._steps_left = steps, steps_left
        if self._loop is not None:
            self._loop.check()
            if self._requested and steps - self._requested_at >= self.k_steps:
                # The round asked for K steps ago has not started (its thread did not run:
                # a loaded machine); it would push every step trained meanwhile, from
                # one stale snapshot. The worker waits for it as for a round in flight.
                self._wait_for_round(steps, pending=True)
            may = (self.may_round(steps) if may_round is None
                   else may_round and self.due(steps, self.pushed))
            if not self._requested and may and self._time_left():
                self._wait_for_round(steps)
                self._requested, self._requested_at = True, steps
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

    def stop(self, what: str) -> None:
        """The communicator stops after its round in flight (bounded by TFPSX_RPC_TIMEOUT,
        else a ClusterTimeoutError naming ``what``); nothing runs until :meth:`restart`
        or :meth:`start`. A failure of that round is not raised: it is the session's
        that closes (graph mode's session closing on an error)."""
        self._stop_loop(what)

    def restart(self, steps: int) -> None:
        """The front-end's session was created again (TF's MonitoredSession, after an
        error): the communicator's round in flight ran on the closed session (stopped
        before TF closed it, :meth:`stop`), and its failure is that session's, not a new
        one; the communicator starts again, every one of the ``steps`` counted pushed
        (the front-end dropped those it had not)."""
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

    def _wait_for_round(self, steps: int, pending: bool = False) -> None:
        """Waits for the background round in flight, started K or more local steps ago
        (its pull then lands within K steps of its start, as the rule's quality needs:
        docs/modes.md, "GEO at N workers"), or with ``pending`` for the round asked for
        K or more steps ago that has not started, and then for it to end; bounded by
        TFPSX_RPC_TIMEOUT. A failed round raises its error (BackgroundTaskError)."""
        if self._idle.is_set():
            return
        timeout = settings.get("TFPSX_RPC_TIMEOUT")
        late = steps - self.pushed  # (a pending round sets pushed when it starts)
        what = (f"the round asked for at local step {self._requested_at} had not "
                "ended" if pending else
                f"the round started at local step {self.pushed} still ran")
        waited = bounded_wait(
            self._idle.is_set, timeout, lambda _: errors.ClusterTimeoutError(
                f"GEO communicator: {what} at local step {steps} after "
                f"TFPSX_RPC_TIMEOUT={timeout:g} s of waiting (a worker trains at most "
                f"k_steps={self.k_steps} steps beside a round); is a parameter server "
                "alive?"), poll=0.01, check=self._loop.check)
        self._loop.check()
        if self._counters is not None:
            self._counters.add(round_waits=1, round_wait_seconds=waited)
        if not self._told_wait:
            self._told_wait = True
            logger.info("GEO: %s %d steps later (k_steps=%d): this worker waits "
                        "for a round in flight before the next (%.2f s this time; metrics "
                        "'geo' round_wait_seconds). A round takes longer than K steps: a "
                        "larger k_steps (K x N at most %d, docs/modes.md) or async trains "
                        "on instead", what, late, self.k_steps, waited,
                        auto_kn(self.deterministic))

    def _background(self) -> None:
        if self._first_round is not None:
            first, self._first_round = self._first_round, None
            first()
        # What to do comes from the schedule's state, not from the wake: wakes the
        # thread has not taken merge (a round asked for before the thread first ran
        # would be lost, and the worker stopped at 2K steps).
        if not self._requested:
            return
        try:
            if not self._time_left():
                # A wake-up during a round that ran long: the steps left now are too few.
                self._requested = False
                return
            started = self.pushed = self._steps
            self._started_at = self._clock()
            self._requested = False  # (after pushed: step_done asks for the next K on)
            self._run_round(self.phases())
            self.lag = self._steps - started
        finally:
            self._idle.set()

    def settle(self, steps: int) -> int:
        """An exact save's barrier (``tfpsx.data.splits(exact_saves=True)``), at a step
        boundary of the training thread after ``steps`` local steps: every one of them
        reaches the PS now. The background round in flight, or asked for and not
        started, ends first (bounded by TFPSX_RPC_TIMEOUT; a failed one raises its
        error), then the steps it did not push go in a round of their own (push, pull).
        Each round commits the input positions of the steps it pushed, so the chief's
        checkpoint then holds exactly this worker's steps and their positions, and no
        round runs until the next step asks for one. Returns the steps pushed here.
        Deterministic rounds meet every worker inside a step: refused with exact saves
        (:func:`tfpsx.modes.positions.check_feeds_splits`)."""
        if self.deterministic:
            raise ValueError("GEO: an exact save's barrier cannot settle deterministic "
                             "rounds (geo_sync_in_train_thread=True)")
        self._steps = steps
        if self._loop is not None and not self._idle.is_set():
            timeout = settings.get("TFPSX_RPC_TIMEOUT")
            bounded_wait(self._idle.is_set, timeout, lambda _: errors.ClusterTimeoutError(
                f"GEO communicator: the round started at local step {self.pushed} had not "
                f"ended after TFPSX_RPC_TIMEOUT={timeout:g} s, at an exact save's barrier "
                f"(local step {steps}); is a parameter server alive?"),
                poll=0.01, check=self._loop.check)
            self._loop.check()
        rest = steps - self.pushed
        if rest > 0:
            self.round(steps, self.phases(deterministic=False))
        return max(rest, 0)

    def end(self, steps: int, raise_failure: bool = True) -> bool:
        """Training ended after ``steps`` local steps: the communicator stops (bounded by
        TFPSX_RPC_TIMEOUT) and the steps not pushed yet reach the PS in a final round
        (push, pull: no barrier, the others may be done). If the communicator had
        failed (a round in flight while training ended included: its pushes are lost),
        nothing more is sent and its error is raised as a BackgroundTaskError; with
        ``raise_failure=False`` an error a step already raised (:meth:`step_done`) is not
        raised again, and False is returned."""
        self._steps = steps
        loop = self._stop_loop("the last sync")
        if loop is not None:
            if loop.error is not None:
                if raise_failure or not loop.reported:
                    loop.check()
                return False
        if steps > self.pushed:
            self.round(steps, self.phases(deterministic=False))
        return True

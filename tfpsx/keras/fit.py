"""Where Keras 3's ``fit`` meets the strategy: the callback the strategy supplies.

Keras 3 calls a ``tf.distribute`` strategy only to distribute a dataset, to open its
scope, to run a step and to reduce its outputs; it has no hook around ``fit``, which
tfpsx's modes need (the chief's initialization, GEO's communicator and its final sync,
sync's leaving the group, a bounded wait that failed inside a step re-raised as itself).
As Horovod does, the strategy supplies the callback that joins ``fit`` to it::

    model.fit(dataset, epochs=3, callbacks=strategy.callbacks())

* ``on_train_begin``: the model's checks and the mode's start (a non-chief waits for the
  chief's model; GEO starts its communicator);
* ``on_train_batch_end``: GEO wakes its communicator; worker caches sync;
* ``on_train_end``: the mode's end (GEO's final sync, sync leaves the group).

A ``fit`` without it fails at its first training step with an error naming the fix (the
strategy's step checks a worker-local flag this callback sets). ``evaluate`` and
``predict`` need nothing: the strategy's ``experimental_distribute_dataset``, which Keras
calls when each of them starts, is their hook.

The one hook Keras lacks is ``fit``'s failure: ``on_train_end`` is not called when a
step raises. For the duration of ``fit`` the callback wraps *this model's*
``train_function`` and ``test_function`` (instance attributes Keras itself assigns and
caches), so a failed step ends the mode (GEO's communicator stops, a sync worker leaves
the group) and a tfpsx error raised inside the step (a bounded wait that ran out, a lost
server) comes out as itself; both are restored when ``fit`` ends. A remote op's error may
surface only at the next sync point, which for an epoch's last step is Keras's own wait
at the epoch's end, outside the step: so the wrapped step waits for its ops in flight
itself when it is the epoch's last (or the epoch's length is unknown). ``keras.Model`` itself
is never touched: a model built outside a tfpsx scope trains as Keras trains it.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import keras
import tensorflow as tf

from tfpsx import compat
from tfpsx.control import splits
from tfpsx.embedding.cache import flush_due_eager_caches
from tfpsx.modes.positions import COMMITS

logger = logging.getLogger("tfpsx")


def flush_commits() -> None:
    """This worker's steps done (their ops in flight finished) and their input positions
    committed: an exact save's barrier may go up."""
    compat.async_wait()
    COMMITS.flush()

_STEP_FUNCTIONS = ("train_function", "test_function")


class StrategyCallback(keras.callbacks.Callback):
    """Joins one ``fit`` to a ``tfpsx.keras.ParameterServerStrategy`` (from
    ``strategy.callbacks()``; the same object may serve every ``fit``)."""

    def __init__(self, strategy):
        super().__init__()
        self._strategy = strategy
        self._originals = {}  # step-function name -> Keras's own, while fit runs
        self._active = False
        self._last_in_epoch = True  # the next train step ends the epoch (or may)
        self._epoch = 0
        self._steps_left = None

    # ------------------------------------------------------------------ Keras's hooks
    def _epoch_steps(self) -> Optional[int]:
        """The steps of an epoch as Keras says, None when unknown: also when Keras says 0
        (a dataset that reports no size, as tfpsx.data.splits's: read to its end)."""
        return (self.params.get("steps") if self.params else None) or None

    def on_train_begin(self, logs=None):
        epoch_steps = self._epoch_steps()
        self._strategy.begin_fit(self.model, epoch_steps)
        self._active = True
        if self._strategy.steps_stale():  # (GEO: see KerasGeo._pull_beside)
            self._trace_again("GEO pulls beside weights the step writes by a read and an "
                              "assign")
        else:
            self._wrap("train_function")

    def on_test_begin(self, logs=None):
        if self._active:  # a validation inside fit
            self._wrap("test_function")

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        steps = self._epoch_steps()
        epochs = self.params.get("epochs") if self.params else None
        per_call = getattr(self.model, "steps_per_execution", 1) or 1
        # (An epoch of unknown length may end at any step, except one from
        # tfpsx.data.splits while its iteration still has splits to take: a wait each
        # step syncs the remote executors, a round trip to every server, which cost the
        # Criteo job 12% of its examples/s.)
        self._last_in_epoch = (batch + per_call >= steps if steps is not None else
                               not (getattr(getattr(self._strategy, "extended", None),
                                            "feeds_splits", False) and
                                    splits.leases_left()))
        # The steps this fit runs after this execution (GEO starts no background round
        # it could not follow with K of them); None when the epoch's length is unknown.
        self._steps_left = (None if steps is None or epochs is None else
                            (epochs - self._epoch) * steps - min(batch + per_call, steps))

    def on_train_batch_end(self, batch, logs=None):
        try:
            self._strategy.translating(self._strategy.batch_end, self.model,
                                       self._steps_left)
            if self._strategy.steps_stale():
                self._trace_again()
            flush_due_eager_caches()  # worker caches sync between steps
            # An input's exact save (tfpsx.data.splits(exact_saves=True)): this worker's
            # steps committed, it waits here while the chief saves.
            self._strategy.translating(splits.pause_points, self._strategy.flush_for_save)
            if self._last_in_epoch:
                # The ops this callback ran since the step's own wait are in flight too:
                # their remote error must come out here, named, not from Keras's wait
                # at the epoch's end as a raw UnavailableError.
                self._strategy.translating(compat.async_wait)
        except BaseException:
            self._fail()
            raise

    def on_train_end(self, logs=None):
        self._restore()
        self._active = False
        self._strategy.end_fit(self.model)

    # ------------------------------------------------------------------ the failure path
    def _wrap(self, name: str) -> None:
        original = getattr(self.model, name, None)
        if original is None or name in self._originals:
            return

        @functools.wraps(original)
        def step(*args, **kwargs):
            try:
                out = self._strategy.translating(original, *args, **kwargs)
                if name == "train_function" and self._last_in_epoch:
                    self._strategy.translating(compat.async_wait)
                return out
            except (StopIteration, tf.errors.OutOfRangeError):
                raise  # the end of an epoch's data: Keras's own loop ends the epoch
            except BaseException:
                self._fail()
                raise

        self._originals[name] = (original, step)
        setattr(self.model, name, step)

    def _trace_again(self, why: str = "GEO's choice between rounds and async changed"
                     ) -> None:
        """The mode's state changed what the model's steps must run (``why``): the train
        step is traced again before the next step (fit reads ``model.train_function`` at
        each), and evaluate / predict trace theirs when next called."""
        self._restore()
        self.model.test_function = self.model.predict_function = None
        self.model.make_train_function(force=True)
        self._wrap("train_function")
        logger.info("the train step is traced again at the next step (%s)", why)

    def _restore(self) -> None:
        for name, (original, step) in self._originals.items():
            if getattr(self.model, name, None) is step:
                setattr(self.model, name, original)
        self._originals = {}

    def _fail(self) -> None:
        """A step of this fit raised: Keras will not call ``on_train_end``."""
        if not self._active:
            return
        self._active = False
        self._restore()
        try:
            self._strategy.end_fit(self.model, failed=True)
        except Exception as e:  # noqa: BLE001 — the step's failure is the one to report
            logger.warning("after a failed fit(), ending the %s mode failed too: %s",
                           self._strategy.mode, e)

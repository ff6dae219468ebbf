"""The exact saves' barrier of an input (``tfpsx.data.splits(exact_saves=True)``): the
chief raises it on PS 0 around each save; every worker holding a lease commits its steps
and acks at its next step boundary, and trains nothing until the save is done (a sync
worker acks from its wait for the chief instead, where it is while the chief saves), so
the checkpoint's position holds exactly the steps of its model. The coordinator's side is
the ``TfpsxSplitBarrier`` op (:mod:`tfpsx.control.splits`)."""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import tensorflow as tf

from tfpsx import errors, settings
from tfpsx.background import BackgroundLoop
from tfpsx.control import splits

logger = logging.getLogger("tfpsx")

# How often a worker of an input with exact saves looks for the chief's save barrier.
POLL_SECONDS = 0.05


class SaveBarrier:
    """One worker's side of an input's save barrier.

    Args:
      name: the input's name (in messages).
      worker: this worker's index.
      client: ``() -> SplitCoordinator``, the input's coordinator client.
    """

    def __init__(self, name: str, worker: int, client: Callable[[], "splits.SplitCoordinator"]):
        self.name, self.worker, self._client = name, worker, client
        # The last generation this worker saw up (its poller) and the last it acked
        # (or, the chief, raised itself).
        self._seen = self._acked = 0
        self._began = 0.0
        self._poller: Optional[BackgroundLoop] = None

    def start(self) -> None:
        """Polls PS 0 for a raised barrier from now on (every POLL_SECONDS)."""
        if self._poller is None:
            self._poller = BackgroundLoop(f"input {self.name} save barrier", self._poll,
                                          interval=POLL_SECONDS).start()

    def _poll(self) -> None:
        try:
            generation, up, _ = self._client().barrier(splits.BARRIER_STATE)
        except (errors.ServerUnavailableError, tf.errors.OpError) as e:
            logger.warning("input %s: worker %d could not read the save barrier: %s",
                           self.name, self.worker, e)
            return
        if up and generation > self._acked:
            self._seen = generation

    def pause_point(self, flush: Callable[[], None]) -> None:
        """A step boundary: when the chief's exact save has its barrier up, this worker
        commits what its steps trained (``flush``), acks, and trains nothing until the
        save is done (at most TFPSX_SAVE_BARRIER_TIMEOUT: the barrier falls by itself)."""
        generation = self._seen
        if generation <= self._acked:
            return
        began = time.monotonic()
        flush()
        client = self._client()
        client.barrier(splits.BARRIER_ACK, self.worker, generation)
        self._acked = generation
        while True:
            last, up, _ = client.barrier(splits.BARRIER_STATE)
            if not up or last != generation:
                break
            time.sleep(0.01)
        logger.info("input %s: worker %d paused %.0f ms for the chief's exact save", self.name,
                    self.worker, 1000 * (time.monotonic() - began))

    def waiting_point(self, flush: Callable[[], None]) -> None:
        """Inside a wait for the chief (sync: a worker waits in its step for the chief to
        apply it, the steps before it trained and committed): when the chief's exact save
        has its barrier up, this worker commits what is due (``flush``) and acks, and
        waits on as it was (the chief applies no step while it saves). It never reaches
        a step boundary while the chief saves, so :meth:`pause_point` alone would leave
        the save waiting for it."""
        generation = self._seen
        if generation <= self._acked:
            return
        flush()
        self._client().barrier(splits.BARRIER_ACK, self.worker, generation)
        self._acked = generation
        logger.info("input %s: worker %d acked the chief's exact save from its wait for "
                    "the chief", self.name, self.worker)

    def begin(self, flush: Callable[[], None]) -> bool:
        """The chief, before it saves: raises the barrier, commits its own steps
        (``flush``) and waits until every worker holding a lease acked (its steps
        committed, none trained now). Returns True.
        A worker that does not ack within TFPSX_SAVE_BARRIER_TIMEOUT (a dead one's
        leases expire and stop counting) is named in a warning and the save goes on:
        a restore may then repeat that worker's last steps (never skip one)."""
        timeout = settings.get("TFPSX_SAVE_BARRIER_TIMEOUT")
        client = self._client()
        self._began = time.monotonic()
        generation, _, _ = client.barrier(splits.BARRIER_BEGIN,
                                          value=max(1, int(timeout * 1000)))
        self._acked = generation
        flush()
        client.barrier(splits.BARRIER_ACK, self.worker, generation)
        while True:
            last, up, waiting = client.barrier(splits.BARRIER_STATE)
            if waiting == 0:
                break
            if not up or last != generation:
                logger.warning(
                    "input %s: exact save: %d worker(s) holding leases did not pause within "
                    "%g s (TFPSX_SAVE_BARRIER_TIMEOUT); saving anyway: a restore may repeat "
                    "their last steps", self.name, waiting, timeout)
                break
            time.sleep(0.005)
        return True

    def end(self) -> None:
        """The chief's save is done: the workers train on."""
        self._client().barrier(splits.BARRIER_END, value=self._acked)
        logger.info("input %s: exact save: the barrier was up %.0f ms", self.name,
                    1000 * (time.monotonic() - self._began))

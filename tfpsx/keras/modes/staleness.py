"""Bounded staleness on Keras: async, and after each step a worker ticks its clock on PS 0
and waits (bounded by TFPSX_STALENESS_TIMEOUT) while it is more than ``max_staleness``
steps ahead of the slowest worker (graph mode's rule: ``wait_for_slowest``)."""

from __future__ import annotations

import tensorflow as tf

from tfpsx import settings
from tfpsx.keras.modes.async_ import KerasAsync
from tfpsx.keras.variables import SharedVariable
from tfpsx.modes.staleness import finish, tick, wait_for_slowest
from tfpsx.modes.state import WORKER_CLOCKS


class KerasStaleness(KerasAsync):
    NAME = "staleness"

    def __init__(self, keras_strategy, options, config):
        super().__init__(keras_strategy, options, config)
        self.waits = 0  # steps this worker had to wait for the slowest
        self._clocks = None

    def clocks(self) -> SharedVariable:
        if self._clocks is None:
            self._clocks = self.state.shared(WORKER_CLOCKS, self.worker_num)
        return self._clocks

    def begin_fit(self, model) -> None:
        super().begin_fit(model)
        self.clocks()

    def after_step(self) -> list:
        clocks = self.clocks()
        counted = super().after_step()  # the global step
        with tf.control_dependencies(counted):
            ticked = tick(clocks, self.worker_index)
        with tf.control_dependencies([ticked]):
            now = clocks.read_value()
        return [tf.py_function(self._wait, [now], tf.bool, name="tfpsx_staleness_wait")]

    def _wait(self, clocks) -> bool:
        def read():
            return self._clocks.read_value().numpy()

        waited = self.keras_strategy.reporting(wait_for_slowest)(
            clocks.numpy(), read, self.worker_index, self.options.max_staleness,
            settings.get("TFPSX_STALENESS_TIMEOUT"))
        self.waits += waited
        return waited

    def end_fit(self, model) -> None:
        # A worker that is done holds nobody back.
        if self._clocks is not None:
            finish(self._clocks, self.worker_index)
        super().end_fit(model)

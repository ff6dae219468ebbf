"""async: variables and the optimizer's apply ops live on the parameter servers; no
worker waits for another. Everything is the base mode's default."""

from tfpsx.training.modes.base import Mode


class AsyncMode(Mode):
    NAME = "async"

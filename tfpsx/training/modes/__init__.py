"""The training modes in graph mode, one module each, behind the :class:`~base.Mode`
interface: TF1-session executors of the protocols in :mod:`tfpsx.modes`.

* :mod:`~.async_`: variables and apply ops on the PS, nobody waits;
* :mod:`~.sync`: gradients of ``replicas_to_aggregate`` workers averaged per step, one
  from each (:mod:`tfpsx.modes.sync`), dense and tables;
* :mod:`~.staleness`: async, no worker more than ``max_staleness`` steps ahead;
* :mod:`~.geo`: k-step GEO, dense and sparse, with its communicator;
* :mod:`~.collective`: no servers, gradients averaged by all-reduce every step;
* :mod:`~.hybrid`: tables on the servers (async or GEO), dense gradients all-reduced.

A new mode is a module with a ``Mode`` subclass plus one entry in ``REGISTRY``.
"""

from typing import Dict, Type

from tfpsx.modes.group import refuse_a_late_join
from tfpsx.training.modes import async_, collective, geo, hybrid, staleness, sync
from tfpsx.training.modes.base import Mode, WrappedOptimizer, mode_of

REGISTRY: Dict[str, Type[Mode]] = {
    cls.NAME: cls for cls in (async_.AsyncMode, sync.SyncMode, staleness.StalenessMode,
                              geo.GeoMode, collective.CollectiveMode)}


def mode_class(strategy, config) -> Type[Mode]:
    """The implementation of ``strategy.mode`` in the job of ``config`` (the hybrid
    mode's, for its tables' mode)."""
    if strategy.hybrid:
        return hybrid.mode_class(strategy)
    if strategy.mode == "geo":
        return geo.mode_class(strategy, config)
    return REGISTRY[strategy.mode]


def mode_for(strategy, config, graph=None) -> Mode:
    """The mode object of ``graph`` (default: the current one) for ``strategy``."""
    refuse_a_late_join(strategy, config)
    return mode_class(strategy, config).for_graph(strategy, config, graph)


__all__ = ["Mode", "WrappedOptimizer", "REGISTRY", "mode_class", "mode_for", "mode_of"]

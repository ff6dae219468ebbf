"""The Keras side of each training mode (see :mod:`~tfpsx.keras.modes.base`), one module
each, resolved from ``DistributedStrategy.mode`` through ``REGISTRY``."""

from typing import Dict, Type

from tfpsx.keras.modes.async_ import KerasAsync
from tfpsx.keras.modes.base import KerasMode
from tfpsx.keras.modes.geo import KerasGeo, geo_class
from tfpsx.keras.modes.hybrid import hybrid_class
from tfpsx.keras.modes.staleness import KerasStaleness
from tfpsx.keras.modes.sync import KerasSync

REGISTRY: Dict[str, Type[KerasMode]] = {
    cls.NAME: cls for cls in (KerasAsync, KerasSync, KerasStaleness, KerasGeo)}


def mode_class(options, config) -> Type[KerasMode]:
    """The Keras implementation of ``options.mode`` in the job of ``config``."""
    if options.mode == "collective":
        raise ValueError("tfpsx.keras.ParameterServerStrategy: DistributedStrategy("
                         "collective=True) trains without parameter servers; use "
                         "tfpsx.keras.CollectiveStrategy() (after "
                         "tfpsx.init(is_collective=True))")
    if options.mode == "geo" and not options.hybrid:
        return geo_class(options, config)
    return hybrid_class(options) or REGISTRY[options.mode]


__all__ = ["KerasMode", "REGISTRY", "mode_class"]

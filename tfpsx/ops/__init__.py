"""The op layer: :mod:`~tfpsx.ops.loader` finds and loads the compiled library (and
refuses one built for another TF); :mod:`~tfpsx.ops.bindings` is the only code that calls
its ops."""

from tfpsx.ops.loader import REBUILD_COMMAND, build_info, find_library, library_info, load_ops

__all__ = ["load_ops", "library_info", "build_info", "find_library", "REBUILD_COMMAND"]

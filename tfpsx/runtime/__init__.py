"""The process runtime behind tfpsx's Fleet-style API, by concept: the state machine
(:mod:`.state`: ``init``, ``reset``, the worker's states, barriers), the control plane
(:mod:`.control_plane`), the TF1 server and session config (:mod:`.graph_server`), a
collective worker's start and leave (:mod:`.collective`, the hybrid mode's too), the
liveness watches and what a loss does (:mod:`.watches`), ``run_server``
(:mod:`.server`)."""

from tfpsx.runtime.server import ServerReport
from tfpsx.runtime.state import RUNTIME, Runtime

__all__ = ["RUNTIME", "Runtime", "ServerReport"]

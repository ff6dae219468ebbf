"""A task that cannot listen on its address: a named error and an exit code of its own.

A launcher picks free ports and the tasks bind them seconds later, when TensorFlow has
loaded; in between another process (a second launcher, an outgoing connection's
ephemeral port) can take one. TF then says only ``Could not start gRPC server``. Here it
becomes a :class:`~tfpsx.errors.PortTakenError` naming the task and its address, and a
process that leaves on it exits with :data:`~tfpsx.control.watchdog.EXIT_PORT_TAKEN`,
which ``tfpsx-run`` answers by starting the job again on new ports.
"""

from __future__ import annotations

import contextlib

from tfpsx.control import sockets, watchdog
from tfpsx.errors import PortTakenError

# What TF's gRPC server says when it could not bind its port (TF 2.16-2.21).
_TF_BIND_FAILED = "Could not start gRPC server"


# What grpcio says when a Python gRPC server (the scheduler) could not bind its port.
_GRPC_BIND_FAILED = "Failed to bind"


def port_taken(what: str, address: str, detail: str) -> PortTakenError:
    """The error of ``what`` (the task, "server 0") that could not listen on ``address``;
    a process that it ends exits with :data:`~tfpsx.control.watchdog.EXIT_PORT_TAKEN`."""
    watchdog.exit_if_uncaught()
    return PortTakenError(
        f"{what} could not listen on {address}: another process holds the port "
        f"({detail.strip()[:200]}); give it a free port (tfpsx-run starts the job again on "
        "new ports by itself)")


@contextlib.contextmanager
def listening(what: str, address: str):
    """Around the start of a server at ``address``: a failed bind raises
    :func:`port_taken`'s error; in a task its launcher keeps on loopback, a server that
    listens beyond it raises :class:`~tfpsx.errors.ExposedPortError`
    (:func:`tfpsx.control.sockets.check_confined`)."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 — TF's UnknownError, grpc's RuntimeError
        if _TF_BIND_FAILED not in str(e) and _GRPC_BIND_FAILED not in str(e):
            raise
        raise port_taken(what, address, str(e)) from e
    port = address.rsplit(":", 1)[-1]
    if port.isdigit():
        sockets.check_confined(what, int(port))

"""Every exception tfpsx raises on purpose. Each message names what was waited for or
what was wrong, and what was expected.

This module is the bottom layer of the package: it imports nothing from tfpsx.
"""


class OpLibraryError(ImportError):
    """The tfpsx op library is missing, was built for another TensorFlow, or failed to load."""


class NotInitializedError(RuntimeError):
    """A tfpsx call that needs the cluster came before ``tfpsx.init()``."""


class WrongRoleError(RuntimeError):
    """A call made from a role that cannot make it (``run_server()`` on a worker...)."""


class OpsNotLoadedOnServerError(RuntimeError):
    """A parameter server runs without the tfpsx op library.

    A bare ``tf.distribute.Server`` cannot run tfpsx ops: start servers with
    ``tfpsx.run_server()``, or call ``tfpsx.load_ops()`` before creating the server.
    """


class ClusterTimeoutError(TimeoutError):
    """A bounded wait ran out: the message says what was awaited and what is missing."""


class ServerUnavailableError(ConnectionError):
    """A parameter server (or the scheduler) stopped answering."""


class PeerUnavailableError(ConnectionError):
    """Another worker of a collective job stopped answering: no collective can complete
    without it (the message names it)."""


class SchedulerRejectedError(RuntimeError):
    """The scheduler refused a node: wrong token, wrong role, too many nodes, rank taken."""


class BackgroundTaskError(RuntimeError):
    """A tfpsx background thread (GEO communicator, sync update, heartbeat) failed; the
    original exception is chained as ``__cause__``."""


class CheckpointError(FileNotFoundError):
    """An incremental checkpoint cannot be restored: a part of its chain is missing or
    unfinished (the message names the part and the chain)."""


class PortTakenError(OSError):
    """A task could not listen on its address: another process holds the port. The
    process exits with ``tfpsx.control.watchdog.EXIT_PORT_TAKEN``; ``tfpsx-run`` then
    starts the job again on new ports."""


class ExposedPortError(RuntimeError):
    """A server of a job its launcher keeps on loopback listens on an address other
    machines reach (the loopback bind shim did not take effect): the message names the
    port, the address and what to do."""

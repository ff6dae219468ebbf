"""tfpsx's exceptions. Each message names what was waited for or what was wrong."""

from tfpsx._loader import OpLibraryError  # noqa: F401  (re-exported: an ImportError)


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
    """A parameter server stopped answering."""


class SchedulerRejectedError(RuntimeError):
    """The scheduler refused a node: wrong token, wrong role, too many nodes, rank taken."""

"""The first-contact rule for eager clients of a server (TF's CreateContext race).

Several eager clients (Keras workers) connect to one server: each
``tf.config.experimental_connect_to_cluster`` sends that server a ``CreateContext``
request. TF's ``EagerServiceImpl::CreateContext`` (read in TF 2.21's source) decides under a lock
that the server has no context yet, drops the lock, then *replaces* the server's
collective executor manager (freeing the old one) and gives the new context a raw pointer
to the new manager; the context is registered only at its end. Two creations that
overlap on a server with no context both replace the manager: the second frees the one
the first context points to, and the first client's next op that needs a new kernel on
that server dies in ``GetOrCreateKernelAndDevice`` (SIGSEGV). ``docs/eager-anchor.md``
has the whole story and a plain-TF reproduction.

Once one context is registered, no creation replaces anything. So a server that tfpsx
runs never has zero contexts while a client may reach it:

* :func:`anchor` - the server, right after it starts, creates a context of its own on
  its own eager service: a fixed id, ``keep_alive_secs=0`` (TF never collects it), and
  no op ever runs in it. Nothing else is in flight then (clients wait, below), so this
  one creation is the only one that replaces the manager, and it is never freed.
* :func:`wait_anchored` / :func:`connect` - a client connects only once every server
  it will reach answers a ``KeepAlive`` for the anchor's id, so no client's creation can
  overlap the anchor's. That holds for the first start, for restarted or late workers
  (the anchor is still there) and for a restarted server (it anchors again first).

Graph-mode sessions go through the master and worker services, never CreateContext.
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, Optional

import grpc

from tfpsx import errors
from tfpsx.control.channels import FAST_RECONNECT
from tfpsx.control.ports import listening
from tfpsx.control.proto import tf_eager_pb2 as pb
from tfpsx.waits import wait_for

# The anchor context's id ("tfpsx-ac"); clients draw theirs at random from 2**64.
ANCHOR_CONTEXT_ID = 0x74667073782D6163
_CREATE = "/tensorflow.eager.EagerService/CreateContext"
_KEEP_ALIVE = "/tensorflow.eager.EagerService/KeepAlive"
_REFUSED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ABORTED)


def _own_address(server_def) -> str:
    """host:port of the task ``server_def`` describes."""
    for job in server_def.cluster.job:
        if job.name == server_def.job_name and server_def.task_index in job.tasks:
            return job.tasks[server_def.task_index]
    raise ValueError(f"the ServerDef of /job:{server_def.job_name}/task:"
                     f"{server_def.task_index} does not list that task in its cluster")


def anchor(server_def, timeout: float) -> None:
    """Creates the anchor context on the server that ``server_def`` describes (in this
    process, just started). Idempotent: an anchor already there is kept as it is.

    Args:
      server_def: the ``tf.distribute.Server``'s ``server_def``.
      timeout: seconds the one CreateContext call may take.

    Raises:
      ServerUnavailableError: the server did not accept the anchor.
    """
    from tensorflow.core.protobuf import tensorflow_server_pb2

    address = _own_address(server_def)
    # The anchor's session knows this task only: it never talks to another.
    own = tensorflow_server_pb2.ServerDef(job_name=server_def.job_name,
                                          task_index=server_def.task_index,
                                          protocol=server_def.protocol or "grpc")
    own.cluster.job.add(name=server_def.job_name).tasks[server_def.task_index] = address
    own.default_session_config.inter_op_parallelism_threads = 1
    request = pb.CreateContextRequest(server_def=own.SerializeToString(), keep_alive_secs=0,
                                      context_id=ANCHOR_CONTEXT_ID, context_view_id=0)
    # TF's gRPC server listens on every interface: reach it on loopback (on the port it
    # listens on: ServerDef.port, when the cluster lists another address for it).
    target = f"127.0.0.1:{server_def.port or address.rsplit(':', 1)[1]}"
    with grpc.insecure_channel(target, options=FAST_RECONNECT) as channel:
        # Never a second CreateContext for the anchor's id: TF replaces a context whose
        # id it gets again (erasing it first), which would empty the server for a moment.
        if _anchored(channel, timeout, wait=True) == "ok":
            return
        create = channel.unary_unary(
            _CREATE, request_serializer=pb.CreateContextRequest.SerializeToString,
            response_deserializer=pb.CreateContextResponse.FromString)
        try:
            create(request, timeout=timeout, wait_for_ready=True)
        except grpc.RpcError as e:
            raise errors.ServerUnavailableError(
                f"/job:{server_def.job_name}/task:{server_def.task_index} at {target}: its "
                f"eager service did not create tfpsx's anchor context within {timeout:g} s "
                f"({e.code().name}: {e.details()}); without it two eager clients connecting "
                "at once can crash this server (docs/eager-anchor.md)") from e


def _anchored(channel, timeout: float, wait: bool = False) -> str:
    """"ok", or why the anchor is not (yet) visible on the server behind ``channel``
    (``wait``: for the server to accept the connection too, within ``timeout``)."""
    keep_alive = channel.unary_unary(
        _KEEP_ALIVE, request_serializer=pb.KeepAliveRequest.SerializeToString,
        response_deserializer=pb.KeepAliveResponse.FromString)
    try:
        keep_alive(pb.KeepAliveRequest(context_id=ANCHOR_CONTEXT_ID), timeout=timeout,
                   wait_for_ready=wait)
        return "ok"
    except grpc.RpcError as e:
        # TF answers "Unable to find a context_id ..." (ABORTED in TF 2.21; older
        # releases said INVALID_ARGUMENT).
        if e.code() in _REFUSED and "context_id" in (e.details() or ""):
            return "answers, but has no tfpsx anchor context"
        return f"does not answer ({e.code().name})"


def wait_anchored(addresses: Dict[str, str], timeout: float,
                  log: Optional[Callable[[str], None]] = None, report_every: float = 5.0) -> None:
    """Waits until every server in ``addresses`` (task name -> host:port) holds its
    anchor, at most ``timeout`` seconds.

    Raises:
      ClusterTimeoutError: naming each server still without one, and why.
    """
    channels = {task: grpc.insecure_channel(addr, options=FAST_RECONNECT)
                for task, addr in addresses.items()}
    state = {task: "not asked yet" for task in addresses}

    def ask(left: float) -> Dict[str, str]:
        """{task: why not} of the servers still without an anchor (each asked again)."""
        for task in [t for t, s in state.items() if s != "ok"]:
            state[task] = _anchored(channels[task], max(0.05, min(2.0, left)))
        return {t: s for t, s in state.items() if s != "ok"}

    def what(pending) -> str:
        return "; ".join(f"{t} at {addresses[t]} {s}" for t, s in sorted(pending.items()))

    try:
        wait_for(ask, lambda pending: not pending, timeout,
                 lambda pending, _waited: errors.ClusterTimeoutError(
                     f"waited {timeout:g} s for the servers' eager services to be safe for "
                     f"several clients: {what(pending)}. A server that Keras workers connect "
                     "to must run tfpsx.run_server() (or tfpsx.anchor_eager_service(server) "
                     "right after creating its own tf.distribute.Server): two eager clients "
                     "connecting at once can crash a server without it "
                     "(docs/eager-anchor.md). Raise the limit with TFPSX_CONNECT_TIMEOUT."),
                 report=(report_every, lambda pending, _waited: log(
                     f"waiting for the servers' eager anchors: {what(pending)}"))
                 if log else None)
    finally:
        for channel in channels.values():
            channel.close()


def connect(cluster_spec, job_name: str, task_index: int, servers: Dict[str, str],
            timeout: float, log: Optional[Callable[[str], None]] = None,
            port: Optional[int] = None) -> None:
    """``tf.config.experimental_connect_to_cluster`` once every server in ``servers``
    (task name -> host:port) holds its anchor: the one way tfpsx connects an eager
    context to servers that other clients share. ``port``: where this process's own
    server listens, when not at its address in ``cluster_spec`` (TFPSX_LISTEN_PORT)."""
    import tensorflow as tf

    from tfpsx import compat  # TF loads here, not when a server imports this module

    wait_anchored(servers, timeout, log)
    # TF logs the whole default session config at INFO when it connects: noise in every
    # worker's log (tfpsx's own line says what connected).
    tf_logger = tf.get_logger()
    level = tf_logger.level
    tf_logger.setLevel(max(level, logging.WARNING))
    try:
        with listening(f"{job_name} {task_index}",
                       cluster_spec.task_address(job_name, task_index)):
            compat.connect_to_cluster(cluster_spec, job_name, task_index, port)
    finally:
        tf_logger.setLevel(level)
    # TF defers the servers' CreateContext to the process's first eager op: make it here,
    # where a failure names the connect, not a later op.
    compat.ensure_eager_context_initialized()

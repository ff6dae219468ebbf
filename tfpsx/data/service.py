"""Preprocessing offloaded to TF's tf.data service, the position still leased from PS 0.

A job's workers may spend more CPU reading and parsing their input than training on it.
``tfpsx-run --data_workers N`` (:class:`~tfpsx.launcher.local.LocalCluster`'s
``data_workers``, the Kubernetes manifests' ``data-worker`` set) starts TF's own
dispatcher (fault tolerant, journaled in a work dir) and N tf.data workers, each a
process of :func:`main`, on loopback like the rest of a local job, and gives every
training task the dispatcher's address in ``TFPSX_DATA_SERVICE``.

:func:`tfpsx.data.splits` then still takes its splits from the coordinator on PS 0, but
reads and parses each one on a data worker: each lease is a dataset registered with the
dispatcher (the split's byte range, from its committed position, as constants) and read
back under ``ShardingPolicy.DYNAMIC`` with a single split, so that one data worker reads
it, in order. Each batch still carries its position, so the step that trains it commits
it as without the service.

The tf.data service's own visitation is at most once: a data worker that dies loses what
it had not delivered. Here that loses nothing: the trainer's side notes, per lease, the
end of the last record delivered (:func:`read_through`), and when a lease's stream ends
short of its end it registers the rest again, from there. A dead data worker is started
again on its address by the launcher; the dispatcher, from its journal.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import uuid
from typing import Callable, List, Optional

import tensorflow as tf

from tfpsx import compat, settings
from tfpsx.cluster import DATA_WORKER, DISPATCHER, ENV_DATA_SERVICE

logger = logging.getLogger("tfpsx")

# How often a data worker tells the dispatcher it lives (and learns of new tasks: a new
# lease's job waits for it) and how soon the dispatcher gives up on a silent one.
HEARTBEAT_MS, WORKER_TIMEOUT_MS = 200, 5000
# Batches of a lease asked of the service at a time: the rest waits on the data worker
# (a trainer does not pull a whole split into its memory ahead of its steps).
OUTSTANDING = 8
# Reads of one lease that deliver nothing before its stream ends: then the service is
# broken (not a data worker that died, which the launcher restarts), and the step fails.
MAX_EMPTY_ATTEMPTS = 3


# The oldest TensorFlow whose tf.data service client reads on from a data worker started
# again on its address (checked: 2.21 does; on 2.16.2 a reader whose data worker stopped
# retried the gone worker's task forever; 2.17-2.20 are not checked, so refused).
MIN_TF = (2, 21)


def address(service: Optional[str] = None) -> Optional[str]:
    """The dispatcher to read through: ``service`` when given, else the job's
    (``TFPSX_DATA_SERVICE``, set by the launcher), else None (read in this process).

    Raises:
      ValueError: a malformed address.
      RuntimeError: a TensorFlow older than :data:`MIN_TF` (its reader could wait
        forever for a data worker that died).
    """
    if service is not None:
        check_address(service)
    else:
        service = settings.raw(ENV_DATA_SERVICE) or None
    if service is not None:
        check_tf_version(tf.__version__)
    return service


def check_address(service) -> None:
    """Raises ValueError unless ``service`` is a dispatcher address (protocol://host:port)."""
    if not isinstance(service, str) or "://" not in service:
        raise ValueError(f"tfpsx.data: service must be a dispatcher address such as "
                         f"'grpc://127.0.0.1:5000', got {service!r}")


def check_tf_version(version: str) -> None:
    """Refuses reading through the tf.data service on a TensorFlow before MIN_TF."""
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if parts < MIN_TF:
        raise RuntimeError(
            f"tfpsx.data: reading through a tf.data service (tfpsx-run --data_workers, or "
            f"service=) needs TensorFlow {MIN_TF[0]}.{MIN_TF[1]} or newer, this is "
            f"{version}: on TF 2.16 a reader whose data worker died waited for it forever "
            "instead of reading on from the one started again on its address, and "
            "versions in between are not checked; read in the training processes (no "
            "--data_workers), or install a newer TensorFlow")


class _Delivered:
    """Lease key -> the end of the last record this process received of it (a lease is
    one worker's, read by one iterator at a time). A table of this process found by its
    name from each function that uses it: a handle captured from the graph that builds
    the dataset would be a table of that graph's device (a parameter server's, under
    ``replica_device_setter``), or another table each time a TF1 graph runs the op."""

    def __init__(self):
        self.name = f"tfpsx_service_delivered_{uuid.uuid4().hex}"

    def _table(self):
        return tf.raw_ops.MutableHashTableV2(key_dtype=tf.int64, value_dtype=tf.int64,
                                             shared_name=self.name)

    def lookup(self, key):
        return tf.raw_ops.LookupTableFindV2(table_handle=self._table(), keys=key,
                                            default_value=tf.constant(-1, tf.int64))

    def insert(self, key, end):
        return tf.raw_ops.LookupTableInsertV2(table_handle=self._table(), keys=key[None],
                                              values=end[None])


def read_through(service: str, remote: Callable, element_spec) -> Callable:
    """``lease -> dataset``: the lease ``(key, path, start, resume, end)`` read on a
    data worker by ``remote(key, path, start, resume, end)`` (whose elements end with
    the ``ends`` vector of their records' end offsets), again from the end of the last
    record delivered when a stream ends short of the lease's ``end``."""
    delivered = _Delivered()

    def lease(key, path, start, resume, end):
        def attempts(state, attempt):
            # (the position a read starts at, reads in a row that delivered nothing): the
            # first read starts at the lease's committed position, a later one where the
            # records delivered so far end (the rest of the lease: a data worker died).
            last, empty = state
            at = tf.where(tf.equal(attempt, 0), resume, delivered.lookup(key))
            empty = tf.where(tf.equal(attempt, 0), tf.constant(0, tf.int64),
                             tf.where(tf.equal(at, last), empty + 1, tf.constant(0, tf.int64)))
            return (at, empty), (attempt, at, empty)

        def read(attempt, at, empty):
            def again():
                tf.print("tfpsx.data: the tf.data service delivered input split", key,
                         "up to offset", at, "of", end, "and ended (a data worker lost "
                         "the rest); reading the rest again", output_stream=sys.stderr)
                return tf.constant(True)

            checks = [delivered.insert(key, at),  # (a key an earlier epoch read)
                      tf.cond(attempt > 0, again, lambda: tf.constant(False)),
                      tf.debugging.assert_less(
                          empty, tf.constant(MAX_EMPTY_ATTEMPTS, tf.int64),
                          message="tfpsx.data: the tf.data service delivered nothing of an "
                                  "input split in several reads in a row (are its data "
                                  "workers up? see their logs)")]
            with tf.control_dependencies(checks):
                at = tf.identity(at)
            records = compat.read_on_service(service, remote(key, path, start, at, end),
                                             element_spec, outstanding=OUTSTANDING)

            def note(*element):
                ends = element[-1]
                noted = delivered.insert(key, tf.reduce_max(ends))
                with tf.control_dependencies([noted]):
                    return element[:-1] + (tf.identity(ends),)

            return records.filter(lambda *e: tf.size(e[-1]) > 0).map(note)

        # A read starts when the one before it ended (flat_map pulls its next input only
        # then), while the lease is unfinished.
        return (tf.data.Dataset.range(1 << 62)
                .take_while(lambda attempt: tf.logical_or(tf.equal(attempt, 0),
                                                          delivered.lookup(key) < end))
                .scan((tf.constant(-1, tf.int64), tf.constant(0, tf.int64)), attempts)
                .flat_map(read))

    return lease


# ---------------------------------------------------------------------- the processes
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tfpsx-data-service",
                                description="one process of a job's tf.data service")
    p.add_argument("role", choices=(DISPATCHER, DATA_WORKER))
    p.add_argument("--port", type=int, required=True, help="the port to listen on")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address the others dial (a data worker's own)")
    p.add_argument("--work_dir", default=None,
                   help="the dispatcher's journal (a dispatcher started again takes the "
                        "service back from it)")
    p.add_argument("--dispatcher", default=None, help="a data worker's dispatcher host:port")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Runs a dispatcher or a data worker until killed."""
    args = _parser().parse_args(argv)
    from tfpsx.control.sockets import check_confined
    from tfpsx.ops import bindings

    # The datasets it runs hold tfpsx's reader op (TfpsxReadSplit); the dispatcher too
    # builds them (their split providers).
    bindings.load_ops()
    service = tf.data.experimental.service
    if args.role == DISPATCHER:
        if not args.work_dir:
            print("tfpsx.data.service: a dispatcher needs --work_dir (its journal)",
                  file=sys.stderr)
            return 2
        os.makedirs(args.work_dir, exist_ok=True)
        server = service.DispatchServer(service.DispatcherConfig(
            port=args.port, work_dir=args.work_dir, fault_tolerant_mode=True,
            worker_timeout_ms=WORKER_TIMEOUT_MS))
        what = "the tf.data dispatcher"
    else:
        if not args.dispatcher:
            print("tfpsx.data.service: a data worker needs --dispatcher host:port",
                  file=sys.stderr)
            return 2
        server = service.WorkerServer(service.WorkerConfig(
            dispatcher_address=args.dispatcher, worker_address=f"{args.host}:{args.port}",
            port=args.port, heartbeat_interval_ms=HEARTBEAT_MS))
        what = "a tf.data worker"
    check_confined(what, args.port)
    print(f"tfpsx.data.service: {what} serves on {args.host}:{args.port}", flush=True)
    server.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())

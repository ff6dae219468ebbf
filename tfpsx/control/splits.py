"""The job's input coordinator on PS 0, as a process reaches it (the data plane's client).

The coordinator (``custom_ops/cc/core/split_coordinator.h``) holds the job's input as a
table of splits and, for every open epoch, how far each split was trained: workers take
splits (leases), commit positions, and give a dead worker's splits back (a lease not
renewed within ``TFPSX_LEASE_TIMEOUT`` returns by itself). :class:`SplitCoordinator` is
its client in this process: eager ops where the process's eager context is connected to
the cluster (Keras), else a small graph of its own run in a session on this worker's
server (graph mode). The user's side (the file table, the reader, the dataset) is
:mod:`tfpsx.data`; where a mode commits is the front-ends' (:func:`commit_op` builds the
op a step or a round runs).

A batch's *position* travels with it in the element's last slot (:func:`make_position`:
each record's split key and end offset): the front-end strips it from what the model
sees and commits it once the step is in the model.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Dict, List, NamedTuple, Optional, Tuple

import tensorflow as tf

from tfpsx import errors, settings
from tfpsx.background import BackgroundLoop
from tfpsx.control.counters import ps0_errors
from tfpsx.ops import bindings

logger = logging.getLogger("tfpsx")

PS0 = "/job:ps/replica:0/task:0/device:CPU:0"
PREFIX = "tfpsx/input/"
# Graph mode: the variable a chief's checkpoint holds an input's position in.
STATE_VARIABLE = "tfpsx_input_position/"
OK, WAIT, END_OF_EPOCHS, PAUSED = 0, 1, 2, 3  # a take's status
BARRIER_STATE, BARRIER_BEGIN, BARRIER_ACK, BARRIER_END = 0, 1, 2, 3


class Lease(NamedTuple):
    status: int
    key: int
    epoch: int
    file: int
    start: int
    resume: int
    end: int


# A batch's position rides in the element's last slot, where Keras would put a sample
# weight: a float32 [5, batch] tensor, each record's split key and end offset (int64,
# bitcast to two float32 each) and its input's tag (a CRC-32 of its name), the batch on
# the last axis so that it broadcasts against a batch of losses. Keras's own code sees it
# only when it builds a model symbolically (shapes, never values); the strategy strips
# it from every step before Keras's train step runs.
POSITION_WIDTH = 5


def input_tag(name: str) -> int:
    """The tag of input ``name`` in its positions (an int32)."""
    import zlib
    value = zlib.crc32(name.encode())
    return value - (1 << 32) if value >= (1 << 31) else value


def make_position(name: str, keys, ends):
    """The position of a batch of records (``keys`` / ``ends``: int64 vectors) of input
    ``name``: float32 [5, batch]."""
    keys = tf.convert_to_tensor(keys, tf.int64)
    tag = tf.fill([tf.size(keys), 1], tf.constant(input_tag(name), tf.int32))
    halves = [tf.reshape(tf.bitcast(tf.cast(v, tf.int64), tf.int32), [-1, 2])
              for v in (keys, ends)]
    return tf.transpose(tf.bitcast(tf.concat(halves + [tag], axis=1), tf.float32))


def looks_like_position(value) -> bool:
    """``value`` has a position's type and shape (float32 [5, batch])."""
    shape = getattr(value, "shape", None)
    return (getattr(value, "dtype", None) == tf.float32 and shape is not None and
            shape.rank == 2 and shape[0] == POSITION_WIDTH)


def split_position(data):
    """(the element without its position, the position or None): a position is the last
    entry of a tuple element (``(x, y, position)`` or ``(x, position)``) while this
    process reads a ``tfpsx.data.splits`` input."""
    if (isinstance(data, tuple) and len(data) >= 2 and looks_like_position(data[-1])
            and registered()):
        rest = data[:-1]
        return (rest[0] if len(rest) == 1 else rest), data[-1]
    return data, None


def decode(position) -> tuple:
    """(input tag, keys, ends) of a position; an assert fails the step when its tag is of
    no input of this process (a float32 [batch, 5] that is not a position)."""
    bits = tf.bitcast(tf.transpose(tf.convert_to_tensor(position, tf.float32)), tf.int32)
    keys = tf.reshape(tf.bitcast(bits[:, 0:2], tf.int64), [-1])
    ends = tf.reshape(tf.bitcast(bits[:, 2:4], tf.int64), [-1])
    return bits[:, 4], keys, ends


def latest(position) -> tuple:
    """A batch's position reduced to (unique split keys, the furthest end of each): the
    records of a split come in order, so the furthest trained is its position."""
    _, keys, ends = decode(position)
    unique, at = tf.unique(keys)
    return unique, tf.math.unsorted_segment_max(ends, at, tf.size(unique))


def inputs_by_tag() -> Dict[int, str]:
    return {input_tag(name): name for name in registered()}


def input_name() -> str:
    """The name of the input this process's batches carry positions of. One input trains
    a model at a time; its name is the one registered here.

    Raises:
      ValueError: this process reads no tfpsx.data input, or several.
    """
    names = registered()
    if not names:
        raise ValueError("a batch carries an input position, but this process built no "
                         "tfpsx.data.splits input")
    if len(names) > 1:
        raise ValueError(f"this process built several tfpsx.data inputs ({sorted(names)}); "
                         "a model trains from one at a time")
    return next(iter(names))


def checked_input(position):
    """(:func:`input_name`, an op asserting every record's tag is that input's).

    Raises:
      ValueError: this process reads no tfpsx.data input, or several.
    """
    name = input_name()
    names = registered()
    tags = inputs_by_tag()
    tag, _, _ = decode(position)
    allowed = tf.constant(sorted(tags), tf.int32)
    known = tf.reduce_all(tf.reduce_any(tf.equal(tag[:, None], allowed[None, :]), axis=1))
    check = tf.debugging.Assert(known, [
        "a batch's last entry is a float32 [5, batch] tensor whose tags name no "
        f"tfpsx.data input of this process ({sorted(names)}): a sample weight of that shape "
        "cannot be told from an input position; reshape it"])
    return name, check


def home(config) -> str:
    """Where the job's input coordinators live: PS 0, or, in a collective job (no
    servers), rank 0's own device (its process serves the others' calls; its checkpoint
    holds the position, and a lost rank restarts the whole job anyway)."""
    if config is None or config.server_num:
        return PS0
    job, task = config.worker_device_job(0)
    return f"/job:{job}/replica:0/task:{task}/device:CPU:0"


def session_config_for(config, base):
    """``base`` (this process's session config) that also reaches the coordinators'
    home: a collective rank's sessions see only its own task."""
    if config is None or config.server_num:
        return base
    import tensorflow as tf

    proto = tf.compat.v1.ConfigProto()
    proto.CopyFrom(base)
    job, task = config.worker_device_job(0)
    if f"/job:{job}/task:{task}" not in proto.device_filters:
        proto.device_filters.append(f"/job:{job}/task:{task}")
    return proto


def coordinator_of(name: str) -> "SplitCoordinator":
    """The client of input ``name`` (registered by ``tfpsx.data.splits``)."""
    return registered()[name].client()


class SplitCoordinator:
    """The input ``name``'s coordinator on PS 0 (a collective job's: on rank 0,
    :func:`home`), as this process reaches it.

    Args:
      name: the input's name (its resource is ``tfpsx/input/<name>`` on PS 0).
      session_target: run the ops in sessions on this target (graph mode); None: eager
        (a process whose eager context is connected to the cluster, or one without a
        cluster: then the coordinator lives in this process).
      device: where it lives (PS 0 by default; None: this process).
    """

    def __init__(self, name: str, session_target: Optional[str] = None,
                 device: Optional[str] = PS0, session_config=None):
        self.name, self.device = name, device
        self.shared_name = PREFIX + name
        self._target, self._session_config = session_target, session_config
        self._lock = threading.Lock()
        self._eager_handle = None
        self._session = None
        self._graph_ops: Dict[str, tuple] = {}
        self._renewal: Optional[BackgroundLoop] = None
        self._renew_failures = 0

    # ------------------------------------------------------------------ ops in a graph
    def _placed(self):
        """The device scope of the coordinator's ops (none: this process's)."""
        return tf.device(self.device) if self.device else contextlib.nullcontext()

    def handle(self):
        """The resource handle, in the current graph or function (eager: made once)."""
        if tf.executing_eagerly() and not tf.inside_function():
            if self._eager_handle is None:
                with self._placed():
                    self._eager_handle = bindings.split_handle(self.shared_name)
            return self._eager_handle
        with tf.control_dependencies(None), self._placed():
            return bindings.split_handle(self.shared_name)

    def commit_op(self, keys, offsets):
        """The op that commits ``keys`` trained up to ``offsets`` (a step's or a round's),
        on the coordinator's device."""
        handle = self.handle()
        with self._placed():
            return bindings.split_commit(handle, keys, offsets)

    def export_op(self):
        """The op exporting the coordinator's state (in the caller's graph)."""
        handle = self.handle()
        with self._placed():
            return bindings.split_export(handle)

    # ------------------------------------------------------------------ calls
    def _run(self, what: str, build, feeds: dict):
        """Runs ``build(handle, **placeholders)`` with ``feeds``: eagerly, or in this
        client's session (its graph built once per call kind)."""
        where = f"through {self._target}" if self._target else "(eager)"
        if self._target is None:
            with ps0_errors(f"the input {self.name!r}'s {what}", where), self._placed():
                return build(self.handle(), **feeds)
        with self._lock:
            if what not in self._graph_ops:
                graph = self._graph()
                with graph.as_default():
                    holders = {k: tf.compat.v1.placeholder(tf.as_dtype(_dtype(v)), _shape(v),
                                                           name=k) for k, v in feeds.items()}
                    with self._placed():
                        out = build(bindings.split_handle(self.shared_name), **holders)
                self._graph_ops[what] = (holders, out)
            holders, out = self._graph_ops[what]
            with ps0_errors(f"the input {self.name!r}'s {what}", where,
                            settings.get("TFPSX_RPC_TIMEOUT")):
                return self._sess().run(out, {holders[k]: v for k, v in feeds.items()})

    def _graph(self):
        if not hasattr(self, "_own_graph"):
            self._own_graph = tf.Graph()
        return self._own_graph

    def _sess(self):
        if self._session is None:
            config = self._session_config or tf.compat.v1.ConfigProto()
            config.operation_timeout_in_ms = int(1000 * settings.get("TFPSX_RPC_TIMEOUT"))
            self._session = tf.compat.v1.Session(self._target, graph=self._graph(),
                                                 config=config)
        return self._session

    def configure(self, digest: str, seed: int, files: List[int], starts: List[int],
                  ends: List[int], lease_seconds: float) -> int:
        """Sets the job's split table (the first caller's; a later one must match its
        digest). Returns the oldest epoch not finished."""
        import numpy as np
        out = self._run("configure", lambda h, **f: bindings.split_configure(h, **f), dict(
            digest=digest, seed=np.int64(seed), files=np.asarray(files, np.int32),
            starts=np.asarray(starts, np.int64), ends=np.asarray(ends, np.int64),
            lease_ms=np.int64(max(1, int(lease_seconds * 1000)))))
        return int(out)

    def _stream(self, what: str, action: int, digest: str = "", seed: int = 0,
                lease_seconds: float = 0.0, names=(), table=(), start: int = 0):
        import numpy as np
        files, starts, ends = (zip(*table) if table else ((), (), ()))
        return self._run(f"stream {what}", lambda h, **f: bindings.split_stream(h, **f), dict(
            action=np.int32(action), digest=digest, seed=np.int64(seed),
            lease_ms=np.int64(max(1, int(lease_seconds * 1000))),
            names=np.asarray(list(names), dtype=object).reshape(-1),
            files=np.asarray(files, np.int32), starts=np.asarray(starts, np.int64),
            ends=np.asarray(ends, np.int64), start=np.int64(start)))

    def configure_stream(self, digest: str, seed: int, lease_seconds: float) -> int:
        """Sets the input as the stream ``digest`` (the first caller's; a later one must
        match). Returns the oldest epoch not finished (a stream's: 0)."""
        value, _ = self._stream("configure", bindings.STREAM_CONFIGURE, digest, seed,
                                lease_seconds)
        return int(_numpy(value))

    def append(self, names: List[str], table) -> int:
        """Adds the stream's files ``names`` not added before, with their splits
        ``table`` ([(index into names, start, end)]); returns the splits added."""
        value, _ = self._stream("append", bindings.STREAM_APPEND, names=names, table=table)
        return int(_numpy(value))

    def files(self, start: int = 0) -> List[str]:
        """The stream's file names from index ``start`` on."""
        _, names = self._stream("files", bindings.STREAM_FILES, start=start)
        return [n.decode() if isinstance(n, bytes) else str(n) for n in _numpy(names)]

    def stop(self) -> None:
        """Every take from now on ends: the job stops (its position keeps the rest)."""
        self._stream("stop", bindings.STREAM_STOP)

    def take(self, worker: int, epoch: int) -> Lease:
        import numpy as np
        out = self._run("take", lambda h, **f: bindings.split_take(h, **f),
                        dict(worker=np.int32(worker), epoch=np.int64(epoch)))
        return Lease(*(int(v) for v in out))

    def commit(self, keys, offsets) -> int:
        import numpy as np
        out = self._run("commit", lambda h, **f: bindings.split_commit(h, **f), dict(
            keys=np.asarray(keys, np.int64).reshape(-1),
            offsets=np.asarray(offsets, np.int64).reshape(-1)))
        return int(out)

    def renew(self, worker: int, release: bool = False) -> int:
        import numpy as np
        out = self._run("renew", lambda h, **f: bindings.split_renew(h, **f),
                        dict(worker=np.int32(worker), release=np.bool_(release)))
        return int(out)

    def give_back(self, worker: int, keys) -> int:
        import numpy as np
        out = self._run("give_back", lambda h, **f: bindings.split_give_back(h, **f), dict(
            worker=np.int32(worker), keys=np.asarray(list(keys), np.int64).reshape(-1)))
        return int(out)

    def barrier(self, action: int, worker: int = 0, value: int = 0) -> Tuple[int, bool, int]:
        """The exact-save barrier after ``action`` (BARRIER_*): (its last generation,
        whether it is up, workers holding a lease that have not acked it)."""
        import numpy as np
        out = self._run("barrier", lambda h, **f: bindings.split_barrier(h, **f), dict(
            action=np.int32(action), worker=np.int32(worker), value=np.int64(value)))
        generation, up, waiting = (_numpy(v) for v in out)
        return int(generation), bool(up), int(waiting)

    def stats(self) -> Dict[str, int]:
        out = self._run("stats", lambda h: bindings.split_stats(h), {})
        return dict(zip(bindings.SPLIT_STATS_FIELDS, (int(v) for v in _numpy(out))))

    def export(self) -> bytes:
        return bytes(_numpy(self._run("export", lambda h: bindings.split_export(h), {})))

    def restore(self, state: bytes) -> int:
        import numpy as np
        out = self._run("import", lambda h, **f: bindings.split_import(h, **f),
                        dict(state=np.asarray(state, dtype=object)))
        return int(out)

    # ------------------------------------------------------------------ leases
    def keep_alive(self, worker: int, lease_seconds: float) -> None:
        """Renews this worker's leases every third of the lease from a background thread
        while the process lives (a dead worker stops: its splits come back)."""
        with self._lock:
            if self._renewal is not None:
                return
            self._renewal = BackgroundLoop(f"input {self.name} leases",
                                           lambda: self._renew_retrying(worker),
                                           interval=max(0.05, lease_seconds / 3)).start()

    def _renew_retrying(self, worker: int) -> None:
        """One renewal of the keep-alive: a failed one is logged and tried again at the
        next (two more before the leases expire); the loop never stops on it, which
        would let this worker's leases expire while it reads them."""
        try:
            self.renew(worker)
        except (errors.ServerUnavailableError, tf.errors.OpError) as e:
            self._renew_failures += 1
            logger.warning("input %s: renewing worker %d's leases failed (%d in a row): %s",
                           self.name, worker, self._renew_failures, e)
            return
        if self._renew_failures:
            logger.info("input %s: worker %d's leases renewed again after %d failure(s)",
                        self.name, worker, self._renew_failures)
        self._renew_failures = 0


def _dtype(value):
    import numpy as np
    value = np.asarray(value)
    return tf.string if value.dtype == object or value.dtype.kind in "SU" else value.dtype


def _shape(value):
    import numpy as np
    return np.asarray(value).shape if np.asarray(value).ndim == 0 else [None]


def _numpy(value):
    return value.numpy() if hasattr(value, "numpy") else value


# ---------------------------------------------------------------- the job's inputs
_INPUTS: Dict[str, "object"] = {}  # name -> the tfpsx.data input that registered it
_INPUTS_LOCK = threading.Lock()


_RESTORED: Dict[str, bytes] = {}  # positions restored before their input was built


def register(name: str, source) -> None:
    """An input of this process (``tfpsx.data.splits``): checkpoints save its position
    (``source.position_state()``) and restore it (``source.restore_position(state)``);
    a position restored before the input was built is applied now."""
    with _INPUTS_LOCK:
        _INPUTS[name] = source
        state = _RESTORED.pop(name, None)
    if state is not None:
        source.restore_position(state)


def restore(name: str, state: bytes) -> Optional[int]:
    """Restores input ``name``'s saved position: into its coordinator now (returns the
    epoch it is at), or when ``tfpsx.data.splits(name=...)`` builds it (None)."""
    with _INPUTS_LOCK:
        source = _INPUTS.get(name)
        if source is None:
            _RESTORED[name] = state
            return None
    return source.restore_position(state)


def registered() -> Dict[str, object]:
    """This process's inputs by name."""
    with _INPUTS_LOCK:
        return dict(_INPUTS)


def leases_left() -> bool:
    """Whether every input of this process still has splits to take in its iteration
    (its end is then at least a split's batches away); False with none."""
    sources = list(registered().values())
    return bool(sources) and all(getattr(s, "leases_left", lambda: False)() for s in sources)


def pause_points(flush) -> None:
    """A training step boundary of this worker: an input whose exact save's barrier is
    up has this worker ``flush()`` its steps' commits, ack, and wait until the save is
    done (``tfpsx.data.splits(exact_saves=True)``; nothing otherwise)."""
    for source in registered().values():
        pause = getattr(source, "pause_point", None)
        if pause is not None:
            pause(flush)


def waiting_points(flush) -> None:
    """Inside this worker's wait for the chief (sync), its steps before it committed once
    ``flush()`` ran: an input whose exact save's barrier is up has this worker ack
    without pausing (nothing otherwise)."""
    for source in registered().values():
        point = getattr(source, "waiting_point", None)
        if point is not None:
            point(flush)


@contextlib.contextmanager
def save_barrier(flush):
    """The chief's save of the model and of its inputs' positions: the exact inputs'
    barriers are up around it (every worker's steps committed and none trained), so
    that the saved positions are exactly the saved model's steps."""
    held = []
    try:
        for source in registered().values():
            begin = getattr(source, "begin_exact_save", None)
            if begin is not None and begin(flush):
                held.append(source)
        yield
    finally:
        for source in held:
            source.end_exact_save()


def input_scalars() -> Dict[str, float]:
    """TensorBoard scalars of this worker's inputs on a cluster (reads PS 0):
    ``input/<name>/epoch`` (the job's first open epoch), ``.../splits_done``,
    ``.../splits_leased``, ``.../splits_left`` (of that epoch), ``.../leases_returned``
    (the job's) and ``.../worker_leases`` (this worker's)."""
    out = {}
    for name, source in sorted(registered().items()):
        if not getattr(source, "clustered", False):
            continue
        stats = source.stats()
        for tag, key in (("epoch", "first_open"), ("splits_done", "done"),
                         ("splits_leased", "leased"), ("splits_left", "left"),
                         ("leases_returned", "leases_returned")):
            out[f"input/{name}/{tag}"] = float(stats[key])
        out[f"input/{name}/worker_leases"] = float(source.counters["leases"])
    return out

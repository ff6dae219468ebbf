"""The job's input read split by split, leased from PS 0: every example trained once,
whatever happens to the job (the data plane).

:func:`splits` cuts the job's files into splits (a file, or ``split_bytes`` of a large
text file), which the coordinator on PS 0 (:mod:`tfpsx.control.splits`) leases to the
workers as they go: a fast worker takes more, a slow one fewer, a worker that joins takes
its first within one lease, and a dead worker's splits come back to the others from
where it stopped. Each worker's ``tf.data.Dataset`` reads the splits it took (the split's
bytes, not its file's: ``TfpsxReadSplit``), parses and batches them, and carries each
batch's *position* (every record's split and end offset) to the step that trains it: the
front-end commits it when the step is in the model (async, staleness, sync: the step's
update applied; GEO: the round that holds the step pushed), so what is committed is
what was trained, not what was read ahead.

A checkpoint saves the coordinator's state (every open epoch's committed positions)
before the model: restored, the job reads every split again from its committed
position. It can repeat the steps trained between that export and the model's (and the
few not yet committed), never skip one.

Each iteration of the dataset is one epoch of the job (``fit(epochs=E)`` iterates it E
times; in graph mode ``dataset.repeat(E)``): every split once, in an order drawn from the
job's ``seed`` and the epoch. A worker whose splits are done waits at the epoch's end
for the splits others hold (at most one split's time). Restored, the first iteration is
the checkpoint's epoch.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import threading
import time
from typing import Callable, List, Optional, Sequence, Union

import tensorflow as tf

from tfpsx import errors, settings
from tfpsx.control import splits as _coordinator
from tfpsx.data import barrier as _barrier
from tfpsx.data import service as _service
from tfpsx.data.barrier import SaveBarrier
from tfpsx.data.pipeline import dataset_of
from tfpsx.runtime import RUNTIME

logger = logging.getLogger("tfpsx")

FORMATS = ("text", "tfrecord")


def file_table(files: Union[str, Sequence[str]], fmt: str, split_bytes: int):
    """(sorted paths, [(file index, start, end)] splits, digest) of the input: a text file
    in ranges of ``split_bytes`` (a smaller one whole), a TFRecord file whole; empty
    files have none.

    Raises:
      ValueError: no file, a missing or unreadable one (named), a bad format or size.
    """
    if fmt not in FORMATS:
        raise ValueError(f"tfpsx.data.splits: format must be one of {FORMATS}, got {fmt!r}")
    if isinstance(split_bytes, bool) or not isinstance(split_bytes, int) or split_bytes < 1:
        raise ValueError(f"tfpsx.data.splits: split_bytes must be an int >= 1, got "
                         f"{split_bytes!r}")
    patterns = [files] if isinstance(files, str) else list(files)
    if not patterns:
        raise ValueError("tfpsx.data.splits: files is empty; expected paths or glob patterns")
    paths: List[str] = []
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise ValueError(f"tfpsx.data.splits: files must be paths or glob patterns, got "
                             f"{pattern!r}")
        found = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not found:
            raise ValueError(f"tfpsx.data.splits: {pattern!r} matches no file")
        paths += found
    paths = sorted(set(os.path.abspath(p) for p in paths))
    table, sizes = [], []
    for i, path in enumerate(paths):
        if not os.path.isfile(path):
            raise ValueError(f"tfpsx.data.splits: input file {path!r} does not exist (or is "
                             "not a file); every worker reads the job's files by the same "
                             "paths")
        if not os.access(path, os.R_OK):
            raise ValueError(f"tfpsx.data.splits: input file {path!r} cannot be read by this "
                             "user")
        size = os.path.getsize(path)
        sizes.append(size)
        step = split_bytes if fmt == "text" else max(size, 1)
        table += [(i, start, min(start + step, size)) for start in range(0, size, step)]
    if not table:
        raise ValueError(f"tfpsx.data.splits: every input file is empty: {paths}")
    listing = "\n".join(f"{p}\t{s}" for p, s in zip(paths, sizes))
    digest = hashlib.sha256(f"{fmt}\n{split_bytes}\n{listing}".encode()).hexdigest()[:16]
    described = (f"{len(paths)} {fmt} file(s) of {sum(sizes):,} bytes in {len(table)} "
                 f"split(s) of at most {split_bytes:,} bytes, sha256 {digest}")
    return paths, table, described


class SplitInput:
    """One input of the job (what :func:`splits` builds): its file table, its coordinator
    on PS 0, and this worker's epochs. Registered by name with tfpsx.control.splits, so
    that checkpoints save and restore its position."""

    follows = False  # a stream (tfpsx.data.stream): its files keep landing

    def __init__(self, name: str, paths, table, digest: str, fmt: str, seed: int,
                 chunk_bytes: int, epochs: Optional[int] = None, exact_saves: bool = False):
        self.name, self.paths, self.table, self.digest = name, paths, table, digest
        self.format, self.seed, self.chunk_bytes = fmt, seed, chunk_bytes
        self.epochs = epochs
        config = RUNTIME.config
        self.clustered = config is not None and config.role == "worker"
        # PS 0, or a collective job's rank 0 (no servers: tfpsx.control.splits.home)
        self.home = _coordinator.home(config if self.clustered else None)
        if self.clustered and exact_saves and not config.server_num:
            raise ValueError(
                "tfpsx.data.splits(exact_saves=True) in a collective job: its ranks step "
                "together, so rank 0's checkpoint holds its positions at most a step "
                "ahead of the others' commits; give exact_saves=False (a restore then "
                "repeats at most the step in flight on each rank)")
        self.worker = config.index if self.clustered else 0
        self.lease_seconds = settings.get("TFPSX_LEASE_TIMEOUT")
        self._lock = threading.RLock()
        self._client: Optional[_coordinator.SplitCoordinator] = None
        self._started = False
        self._next_epoch = 0
        self._generation = 0
        self._start_epochs = {}  # generation -> the epoch it read
        # The keys the current generation leased (a newer one gives them back unless it
        # took every split it could: read to their end).
        self._held = set()
        self._read_all = False
        self._fit_generation = 0  # the last generation of the last fit that ended
        # Keras's fit is about to look at a batch before its steps start (it fails on an
        # input that gives none): an iteration with nothing left to train gives one to
        # look at, never trained (:meth:`keras_will_look`).
        self._look_pending = False
        self.counters = {"leases": 0, "epochs": 0}
        # The exact saves' barrier (exact_saves): the last generation this worker saw up
        # (its poller) and the last it acked (or, the chief, raised itself).
        self.exact = bool(exact_saves)
        self._barrier = (SaveBarrier(name, self.worker, self.client)
                         if self.exact and self.clustered else None)
        if self.clustered and not self.follows and len(table) < config.worker_num:
            raise ValueError(
                f"tfpsx.data.splits: {digest}: {len(table)} split(s) for {config.worker_num} "
                "workers leave some workers nothing to read; give a smaller split_bytes (many "
                "more splits than workers: a slow or dead worker then holds back little)")

    # ------------------------------------------------------------------ the coordinator
    def client(self) -> _coordinator.SplitCoordinator:
        """The coordinator's client, its split table configured (the first worker's; the
        others' must match: the same files, sizes and split size)."""
        with self._lock:
            if self._client is None:
                if not self.clustered:
                    client = _coordinator.SplitCoordinator(self.name, device=None)
                elif RUNTIME.eager_connection is not None:
                    client = _coordinator.SplitCoordinator(self.name, device=self.home)
                else:  # graph mode, a collective rank: a session on this worker's server
                    client = _coordinator.SplitCoordinator(
                        self.name, session_target=RUNTIME.server_target(),
                        device=self.home, session_config=_coordinator.session_config_for(
                            RUNTIME.config, RUNTIME.session_config()))
                self._configure(client)
                self._client = client
            return self._client

    def _configure(self, client) -> None:
        files, starts, ends = zip(*self.table)
        client.configure(self.digest, self.seed, list(files), list(starts), list(ends),
                         self.lease_seconds)

    def path_of(self, file: int) -> str:
        """The path of a lease's file."""
        return self.paths[file]

    def wait_for_more(self) -> None:
        """A stream's take found nothing to lease yet: wait a little (see
        tfpsx.data.stream)."""
        raise NotImplementedError("an input of files never waits for more")

    def client_for_graph(self) -> _coordinator.SplitCoordinator:
        """A client whose ops go into the caller's graph (the coordinator on PS 0)."""
        return _coordinator.SplitCoordinator(self.name, device=self.home)

    def _start(self) -> None:
        """The first take of this process: an earlier process of this worker's rank (one
        that died and was started again in place) gives its splits back; this one renews
        its leases while it lives."""
        if self._started or not self.clustered:
            return
        self._started = True
        client = self.client()
        back = client.renew(self.worker, release=True)
        if back:
            logger.info("input %s: worker %d gave back %d split(s) its earlier process held",
                        self.name, self.worker, back)
        client.keep_alive(self.worker, self.lease_seconds)
        if self._barrier is not None:
            self._barrier.start()

    # ------------------------------------------------------------------ exact saves
    def pause_point(self, flush: Callable[[], None]) -> None:
        """A step boundary (see :meth:`SaveBarrier.pause_point`)."""
        if self._barrier is not None:
            self._barrier.pause_point(flush)

    def waiting_point(self, flush: Callable[[], None]) -> None:
        """Inside a wait for the chief (see :meth:`SaveBarrier.waiting_point`)."""
        if self._barrier is not None:
            self._barrier.waiting_point(flush)

    def begin_exact_save(self, flush: Callable[[], None]) -> bool:
        """The chief, before it saves (see :meth:`SaveBarrier.begin`); False for an input
        without exact saves."""
        return self._barrier is not None and self._barrier.begin(flush)

    def end_exact_save(self) -> None:
        """The chief's save is done: the workers train on."""
        if self._barrier is not None:
            self._barrier.end()

    # ------------------------------------------------------------------ leases
    def leases(self):
        """One epoch's leases for this worker: (key, path, start, resume, end); see
        :meth:`_leases`. An iteration with nothing left to train (a worker started again
        once the others trained the job's last splits) gives, to Keras's look at a batch
        before ``fit``, the first split to look at (key -1: no lease, never trained:
        ``fit``'s own iteration is empty, and ends at once)."""
        taken = 0
        for lease in self._leases():
            taken += 1
            yield lease
        look = self.look_split() if not taken and self._look_pending else None
        if look is not None:
            logger.info("input %s: worker %d has nothing left to train; Keras's look at a "
                        "batch before fit reads split 0 (not trained)", self.name,
                        self.worker)
            path, start, end = look
            yield (-1, path, start, start, end)

    def look_split(self):
        """(path, start, end) of the split Keras's look reads when nothing is left."""
        file, start, end = self.table[0]
        return self.paths[file], start, end

    def _leases(self):
        """One epoch's leases for this worker: (key, path, start, resume, end).

        Each iteration of the dataset is a generation. A new one gives back the splits
        an earlier one leased and stopped taking before its epoch's last (an iterator
        abandoned: a new ``iter()``, a session created again): its steps trained what
        they took of them (committed, or pending until the commit that follows their
        step), and the rest no step of it will train. An earlier iterator takes no split
        once a newer one started. What comes back is read again from its committed
        position, by whoever takes it. The splits of an iterator that took its epoch's
        last stay leased: its pipeline reads them to their end, and their steps commit
        them (graph mode's ``repeat`` starts the next iteration while the last batches
        are still in its buffers; GEO commits a step at the round that pushes it, K
        steps on). Keras's look at a batch before ``fit`` is :meth:`fit_begins`'s."""
        client = self.client()
        self._start()
        with self._lock:
            self._generation += 1
            generation = self._generation
            stale = [] if self._read_all else sorted(self._held)
            self._held, self._read_all = set(), False
            back = client.give_back(self.worker, stale) if self.clustered and stale else 0
            epoch = max(self._next_epoch, client.stats()["first_open"])
            self._start_epochs[generation] = epoch
        if back:
            logger.info("input %s: worker %d gave back %d split(s) an abandoned iterator "
                        "held (read again from their committed positions)", self.name,
                        self.worker, back)
        if self.epochs is not None and epoch >= self.epochs:
            logger.info("input %s: worker %d: the job's %d epoch(s) are read", self.name,
                        self.worker, self.epochs)
            with self._lock:
                if generation == self._generation:
                    self._read_all = True  # (it holds nothing: nothing to give back)
            return
        while True:
            # No split left to take ends this worker's epoch: the splits others hold are
            # theirs to train (a wait for them could wait on this worker's own next
            # steps: GEO commits at its rounds). One that comes back (its worker died) is
            # the next take's, of any worker, before the next epoch's splits; a worker
            # started again in place takes its own back.
            with self._lock:
                if generation != self._generation:  # a newer iterator reads on
                    break
                lease = client.take(self.worker, epoch)
                paused = lease.status == _coordinator.PAUSED
                if (not paused and lease.status != _coordinator.OK and not self._held
                        and (self.epochs is None or epoch + 1 < self.epochs)):
                    # Nothing of this epoch is left for this worker (one that joins while
                    # the others hold its last splits): the iteration reads the next
                    # epoch rather than end empty (Keras fails on an empty epoch).
                    epoch += 1
                    self._start_epochs[generation] = epoch
                    continue
                more = self.follows and lease.status == _coordinator.WAIT
                if not paused and not more and lease.status != _coordinator.OK:
                    self._read_all = True
                    break
                if not paused and not more:
                    self._held.add(lease.key)
            if paused:  # the chief's exact save: no lease until it is done
                time.sleep(_barrier.POLL_SECONDS / 2)
                continue
            if more:  # a stream: the next files have not landed yet
                self.wait_for_more()
                continue
            self.counters["leases"] += 1
            if not self.clustered:  # one process: read is trained (nothing to recover)
                client.commit([lease.key], [lease.end])
            yield (lease.key, self.path_of(lease.file), lease.start, lease.resume, lease.end)
        with self._lock:
            if generation != self._generation:
                return  # (abandoned: the newer iterator counts the epoch)
            self._next_epoch = epoch + 1
            self.counters["epochs"] += 1
            empty = not self._held
        if empty:
            logger.warning("input %s: worker %d found no split left to read in the job's "
                           "epoch %d, its last (the other workers hold or trained them): "
                           "this iteration is empty", self.name, self.worker, epoch)
        stats = client.stats()
        logger.info("input %s: worker %d ended epoch %d (%d leases taken so far; the job's "
                    "epoch %d: %d of %d splits done)", self.name, self.worker, epoch,
                    self.counters["leases"], stats["first_open"], stats["done"],
                    stats["splits"])

    def leases_left(self) -> bool:
        """Whether this worker's iteration may still take a split (it has not found the
        epoch's splits all taken): its last batch is then at least a split away."""
        with self._lock:
            return self.clustered and self._generation > 0 and not self._read_all

    def abandon(self) -> None:
        """The session that reads this input closes (graph mode, tfpsx.training.closing:
        at the end, or after an error, when TF's MonitoredSession creates a new one): its
        iterator takes no more splits, and every split this worker holds goes back, read
        again from its committed position by whoever takes it (what the closed session's
        buffers held is lost with it; an iterator that took its epoch's last split, whose
        splits a new one would not give back, included). Its take in flight ends first
        (it holds the lock; bounded by TFPSX_RPC_TIMEOUT): TF's close destroys the
        iterator, which waits for its generator, and a take then in flight goes through
        this worker's server while it deletes the session (measured: a close held 4
        minutes)."""
        with self._lock:
            self._generation += 1
            self._read_all = False  # (a new iterator gives back what is still held)
            if not (self.clustered and self._started):
                return
            try:
                back = self.client().renew(self.worker, release=True)
            except (errors.ServerUnavailableError, tf.errors.OpError) as e:
                # (the link to PS 0 may be what broke: TF's recovery goes on, and the new
                # iterator gives back what this one held, or their leases expire)
                logger.warning("input %s: worker %d could not give back its splits as its "
                               "session closed (%s); its next iterator gives them back",
                               self.name, self.worker, e)
                return
            self._held = set()
        if back:
            logger.info("input %s: worker %d gave back %d split(s) as its session closed "
                        "(read again from their committed positions)", self.name,
                        self.worker, back)

    # ------------------------------------------------------------------ Keras's fit
    def keras_will_look(self) -> None:
        """Keras's ``fit`` starts (it distributes its dataset): it looks at a batch
        before its steps (see :meth:`leases`)."""
        self._look_pending = True

    def fit_begins(self) -> None:
        """A Keras ``fit``'s steps start: the iterators made since the last ``fit`` ended
        trained nothing (Keras looks at a batch to build the model: it takes splits, and
        may read an epoch to its end in its buffers). Every split this worker holds goes
        back, and its next iterator reads the epoch the first of them did."""
        self._look_pending = False
        with self._lock:
            if self._generation == self._fit_generation:
                return
            self._next_epoch = self._start_epochs.get(self._fit_generation + 1,
                                                      self._next_epoch)
            self._start_epochs.clear()
            if not self.clustered:
                return
            back = self.client().renew(self.worker, release=True)
        if back:
            logger.info("input %s: worker %d gave back %d split(s) read before fit started",
                        self.name, self.worker, back)

    def fit_ends(self) -> None:
        """A Keras ``fit`` ended: its iterators read what they took."""
        with self._lock:
            self._fit_generation = self._generation

    # ------------------------------------------------------------------ checkpoints
    def position_state(self) -> bytes:
        """The coordinator's state (its table and the open epochs' positions)."""
        return self.client().export()

    def restore_position(self, state: bytes) -> int:
        """Restores a saved position (every lease dropped); returns the epoch it is at.

        Raises:
          InvalidArgumentError: the position is of other files or another split size.
        """
        epoch = self.client().restore(state)
        with self._lock:
            self._next_epoch = epoch
        return epoch

    def stats(self) -> dict:
        return self.client().stats()


def splits(files: Union[str, Sequence[str]], parse: Optional[Callable] = None,
           batch_size: Optional[int] = None, *, format: str = "text",
           split_bytes: int = 64 << 20, seed: int = 0, epochs: Optional[int] = 1,
           name: str = "input",
           interleave: int = 2, chunk_bytes: int = 4 << 20, drop_remainder: bool = False,
           parse_batches: bool = True, num_parallel_calls=tf.data.AUTOTUNE,
           service: Optional[str] = None, exact_saves: bool = False):
    """This worker's ``tf.data.Dataset`` of the job's input, read split by split as the
    coordinator on PS 0 leases them (see the module doc).

    Args:
      files: paths or glob patterns (local files every worker reads by the same paths).
      parse: ``parse(records)`` -> ``(features, label)`` (or a single structure): with
        ``batch_size`` and ``parse_batches`` it gets a batch of records (a string vector:
        vectorized parsing), else one record.
      batch_size: records per batch (None: the dataset's elements are single records).
      format: "text" (a record a line) or "tfrecord" (uncompressed; a split a file).
      split_bytes: a text file's split size: many more splits than workers (a slow or
        dead worker holds back a split, no more).
      seed: the job's seed: every epoch's order of the splits (the same on every worker).
      epochs: the job's epochs (give ``fit(epochs=...)`` or ``repeat(...)`` the same):
        every worker's, a joiner's or a restored job's too, whose iterations past the
        last are empty (a job restored in its epoch e reads e .. epochs - 1). None: as
        many as the iterations, each the next epoch (a restored job would read more).
      name: the input's name (several inputs need several names).
      interleave: splits this worker reads at once (their chunks alternate; each
        split's stay in order, as its position needs).
      chunk_bytes: bytes read at a time of a split.
      drop_remainder: as ``batch``'s.
      parse_batches: ``parse`` takes a batch of records (default) or one record.
      num_parallel_calls: of ``parse``'s map.
      service: a tf.data service dispatcher (``"grpc://host:port"``) whose workers read
        and parse each split (:mod:`tfpsx.data.service`); default: the job's
        (``tfpsx-run --data_workers N`` sets ``TFPSX_DATA_SERVICE``), else none. The
        splits are still leased from PS 0 and committed by the steps that train them.
      exact_saves: the chief's checkpoints hold exactly the steps of the saved model (a
        restore repeats none): each save raises a barrier on PS 0, every worker commits
        its steps and pauses at its next step boundary (each polls PS 0 every 50 ms),
        and the save runs while none trains (async, staleness, sync, GEO: a worker
        pushes its unpushed steps at the barrier; refused where workers meet inside a
        step: collective, the hybrid, GEO's deterministic rounds). Default: no pause; a
        restore may repeat the steps trained during the save.

    Returns:
      A dataset whose elements are ``parse``'s, each followed by its position (a dict the
      front-end strips before the model sees the batch): give it to ``fit`` under
      ``tfpsx.keras.ParameterServerStrategy``, or take its batches with
      :func:`next_batch` in graph mode. Without a cluster (an evaluator, a local run) the
      elements have no position and every split is read once per iteration.

    Raises:
      ValueError: no file, a missing or unreadable file, fewer splits than workers, a
        bad argument: named, before anything is read.
    """
    paths, table, digest = file_table(files, format, split_bytes)
    _service.address(service)  # (a bad one named before anything starts)
    for arg, value, low in (("interleave", interleave, 1), ("chunk_bytes", chunk_bytes, 1),
                            ("seed", seed, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"tfpsx.data.splits: {arg} must be an int >= {low}, got {value!r}")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(
            batch_size, int) or batch_size < 1):
        raise ValueError(f"tfpsx.data.splits: batch_size must be an int >= 1 or None, got "
                         f"{batch_size!r}")
    if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, int)
                               or epochs < 1):
        raise ValueError(f"tfpsx.data.splits: epochs must be an int >= 1 or None, got "
                         f"{epochs!r}")
    if not isinstance(exact_saves, bool):
        raise ValueError(f"tfpsx.data.splits: exact_saves must be True or False, got "
                         f"{exact_saves!r}")
    source = SplitInput(name, paths, table, digest, format, seed, chunk_bytes, epochs,
                        exact_saves)
    if source.clustered and batch_size is None:
        raise ValueError("tfpsx.data.splits: give batch_size: on a cluster each batch carries "
                         "its input position to the step that trains it")
    _coordinator.register(name, source)
    return dataset_of(source, parse, batch_size, interleave, drop_remainder, parse_batches,
                      num_parallel_calls, service)


def next_batch(dataset):
    """Graph mode: this step's batch of a :func:`splits` dataset, without its position,
    which the mode commits when the step that trains the batch is in the model. The
    iterator starts (again) with every session (its initializer is a local init op).

    Returns:
      The element as ``parse`` made it (``(features, label)``).
    """
    from tfpsx import graph_state

    iterator = tf.compat.v1.data.make_initializable_iterator(dataset)
    tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.TABLE_INITIALIZERS,
                                   iterator.initializer)
    element = iterator.get_next()
    data, position = _coordinator.split_position(element)
    if position is not None:
        state = graph_state.of()
        state.positions.append(position)
        name = _coordinator.input_name()  # (the step's commit checks the tags)
        config = RUNTIME.config
        # (a collective rank's sessions see only its own task: rank 0 alone, the home,
        # saves the position, and only its graph holds the export)
        saves = config.server_num or config.index == 0
        if saves and name not in state.input_positions:
            # The chief's checkpoints hold the input's position: a string variable on PS 0
            # that a save first fills with the coordinator's state (before the model), and
            # the chief's session restores into the coordinator before TF restores the
            # model (tfpsx.training.session).
            source = _coordinator.registered()[name]
            client = source.client_for_graph()
            with tf.compat.v1.device(source.home), tf.control_dependencies(None):
                var = tf.compat.v1.get_variable(_coordinator.STATE_VARIABLE + name, [],
                                                tf.string, initializer=tf.constant_initializer(""),
                                                trainable=False, use_resource=True)
                state.input_positions[name] = (var, var.assign(client.export_op()))
    return data


def input_stats(name: str = "input") -> dict:
    """The job's input ``name``: its first open epoch and that epoch's splits done,
    leased and left (``TfpsxSplitStats``), with this worker's leases and epochs."""
    source = _coordinator.registered().get(name)
    if source is None:
        raise ValueError(f"tfpsx.data: no input named {name!r} in this process; expected one "
                         f"of {sorted(_coordinator.registered())}")
    return dict(source.stats(), **source.counters)

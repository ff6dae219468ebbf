"""A stream input: a job that trains on files as they land, until told to stop.

``tfpsx.data.stream(pattern, ...)`` follows a glob pattern (e.g. hourly folders,
``/logs/*/part-*``): the chief (or a process without a cluster) scans it every
``poll_seconds``, and the files of each folder that holds its done-marker (``_SUCCESS``
by default, as Paddle's and DeepRec's jobs write it) become splits of the job's input,
appended to the coordinator on PS 0 in the order of their paths. Workers lease them
as they do a file input's (:mod:`tfpsx.data.splits`: every example trained once, the
position committed where each mode puts a step into the model and saved in the model's
checkpoint), in landing order, as one epoch that never ends: a worker that finds
nothing to lease waits for the next files. The coordinator keeps the files' names, so a
restored job reads on from its checkpoint's position, and appends what landed since.

The job runs until it is told to stop: :func:`stop` (or SIGTERM to a worker, which
``tfpsx-run`` forwards on its own SIGTERM) makes every take end, each worker's dataset
ends after the splits it holds, ``fit`` returns, and the chief's last checkpoint (and
its last serving delta, ``IncrementalCheckpoint(publisher=...)``) keeps what is left
for the next run.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import signal
import threading
import time
from typing import Callable, List, Optional, Sequence, Union

import tensorflow as tf

from tfpsx.control import splits as _coordinator
from tfpsx.data import service as _service
from tfpsx.data.pipeline import dataset_of
from tfpsx.data.splits import FORMATS, SplitInput
from tfpsx.runtime import RUNTIME

logger = logging.getLogger("tfpsx")

DONE_MARKER = "_SUCCESS"
WAIT_SECONDS = 0.5  # a worker's pause between takes while nothing has landed
LOG_EVERY = 60.0    # ... and how often it says so


def _patterns(files: Union[str, Sequence[str]]) -> List[str]:
    patterns = [files] if isinstance(files, str) else list(files)
    if not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise ValueError(f"tfpsx.data.stream: expected a glob pattern or a list of them, got "
                         f"{files!r}")
    return [os.path.abspath(p) for p in patterns]


def _checked_int(what: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"tfpsx.data.stream: {what} must be an int >= {low}, got {value!r}")
    return value


class StreamInput(SplitInput):
    """A stream's :class:`~tfpsx.data.splits.SplitInput`: no table of its own (the
    coordinator's grows), the files' names read from the coordinator, and on the chief
    a watcher that appends what lands."""

    follows = True

    def __init__(self, name: str, patterns: List[str], fmt: str, split_bytes: int, seed: int,
                 chunk_bytes: int, done_marker: Optional[str], poll_seconds: float,
                 exact_saves: bool, data_time: Optional[Callable[[str], float]] = None):
        listing = "\n".join(patterns)
        digest = hashlib.sha256(f"stream\n{fmt}\n{split_bytes}\n{done_marker}\n"
                                f"{listing}".encode()).hexdigest()[:16]
        described = (f"a stream of {fmt} files matching {patterns} in splits of at most "
                     f"{split_bytes:,} bytes, sha256 {digest}")
        super().__init__(name, [], [], described, fmt, seed, chunk_bytes, 1, exact_saves)
        self.patterns, self.split_bytes = patterns, split_bytes
        self.done_marker, self.poll_seconds = done_marker, poll_seconds
        self._paths_lock = threading.Lock()
        self._appended = set()  # this process's watcher: what it appended
        self._watcher = None
        self._waited_since: Optional[float] = None
        self._logged_at = 0.0
        self._data_time_of = data_time
        # The newest data time this worker took a lease of (None: no data_time, or no
        # lease yet): where its training stands in the stream's time, a lease ahead.
        self.data_time: Optional[float] = None
        config = RUNTIME.config
        self.watches = not self.clustered or config.is_chief

    # ------------------------------------------------------------------ the coordinator
    def _configure(self, client) -> None:
        client.configure_stream(self.digest, self.seed, self.lease_seconds)

    def path_of(self, file: int) -> str:
        with self._paths_lock:
            if file >= len(self.paths):
                self.paths += self.client().files(len(self.paths))
            if file >= len(self.paths):
                raise RuntimeError(f"input {self.name}: the coordinator leased file {file} of "
                                   f"a stream that names {len(self.paths)} files")
            return self.paths[file]

    def look_split(self):
        """The stream's first file's first split, when one landed (a worker whose fit
        starts after the stream stopped: Keras looks at a batch before fit); else None."""
        try:
            path = self.path_of(0)
        except RuntimeError:  # nothing landed
            return None
        return path, 0, min(self.split_bytes, os.path.getsize(path))

    # ------------------------------------------------------------------ landing files
    def ready_files(self) -> List[str]:
        """The files matching the patterns whose folder holds the done-marker (every
        matching file without one), sorted by path; the markers themselves left out."""
        found = set()
        for pattern in self.patterns:
            for path in glob.glob(pattern):
                if not os.path.isfile(path) or os.path.basename(path) == self.done_marker:
                    continue
                if self.done_marker and not os.path.exists(
                        os.path.join(os.path.dirname(path), self.done_marker)):
                    continue
                found.add(path)
        return sorted(found)

    def scan(self) -> int:
        """Appends the files that landed since the last scan; returns the splits added.
        An unreadable file is skipped with a warning (tried again next scan)."""
        names, table = [], []
        for path in self.ready_files():
            if path in self._appended:
                continue
            try:
                size = os.path.getsize(path)
                if not os.access(path, os.R_OK):
                    raise PermissionError(f"{path} cannot be read by this user")
            except OSError as e:
                logger.warning("input %s: skipping %s for now: %s", self.name, path, e)
                continue
            index = len(names)
            names.append(path)
            step = self.split_bytes if self.format == "text" else max(size, 1)
            table += [(index, start, min(start + step, size)) for start in range(0, size, step)]
        if not names:
            return 0
        added = self.client().append(names, table)
        self._appended.update(names)
        logger.info("input %s: %d file(s) landed (%d split(s) added to the stream): %s%s",
                    self.name, len(names), added, names[:3], " ..." if len(names) > 3 else "")
        return added

    def start_watching(self) -> None:
        """On the chief (or without a cluster): scans now, then every ``poll_seconds``
        from a background thread while the process lives."""
        if not self.watches or self._watcher is not None:
            return
        from tfpsx.background import BackgroundLoop

        self.scan()
        self._watcher = BackgroundLoop(f"stream {self.name}", self._scan_logged,
                                       interval=self.poll_seconds).start()

    def _scan_logged(self) -> None:
        try:
            self.scan()
        except Exception as e:  # noqa: BLE001 — logged; the next scan tries again
            logger.warning("input %s: scanning %s failed (tried again in %g s): %s",
                           self.name, self.patterns, self.poll_seconds, e)

    def wait_for_more(self) -> None:
        now = time.monotonic()
        if self._waited_since is None:  # a wait begins: said at once, then every minute
            self._waited_since, self._logged_at = now, 0.0
        if now - self._logged_at >= LOG_EVERY:
            self._logged_at = now
            logger.info("input %s: worker %d waits for files matching %s to land (a folder "
                        "is ready with its %s; %.0f s so far; stop the job with SIGTERM or "
                        "tfpsx.data.stream_stop)", self.name, self.worker, self.patterns,
                        self.done_marker or "files, no marker", now - self._waited_since)
        time.sleep(WAIT_SECONDS)

    def _leases(self):
        self.start_watching()
        for lease in super()._leases():
            self._waited_since = None
            if self._data_time_of is not None:
                self._note_data_time(lease[1])
            yield lease

    def _note_data_time(self, path: str) -> None:
        try:
            value = float(self._data_time_of(path))
        except Exception as e:
            raise ValueError(f"input {self.name}: data_time({path!r}) failed: {e}; expected "
                             "the data time of the file (seconds) from its path") from e
        if self.data_time is None or value > self.data_time:
            self.data_time = value

    def stop(self) -> None:
        """Every take of every worker ends from now on (see :func:`stop`)."""
        self.client().stop()
        logger.info("input %s: the stream stops: each worker ends after the splits it "
                    "holds; the checkpoint keeps the rest", self.name)


def stream(files: Union[str, Sequence[str]], parse: Optional[Callable] = None,
           batch_size: Optional[int] = None, *, format: str = "text",
           split_bytes: int = 64 << 20, done_marker: Optional[str] = DONE_MARKER,
           poll_seconds: float = 5.0, seed: int = 0, name: str = "input",
           interleave: int = 2, chunk_bytes: int = 4 << 20, drop_remainder: bool = False,
           parse_batches: bool = True, num_parallel_calls=tf.data.AUTOTUNE,
           service: Optional[str] = None, exact_saves: bool = False,
           stop_on_sigterm: bool = True, data_time: Optional[Callable[[str], float]] = None):
    """This worker's ``tf.data.Dataset`` of a stream: the files matching ``files`` as they
    land (see the module doc), read as :func:`tfpsx.data.splits` reads a job's files.

    Args:
      files: a glob pattern, or several (local files every worker reads by the same
        paths); files are taken in the order of their paths.
      done_marker: the file that makes a folder's files ready (the writer puts it last);
        None: every matching file as soon as it is seen (the writer must then move each
        file into place whole, e.g. by a rename).
      poll_seconds: how often the chief scans for files that landed.
      data_time: ``data_time(path)`` -> the data time of a file, in seconds (e.g. from its
        hourly folder's name): what ``tfpsx.keras.ExpireByDataTime`` expires rows by;
        None: the stream has no data time.
      stop_on_sigterm: SIGTERM stops the stream (:func:`stop`) rather than kill the
        process: its dataset ends, ``fit`` returns and the callbacks save (called from
        the main thread; ``tfpsx-run`` forwards its SIGTERM to the workers).
      The rest: as :func:`tfpsx.data.splits`'s (a stream is one endless epoch).

    Returns:
      The dataset (elements as :func:`tfpsx.data.splits`'s: ``fit`` it once, or take its
      batches with :func:`tfpsx.data.next_batch` in graph mode).

    Raises:
      ValueError: a bad argument, named, before anything is read.
    """
    patterns = _patterns(files)
    if format not in FORMATS:
        raise ValueError(f"tfpsx.data.stream: format must be one of {FORMATS}, got {format!r}")
    _checked_int("split_bytes", split_bytes, 1)
    for arg, value, low in (("interleave", interleave, 1), ("chunk_bytes", chunk_bytes, 1),
                            ("seed", seed, 0)):
        _checked_int(arg, value, low)
    if batch_size is not None:
        _checked_int("batch_size", batch_size, 1)
    if isinstance(poll_seconds, bool) or not isinstance(poll_seconds, (int, float)) or \
            poll_seconds <= 0:
        raise ValueError(f"tfpsx.data.stream: poll_seconds must be a number > 0, got "
                         f"{poll_seconds!r}")
    if done_marker is not None and (not isinstance(done_marker, str) or not done_marker or
                                    os.sep in done_marker):
        raise ValueError(f"tfpsx.data.stream: done_marker must be a file name (or None), got "
                         f"{done_marker!r}")
    if not isinstance(exact_saves, bool):
        raise ValueError(f"tfpsx.data.stream: exact_saves must be True or False, got "
                         f"{exact_saves!r}")
    if data_time is not None and not callable(data_time):
        raise ValueError(f"tfpsx.data.stream: data_time must be a function of a file's path "
                         f"(or None), got {data_time!r}")
    _service.address(service)  # (a bad one named before anything starts)
    source = StreamInput(name, patterns, format, split_bytes, seed, chunk_bytes, done_marker,
                         float(poll_seconds), exact_saves, data_time)
    if source.clustered and batch_size is None:
        raise ValueError("tfpsx.data.stream: give batch_size: on a cluster each batch carries "
                         "its input position to the step that trains it")
    _coordinator.register(name, source)
    if stop_on_sigterm:
        _stop_on_sigterm()
    return dataset_of(source, parse, batch_size, interleave, drop_remainder, parse_batches,
                      num_parallel_calls, service)


def stop(name: Optional[str] = None) -> List[str]:
    """Stops the stream ``name`` (None: every stream of this process): every worker's
    take ends from now on, so each worker's dataset ends once it trained the splits it
    holds, and the job's ``fit`` returns; the checkpoint's position keeps the rest for the
    next run. Returns the streams stopped."""
    streams = {n: s for n, s in _coordinator.registered().items()
               if isinstance(s, StreamInput) and (name is None or n == name)}
    if name is not None and not streams:
        known = sorted(n for n, s in _coordinator.registered().items()
                       if isinstance(s, StreamInput))
        raise ValueError(f"tfpsx.data.stream_stop: no stream named {name!r} in this process; "
                         f"expected one of {known}")
    for source in streams.values():
        source.stop()
    return sorted(streams)


_SIGTERM_SET = False


def _stop_on_sigterm() -> None:
    """SIGTERM stops this process's streams instead of killing it; a second one exits.

    A Python signal handler runs in the main thread between bytecodes, and a worker's
    main thread waits inside TensorFlow (fit's step waits for the next batch, which
    waits for files to land): it would run only when the step returns. So the handler
    does nothing, and the signal's wakeup fd (written by the C-level handler, from any
    thread, at once) wakes a thread of our own that stops the streams."""
    global _SIGTERM_SET
    if _SIGTERM_SET or threading.current_thread() is not threading.main_thread():
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    try:
        previous_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    except ValueError:  # (not the main thread of the main interpreter)
        os.close(read)
        os.close(write)
        return
    if previous_fd != -1:  # someone else's wakeup fd (an event loop): leave it theirs
        signal.set_wakeup_fd(previous_fd)
        os.close(read)
        os.close(write)
        logger.warning("tfpsx.data.stream: this process already has a signal wakeup fd "
                       "(an event loop?); SIGTERM will not stop the stream: call "
                       "tfpsx.data.stream_stop() yourself")
        return
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    threading.Thread(target=_on_sigterm, args=(read,), name="tfpsx-sigterm",
                     daemon=True).start()
    _SIGTERM_SET = True


def _on_sigterm(read: int) -> None:
    terms = 0
    while True:
        try:
            got = os.read(read, 64)
        except OSError:
            return
        if not got:
            return
        for signum in got:
            if signum != signal.SIGTERM:
                continue
            terms += 1
            if terms > 1:
                logger.warning("a second SIGTERM: exiting now")
                os._exit(128 + signal.SIGTERM)
            logger.warning("SIGTERM: stopping this job's stream input(s); a second SIGTERM "
                           "exits the process")
            _stop_logged()


def _stop_logged() -> None:
    try:
        stop()
    except Exception as e:  # noqa: BLE001 — the process goes on; a second SIGTERM kills
        logger.error("SIGTERM: stopping the stream failed: %s", e)

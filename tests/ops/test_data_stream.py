"""tfpsx.data.stream in one process (no cluster): files that land in folders with a
done-marker are read as they come, each record once, in the order of their paths,
until the stream stops; bad arguments are refused before anything is read.
(On a cluster, with a checkpoint and SIGTERM: tests/cluster/test_data_plane.py.)"""

import os
import threading
import time

import pytest
import tensorflow as tf

import tfpsx
from tfpsx.control import splits as coordinator
from tfpsx.data.stream import StreamInput

_names = iter(range(10 ** 6))


def land(folder, hour, lines, marker=True):
    """Writes hour ``hour``'s folder: two files of ``lines`` lines, then its marker."""
    path = os.path.join(folder, f"h{hour:02d}")
    os.makedirs(path, exist_ok=True)
    for part in range(2):
        with open(os.path.join(path, f"part-{part}"), "w") as f:
            f.writelines(f"{hour}-{part}-{i}\n" for i in range(lines))
    if marker:
        open(os.path.join(path, "_SUCCESS"), "w").close()
    return path


def read_until_stopped(dataset, got, done):
    try:
        for batch in dataset:
            got.extend(v.decode() for v in batch.numpy())
    finally:
        done.set()


def wait_for(what, predicate, timeout=30):
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, f"waited {timeout} s for {what}"
        time.sleep(0.05)


def test_files_are_read_as_they_land_each_record_once_until_the_stream_stops(tmp_path):
    name = f"stream{next(_names)}"
    land(tmp_path, 0, 30)
    land(tmp_path, 1, 30, marker=False)  # not ready: its marker has not landed
    data = tfpsx.data.stream(str(tmp_path / "*" / "part-*"), batch_size=4, split_bytes=64,
                             poll_seconds=0.1, name=name, stop_on_sigterm=False)
    got, done = [], threading.Event()
    reader = threading.Thread(target=read_until_stopped, args=(data, got, done), daemon=True)
    reader.start()
    # (a batch is cut when full: 60 and 100 records are whole batches of 4)
    wait_for("hour 0's records", lambda: len(got) == 60)
    time.sleep(0.5)
    assert len(got) == 60 and not done.is_set()  # hour 1 waits for its marker
    open(tmp_path / "h01" / "_SUCCESS", "w").close()
    land(tmp_path, 2, 20)
    wait_for("hours 1 and 2", lambda: len(got) == 60 + 60 + 40)
    assert tfpsx.data.stream_stop(name) == [name]
    wait_for("the stream's end", done.is_set)
    reader.join(10)
    assert sorted(got) == sorted(f"{h}-{p}-{i}" for h, n in ((0, 30), (1, 30), (2, 20))
                                 for p in range(2) for i in range(n))
    hours = [int(r.split("-")[0]) for r in got]
    assert hours == sorted(hours)  # in landing order
    stats = tfpsx.data.input_stats(name)
    assert stats["first_open"] == 0 and stats["done"] == stats["splits"] > 6, stats


@pytest.mark.parametrize("kwargs,match", [
    (dict(files=[]), "glob pattern"),
    (dict(format="csv"), "format"),
    (dict(split_bytes=0), "split_bytes"),
    (dict(poll_seconds=0), "poll_seconds"),
    (dict(done_marker="a/b"), "done_marker"),
    (dict(exact_saves="yes"), "exact_saves"),
])
def test_a_bad_argument_is_refused_by_name(tmp_path, kwargs, match):
    args = dict(files=str(tmp_path / "*"), name=f"bad{next(_names)}", stop_on_sigterm=False)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        tfpsx.data.stream(**args)


def test_stopping_a_stream_that_does_not_exist_names_the_ones_that_do():
    with pytest.raises(ValueError, match="no stream named 'nope'"):
        tfpsx.data.stream_stop("nope")


def test_a_streams_position_is_refused_by_an_input_of_files(tmp_path):
    land(tmp_path, 0, 5)
    name = f"kind{next(_names)}"
    tfpsx.data.stream(str(tmp_path / "*" / "part-*"), batch_size=4, name=name,
                      stop_on_sigterm=False)
    source = coordinator.registered()[name]
    assert isinstance(source, StreamInput)
    files = coordinator.SplitCoordinator(f"files{next(_names)}", device=None)
    files.configure("d-files", 0, [0], [0], [10], 1.0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="stream"):
        files.restore(source.position_state())

"""tfpsx.data.stream in one process (no cluster): files that land in folders with a
done-marker are read as they come, each record once, in the order of their paths,
until the stream stops; bad arguments are refused before anything is read.
(On a cluster, with a checkpoint and SIGTERM: tests/cluster/test_data_plane.py.)"""

import json
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
    (dict(data_time="hour"), "data_time"),
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


def test_rows_unseen_for_a_span_of_data_time_are_evicted_and_leave_serving(tmp_path):
    """Four hours land, ids [100 h, 100 h + 100) in hour h; ExpireByDataTime(1.5 h) on
    the stream's data time (each folder's hour): by the end, hour 0's rows are gone (unseen
    since data time 0 h, 3 h before), hours 2 and 3 are there; the published deltas
    remove exactly the rows evicted."""
    import keras
    import numpy as np

    from tfpsx.keras.checkpoint import IncrementalCheckpoint
    from tfpsx.serving import Publisher, publish

    name = f"expiry{next(_names)}"
    folder = tmp_path / "data"
    for hour in range(4):
        path = folder / f"h{hour:02d}"
        path.mkdir(parents=True)
        (path / "part-0").write_text("".join(f"{100 * hour + i}\n" for i in range(100)))
        (path / "_SUCCESS").write_text("")
    data = tfpsx.data.stream(str(folder / "*" / "part-*"), batch_size=10, split_bytes=100,
                             name=name, poll_seconds=0.1, stop_on_sigterm=False,
                             data_time=lambda p: 3600.0 * int(os.path.basename(
                                 os.path.dirname(p))[1:]))
    data = data.map(lambda r: (tf.strings.to_number(r, tf.int64)[:, None],
                               tf.zeros([tf.shape(r)[0], 1])))
    ids = keras.Input((1,), dtype="int64")
    layer = tfpsx.keras.DynamicEmbedding(2, table_name=f"t{name}",
                                         optimizer=tfpsx.embedding.SGD(0.1))
    model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(layer(ids))))
    model.compile("sgd", "mse")
    expire = tfpsx.keras.ExpireByDataTime(1.5 * 3600, input=name, every_steps=1)
    served = tmp_path / "served"
    ckpt = IncrementalCheckpoint(str(tmp_path / "ckpt"), full_every=1000, save_freq=5,
                                 publisher=Publisher(str(served)))

    class StopWhenRead(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            stats = tfpsx.data.input_stats(name)
            if stats["splits"] >= 4 * 3 and stats["done"] == stats["splits"]:
                tfpsx.data.stream_stop(name)

    model.fit(data, epochs=1, verbose=0, callbacks=[expire, ckpt, StopWhenRead()])
    keys = set(layer.table.export()["keys"].numpy().tolist())
    assert not keys & set(range(100)), sorted(keys & set(range(100)))[:5]  # hour 0: gone
    assert set(range(200, 400)) <= keys  # hours 2 and 3: seen within the span
    evicted = expire.evicted[layer.table.name]
    assert evicted >= 100 and 400 - len(keys) == evicted, (evicted, len(keys))
    removed = sum(json.loads((served / publish.DELTAS / str(s) / publish.MANIFEST)
                             .read_text())["removed"]
                  for s in publish.published(str(served))["deltas"])
    assert removed == evicted
    other = tfpsx.keras.ExpireByDataTime(60, input="nope")
    other.set_model(model)
    with pytest.raises(ValueError, match="input 'nope' is not a stream with a data time"):
        other.check()
    for bad, match in (((0,), "seconds"), ((60, "input", 0), "every_steps")):
        with pytest.raises(ValueError, match=match):
            tfpsx.keras.ExpireByDataTime(*bad)

"""tfpsx.data.splits in one process (no cluster: the coordinator in this process): the
file table and its refusals, every record of every split read once an iteration in the
job's order, TFRecords, the position a batch carries, and the coordinator's state
restored into a job of other files refused naming both."""

import os
import re

import numpy as np
import pytest
import tensorflow as tf

import tfpsx
from tfpsx.control import splits as coordinator
from tfpsx.data.splits import file_table


def write_lines(folder, files=3, lines=500):
    folder.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        with open(folder / f"part-{f}.txt", "w") as out:
            for i in range(lines):
                out.write(f"{f * lines + i}\t{i % 2}\n")
    return str(folder / "part-*.txt")


def parse(lines):
    cols = tf.strings.split(lines, "\t").to_tensor()
    return tf.strings.to_number(cols[:, 0], tf.int64), tf.strings.to_number(cols[:, 1])


def test_every_record_is_read_once_an_iteration_in_the_jobs_order(tmp_path):
    pattern = write_lines(tmp_path / "in")
    data = tfpsx.data.splits(pattern, parse, 64, split_bytes=1000, seed=3, epochs=None,
                             name="once")
    assert int(data.cardinality()) == 0  # (Keras never learns an epoch's length)
    epochs = [np.concatenate([x.numpy() for x, _ in data]) for _ in range(2)]
    for ids in epochs:
        assert sorted(ids.tolist()) == list(range(1500))
    assert epochs[0].tolist() != epochs[1].tolist()  # each epoch its own order
    stats = tfpsx.data.input_stats("once")
    assert stats["epochs"] == 2 and stats["splits"] == len(file_table(pattern, "text",
                                                                       1000)[1])
    bounded = tfpsx.data.splits(pattern, parse, 64, split_bytes=1000, epochs=1,
                                name="bounded")
    assert sum(int(tf.size(x)) for x, _ in bounded) == 1500
    assert sum(int(tf.size(x)) for x, _ in bounded) == 0  # past the job's epochs


def test_nothing_left_to_train_gives_keras_a_batch_to_look_at_and_fit_none(tmp_path):
    """A worker started again once the job's splits are all trained: Keras's fit looks
    at a batch before its steps (it fails on an input with none), so that look gets the
    first split (no lease, never trained), and fit's own iteration is empty."""
    pattern = write_lines(tmp_path / "in", files=1, lines=200)
    data = tfpsx.data.splits(pattern, parse, 64, split_bytes=1000, epochs=1, name="done")
    assert sum(int(tf.size(x)) for x, _ in data) == 200
    source = coordinator.registered()["done"]
    assert sum(int(tf.size(x)) for x, _ in data) == 0  # no look pending: nothing
    source.keras_will_look()  # (the Keras strategy, as fit distributes its dataset)
    looked = next(iter(data))[0].numpy()
    assert looked.tolist() == list(range(64))  # split 0's first batch, to look at
    source.fit_begins()
    assert sum(int(tf.size(x)) for x, _ in data) == 0  # fit trains nothing


def test_an_abandoned_iteration_takes_no_more_splits(tmp_path):
    """Graph mode's session closes (an error: TF's MonitoredSession then creates a new
    one): its iterator takes no split after ``abandon`` (a take in flight while TF's close
    deleted the iterator held the close, once 4 minutes), and the next iteration reads
    on."""
    pattern = write_lines(tmp_path / "in")
    tfpsx.data.splits(pattern, parse, 64, split_bytes=1000, epochs=1, name="abandoned")
    source = coordinator.registered()["abandoned"]
    splits = len(file_table(pattern, "text", 1000)[1])
    leases = source.leases()
    next(leases)
    source.abandon()
    assert list(leases) == []
    # (one process: a lease is committed as it is taken) the next iteration, the rest
    assert len(list(source.leases())) == splits - 1


def test_tfrecords_a_split_a_file(tmp_path):
    paths = []
    for f in range(2):
        path = str(tmp_path / f"r{f}.tfrecord")
        with tf.io.TFRecordWriter(path) as w:
            for i in range(100):
                w.write(f"{f}:{i}".encode())
        paths.append(path)
    _, table, _ = file_table(paths, "tfrecord", 1 << 20)
    assert [(f, start) for f, start, _ in table] == [(0, 0), (1, 0)]
    got = [r.decode() for b in tfpsx.data.splits(paths, batch_size=32, format="tfrecord",
                                                 name="records")
           for r in b.numpy()]
    assert sorted(got) == sorted(f"{f}:{i}" for f in range(2) for i in range(100))


def test_a_position_round_trips_and_the_strategy_strips_it(tmp_path):
    keys = tf.constant([5, (3 << 32) | 7], tf.int64)
    ends = tf.constant([100, (1 << 40) + 3], tf.int64)
    position = coordinator.make_position("pos", keys, ends)
    assert position.shape == (5, 2) and coordinator.looks_like_position(position)
    tags, got_keys, got_ends = coordinator.decode(position)
    assert got_keys.numpy().tolist() == keys.numpy().tolist()
    assert got_ends.numpy().tolist() == ends.numpy().tolist()
    assert set(tags.numpy().tolist()) == {coordinator.input_tag("pos")}
    unique, furthest = coordinator.latest(coordinator.make_position(
        "pos", tf.constant([9, 9, 4], tf.int64), tf.constant([10, 30, 7], tf.int64)))
    assert dict(zip(unique.numpy().tolist(), furthest.numpy().tolist())) == {9: 30, 4: 7}
    write_lines(tmp_path / "in", files=1, lines=10)
    tfpsx.data.splits(str(tmp_path / "in" / "part-*.txt"), parse, 4, name="pos")
    x, y = tf.ones([2, 3]), tf.ones([2, 1])
    assert coordinator.split_position((x, y, position))[1] is position
    assert coordinator.split_position((x, y, tf.ones([2])))[1] is None  # a sample weight


@pytest.mark.parametrize("files,kwargs,words", [
    (["/nonexistent/tfpsx-a.txt"], {}, ["'/nonexistent/tfpsx-a.txt'", "does not exist"]),
    ("/nonexistent/tfpsx-*.txt", {}, ["matches no file"]),
    ([], {}, ["files is empty"]),
    ("IN", {"format": "csv"}, ["format", "'csv'", "'text'"]),
    ("IN", {"split_bytes": 0}, ["split_bytes", ">= 1", "0"]),
    ("IN", {"epochs": 0}, ["epochs", "0"]),
    ("IN", {"interleave": 0}, ["interleave", "0"]),
    ("EMPTY", {}, ["every input file is empty"]),
    ("IN", {"service": "127.0.0.1:5000"}, ["service", "'127.0.0.1:5000'", "grpc://"]),
])
def test_bad_input_is_refused_before_anything_is_read(tmp_path, files, kwargs, words):
    pattern = write_lines(tmp_path / "in", files=1, lines=5)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "e.txt").write_text("")
    files = {"IN": pattern, "EMPTY": str(tmp_path / "empty" / "e.txt")}.get(
        files, files) if isinstance(files, str) else files
    with pytest.raises(ValueError) as e:
        tfpsx.data.splits(files, parse, 4, **kwargs)
    assert all(w in str(e.value) for w in words), e.value


def test_a_folder_named_as_a_file_is_refused(tmp_path):
    (tmp_path / "folder.txt").mkdir()
    with pytest.raises(ValueError, match=r"folder\.txt' does not exist \(or is not a file\)"):
        tfpsx.data.splits(str(tmp_path / "folder.txt"), parse, 4)


def test_a_position_of_other_files_is_refused_naming_both_inputs(tmp_path):
    """A checkpoint's position restored into a job whose files (or split size) changed:
    refused before anything changes, naming both inputs; the job's position stays."""
    first = write_lines(tmp_path / "a", files=2)
    job = coordinator.SplitCoordinator("restore-a", device=None)
    paths, table, digest = file_table(first, "text", 1000)
    files, starts, ends = zip(*table)
    job.configure(digest, 1, files, starts, ends, 60)
    lease = job.take(0, 0)
    job.commit([lease.key], [lease.resume + 10])
    saved = job.export()
    other = coordinator.SplitCoordinator("restore-b", device=None)
    _, table_b, digest_b = file_table(write_lines(tmp_path / "b", files=3), "text", 1000)
    f, s, e = zip(*table_b)
    other.configure(digest_b, 1, f, s, e, 60)
    before = other.export()
    with pytest.raises(tf.errors.InvalidArgumentError) as err:
        other.restore(saved)
    assert digest in str(err.value) and digest_b in str(err.value)
    assert "the files or the split size changed" in str(err.value)
    assert other.export() == before
    fresh = coordinator.SplitCoordinator("restore-c", device=None)
    assert fresh.restore(saved) == 0
    back = fresh.take(0, 0)
    assert (back.key, back.resume) == (lease.key, lease.resume + 10)  # from its position


def test_a_failed_lease_renewal_is_logged_and_the_renewals_go_on(caplog):
    """PS 0 silent for a moment: the keep-alive logs the failed renewal and renews again
    at its next tick (a renewal loop that stopped at the first failure would let this
    worker's leases expire while it reads them, and others read the same splits)."""
    import threading

    client = coordinator.SplitCoordinator("renewals", device=None)
    calls, renewed = [], threading.Event()

    def renew(worker, release=False):
        calls.append(worker)
        if len(calls) == 1:
            raise tfpsx.errors.ServerUnavailableError("parameter server ps:0 did not answer")
        renewed.set()
        return 0

    client.renew = renew
    with caplog.at_level("WARNING", logger="tfpsx"):
        client.keep_alive(3, lease_seconds=0.15)
        assert renewed.wait(10), calls
    client._renewal.stop(timeout=5)
    assert calls[:2] == [3, 3], calls
    assert "renewing worker 3's leases failed (1 in a row)" in caplog.text, caplog.text


def test_a_coordinator_call_to_a_server_that_is_gone_is_a_named_error(monkeypatch):
    """Graph mode's client runs in a session of its own: PS 0 gone (nothing listens at
    its address) is a ServerUnavailableError naming the input and the call, within
    TFPSX_RPC_TIMEOUT (the watchdog's retryable exit), not TF's raw error."""
    import portpicker

    monkeypatch.setenv("TFPSX_RPC_TIMEOUT", "3")
    client = coordinator.SplitCoordinator(
        "gone", session_target=f"grpc://127.0.0.1:{portpicker.pick_unused_port()}")
    with pytest.raises(tfpsx.errors.ServerUnavailableError,
                       match=r"parameter server ps:0 through grpc://127\.0\.0\.1:\d+ did not "
                             r"answer the input 'gone''s take within 3 s"):
        client.take(0, 0)


def _service_refused(tmp_path) -> bool:
    """On a TensorFlow older than tfpsx.data.service.MIN_TF (2.16 in `make test TF=2.16`),
    reading through a tf.data service is refused before anything starts, naming why
    (its reader waited forever for a data worker that died): True, having checked it."""
    from tfpsx.data import service

    service.check_tf_version("2.21.0")
    service.check_tf_version("3.0")
    with pytest.raises(RuntimeError, match=r"needs TensorFlow 2\.21 or newer, this is "
                                           r"2\.16\.2: on TF 2\.16 a reader"):
        service.check_tf_version("2.16.2")
    if tuple(int(p) for p in tf.__version__.split(".")[:2]) >= service.MIN_TF:
        return False
    pattern = write_lines(tmp_path / "old_tf", files=1, lines=10)
    with pytest.raises(RuntimeError, match=f"this is {re.escape(tf.__version__)}"):
        tfpsx.data.splits(pattern, parse, 4, name="refused", service="grpc://127.0.0.1:1")
    return True


def test_splits_read_and_parsed_by_a_tfdata_service_in_eager_and_graph_mode(tmp_path):
    """service=: each lease is read and parsed on a tf.data worker (here one of this
    process) and comes back whole, in batches of batch_size, every record once."""
    if _service_refused(tmp_path):
        return
    pattern = write_lines(tmp_path / "in")
    svc = tf.data.experimental.service
    dispatcher = svc.DispatchServer(svc.DispatcherConfig(port=0))
    worker = svc.WorkerServer(svc.WorkerConfig(
        dispatcher_address=dispatcher.target.split("://")[1], heartbeat_interval_ms=200))
    try:
        data = tfpsx.data.splits(pattern, parse, 64, split_bytes=1000, seed=3, epochs=None,
                                 name="through_service", service=dispatcher.target)
        for _ in range(2):
            batches = [x.numpy() for x, _ in data]
            assert sorted(np.concatenate(batches).tolist()) == list(range(1500))
            assert [len(b) for b in batches[:-1]] == [64] * (len(batches) - 1)
        with tf.Graph().as_default():
            graph_data = tfpsx.data.splits(pattern, parse, 64, split_bytes=1000, epochs=1,
                                           name="through_service_graph",
                                           service=dispatcher.target)
            iterator = tf.compat.v1.data.make_initializable_iterator(graph_data)
            ids = iterator.get_next()[0]
            got = []
            with tf.compat.v1.Session() as session:
                session.run(iterator.initializer)
                with pytest.raises(tf.errors.OutOfRangeError):
                    while True:
                        got += session.run(ids).tolist()
            assert sorted(got) == list(range(1500))
    finally:
        worker.stop()
        dispatcher.stop()


def test_a_data_worker_lost_mid_split_is_read_again_from_what_was_delivered(tmp_path, capfd):
    """The tf.data service delivers at most once: a data worker stopped in the middle of
    a split takes the rest of it along. The reader reads the rest again from the end of
    the last record it received (through the data worker started on the same address),
    and every record comes once."""
    if _service_refused(tmp_path):
        return
    from tfpsx.launcher.local import pick_ports

    pattern = write_lines(tmp_path / "in", files=1, lines=3000)
    svc = tf.data.experimental.service
    dispatcher = svc.DispatchServer(svc.DispatcherConfig(port=0, worker_timeout_ms=1000))
    (port,) = pick_ports(1)
    config = svc.WorkerConfig(dispatcher_address=dispatcher.target.split("://")[1],
                              worker_address=f"127.0.0.1:{port}", port=port,
                              heartbeat_interval_ms=100)
    worker = svc.WorkerServer(config)
    try:
        data = tfpsx.data.splits(pattern, parse, 32, split_bytes=1 << 20, epochs=1,
                                 name="service_lost", service=dispatcher.target)
        iterator = iter(data)
        got = [next(iterator)[0].numpy() for _ in range(3)]  # 96 of 3,000 in one split
        worker.stop()  # the rest of the split goes with it
        worker = svc.WorkerServer(config)  # started again on its address
        got += [x.numpy() for x, _ in iterator]
        assert sorted(np.concatenate(got).tolist()) == list(range(3000))
        assert "reading the rest again" in capfd.readouterr().err
    finally:
        worker.stop()
        dispatcher.stop()

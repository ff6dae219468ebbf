"""A server process with a tiered table (rows on its disk) killed with SIGKILL at random
moments while it trains and saves incremental checkpoints, three times: each restarted
process discards the files the killed one left and restores exactly the rows the table
held when the last checkpoint was saved (the digest the server printed before that save),
which are also the rows of that checkpoint restored into a table in RAM. A second process
opening the same tier folder while one runs is refused, naming the owner's pid, and the
owner's rows stay intact."""

import hashlib
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import tensorflow as tf

from tfpsx import embedding as E
from tfpsx.checkpoint import IncrementalSaver

RAM = 1_600_000
SERVER = textwrap.dedent('''
    import hashlib, os, sys
    import numpy as np
    import tensorflow as tf
    from tfpsx import embedding as E
    from tfpsx.checkpoint import IncrementalSaver

    tier_dir, ckpt, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    tf.compat.v1.disable_eager_execution()
    step = tf.compat.v1.train.get_or_create_global_step()
    table = E.DynamicTable("crash", 8, optimizer=E.Adagrad(0.1),
                           initializer=E.normal(stddev=0.1), devices=[None],
                           backend=E.TieredBackend(tier_dir, ram_bytes=%d))
    ids = tf.compat.v1.placeholder(tf.int64, [None])
    looked = table.lookup_unique(ids, step=step)
    grads = 0.01 * tf.sin(looked.unique_rows * 7.0)
    with tf.control_dependencies([table.apply_gradients(looked, grads, step=step)]):
        train = step.assign_add(1)
    rows, disk = table.export(), table.tier_stats()["disk_rows"]
    saver = IncrementalSaver(full_every=3, max_to_keep=20)
    rng = np.random.default_rng(seed)

    def digest(sess):
        got = sess.run(rows)
        order = np.argsort(got["keys"], kind="stable")
        return hashlib.sha256(b"".join(got[f][order].tobytes() for f in sorted(got))).hexdigest()

    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        latest = tf.train.latest_checkpoint(ckpt)
        if latest:
            saver.restore(sess, latest)
            print("restored", latest, digest(sess), flush=True)
        while True:
            for _ in range(3):
                head = np.exp(rng.random(1500) * np.log(2e6)).astype(np.int64)
                sess.run(train, {ids: np.concatenate([head, rng.integers(0, 2**40, 1500)])})
            # The state the save must hold, printed before the save begins: a checkpoint
            # on disk always has its line.
            print("saving", int(sess.run(step)), digest(sess), flush=True)
            path = saver.save(sess, os.path.join(ckpt, "model"), global_step=step)
            print("saved", path, int(sess.run(disk)), flush=True)
''' % RAM)


def digest_in_ram(path):
    """The rows of checkpoint ``path`` restored into a table in RAM (a second reference)."""
    with tf.Graph().as_default():
        tf.compat.v1.train.get_or_create_global_step()
        table = E.DynamicTable("crash", 8, optimizer=E.Adagrad(0.1),
                               initializer=E.normal(stddev=0.1), devices=[None])
        rows = table.export()
        saver = IncrementalSaver(full_every=3, max_to_keep=20)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            saver.restore(sess, path)
            got = sess.run(rows)
    order = np.argsort(got["keys"], kind="stable")
    return hashlib.sha256(b"".join(got[f][order].tobytes() for f in sorted(got))).hexdigest()


def files_of(tier_dir):
    """The segment files of the shard: (name, inode, mtime in ns) each."""
    folder = tier_dir / "crash" / "part_0"
    return {(e.name, e.inode(), e.stat().st_mtime_ns) for e in os.scandir(folder)
            if e.name.startswith("seg_")}


def read_save(proc, at_save):
    """The server's next 'saved' line as [saved, path, disk rows] ([] at its end); the
    digest of each 'saving' line before it goes into at_save[step]."""
    while True:
        line = proc.stdout.readline().split()
        if not line or line[0] != "saving":
            return line
        at_save[int(line[1])] = line[2]


@pytest.mark.heavy
@pytest.mark.budget(100, why="five server processes (TensorFlow imports), each trained until "
                             "rows are on its disk, three of them killed, one refused")
@pytest.mark.timeout(300)
def test_a_killed_tiered_server_restarts_with_exactly_its_checkpoints_rows(tmp_path):
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    tier_dir, ckpt = tmp_path / "tables", tmp_path / "ckpt"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    chance = random.Random(os.environ.get("TFPSX_TEST_SEED", "7"))
    expected, stale, at_save = None, set(), {}
    for round_ in range(4):
        proc = subprocess.Popen([sys.executable, str(script), str(tier_dir), str(ckpt),
                                 str(round_)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)
        try:
            if expected is not None:
                # The restart restored the last checkpoint: exactly the rows the table
                # held at its save, and none of the killed process's files is left.
                first = proc.stdout.readline().split()
                assert first[:2] == ["restored", expected[0]], (first, expected)
                assert first[2] == expected[1], "the restored rows differ from the saved state"
                assert not stale & files_of(tier_dir), stale & files_of(tier_dir)
            saves = [read_save(proc, at_save)]
            # Killed after 1-3 more saves, at a random moment of training or saving, with
            # rows on disk.
            for _ in range(chance.randint(1, 3) - 1):
                saves.append(read_save(proc, at_save))
            assert all(s and s[0] == "saved" for s in saves), (
                saves, proc.stderr.read() if proc.poll() is not None else "")
            assert int(saves[-1][2]) > 0, saves  # rows live on disk
            if round_ == 1:
                # A second process on the same tier folder (another job given the same
                # --table_dir) is refused at start, naming the owner's pid; the owner
                # trains and saves on, its rows intact (the next round restores them).
                intruder = subprocess.run(
                    [sys.executable, str(script), str(tier_dir), str(tmp_path / "other"), "9"],
                    capture_output=True, text=True, env=env, timeout=120)
                assert intruder.returncode != 0 and not intruder.stdout, intruder.stdout[-2000:]
                assert ("is in use" in intruder.stderr and
                        f"pid {proc.pid} " in intruder.stderr), intruder.stderr[-3000:]
                saves.append(read_save(proc, at_save))
                assert saves[-1] and saves[-1][0] == "saved", saves
            if round_ == 3:
                break
            time.sleep(chance.uniform(0.0, 0.6))
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            # A save that began before the kill: its 'saving' line is still unread.
            for line in proc.stdout.read().splitlines():
                if line.startswith("saving "):
                    at_save[int(line.split()[1])] = line.split()[2]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        latest = tf.train.latest_checkpoint(str(ckpt))
        digest = at_save[int(latest.rsplit("-", 1)[1])]
        assert digest_in_ram(latest) == digest, "the checkpoint does not hold the saved state"
        expected = (latest, digest)
        stale = files_of(tier_dir)
        assert stale, "the killed server left no files: its rows were not on disk"
    files = sorted(os.listdir(tier_dir / "crash" / "part_0"))
    assert "LOCK" in files and all(f.startswith("seg_") for f in files if f != "LOCK"), files

"""A server process with a tiered table (rows on its disk) killed with SIGKILL at random
moments while it trains and saves incremental checkpoints, three times: each restarted
process discards the files the killed one left and restores exactly the rows of the last
checkpoint (the same rows as a restore of that checkpoint into a table in RAM)."""

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
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        latest = tf.train.latest_checkpoint(ckpt)
        if latest:
            saver.restore(sess, latest)
            got = sess.run(rows)
            order = np.argsort(got["keys"], kind="stable")
            digest = hashlib.sha256(b"".join(
                got[f][order].tobytes() for f in sorted(got))).hexdigest()
            print("restored", latest, digest, flush=True)
        while True:
            for _ in range(3):
                head = np.exp(rng.random(1500) * np.log(2e6)).astype(np.int64)
                sess.run(train, {ids: np.concatenate([head, rng.integers(0, 2**40, 1500)])})
            path = saver.save(sess, os.path.join(ckpt, "model"), global_step=step)
            print("saved", path, int(sess.run(disk)), flush=True)
''' % RAM)


def digest_in_ram(path):
    """The rows of checkpoint ``path`` restored into a table in RAM (the reference)."""
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
    return {(e.name, e.inode(), e.stat().st_mtime_ns) for e in os.scandir(folder)}


@pytest.mark.heavy
@pytest.mark.budget(90, why="four server processes (TensorFlow imports), each trained until "
                            "rows are on its disk, three of them killed")
@pytest.mark.timeout(300)
def test_a_killed_tiered_server_restarts_with_exactly_its_checkpoints_rows(tmp_path):
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    tier_dir, ckpt = tmp_path / "tables", tmp_path / "ckpt"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    chance = random.Random(os.environ.get("TFPSX_TEST_SEED", "7"))
    expected, stale = None, set()
    for round_ in range(4):
        proc = subprocess.Popen([sys.executable, str(script), str(tier_dir), str(ckpt),
                                 str(round_)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)
        try:
            first = proc.stdout.readline().split()
            if expected is not None:
                # The restart restored the last checkpoint, exactly, and none of the
                # killed process's files is left.
                assert first[:2] == ["restored", expected[0]], (first, expected)
                assert first[2] == expected[1], "the restored rows differ from the checkpoint's"
                assert not stale & files_of(tier_dir), stale & files_of(tier_dir)
                first = proc.stdout.readline().split()
            saves = [first]
            # Killed after 1-3 more saves, at a random moment of training or saving, with
            # rows on disk.
            for _ in range(chance.randint(1, 3) - 1):
                saves.append(proc.stdout.readline().split())
            assert all(s[0] == "saved" for s in saves), (saves, proc.stderr.read()
                                                         if proc.poll() is not None else "")
            assert int(saves[-1][2]) > 0, saves  # rows live on disk
            if round_ == 3:
                break
            time.sleep(chance.uniform(0.0, 0.6))
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        latest = tf.train.latest_checkpoint(str(ckpt))
        expected = (latest, digest_in_ram(latest))
        stale = files_of(tier_dir)
        assert stale, "the killed server left no files: its rows were not on disk"
    files = sorted(os.listdir(tier_dir / "crash" / "part_0"))
    assert files and all(f.startswith("seg_") for f in files), files

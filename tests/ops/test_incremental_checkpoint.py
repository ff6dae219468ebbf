"""Incremental checkpoints (tfpsx.checkpoint.IncrementalSaver) in one process, graph mode:
full table exports every M saves and deltas between, restored bit-exactly; atomic saves."""

import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

from tfpsx import embedding as E
from tfpsx import errors
from tfpsx.checkpoint import IncrementalSaver, parts

_names = iter(range(10 ** 6))


class Model:
    """Two tables (Adagrad on 2 shards; SGD with admission), a dense variable, and ops
    that train random ids, evict and remove, as a training job's tables change."""

    def __init__(self, prefix, shards=2, full_every=3, **saver_kw):
        self.step = tf.compat.v1.train.get_or_create_global_step()
        self.a = E.DynamicTable(f"{prefix}a", 4, optimizer=E.Adagrad(0.1),
                                    initializer=E.normal(stddev=0.1), devices=[None] * shards)
        self.b = E.DynamicTable(f"{prefix}b", 3, optimizer=E.SGD(0.5), min_frequency=2,
                                    devices=[None])
        self.w = tf.compat.v1.get_variable("w", [3], initializer=tf.zeros_initializer())
        self.ids = tf.compat.v1.placeholder(tf.int64, [None])
        train = []
        for t in (self.a, self.b):
            looked = t.lookup_unique(self.ids, step=self.step)
            train.append(t.apply_gradients(looked, tf.ones_like(looked.unique_rows),
                                           step=self.step))
        with tf.control_dependencies(train):
            self.train = tf.group(self.w.assign_add([1.0, 2.0, 3.0]),
                                  self.step.assign_add(1))
        self.evict = self.a.evict(keep_top_n=40)
        self.remove = self.b.remove(self.ids)
        self.exports = {t.name: t.export() for t in (self.a, self.b)}
        self.saver = IncrementalSaver(full_every=full_every, max_to_keep=20, **saver_kw)

    def rows(self, sess):
        """Every table's rows (bytes, by key)."""
        got = sess.run(self.exports)
        by_key = {name: np.argsort(rows["keys"], kind="stable") for name, rows in got.items()}
        return {name: {f: v[by_key[name]].tobytes() for f, v in rows.items()}
                for name, rows in got.items()}

    def state(self, sess):
        """Every table's rows and the dense values: what a restore must give."""
        return (self.rows(sess),
                tuple(np.asarray(v).tobytes() for v in sess.run([self.w, self.step])))


def train_between_saves(model, sess, rng, round_):
    span = 60 + 40 * round_  # the tables grow
    for _ in range(5):
        sess.run(model.train, {model.ids: rng.integers(0, span, 12)})
    if round_ % 3 == 1:
        sess.run(model.evict)
    if round_ % 2 == 1:
        sess.run(model.remove, {model.ids: rng.integers(0, span, 6)})


def restored_state(prefix, path, shards=3):
    """The state a fresh graph (another shard count) restores from checkpoint ``path``."""
    with tf.Graph().as_default():
        model = Model(prefix, shards=shards)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            # Rows that are not in the checkpoint: a restore replaces, it does not merge.
            sess.run(model.train, {model.ids: [10 ** 9, 10 ** 9 + 1]})
            model.saver.restore(sess, path)
            return model.state(sess)


def saved_rounds(model, sess, rng, rounds, directory):
    """Trains and saves ``rounds`` times; [(path, what the save wrote, state)] per save."""
    saved = []
    for round_ in range(rounds):
        train_between_saves(model, sess, rng, round_)
        path = model.saver.save(sess, os.path.join(directory, "model"), global_step=model.step)
        saved.append((path, dict(model.saver.last_save), model.state(sess)))
    return saved


@pytest.mark.heavy
def test_full_and_delta_chain_restores_bit_exact(tmp_path):
    prefix = f"inc{next(_names)}"
    rng = np.random.default_rng(3)
    with tf.Graph().as_default():
        model = Model(prefix, full_every=4)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            saved = saved_rounds(model, sess, rng, 9, str(tmp_path))
    kinds = [s[1]["kind"] for s in saved]
    assert kinds == ["full", "delta", "delta", "delta"] * 2 + ["full"], kinds
    assert [len(s[1]["chain"]) for s in saved] == [1, 2, 3, 4, 1, 2, 3, 4, 1]
    # A delta holds what changed since the previous save, not the table.
    for (_, full_info, (rows, _)), (_, delta_info, _) in zip(saved[:1], saved[1:2]):
        assert 0 < delta_info["rows"] < full_info["rows"] + 60
    assert any(s[1]["removed"] > 0 for s in saved if s[1]["kind"] == "delta"), \
        [s[1] for s in saved]
    for path, info, want in saved[2:4] + saved[7:]:  # full + 3 deltas among them
        assert restored_state(prefix, path) == want, (path, info)


def test_the_tables_are_restored_before_the_variables_that_free_the_other_workers(
        tmp_path, monkeypatch):
    """The other workers of a MonitoredTrainingSession start once the chief's variables
    are initialized: by then every table must hold the checkpoint's rows (before, a
    worker of a resumed GEO job trained on tables still being imported, and two jobs
    resumed from one checkpoint ended apart: tests/cluster/test_launcher.py's
    max_restarts test)."""
    prefix = f"inc{next(_names)}"
    with tf.Graph().as_default():
        model = Model(prefix)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            saved = saved_rounds(model, sess, np.random.default_rng(5), 2, str(tmp_path))
    path, _, (want_rows, _) = saved[-1]
    seen = []
    plain_restore = tf.compat.v1.train.Saver.restore

    def restore_variables(saver, sess, save_path):
        if isinstance(saver, IncrementalSaver):  # what the tables hold at that moment
            seen.append(model.rows(sess))
        return plain_restore(saver, sess, save_path)

    monkeypatch.setattr(tf.compat.v1.train.Saver, "restore", restore_variables)
    with tf.Graph().as_default():
        model = Model(prefix)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.variables_initializer([model.step]))  # not w yet
            model.saver.restore(sess, path)
    assert seen == [want_rows]


def test_a_crash_during_a_save_leaves_the_previous_checkpoint_valid(tmp_path, monkeypatch):
    prefix = f"inc{next(_names)}"
    rng = np.random.default_rng(5)
    directory = str(tmp_path)
    with tf.Graph().as_default():
        model = Model(prefix, full_every=4)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            good, _, want = saved_rounds(model, sess, rng, 2, directory)[-1]
            assert model.saver.last_save["kind"] == "delta"
            # 1) the process dies while writing a table part: a temporary is left.
            train_between_saves(model, sess, rng, 2)
            real_save = np.save
            calls = []

            def dies_on_third(*args, **kwargs):
                calls.append(1)
                if len(calls) == 3:
                    raise OSError("disk gone")
                return real_save(*args, **kwargs)

            monkeypatch.setattr(np, "save", dies_on_third)
            with pytest.raises(OSError, match="disk gone"):
                model.saver.save(sess, os.path.join(directory, "model"), global_step=model.step)
            monkeypatch.setattr(np, "save", real_save)
            assert any(".tmp-" in e for e in os.listdir(directory))
            assert tf.train.latest_checkpoint(directory) == good
            # 2) the part is written, then TF's own save dies: the state file still names
            # the previous checkpoint.
            monkeypatch.setattr(tf.compat.v1.train.Saver, "save",
                                lambda *a, **k: (_ for _ in ()).throw(OSError("killed")))
            with pytest.raises(OSError, match="killed"):
                model.saver.save(sess, os.path.join(directory, "model"), global_step=model.step)
            monkeypatch.undo()
            assert tf.train.latest_checkpoint(directory) == good
            # The marks of the failed saves were taken: the next save is a full one, and
            # it cleans up the leftovers.
            model.saver.save(sess, os.path.join(directory, "model"), global_step=model.step)
            assert model.saver.last_save["kind"] == "full"
            assert not any(".tmp-" in e for e in os.listdir(directory))
    assert restored_state(prefix, good) == want


def test_a_missing_part_is_a_clear_error_before_any_change(tmp_path):
    prefix = f"inc{next(_names)}"
    rng = np.random.default_rng(7)
    with tf.Graph().as_default():
        model = Model(prefix, full_every=5)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            paths = [path for path, _, _ in saved_rounds(model, sess, rng, 3, str(tmp_path))]
    shutil.rmtree(parts.part_path(paths[1]))
    with tf.Graph().as_default():
        model = Model(prefix, shards=1)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(model.train, {model.ids: [1, 2, 3]})
            before = model.state(sess)
            with pytest.raises(errors.CheckpointError,
                               match=rf"needs part .*{os.path.basename(paths[1])}.tables, which "
                                     "is missing"):
                model.saver.restore(sess, paths[2])
            assert model.state(sess) == before


@pytest.mark.heavy
def test_a_table_that_lost_its_base_gets_a_full_save(tmp_path):
    """A restarted server's tables (restored by import) have no base for a delta."""
    prefix = f"inc{next(_names)}"
    with tf.Graph().as_default():
        model = Model(prefix, full_every=10)
        reload = model.a.import_rows(model.a.export(), clear=True)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(model.train, {model.ids: [1, 2, 3]})
            model.saver.save(sess, str(tmp_path / "model"), global_step=model.step)
            sess.run(model.train, {model.ids: [4]})
            model.saver.save(sess, str(tmp_path / "model"), global_step=model.step)
            assert model.saver.last_save["kind"] == "delta"
            sess.run(reload)
            sess.run(model.train, {model.ids: [5]})
            path = model.saver.save(sess, str(tmp_path / "model"), global_step=model.step)
            assert model.saver.last_save["kind"] == "full"
            want = model.state(sess)
    assert restored_state(prefix, path) == want


@pytest.mark.heavy
def test_checkpoints_of_a_plain_saver_still_restore(tmp_path):
    prefix = f"inc{next(_names)}"
    with tf.Graph().as_default():
        model = Model(prefix)
        plain = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(model.train, {model.ids: [1, 2, 3, 3]})
            path = plain.save(sess, str(tmp_path / "plain"), global_step=model.step)
            want = model.state(sess)
    assert not os.path.exists(parts.part_path(path))
    assert restored_state(prefix, path) == want


def test_bad_arguments_are_named():
    with tf.Graph().as_default():
        with pytest.raises(ValueError, match=r"full_every=...\): expected an integer >= 1, got 0"):
            Model(f"inc{next(_names)}", full_every=0)


_KILLED_SAVE = textwrap.dedent("""
    import os, pickle, signal, sys
    import numpy as np
    import tensorflow as tf
    sys.path.insert(0, {here!r})
    from test_incremental_checkpoint import Model, train_between_saves
    directory, prefix = sys.argv[1], sys.argv[2]
    rng = np.random.default_rng(9)
    with tf.Graph().as_default():
        model = Model(prefix, full_every=5)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for round_ in range(2):
                train_between_saves(model, sess, rng, round_)
                path = model.saver.save(sess, os.path.join(directory, "model"),
                                        global_step=model.step)
            with open(os.path.join(directory, "state.pkl"), "wb") as f:
                pickle.dump((path, model.state(sess)), f)
            train_between_saves(model, sess, rng, 2)
            real, calls = np.save, []
            def save_then_die(*args, **kwargs):
                calls.append(1)
                if len(calls) == 4:  # the third save's fourth file: halfway
                    os.kill(os.getpid(), signal.SIGKILL)
                return real(*args, **kwargs)
            np.save = save_then_die
            model.saver.save(sess, os.path.join(directory, "model"), global_step=model.step)
    print("NOT KILLED")
""")


@pytest.mark.heavy
@pytest.mark.timeout(240)
def test_a_process_killed_halfway_through_a_save_leaves_the_previous_checkpoint(tmp_path):
    """SIGKILL in the middle of writing a delta's part: the checkpoint state still names
    the previous save, which restores bit-exact, and its chain is intact."""
    import pickle

    prefix = f"inc{next(_names)}"
    script = tmp_path / "save_and_die.py"
    script.write_text(_KILLED_SAVE.format(here=os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), prefix],
                          capture_output=True, text=True, timeout=200)
    assert proc.returncode == -9, proc.stdout + proc.stderr[-3000:]
    with open(tmp_path / "state.pkl", "rb") as f:
        good, want = pickle.load(f)
    assert tf.train.latest_checkpoint(str(tmp_path)) == good
    assert any(".tmp-" in e for e in os.listdir(tmp_path))  # the unfinished part
    assert restored_state(prefix, good) == want

"""The stager's protocol (tfpsx.embedding.cache.staging.Stager) without TF: syncs due
every flush_steps batches, run by its flusher thread; a failed sync's error reaches the
next staging and the end; a finished stager starts no flusher; a new session starts
clean."""

import threading
import types

import pytest

from tfpsx.embedding.cache.staging import Stager
from tfpsx.testing import wait_until


def _cache(flush_steps=2):
    return types.SimpleNamespace(options=types.SimpleNamespace(size=100, flush_steps=flush_steps),
                                 flush_in_step=True, sync_lock=threading.RLock())


class _Recording(Stager):
    def __init__(self, fail=False):
        super().__init__()
        self.fail, self.flushes = fail, 0

    def _evict(self, cache, keep):
        raise AssertionError("nothing is over its size here")

    def _flush(self, cache):
        if self.fail:
            raise RuntimeError("parameter server /job:ps/task:0 lost")
        self.flushes += 1


def test_syncs_count_batches_and_run_in_the_flusher():
    s, cache = _Recording(), _cache(flush_steps=2)
    s._start([cache], depth=3)
    s.open_flushes()
    s.staged([[1, 2]], [2], batches=3)   # batches 1-3: the sync due at 2
    wait_until(lambda: s.flushes == 1)
    s.staged([[3]], [3], batches=1)      # batch 4: due again
    wait_until(lambda: s.flushes == 2)
    s.staged([[4]], [4], batches=1)      # batch 5: not due
    assert s.finish_flushes(10)
    assert s.flushes == 2
    # Finished: a staging that ends late (after its fit) starts no flusher.
    s.staged([[5]], [5], batches=1)
    assert s._flusher is None and s.flushes == 2


def test_a_failed_sync_fails_the_next_staging_and_the_end_then_a_new_session_is_clean():
    s, cache = _Recording(fail=True), _cache(flush_steps=1)
    s._start([cache], depth=3)
    s.open_flushes()
    s.staged([[1]], [1])
    wait_until(lambda: s._flush_error is not None)
    with pytest.raises(RuntimeError, match="/job:ps/task:0 lost"):
        s.staged([[2]], [2])
    with pytest.raises(RuntimeError, match="/job:ps/task:0 lost"):
        s.finish_flushes(10)
    s.fail = False
    s.open_flushes()  # a recreated session: the old error is not its own
    s.staged([[3]], [3])
    wait_until(lambda: s.flushes == 1)
    assert s.finish_flushes(10)

"""A collective worker's start: TF configures collectives once, at program start, so
init_worker() after TF ops names the fix."""

import subprocess
import sys
import textwrap

import pytest


_LATE = textwrap.dedent("""
    import portpicker, tensorflow as tf, tfpsx
    tf.constant(1.0) + 1  # a TF op first: the eager context exists
    address = f"127.0.0.1:{portpicker.pick_unused_port()}"
    tfpsx.init(tfpsx.UserDefinedRoleMaker("worker", 0, [], [address]), is_collective=True)
    tfpsx.init_worker()
""")


@pytest.mark.heavy
@pytest.mark.timeout(120)
def test_a_collective_init_worker_after_tf_ops_names_the_fix():
    done = subprocess.run([sys.executable, "-c", _LATE], capture_output=True, text=True,
                          timeout=100)
    assert done.returncode == 1, done.stderr[-2000:]
    assert ("tfpsx.init_worker() could not start worker 0's collectives (Collective ops must "
            "be configured at program startup)") in done.stderr, done.stderr[-2000:]
    assert "call it right after tfpsx.init(), before any TensorFlow op" in done.stderr

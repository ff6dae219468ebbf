"""A CUDA build of the op library, made the way a user with nvcc makes one
(``TFPSX_WITH_CUDA=1``): it links (static, private cudart), loads into the installed TF,
registers the GPU table's ops with GPU kernels only, and its CPU ops still work. No GPU is
needed; where there is no nvcc the test is skipped and says so, as ``make cuda-check`` does.
"""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Runs in a process of its own: one process cannot load two builds of the same ops.
CHECK = textwrap.dedent("""
    import sys
    import numpy as np
    import tensorflow as tf
    from tfpsx.ops import loader

    lib_dir = sys.argv[1]
    info = loader.build_info(loader.find_library(lib_dir))
    assert info == {"tf_version": tf.__version__, "cuda": True}, info
    ops = loader.load_ops(lib_dir)
    for op in ("handle_op", "find", "find_or_insert", "accumulate", "evict", "size"):
        assert hasattr(ops, "tfpsx_gpu_table_" + op), op
    if not tf.config.list_physical_devices("GPU"):
        try:
            ops.tfpsx_gpu_table_handle_op(shared_name="gpu", dim=4, capacity=16)
        except tf.errors.NotFoundError as e:
            assert "device='GPU'" in str(e), str(e)
        else:
            raise AssertionError("a GPU table op ran without a GPU")
    table = ops.tfpsx_hash_table_handle_op(shared_name="cpu", dim=3)
    keys = tf.constant([5, 9], tf.int64)
    ops.tfpsx_hash_table_accumulate(table, keys, tf.ones([2, 3]), tf.constant(0, tf.int64))
    rows, found = ops.tfpsx_hash_table_find(table, keys)
    np.testing.assert_array_equal(rows.numpy(), np.ones([2, 3]))
    assert found.numpy().all()
    print("CUDA BUILD OK")
""")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_cuda_build_links_loads_and_keeps_its_cpu_ops(tmp_path):
    env = {**os.environ, "TFPSX_WITH_CUDA": "1"}
    build = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=840)
    # setup.py looks for nvcc where a user's build does; its message says where it looked.
    no_nvcc = [line for line in build.stderr.splitlines() if "need nvcc, but none" in line]
    if build.returncode != 0 and no_nvcc:
        pytest.skip(f"the CUDA build cannot be checked on this machine: {no_nvcc[0]}")
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    assert "(with CUDA)" in build.stdout, build.stdout[-2000:]
    check = subprocess.run([sys.executable, "-c", CHECK, str(tmp_path / "tfpsx")], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0 and "CUDA BUILD OK" in check.stdout, \
        check.stdout[-2000:] + check.stderr[-3000:]

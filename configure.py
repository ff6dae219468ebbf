"""Points the Bazel build at the installed TensorFlow (the tensorflow/custom-op shape).

Writes third_party/tf/paths.bzl (where the wheel's headers and libtensorflow_framework
are) and .bazelrc (the compile flags tf.sysconfig reports, the C++ ABI flag among them,
and the TF version marker the loader checks; with nvcc found, a `cuda` config that builds
the *.cu.cc sources in). Run it with the Python whose TF you build for:
python configure.py && bazel build //:_tfpsx_ops.so
"""

import os
import re
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def find_nvcc():
    """(nvcc, CUDA root), searched in setup.py's order ($NVCC, PATH, $CUDA_HOME/bin,
    $CUDA_PATH/bin, /usr/local/cuda/bin), or None."""
    candidates = [os.environ.get("NVCC"), shutil.which("nvcc")]
    candidates += [os.path.join(os.environ[v], "bin", "nvcc")
                   for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    candidates.append("/usr/local/cuda/bin/nvcc")
    nvcc = next((c for c in candidates if c and os.access(c, os.X_OK)), None)
    if nvcc is None:
        return None
    proc = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                          capture_output=True, text=True)
    top = re.search(r"^#\$ TOP=(.+)$", proc.stderr + proc.stdout, re.MULTILINE)
    return (nvcc, os.path.realpath(top.group(1).strip())) if top else None


def main() -> int:
    try:
        import tensorflow as tf
    except ImportError as e:
        print(f"configure.py: cannot import tensorflow with {sys.executable}: {e}; install "
              "TensorFlow first (e.g. pip install tensorflow-cpu==2.21.0)", file=sys.stderr)
        return 1
    include, lib = tf.sysconfig.get_include(), tf.sysconfig.get_lib()
    if not os.path.exists(os.path.join(lib, "libtensorflow_framework.so.2")):
        print(f"configure.py: {lib} has no libtensorflow_framework.so.2", file=sys.stderr)
        return 1
    with open(os.path.join(HERE, "third_party", "tf", "paths.bzl"), "w") as f:
        f.write("# Written by configure.py for TensorFlow %s; do not edit.\n" % tf.__version__)
        f.write(f'TF_INCLUDE_DIR = "{include}"\nTF_LIB_DIR = "{lib}"\n')
    lines = [f"# Written by configure.py for TensorFlow {tf.__version__}; do not edit."]
    for flag in tf.sysconfig.get_compile_flags():
        if flag.startswith("-I"):
            continue  # the headers come through @tf_headers
        lines.append(f"build --cxxopt={flag}" if flag.startswith("--std") or flag.startswith("-std")
                     else f"build --copt={flag}")
    lines.append(f'build --copt=-DTFPSX_TF_VERSION=\\"{tf.__version__}\\"')
    cuda = find_nvcc()
    if cuda is None:
        lines.append("# No nvcc found: no cuda config (bazel build --config=cuda fails).")
    else:
        abi = [f for f in tf.sysconfig.get_compile_flags()
               if f.startswith("-D_GLIBCXX_USE_CXX11_ABI")]
        lines += ["build:cuda --define=tfpsx_cuda=1", f"build:cuda --define=NVCC={cuda[0]}",
                  f"build:cuda --define=CUDA_HOME={cuda[1]}",
                  f"build:cuda --define=NVCC_ABI={abi[0] if abi else ''}"]
    with open(os.path.join(HERE, ".bazelrc"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"configured Bazel for TensorFlow {tf.__version__} ({include})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Builds tfpsx and compiles its op library against the TensorFlow that is installed.

The op library is compiled with g++ and only the flags ``tf.sysconfig`` reports for the
installed TF (never a hard-coded C++ ABI flag), and the TF version it was built for is
compiled into it (``custom_ops/cc/build_info.cc``); the loader refuses a library built for
another TF, naming both versions.

TF is asked through a subprocess of the target interpreter with pip's build-isolation
path removed, so ``pip install .`` builds against the TF of the environment being
installed into, not a TF pip might put in an isolated build environment.
"""

import glob
import hashlib
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))

_TF_QUERY = r"""
import json, tensorflow as tf
print(json.dumps({"tf_version": tf.__version__,
                  "compile_flags": tf.sysconfig.get_compile_flags(),
                  "link_flags": tf.sysconfig.get_link_flags()}))
"""


def query_tensorflow():
    """Returns the installed TF's version and build flags, or exits with a clear message."""
    env = dict(os.environ)
    for var in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME"):
        env.pop(var, None)
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    python = os.environ.get("TFPSX_TF_PYTHON", sys.executable)
    proc = subprocess.run([python, "-c", _TF_QUERY], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(
            "tfpsx compiles its ops against the installed TensorFlow, but "
            f"`{python} -c 'import tensorflow'` failed:\n{proc.stderr[-2000:]}\n"
            "Install TensorFlow first (e.g. pip install tensorflow-cpu==2.21.0), then "
            "pip install --no-build-isolation -e .")
    return json.loads(proc.stdout.strip().splitlines()[-1])


class TfOpBuildExt(build_ext):
    """Compiles each op source to an object in parallel, links them into one library."""

    def build_extension(self, ext):
        tf = query_tensorflow()
        out_path = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(out_path), exist_ok=True)
        obj_dir = os.path.join(self.build_temp, "tfpsx_ops")
        os.makedirs(obj_dir, exist_ok=True)
        cxx = os.environ.get("CXX", "g++")
        cflags = ["-fPIC", "-O3", "-Wno-deprecated-declarations", f"-I{HERE}",
                  f'-DTFPSX_TF_VERSION="{tf["tf_version"]}"', *tf["compile_flags"]]
        # Objects are cached per flag set, so a different TF never reuses a stale object.
        flag_key = hashlib.sha1(" ".join([cxx, *cflags]).encode()).hexdigest()[:10]

        def compile_one(src):
            obj = os.path.join(obj_dir, os.path.relpath(src, HERE).replace(os.sep, "_")
                               + f".{flag_key}.o")
            if (os.path.exists(obj) and os.path.getmtime(obj) >= os.path.getmtime(src)
                    and not self.force and not _headers_newer(obj)):
                return obj
            cmd = [cxx, "-c", src, "-o", obj, *cflags]
            print(" ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
            return obj

        start = time.time()
        jobs = int(os.environ.get("TFPSX_BUILD_JOBS", os.cpu_count() or 1))
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            objs = list(pool.map(compile_one, ext.sources))
        link = [cxx, "-shared", "-o", out_path, *objs, *tf["link_flags"]]
        print(" ".join(link), flush=True)
        subprocess.run(link, check=True)
        print(f"tfpsx: built {out_path} for TensorFlow {tf['tf_version']} "
              f"in {time.time() - start:.1f} s", flush=True)


def _headers_newer(obj):
    mtime = os.path.getmtime(obj)
    return any(os.path.getmtime(h) > mtime
               for h in glob.glob(os.path.join(HERE, "custom_ops", "**", "*.h"), recursive=True))


OP_SOURCES = sorted(
    os.path.relpath(p, HERE)
    for p in glob.glob(os.path.join(HERE, "custom_ops", "cc", "**", "*.cc"), recursive=True))

setup(
    name="tfpsx",
    version="0.1.0",
    description="TensorFlow-native parameter-server extension: Fleet-style API, "
                "GEO training, dynamic embedding tables",
    long_description=open(os.path.join(HERE, "README.md"), encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["tfpsx", "tfpsx.*"]),
    ext_modules=[Extension("tfpsx._tfpsx_ops", sources=OP_SOURCES)],
    cmdclass={"build_ext": TfOpBuildExt},
    # TensorFlow itself is not a dependency on purpose: tfpsx builds against whichever TF
    # (2.16 .. 2.21, CPU or GPU package) the user already has, and must never pull the
    # CUDA `tensorflow` wheel over a `tensorflow-cpu` install.
    # protobuf >= 4.21: the committed scheduler_pb2 is protobuf 4.25 gencode (see the .proto).
    install_requires=["numpy", "grpcio", "protobuf>=4.21", "portpicker"],
    extras_require={
        "test": ["pytest", "pytest-timeout", "import-linter"],
        "cpu": ["tensorflow-cpu"],
    },
    entry_points={"console_scripts": ["tfpsx-run=tfpsx.launcher.run:main",
                                      "tfpsx-scheduler=tfpsx.control.scheduler:main"]},
    zip_safe=False,
)

"""Builds tfpsx and compiles its op library against the TensorFlow that is installed.

The op library is compiled with g++ and only the flags ``tf.sysconfig`` reports for the
installed TF (never a hard-coded C++ ABI flag), and the TF version it was built for is
compiled into it (``custom_ops/cc/build_info.cc``); the loader refuses a library built for
another TF, naming both versions.

TF is asked through a subprocess of the target interpreter with pip's build-isolation
path removed, so ``pip install .`` builds against the TF of the environment being
installed into, not a TF pip might put in an isolated build environment.

CUDA: ``*.cu.cc`` sources are left out unless ``TFPSX_WITH_CUDA=1``; then nvcc compiles
them (with the TF flags nvcc takes and an include shim, see ``cuda_include_shim``), they
are linked in with a static cudart, and the build record says ``cuda=1``.
``python setup.py cuda_check`` compiles them the same way without linking (no GPU needed).
"""

import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from setuptools import Command, Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))


def _load_settings():
    """tfpsx/settings.py, loaded by path (the package is not installed yet): the build
    parses its TFPSX_* variables with the registry's parsers (a bool is 1/0, true/false,
    yes/no, on/off, as everywhere else)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "_tfpsx_settings", os.path.join(HERE, "tfpsx", "settings.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses looks the module up by name
    spec.loader.exec_module(module)
    return module


_settings = _load_settings()


def build_setting(name: str):
    """The build setting ``name`` from the environment; exits naming a bad value."""
    try:
        return _settings.get(name)
    except ValueError as e:
        sys.exit(str(e))

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
    python = build_setting("TFPSX_TF_PYTHON") or sys.executable
    proc = subprocess.run([python, "-c", _TF_QUERY], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(
            "tfpsx compiles its ops against the installed TensorFlow, but "
            f"`{python} -c 'import tensorflow'` failed:\n{proc.stderr[-2000:]}\n"
            "Install TensorFlow first (e.g. pip install tensorflow-cpu==2.21.0), then "
            "pip install --no-build-isolation -e .")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def op_sources(cuda: bool):
    """The op library's sources (paths relative to HERE): *.cc for g++, or *.cu.cc for nvcc
    (with the TF-free CUDA core of custom_ops/cuda, its native benchmark left out)."""
    paths = glob.glob(os.path.join(HERE, "custom_ops", "cc", "**", "*.cc"), recursive=True)
    if cuda:
        paths += [p for p in glob.glob(os.path.join(HERE, "custom_ops", "cuda", "*.cu.cc"))
                  if not p.endswith("_bench.cu.cc")]
    return sorted(os.path.relpath(p, HERE) for p in paths if p.endswith(".cu.cc") == cuda)


OP_SOURCES = op_sources(cuda=False)
BUILD_INFO = os.path.join("custom_ops", "cc", "build_info.cc")
CUDA_SOURCES = op_sources(cuda=True)
# Preloaded into a local job's tasks: their wildcard binds go to loopback (issue: TF's
# servers listen on every interface). Not a Python module: tfpsx.launcher.loopback finds it.
LOOPBACK_EXT = "tfpsx._loopback_bind"
LOOPBACK_SOURCE = os.path.join("custom_ops", "loopback", "loopback_bind.cc")


def cuda_wanted() -> bool:
    return build_setting("TFPSX_WITH_CUDA")


def find_cuda():
    """Returns (nvcc, CUDA root) or exits saying where nvcc was looked for."""
    places = [("$NVCC", os.environ.get("NVCC")), ("PATH", shutil.which("nvcc"))]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            places.append((f"${var}/bin", os.path.join(os.environ[var], "bin", "nvcc")))
    places.append(("/usr/local/cuda/bin", "/usr/local/cuda/bin/nvcc"))
    nvcc = next((path for _, path in places if path and os.access(path, os.X_OK)), None)
    if nvcc is None:
        sys.exit("tfpsx: the CUDA kernels (TFPSX_WITH_CUDA=1, cuda_check) need nvcc, but none "
                 f"was found in {', '.join(where for where, _ in places)}. Install the CUDA "
                 "toolkit, set NVCC=/path/to/nvcc, or build without CUDA (TFPSX_WITH_CUDA=0).")
    # nvcc itself says where its toolkit is (`nvcc` on PATH may be a wrapper script).
    proc = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                          capture_output=True, text=True)
    top = re.search(r"^#\$ TOP=(.+)$", proc.stderr + proc.stdout, re.MULTILINE)
    root = os.path.realpath(top.group(1).strip()) if top else ""
    if not os.path.exists(os.path.join(root, "include", "cuda_runtime.h")):
        sys.exit(f"tfpsx: cannot tell where {nvcc}'s CUDA toolkit is (`nvcc --dryrun` named "
                 f"TOP={root or '?'}, which has no include/cuda_runtime.h)")
    return nvcc, root


def cuda_include_shim(build_temp: str, cuda_root: str) -> str:
    """A folder holding third_party/gpus/cuda/include -> the toolkit's include folder.

    TF's headers include CUDA's as "third_party/gpus/cuda/include/...", a folder of TF's
    own source tree that the pip wheel lacks; with this folder on the include path a
    .cu.cc that includes TF headers compiles against the installed wheel.
    """
    root = os.path.abspath(os.path.join(build_temp, "cuda_include_shim"))
    link = os.path.join(root, "third_party", "gpus", "cuda", "include")
    target = os.path.join(cuda_root, "include")
    os.makedirs(os.path.dirname(link), exist_ok=True)
    if os.path.islink(link) and os.readlink(link) != target:
        os.remove(link)
    if not os.path.lexists(link):
        os.symlink(target, link)
    return root


def nvcc_flags(tf, shim: str):
    flags = ["-x", "cu", "-std=c++17", "-O3", "-DGOOGLE_CUDA=1", "--expt-relaxed-constexpr",
             "-Xcompiler", "-fPIC", f"-I{HERE}", f"-I{shim}"]
    for flag in tf["compile_flags"]:
        if flag.startswith(("-I", "-D")):
            flags.append(flag)
        elif not flag.startswith(("-std=", "--std=")):  # the standard is set above
            flags += ["-Xcompiler", flag]
    return flags


def compile_sources(sources, compiler, flags, obj_dir, force=False):
    """Compiles sources to objects in parallel; returns the objects, in order.

    Objects are cached per compiler and flag set, so a different TF never reuses a stale
    object; a source or any header newer than its object recompiles it.
    """
    os.makedirs(obj_dir, exist_ok=True)
    flag_key = hashlib.sha1(" ".join([compiler, *flags]).encode()).hexdigest()[:10]

    def compile_one(src):
        obj = os.path.join(obj_dir, src.replace(os.sep, "_") + f".{flag_key}.o")
        path = os.path.join(HERE, src)
        if (os.path.exists(obj) and os.path.getmtime(obj) >= os.path.getmtime(path)
                and not force and not _headers_newer(obj)):
            return obj
        cmd = [compiler, "-c", path, "-o", obj, *flags]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        return obj

    jobs = build_setting("TFPSX_BUILD_JOBS") or os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(compile_one, sources))


class TfOpBuildExt(build_ext):
    """Compiles each op source to an object in parallel, links them into one library."""

    def build_extension(self, ext):
        if ext.name == LOOPBACK_EXT:
            return self.build_loopback(ext)
        tf = query_tensorflow()
        with_cuda = cuda_wanted()
        out_path = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(out_path), exist_ok=True)
        obj_dir = os.path.join(self.build_temp, "tfpsx_ops")
        cxx = os.environ.get("CXX", "g++")
        cflags = ["-fPIC", "-O3", "-Wno-deprecated-declarations", f"-I{HERE}",
                  f'-DTFPSX_TF_VERSION="{tf["tf_version"]}"', *tf["compile_flags"]]
        start = time.time()
        # Only the build record says whether CUDA is in: switching CUDA on or off
        # recompiles that one file.
        objs = compile_sources([s for s in ext.sources if s != BUILD_INFO], cxx, cflags,
                               obj_dir, self.force)
        objs += compile_sources([BUILD_INFO], cxx,
                                [*cflags, f"-DTFPSX_WITH_CUDA={int(with_cuda)}"], obj_dir,
                                self.force)
        link_extra = []
        if with_cuda:
            nvcc, cuda_root = find_cuda()
            shim = cuda_include_shim(self.build_temp, cuda_root)
            objs += compile_sources(CUDA_SOURCES, nvcc, nvcc_flags(tf, shim), obj_dir, self.force)
            # Static cudart, its symbols kept private: the library then needs no CUDA
            # runtime at load time, and never interposes the cudart a GPU TF loads itself.
            link_extra = [f"-L{os.path.join(cuda_root, 'lib64')}", "-lcudart_static", "-ldl",
                          "-lrt", "-lpthread", "-Wl,--exclude-libs,libcudart_static.a"]
        link = [cxx, "-shared", "-o", out_path, *objs, *link_extra, *tf["link_flags"]]
        print(" ".join(link), flush=True)
        subprocess.run(link, check=True)
        print(f"tfpsx: built {out_path} for TensorFlow {tf['tf_version']} "
              f"({'with' if with_cuda else 'without'} CUDA) in {time.time() - start:.1f} s",
              flush=True)


    def build_loopback(self, ext):
        """The bind shim a local job's tasks preload (no TensorFlow: the C++ compiler and
        libdl alone; see its source)."""
        out_path = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(out_path), exist_ok=True)
        cmd = [os.environ.get("CXX", "g++"), "-shared", "-fPIC", "-O2", "-Wall", "-std=c++17",
               "-pthread",
               *[os.path.join(HERE, s) for s in ext.sources], "-o", out_path, "-ldl"]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)


class CudaCheck(Command):
    """Compiles every *.cu.cc of the op library as a TFPSX_WITH_CUDA=1 build would.

    The same nvcc flags (the installed TF's, the include shim), no link: it needs nvcc and
    TensorFlow, not a GPU. `make cuda-check` runs it.
    """

    description = "compile the op library's CUDA sources with nvcc (no link, no GPU needed)"
    user_options = []

    def initialize_options(self):
        self.build_temp = None

    def finalize_options(self):
        self.set_undefined_options("build", ("build_temp", "build_temp"))

    def run(self):
        tf = query_tensorflow()
        nvcc, cuda_root = find_cuda()
        shim = cuda_include_shim(self.build_temp, cuda_root)
        start = time.time()
        compile_sources(CUDA_SOURCES, nvcc, nvcc_flags(tf, shim),
                        os.path.join(self.build_temp, "tfpsx_ops"))
        print(f"tfpsx: {len(CUDA_SOURCES)} CUDA source(s) compile with {nvcc} ({cuda_root}) "
              f"against TensorFlow {tf['tf_version']} in {time.time() - start:.1f} s", flush=True)


def _headers_newer(obj):
    mtime = os.path.getmtime(obj)
    return any(os.path.getmtime(h) > mtime
               for h in glob.glob(os.path.join(HERE, "custom_ops", "**", "*.h"), recursive=True))


setup(
    name="tfpsx",
    version="0.1.0",
    description="TensorFlow-native parameter-server extension: Fleet-style API, "
                "GEO training, dynamic embedding tables",
    long_description=open(os.path.join(HERE, "README.md"), encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["tfpsx", "tfpsx.*"]),
    ext_modules=[Extension("tfpsx._tfpsx_ops", sources=OP_SOURCES),
                 Extension(LOOPBACK_EXT, sources=[LOOPBACK_SOURCE])],
    cmdclass={"build_ext": TfOpBuildExt, "cuda_check": CudaCheck},
    # TensorFlow itself is not a dependency on purpose: tfpsx builds against whichever TF
    # (2.16 .. 2.21, CPU or GPU package) the user already has, and must never pull the
    # CUDA `tensorflow` wheel over a `tensorflow-cpu` install.
    # protobuf >= 4.21: the committed scheduler_pb2 is protobuf 4.25 gencode (see the .proto).
    install_requires=["numpy", "grpcio", "protobuf>=4.21", "portpicker"],
    extras_require={
        # tensorboard: tf.summary needs it (TF 2.21 no longer depends on it), for
        # tfpsx.keras.TrainingSummaries and the tests that read its event files back.
        # pytest-xdist: make test runs the single-process tiers two at a time (Makefile)
        "test": ["pytest", "pytest-timeout", "pytest-xdist", "import-linter", "psutil",
                 "tensorboard", "pyyaml"],  # pyyaml: the deploy manifests test
        "tensorboard": ["tensorboard"],
        "bench": ["matplotlib"],
        "docs": ["mkdocs", "mkdocs-material"],
        "cpu": ["tensorflow-cpu"],
    },
    entry_points={"console_scripts": ["tfpsx-run=tfpsx.launcher.run:main",
                                      "tfpsx-scheduler=tfpsx.control.scheduler:main",
                                      "tfpsx-data-service=tfpsx.data.service:main"]},
    zip_safe=False,
)

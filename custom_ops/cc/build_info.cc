// Records what this library was built with inside the library itself, so the record
// cannot be separated from the binary: the TensorFlow version it was compiled against
// (tfpsx/_loader.py reads the marker from the file's bytes before loading it and refuses
// a mismatch) and whether the CUDA kernels (*.cu.cc) are linked in. `tf=` stays first.
#ifndef TFPSX_TF_VERSION
#error "build with -DTFPSX_TF_VERSION=\"<tf.__version__>\" (setup.py and BUILD do this)"
#endif

// setup.py (TFPSX_WITH_CUDA=1) and Bazel (--config=cuda) define TFPSX_WITH_CUDA=1 when
// they link the CUDA objects in.
#if TFPSX_WITH_CUDA
#define TFPSX_BUILD_CUDA "1"
#else
#define TFPSX_BUILD_CUDA "0"
#endif

extern "C" __attribute__((visibility("default"), used)) const char tfpsx_build_info[] =
    "tfpsx-build-info:tf=" TFPSX_TF_VERSION ";cuda=" TFPSX_BUILD_CUDA ";";

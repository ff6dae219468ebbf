// Records the TensorFlow version this library was compiled against inside the library
// itself, so the record cannot be separated from the binary. tfpsx/_loader.py reads the
// marker from the file's bytes before loading it and refuses a mismatch.
#ifndef TFPSX_TF_VERSION
#error "build with -DTFPSX_TF_VERSION=\"<tf.__version__>\" (setup.py and BUILD do this)"
#endif

extern "C" __attribute__((visibility("default"), used)) const char tfpsx_build_info[] =
    "tfpsx-build-info:tf=" TFPSX_TF_VERSION ";";

// Native CUDA test of the GPU side of the table core: nvcc, no TensorFlow (the GPU
// machines have none). `make cuda-check` compiles and links it anywhere nvcc is;
// `make cuda-native-test` runs it, on a machine with a GPU.
//
// The GPU must run the same formulas as the CPU table: every optimizer through
// ApplyRowsFunctor<GpuDevice, ...> against its row math on the host, and the initializer
// in a kernel against the host. Device math contracts a*b+c into FMAs and its powf, logf,
// cosf, sinf differ from glibc's by an ulp or two, so results are compared with a relative
// tolerance of 1e-5; rows' padding must come back untouched.

#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "custom_ops/cc/core/apply_rows_functor.h"
#include "custom_ops/cc/core/initializer.h"
#include "custom_ops/cc/core/optimizers.h"
#include "custom_ops/tests/check.h"

namespace {

using tfpsx_test::failures;

#define CUDA_OK(call)                                                                   \
  do {                                                                                  \
    const cudaError_t err = (call);                                                     \
    if (err != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,                \
                   cudaGetErrorString(err));                                            \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

// Indices where got and want differ by more than 1e-5 relative (1e-5 absolute near 0).
size_t CountFar(const std::vector<float>& got, const std::vector<float>& want) {
  size_t far = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    far += !(std::fabs(got[i] - want[i]) <= 1e-5f * std::max(1.f, std::fabs(want[i])));
  }
  return far;
}

template <typename T>
T* ToDevice(const std::vector<T>& host) {
  T* dev = nullptr;
  CUDA_OK(cudaMalloc(&dev, host.size() * sizeof(T)));
  CUDA_OK(cudaMemcpy(dev, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return dev;
}

template <typename Optimizer>
void CheckGpuMatchesHost(const std::vector<float>& hparams) {
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  for (int64_t dim : {1, 16, 33}) {
    // A padded stride: the rows of a block need not be packed.
    const int64_t n = 10000, stride = dim * (1 + Optimizer::kSlots) + 1;
    std::mt19937_64 rng(dim);
    std::uniform_real_distribution<float> u(0.01f, 1.f);  // accumulators must be > 0
    std::vector<float> rows(n * stride), grads(n * dim);
    for (float& x : rows) x = u(rng);
    for (float& x : grads) x = 2 * u(rng) - 1;
    const Optimizer opt(hparams.data(), 7);
    std::vector<float> want = rows;
    for (int64_t i = 0; i < n; ++i) opt(want.data() + i * stride, grads.data() + i * dim, dim);

    float* d_rows = ToDevice(rows);
    float* d_grads = ToDevice(grads);
    tfpsx::ApplyRowsFunctor<tfpsx::GpuDevice, Optimizer>()(tfpsx::GpuDevice{stream}, opt, d_rows,
                                                           stride, d_grads, n, dim);
    CUDA_OK(cudaStreamSynchronize(stream));
    std::vector<float> got(rows.size());
    CUDA_OK(cudaMemcpy(got.data(), d_rows, got.size() * sizeof(float), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaFree(d_rows));
    CUDA_OK(cudaFree(d_grads));
    const size_t far = CountFar(got, want);
    if (far) {
      std::fprintf(stderr, "%s dim=%lld: %zu of %zu floats differ from the host row math\n",
                   Optimizer::kName, static_cast<long long>(dim), far, got.size());
    }
    CHECK(far == 0);
    for (int64_t pad = stride - 1; pad < n * stride; pad += stride) CHECK(got[pad] == rows[pad]);
  }
  CUDA_OK(cudaStreamDestroy(stream));
}

__global__ void InitialRowsKernel(tfpsx::RowInitializer init, const int64_t* keys, int64_t n,
                                  int64_t dim, float* out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) init(keys[i], out + i * dim, dim);
}

void CheckInitializerOnDevice() {
  const int64_t n = 4096, dim = 17;
  std::vector<int64_t> keys(n);
  for (int64_t i = 0; i < n; ++i) keys[i] = (i - n / 2) * 1000003;
  const tfpsx::RowInitializer inits[] = {
      {tfpsx::InitKind::kZeros, 0.f, 0.f, 1},
      {tfpsx::InitKind::kConstant, 0.25f, 0.f, 1},
      {tfpsx::InitKind::kUniform, -0.3f, 0.7f, 99},
      {tfpsx::InitKind::kNormal, 0.1f, 0.05f, 42},
  };
  int64_t* d_keys = ToDevice(keys);
  float* d_out = nullptr;
  CUDA_OK(cudaMalloc(&d_out, n * dim * sizeof(float)));
  for (const tfpsx::RowInitializer& init : inits) {
    std::vector<float> want(n * dim), got(n * dim);
    for (int64_t i = 0; i < n; ++i) init(keys[i], want.data() + i * dim, dim);
    InitialRowsKernel<<<(n + 255) / 256, 256>>>(init, d_keys, n, dim, d_out);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaMemcpy(got.data(), d_out, got.size() * sizeof(float), cudaMemcpyDeviceToHost));
    const size_t far = CountFar(got, want);
    if (far) {
      std::fprintf(stderr, "initializer kind %d: %zu of %zu floats differ from the host\n",
                   static_cast<int>(init.kind), far, got.size());
    }
    CHECK(far == 0);
  }
  CUDA_OK(cudaFree(d_keys));
  CUDA_OK(cudaFree(d_out));
}

}  // namespace

int main() {
  int devices = 0;
  const cudaError_t err = cudaGetDeviceCount(&devices);
  if (err != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "apply_rows_functor_test: needs a CUDA device, found none (%s)\n",
                 err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
    return 1;
  }
  CheckGpuMatchesHost<tfpsx::SgdOptimizer>({0.1f});
  CheckGpuMatchesHost<tfpsx::AdagradOptimizer>({0.1f, 1e-7f});
  CheckGpuMatchesHost<tfpsx::AdamOptimizer>({0.01f, 0.9f, 0.999f, 1e-7f});
  CheckGpuMatchesHost<tfpsx::FtrlOptimizer>({0.05f, -0.5f, 0.01f, 0.02f});
  CheckInitializerOnDevice();
  return tfpsx_test::Finish("apply_rows_functor_test");
}

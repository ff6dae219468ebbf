// The GPU side of ApplyRowsFunctor (apply_rows_functor.h): a CUDA kernel that runs an
// optimizer's TFPSX_HOST_DEVICE row math over a block of rows in device memory. One thread
// per row: an optimizer's row math may read the whole row (a row-wise optimizer reduces
// over it), so a row is not split over threads. TF-free like the rest of the core, so it
// builds and is tested (custom_ops/tests/apply_rows_functor_test.cu.cc) on GPU machines
// that have no TensorFlow.

#if GOOGLE_CUDA

#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "custom_ops/cc/core/apply_rows_functor.h"
#include "custom_ops/cc/core/optimizers.h"

namespace tfpsx {
namespace {

template <typename Optimizer>
__global__ void ApplyRowsKernel(Optimizer opt, float* rows, int64_t row_stride,
                                const float* grads, int64_t n, int64_t dim) {
  const int64_t threads = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += threads) {
    opt(rows + i * row_stride, grads + i * dim, dim);
  }
}

}  // namespace

template <typename Optimizer>
void ApplyRowsFunctor<GpuDevice, Optimizer>::operator()(const GpuDevice& d, const Optimizer& opt,
                                                        float* rows, int64_t row_stride,
                                                        const float* grads, int64_t n,
                                                        int64_t dim) const {
  if (n <= 0) return;
  constexpr int kThreads = 256;
  // A grid-stride loop: enough blocks to fill any current GPU, not one per 256 rows of a
  // huge block.
  const int blocks = static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, 4096));
  ApplyRowsKernel<Optimizer><<<blocks, kThreads, 0, d.stream>>>(opt, rows, row_stride, grads, n,
                                                                 dim);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("ApplyRowsFunctor<GpuDevice, ") + Optimizer::kName +
                             ">: launching the kernel for " + std::to_string(n) +
                             " rows failed: " + cudaGetErrorString(err));
  }
}

#define TFPSX_INSTANTIATE_GPU(Optimizer) template struct ApplyRowsFunctor<GpuDevice, Optimizer>;
TFPSX_FOR_EACH_OPTIMIZER(TFPSX_INSTANTIATE_GPU)
#undef TFPSX_INSTANTIATE_GPU

}  // namespace tfpsx

#endif  // GOOGLE_CUDA

// ApplyRowsFunctor<Device, Optimizer>: applies an optimizer (optimizers.h) to a block of
// rows on a device, in the shape of tensorflow/custom-op's time_two functor: this header
// declares it per device, the CPU specialization is defined in apply_rows_functor.cc
// (where the CPU table runs it, one row at a time, under the row's stripe lock), the GPU
// one in apply_rows_functor.cu.cc (a CUDA kernel over a block of rows in device memory: the
// building block of a GPU table).
//
// The devices are tfpsx's own tags, not Eigen's: the table core builds and is tested
// without TensorFlow. A TF kernel passes its stream through
// (GpuDevice{ctx->eigen_gpu_device().stream()}).

#ifndef TFPSX_CORE_APPLY_ROWS_FUNCTOR_H_
#define TFPSX_CORE_APPLY_ROWS_FUNCTOR_H_

#include <cstdint>

struct CUstream_st;  // what a cudaStream_t points to, named without CUDA's headers

namespace tfpsx {

class HashTable;

struct CpuDevice {};

struct GpuDevice {
  CUstream_st* stream = nullptr;  // a cudaStream_t; null: the legacy default stream
};

// Applies grads[n * dim] to n rows: row i starts at rows + i * row_stride (floats) and is
// [value | the optimizer's slots], dim floats each. On a GpuDevice every pointer is device
// memory and the call only enqueues the work on d.stream.
template <typename Device, typename Optimizer>
struct ApplyRowsFunctor;

template <typename Optimizer>
struct ApplyRowsFunctor<CpuDevice, Optimizer> {
  void operator()(const CpuDevice& d, const Optimizer& opt, float* rows, int64_t row_stride,
                  const float* grads, int64_t n, int64_t dim) const;
};

template <typename Optimizer>
struct ApplyRowsFunctor<GpuDevice, Optimizer> {
  // Throws std::runtime_error when the kernel cannot be launched.
  void operator()(const GpuDevice& d, const Optimizer& opt, float* rows, int64_t row_stride,
                  const float* grads, int64_t n, int64_t dim) const;
};

// The CPU table's optimizer step: builds Optimizer from hparams (Optimizer::kHparams
// order) and step, and applies grads[n * dim] to the rows of keys[n] (expected unique)
// through HashTable::ApplyGradients, whose rows must have Optimizer::kSlots slots.
// Instantiated for every optimizer in apply_rows_functor.cc; the registry
// (optimizer_registry.h) hands it out by name.
template <typename Optimizer>
void ApplyToTable(HashTable& table, const int64_t* keys, int64_t n, const float* grads,
                  const float* hparams, int64_t step);

}  // namespace tfpsx

#endif  // TFPSX_CORE_APPLY_ROWS_FUNCTOR_H_

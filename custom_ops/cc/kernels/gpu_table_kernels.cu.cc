// GPU kernels of the GPU embedding table ops (../ops/gpu_table_ops.cu.cc): thin wrappers of
// the TF-free CUDA core (custom_ops/cuda/gpu_table.h) on the op's stream. Built only
// with CUDA (TFPSX_WITH_CUDA=1: nvcc, GOOGLE_CUDA); a CPU-only build has no such kernels.

#if GOOGLE_CUDA
#define EIGEN_USE_GPU

#include <cuda_runtime.h>

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "custom_ops/cuda/gpu_table.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_base.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/tensor.h"
#include "unsupported/Eigen/CXX11/Tensor"

namespace tfpsx {
namespace {

using ::tensorflow::DEVICE_GPU;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using cuda::GpuHashTable;

class GpuTableResource : public ::tensorflow::ResourceBase {
 public:
  GpuTableResource(const std::string& name, std::unique_ptr<GpuHashTable> table)
      : name_(name), table_(std::move(table)) {}
  std::string DebugString() const override {
    return absl::StrCat("TfpsxGpuTable(", name_, ", dim=", table_->dim(),
                        ", capacity=", table_->capacity(), ")");
  }
  GpuHashTable& table() { return *table_; }

 private:
  std::string name_;
  std::unique_ptr<GpuHashTable> table_;
};

cuda::Stream StreamOf(OpKernelContext* ctx) {
  return reinterpret_cast<cuda::Stream>(ctx->eigen_device<Eigen::GpuDevice>().stream());
}

// Runs fn, turning the core's exceptions (CUDA errors) into the op's error.
template <typename Fn>
void Guarded(OpKernelContext* ctx, const char* what, Fn&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    ctx->SetStatus(absl::InternalError(absl::StrCat(what, ": ", e.what())));
  }
}

class GpuTableHandleOp : public OpKernel {
 public:
  explicit GpuTableHandleOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("container", &container_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("shared_name", &name_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dim", &dim_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("capacity", &capacity_));
    std::string init;
    int64_t seed = 0;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("initializer", &init));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("init_a", &init_.a));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("init_b", &init_.b));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("seed", &seed));
    init_.seed = static_cast<uint64_t>(seed);
    init_.kind = init == "constant" ? InitKind::kConstant
                 : init == "uniform" ? InitKind::kUniform
                 : init == "normal"  ? InitKind::kNormal
                                     : InitKind::kZeros;
    OP_REQUIRES(ctx, !name_.empty(),
                absl::InvalidArgumentError("a tfpsx GPU table needs a non-empty shared_name"));
    OP_REQUIRES(ctx, dim_ > 0 && capacity_ > 0,
                absl::InvalidArgumentError(absl::StrCat(
                    "tfpsx GPU table '", name_, "': dim and capacity must be > 0, got dim=",
                    dim_, ", capacity=", capacity_)));
  }

  void Compute(OpKernelContext* ctx) override {
    const std::string container =
        container_.empty() ? ctx->resource_manager()->default_container() : container_;
    GpuTableResource* table = nullptr;
    OP_REQUIRES_OK(ctx, ctx->resource_manager()->LookupOrCreate<GpuTableResource>(
                            container, name_, &table, [this](GpuTableResource** out) {
                              std::unique_ptr<GpuHashTable> t;
                              try {
                                t = std::make_unique<GpuHashTable>(capacity_, dim_, init_);
                              } catch (const std::exception& e) {
                                return absl::ResourceExhaustedError(absl::StrCat(
                                    "tfpsx GPU table '", name_, "' with capacity=", capacity_,
                                    ", dim=", dim_, ": ", e.what()));
                              }
                              *out = new GpuTableResource(name_, std::move(t));
                              return absl::OkStatus();
                            }));
    ::tensorflow::core::ScopedUnref unref(table);
    OP_REQUIRES(ctx, table->table().dim() == dim_,
                absl::InvalidArgumentError(absl::StrCat(
                    "tfpsx GPU table '", name_, "' already exists with dim=",
                    table->table().dim(), "; asked for dim=", dim_)));
    Tensor* handle = nullptr;
    ::tensorflow::AllocatorAttributes host;
    host.set_on_host(true);
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &handle, host));
    handle->scalar<::tensorflow::ResourceHandle>()() =
        ::tensorflow::MakeResourceHandle<GpuTableResource>(ctx, container, name_);
  }

 private:
  std::string container_, name_;
  int64_t dim_ = 0, capacity_ = 0;
  RowInitializer init_;
};

// Base: looks the table up, checks the keys, runs ComputeOn.
class GpuTableOpKernel : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<GpuTableResource> table;
    OP_REQUIRES_OK(ctx, ::tensorflow::LookupResource(ctx, ::tensorflow::HandleFromInput(ctx, 0),
                                                     &table));
    ComputeOn(ctx, table->table());
  }
  virtual void ComputeOn(OpKernelContext* ctx, GpuHashTable& table) = 0;
};

TensorShape RowsShape(const TensorShape& keys, int64_t dim) {
  TensorShape shape = keys;
  shape.AddDim(dim);
  return shape;
}

// A device counter the op reads back after its work (the table-full check).
class DeviceCounter {
 public:
  explicit DeviceCounter(OpKernelContext* ctx) {
    status_ = ctx->allocate_temp(::tensorflow::DT_UINT64, TensorShape({1}), &tensor_);
    if (status_.ok()) {
      cuda::Check(cudaMemsetAsync(ptr(), 0, sizeof(unsigned long long),
                                  reinterpret_cast<cudaStream_t>(StreamOf(ctx))),
                  "cudaMemsetAsync");
    }
  }
  const absl::Status& status() const { return status_; }
  unsigned long long* ptr() {
    return reinterpret_cast<unsigned long long*>(tensor_.flat<uint64_t>().data());
  }
  unsigned long long Read(OpKernelContext* ctx) {
    unsigned long long value = 0;
    cudaStream_t s = reinterpret_cast<cudaStream_t>(StreamOf(ctx));
    cuda::Check(cudaMemcpyAsync(&value, ptr(), sizeof(value), cudaMemcpyDeviceToHost, s),
                "counter");
    cuda::Check(cudaStreamSynchronize(s), "counter");
    return value;
  }

 private:
  Tensor tensor_;
  absl::Status status_;
};

class GpuTableFindOp : public GpuTableOpKernel {
 public:
  using GpuTableOpKernel::GpuTableOpKernel;
  void ComputeOn(OpKernelContext* ctx, GpuHashTable& table) override {
    const Tensor& keys = ctx->input(1);
    Tensor *values = nullptr, *found = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, RowsShape(keys.shape(), table.dim()), &values));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, keys.shape(), &found));
    Guarded(ctx, "TfpsxGpuTableFind", [&] {
      table.Find(keys.flat<int64_t>().data(), keys.NumElements(), values->flat<float>().data(),
                 found->flat<bool>().data(), StreamOf(ctx));
    });
  }
};

class GpuTableFindOrInsertOp : public GpuTableOpKernel {
 public:
  using GpuTableOpKernel::GpuTableOpKernel;
  void ComputeOn(OpKernelContext* ctx, GpuHashTable& table) override {
    const Tensor& keys = ctx->input(1);
    Tensor* values = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, RowsShape(keys.shape(), table.dim()), &values));
    Guarded(ctx, "TfpsxGpuTableFindOrInsert", [&] {
      DeviceCounter failed(ctx);
      OP_REQUIRES_OK(ctx, failed.status());
      table.FindOrInsert(keys.flat<int64_t>().data(), keys.NumElements(),
                         values->flat<float>().data(), StreamOf(ctx), failed.ptr());
      const auto lost = failed.Read(ctx);
      OP_REQUIRES(ctx, lost == 0,
                  absl::ResourceExhaustedError(absl::StrCat(
                      "tfpsx GPU table is full: ", lost, " of ", keys.NumElements(),
                      " keys found no free slot among its ", table.capacity(),
                      "; create it with a larger capacity or evict rows")));
    });
  }
};

class GpuTableAccumulateOp : public GpuTableOpKernel {
 public:
  using GpuTableOpKernel::GpuTableOpKernel;
  void ComputeOn(OpKernelContext* ctx, GpuHashTable& table) override {
    const Tensor& keys = ctx->input(1);
    const Tensor& deltas = ctx->input(2);
    OP_REQUIRES(ctx, deltas.shape() == RowsShape(keys.shape(), table.dim()),
                absl::InvalidArgumentError(absl::StrCat(
                    "TfpsxGpuTableAccumulate: deltas must have shape keys' shape + [dim=",
                    table.dim(), "], got ", deltas.shape().DebugString(), " for keys ",
                    keys.shape().DebugString())));
    Guarded(ctx, "TfpsxGpuTableAccumulate", [&] {
      DeviceCounter failed(ctx);
      OP_REQUIRES_OK(ctx, failed.status());
      table.Accumulate(keys.flat<int64_t>().data(), keys.NumElements(),
                       deltas.flat<float>().data(), StreamOf(ctx), failed.ptr());
      const auto lost = failed.Read(ctx);
      OP_REQUIRES(ctx, lost == 0,
                  absl::ResourceExhaustedError(absl::StrCat(
                      "tfpsx GPU table is full: ", lost, " of ", keys.NumElements(),
                      " keys found no free slot among its ", table.capacity())));
    });
  }
};

class GpuTableEvictOp : public GpuTableOpKernel {
 public:
  using GpuTableOpKernel::GpuTableOpKernel;
  void ComputeOn(OpKernelContext* ctx, GpuHashTable& table) override {
    const Tensor& keys = ctx->input(1);
    Guarded(ctx, "TfpsxGpuTableEvict", [&] {
      table.Evict(keys.flat<int64_t>().data(), keys.NumElements(), StreamOf(ctx));
    });
  }
};

class GpuTableSizeOp : public GpuTableOpKernel {
 public:
  using GpuTableOpKernel::GpuTableOpKernel;
  void ComputeOn(OpKernelContext* ctx, GpuHashTable& table) override {
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    Guarded(ctx, "TfpsxGpuTableSize", [&] { out->scalar<int64_t>()() = table.Size(StreamOf(ctx)); });
  }
};

}  // namespace

REGISTER_KERNEL_BUILDER(Name("TfpsxGpuTableHandleOp").Device(DEVICE_GPU).HostMemory("handle"),
                        GpuTableHandleOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxGpuTableFind").Device(DEVICE_GPU).HostMemory("handle"),
                        GpuTableFindOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxGpuTableFindOrInsert").Device(DEVICE_GPU).HostMemory("handle"),
                        GpuTableFindOrInsertOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxGpuTableAccumulate").Device(DEVICE_GPU).HostMemory("handle"),
                        GpuTableAccumulateOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxGpuTableEvict").Device(DEVICE_GPU).HostMemory("handle"),
                        GpuTableEvictOp);
REGISTER_KERNEL_BUILDER(
    Name("TfpsxGpuTableSize").Device(DEVICE_GPU).HostMemory("handle").HostMemory("size"),
    GpuTableSizeOp);

}  // namespace tfpsx

#endif  // GOOGLE_CUDA

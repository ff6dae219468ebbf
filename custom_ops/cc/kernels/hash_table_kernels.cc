// TF kernels for tfpsx dynamic embedding tables: thin wrappers over the TF-free core
// (custom_ops/cc/core/hash_table.h). Shapes are checked here, with messages that name
// the table, the expected shape and the one given.

#include <climits>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "custom_ops/cc/core/hash_table.h"
#include "custom_ops/cc/core/optimizer_registry.h"
#include "custom_ops/cc/core/optimizers.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/util/work_sharder.h"

namespace tfpsx {

using ::tensorflow::DEVICE_CPU;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;

class TableResource : public ::tensorflow::ResourceBase {
 public:
  // The table is built before the resource: a HashTable constructor that throws (a
  // capacity the process cannot reserve) must not unwind a RefCounted (TF 2.16 aborts on
  // destroying one whose count is still 1).
  TableResource(const std::string& name, std::unique_ptr<HashTable> table)
      : name_(name), table_(std::move(table)) {}
  std::string DebugString() const override {
    return absl::StrCat("TfpsxHashTable(", name_, ", dim=", table_->dim(),
                        ", size=", table_->Size(), ")");
  }
  int64_t MemoryUsed() const override { return table_->MemoryBytes(); }
  HashTable& table() { return *table_; }
  const std::string& name() const { return name_; }

 private:
  std::string name_;
  std::unique_ptr<HashTable> table_;
};

class HashTableHandleOp : public OpKernel {
 public:
  explicit HashTableHandleOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("container", &container_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("shared_name", &name_));
    OP_REQUIRES(ctx, !name_.empty(),
                absl::InvalidArgumentError("a tfpsx table needs a non-empty shared_name"));
    int64_t dim = 0, seed = 0, min_frequency = 1;
    int num_slots = 0;
    std::string init;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dim", &dim));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_slots", &num_slots));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("slot_init", &options_.slot_init));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("initializer", &init));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("init_a", &options_.init_a));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("init_b", &options_.init_b));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("seed", &seed));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("min_frequency", &min_frequency));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("capacity", &options_.capacity));
    options_.dim = dim;
    options_.num_slots = num_slots;
    options_.seed = static_cast<uint64_t>(seed);
    options_.min_frequency = min_frequency;
    options_.init = init == "constant" ? InitKind::kConstant
                    : init == "uniform" ? InitKind::kUniform
                    : init == "normal"  ? InitKind::kNormal
                                        : InitKind::kZeros;
    const std::string problem = ValidateOptions(options_);
    OP_REQUIRES(ctx, problem.empty(),
                absl::InvalidArgumentError(absl::StrCat("tfpsx table '", name_, "': ", problem)));
  }

  void Compute(OpKernelContext* ctx) override {
    TableResource* table = nullptr;
    const std::string container =
        container_.empty() ? ctx->resource_manager()->default_container() : container_;
    OP_REQUIRES_OK(ctx, ctx->resource_manager()->LookupOrCreate<TableResource>(
                            container, name_, &table, [this](TableResource** out) {
                              std::unique_ptr<HashTable> t;
                              try {
                                t = std::make_unique<HashTable>(options_);
                              } catch (const std::exception& e) {  // reserving capacity
                                return absl::ResourceExhaustedError(absl::StrCat(
                                    "tfpsx table '", name_, "' with capacity=",
                                    options_.capacity, ": ", e.what()));
                              }
                              *out = new TableResource(name_, std::move(t));
                              return absl::OkStatus();
                            }));
    ::tensorflow::core::ScopedUnref unref(table);
    const TableOptions& have = table->table().options();
    OP_REQUIRES(ctx, have.dim == options_.dim && have.num_slots == options_.num_slots,
                absl::InvalidArgumentError(absl::StrCat(
                    "tfpsx table '", name_, "' already exists on this device with dim=",
                    have.dim, ", num_slots=", have.num_slots, "; it was asked for again with dim=",
                    options_.dim, ", num_slots=", options_.num_slots,
                    ". Use another name, or the same dim and optimizer.")));
    Tensor* handle = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &handle,
                                             ::tensorflow::AllocatorAttributes()));
    handle->scalar<::tensorflow::ResourceHandle>()() =
        ::tensorflow::MakeResourceHandle<TableResource>(ctx, container, name_);
  }

 private:
  std::string container_, name_;
  TableOptions options_;
};

REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableHandleOp").Device(DEVICE_CPU), HashTableHandleOp);

namespace {

absl::Status GetTable(OpKernelContext* ctx, ::tensorflow::core::RefCountPtr<TableResource>* out) {
  return ::tensorflow::LookupResource(ctx, ::tensorflow::HandleFromInput(ctx, 0), out);
}

template <typename T>
absl::Status Scalar(OpKernelContext* ctx, int index, const char* name, T* out) {
  const Tensor& t = ctx->input(index);
  if (!::tensorflow::TensorShapeUtils::IsScalar(t.shape())) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " must be a scalar, got shape ", t.shape().DebugString()));
  }
  *out = t.scalar<T>()();
  return absl::OkStatus();
}

TensorShape RowsShape(const TensorShape& keys, int64_t dim) {
  TensorShape shape = keys;
  shape.AddDim(dim);
  return shape;
}

absl::Status CheckRows(const TableResource& table, const Tensor& keys, const Tensor& rows,
                       const char* what) {
  const int64_t dim = const_cast<TableResource&>(table).table().dim();
  const TensorShape want = RowsShape(keys.shape(), dim);
  if (rows.shape() != want) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tfpsx table '", table.name(), "': ", what, " must have shape ", want.DebugString(),
        " (keys' shape + [dim=", dim, "]), got ", rows.shape().DebugString()));
  }
  return absl::OkStatus();
}

// Splits [0, n) over the CPU worker threads; each range is processed independently
// (the core table is thread-safe). The core reports a full table by throwing; that must
// not escape into TF's thread pool, so the first failure becomes the op's error.
template <typename Fn>
absl::Status ParallelRanges(OpKernelContext* ctx, const TableResource& table, int64_t n,
                            int64_t cost_per_key, Fn&& fn) {
  auto* threads = ctx->device()->tensorflow_cpu_worker_threads();
  std::mutex mu;
  absl::Status status;
  ::tensorflow::Shard(threads->num_threads, threads->workers, n, cost_per_key,
                      [&](int64_t begin, int64_t end) {
                        try {
                          fn(begin, end);
                        } catch (const std::exception& e) {
                          std::lock_guard<std::mutex> lock(mu);
                          if (status.ok()) {
                            status = absl::ResourceExhaustedError(
                                absl::StrCat("tfpsx table '", table.name(), "': ", e.what()));
                          }
                        }
                      });
  return status;
}

}  // namespace

// Base of the kernels that work on a table: input 0 is its handle.
class TableOpKernel : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) final {
    ::tensorflow::core::RefCountPtr<TableResource> table;
    OP_REQUIRES_OK(ctx, GetTable(ctx, &table));
    ComputeOn(ctx, *table);
  }

 protected:
  virtual void ComputeOn(OpKernelContext* ctx, TableResource& table) = 0;
};

class FindOp : public TableOpKernel {
 public:
  using TableOpKernel::TableOpKernel;
  void ComputeOn(OpKernelContext* ctx, TableResource& table) override {
    const Tensor& keys = ctx->input(1);
    HashTable& t = table.table();
    Tensor* values = nullptr;
    Tensor* found = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, RowsShape(keys.shape(), t.dim()), &values));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, keys.shape(), &found));
    const int64_t* k = keys.flat<int64_t>().data();
    float* v = values->flat<float>().data();
    bool* f = found->flat<bool>().data();
    const int64_t dim = t.dim();
    OP_REQUIRES_OK(ctx, ParallelRanges(ctx, table, keys.NumElements(), 20 + 2 * dim,
                                       [&](int64_t b, int64_t e) {
      t.Find(k + b, e - b, v + b * dim, f + b);
    }));
  }
};

class FindOrInsertOp : public TableOpKernel {
 public:
  using TableOpKernel::TableOpKernel;
  void ComputeOn(OpKernelContext* ctx, TableResource& table) override {
    const Tensor& keys = ctx->input(1);
    int64_t step = 0;
    OP_REQUIRES_OK(ctx, Scalar(ctx, 2, "step", &step));
    HashTable& t = table.table();
    Tensor* values = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, RowsShape(keys.shape(), t.dim()), &values));
    const int64_t* k = keys.flat<int64_t>().data();
    float* v = values->flat<float>().data();
    const int64_t dim = t.dim();
    OP_REQUIRES_OK(ctx, ParallelRanges(ctx, table, keys.NumElements(), 40 + 2 * dim,
                                       [&](int64_t b, int64_t e) {
      t.FindOrInsert(k + b, e - b, step, v + b * dim);
    }));
  }
};

template <bool kAccumulate>
class WriteOp : public TableOpKernel {
 public:
  using TableOpKernel::TableOpKernel;
  void ComputeOn(OpKernelContext* ctx, TableResource& table) override {
    const Tensor& keys = ctx->input(1);
    const Tensor& rows = ctx->input(2);
    OP_REQUIRES_OK(ctx, CheckRows(table, keys, rows, kAccumulate ? "deltas" : "values"));
    int64_t step = 0;
    OP_REQUIRES_OK(ctx, Scalar(ctx, 3, "step", &step));
    HashTable& t = table.table();
    const int64_t* k = keys.flat<int64_t>().data();
    const float* r = rows.flat<float>().data();
    const int64_t dim = t.dim();
    OP_REQUIRES_OK(ctx, ParallelRanges(ctx, table, keys.NumElements(), 40 + 2 * dim,
                                       [&](int64_t b, int64_t e) {
      if (kAccumulate) {
        t.Accumulate(k + b, e - b, r + b * dim, step);
      } else {
        t.Insert(k + b, e - b, r + b * dim, step);
      }
    }));
  }
};

class RemoveOp : public TableOpKernel {
 public:
  using TableOpKernel::TableOpKernel;
  void ComputeOn(OpKernelContext* ctx, TableResource& table) override {
    const Tensor& keys = ctx->input(1);
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() =
        table.table().Remove(keys.flat<int64_t>().data(), keys.NumElements());
  }
};

class SizeOp : public TableOpKernel {
 public:
  using TableOpKernel::TableOpKernel;
  void ComputeOn(OpKernelContext* ctx, TableResource& table) override {
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = table.table().Size();
  }
};

class ExportOp : public TableOpKernel {
 public:
  using TableOpKernel::TableOpKernel;
  void ComputeOn(OpKernelContext* ctx, TableResource& table) override {
    int64_t since = 0;
    OP_REQUIRES_OK(ctx, Scalar(ctx, 1, "since_step", &since));
    HashTable& t = table.table();
    ExportedRows rows = t.ExportSince(since);
    const int64_t n = static_cast<int64_t>(rows.keys.size()), dim = t.dim(),
                  slots = t.options().num_slots;
    Tensor* out[5];
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &out[0]));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({n, dim}), &out[1]));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({n, slots, dim}), &out[2]));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, TensorShape({n}), &out[3]));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(4, TensorShape({n}), &out[4]));
    std::copy(rows.keys.begin(), rows.keys.end(), out[0]->flat<int64_t>().data());
    std::copy(rows.values.begin(), rows.values.end(), out[1]->flat<float>().data());
    std::copy(rows.slots.begin(), rows.slots.end(), out[2]->flat<float>().data());
    std::copy(rows.freq.begin(), rows.freq.end(), out[3]->flat<int64_t>().data());
    std::copy(rows.step.begin(), rows.step.end(), out[4]->flat<int64_t>().data());
  }
};

class ImportOp : public TableOpKernel {
 public:
  explicit ImportOp(OpKernelConstruction* ctx) : TableOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("clear", &clear_));
  }
  void ComputeOn(OpKernelContext* ctx, TableResource& table) override {
    HashTable& t = table.table();
    const Tensor &keys = ctx->input(1), &values = ctx->input(2), &slots = ctx->input(3),
                 &freq = ctx->input(4), &step = ctx->input(5);
    OP_REQUIRES(ctx, keys.dims() == 1,
                absl::InvalidArgumentError(absl::StrCat(
                    "tfpsx table '", table.name(), "': import keys must be a vector, got shape ",
                    keys.shape().DebugString())));
    const int64_t n = keys.NumElements();
    OP_REQUIRES_OK(ctx, CheckRows(table, keys, values, "imported values"));
    for (const auto& [tensor, what] : {std::make_pair(&freq, "freq"), std::make_pair(&step, "step")}) {
      OP_REQUIRES(ctx, tensor->NumElements() == 0 || tensor->NumElements() == n,
                  absl::InvalidArgumentError(absl::StrCat(
                      "tfpsx table '", table.name(), "': import ", what, " must be empty or hold ",
                      n, " values, got ", tensor->shape().DebugString())));
    }
    std::string problem;
    try {
      problem = t.Import(
          keys.flat<int64_t>().data(), n, values.flat<float>().data(),
          slots.NumElements() ? slots.flat<float>().data() : nullptr, slots.NumElements(),
          freq.NumElements() ? freq.flat<int64_t>().data() : nullptr,
          step.NumElements() ? step.flat<int64_t>().data() : nullptr, clear_);
    } catch (const std::exception& e) {
      problem = e.what();
    }
    OP_REQUIRES(ctx, problem.empty(),
                absl::InvalidArgumentError(
                    absl::StrCat("tfpsx table '", table.name(), "': import: ", problem)));
  }

 private:
  bool clear_ = false;
};

class TakeChangedOp : public TableOpKernel {
 public:
  using TableOpKernel::TableOpKernel;
  void ComputeOn(OpKernelContext* ctx, TableResource& table) override {
    int64_t reader = 0;
    OP_REQUIRES_OK(ctx, Scalar(ctx, 1, "reader", &reader));
    const std::vector<int64_t> keys = table.table().TakeChanged(reader);
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            0, TensorShape({static_cast<int64_t>(keys.size())}), &out));
    std::copy(keys.begin(), keys.end(), out->flat<int64_t>().data());
  }
};

// Serves TfpsxHashTableApply (the optimizer from its attr, hyperparameters as one
// vector) and, through FixedApplyOp, the per-optimizer ops that came before it (one fixed
// optimizer, hyperparameters as scalar inputs; kept because saved graphs name them).
class ApplyOp : public TableOpKernel {
 public:
  explicit ApplyOp(OpKernelConstruction* ctx) : TableOpKernel(ctx), scalar_hparams_(false) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("optimizer", &optimizer_name_));
    optimizer_ = FindOptimizer(optimizer_name_);
  }

  void ComputeOn(OpKernelContext* ctx, TableResource& table) override {
    // An unknown name is reported here rather than at construction, to name the table.
    OP_REQUIRES(ctx, optimizer_ != nullptr,
                absl::InvalidArgumentError(absl::StrCat(
                    "tfpsx table '", table.name(), "': unknown optimizer '", optimizer_name_,
                    "'; expected one of ", OptimizerNames())));
    const OptimizerInfo& opt = *optimizer_;
    HashTable& t = table.table();
    OP_REQUIRES(ctx, t.options().num_slots == opt.num_slots,
                absl::InvalidArgumentError(absl::StrCat(
                    "tfpsx table '", table.name(), "' has ", t.options().num_slots,
                    " optimizer slot(s) but optimizer '", opt.name, "' (", type_string(),
                    ") needs ", opt.num_slots,
                    "; create the table with the optimizer it is trained with")));
    const Tensor& keys = ctx->input(1);
    const Tensor& grads = ctx->input(2);
    OP_REQUIRES_OK(ctx, CheckRows(table, keys, grads, "grads"));
    const int num_hparams = static_cast<int>(opt.hparam_names.size());
    std::vector<float> hparams(num_hparams);
    int step_input = 4;
    if (scalar_hparams_) {
      for (int i = 0; i < num_hparams; ++i) {
        OP_REQUIRES_OK(ctx, Scalar(ctx, 3 + i, opt.hparam_names[i].c_str(), &hparams[i]));
      }
      step_input = 3 + num_hparams;
    } else {
      const Tensor& given = ctx->input(3);
      OP_REQUIRES(ctx, given.dims() == 1 && given.NumElements() == num_hparams,
                  absl::InvalidArgumentError(absl::StrCat(
                      "tfpsx table '", table.name(), "': optimizer '", opt.name, "' takes ",
                      num_hparams, " hyperparameter(s) ", opt.HparamList(),
                      " as a vector, got hparams of shape ", given.shape().DebugString())));
      std::copy_n(given.flat<float>().data(), num_hparams, hparams.begin());
    }
    int64_t step = 0;
    OP_REQUIRES_OK(ctx, Scalar(ctx, step_input, "step", &step));
    const int64_t* k = keys.flat<int64_t>().data();
    const float* g = grads.flat<float>().data();
    const int64_t n = keys.NumElements(), dim = t.dim();
    OP_REQUIRES_OK(ctx, ParallelRanges(ctx, table, n, 60 + 8 * dim,
                                       [&](int64_t begin, int64_t end) {
      opt.apply(t, k + begin, end - begin, g + begin * dim, hparams.data(), step);
    }));
  }

 protected:
  ApplyOp(OpKernelConstruction* ctx, const char* optimizer)
      : TableOpKernel(ctx),
        scalar_hparams_(true),
        optimizer_name_(optimizer),
        optimizer_(FindOptimizer(optimizer)) {}

 private:
  const bool scalar_hparams_;
  std::string optimizer_name_;
  const OptimizerInfo* optimizer_;
};

// TfpsxHashTableApplySgd/Adagrad/Adam/Ftrl: ApplyOp with the optimizer fixed.
template <typename Optimizer>
class FixedApplyOp : public ApplyOp {
 public:
  explicit FixedApplyOp(OpKernelConstruction* ctx) : ApplyOp(ctx, Optimizer::kName) {}
};

class EvictOp : public TableOpKernel {
 public:
  using TableOpKernel::TableOpKernel;
  void ComputeOn(OpKernelContext* ctx, TableResource& table) override {
    int64_t min_step = 0, keep = 0;
    OP_REQUIRES_OK(ctx, Scalar(ctx, 1, "min_step", &min_step));
    OP_REQUIRES_OK(ctx, Scalar(ctx, 2, "keep_top_n", &keep));
    int64_t evicted = 0;
    if (min_step != INT64_MIN) evicted += table.table().EvictOlderThan(min_step);
    if (keep >= 0) evicted += table.table().EvictToTopN(keep);
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = evicted;
  }
};

class StatsOp : public TableOpKernel {
 public:
  using TableOpKernel::TableOpKernel;
  void ComputeOn(OpKernelContext* ctx, TableResource& table) override {
    HashTable& t = table.table();
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({5}), &out));
    auto s = out->flat<int64_t>();
    s(0) = t.Size();
    s(1) = t.admitted();
    s(2) = t.evicted();
    s(3) = t.pending_admission();
    s(4) = t.MemoryBytes();
  }
};

REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableFind").Device(DEVICE_CPU), FindOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableFindOrInsert").Device(DEVICE_CPU), FindOrInsertOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableInsert").Device(DEVICE_CPU), WriteOp<false>);
REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableAccumulate").Device(DEVICE_CPU), WriteOp<true>);
REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableRemove").Device(DEVICE_CPU), RemoveOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableSize").Device(DEVICE_CPU), SizeOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableExport").Device(DEVICE_CPU), ExportOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableImport").Device(DEVICE_CPU), ImportOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableTakeChanged").Device(DEVICE_CPU), TakeChangedOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableApply").Device(DEVICE_CPU), ApplyOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableApplySgd").Device(DEVICE_CPU),
                        FixedApplyOp<SgdOptimizer>);
REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableApplyAdagrad").Device(DEVICE_CPU),
                        FixedApplyOp<AdagradOptimizer>);
REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableApplyAdam").Device(DEVICE_CPU),
                        FixedApplyOp<AdamOptimizer>);
REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableApplyFtrl").Device(DEVICE_CPU),
                        FixedApplyOp<FtrlOptimizer>);
REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableEvict").Device(DEVICE_CPU), EvictOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableStats").Device(DEVICE_CPU), StatsOp);

}  // namespace tfpsx

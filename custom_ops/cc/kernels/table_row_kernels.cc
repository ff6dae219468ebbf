// Kernels that read and write rows by key: find, a cache's find, find-or-insert, insert, accumulate,
// remove, size. The first four split their batch over the CPU worker threads (the core
// table is thread-safe).

#include "custom_ops/cc/core/hash_table.h"
#include "custom_ops/cc/kernels/table_kernel.h"

namespace tfpsx {
namespace {

// Find, and a worker cache's find (kTouch: a present key's frequency counted and its
// step set, from input 2).
template <bool kTouch>
class FindOp : public TableOpKernel {
 public:
  explicit FindOp(OpKernelConstruction* ctx) : TableOpKernel(ctx) {
    if (!kTouch) OP_REQUIRES_OK(ctx, ctx->GetAttr("with_slots", &with_slots_));
  }
  void ComputeOn(OpKernelContext* ctx, TableResource& table) override {
    const Tensor& keys = ctx->input(1);
    OP_REQUIRES(ctx, !kTouch || table.tier() == nullptr,
                absl::InvalidArgumentError(absl::StrCat(
                    "tfpsx table '", table.name(), "' has a disk tier: it cannot be a worker "
                    "cache (a cache holds rows in RAM by design)")));
    int64_t step = 0;
    if (kTouch) OP_REQUIRES_OK(ctx, Scalar(ctx, 2, "step", &step));
    HashTable& t = table.table();
    const int64_t dim = with_slots_ ? t.row_width() : t.dim();
    Tensor* values = nullptr;
    Tensor* found = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, RowsShape(keys.shape(), dim), &values));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, keys.shape(), &found));
    const int64_t* k = keys.flat<int64_t>().data();
    float* v = values->flat<float>().data();
    bool* f = found->flat<bool>().data();
    OP_REQUIRES_OK(ctx, ParallelRanges(ctx, table, keys.NumElements(),
                                       (kTouch ? 30 : 20) + 2 * dim,
                                       [&](int64_t b, int64_t e) {
      if (kTouch) {
        t.CacheFind(k + b, e - b, step, v + b * dim, f + b);
      } else if (with_slots_) {
        t.FindWithSlots(k + b, e - b, v + b * dim, f + b);
      } else {
        t.Find(k + b, e - b, v + b * dim, f + b);
      }
    }));
    // A tiered table's rows on disk are read where they are (the RAM table gave the
    // initial row of each key it does not hold; a key on disk gets its own).
    if (table.tier() != nullptr && ctx->status().ok()) {
      table.tier()->FindOnDisk(k, keys.NumElements(), dim, v, f);
    }
  }

 private:
  bool with_slots_ = false;
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
    OP_REQUIRES_OK(ctx, ForKeyPieces(table, k, keys.NumElements(), [&](int64_t p, int64_t q) {
      return ParallelRanges(ctx, table, q - p, 40 + 2 * dim, [&](int64_t b, int64_t e) {
        t.FindOrInsert(k + p + b, e - b, step, v + (p + b) * dim);
      });
    }));
  }
};

template <bool kAccumulate>
class WriteOp : public TableOpKernel {
 public:
  explicit WriteOp(OpKernelConstruction* ctx) : TableOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("with_slots", &with_slots_));
    if (!kAccumulate) return;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("skip_reader", &skip_reader_));
    std::string combine;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("combine", &combine));
    combine_ = combine == "mean"   ? HashTable::Combine::kMean
             : combine == "scaled" ? HashTable::Combine::kScaled
                                   : HashTable::Combine::kSum;
    OP_REQUIRES(ctx, combine_ == HashTable::Combine::kSum || skip_reader_ >= 0,
                absl::InvalidArgumentError(absl::StrCat(
                    "TfpsxHashTableAccumulate: combine='", combine, "' counts the other "
                    "pushes since the pusher's last take_changed, so it needs the pusher's "
                    "reader as skip_reader (>= 0), got ", skip_reader_)));
    OP_REQUIRES(ctx, !with_slots_ || combine_ == HashTable::Combine::kSum,
                absl::InvalidArgumentError(absl::StrCat(
                    "TfpsxHashTableAccumulate: with_slots adds every delta whole; combine='",
                    combine, "' is not supported with it (expected 'sum')")));
  }
  void ComputeOn(OpKernelContext* ctx, TableResource& table) override {
    const Tensor& keys = ctx->input(1);
    const Tensor& rows = ctx->input(2);
    OP_REQUIRES_OK(ctx, CheckRows(table, keys, rows, kAccumulate ? "deltas" : "values",
                                  with_slots_));
    int64_t step = 0;
    OP_REQUIRES_OK(ctx, Scalar(ctx, 3, "step", &step));
    HashTable& t = table.table();
    const int64_t* k = keys.flat<int64_t>().data();
    const float* r = rows.flat<float>().data();
    const int64_t dim = with_slots_ ? t.row_width() : t.dim();
    OP_REQUIRES_OK(ctx, ForKeyPieces(table, k, keys.NumElements(), [&](int64_t p, int64_t q) {
      return ParallelRanges(ctx, table, q - p, 40 + 2 * dim, [&](int64_t b, int64_t e) {
        const int64_t* kk = k + p + b;
        const float* rr = r + (p + b) * dim;
        if (kAccumulate && with_slots_) {
          t.AccumulateWithSlots(kk, e - b, rr, step, skip_reader_);
        } else if (kAccumulate) {
          t.Accumulate(kk, e - b, rr, step, skip_reader_, combine_);
        } else if (with_slots_) {
          t.InsertWithSlots(kk, e - b, rr, step);
        } else {
          t.Insert(kk, e - b, rr, step);
        }
      });
    }));
  }

 private:
  int64_t skip_reader_ = -1;
  HashTable::Combine combine_ = HashTable::Combine::kSum;
  bool with_slots_ = false;
};

class RemoveOp : public TableOpKernel {
 public:
  using TableOpKernel::TableOpKernel;
  void ComputeOn(OpKernelContext* ctx, TableResource& table) override {
    const Tensor& keys = ctx->input(1);
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    const int64_t* k = keys.flat<int64_t>().data();
    const int64_t n = keys.NumElements();
    // A tiered table removes disk rows where they are (no batch limit, no read back).
    out->scalar<int64_t>()() = table.tier() ? table.tier()->Remove(k, n) : table.table().Remove(k, n);
  }
};

// Not a TableOpKernel: the lock is held only to plan the reads and to place their rows,
// not during the reads (tiered_table.h's Prefetch).
class PrefetchOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<TableResource> table;
    OP_REQUIRES_OK(ctx, GetTable(ctx, &table));
    const Tensor& keys = ctx->input(1);
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = 0;
    TieredTable* tier = table->tier();
    if (tier == nullptr) return;
    TieredTable::Prefetch prefetch;
    {
      std::lock_guard<std::mutex> lock(table->tier_mu());
      OP_REQUIRES_OK(ctx, TierStep(*table, [&] {
        prefetch = tier->PlanPrefetch(keys.flat<int64_t>().data(), keys.NumElements());
      }));
    }
    if (prefetch.keys.empty()) return;
    OP_REQUIRES_OK(ctx, TierStep(*table, [&] { TieredTable::ReadPrefetch(&prefetch); }));
    std::lock_guard<std::mutex> lock(table->tier_mu());
    OP_REQUIRES_OK(ctx, TierStep(*table, [&] {
      out->scalar<int64_t>()() = tier->PlacePrefetch(&prefetch);
      tier->Settle(prefetch.keys.data(), static_cast<int64_t>(prefetch.keys.size()));
    }));
    LogTierWarning(*table);
  }
};

class SizeOp : public TableOpKernel {
 public:
  using TableOpKernel::TableOpKernel;
  void ComputeOn(OpKernelContext* ctx, TableResource& table) override {
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = table.Size();
  }
};

}  // namespace

REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableFind").Device(DEVICE_CPU), FindOp<false>);
REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableCacheFind").Device(DEVICE_CPU), FindOp<true>);
REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableFindOrInsert").Device(DEVICE_CPU), FindOrInsertOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableInsert").Device(DEVICE_CPU), WriteOp<false>);
REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableAccumulate").Device(DEVICE_CPU), WriteOp<true>);
REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableRemove").Device(DEVICE_CPU), RemoveOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxHashTablePrefetch").Device(DEVICE_CPU), PrefetchOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableSize").Device(DEVICE_CPU), SizeOp);

}  // namespace tfpsx

// Kernels over a whole table: export and import (checkpoints, shard moves), the
// incremental checkpoint export, the keys changed per reader (sparse GEO), eviction,
// and stats.

#include <algorithm>
#include <climits>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "custom_ops/cc/core/hash_table.h"
#include "custom_ops/cc/kernels/table_kernel.h"

namespace tfpsx {
namespace {

// Writes keys to output `index` as an int64 vector.
void OutputKeys(OpKernelContext* ctx, int index, const std::vector<int64_t>& keys) {
  Tensor* out = nullptr;
  OP_REQUIRES_OK(ctx, ctx->allocate_output(
                          index, TensorShape({static_cast<int64_t>(keys.size())}), &out));
  std::copy(keys.begin(), keys.end(), out->flat<int64_t>().data());
}

// Writes rows to outputs first..first+4 (keys, values, slots, freq, step).
void OutputRows(OpKernelContext* ctx, const HashTable& t, const ExportedRows& rows, int first) {
  const int64_t n = static_cast<int64_t>(rows.keys.size()), dim = t.dim(),
                slots = t.options().num_slots;
  Tensor* out[5];
  const TensorShape shapes[5] = {TensorShape({n}), TensorShape({n, dim}),
                                 TensorShape({n, slots, dim}), TensorShape({n}),
                                 TensorShape({n})};
  for (int i = 0; i < 5; ++i) {
    OP_REQUIRES_OK(ctx, ctx->allocate_output(first + i, shapes[i], &out[i]));
  }
  std::copy(rows.keys.begin(), rows.keys.end(), out[0]->flat<int64_t>().data());
  std::copy(rows.values.begin(), rows.values.end(), out[1]->flat<float>().data());
  std::copy(rows.slots.begin(), rows.slots.end(), out[2]->flat<float>().data());
  std::copy(rows.freq.begin(), rows.freq.end(), out[3]->flat<int64_t>().data());
  std::copy(rows.step.begin(), rows.step.end(), out[4]->flat<int64_t>().data());
}

class ExportOp : public TableOpKernel {
 public:
  using TableOpKernel::TableOpKernel;
  void ComputeOn(OpKernelContext* ctx, TableResource& table) override {
    int64_t since = 0;
    OP_REQUIRES_OK(ctx, Scalar(ctx, 1, "since_step", &since));
    OutputRows(ctx, table.table(), table.ExportSince(since), 0);
  }
};

// A paged export's bounds (tiered_table.h); `arm`: a paged full checkpoint starts, its
// marks taken as a full CheckpointExport takes them.
class PageBoundsOp : public TableOpKernel {
 public:
  using TableOpKernel::TableOpKernel;
  void ComputeOn(OpKernelContext* ctx, TableResource& table) override {
    int64_t max_rows = 0;
    bool arm = false;
    OP_REQUIRES_OK(ctx, Scalar(ctx, 1, "max_rows", &max_rows));
    OP_REQUIRES_OK(ctx, Scalar(ctx, 2, "arm", &arm));
    OP_REQUIRES(ctx, max_rows >= 0,
                absl::InvalidArgumentError(absl::StrCat(
                    "tfpsx table '", table.name(), "': a page's max_rows must be >= 0 (0: ",
                    "the table's default), got ", max_rows)));
    if (arm) table.ArmTracking();
    OutputKeys(ctx, 0, table.PageBounds(max_rows));
  }
};

class ExportRangeOp : public TableOpKernel {
 public:
  explicit ExportRangeOp(OpKernelConstruction* ctx) : TableOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("delta", &delta_));
  }
  void ComputeOn(OpKernelContext* ctx, TableResource& table) override {
    int64_t lo = 0, hi = 0;
    OP_REQUIRES_OK(ctx, Scalar(ctx, 1, "lo", &lo));
    OP_REQUIRES_OK(ctx, Scalar(ctx, 2, "hi", &hi));
    if (!delta_) {
      OutputRows(ctx, table.table(), table.ExportRange(lo, hi), 0);
      return;
    }
    OP_REQUIRES(ctx, table.tier() != nullptr,
                absl::InvalidArgumentError(absl::StrCat(
                    "tfpsx table '", table.name(), "': a delta in pages needs a disk tier")));
    OutputRows(ctx, table.table(), table.tier()->DeltaRange(lo, hi), 0);
  }

 private:
  bool delta_ = false;
};

// A tiered table's paged delta (tiered_table.h): begin, then its pages.
class DeltaBeginOp : public TableOpKernel {
 public:
  using TableOpKernel::TableOpKernel;
  void ComputeOn(OpKernelContext* ctx, TableResource& table) override {
    int64_t max_rows = 0;
    OP_REQUIRES_OK(ctx, Scalar(ctx, 1, "max_rows", &max_rows));
    OP_REQUIRES(ctx, table.tier() != nullptr && max_rows >= 0,
                absl::InvalidArgumentError(absl::StrCat(
                    "tfpsx table '", table.name(), "': a delta in pages needs a table with ",
                    "a disk tier and max_rows >= 0, got ",
                    table.tier() ? "one" : "a table all in RAM", " and max_rows ", max_rows)));
    const CheckpointRows got = table.tier()->BeginDelta();
    OutputKeys(ctx, 0, got.removed);
    Tensor* complete = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({}), &complete));
    complete->scalar<bool>()() = got.complete;
    OutputKeys(ctx, 2, table.tier()->DeltaBounds(max_rows));
  }
};

class CheckpointExportOp : public TableOpKernel {
 public:
  using TableOpKernel::TableOpKernel;
  void ComputeOn(OpKernelContext* ctx, TableResource& table) override {
    bool full = false;
    OP_REQUIRES_OK(ctx, Scalar(ctx, 1, "full", &full));
    const CheckpointRows got = table.CheckpointExport(full);
    OutputRows(ctx, table.table(), got.rows, 0);
    if (!ctx->status().ok()) return;
    OutputKeys(ctx, 5, got.removed);
    if (!ctx->status().ok()) return;
    Tensor* complete = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(6, TensorShape({}), &complete));
    complete->scalar<bool>()() = got.complete;
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
    // Every input is checked before the table changes (a clear comes first in Import).
    const TensorShape want_slots({n, static_cast<int64_t>(t.options().num_slots), t.dim()});
    OP_REQUIRES(ctx, slots.NumElements() == 0 || slots.shape() == want_slots,
                absl::InvalidArgumentError(absl::StrCat(
                    "tfpsx table '", table.name(), "': import slots must be empty or have shape ",
                    want_slots.DebugString(), " [n, num_slots, dim], got ",
                    slots.shape().DebugString())));
    for (const auto& [tensor, what] : {std::make_pair(&freq, "freq"), std::make_pair(&step, "step")}) {
      OP_REQUIRES(ctx, tensor->NumElements() == 0 || tensor->shape() == TensorShape({n}),
                  absl::InvalidArgumentError(absl::StrCat(
                      "tfpsx table '", table.name(), "': import ", what,
                      " must be empty or have shape [", n, "], got ",
                      tensor->shape().DebugString())));
    }
    std::string problem;
    try {
      problem = table.Import(
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
    OutputKeys(ctx, 0, table.table().TakeChanged(reader));
  }
};
class TakeChangedAmongOp : public TableOpKernel {
 public:
  using TableOpKernel::TableOpKernel;
  void ComputeOn(OpKernelContext* ctx, TableResource& table) override {
    int64_t reader = 0;
    OP_REQUIRES_OK(ctx, Scalar(ctx, 1, "reader", &reader));
    const Tensor& keys = ctx->input(2);
    OP_REQUIRES(ctx, ::tensorflow::TensorShapeUtils::IsVector(keys.shape()),
                absl::InvalidArgumentError(absl::StrCat(
                    "tfpsx table '", table.name(), "': take_changed_among: keys must be a "
                    "vector, got shape ", keys.shape().DebugString())));
    OutputKeys(ctx, 0, table.table().TakeChangedAmong(reader, keys.flat<int64_t>().data(),
                                                      keys.NumElements()));
  }
};
class EvictOp : public TableOpKernel {
 public:
  using TableOpKernel::TableOpKernel;
  void ComputeOn(OpKernelContext* ctx, TableResource& table) override {
    int64_t min_step = 0, keep = 0;
    OP_REQUIRES_OK(ctx, Scalar(ctx, 1, "min_step", &min_step));
    OP_REQUIRES_OK(ctx, Scalar(ctx, 2, "keep_top_n", &keep));
    int64_t evicted = 0;
    if (min_step != INT64_MIN) evicted += table.EvictOlderThan(min_step);
    if (keep >= 0) evicted += table.EvictToTopN(keep);
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = evicted;
  }
};

class CacheVictimsOp : public TableOpKernel {
 public:
  using TableOpKernel::TableOpKernel;
  void ComputeOn(OpKernelContext* ctx, TableResource& table) override {
    int64_t count = 0;
    OP_REQUIRES_OK(ctx, Scalar(ctx, 1, "count", &count));
    bool by_step = false;
    OP_REQUIRES_OK(ctx, Scalar(ctx, 2, "by_step", &by_step));
    OP_REQUIRES(ctx, table.tier() == nullptr,
                absl::InvalidArgumentError(absl::StrCat(
                    "tfpsx table '", table.name(), "' has a disk tier: it cannot be a worker "
                    "cache (a cache holds rows in RAM by design)")));
    const std::vector<int64_t> keys = table.table().CacheVictims(count, by_step);
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
        0, TensorShape({static_cast<int64_t>(keys.size())}), &out));
    std::copy(keys.begin(), keys.end(), out->flat<int64_t>().data());
  }
};

class StatsOp : public TableOpKernel {
 public:
  using TableOpKernel::TableOpKernel;
  void ComputeOn(OpKernelContext* ctx, TableResource& table) override {
    HashTable& t = table.table();
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({6}), &out));
    auto s = out->flat<int64_t>();
    s(0) = table.Size();
    s(1) = t.admitted();
    s(2) = table.evicted();
    s(3) = t.pending_admission();
    // A tiered table: what counts against its RAM budget (tiered_table.h), both.
    s(4) = table.tier() ? table.tier()->RamBytes() : t.UsedBytes();
    s(5) = table.tier() ? table.tier()->RamBytes() : t.ReservedBytes();
  }
};

// A tiered table's disk tier: see TfpsxHashTableTierStats; zeros for a table in RAM.
class TierStatsOp : public TableOpKernel {
 public:
  using TableOpKernel::TableOpKernel;
  void ComputeOn(OpKernelContext* ctx, TableResource& table) override {
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({kTierStats}), &out));
    auto s = out->flat<int64_t>();
    for (int i = 0; i < kTierStats; ++i) s(i) = 0;
    if (table.tier() == nullptr) return;
    const TierStats t = table.tier()->Stats();
    const int64_t values[kTierStats] = {t.ram_bytes,     t.disk_rows,    t.disk_bytes,
                                        t.bytes_written, t.bytes_spilled, t.bytes_read,
                                        t.read_calls,    t.rows_spilled, t.rows_faulted,
                                        t.segments,      t.index_bytes};
    for (int i = 0; i < kTierStats; ++i) s(i) = values[i];
  }

 private:
  static constexpr int kTierStats = 11;
};

}  // namespace

REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableExport").Device(DEVICE_CPU), ExportOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableImport").Device(DEVICE_CPU), ImportOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxHashTablePageBounds").Device(DEVICE_CPU), PageBoundsOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableExportRange").Device(DEVICE_CPU), ExportRangeOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableDeltaBegin").Device(DEVICE_CPU), DeltaBeginOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableCheckpointExport").Device(DEVICE_CPU),
                        CheckpointExportOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableTakeChanged").Device(DEVICE_CPU), TakeChangedOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableTakeChangedAmong").Device(DEVICE_CPU),
                        TakeChangedAmongOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableEvict").Device(DEVICE_CPU), EvictOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableCacheVictims").Device(DEVICE_CPU), CacheVictimsOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableStats").Device(DEVICE_CPU), StatsOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableTierStats").Device(DEVICE_CPU), TierStatsOp);

}  // namespace tfpsx

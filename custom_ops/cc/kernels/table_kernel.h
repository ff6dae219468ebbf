// What every kernel over a tfpsx table shares: the base class that looks the table up
// from input 0, input checks whose messages name the table, the expected shape and the
// one given, and the split of a batch over the CPU worker threads.

#ifndef TFPSX_KERNELS_TABLE_KERNEL_H_
#define TFPSX_KERNELS_TABLE_KERNEL_H_

#include <algorithm>
#include <exception>
#include <mutex>
#include <stdexcept>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "custom_ops/cc/kernels/scalar_input.h"
#include "custom_ops/cc/kernels/table_resource.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/platform/logging.h"
#include "tensorflow/core/util/work_sharder.h"

namespace tfpsx {

using ::tensorflow::DEVICE_CPU;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;

inline absl::Status GetTable(OpKernelContext* ctx, ::tensorflow::core::RefCountPtr<TableResource>* out) {
  return ::tensorflow::LookupResource(ctx, ::tensorflow::HandleFromInput(ctx, 0), out);
}

inline TensorShape RowsShape(const TensorShape& keys, int64_t dim) {
  TensorShape shape = keys;
  shape.AddDim(dim);
  return shape;
}

inline absl::Status CheckRows(const TableResource& table, const Tensor& keys, const Tensor& rows,
                              const char* what, bool with_slots = false) {
  const HashTable& t = table.table();
  const int64_t dim = with_slots ? t.row_width() : t.dim();
  const TensorShape want = RowsShape(keys.shape(), dim);
  if (rows.shape() != want) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tfpsx table '", table.name(), "': ", what, " must have shape ", want.DebugString(),
        with_slots ? absl::StrCat(" (keys' shape + [dim * (1 + num_slots) = ", t.dim(),
                                  " * ", 1 + t.options().num_slots, "]), got ")
                   : absl::StrCat(" (keys' shape + [dim=", dim, "]), got "),
        rows.shape().DebugString()));
  }
  return absl::OkStatus();
}

// Splits [0, n) over the CPU worker threads; each range is processed independently
// (the core table is thread-safe). The core reports a full table by throwing; that must
// not escape into TF's thread pool, so the first failure becomes the op's error.
template <typename Fn>
inline absl::Status ParallelRanges(OpKernelContext* ctx, const TableResource& table, int64_t n,
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


// A disk tier's failure as an op's error, naming the table: an I/O error (a full disk:
// the rows being moved stay in RAM), or a batch too large for its RAM budget.
template <typename Fn>
inline absl::Status TierStep(const TableResource& table, Fn&& fn) {
  try {
    fn();
  } catch (const std::length_error& e) {
    return absl::ResourceExhaustedError(
        absl::StrCat("tfpsx tiered table '", table.name(), "': ", e.what()));
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("tfpsx tiered table '", table.name(), "' at ",
                                               table.tier()->options().directory, ": ",
                                               e.what()));
  }
  return absl::OkStatus();
}

// Logs the tier's warning (RAM over budget), once, naming the table; under its lock.
inline void LogTierWarning(TableResource& table) {
  const std::string warning = table.tier()->TakeWarning();
  if (!warning.empty()) LOG(WARNING) << "tfpsx tiered table '" << table.name() << "': " << warning;
}

// Runs fn(begin, end) (an absl::Status) over [0, n) of an op's keys. On a tiered table,
// in pieces whose rows fit in RAM above its high-water mark, each piece's disk rows
// brought back first and rows moved out after it: a batch of any size (a GEO round's
// push of K batches' rows) within the RAM budget. Element-wise ops only: a key's result
// must not depend on the other keys of its batch.
template <typename Fn>
inline absl::Status ForKeyPieces(TableResource& table, const int64_t* keys, int64_t n, Fn&& fn) {
  TieredTable* tier = table.tier();
  if (tier == nullptr) return fn(int64_t{0}, n);
  const int64_t piece = tier->KeysPerPiece();
  for (int64_t begin = 0; begin < n; begin += piece) {
    const int64_t end = std::min(n, begin + piece);
    absl::Status status = TierStep(table, [&] { tier->FaultIn(keys + begin, end - begin); });
    if (status.ok()) status = fn(begin, end);
    if (status.ok()) status = TierStep(table, [&] { tier->Settle(keys + begin, end - begin); });
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

// Base of the kernels that work on a table: input 0 is its handle. On a tiered table the
// kernel runs under the tier's lock (rows cannot leave RAM between their return from
// disk and their use), and rows move to disk after it when RAM is over its mark; kernels
// over keys go through ForKeyPieces.
class TableOpKernel : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) final {
    ::tensorflow::core::RefCountPtr<TableResource> table;
    OP_REQUIRES_OK(ctx, GetTable(ctx, &table));
    TieredTable* tier = table->tier();
    if (tier == nullptr) {
      ComputeOn(ctx, *table);
      return;
    }
    std::lock_guard<std::mutex> lock(table->tier_mu());
    // The tier's whole-table operations read the disk: an I/O error is the op's error.
    OP_REQUIRES_OK(ctx, TierStep(*table, [&] { ComputeOn(ctx, *table); }));
    if (!ctx->status().ok()) return;
    OP_REQUIRES_OK(ctx, TierStep(*table, [&] { tier->Settle(); }));
    LogTierWarning(*table);
  }

 protected:
  virtual void ComputeOn(OpKernelContext* ctx, TableResource& table) = 0;
};

}  // namespace tfpsx

#endif  // TFPSX_KERNELS_TABLE_KERNEL_H_

// The TF resource that holds one tfpsx table on a device (a PS task), shared by every
// client that names the same shared_name there. The kernels over it are in
// table_*_kernels.cc; the table itself is the TF-free core (core/hash_table.h), and a
// table larger than RAM adds its disk tier (core/tiered_table.h). The whole-table
// operations below go to the tier when there is one, else to the RAM table.

#ifndef TFPSX_KERNELS_TABLE_RESOURCE_H_
#define TFPSX_KERNELS_TABLE_RESOURCE_H_

#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "custom_ops/cc/core/hash_table.h"
#include "custom_ops/cc/core/tiered_table.h"
#include "tensorflow/core/framework/resource_base.h"

namespace tfpsx {

class TableResource : public ::tensorflow::ResourceBase {
 public:
  // The table is built before the resource: a HashTable constructor that throws (a
  // capacity the process cannot reserve) must not unwind a RefCounted (TF 2.16 aborts on
  // destroying one whose count is still 1). `tier` (may be null) works over `table`.
  TableResource(const std::string& name, std::unique_ptr<HashTable> table,
                std::unique_ptr<TieredTable> tier = nullptr)
      : name_(name), table_(std::move(table)), tier_(std::move(tier)) {}
  // TF may ask these from any thread: a tier's figures are read under its lock, or the
  // RAM table's when an operation holds it (never a wait, never a torn read).
  std::string DebugString() const override {
    std::unique_lock<std::mutex> lock(tier_mu_, std::try_to_lock);
    const bool whole = tier_ && lock.owns_lock();
    return absl::StrCat("TfpsxHashTable(", name_, ", dim=", table_->dim(),
                        ", size=", whole ? tier_->Size() : table_->Size(),
                        tier_ ? absl::StrCat(", tiered at ", tier_->options().directory) : "",
                        ")");
  }
  int64_t MemoryUsed() const override {
    std::unique_lock<std::mutex> lock(tier_mu_, std::try_to_lock);
    return tier_ && lock.owns_lock() ? tier_->RamBytes() : table_->ReservedBytes();
  }
  HashTable& table() { return *table_; }
  const HashTable& table() const { return *table_; }
  const std::string& name() const { return name_; }

  // The disk tier, or null for a table all in RAM. Its operations (and every operation
  // on a tiered table: table_kernel.h) run under tier_mu().
  TieredTable* tier() { return tier_.get(); }
  const TieredTable* tier() const { return tier_.get(); }
  std::mutex& tier_mu() { return tier_mu_; }

  int64_t Size() const { return tier_ ? tier_->Size() : table_->Size(); }
  ExportedRows ExportSince(int64_t since) {
    return tier_ ? tier_->ExportSince(since) : table_->ExportSince(since);
  }
  CheckpointRows CheckpointExport(bool full) {
    return tier_ ? tier_->CheckpointExport(full) : table_->CheckpointExport(full);
  }
  // A paged export (tiered_table.h); a table all in RAM is one page.
  std::vector<int64_t> PageBounds(int64_t max_rows) const {
    return tier_ ? tier_->PageBounds(max_rows) : std::vector<int64_t>{};
  }
  ExportedRows ExportRange(int64_t lo, int64_t hi) {
    return tier_ ? tier_->ExportRange(lo, hi) : table_->ExportRange(lo, hi);
  }
  void ArmTracking() {
    if (tier_) {
      tier_->ArmTracking();
    } else {
      table_->ArmTracking();
    }
  }
  std::string Import(const int64_t* keys, int64_t n, const float* values, const float* slots,
                     int64_t slots_len, const int64_t* freq, const int64_t* step, bool clear) {
    return tier_ ? tier_->Import(keys, n, values, slots, slots_len, freq, step, clear)
                 : table_->Import(keys, n, values, slots, slots_len, freq, step, clear);
  }
  int64_t EvictOlderThan(int64_t min_step) {
    return tier_ ? tier_->EvictOlderThan(min_step) : table_->EvictOlderThan(min_step);
  }
  int64_t EvictToTopN(int64_t keep) {
    return tier_ ? tier_->EvictToTopN(keep) : table_->EvictToTopN(keep);
  }
  int64_t evicted() const { return table_->evicted() + (tier_ ? tier_->evicted() : 0); }

 private:
  std::string name_;
  std::unique_ptr<HashTable> table_;
  std::unique_ptr<TieredTable> tier_;  // after table_: destroyed before it
  mutable std::mutex tier_mu_;
};

}  // namespace tfpsx

#endif  // TFPSX_KERNELS_TABLE_RESOURCE_H_

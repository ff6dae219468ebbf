// The TF resource that holds one tfpsx table on a device (a PS task), shared by every
// client that names the same shared_name there. The kernels over it are in
// table_*_kernels.cc; the table itself is the TF-free core (core/hash_table.h).

#ifndef TFPSX_KERNELS_TABLE_RESOURCE_H_
#define TFPSX_KERNELS_TABLE_RESOURCE_H_

#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "custom_ops/cc/core/hash_table.h"
#include "tensorflow/core/framework/resource_base.h"

namespace tfpsx {

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
  int64_t MemoryUsed() const override { return table_->ReservedBytes(); }
  HashTable& table() { return *table_; }
  const HashTable& table() const { return *table_; }
  const std::string& name() const { return name_; }

 private:
  std::string name_;
  std::unique_ptr<HashTable> table_;
};

}  // namespace tfpsx

#endif  // TFPSX_KERNELS_TABLE_RESOURCE_H_

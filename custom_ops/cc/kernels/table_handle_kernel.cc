// The kernel that creates or finds a tfpsx table (TfpsxHashTableHandleOp).

#include <exception>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "custom_ops/cc/core/hash_table.h"
#include "custom_ops/cc/core/tiered_table.h"
#include "custom_ops/cc/kernels/table_resource.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace tfpsx {
namespace {

using ::tensorflow::DEVICE_CPU;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;

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
    OP_REQUIRES_OK(ctx, ctx->GetAttr("tier_directory", &tier_.directory));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("tier_ram_bytes", &tier_.ram_bytes));
    if (!tier_.directory.empty()) {
      // The shard's own folder, named by its table and part ("user/part_0").
      OP_REQUIRES(ctx, name_.find("..") == std::string::npos && name_[0] != '/',
                  absl::InvalidArgumentError(absl::StrCat(
                      "tfpsx table '", name_, "': a tiered table's shared_name names its "
                      "folder under tier_directory; it must be a relative path without '..'")));
      tier_.directory = absl::StrCat(tier_.directory, "/", name_);
      // Fewer lock stripes: each keeps a partly filled chunk of rows in RAM, which the
      // budget pays for (TieredTable::MinRamBytes).
      options_.num_stripes = 16;
    }
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
                              std::unique_ptr<TieredTable> tier;
                              if (!tier_.directory.empty()) {
                                try {
                                  tier = std::make_unique<TieredTable>(t.get(), tier_);
                                  tier->Open();
                                } catch (const std::invalid_argument& e) {
                                  return absl::InvalidArgumentError(absl::StrCat(
                                      "tfpsx tiered table '", name_, "': ", e.what()));
                                } catch (const std::exception& e) {
                                  return absl::FailedPreconditionError(absl::StrCat(
                                      "tfpsx tiered table '", name_, "': ", e.what()));
                                }
                              }
                              *out = new TableResource(name_, std::move(t), std::move(tier));
                              return absl::OkStatus();
                            }));
    ::tensorflow::core::ScopedUnref unref(table);
    const TableOptions& have = table->table().options();
    const std::string have_dir = table->tier() ? table->tier()->options().directory : "";
    OP_REQUIRES(ctx, have_dir == tier_.directory,
                absl::InvalidArgumentError(absl::StrCat(
                    "tfpsx table '", name_, "' already exists on this device ",
                    have_dir.empty() ? "in RAM" : absl::StrCat("tiered at ", have_dir),
                    "; it was asked for again ",
                    tier_.directory.empty() ? "in RAM"
                                            : absl::StrCat("tiered at ", tier_.directory))));
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
  TierOptions tier_;
};

}  // namespace

REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableHandleOp").Device(DEVICE_CPU), HashTableHandleOp);

}  // namespace tfpsx

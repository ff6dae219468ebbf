// The optimizer kernel: TfpsxHashTableApply runs any optimizer of the registry
// (core/optimizer_registry.h) by name, and the per-optimizer ops it replaced are the same
// kernel with the optimizer fixed.

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "custom_ops/cc/core/hash_table.h"
#include "custom_ops/cc/core/optimizer_registry.h"
#include "custom_ops/cc/core/optimizers.h"
#include "custom_ops/cc/kernels/table_kernel.h"

namespace tfpsx {
namespace {

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
    OP_REQUIRES_OK(ctx, ForKeyPieces(table, k, n, [&](int64_t p, int64_t q) {
      return ParallelRanges(ctx, table, q - p, 60 + 8 * dim, [&](int64_t b, int64_t e) {
        opt.apply(t, k + p + b, e - b, g + (p + b) * dim, hparams.data(), step);
      });
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

// TfpsxOptimizerRegistry: the registry, for the Python specs to be checked against.
class OptimizerRegistryOp : public ::tensorflow::OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    const std::vector<OptimizerInfo>& all = Optimizers();
    const ::tensorflow::TensorShape shape({static_cast<int64_t>(all.size())});
    ::tensorflow::Tensor *names, *slots, *hparams;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &names));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, shape, &slots));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, shape, &hparams));
    for (size_t i = 0; i < all.size(); ++i) {
      names->vec<::tensorflow::tstring>()(i) = all[i].name;
      slots->vec<int32_t>()(i) = all[i].num_slots;
      std::string joined;
      for (const std::string& h : all[i].hparam_names) joined += (joined.empty() ? "" : ",") + h;
      hparams->vec<::tensorflow::tstring>()(i) = joined;
    }
  }
};

}  // namespace

REGISTER_KERNEL_BUILDER(Name("TfpsxOptimizerRegistry").Device(DEVICE_CPU), OptimizerRegistryOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableApply").Device(DEVICE_CPU), ApplyOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableApplySgd").Device(DEVICE_CPU),
                        FixedApplyOp<SgdOptimizer>);
REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableApplyAdagrad").Device(DEVICE_CPU),
                        FixedApplyOp<AdagradOptimizer>);
REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableApplyAdam").Device(DEVICE_CPU),
                        FixedApplyOp<AdamOptimizer>);
REGISTER_KERNEL_BUILDER(Name("TfpsxHashTableApplyFtrl").Device(DEVICE_CPU),
                        FixedApplyOp<FtrlOptimizer>);

}  // namespace tfpsx

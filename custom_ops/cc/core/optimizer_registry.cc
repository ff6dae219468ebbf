#include "custom_ops/cc/core/optimizer_registry.h"

#include <iterator>

#include "custom_ops/cc/core/apply_rows_functor.h"
#include "custom_ops/cc/core/optimizers.h"

namespace tfpsx {
namespace {

template <typename Optimizer>
OptimizerInfo InfoOf() {
  return OptimizerInfo{Optimizer::kName, Optimizer::kSlots,
                       {std::begin(Optimizer::kHparams), std::end(Optimizer::kHparams)},
                       &ApplyToTable<Optimizer>};
}

std::string Join(const std::vector<std::string>& parts) {
  std::string out;
  for (const std::string& p : parts) out += (out.empty() ? "" : ", ") + p;
  return out;
}

}  // namespace

std::string OptimizerInfo::HparamList() const { return "[" + Join(hparam_names) + "]"; }

const std::vector<OptimizerInfo>& Optimizers() {
#define TFPSX_OPTIMIZER_INFO(Optimizer) InfoOf<Optimizer>(),
  static const auto* all = new std::vector<OptimizerInfo>{
      TFPSX_FOR_EACH_OPTIMIZER(TFPSX_OPTIMIZER_INFO)};
#undef TFPSX_OPTIMIZER_INFO
  return *all;
}

const OptimizerInfo* FindOptimizer(const std::string& name) {
  for (const OptimizerInfo& info : Optimizers()) {
    if (info.name == name) return &info;
  }
  return nullptr;
}

std::string OptimizerNames() {
  std::vector<std::string> names;
  for (const OptimizerInfo& info : Optimizers()) names.push_back(info.name);
  return Join(names);
}

}  // namespace tfpsx

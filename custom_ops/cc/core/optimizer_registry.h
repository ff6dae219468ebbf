// Server-side optimizers by name: what a caller (the TfpsxHashTableApply kernel, a test)
// needs to validate a request and run it. Entries come from TFPSX_FOR_EACH_OPTIMIZER
// (optimizers.h), so an optimizer is registered by its one line there.

#ifndef TFPSX_CORE_OPTIMIZER_REGISTRY_H_
#define TFPSX_CORE_OPTIMIZER_REGISTRY_H_

#include <cstdint>
#include <string>
#include <vector>

namespace tfpsx {

class HashTable;

struct OptimizerInfo {
  std::string name;
  int num_slots;                          // slot vectors beside each row's value
  std::vector<std::string> hparam_names;  // the order `hparams` lists them in
  // Applies grads[n * dim] to the rows of keys[n] (expected unique) of a table with
  // num_slots slots; hparams holds hparam_names.size() values. Throws like the table's
  // writes (std::length_error for a full stripe).
  void (*apply)(HashTable& table, const int64_t* keys, int64_t n, const float* grads,
                const float* hparams, int64_t step);

  // "[learning_rate, beta1, beta2, epsilon]", for messages.
  std::string HparamList() const;
};

// The optimizer registered as `name`, or null.
const OptimizerInfo* FindOptimizer(const std::string& name);

// Every registered optimizer, in registration order.
const std::vector<OptimizerInfo>& Optimizers();

// "sgd, adagrad, adam, ftrl", for messages.
std::string OptimizerNames();

}  // namespace tfpsx

#endif  // TFPSX_CORE_OPTIMIZER_REGISTRY_H_

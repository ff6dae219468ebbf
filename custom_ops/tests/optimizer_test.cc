// Native tests of the optimizer registry and the CPU row applier: g++, no TensorFlow.
// The registry path must give bit-identical rows to the per-optimizer code it replaced
// (HashTable::ApplySgd/Adagrad/Adam/Ftrl, kept below as the reference), so that models
// trained before and after the change, and TF's own optimizers the Python tests compare
// with, agree exactly.

#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "custom_ops/cc/core/apply_rows_functor.h"
#include "custom_ops/cc/core/hash_table.h"
#include "custom_ops/cc/core/optimizer_registry.h"
#include "custom_ops/cc/core/optimizers.h"
#include "custom_ops/tests/check.h"

namespace {

using tfpsx_test::failures;

// The row math of HashTable::ApplySgd/Adagrad/Adam/Ftrl before the registry (7f9f7fc),
// on one row [value | slots]; h holds the hyperparameters in registry order.
void LegacyUpdate(const std::string& opt, float* row, const float* g, int64_t dim,
                  const float* h, int64_t step) {
  if (opt == "sgd") {
    const float lr = h[0];
    for (int64_t j = 0; j < dim; ++j) row[j] -= lr * g[j];
  } else if (opt == "adagrad") {
    const float lr = h[0], eps = h[1];
    float* acc = row + dim;
    for (int64_t j = 0; j < dim; ++j) {
      acc[j] += g[j] * g[j];
      row[j] -= lr * g[j] / (std::sqrt(acc[j]) + eps);
    }
  } else if (opt == "adam") {
    const float lr = h[0], beta1 = h[1], beta2 = h[2], eps = h[3];
    const double t = static_cast<double>(std::max<int64_t>(step, 1));
    const float lr_t = static_cast<float>(lr * std::sqrt(1.0 - std::pow(beta2, t)) /
                                          (1.0 - std::pow(beta1, t)));
    float* m = row + dim;
    float* v = row + 2 * dim;
    for (int64_t j = 0; j < dim; ++j) {
      m[j] = beta1 * m[j] + (1 - beta1) * g[j];
      v[j] = beta2 * v[j] + (1 - beta2) * g[j] * g[j];
      row[j] -= lr_t * m[j] / (std::sqrt(v[j]) + eps);
    }
  } else if (opt == "ftrl") {
    const float lr = h[0], lr_power = h[1], l1 = h[2], l2 = h[3];
    float* z = row + dim;
    float* acc = row + 2 * dim;
    for (int64_t j = 0; j < dim; ++j) {
      const float new_acc = acc[j] + g[j] * g[j];
      const float sigma = (std::pow(new_acc, -lr_power) - std::pow(acc[j], -lr_power)) / lr;
      z[j] += g[j] - sigma * row[j];
      acc[j] = new_acc;
      if (std::fabs(z[j]) <= l1) {
        row[j] = 0.f;
      } else {
        const float sign = z[j] > 0 ? 1.f : -1.f;
        row[j] = -(z[j] - sign * l1) / (std::pow(new_acc, -lr_power) / lr + 2 * l2);
      }
    }
  } else {
    std::fprintf(stderr, "no legacy reference for optimizer '%s'\n", opt.c_str());
    ++failures;
  }
}

std::vector<float> HparamsFor(const std::string& opt, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(0.f, 1.f);
  if (opt == "sgd") return {0.01f + 0.5f * u(rng)};
  if (opt == "adagrad") return {0.01f + 0.5f * u(rng), 1e-7f * u(rng)};
  if (opt == "adam") {
    return {0.001f + 0.05f * u(rng), 0.8f + 0.19f * u(rng), 0.99f + 0.009f * u(rng),
            1e-7f + 1e-3f * u(rng)};
  }
  return {0.01f + 0.2f * u(rng), -0.9f * u(rng), 0.05f * u(rng), 0.05f * u(rng)};  // ftrl
}

bool SameBits(const float* a, const float* b, size_t n) {
  return n == 0 || std::memcmp(a, b, n * sizeof(float)) == 0;  // memcmp wants non-null
}

// Random batches of unique keys (new and known ones) through the registry and through the
// legacy math on a reference map: every value and slot must be bit-identical.
void TestRegistryEqualsLegacyOnRandomData() {
  for (const tfpsx::OptimizerInfo& info : tfpsx::Optimizers()) {
    for (int64_t dim : {1, 7, 16}) {
      std::mt19937_64 rng(dim * 1000 + info.num_slots);
      tfpsx::TableOptions o;
      o.dim = dim;
      o.num_slots = info.num_slots;
      for (int k = 0; k < info.num_slots; ++k) o.slot_init.push_back(0.05f * (k + 1));
      o.init = tfpsx::InitKind::kNormal;
      o.init_b = 0.2f;
      o.seed = 11;
      tfpsx::HashTable table(o);
      const int64_t width = dim * (1 + info.num_slots);
      std::map<int64_t, std::vector<float>> ref;
      std::normal_distribution<float> normal(0.f, 1.f);
      for (int64_t step = 0; step < 25; ++step) {
        std::vector<int64_t> keys;
        for (int64_t k = -300; k < 300; ++k) {
          if (rng() % 4 == 0) keys.push_back(k * 7 + step % 3);
        }
        std::vector<float> grads(keys.size() * dim);
        for (float& x : grads) x = normal(rng);
        const std::vector<float> h = HparamsFor(info.name, rng);
        CHECK(h.size() == info.hparam_names.size());
        info.apply(table, keys.data(), static_cast<int64_t>(keys.size()), grads.data(), h.data(),
                   step);
        for (size_t i = 0; i < keys.size(); ++i) {
          auto it = ref.find(keys[i]);
          if (it == ref.end()) {
            std::vector<float> row(width);
            table.InitialRow(keys[i], row.data());
            for (int k = 0; k < info.num_slots; ++k)
              std::fill(row.begin() + (k + 1) * dim, row.begin() + (k + 2) * dim, o.slot_init[k]);
            it = ref.emplace(keys[i], row).first;
          }
          LegacyUpdate(info.name, it->second.data(), grads.data() + i * dim, dim, h.data(), step);
        }
      }
      const tfpsx::ExportedRows e = table.Export();
      CHECK(e.keys.size() == ref.size());
      size_t i = 0, mismatched = 0;
      for (const auto& [key, row] : ref) {  // sorted like the export
        if (i >= e.keys.size()) break;
        const bool same =
            e.keys[i] == key && SameBits(e.values.data() + i * dim, row.data(), dim) &&
            SameBits(e.slots.data() + i * info.num_slots * dim, row.data() + dim,
                     info.num_slots * dim);
        mismatched += !same;
        ++i;
      }
      if (mismatched) {
        std::fprintf(stderr, "%s dim=%lld: %zu of %zu rows differ from the legacy math\n",
                     info.name.c_str(), static_cast<long long>(dim), mismatched, ref.size());
      }
      CHECK(mismatched == 0);
    }
  }
}

// The registry is what TfpsxHashTableApply validates against and what the Python side
// calls by: names, slot counts and hyperparameter orders are part of the op's interface.
void TestRegistryInterface() {
  CHECK(tfpsx::OptimizerNames() == "sgd, adagrad, adam, ftrl");
  const tfpsx::OptimizerInfo* adam = tfpsx::FindOptimizer("adam");
  CHECK(adam != nullptr && adam->num_slots == 2 &&
        adam->HparamList() == "[learning_rate, beta1, beta2, epsilon]");
  const tfpsx::OptimizerInfo* ftrl = tfpsx::FindOptimizer("ftrl");
  CHECK(ftrl != nullptr && ftrl->num_slots == 2 && ftrl->HparamList() == "[learning_rate, learning_rate_power, l1, l2]");
  const tfpsx::OptimizerInfo* adagrad = tfpsx::FindOptimizer("adagrad");
  CHECK(adagrad != nullptr && adagrad->num_slots == 1 && adagrad->HparamList() == "[learning_rate, epsilon]");
  const tfpsx::OptimizerInfo* sgd = tfpsx::FindOptimizer("sgd");
  CHECK(sgd != nullptr && sgd->num_slots == 0 && sgd->HparamList() == "[learning_rate]");
  CHECK(tfpsx::FindOptimizer("rmsprop") == nullptr);
  CHECK(tfpsx::FindOptimizer("Adam") == nullptr);  // names are exact
}

// The CPU functor over a block of strided rows (what a GPU table hands the GPU side)
// equals the optimizer applied row by row.
template <typename Optimizer>
void CheckBlockEqualsRows(const std::vector<float>& h) {
  const int64_t dim = 5, n = 37, stride = dim * (1 + Optimizer::kSlots) + 3;
  std::mt19937_64 rng(n);
  std::uniform_real_distribution<float> u(0.01f, 1.f);
  std::vector<float> rows(n * stride), grads(n * dim);
  for (float& x : rows) x = u(rng);
  for (float& x : grads) x = u(rng) - 0.5f;
  std::vector<float> expect = rows;
  const Optimizer opt(h.data(), 3);
  for (int64_t i = 0; i < n; ++i) opt(expect.data() + i * stride, grads.data() + i * dim, dim);
  tfpsx::ApplyRowsFunctor<tfpsx::CpuDevice, Optimizer>()(tfpsx::CpuDevice(), opt, rows.data(),
                                                         stride, grads.data(), n, dim);
  CHECK(SameBits(rows.data(), expect.data(), rows.size()));  // padding untouched too
}

void TestCpuBlockFunctor() {
  CheckBlockEqualsRows<tfpsx::SgdOptimizer>({0.1f});
  CheckBlockEqualsRows<tfpsx::AdagradOptimizer>({0.1f, 1e-7f});
  CheckBlockEqualsRows<tfpsx::AdamOptimizer>({0.01f, 0.9f, 0.999f, 1e-7f});
  CheckBlockEqualsRows<tfpsx::FtrlOptimizer>({0.05f, -0.5f, 0.01f, 0.02f});
}

}  // namespace

int main() {
  TestRegistryEqualsLegacyOnRandomData();
  TestRegistryInterface();
  TestCpuBlockFunctor();
  return tfpsx_test::Finish("optimizer_test");
}

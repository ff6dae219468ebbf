// Server-side optimizers, each one row functor. Adding an optimizer is writing its functor
// here and adding one line to TFPSX_FOR_EACH_OPTIMIZER below: the registry
// (optimizer_registry.h), the TfpsxHashTableApply kernel and the CPU and CUDA row appliers
// (apply_rows_functor.h) all expand that list.
//
// A functor declares
//   kName      the name TfpsxHashTableApply's `optimizer` attr selects it by;
//   kSlots     slot vectors it keeps beside each row's value;
//   kHparams   its hyperparameters' names, in the order the `hparams` input lists them
//              (the Python specs in tfpsx/embedding/optimizers.py are checked against
//              these names, this order and kSlots when the library loads: the registry
//              here is the single source of truth);
// is built on the host once per batch from those hyperparameters and the global step
// (values that depend only on them, such as Adam's bias-corrected rate, are computed
// there), and updates one row in place:
//   operator()(row, grad, dim): row = [value | slot 0 | slot 1 ...], dim floats each.
// The row math is TFPSX_HOST_DEVICE, so the CPU table and a CUDA kernel run the very same
// formulas; it must stay plain data (a kernel takes it by value).

#ifndef TFPSX_CORE_OPTIMIZERS_H_
#define TFPSX_CORE_OPTIMIZERS_H_

#include <math.h>
#include <stdint.h>

#include <algorithm>
#include <cmath>

#include "custom_ops/cc/core/host_device.h"

namespace tfpsx {

struct SgdOptimizer {
  static constexpr const char* kName = "sgd";
  static constexpr int kSlots = 0;
  static constexpr const char* kHparams[] = {"learning_rate"};

  SgdOptimizer(const float* h, int64_t /*step*/) : lr(h[0]) {}

  TFPSX_HOST_DEVICE void operator()(float* row, const float* g, int64_t dim) const {
    for (int64_t j = 0; j < dim; ++j) row[j] -= lr * g[j];
  }

  float lr;
};

// Slot: the accumulator of squared gradients.
struct AdagradOptimizer {
  static constexpr const char* kName = "adagrad";
  static constexpr int kSlots = 1;
  static constexpr const char* kHparams[] = {"learning_rate", "epsilon"};

  AdagradOptimizer(const float* h, int64_t /*step*/) : lr(h[0]), eps(h[1]) {}

  TFPSX_HOST_DEVICE void operator()(float* row, const float* g, int64_t dim) const {
    float* acc = row + dim;
    for (int64_t j = 0; j < dim; ++j) {
      acc[j] += g[j] * g[j];
      row[j] -= lr * g[j] / (sqrtf(acc[j]) + eps);
    }
  }

  float lr, eps;
};

// Lazy Adam as TF applies it to sparse rows: only the rows in the batch move, and the
// bias correction comes from the global step (>= 1). Slots: m, v.
struct AdamOptimizer {
  static constexpr const char* kName = "adam";
  static constexpr int kSlots = 2;
  static constexpr const char* kHparams[] = {"learning_rate", "beta1", "beta2", "epsilon"};

  AdamOptimizer(const float* h, int64_t step) : beta1(h[1]), beta2(h[2]), eps(h[3]) {
    const double t = static_cast<double>(std::max<int64_t>(step, 1));
    lr_t = static_cast<float>(h[0] * std::sqrt(1.0 - std::pow(beta2, t)) /
                              (1.0 - std::pow(beta1, t)));
  }

  TFPSX_HOST_DEVICE void operator()(float* row, const float* g, int64_t dim) const {
    float* m = row + dim;
    float* v = row + 2 * dim;
    for (int64_t j = 0; j < dim; ++j) {
      m[j] = beta1 * m[j] + (1 - beta1) * g[j];
      v[j] = beta2 * v[j] + (1 - beta2) * g[j] * g[j];
      row[j] -= lr_t * m[j] / (sqrtf(v[j]) + eps);
    }
  }

  float beta1, beta2, eps;
  float lr_t;  // the step's bias-corrected learning rate
};

// FTRL-Proximal (McMahan et al. 2013), as tf.compat.v1.train.FtrlOptimizer applies it.
// Slots: z, the accumulator of squared gradients.
struct FtrlOptimizer {
  static constexpr const char* kName = "ftrl";
  static constexpr int kSlots = 2;
  static constexpr const char* kHparams[] = {"learning_rate", "learning_rate_power", "l1", "l2"};

  FtrlOptimizer(const float* h, int64_t /*step*/)
      : lr(h[0]), lr_power(h[1]), l1(h[2]), l2(h[3]) {}

  TFPSX_HOST_DEVICE void operator()(float* row, const float* g, int64_t dim) const {
    float* z = row + dim;
    float* acc = row + 2 * dim;
    for (int64_t j = 0; j < dim; ++j) {
      const float new_acc = acc[j] + g[j] * g[j];
      const float sigma = (powf(new_acc, -lr_power) - powf(acc[j], -lr_power)) / lr;
      z[j] += g[j] - sigma * row[j];
      acc[j] = new_acc;
      if (fabsf(z[j]) <= l1) {
        row[j] = 0.f;
      } else {
        const float sign = z[j] > 0 ? 1.f : -1.f;
        row[j] = -(z[j] - sign * l1) / (powf(new_acc, -lr_power) / lr + 2 * l2);
      }
    }
  }

  float lr, lr_power, l1, l2;
};

// Every optimizer, once: X(Functor) per line.
#define TFPSX_FOR_EACH_OPTIMIZER(X) \
  X(SgdOptimizer)                   \
  X(AdagradOptimizer)               \
  X(AdamOptimizer)                  \
  X(FtrlOptimizer)

}  // namespace tfpsx

#endif  // TFPSX_CORE_OPTIMIZERS_H_

// Per-key math shared by the CPU table and a CUDA table: the key hash and the
// deterministic initial row. A key's initial row is a pure function of (seed, key), so
// every PS, every restart and every device draws the same row.
//
// The C math functions (sqrtf, logf, ...) are used because they exist on both sides; on
// the host they are the very functions std::sqrt(float) etc. call.

#ifndef TFPSX_CORE_INITIALIZER_H_
#define TFPSX_CORE_INITIALIZER_H_

#include <math.h>
#include <stdint.h>

#include "custom_ops/cc/core/host_device.h"

namespace tfpsx {

enum class InitKind { kZeros = 0, kConstant = 1, kUniform = 2, kNormal = 3 };

// splitmix64's finalizer: a fast, well-spread hash.
TFPSX_HOST_DEVICE inline uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// The hash a table places a key by (stripe, index slot, tag).
TFPSX_HOST_DEVICE inline uint64_t HashKey(int64_t key) { return Mix(static_cast<uint64_t>(key)); }

// (0, 1]: safe for log().
TFPSX_HOST_DEVICE inline float Uniform01(uint64_t bits) {
  return (static_cast<float>(bits >> 40) + 1.0f) * (1.0f / 16777216.0f);
}

// How a table draws the row of a key it does not hold. Plain data, so that a CUDA kernel
// can take it by value.
struct RowInitializer {
  InitKind kind = InitKind::kZeros;
  float a = 0.f;  // constant value / uniform low / normal mean
  float b = 0.f;  // uniform high / normal stddev
  uint64_t seed = 0;

  // The initial row of `key` into out[dim].
  TFPSX_HOST_DEVICE void operator()(int64_t key, float* out, int64_t dim) const {
    if (kind == InitKind::kZeros || kind == InitKind::kConstant) {
      const float v = kind == InitKind::kConstant ? a : 0.f;
      for (int64_t j = 0; j < dim; ++j) out[j] = v;
      return;
    }
    const uint64_t base = Mix(seed ^ Mix(static_cast<uint64_t>(key)));
    if (kind == InitKind::kUniform) {
      const float lo = a, span = b - a;
      for (int64_t j = 0; j < dim; ++j)
        out[j] = lo + span * (Uniform01(Mix(base + j)) - 0.5f / 16777216.0f);
      return;
    }
    // Normal: Box-Muller, two values per pair of uniforms.
    for (int64_t j = 0; j < dim; j += 2) {
      const float u1 = Uniform01(Mix(base + 2 * j)), u2 = Uniform01(Mix(base + 2 * j + 1));
      const float radius = sqrtf(-2.f * logf(u1)) * b;
      out[j] = a + radius * cosf(6.2831853071795864f * u2);
      if (j + 1 < dim) out[j + 1] = a + radius * sinf(6.2831853071795864f * u2);
    }
  }
};

}  // namespace tfpsx

#endif  // TFPSX_CORE_INITIALIZER_H_

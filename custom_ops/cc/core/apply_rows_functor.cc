// The CPU side of ApplyRowsFunctor and the CPU table's optimizer step. Both live in this
// one file so that the row functor inlines into the table's stripe loop: the seam between
// table and optimizer costs no call per row.

#include "custom_ops/cc/core/apply_rows_functor.h"

#include "custom_ops/cc/core/hash_table.h"
#include "custom_ops/cc/core/optimizers.h"

namespace tfpsx {

template <typename Optimizer>
void ApplyRowsFunctor<CpuDevice, Optimizer>::operator()(
    const CpuDevice&, const Optimizer& opt, float* rows, int64_t row_stride, const float* grads,
    int64_t n, int64_t dim) const {
  for (int64_t i = 0; i < n; ++i) opt(rows + i * row_stride, grads + i * dim, dim);
}

template <typename Optimizer>
void ApplyToTable(HashTable& table, const int64_t* keys, int64_t n, const float* grads,
                  const float* hparams, int64_t step) {
  const Optimizer opt(hparams, step);
  const int64_t dim = table.dim(), row_width = table.row_width();
  const ApplyRowsFunctor<CpuDevice, Optimizer> apply;
  // Rows are found by key one at a time under their stripe's lock: a block of one row.
  table.ApplyGradients(keys, n, grads, step, [&](float* row, const float* grad) {
    apply(CpuDevice(), opt, row, row_width, grad, 1, dim);
  });
}

#define TFPSX_INSTANTIATE_CPU(Optimizer)                     \
  template struct ApplyRowsFunctor<CpuDevice, Optimizer>;    \
  template void ApplyToTable<Optimizer>(HashTable&, const int64_t*, int64_t, const float*, \
                                        const float*, int64_t);
TFPSX_FOR_EACH_OPTIMIZER(TFPSX_INSTANTIATE_CPU)
#undef TFPSX_INSTANTIATE_CPU

}  // namespace tfpsx

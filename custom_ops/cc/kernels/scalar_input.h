// A kernel's scalar input, checked: the error names the input and the shape given.

#ifndef TFPSX_KERNELS_SCALAR_INPUT_H_
#define TFPSX_KERNELS_SCALAR_INPUT_H_

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace tfpsx {

template <typename T>
inline absl::Status Scalar(::tensorflow::OpKernelContext* ctx, int index, const char* name,
                           T* out) {
  const ::tensorflow::Tensor& t = ctx->input(index);
  if (!::tensorflow::TensorShapeUtils::IsScalar(t.shape())) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " must be a scalar, got shape ", t.shape().DebugString()));
  }
  *out = t.scalar<T>()();
  return absl::OkStatus();
}

}  // namespace tfpsx

#endif  // TFPSX_KERNELS_SCALAR_INPUT_H_

// Shape functions shared by the table op declarations (CPU table, GPU table).

#ifndef TFPSX_CUSTOM_OPS_CC_OPS_SHAPE_FNS_H_
#define TFPSX_CUSTOM_OPS_CC_OPS_SHAPE_FNS_H_

#include "tensorflow/core/framework/shape_inference.h"

namespace tfpsx {
namespace shape_fns {

using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

// Output 0: keys' shape (input 1) + [dim] (dim is an attribute of the table, unknown here).
inline absl::Status RowsLikeKeys(InferenceContext* c) {
  ShapeHandle out;
  TF_RETURN_IF_ERROR(c->Concatenate(c->input(1), c->Vector(InferenceContext::kUnknownDim), &out));
  c->set_output(0, out);
  return absl::OkStatus();
}

// A find: (rows like RowsLikeKeys, found: keys' shape).
inline absl::Status RowsAndFound(InferenceContext* c) {
  TF_RETURN_IF_ERROR(RowsLikeKeys(c));
  c->set_output(1, c->input(1));
  return absl::OkStatus();
}

inline absl::Status NoOutputs(InferenceContext*) { return absl::OkStatus(); }

// Exported rows from output 0 on: keys [n], values [n, dim], slots [n, num_slots, dim],
// freq [n], step [n].
inline absl::Status ExportedRows(InferenceContext* c) {
  const auto n = c->UnknownDim();
  c->set_output(0, c->Vector(n));
  c->set_output(1, c->Matrix(n, c->UnknownDim()));
  c->set_output(2, c->MakeShape({n, c->UnknownDim(), c->UnknownDim()}));
  c->set_output(3, c->Vector(n));
  c->set_output(4, c->Vector(n));
  return absl::OkStatus();
}

}  // namespace shape_fns
}  // namespace tfpsx

#endif  // TFPSX_CUSTOM_OPS_CC_OPS_SHAPE_FNS_H_

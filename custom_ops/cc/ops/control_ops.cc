// Op declarations for the tfpsx control plane: a shared counter / member-set
// resource that lives on a parameter server. Workers mark themselves started
// and stopped on PS 0 so that run_server() can return when the job is done,
// and use the counter for barriers and heartbeats when no scheduler runs.
//
// Op names carry the fixed "Tfpsx" prefix: renaming an op breaks saved graphs.

#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tfpsx {

using ::tensorflow::shape_inference::InferenceContext;

REGISTER_OP("TfpsxCounterHandleOp")
    .Output("handle: resource")
    .Attr("container: string = ''")
    .Attr("shared_name: string = ''")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape)
    .Doc(R"doc(
A handle to a tfpsx counter: an int64 value plus a set of distinct int64
members. Created on first use on the device the op is placed on; every client
that names the same shared_name on that device reaches the same counter.
)doc");

REGISTER_OP("TfpsxCounterAdd")
    .SetIsStateful()
    .Input("handle: resource")
    .Input("delta: int64")
    .Output("value: int64")
    .SetShapeFn([](InferenceContext* c) {
      ::tensorflow::shape_inference::ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 0, &unused));
      c->set_output(0, c->Scalar());
      return absl::OkStatus();
    })
    .Doc("Adds `delta` to the counter and returns the new value.");

REGISTER_OP("TfpsxCounterRead")
    .SetIsStateful()
    .Input("handle: resource")
    .Output("value: int64")
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape)
    .Doc("Returns the counter's current value.");

REGISTER_OP("TfpsxCounterMark")
    .SetIsStateful()
    .Input("handle: resource")
    .Input("member: int64")
    .Output("count: int64")
    .SetShapeFn([](InferenceContext* c) {
      ::tensorflow::shape_inference::ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 0, &unused));
      c->set_output(0, c->Scalar());
      return absl::OkStatus();
    })
    .Doc(R"doc(
Adds `member` (>= 0) to the counter's member set and returns how many distinct
members it holds. Marking the same member twice counts it once, so a client
that retries after a lost reply does not count twice.
)doc");

REGISTER_OP("TfpsxCounterMembers")
    .SetIsStateful()
    .Input("handle: resource")
    .Output("members: int64")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(InferenceContext::kUnknownDim));
      return absl::OkStatus();
    })
    .Doc("Returns the counter's members, sorted ascending.");

}  // namespace tfpsx

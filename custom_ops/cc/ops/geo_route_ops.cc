// Op declarations of GEO's row routing on a worker (tfpsx/modes/geo/hot_rows.py): a
// table whose rounds the job chooses for (geo_table_choice="auto") reads and trains its
// hot rows on the PS and the rest in this worker's copy, or, while it trains async,
// every row on the PS. These ops split a batch's keys (and rows) by a flag and a hot
// mask, and stitch the rows back, in place of TF1 conds: while the flag is on they
// forward their input (no copy) and give empty tails, so a step of a table that trains
// async runs a few ops more than async's, where the conds' Switch / Merge and dead
// branches ran 35 (benchmarks/geo_step_ops.py).
//
// Op names carry the fixed "Tfpsx" prefix: renaming an op breaks saved graphs.

#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tfpsx {

using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

namespace {

// Rows of unknown count with the width of `rows` (its dims after the first).
absl::Status RowsLike(InferenceContext* c, int input, int output) {
  ShapeHandle rows, tail, out;
  TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(input), 1, &rows));
  TF_RETURN_IF_ERROR(c->Subshape(rows, 1, &tail));
  TF_RETURN_IF_ERROR(c->Concatenate(c->Vector(InferenceContext::kUnknownDim), tail, &out));
  c->set_output(output, out);
  return absl::OkStatus();
}

}  // namespace

REGISTER_OP("TfpsxGeoSplitKeys")
    .Input("on_ps: bool")
    .Input("keys: int64")
    .Input("hot: bool")
    .Output("hot_out: bool")
    .Output("ps_keys: int64")
    .Output("tail_keys: int64")
    .Output("at_hot: int32")
    .Output("at_tail: int32")
    .Output("held: int64")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused, keys;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 0, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &keys));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &unused));
      c->set_output(0, keys);
      for (int i = 1; i < 5; ++i) c->set_output(i, c->Vector(InferenceContext::kUnknownDim));
      c->set_output(5, c->Vector(2));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Splits unique `keys` into those read on the PS and those read in the worker's copy.
With `on_ps`: every key is the PS's (`ps_keys` is `keys`, not a copy), `hot_out` all
true, the tails and both positions empty, and `hot` is not read (it may be empty).
Else `hot` (one per key, or empty: none) says which keys are the PS's: `ps_keys` and
`tail_keys` in the keys' order, `at_hot` and `at_tail` their positions in `keys`,
`hot_out` is `hot` (all false when empty). `held` is [the keys, the PS's keys]: what a
training step holds, counted for GEO's traffic figures without ops of its own.
)doc");

REGISTER_OP("TfpsxGeoSplitRows")
    .Input("on_ps: bool")
    .Input("keys: int64")
    .Input("rows: T")
    .Input("hot: bool")
    .Output("ps_keys: int64")
    .Output("ps_rows: T")
    .Output("tail_keys: int64")
    .Output("tail_rows: T")
    .Attr("T: {float, double, half, bfloat16}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 0, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 1, &unused));
      c->set_output(0, c->Vector(InferenceContext::kUnknownDim));
      c->set_output(2, c->Vector(InferenceContext::kUnknownDim));
      TF_RETURN_IF_ERROR(RowsLike(c, 2, 1));
      return RowsLike(c, 2, 3);
    })
    .Doc(R"doc(
Splits unique `keys` and their `rows` (gradients: one row per key) into the PS's and
the copy's, as TfpsxGeoSplitKeys: with `on_ps` every key and row is the PS's (its
inputs forwarded, not copied) and the tails are empty; else by `hot` (one per key,
or empty when none is hot).
)doc");

REGISTER_OP("TfpsxGeoStitchRows")
    .Input("on_ps: bool")
    .Input("ps_rows: T")
    .Input("tail_rows: T")
    .Input("at_hot: int32")
    .Input("at_tail: int32")
    .Output("rows: T")
    .Attr("T: {float, double, half, bfloat16}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 0, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 1, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(4), 1, &unused));
      return RowsLike(c, 1, 0);
    })
    .Doc(R"doc(
The rows of TfpsxGeoSplitKeys' keys in their order: with `on_ps`, `ps_rows` (forwarded,
not copied; `tail_rows` and the positions are not read); else row `at_hot[i]` is
`ps_rows[i]` and row `at_tail[j]` is `tail_rows[j]`, every position once.
)doc");

}  // namespace tfpsx

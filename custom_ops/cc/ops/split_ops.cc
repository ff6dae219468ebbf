// Op declarations of the data plane: the job's split coordinator, a resource on PS 0
// (core/split_coordinator.h), and the reader of one split's records
// (core/split_reader.h). The Python side is tfpsx/data/.
//
// Op names carry the fixed "Tfpsx" prefix: renaming an op breaks saved graphs.

#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tfpsx {

using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

namespace {

absl::Status Scalars(InferenceContext* c, int first, int count) {
  ShapeHandle unused;
  for (int i = first; i < first + count; ++i)
    TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 0, &unused));
  return absl::OkStatus();
}

}  // namespace

REGISTER_OP("TfpsxSplitCoordinatorHandleOp")
    .Output("handle: resource")
    .Attr("container: string = ''")
    .Attr("shared_name: string = ''")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape)
    .Doc(R"doc(
A handle to a job's split coordinator (created empty on first use on the device the op
is placed on; every client that names the same shared_name there reaches it).
)doc");

REGISTER_OP("TfpsxSplitConfigure")
    .SetIsStateful()
    .Input("handle: resource")
    .Input("digest: string")
    .Input("seed: int64")
    .Input("files: int32")
    .Input("starts: int64")
    .Input("ends: int64")
    .Input("lease_ms: int64")
    .Output("first_open: int64")
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(Scalars(c, 1, 2));
      TF_RETURN_IF_ERROR(Scalars(c, 6, 1));
      c->set_output(0, c->Scalar());
      return absl::OkStatus();
    })
    .Doc(R"doc(
Sets the job's split table once (split i: bytes [starts[i], ends[i]) of file files[i]);
a second call with the same digest only renews lease_ms, another digest fails naming
both. Returns the oldest epoch not finished.
)doc");

REGISTER_OP("TfpsxSplitTake")
    .SetIsStateful()
    .Input("handle: resource")
    .Input("worker: int32")
    .Input("epoch: int64")
    .Output("status: int32")
    .Output("key: int64")
    .Output("lease_epoch: int64")
    .Output("file: int32")
    .Output("start: int64")
    .Output("resume: int64")
    .Output("end: int64")
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(Scalars(c, 1, 2));
      for (int i = 0; i < 7; ++i) c->set_output(i, c->Scalar());
      return absl::OkStatus();
    })
    .Doc(R"doc(
The next split for `worker` from the oldest open epoch up to `epoch`: status 0 (a lease:
read file's [resume, end)), 1 (none free now: wait), 2 (those epochs are done) or 3 (an
exact save's barrier is up: ask again when it is down).
)doc");

REGISTER_OP("TfpsxSplitCommit")
    .SetIsStateful()
    .Input("handle: resource")
    .Input("keys: int64")
    .Input("offsets: int64")
    .Output("finished: int64")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle keys, offsets;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &keys));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &offsets));
      c->set_output(0, c->Scalar());
      return absl::OkStatus();
    })
    .Doc("Splits `keys` trained up to `offsets` (positions only move on).");

REGISTER_OP("TfpsxSplitRenew")
    .SetIsStateful()
    .Input("handle: resource")
    .Input("worker: int32")
    .Input("release: bool")
    .Output("released: int64")
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(Scalars(c, 1, 2));
      c->set_output(0, c->Scalar());
      return absl::OkStatus();
    })
    .Doc(R"doc(
Renews `worker`'s leases (it is alive), or with `release` gives them all back (a worker
started again in place gives back its earlier process's); returns how many came back.
)doc");

REGISTER_OP("TfpsxSplitGiveBack")
    .SetIsStateful()
    .Input("handle: resource")
    .Input("worker: int32")
    .Input("keys: int64")
    .Output("given_back: int64")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 0, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &unused));
      c->set_output(0, c->Scalar());
      return absl::OkStatus();
    })
    .Doc(R"doc(
The leases of `keys` that `worker` holds come back (read again from their positions):
an iterator of the worker that was abandoned before it read them.
)doc");

REGISTER_OP("TfpsxSplitStats")
    .SetIsStateful()
    .Input("handle: resource")
    .Output("stats: int64")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(6));
      return absl::OkStatus();
    })
    .Doc(R"doc(
[first open epoch, splits an epoch, done, leased, left (of the first open epoch),
leases returned ever]; all zeros before the splits are configured.
)doc");

REGISTER_OP("TfpsxSplitBarrier")
    .SetIsStateful()
    .Input("handle: resource")
    .Input("action: int32")
    .Input("worker: int32")
    .Input("value: int64")
    .Output("generation: int64")
    .Output("up: bool")
    .Output("waiting: int64")
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(Scalars(c, 1, 3));
      for (int i = 0; i < 3; ++i) c->set_output(i, c->Scalar());
      return absl::OkStatus();
    })
    .Doc(R"doc(
An exact save's barrier. action 0: where it stands; 1: raise it for `value` ms (returns
its generation); 2: `worker` acks generation `value`; 3: lower generation `value`.
Returns [the last generation, whether it is up, workers holding a lease that have not
acked it]. While it is up a worker that acked takes no lease (a take says 3: paused), nor
does any once every holder acked.
)doc");

REGISTER_OP("TfpsxSplitStream")
    .SetIsStateful()
    .Input("handle: resource")
    .Input("action: int32")
    .Input("digest: string")
    .Input("seed: int64")
    .Input("lease_ms: int64")
    .Input("names: string")
    .Input("files: int32")
    .Input("starts: int64")
    .Input("ends: int64")
    .Input("from: int64")
    .Output("value: int64")
    .Output("files_out: string")
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(Scalars(c, 1, 4));
      TF_RETURN_IF_ERROR(Scalars(c, 9, 1));
      c->set_output(0, c->Scalar());
      c->set_output(1, c->Vector(InferenceContext::kUnknownDim));
      return absl::OkStatus();
    })
    .Doc(R"doc(
A stream input (files that keep landing). action 0: configure the coordinator as the
stream `digest` (seed, lease_ms), returns its first open epoch; 1: append the files
`names` not appended before with their splits (split i: bytes [starts[i], ends[i]) of
names[files[i]]), returns the splits added; 2: the stream's file names from index
`from` (files_out); 3: stop (every take ends from now on). Unused inputs are ignored.
)doc");

REGISTER_OP("TfpsxSplitExport")
    .SetIsStateful()
    .Input("handle: resource")
    .Output("state: string")
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape)
    .Doc("The coordinator's state (its table and every open epoch's positions) as bytes.");

REGISTER_OP("TfpsxSplitImport")
    .SetIsStateful()
    .Input("handle: resource")
    .Input("state: string")
    .Output("first_open: int64")
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(Scalars(c, 1, 1));
      c->set_output(0, c->Scalar());
      return absl::OkStatus();
    })
    .Doc(R"doc(
Restores an exported state (every lease dropped: their splits are read again from their
positions); refuses another input's (the digests, named) before any change.
)doc");

REGISTER_OP("TfpsxReadSplit")
    .SetIsStateful()  // reads a file: never folded or cached
    .Input("path: string")
    .Input("start: int64")
    .Input("resume: int64")
    .Input("end: int64")
    .Input("max_bytes: int64")
    .Attr("format: {'text', 'tfrecord'} = 'text'")
    .Output("records: string")
    .Output("ends: int64")
    .Output("next: int64")
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(Scalars(c, 0, 5));
      c->set_output(0, c->Vector(c->UnknownDim()));
      c->set_output(1, c->Vector(c->UnknownDim()));
      c->set_output(2, c->Scalar());
      return absl::OkStatus();
    })
    .Doc(R"doc(
The records of `path`'s split [start, end) from `resume` (start, or a record's end
offset), about max_bytes of them: records, each one's end offset, and the offset to read
on from (-1: the split is read). Text: lines; tfrecord: uncompressed TFRecords, CRCs
checked.
)doc");

}  // namespace tfpsx

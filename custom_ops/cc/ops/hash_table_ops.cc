// Op declarations for tfpsx dynamic embedding tables (kernels: ../kernels/table_*_kernel*.cc).
// The table lives on the device its handle op runs on (a PS task); every client that
// names the same shared_name there reaches the same table. Every op is stateful: each
// reads or changes the table, so TF must neither fold, merge nor prune one (a tf.function
// pruned an apply whose only user was a control dependency: Keras tables did not train).

#include "custom_ops/cc/ops/shape_fns.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tfpsx {

using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

using shape_fns::NoOutputs;
using shape_fns::RowsAndFound;
using shape_fns::RowsLikeKeys;

REGISTER_OP("TfpsxHashTableHandleOp")
    .Output("handle: resource")
    .Attr("container: string = ''")
    .Attr("shared_name: string")
    .Attr("dim: int")
    .Attr("num_slots: int = 0")
    .Attr("slot_init: list(float) = []")
    .Attr("initializer: {'zeros', 'constant', 'uniform', 'normal'} = 'zeros'")
    .Attr("init_a: float = 0.0")
    .Attr("init_b: float = 0.0")
    .Attr("seed: int = 0")
    .Attr("min_frequency: int = 1")
    .Attr("capacity: int = 0")
    .Attr("tier_directory: string = ''")
    .Attr("tier_ram_bytes: int = 0")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape)
    .Doc(R"doc(
Creates (on first run) or finds the dynamic embedding table `shared_name` on this
device and returns a handle to it. Running it for an existing table with another dim
or slot count is an error. capacity > 0 reserves that many rows when the table is
created (index sized, row memory faulted in); it is a hint, ignored for an existing table.
tier_directory: a table larger than RAM keeps its rows beyond tier_ram_bytes of RAM in
tier_directory/shared_name on this device's local disk (core/tiered_table.h).
)doc");

REGISTER_OP("TfpsxHashTableFind")
    .SetIsStateful()
    .Input("handle: resource")
    .Input("keys: int64")
    .Output("values: float")
    .Output("found: bool")
    .Attr("with_slots: bool = false")
    .SetShapeFn(RowsAndFound)
    .Doc("Rows of `keys`; a missing key gets its initial row and found=false. with_slots: "
         "each row with its optimizer slots, [value | slots] (dim * (1 + num_slots) "
         "floats; a missing key's slots at slot_init).");

REGISTER_OP("TfpsxHashTableCacheFind")
    .SetIsStateful()
    .Input("handle: resource")
    .Input("keys: int64")
    .Input("step: int64")
    .Output("values: float")
    .Output("found: bool")
    .SetShapeFn(RowsAndFound)
    .Doc(R"doc(
A worker cache's lookup: rows of `keys` and which were present, like Find; a present
key's frequency is counted and its step set to `step` (LFU / LRU bookkeeping). Nothing
is inserted and no key is marked changed.
)doc");

REGISTER_OP("TfpsxHashTableCacheVictims")
    .SetIsStateful()
    .Input("handle: resource")
    .Input("count: int64")
    .Input("by_step: bool")
    .Output("keys: int64")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(InferenceContext::kUnknownDim));
      return absl::OkStatus();
    })
    .Doc(R"doc(
The keys of the `count` rows a cache evicts first, without removing them: lowest
frequency (LFU), or with `by_step` the oldest step (LRU); ties: larger key first.
)doc");

REGISTER_OP("TfpsxHashTableFindOrInsert")
    .SetIsStateful()
    .Input("handle: resource")
    .Input("keys: int64")
    .Input("step: int64")
    .Output("values: float")
    .SetShapeFn(RowsLikeKeys)
    .Doc("Rows of `keys`, inserting missing keys (subject to admission) and counting frequency.");

REGISTER_OP("TfpsxHashTableInsert")
    .SetIsStateful()
    .Input("handle: resource")
    .Input("keys: int64")
    .Input("values: float")
    .Input("step: int64")
    .Attr("with_slots: bool = false")
    .SetShapeFn(NoOutputs)
    .Doc("Sets the rows of `keys` (values: keys' shape + [dim]; with_slots: [dim * (1 + "
         "num_slots)], each row with its optimizer slots, written whole).");

REGISTER_OP("TfpsxHashTableAccumulate")
    .SetIsStateful()
    .Input("handle: resource")
    .Input("keys: int64")
    .Input("deltas: float")
    .Input("step: int64")
    .Attr("skip_reader: int = -1")
    .Attr("combine: {'sum', 'mean', 'scaled'} = 'sum'")
    .Attr("with_slots: bool = false")
    .SetShapeFn(NoOutputs)
    .Doc("row += delta for `keys`; a missing key starts from its initial row. The keys are "
         "marked changed for every changed-key reader but `skip_reader` (-1: none): a "
         "worker's own push need not come back in its next pull. `combine` says how the "
         "pushes of several workers to one row add up (skip_reader is the pusher; the "
         "others: the c pushes of the row since the pusher's last take_changed): 'sum' "
         "whole; 'mean' the row moves to the mean of the pushes (exact when they started "
         "from one value); 'scaled' delta / (1 + c). with_slots: deltas of [value | "
         "slots] (dim * (1 + num_slots) floats), every one whole (combine 'sum' only).");

REGISTER_OP("TfpsxHashTableRemove")
    .SetIsStateful()
    .Input("handle: resource")
    .Input("keys: int64")
    .Output("removed: int64")
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape);

REGISTER_OP("TfpsxHashTablePrefetch")
    .SetIsStateful()
    .Input("handle: resource")
    .Input("keys: int64")
    .Output("placed: int64")
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape)
    .Doc(R"doc(
A tiered table: brings the disk rows of keys into RAM ahead of the step that uses them,
the reads done without the table's lock (they overlap the operations running meanwhile).
placed: the rows brought back. At most a piece of keys that fits above the high-water
mark is prefetched; the rest come in with their operation. 0 on a table all in RAM.
)doc");

REGISTER_OP("TfpsxHashTableSize")
    .SetIsStateful()
    .Input("handle: resource")
    .Output("size: int64")
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape);

REGISTER_OP("TfpsxHashTableExport")
    .SetIsStateful()
    .Input("handle: resource")
    .Input("since_step: int64")
    .Output("keys: int64")
    .Output("values: float")
    .Output("slots: float")
    .Output("freq: int64")
    .Output("step: int64")
    .SetShapeFn(tfpsx::shape_fns::ExportedRows)
    .Doc(R"doc(
Rows whose last update step is >= since_step (all rows for the int64 minimum), sorted
by key: values [n, dim], slots [n, num_slots, dim], frequency and last-update step.
)doc");

REGISTER_OP("TfpsxHashTablePageBounds")
    .SetIsStateful()
    .Input("handle: resource")
    .Input("max_rows: int64")
    .Input("arm: bool")
    .Output("bounds: int64")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(c->UnknownDim()));
      return absl::OkStatus();
    })
    .Doc(R"doc(
A paged export, so that exporting a table larger than its RAM (a tiered one) takes a
page of RAM, not the table's size. bounds b_1 < ... < b_m split the keys into the pages
(-inf, b_1), [b_1, b_2), ..., [b_m, +inf) of about max_rows rows each (0: a tiered
table's default, a 32nd of its ram_bytes; a table all in RAM is one page); read each
with ExportRange. arm: a paged full checkpoint starts here (the table tracks its writes
from now on, as after a full CheckpointExport; a row written meanwhile is in the next
delta).
)doc");

REGISTER_OP("TfpsxHashTableDeltaBegin")
    .SetIsStateful()
    .Input("handle: resource")
    .Input("max_rows: int64")
    .Output("removed: int64")
    .Output("complete: bool")
    .Output("bounds: int64")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(c->UnknownDim()));
      c->set_output(1, c->Scalar());
      c->set_output(2, c->Vector(c->UnknownDim()));
      return absl::OkStatus();
    })
    .Doc(R"doc(
A tiered table's incremental checkpoint in pages: CheckpointExport(full=false)'s marks
taken, its removed keys and complete flag returned, the keys of the rows written since
the last export kept (not their rows); bounds split those keys into pages of max_rows
(0: a 32nd of ram_bytes of rows), read each with ExportRange(delta=true).
)doc");

REGISTER_OP("TfpsxHashTableExportRange")
    .SetIsStateful()
    .Input("handle: resource")
    .Input("lo: int64")
    .Input("hi: int64")
    .Attr("delta: bool = false")
    .Output("keys: int64")
    .Output("values: float")
    .Output("slots: float")
    .Output("freq: int64")
    .Output("step: int64")
    .SetShapeFn(tfpsx::shape_fns::ExportedRows)
    .Doc(R"doc(
The rows with lo <= key <= hi (a page of PageBounds), sorted by key, as Export gives
them; a tiered table reads only the disk groups that may hold such keys and moves no row.
delta: of DeltaBegin's keys only, read where they are now (RAM or disk).
)doc");

REGISTER_OP("TfpsxHashTableCheckpointExport")
    .SetIsStateful()
    .Input("handle: resource")
    .Input("full: bool")
    .Output("keys: int64")
    .Output("values: float")
    .Output("slots: float")
    .Output("freq: int64")
    .Output("step: int64")
    .Output("removed: int64")
    .Output("complete: bool")
    .SetShapeFn([](InferenceContext* c) {
      DimensionHandle n = c->UnknownDim();
      c->set_output(0, c->Vector(n));
      c->set_output(1, c->Matrix(n, c->UnknownDim()));
      c->set_output(2, c->MakeShape({n, c->UnknownDim(), c->UnknownDim()}));
      c->set_output(3, c->Vector(n));
      c->set_output(4, c->Vector(n));
      c->set_output(5, c->Vector(c->UnknownDim()));
      c->set_output(6, c->Scalar());
      return absl::OkStatus();
    })
    .Doc(R"doc(
Incremental checkpoints. full=true: every row, as Export, and the table tracks its
writes from now on. full=false: the rows written (inserted, updated, counted by a
lookup, imported) and the keys removed since the previous CheckpointExport, sorted by
key; complete=false (and nothing else) when the table was not tracking (a new process,
or a clear since): save a full one. Each call clears the marks.
)doc");

REGISTER_OP("TfpsxHashTableImport")
    .SetIsStateful()
    .Input("handle: resource")
    .Input("keys: int64")
    .Input("values: float")
    .Input("slots: float")
    .Input("freq: int64")
    .Input("step: int64")
    .Attr("clear: bool = false")
    .SetShapeFn(NoOutputs)
    .Doc(R"doc(
Writes exported rows back (clear=true replaces the table's contents): keys [n],
values [n, dim], slots [n, num_slots, dim] or empty (slots then start from their initial
value), freq and step [n] or empty. Every input is checked before the table changes.
)doc");

REGISTER_OP("TfpsxHashTableTakeChanged")
    .SetIsStateful()
    .Input("handle: resource")
    .Input("reader: int64")
    .Output("keys: int64")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(InferenceContext::kUnknownDim));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Keys changed since `reader`'s previous call (sorted), and resets them. A reader is
registered by its first call, which returns nothing.
)doc");

REGISTER_OP("TfpsxHashTableTakeChangedAmong")
    .SetIsStateful()
    .Input("handle: resource")
    .Input("reader: int64")
    .Input("keys: int64")
    .Output("changed: int64")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &unused));
      c->set_output(0, c->Vector(InferenceContext::kUnknownDim));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Of the keys changed since `reader`'s previous TfpsxHashTableTakeChanged, those among
`keys` (sorted), and resets them; the others stay marked for a later take (GEO's pull of
the rows a worker will read). A reader is registered by its first call, which returns
nothing.
)doc");

REGISTER_OP("TfpsxOptimizerRegistry")
    .Output("names: string")
    .Output("num_slots: int32")
    .Output("hparams: string")
    .SetShapeFn([](InferenceContext* c) {
      for (int i = 0; i < 3; ++i) c->set_output(i, c->Vector(c->UnknownDim()));
      return absl::OkStatus();
    })
    .Doc(R"doc(
The server-side optimizers this library was built with, in registration order: each
one's name (what TfpsxHashTableApply's `optimizer` attr selects), its slot count and its
hyperparameter names joined by commas, in the order `hparams` lists them. The Python
specs are checked against it: the C++ registry is the one source of truth.
)doc");

REGISTER_OP("TfpsxHashTableApply")
    .SetIsStateful()
    .Input("handle: resource")
    .Input("keys: int64")
    .Input("grads: float")
    .Input("hparams: float")
    .Input("step: int64")
    .Attr("optimizer: string")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 1, &unused));
      return c->WithRank(c->input(4), 0, &unused);
    })
    .Doc(R"doc(
Applies `grads` (keys' shape + [dim]) to the rows of `keys` (expected unique) with the
server-side optimizer named by `optimizer`; a missing key starts from its initial row
(with admission on, it gets no row). The table must have the optimizer's slot count.
`hparams` lists the optimizer's hyperparameters in the order TfpsxOptimizerRegistry
gives (sgd [learning_rate], adagrad [learning_rate, epsilon], adam [learning_rate,
beta1, beta2, epsilon], ftrl [learning_rate, learning_rate_power, l1, l2]).
adam is lazy Adam with bias correction from `step` (taken as 1 when smaller).
)doc");

// The per-optimizer ops TfpsxHashTableApply replaces: the same kernel with the optimizer
// fixed and each hyperparameter a scalar input. Registered still, because saved graphs
// name them.
#define TFPSX_APPLY_OP(Name, ExtraInputs)                                  \
  REGISTER_OP(Name)                                                        \
      .SetIsStateful()                                                     \
      .Input("handle: resource")                                           \
      .Input("keys: int64")                                                \
      .Input("grads: float")                                               \
      .Input("lr: float") ExtraInputs                                      \
      .Input("step: int64")                                                \
      .SetShapeFn(NoOutputs)

TFPSX_APPLY_OP("TfpsxHashTableApplySgd", );
TFPSX_APPLY_OP("TfpsxHashTableApplyAdagrad", .Input("epsilon: float"));
TFPSX_APPLY_OP("TfpsxHashTableApplyAdam",
               .Input("beta1: float").Input("beta2: float").Input("epsilon: float"));
TFPSX_APPLY_OP("TfpsxHashTableApplyFtrl",
               .Input("lr_power: float").Input("l1: float").Input("l2: float"));
#undef TFPSX_APPLY_OP

REGISTER_OP("TfpsxHashTableEvict")
    .SetIsStateful()
    .Input("handle: resource")
    .Input("min_step: int64")
    .Input("keep_top_n: int64")
    .Output("evicted: int64")
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape)
    .Doc(R"doc(
Evicts rows last updated before min_step (skipped when min_step is the int64 minimum),
then keeps only the keep_top_n most frequent rows (skipped when keep_top_n < 0).
)doc");

REGISTER_OP("TfpsxHashTableTierStats")
    .SetIsStateful()
    .Input("handle: resource")
    .Output("stats: int64")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(11));
      return absl::OkStatus();
    })
    .Doc(R"doc(
A tiered table's disk tier: [ram_bytes, disk_rows, disk_bytes, bytes_written,
bytes_spilled, bytes_read, read_calls, rows_spilled, rows_faulted, segments, index_bytes],
where ram_bytes is what counts against its budget, bytes_written what spills and
compactions wrote and bytes_spilled the bytes of the rows moved to disk. Zeros for a
table all in RAM.
)doc");

REGISTER_OP("TfpsxHashTableStats")
    .SetIsStateful()
    .Input("handle: resource")
    .Output("stats: int64")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(6));
      return absl::OkStatus();
    })
    .Doc(R"doc(
[size, admitted, evicted, pending_admission, bytes_used, bytes_reserved]: bytes_used is
what the rows held take (records: key, metadata, value, slots; plus the index),
bytes_reserved all the table holds (the index and every block of row memory mapped,
reserved capacity and chunks not filled yet included).
)doc");

}  // namespace tfpsx

// Op declarations for the GPU embedding table (custom_ops/cuda/gpu_table.h), compiled only
// into a library built with CUDA (TFPSX_WITH_CUDA=1), beside their GPU kernels
// (../kernels/gpu_table_kernels.cu.cc). The .cu.cc name is what keeps them out of a CPU
// build: a CPU-only library registers exactly the ops it did before the GPU table existed,
// and the CUDA build compiles this file with nvcc like every other *.cu.cc (it has no
// device code; nvcc hands it to the host compiler).

#include "custom_ops/cc/ops/shape_fns.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tfpsx {

using shape_fns::NoOutputs;
using shape_fns::RowsAndFound;
using shape_fns::RowsLikeKeys;

REGISTER_OP("TfpsxGpuTableHandleOp")
    .Output("handle: resource")
    .Attr("container: string = ''")
    .Attr("shared_name: string")
    .Attr("dim: int")
    .Attr("capacity: int")
    .Attr("initializer: {'zeros', 'constant', 'uniform', 'normal'} = 'zeros'")
    .Attr("init_a: float = 0.0")
    .Attr("init_b: float = 0.0")
    .Attr("seed: int = 0")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape)
    .Doc(R"doc(
Creates (on first run) or finds the GPU table `shared_name` on this GPU: `capacity`
slots of `dim` floats in device memory, missing keys drawn like the CPU table's
(initializer, init_a, init_b, seed).
)doc");

REGISTER_OP("TfpsxGpuTableFind")
    .SetIsStateful()
    .Input("handle: resource")
    .Input("keys: int64")
    .Output("values: float")
    .Output("found: bool")
    .SetShapeFn(RowsAndFound)
    .Doc("Rows of `keys`; a missing key gets its initial row and found=false.");

REGISTER_OP("TfpsxGpuTableFindOrInsert")
    .SetIsStateful()
    .Input("handle: resource")
    .Input("keys: int64")
    .Output("values: float")
    .SetShapeFn(RowsLikeKeys)
    .Doc("Rows of `keys`, inserting missing keys with their initial rows; a full table is an error.");

REGISTER_OP("TfpsxGpuTableAccumulate")
    .SetIsStateful()
    .Input("handle: resource")
    .Input("keys: int64")
    .Input("deltas: float")
    .SetShapeFn(NoOutputs)
    .Doc("row += delta for `keys` (repeats add up); a missing key starts from its initial row.");

REGISTER_OP("TfpsxGpuTableEvict")
    .SetIsStateful()
    .Input("handle: resource")
    .Input("keys: int64")
    .SetShapeFn(NoOutputs)
    .Doc("Removes `keys` from the GPU table (their slots are reused).");

REGISTER_OP("TfpsxGpuTableSize")
    .SetIsStateful()
    .Input("handle: resource")
    .Output("size: int64")
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape)
    .Doc("Keys the GPU table holds.");

}  // namespace tfpsx

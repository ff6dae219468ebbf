// Kernels of GEO's row routing (see ../ops/geo_route_ops.cc): split a batch's keys and
// rows by a flag and a hot mask, stitch rows back. With the flag on they forward their
// inputs: a table that trains async pays a few ops a step, not a copy of its rows.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "custom_ops/cc/kernels/scalar_input.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.h"

namespace tfpsx {

using ::tensorflow::DEVICE_CPU;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;

namespace {

absl::Status Vector(const Tensor& t, const char* name) {
  if (t.dims() != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " must be a vector, got shape ", t.shape().DebugString()));
  }
  return absl::OkStatus();
}

// `hot` holds one flag per key, or none (no key hot), when the flag is off; *none says
// which.
absl::Status HotPerKey(const Tensor& hot, int64_t n, bool* none) {
  if (hot.dims() != 1 || (hot.NumElements() != n && hot.NumElements() != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "hot must hold one flag per key (", n, ") or none (no key hot), got shape ",
        hot.shape().DebugString(), " (with on_ps false it says which keys are the PS's)"));
  }
  *none = hot.NumElements() != n;
  return absl::OkStatus();
}

// The count of true flags of `hot` (none: 0).
int64_t HotCount(const Tensor& hot, bool none) {
  if (none) return 0;
  const bool* h = hot.flat<bool>().data();
  return std::count(h, h + hot.NumElements(), true);
}

// Output `index`: [keys, the PS's keys] (a step's held rows, counted by GEO).
absl::Status Held(OpKernelContext* ctx, int index, int64_t keys, int64_t ps_keys) {
  Tensor* held = nullptr;
  TF_RETURN_IF_ERROR(ctx->allocate_output(index, {2}, &held));
  held->flat<int64_t>()(0) = keys;
  held->flat<int64_t>()(1) = ps_keys;
  return absl::OkStatus();
}

// The shape [count] + rows' dims after the first.
TensorShape RowsShape(const Tensor& rows, int64_t count) {
  TensorShape shape = rows.shape();
  shape.set_dim(0, count);
  return shape;
}

// Bytes of one row of `rows` (rank >= 1).
int64_t RowBytes(const Tensor& rows) {
  const int64_t n = rows.dim_size(0);
  const int64_t width = n > 0 ? rows.NumElements() / n : [&] {
    int64_t w = 1;
    for (int d = 1; d < rows.dims(); ++d) w *= rows.dim_size(d);
    return w;
  }();
  return width * ::tensorflow::DataTypeSize(rows.dtype());
}

char* Bytes(Tensor* t) { return static_cast<char*>(t->data()); }
const char* Bytes(const Tensor& t) { return static_cast<const char*>(t.data()); }

}  // namespace

class GeoSplitKeysOp : public OpKernel {
 public:
  explicit GeoSplitKeysOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}
  // (a few copies at most: run inline, as TF's Switch / Merge and gathers are, not
  // handed to the executor's thread pool each step)
  bool IsExpensive() override { return false; }

  void Compute(OpKernelContext* ctx) override {
    bool on_ps = false;
    OP_REQUIRES_OK(ctx, Scalar(ctx, 0, "on_ps", &on_ps));
    const Tensor& keys = ctx->input(1);
    OP_REQUIRES_OK(ctx, Vector(keys, "keys"));
    const int64_t n = keys.NumElements();
    Tensor* out = nullptr;
    if (on_ps) {
      OP_REQUIRES_OK(ctx, ctx->allocate_output(0, keys.shape(), &out));
      std::fill_n(out->flat<bool>().data(), n, true);
      ctx->set_output(1, keys);
      for (int i = 2; i < 5; ++i) OP_REQUIRES_OK(ctx, ctx->allocate_output(i, {0}, &out));
      OP_REQUIRES_OK(ctx, Held(ctx, 5, n, n));
      return;
    }
    OP_REQUIRES(ctx, n <= std::numeric_limits<int32_t>::max(),
                absl::InvalidArgumentError(absl::StrCat(
                    "keys: ", n, " keys, over the int32 positions (at most ",
                    std::numeric_limits<int32_t>::max(), ") a batch's split can name")));
    const Tensor& hot = ctx->input(2);
    bool none = false;
    OP_REQUIRES_OK(ctx, HotPerKey(hot, n, &none));
    if (none) {  // every key the copy's
      OP_REQUIRES_OK(ctx, ctx->allocate_output(0, keys.shape(), &out));
      std::fill_n(out->flat<bool>().data(), n, false);
    } else {
      ctx->set_output(0, hot);
    }
    const bool* h = none ? nullptr : hot.flat<bool>().data();
    const int64_t hot_count = HotCount(hot, none);
    Tensor *ps_keys, *tail_keys, *at_hot, *at_tail;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, {hot_count}, &ps_keys));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, {n - hot_count}, &tail_keys));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, {hot_count}, &at_hot));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(4, {n - hot_count}, &at_tail));
    OP_REQUIRES_OK(ctx, Held(ctx, 5, n, hot_count));
    const int64_t* k = keys.flat<int64_t>().data();
    int64_t* pk = ps_keys->flat<int64_t>().data();
    int64_t* tk = tail_keys->flat<int64_t>().data();
    int32_t* ah = at_hot->flat<int32_t>().data();
    int32_t* at = at_tail->flat<int32_t>().data();
    for (int64_t i = 0; i < n; ++i) {
      if (h != nullptr && h[i]) {
        *pk++ = k[i];
        *ah++ = static_cast<int32_t>(i);
      } else {
        *tk++ = k[i];
        *at++ = static_cast<int32_t>(i);
      }
    }
  }
};

class GeoSplitRowsOp : public OpKernel {
 public:
  explicit GeoSplitRowsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}
  // (a few copies at most: run inline, as TF's Switch / Merge and gathers are, not
  // handed to the executor's thread pool each step)
  bool IsExpensive() override { return false; }

  void Compute(OpKernelContext* ctx) override {
    bool on_ps = false;
    OP_REQUIRES_OK(ctx, Scalar(ctx, 0, "on_ps", &on_ps));
    const Tensor& keys = ctx->input(1);
    const Tensor& rows = ctx->input(2);
    OP_REQUIRES_OK(ctx, Vector(keys, "keys"));
    const int64_t n = keys.NumElements();
    OP_REQUIRES(ctx, rows.dims() >= 1 && rows.dim_size(0) == n,
                absl::InvalidArgumentError(absl::StrCat(
                    "rows must hold one row per key (", n, "), got shape ",
                    rows.shape().DebugString())));
    Tensor* out = nullptr;
    if (on_ps) {
      ctx->set_output(0, keys);
      ctx->set_output(1, rows);
      OP_REQUIRES_OK(ctx, ctx->allocate_output(2, {0}, &out));
      OP_REQUIRES_OK(ctx, ctx->allocate_output(3, RowsShape(rows, 0), &out));
      return;
    }
    const Tensor& hot = ctx->input(3);
    bool none = false;
    OP_REQUIRES_OK(ctx, HotPerKey(hot, n, &none));
    const bool* h = none ? nullptr : hot.flat<bool>().data();
    const int64_t hot_count = HotCount(hot, none);
    Tensor *ps_keys, *ps_rows, *tail_keys, *tail_rows;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, {hot_count}, &ps_keys));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, RowsShape(rows, hot_count), &ps_rows));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, {n - hot_count}, &tail_keys));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, RowsShape(rows, n - hot_count), &tail_rows));
    const int64_t bytes = RowBytes(rows);
    const int64_t* k = keys.flat<int64_t>().data();
    const char* r = Bytes(rows);
    int64_t* pk = ps_keys->flat<int64_t>().data();
    int64_t* tk = tail_keys->flat<int64_t>().data();
    char* pr = Bytes(ps_rows);
    char* tr = Bytes(tail_rows);
    for (int64_t i = 0; i < n; ++i) {
      if (h != nullptr && h[i]) {
        *pk++ = k[i];
        std::memcpy(pr, r + i * bytes, bytes);
        pr += bytes;
      } else {
        *tk++ = k[i];
        std::memcpy(tr, r + i * bytes, bytes);
        tr += bytes;
      }
    }
  }
};

class GeoStitchRowsOp : public OpKernel {
 public:
  explicit GeoStitchRowsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}
  // (a few copies at most: run inline, as TF's Switch / Merge and gathers are, not
  // handed to the executor's thread pool each step)
  bool IsExpensive() override { return false; }

  void Compute(OpKernelContext* ctx) override {
    bool on_ps = false;
    OP_REQUIRES_OK(ctx, Scalar(ctx, 0, "on_ps", &on_ps));
    const Tensor& ps_rows = ctx->input(1);
    OP_REQUIRES(ctx, ps_rows.dims() >= 1,
                absl::InvalidArgumentError(absl::StrCat(
                    "ps_rows must be rows (rank >= 1), got shape ",
                    ps_rows.shape().DebugString())));
    if (on_ps) {
      ctx->set_output(0, ps_rows);
      return;
    }
    const Tensor& tail_rows = ctx->input(2);
    const Tensor& at_hot = ctx->input(3);
    const Tensor& at_tail = ctx->input(4);
    OP_REQUIRES_OK(ctx, Vector(at_hot, "at_hot"));
    OP_REQUIRES_OK(ctx, Vector(at_tail, "at_tail"));
    const int64_t hot_count = at_hot.NumElements(), tail_count = at_tail.NumElements();
    OP_REQUIRES(ctx, ps_rows.dim_size(0) == hot_count,
                absl::InvalidArgumentError(absl::StrCat(
                    "ps_rows must hold one row per position of at_hot (", hot_count,
                    "), got shape ", ps_rows.shape().DebugString())));
    OP_REQUIRES(ctx, tail_rows.dims() == ps_rows.dims() &&
                         tail_rows.dim_size(0) == tail_count &&
                         RowsShape(tail_rows, hot_count) == ps_rows.shape(),
                absl::InvalidArgumentError(absl::StrCat(
                    "tail_rows must hold one row per position of at_tail (", tail_count,
                    ") as wide as ps_rows ", ps_rows.shape().DebugString(), ", got shape ",
                    tail_rows.shape().DebugString())));
    const int64_t n = hot_count + tail_count;
    Tensor* rows = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, RowsShape(ps_rows, n), &rows));
    const int64_t bytes = RowBytes(ps_rows);
    std::vector<bool> placed(n, false);
    char* out = Bytes(rows);
    auto place = [&](const Tensor& at, const Tensor& from, const char* name) -> absl::Status {
      const int32_t* a = at.flat<int32_t>().data();
      const char* src = Bytes(from);
      for (int64_t i = 0; i < at.NumElements(); ++i) {
        const int32_t p = a[i];
        if (p < 0 || p >= n || placed[p]) {
          return absl::InvalidArgumentError(absl::StrCat(
              name, "[", i, "] = ", p, ": expected each of the ", n,
              " positions of the rows once (TfpsxGeoSplitKeys' at_hot and at_tail)"));
        }
        placed[p] = true;
        std::memcpy(out + p * bytes, src + i * bytes, bytes);
      }
      return absl::OkStatus();
    };
    OP_REQUIRES_OK(ctx, place(at_hot, ps_rows, "at_hot"));
    OP_REQUIRES_OK(ctx, place(at_tail, tail_rows, "at_tail"));
  }
};

REGISTER_KERNEL_BUILDER(Name("TfpsxGeoSplitKeys").Device(DEVICE_CPU), GeoSplitKeysOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxGeoSplitRows").Device(DEVICE_CPU), GeoSplitRowsOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxGeoStitchRows").Device(DEVICE_CPU), GeoStitchRowsOp);

}  // namespace tfpsx

// Kernels of the data plane (see ../ops/split_ops.cc): thin wrappers of the TF-free
// core/split_coordinator.h and core/split_reader.h.

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "custom_ops/cc/core/split_coordinator.h"
#include "custom_ops/cc/core/split_reader.h"
#include "custom_ops/cc/kernels/scalar_input.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_op_kernel.h"
#include "tensorflow/core/framework/tensor.h"

namespace tfpsx {

using ::tensorflow::DEVICE_CPU;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::tstring;

class SplitCoordinatorResource : public ::tensorflow::ResourceBase {
 public:
  std::string DebugString() const override {
    const SplitStats s = core.Stats();
    return absl::StrCat("TfpsxSplitCoordinator(epoch=", s.first_open, ", splits=", s.splits,
                        ", done=", s.done, ", leased=", s.leased, ")");
  }
  SplitCoordinator core;
};

REGISTER_KERNEL_BUILDER(Name("TfpsxSplitCoordinatorHandleOp").Device(DEVICE_CPU),
                        ::tensorflow::ResourceHandleOp<SplitCoordinatorResource>);

namespace {

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

absl::Status GetCoordinator(OpKernelContext* ctx,
                            ::tensorflow::core::RefCountPtr<SplitCoordinatorResource>* out) {
  return ::tensorflow::LookupOrCreateResource<SplitCoordinatorResource>(
      ctx, ::tensorflow::HandleFromInput(ctx, 0), out, [](SplitCoordinatorResource** c) {
        *c = new SplitCoordinatorResource();
        return absl::OkStatus();
      });
}

void OutScalar(OpKernelContext* ctx, int index, int64_t v) {
  Tensor* out = nullptr;
  OP_REQUIRES_OK(ctx, ctx->allocate_output(index, TensorShape({}), &out));
  out->scalar<int64_t>()() = v;
}

// Runs fn; a std::invalid_argument is the caller's bad input, anything else a failed
// precondition (the coordinator not configured yet).
template <typename Fn>
void Guarded(OpKernelContext* ctx, const char* what, Fn&& fn) {
  try {
    fn();
  } catch (const std::invalid_argument& e) {
    ctx->SetStatus(absl::InvalidArgumentError(absl::StrCat("tfpsx input: ", what, ": ", e.what())));
  } catch (const std::exception& e) {
    ctx->SetStatus(
        absl::FailedPreconditionError(absl::StrCat("tfpsx input: ", what, ": ", e.what())));
  }
}

}  // namespace

class SplitConfigureOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    tstring digest;
    int64_t seed = 0, lease_ms = 0;
    OP_REQUIRES_OK(ctx, Scalar(ctx, 1, "digest", &digest));
    OP_REQUIRES_OK(ctx, Scalar(ctx, 2, "seed", &seed));
    OP_REQUIRES_OK(ctx, Scalar(ctx, 6, "lease_ms", &lease_ms));
    const auto files = ctx->input(3).flat<int32_t>();
    const auto starts = ctx->input(4).flat<int64_t>();
    const auto ends = ctx->input(5).flat<int64_t>();
    OP_REQUIRES(ctx, files.size() == starts.size() && starts.size() == ends.size(),
                absl::InvalidArgumentError(absl::StrCat(
                    "files, starts and ends must have one entry a split, got ", files.size(),
                    ", ", starts.size(), " and ", ends.size())));
    std::vector<SplitSpec> splits(static_cast<size_t>(files.size()));
    for (int64_t i = 0; i < files.size(); ++i) splits[i] = {files(i), starts(i), ends(i)};
    ::tensorflow::core::RefCountPtr<SplitCoordinatorResource> c;
    OP_REQUIRES_OK(ctx, GetCoordinator(ctx, &c));
    Guarded(ctx, "configure", [&] {
      c->core.Configure(std::string(digest), static_cast<uint64_t>(seed), std::move(splits),
                        lease_ms);
      OutScalar(ctx, 0, c->core.FirstOpen());
    });
  }
};

class SplitTakeOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    int32_t worker = 0;
    int64_t epoch = 0;
    OP_REQUIRES_OK(ctx, Scalar(ctx, 1, "worker", &worker));
    OP_REQUIRES_OK(ctx, Scalar(ctx, 2, "epoch", &epoch));
    ::tensorflow::core::RefCountPtr<SplitCoordinatorResource> c;
    OP_REQUIRES_OK(ctx, GetCoordinator(ctx, &c));
    Guarded(ctx, "take", [&] {
      const SplitLease l = c->core.Take(worker, epoch, NowMs());
      Tensor* status = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &status));
      status->scalar<int32_t>()() = l.status;
      OutScalar(ctx, 1, l.key());
      OutScalar(ctx, 2, l.epoch);
      Tensor* file = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(3, TensorShape({}), &file));
      file->scalar<int32_t>()() = l.file;
      OutScalar(ctx, 4, l.start);
      OutScalar(ctx, 5, l.resume);
      OutScalar(ctx, 6, l.end);
    });
  }
};

class SplitBarrierOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    int32_t action = 0, worker = 0;
    int64_t value = 0;
    OP_REQUIRES_OK(ctx, Scalar(ctx, 1, "action", &action));
    OP_REQUIRES_OK(ctx, Scalar(ctx, 2, "worker", &worker));
    OP_REQUIRES_OK(ctx, Scalar(ctx, 3, "value", &value));
    OP_REQUIRES(ctx, action >= 0 && action <= 3,
                absl::InvalidArgumentError(absl::StrCat(
                    "barrier action must be 0 (state), 1 (begin), 2 (ack) or 3 (end), got ",
                    action)));
    ::tensorflow::core::RefCountPtr<SplitCoordinatorResource> c;
    OP_REQUIRES_OK(ctx, GetCoordinator(ctx, &c));
    Guarded(ctx, "barrier", [&] {
      const int64_t now = NowMs();
      if (action == 1) c->core.BarrierBegin(now, value);
      if (action == 2) c->core.BarrierAck(worker, value);
      if (action == 3) c->core.BarrierEnd(value);
      const SplitBarrier b = c->core.Barrier(now);
      OutScalar(ctx, 0, b.generation);
      Tensor* up = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({}), &up));
      up->scalar<bool>()() = b.up;
      OutScalar(ctx, 2, b.waiting);
    });
  }
};

class SplitCommitOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    const Tensor& keys = ctx->input(1);
    const Tensor& offsets = ctx->input(2);
    OP_REQUIRES(ctx, keys.NumElements() == offsets.NumElements(),
                absl::InvalidArgumentError(absl::StrCat(
                    "keys and offsets must have one entry each, got ", keys.NumElements(),
                    " and ", offsets.NumElements())));
    ::tensorflow::core::RefCountPtr<SplitCoordinatorResource> c;
    OP_REQUIRES_OK(ctx, GetCoordinator(ctx, &c));
    Guarded(ctx, "commit", [&] {
      OutScalar(ctx, 0, c->core.Commit(keys.flat<int64_t>().data(),
                                       offsets.flat<int64_t>().data(), keys.NumElements()));
    });
  }
};

class SplitRenewOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    int32_t worker = 0;
    bool release = false;
    OP_REQUIRES_OK(ctx, Scalar(ctx, 1, "worker", &worker));
    OP_REQUIRES_OK(ctx, Scalar(ctx, 2, "release", &release));
    ::tensorflow::core::RefCountPtr<SplitCoordinatorResource> c;
    OP_REQUIRES_OK(ctx, GetCoordinator(ctx, &c));
    if (release) {
      OutScalar(ctx, 0, c->core.Release(worker));
    } else {
      c->core.Renew(worker, NowMs());
      OutScalar(ctx, 0, 0);
    }
  }
};

class SplitGiveBackOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    int32_t worker = 0;
    OP_REQUIRES_OK(ctx, Scalar(ctx, 1, "worker", &worker));
    const Tensor& keys = ctx->input(2);
    ::tensorflow::core::RefCountPtr<SplitCoordinatorResource> c;
    OP_REQUIRES_OK(ctx, GetCoordinator(ctx, &c));
    OutScalar(ctx, 0, c->core.GiveBack(worker, keys.flat<int64_t>().data(), keys.NumElements()));
  }
};

class SplitStatsOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<SplitCoordinatorResource> c;
    OP_REQUIRES_OK(ctx, GetCoordinator(ctx, &c));
    const SplitStats s = c->core.Stats();
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({6}), &out));
    auto v = out->flat<int64_t>();
    v(0) = s.first_open;
    v(1) = s.splits;
    v(2) = s.done;
    v(3) = s.leased;
    v(4) = s.left;
    v(5) = s.leases_returned;
  }
};

class SplitStreamOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    int32_t action = 0;
    OP_REQUIRES_OK(ctx, Scalar(ctx, 1, "action", &action));
    ::tensorflow::core::RefCountPtr<SplitCoordinatorResource> c;
    OP_REQUIRES_OK(ctx, GetCoordinator(ctx, &c));
    std::vector<std::string> files_out;
    int64_t value = 0;
    if (action == 0) {
      tstring digest;
      int64_t seed = 0, lease_ms = 0;
      OP_REQUIRES_OK(ctx, Scalar(ctx, 2, "digest", &digest));
      OP_REQUIRES_OK(ctx, Scalar(ctx, 3, "seed", &seed));
      OP_REQUIRES_OK(ctx, Scalar(ctx, 4, "lease_ms", &lease_ms));
      Guarded(ctx, "configure a stream", [&] {
        c->core.ConfigureStream(std::string(digest), static_cast<uint64_t>(seed), lease_ms);
        value = c->core.FirstOpen();
      });
    } else if (action == 1) {
      const auto names = ctx->input(5).flat<tstring>();
      const auto files = ctx->input(6).flat<int32_t>();
      const auto starts = ctx->input(7).flat<int64_t>();
      const auto ends = ctx->input(8).flat<int64_t>();
      OP_REQUIRES(ctx, files.size() == starts.size() && starts.size() == ends.size(),
                  absl::InvalidArgumentError(absl::StrCat(
                      "files, starts and ends must have one entry a split, got ",
                      files.size(), ", ", starts.size(), " and ", ends.size())));
      std::vector<std::string> list(static_cast<size_t>(names.size()));
      for (int64_t i = 0; i < names.size(); ++i) list[i] = std::string(names(i));
      std::vector<SplitSpec> splits(static_cast<size_t>(files.size()));
      for (int64_t i = 0; i < files.size(); ++i) splits[i] = {files(i), starts(i), ends(i)};
      Guarded(ctx, "append to a stream", [&] { value = c->core.Append(list, splits); });
    } else if (action == 2) {
      int64_t from = 0;
      OP_REQUIRES_OK(ctx, Scalar(ctx, 9, "from", &from));
      files_out = c->core.Files(from);
    } else if (action == 3) {
      c->core.StopStream();
    } else {
      ctx->SetStatus(absl::InvalidArgumentError(
          absl::StrCat("tfpsx input: a stream's action is 0..3, got ", action)));
    }
    if (!ctx->status().ok()) return;
    OutScalar(ctx, 0, value);
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            1, TensorShape({static_cast<int64_t>(files_out.size())}), &out));
    auto flat = out->flat<tstring>();
    for (size_t i = 0; i < files_out.size(); ++i) flat(i) = files_out[i];
  }
};

class SplitExportOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<SplitCoordinatorResource> c;
    OP_REQUIRES_OK(ctx, GetCoordinator(ctx, &c));
    Guarded(ctx, "export", [&] {
      Tensor* out = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
      out->scalar<tstring>()() = c->core.Export();
    });
  }
};

class SplitImportOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    tstring state;
    OP_REQUIRES_OK(ctx, Scalar(ctx, 1, "state", &state));
    ::tensorflow::core::RefCountPtr<SplitCoordinatorResource> c;
    OP_REQUIRES_OK(ctx, GetCoordinator(ctx, &c));
    Guarded(ctx, "restore", [&] {
      c->core.Import(std::string(state));
      OutScalar(ctx, 0, c->core.FirstOpen());
    });
  }
};

class ReadSplitOp : public OpKernel {
 public:
  explicit ReadSplitOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string format;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("format", &format));
    format_ = format == "tfrecord" ? RecordFormat::kTfRecord : RecordFormat::kText;
  }

  void Compute(OpKernelContext* ctx) override {
    tstring path;
    int64_t start = 0, resume = 0, end = 0, max_bytes = 0;
    OP_REQUIRES_OK(ctx, Scalar(ctx, 0, "path", &path));
    OP_REQUIRES_OK(ctx, Scalar(ctx, 1, "start", &start));
    OP_REQUIRES_OK(ctx, Scalar(ctx, 2, "resume", &resume));
    OP_REQUIRES_OK(ctx, Scalar(ctx, 3, "end", &end));
    OP_REQUIRES_OK(ctx, Scalar(ctx, 4, "max_bytes", &max_bytes));
    // Each record copied once, into the string it leaves in (a tstring moves into the
    // output without a copy).
    std::vector<tstring> found;
    std::vector<int64_t> found_ends;
    SplitRead read;
    try {
      read = ReadSplitRecords(std::string(path), format_, start, resume, end, max_bytes,
                              [&](const char* data, size_t size, int64_t record_end) {
                                found.emplace_back(data, size);
                                found_ends.push_back(record_end);
                              });
    } catch (const std::invalid_argument& e) {
      ctx->SetStatus(absl::InvalidArgumentError(absl::StrCat("tfpsx input: ", e.what())));
      return;
    } catch (const std::exception& e) {
      ctx->SetStatus(absl::DataLossError(absl::StrCat("tfpsx input: ", e.what())));
      return;
    }
    const int64_t n = static_cast<int64_t>(found.size());
    Tensor* records = nullptr;
    Tensor* ends = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &records));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({n}), &ends));
    auto r = records->flat<tstring>();
    auto e = ends->flat<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      r(i) = std::move(found[i]);
      e(i) = found_ends[i];
    }
    OutScalar(ctx, 2, read.next);
  }

 private:
  RecordFormat format_;
};

REGISTER_KERNEL_BUILDER(Name("TfpsxSplitConfigure").Device(DEVICE_CPU), SplitConfigureOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxSplitTake").Device(DEVICE_CPU), SplitTakeOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxSplitCommit").Device(DEVICE_CPU), SplitCommitOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxSplitBarrier").Device(DEVICE_CPU), SplitBarrierOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxSplitRenew").Device(DEVICE_CPU), SplitRenewOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxSplitGiveBack").Device(DEVICE_CPU), SplitGiveBackOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxSplitStats").Device(DEVICE_CPU), SplitStatsOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxSplitStream").Device(DEVICE_CPU), SplitStreamOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxSplitExport").Device(DEVICE_CPU), SplitExportOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxSplitImport").Device(DEVICE_CPU), SplitImportOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxReadSplit").Device(DEVICE_CPU), ReadSplitOp);

}  // namespace tfpsx

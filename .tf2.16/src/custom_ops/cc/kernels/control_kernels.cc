// Kernels for the tfpsx control-plane counter (see ../ops/control_ops.cc).

#include <cstdint>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/mutex.h"

namespace tfpsx {

using ::tensorflow::DEVICE_CPU;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;

class CounterResource : public ::tensorflow::ResourceBase {
 public:
  std::string DebugString() const override {
    ::tensorflow::mutex_lock l(mu_);
    return absl::StrCat("TfpsxCounter(value=", value_,
                        ", members=", members_.size(), ")");
  }

  int64_t Add(int64_t delta) {
    ::tensorflow::mutex_lock l(mu_);
    value_ += delta;
    return value_;
  }

  int64_t Read() const {
    ::tensorflow::mutex_lock l(mu_);
    return value_;
  }

  int64_t Mark(int64_t member) {
    ::tensorflow::mutex_lock l(mu_);
    members_.insert(member);
    return static_cast<int64_t>(members_.size());
  }

  std::set<int64_t> Members() const {
    ::tensorflow::mutex_lock l(mu_);
    return members_;
  }

 private:
  mutable ::tensorflow::mutex mu_;
  int64_t value_ = 0;
  std::set<int64_t> members_;
};

REGISTER_KERNEL_BUILDER(Name("TfpsxCounterHandleOp").Device(DEVICE_CPU),
                        ::tensorflow::ResourceHandleOp<CounterResource>);

namespace {

absl::Status GetCounter(OpKernelContext* ctx,
                        ::tensorflow::core::RefCountPtr<CounterResource>* out) {
  return ::tensorflow::LookupOrCreateResource<CounterResource>(
      ctx, ::tensorflow::HandleFromInput(ctx, 0), out,
      [](CounterResource** c) {
        *c = new CounterResource();
        return absl::OkStatus();
      });
}

absl::Status ScalarInput(OpKernelContext* ctx, int index, const char* name,
                         int64_t* out) {
  const Tensor& t = ctx->input(index);
  if (!::tensorflow::TensorShapeUtils::IsScalar(t.shape())) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " must be a scalar int64, got shape ",
                     t.shape().DebugString()));
  }
  *out = t.scalar<int64_t>()();
  return absl::OkStatus();
}

void SetScalar(OpKernelContext* ctx, int64_t v) {
  Tensor* out = nullptr;
  OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
  out->scalar<int64_t>()() = v;
}

}  // namespace

class CounterAddOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    int64_t delta = 0;
    OP_REQUIRES_OK(ctx, ScalarInput(ctx, 1, "delta", &delta));
    ::tensorflow::core::RefCountPtr<CounterResource> counter;
    OP_REQUIRES_OK(ctx, GetCounter(ctx, &counter));
    SetScalar(ctx, counter->Add(delta));
  }
};

class CounterReadOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<CounterResource> counter;
    OP_REQUIRES_OK(ctx, GetCounter(ctx, &counter));
    SetScalar(ctx, counter->Read());
  }
};

class CounterMarkOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    int64_t member = 0;
    OP_REQUIRES_OK(ctx, ScalarInput(ctx, 1, "member", &member));
    OP_REQUIRES(ctx, member >= 0,
                absl::InvalidArgumentError(absl::StrCat(
                    "member must be >= 0 (a worker or server index), got ",
                    member)));
    ::tensorflow::core::RefCountPtr<CounterResource> counter;
    OP_REQUIRES_OK(ctx, GetCounter(ctx, &counter));
    SetScalar(ctx, counter->Mark(member));
  }
};

class CounterMembersOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<CounterResource> counter;
    OP_REQUIRES_OK(ctx, GetCounter(ctx, &counter));
    const std::set<int64_t> members = counter->Members();
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            0, TensorShape({static_cast<int64_t>(members.size())}),
                            &out));
    auto flat = out->flat<int64_t>();
    int64_t i = 0;
    for (int64_t m : members) flat(i++) = m;
  }
};

REGISTER_KERNEL_BUILDER(Name("TfpsxCounterAdd").Device(DEVICE_CPU), CounterAddOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxCounterRead").Device(DEVICE_CPU), CounterReadOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxCounterMark").Device(DEVICE_CPU), CounterMarkOp);
REGISTER_KERNEL_BUILDER(Name("TfpsxCounterMembers").Device(DEVICE_CPU),
                        CounterMembersOp);

}  // namespace tfpsx

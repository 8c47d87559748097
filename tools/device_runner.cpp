// The GPU side of `flashattn run` (compiled only with CUDA): the call's host views staged on
// one device, the outputs of a pass poisoned before each of its calls and copied back after the
// timed calls, and each call timed by a pair of CUDA events on the run's own stream.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "runner.hpp"

namespace flashattn::cli {
namespace {

// Every CUDA call goes through this: main prints "flashattn: error: <what>: <reason>", exit 2.
void check(cudaError_t status, const std::string& what) {
  if (status != cudaSuccess) throw std::runtime_error(what + ": " + cudaGetErrorString(status));
}

// Owning handles. Their deleters cannot report a failure (they run during unwinding, too); an
// error they would see is one an earlier, checked call has already reported.
struct FreeMemory {
  void operator()(void* p) const { cudaFree(p); }
};
struct DestroyStream {
  void operator()(cudaStream_t s) const { cudaStreamDestroy(s); }
};
struct DestroyEvent {
  void operator()(cudaEvent_t e) const { cudaEventDestroy(e); }
};
using DeviceMemoryPtr = std::unique_ptr<void, FreeMemory>;
using Stream = std::unique_ptr<std::remove_pointer_t<cudaStream_t>, DestroyStream>;
using Event = std::unique_ptr<std::remove_pointer_t<cudaEvent_t>, DestroyEvent>;

// The bytes a view spans (same strides on the device, gaps included); 0 when it is empty.
size_t span_bytes(const TensorView& t) {
  int64_t last = 0;
  for (int d = 0; d < t.ndim; ++d) {
    if (t.size(d) == 0) return 0;
    last += (t.size(d) - 1) * t.stride(d);
  }
  return static_cast<size_t>(last + 1) * dtype_size(t.dtype);
}

class DeviceRunner final : public Runner {
 public:
  DeviceRunner(const ForwardCall& host, const std::optional<BackwardCall>& host_backward,
               int32_t device)
      : call_(host) {
    check(cudaSetDevice(device), "cudaSetDevice(" + std::to_string(device) + ")");
    stream_ = make_stream();
    start_ = make_event();
    stop_ = make_event();

    const Device cuda{DeviceType::CUDA, device};
    call_.q = input("q", host.q, cuda);
    call_.k = input("k", host.k, cuda);
    call_.v = input("v", host.v, cuda);
    call_.out = output(Pass::Forward, "out", host.out, cuda);
    call_.lse = output(Pass::Forward, "lse", host.lse, cuda);
    if (host.options.alibi_slopes)
      call_.options.alibi_slopes = input("alibi_slopes", *host.options.alibi_slopes, cuda);
    if (host.varlen) {
      call_.varlen->cu_seqlens_q = input("cu_seqlens_q", host.varlen->cu_seqlens_q, cuda);
      call_.varlen->cu_seqlens_k = input("cu_seqlens_k", host.varlen->cu_seqlens_k, cuda);
      if (host.varlen->seqused_k)
        call_.varlen->seqused_k = input("seqused_k", *host.varlen->seqused_k, cuda);
    }
    if (host_backward) {
      BackwardCall& b = backward_.emplace();
      b.dout = input("dout", host_backward->dout, cuda);
      b.dq = output(Pass::Backward, "dq", host_backward->dq, cuda);
      b.dk = output(Pass::Backward, "dk", host_backward->dk, cuda);
      b.dv = output(Pass::Backward, "dv", host_backward->dv, cuda);
    }
    check(cudaStreamSynchronize(stream_.get()), "copying the inputs to the device");
    memory_.free_bytes_before = free_bytes();
  }

  const ForwardCall& call() const override { return call_; }
  const BackwardCall* backward_call() const override {
    return backward_ ? &*backward_ : nullptr;
  }
  void* stream() const override { return stream_.get(); }
  const char* timer() const override { return "cuda_events"; }

  double time(Pass pass, const std::function<void()>& call) override {
    for (const Output& o : outputs_)  // all-ones bytes are NaN in fp32, fp16 and bf16
      if (o.pass == pass)
        check(cudaMemsetAsync(o.device, 0xFF, o.bytes, stream_.get()), "poisoning " + o.name);
    check(cudaEventRecord(start_.get(), stream_.get()), "cudaEventRecord (start)");
    call();
    check(cudaEventRecord(stop_.get(), stream_.get()), "cudaEventRecord (stop)");
    check(cudaEventSynchronize(stop_.get()),
          std::string("the ") + (pass == Pass::Forward ? "forward" : "backward") +
              " call (waiting for its end)");
    float ms = 0.0f;
    check(cudaEventElapsedTime(&ms, start_.get(), stop_.get()), "cudaEventElapsedTime");
    return ms;
  }

  void finish() override {
    memory_.free_bytes_after = free_bytes();
    for (const Output& o : outputs_)
      check(cudaMemcpyAsync(o.host, o.device, o.bytes, cudaMemcpyDeviceToHost, stream_.get()),
            "copying " + o.name + " back to the host");
    check(cudaStreamSynchronize(stream_.get()), "copying the outputs back to the host");
  }

  std::optional<DeviceMemory> device_memory() const override { return memory_; }

 private:
  struct Output {
    Pass pass;  // the call that writes it
    std::string name;
    void* device;
    void* host;
    size_t bytes;
  };

  static Stream make_stream() {
    cudaStream_t s = nullptr;
    check(cudaStreamCreate(&s), "cudaStreamCreate");
    return Stream(s);
  }

  static Event make_event() {
    cudaEvent_t e = nullptr;
    check(cudaEventCreate(&e), "cudaEventCreate");
    return Event(e);
  }

  // A device buffer for a view (cudaMalloc: 256-byte aligned, so rows stay 16-byte aligned),
  // and the view moved onto it. Empty views keep a null pointer, as on the host.
  TensorView allocate(const std::string& name, const TensorView& host, Device device) {
    TensorView view = host;
    view.device = device;
    view.data = nullptr;
    const size_t bytes = span_bytes(host);
    if (bytes == 0) return view;
    void* p = nullptr;
    check(cudaMalloc(&p, bytes),
          "cudaMalloc for " + name + " (" + std::to_string(bytes) + " bytes)");
    DeviceMemoryPtr owned(p);  // owned before anything else can throw
    buffers_.push_back(std::move(owned));
    view.data = p;
    return view;
  }

  TensorView input(const std::string& name, const TensorView& host, Device device) {
    TensorView view = allocate(name, host, device);
    if (view.data != nullptr)
      check(cudaMemcpyAsync(view.data, host.data, span_bytes(host), cudaMemcpyHostToDevice,
                            stream_.get()),
            "copying " + name + " to the device");
    return view;
  }

  TensorView output(Pass pass, const std::string& name, const TensorView& host, Device device) {
    TensorView view = allocate(name, host, device);
    if (view.data != nullptr)
      outputs_.push_back({pass, name, view.data, host.data, span_bytes(host)});
    return view;
  }

  size_t free_bytes() const {
    size_t free = 0, total = 0;
    check(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
    return free;
  }

  // Declared first, destroyed last: buffers go before the stream and events they were used on.
  Stream stream_;
  Event start_, stop_;
  std::vector<DeviceMemoryPtr> buffers_;
  ForwardCall call_;  // the device views
  std::optional<BackwardCall> backward_;  // the device views, with --backward
  std::vector<Output> outputs_;
  DeviceMemory memory_;
};

}  // namespace

std::unique_ptr<Runner> make_device_runner(const ForwardCall& host,
                                           const std::optional<BackwardCall>& host_backward,
                                           int32_t device) {
  return std::make_unique<DeviceRunner>(host, host_backward, device);
}

}  // namespace flashattn::cli

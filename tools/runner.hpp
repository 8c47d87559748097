// Where `flashattn run` makes its forward (and, with --backward, backward) calls: on the host
// buffers themselves (the CPU path, in run.cpp) or on copies of them on a GPU
// (device_runner.cpp, compiled only with CUDA). run.cpp makes the problem on the host, hands its
// views to a Runner and from then on sees only this interface: the views to pass, the stream,
// "poison the outputs of this pass and time this call", and "put the outputs back in the host
// buffers".
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>

#include "flashattn/flashattn.hpp"

namespace flashattn::cli {

// The arguments of one forward call, as views (lse is always computed).
struct ForwardCall {
  TensorView q, k, v, out, lse;
  Options options;               // alibi_slopes among them
  std::optional<Varlen> varlen;  // ragged batches only
};

// What a backward call takes beyond the forward's views (q, k, v, out, lse, options, varlen):
// dout (an input, out's shape) and the gradients it writes (q's, k's and v's shapes).
struct BackwardCall {
  TensorView dout, dq, dk, dv;
};

// Which call time() measures, and so which outputs it poisons first.
enum class Pass {
  Forward,   // out and lse
  Backward,  // dq, dk and dv (out and lse are the backward's inputs: left alone)
};

// cudaMemGetInfo's free bytes on the run's device around the timed calls: a cross-check of
// RunInfo::workspace_bytes (an engine that kept memory would show up as a drop).
struct DeviceMemory {
  size_t free_bytes_before = 0;  // inputs and outputs allocated, before the warm-up call
  size_t free_bytes_after = 0;   // after the last timed call
};

class Runner {
 public:
  virtual ~Runner() = default;

  // The views the library gets (host views, or device views with Device{CUDA, index}).
  virtual const ForwardCall& call() const = 0;
  // The views of the backward call (device views on a GPU); null when the runner was made
  // without one (no --backward).
  virtual const BackwardCall* backward_call() const = 0;
  // The cudaStream_t for Execution::stream; null on the host.
  virtual void* stream() const { return nullptr; }
  // Poisons the outputs of `pass` (NaN everywhere, outside the timed region), runs `call` once
  // and returns the time it took in milliseconds.
  virtual double time(Pass pass, const std::function<void()>& call) = 0;
  // After the last timed call of every pass: all outputs (out, lse; dq, dk, dv) in the host
  // buffers, for --check.
  virtual void finish() {}
  // Only on a GPU.
  virtual std::optional<DeviceMemory> device_memory() const { return std::nullopt; }
  // What measured time(): for the report.
  virtual const char* timer() const = 0;
};

// device_runner.cpp (CUDA builds only): copies the host inputs of `host` (q, k, v, alibi
// slopes, cu_seqlens) and of `host_backward` when given (dout) to new buffers on CUDA device
// `device`, allocates the outputs there (out, lse; dq, dk, dv) and creates a stream; finish()
// copies the outputs back into the host views' buffers. A failing CUDA call throws
// std::runtime_error "<what>: <cudaGetErrorString>"; everything is freed on every path.
std::unique_ptr<Runner> make_device_runner(const ForwardCall& host,
                                           const std::optional<BackwardCall>& host_backward,
                                           int32_t device);

}  // namespace flashattn::cli

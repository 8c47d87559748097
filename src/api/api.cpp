// The public entry points: validate, build the normalised params, hand them to the chosen
// backend.
#include <cstddef>
#include <string>

#include "api/params.hpp"
#include "api/validate.hpp"
#include "common/mask.hpp"
#include "cpu/backward.hpp"
#include "cpu/forward.hpp"
#include "cpu/kvcache.hpp"
#include "cuda/backward.hpp"
#include "cuda/devices.hpp"
#include "cuda/forward.hpp"
#include "cuda/kvcache.hpp"
#include "flashattn/flashattn.hpp"

namespace flashattn {

namespace {

TensorView with_sizes(void* data, DType dtype, std::initializer_list<int64_t> sizes,
                      Device device) {
  if (sizes.size() > kMaxDims)
    throw Error(ErrorCode::InvalidArgument, "sizes", "at most 6 dimensions",
                std::to_string(sizes.size()));
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.ndim = static_cast<int32_t>(sizes.size());
  size_t i = 0;
  for (int64_t s : sizes) t.sizes[i++] = s;
  return t;
}

// The name of an enum value from its names in code order (the codes are 0, 1, ..., as in
// the C ABI); "unknown" for a code out of range.
template <size_t N>
const char* name_of_code(int32_t code, const char* const (&names)[N]) {
  return code >= 0 && static_cast<size_t>(code) < N ? names[code] : "unknown";
}

}  // namespace

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<int64_t> sizes,
                                  Device device) {
  TensorView t = with_sizes(data, dtype, sizes, device);
  int64_t stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.strides[static_cast<size_t>(d)] = stride;
    if (d > 0 && __builtin_mul_overflow(stride, t.sizes[static_cast<size_t>(d)], &stride))
      throw Error(ErrorCode::InvalidArgument, "sizes", "a shape whose strides fit in 64 bits",
                  "a dimension of size " + std::to_string(t.sizes[static_cast<size_t>(d)]));
  }
  return t;
}

TensorView TensorView::strided(void* data, DType dtype, std::initializer_list<int64_t> sizes,
                               std::initializer_list<int64_t> strides, Device device) {
  if (sizes.size() != strides.size())
    throw Error(ErrorCode::InvalidArgument, "strides",
                "one stride per size (" + std::to_string(sizes.size()) + ")",
                std::to_string(strides.size()) + " strides");
  TensorView t = with_sizes(data, dtype, sizes, device);
  size_t i = 0;
  for (int64_t s : strides) t.strides[i++] = s;
  return t;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim && d < kMaxDims; ++d)
    if (__builtin_mul_overflow(n, sizes[static_cast<size_t>(d)], &n))
      throw Error(ErrorCode::InvalidArgument, "sizes", "an element count that fits in 64 bits",
                  "a tensor with " + std::to_string(ndim) + " dimensions that overflows");
  return n;
}

const char* dtype_name(DType dtype) {
  return name_of_code(static_cast<int32_t>(dtype), {"fp32", "fp16", "bf16", "int32", "fp8_e4m3"});
}

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::Float32:
    case DType::Int32:
      return 4;
    case DType::Float16:
    case DType::BFloat16:
      return 2;
    case DType::Float8E4M3:
      return 1;
  }
  return 0;
}

const char* backend_name(Backend backend) {
  return name_of_code(static_cast<int32_t>(backend), {"auto", "cpu", "cuda"});
}

Error::Error(ErrorCode code, std::string argument, std::string expected, std::string given)
    : std::runtime_error(argument + ": expected " + expected + ", given " + given),
      code_(code),
      argument_(std::move(argument)),
      expected_(std::move(expected)),
      given_(std::move(given)) {}

namespace {

// Runs a validated call on its resolved backend: cpu() or cuda(), whatever they return.
template <typename Cpu, typename Cuda>
auto on_backend(Backend backend, const char* kernel, const Cpu& cpu, const Cuda& cuda) {
  switch (backend) {
    case Backend::CPU:
      return cpu();
    case Backend::CUDA:
      return cuda();
    case Backend::Auto:
      break;
  }
  throw Error(ErrorCode::Internal, "backend",
              std::string("a resolved backend with a ") + kernel + " kernel",
              backend_name(backend));
}

// What a backend's entry point returned, as RunInfo.
RunInfo report(Backend backend, size_t workspace_bytes) {
  RunInfo info;
  info.backend = backend;
  info.workspace_bytes = workspace_bytes;
  return info;
}

RunInfo report(Backend backend, const detail::KvCacheRun& done) {
  RunInfo info = report(backend, done.workspace_bytes);
  info.num_splits = done.num_splits;
  return info;
}

RunInfo run(Backend backend, const detail::ForwardParams& params) {
  const auto cpu = [&] { return detail::cpu::forward(params); };
  const auto cuda = [&] { return detail::cuda::forward(params); };
  return report(backend, on_backend(backend, "forward", cpu, cuda));
}

RunInfo run(Backend backend, const detail::BackwardParams& params) {
  const auto cpu = [&] { return detail::cpu::backward(params); };
  const auto cuda = [&] { return detail::cuda::backward(params); };
  RunInfo info = report(backend, on_backend(backend, "backward", cpu, cuda));
  // The CPU backward is deterministic whatever was asked (docs/ARCHITECTURE.md); the CUDA
  // one's default mode adds dQ with atomics, in no fixed order.
  if (backend == Backend::CUDA) info.deterministic = params.deterministic;
  return info;
}

RunInfo run(Backend backend, const detail::ProbabilitiesParams& params) {
  const auto cpu = [&] { return detail::cpu::probabilities(params); };
  const auto cuda = [&] { return detail::cuda::probabilities(params); };
  return report(backend, on_backend(backend, "probabilities", cpu, cuda));
}

RunInfo run(Backend backend, const detail::KvCacheParams& params) {
  const auto cpu = [&] { return detail::cpu::forward_kvcache(params); };
  const auto cuda = [&] { return detail::cuda::forward_kvcache(params); };
  return report(backend, on_backend(backend, "KV-cache", cpu, cuda));
}

// Each call: validate (api/validate.hpp), build the params (api/params.hpp), run.
RunInfo run_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                    const TensorView& out, const std::optional<TensorView>& lse,
                    const Varlen* varlen, const Options& options, const Execution& execution) {
  const detail::ValidatedCall call =
      detail::validate_forward(q, k, v, out, lse, varlen, options, execution);
  return run(call.backend,
             detail::forward_params(q, k, v, out, lse, varlen, options, execution, call));
}

RunInfo run_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                     const TensorView& out, const TensorView& dout, const TensorView& lse,
                     const TensorView& dq, const TensorView& dk, const TensorView& dv,
                     const Varlen* varlen, const Options& options, const Execution& execution) {
  const detail::ValidatedCall call = detail::validate_backward(q, k, v, out, dout, lse, dq, dk,
                                                               dv, varlen, options, execution);
  return run(call.backend, detail::backward_params(q, k, v, out, dout, lse, dq, dk, dv, varlen,
                                                   options, execution, call));
}

RunInfo run_probabilities(const TensorView& q, const TensorView& k, const TensorView& probs,
                          const Varlen* varlen, const Options& options,
                          const Execution& execution) {
  const detail::ValidatedCall call =
      detail::validate_probabilities(q, k, probs, varlen, options, execution);
  return run(call.backend,
             detail::probabilities_params(q, k, probs, varlen, options, execution, call));
}

}  // namespace

RunInfo attention_probabilities(const TensorView& q, const TensorView& k, const TensorView& probs,
                                const Options& options, const Execution& execution) {
  return run_probabilities(q, k, probs, nullptr, options, execution);
}

RunInfo attention_probabilities_varlen(const TensorView& q, const TensorView& k,
                                       const TensorView& probs, const Varlen& varlen,
                                       const Options& options, const Execution& execution) {
  return run_probabilities(q, k, probs, &varlen, options, execution);
}

RunInfo backward(const TensorView& q, const TensorView& k, const TensorView& v,
                 const TensorView& out, const TensorView& dout, const TensorView& lse,
                 const TensorView& dq, const TensorView& dk, const TensorView& dv,
                 const Options& options, const Execution& execution) {
  return run_backward(q, k, v, out, dout, lse, dq, dk, dv, nullptr, options, execution);
}

RunInfo backward_varlen(const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& out, const TensorView& dout, const TensorView& lse,
                        const TensorView& dq, const TensorView& dk, const TensorView& dv,
                        const Varlen& varlen, const Options& options,
                        const Execution& execution) {
  return run_backward(q, k, v, out, dout, lse, dq, dk, dv, &varlen, options, execution);
}

RunInfo forward(const TensorView& q, const TensorView& k, const TensorView& v,
                const TensorView& out, const std::optional<TensorView>& lse,
                const Options& options, const Execution& execution) {
  return run_forward(q, k, v, out, lse, nullptr, options, execution);
}

RunInfo forward_varlen(const TensorView& q, const TensorView& k, const TensorView& v,
                       const TensorView& out, const std::optional<TensorView>& lse,
                       const Varlen& varlen, const Options& options,
                       const Execution& execution) {
  return run_forward(q, k, v, out, lse, &varlen, options, execution);
}

RunInfo forward_kvcache(const TensorView& q, const KvCache& cache, const TensorView& out,
                        const std::optional<TensorView>& lse, const Options& options,
                        const Execution& execution) {
  const detail::ValidatedCall call =
      detail::validate_kvcache(q, cache, out, lse, options, execution);
  return run(call.backend, detail::kvcache_params(q, cache, out, lse, options, execution, call));
}

const char* version() { return FLASHATTN_VERSION; }

bool cuda_compiled() { return detail::cuda::compiled(); }

std::vector<std::string> cuda_architectures() { return detail::cuda::architectures(); }

std::vector<CudaDevice> cuda_devices(std::string* why) { return detail::cuda::devices(why); }

KeyRange visible_keys(int64_t row, int64_t seqlen_q, int64_t seqlen_k, const Options& options) {
  const detail::KeyRange r = detail::visible_keys(row, seqlen_q, seqlen_k, options.window_left,
                                                  detail::window_right_of(options));
  return {r.begin, r.end};
}

}  // namespace flashattn

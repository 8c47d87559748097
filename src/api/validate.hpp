// Argument checking: the only place that validates. Turns a public call into a ForwardParams
// (or BackwardParams, KvCacheParams) or throws flashattn::Error naming the argument, the expectation and the given value. Runs
// before any backend touches memory, so a rejected call writes nothing.
#pragma once

#include <optional>

#include "common/kvcache.hpp"
#include "common/params.hpp"
#include "flashattn/flashattn.hpp"

namespace flashattn::detail {

struct ValidatedForward {
  ForwardParams params;
  Backend backend = Backend::CPU;  // resolved: never Auto
};

ValidatedForward validate_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                                  const TensorView& out, const std::optional<TensorView>& lse,
                                  const Varlen* varlen, const Options& options,
                                  const Execution& execution);

struct ValidatedBackward {
  BackwardParams params;
  Backend backend = Backend::CPU;  // resolved: never Auto
};

// Everything validate_forward checks (out and lse now being inputs, lse required), plus
// dout like out, dq/dk/dv like q/k/v, and gradients disjoint from every input and each other.
ValidatedBackward validate_backward(const TensorView& q, const TensorView& k,
                                    const TensorView& v, const TensorView& out,
                                    const TensorView& dout, const TensorView& lse,
                                    const TensorView& dq, const TensorView& dk,
                                    const TensorView& dv, const Varlen* varlen,
                                    const Options& options, const Execution& execution);

struct ValidatedKvCache {
  KvCacheParams params;
  Backend backend = Backend::CPU;  // resolved: never Auto
};

// forward_kvcache's checks: the forward's rules for q, out, lse and the options (dropout
// rejected), the caches (dense or paged), k_new/v_new, the rotary tables and the int32
// per-sequence tensors, and that nothing written (out, lse, the caches when k_new is given)
// overlaps anything read. Integer values are checked when they are in host memory (the CPU
// backend): every position read or written exists, no two sequences write one cache row,
// the rotary tables cover every rotated position. CUDA kernels trust them.
ValidatedKvCache validate_kvcache(const TensorView& q, const KvCache& cache,
                                  const TensorView& out, const std::optional<TensorView>& lse,
                                  const Options& options, const Execution& execution);

}  // namespace flashattn::detail

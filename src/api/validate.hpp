// Argument checking: the only place that validates. Turns a public call into a ForwardParams
// (or BackwardParams)
// or throws flashattn::Error naming the argument, the expectation and the given value. Runs
// before any backend touches memory, so a rejected call writes nothing.
#pragma once

#include <optional>

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

}  // namespace flashattn::detail

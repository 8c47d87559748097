// The params of a validated call (api/validate.hpp): the public arguments turned into the
// plain description every backend consumes (common/params.hpp, common/kvcache.hpp), defaults
// resolved. Builds only; every check is the validator's.
#pragma once

#include <cstdint>
#include <optional>

#include "api/validate.hpp"
#include "common/kvcache.hpp"
#include "common/params.hpp"
#include "flashattn/flashattn.hpp"

namespace flashattn::detail {

// The window's right edge as the params hold it: causal is window_right = 0.
int32_t window_right_of(const Options& options);

ForwardParams forward_params(const TensorView& q, const TensorView& k, const TensorView& v,
                             const TensorView& out, const std::optional<TensorView>& lse,
                             const Varlen* varlen, const Options& options,
                             const Execution& execution, const ValidatedCall& call);

BackwardParams backward_params(const TensorView& q, const TensorView& k, const TensorView& v,
                               const TensorView& out, const TensorView& dout,
                               const TensorView& lse, const TensorView& dq, const TensorView& dk,
                               const TensorView& dv, const Varlen* varlen, const Options& options,
                               const Execution& execution, const ValidatedCall& call);

// The forward's params of the same call without v, out and lse, plus probs' strides.
ProbabilitiesParams probabilities_params(const TensorView& q, const TensorView& k,
                                         const TensorView& probs, const Varlen* varlen,
                                         const Options& options, const Execution& execution,
                                         const ValidatedCall& call);

KvCacheParams kvcache_params(const TensorView& q, const KvCache& cache, const TensorView& out,
                             const std::optional<TensorView>& lse, const Options& options,
                             const Execution& execution, const ValidatedCall& call);

}  // namespace flashattn::detail

// The CUDA backend's forward entry point (host side).
#pragma once

#include <cstddef>

#include "common/params.hpp"

namespace flashattn::detail::cuda {

// Runs the validated call on params.stream; returns the bytes of device memory it allocated:
// none, the forward writes only out and lse, unless the head dim is not a multiple of 8 (then
// the padded copies of q, k, v and out, cuda/head_dim_padding.hpp).
size_t forward(const ForwardParams& params);

// attention_probabilities on params.fwd.stream (cuda/probabilities.cu): a simple kernel, no
// workspace.
size_t probabilities(const ProbabilitiesParams& params);

}  // namespace flashattn::detail::cuda

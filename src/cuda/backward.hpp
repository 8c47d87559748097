// The CUDA backend's backward entry point (host side).
#pragma once

#include <cstddef>

#include "common/params.hpp"

namespace flashattn::detail::cuda {

// Runs the validated call on params.fwd.stream; returns the bytes of device workspace it
// allocated (stream-ordered, freed on the same stream before it returns), the padded copies
// of a head dim that is not a multiple of 8 included (cuda/head_dim_padding.hpp).
size_t backward(const BackwardParams& params);

}  // namespace flashattn::detail::cuda

// The CPU backend's backward entry point.
#pragma once

#include <cstddef>

#include "common/params.hpp"

namespace flashattn::detail::cpu {

// Runs the validated call; returns the bytes of working memory it allocated.
size_t backward(const BackwardParams& params);

}  // namespace flashattn::detail::cpu

// The CPU backend's forward entry point.
#pragma once

#include <cstddef>

#include "common/params.hpp"

namespace flashattn::detail::cpu {

// Runs the validated call; returns the bytes of working memory it allocated.
size_t forward(const ForwardParams& params);

// attention_probabilities (cpu/probabilities.cpp); returns the bytes of working memory it
// allocated.
size_t probabilities(const ProbabilitiesParams& params);

}  // namespace flashattn::detail::cpu

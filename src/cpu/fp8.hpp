// The CPU backend's forward for FP8 (e4m3) inputs (cpu/fp8.cpp).
#pragma once

#include <cstddef>

#include "common/params.hpp"

namespace flashattn::detail::cpu {

// Runs a validated call whose q, k, v are fp8 e4m3 (out bf16): dequantises them exactly into
// fp32 copies and runs the fp32 engine. Returns the bytes of working memory it allocated
// (the copies included).
size_t forward_fp8(const ForwardParams& params);

}  // namespace flashattn::detail::cpu

// The CPU engine's exponential, shared with the CPU benchmark's naive path so that both pay
// the same for it.
#pragma once

#include <cstdint>
#include <limits>

#include "common/numeric.hpp"

namespace flashattn::detail::cpu {

// exp(x) for x in [-87, 88], with a relative error of a few ulp, written so that loops over
// it vectorise (std::exp does not without -ffast-math): x = n ln2 + r with |r| <= ln2/2
// (Cody-Waite split of ln2), exp(r) by its Taylor series to degree 7 (truncation < 1e-8),
// times 2^n built in the exponent bits.
inline float exp_in_range(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693145751953125f;  // ln2 with its low bits cleared: n*hi is exact
  constexpr float kLn2Lo = 1.42860682030941723e-6f;
  const float n = (x * kLog2e + 12582912.0f) - 12582912.0f;  // round to nearest
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t exponent = static_cast<int32_t>(n) + 127;
  return p * bits_to_float(static_cast<uint32_t>(exponent) << 23);
}

// exp(x) for any float: -inf and anything below the smallest normal give 0, past 88 +inf;
// NaN stays NaN.
inline float exp_approx(float x) {
  // Written so that NaN fails both tests and lands on a bound: the conversion of n to int
  // in exp_in_range is undefined for NaN (clang's UBSan float-cast-overflow; found by
  // fuzz_kvcache). One exit, selects only: early returns would be control flow that keeps
  // GCC from vectorising the loops that call this.
  const float clamped = x >= -87.0f ? (x <= 88.0f ? x : 88.0f) : -87.0f;
  const float result = exp_in_range(clamped);
  const float bounded = x > 88.0f ? std::numeric_limits<float>::infinity() : result;
  return x < -87.0f ? 0.0f : (x != x ? x : bounded);
}

// exp(x) for x <= 0 or -inf, never NaN: a softmax row less its max. exp_approx without the
// selects that only overflow and NaN need (a fifth of its cost in the forward's softmax).
inline float exp_nonpositive(float x) {
  const float result = exp_in_range(x >= -87.0f ? x : -87.0f);
  return x >= -87.0f ? result : 0.0f;
}

}  // namespace flashattn::detail::cpu

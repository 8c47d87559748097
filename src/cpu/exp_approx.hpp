// The CPU engine's exponential, shared with the CPU benchmark's naive path so that both pay
// the same for it.
#pragma once

#include <cstdint>
#include <limits>

#include "common/numeric.hpp"

namespace flashattn::detail::cpu {

// exp(x) in float with a relative error of a few ulp, written so that loops over it
// vectorise (std::exp does not without -ffast-math): x = n ln2 + r with |r| <= ln2/2
// (Cody-Waite split of ln2), exp(r) by its Taylor series to degree 7 (truncation < 1e-8),
// times 2^n built in the exponent bits. -inf and anything below the smallest normal give 0;
// NaN stays NaN.
inline float exp_approx(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693145751953125f;  // ln2 with its low bits cleared: n*hi is exact
  constexpr float kLn2Lo = 1.42860682030941723e-6f;
  // Written so that NaN fails both tests and lands on a bound: the conversion of n to int
  // below is undefined for NaN (clang's UBSan float-cast-overflow; found by fuzz_kvcache).
  const float clamped = x >= -87.0f ? (x <= 88.0f ? x : 88.0f) : -87.0f;
  const float n = (clamped * kLog2e + 12582912.0f) - 12582912.0f;  // round to nearest
  const float r = (clamped - n * kLn2Hi) - n * kLn2Lo;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t exponent = static_cast<int32_t>(n) + 127;
  const float result = p * bits_to_float(static_cast<uint32_t>(exponent) << 23);
  if (x < -87.0f) return 0.0f;
  if (x > 88.0f) return std::numeric_limits<float>::infinity();
  return x != x ? x : result;
}

}  // namespace flashattn::detail::cpu

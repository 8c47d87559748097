// Storage types of the CPU engine and the reference: IEEE binary16, bfloat16 and FP8 e4m3
// held as raw bits, converted to and from float. The conversions are branch-free so that loops over
// whole tiles vectorise.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace flashattn::detail {

struct half_t {
  uint16_t bits;
};
struct bfloat16_t {
  uint16_t bits;
};
// FP8 e4m3 as float8_e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities;
// S.1111.111 is NaN, so the largest finite value is S.1111.110 = 448.
struct float8_e4m3_t {
  uint8_t bits;
};
inline constexpr float kFloat8E4M3Max = 448.0f;

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float to_float(float x) { return x; }

inline float to_float(bfloat16_t x) { return bits_to_float(static_cast<uint32_t>(x.bits) << 16); }

inline float to_float(half_t x) {
  const uint32_t h = x.bits;
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t magnitude = h & 0x7fffu;
  // Shifting the exponent+mantissa into float position and scaling by 2^(127-15) converts
  // normal and subnormal halves exactly; only Inf/NaN (exponent all ones) need fixing up.
  const float scaled = bits_to_float(magnitude << 13) * 0x1p112f;
  const uint32_t finite_bits = float_to_bits(scaled);
  const uint32_t special_bits = (magnitude << 13) | 0x7f800000u;
  return bits_to_float(sign | (magnitude >= 0x7c00u ? special_bits : finite_bits));
}

// Exact: every e4m3 value is a float. Subnormals (exponent field 0) are m * 2^-9.
inline float to_float(float8_e4m3_t x) {
  const uint32_t exponent = (x.bits >> 3) & 0xfu;
  const uint32_t mantissa = x.bits & 0x7u;
  const float sign = (x.bits & 0x80u) ? -1.0f : 1.0f;
  if (exponent == 0xfu && mantissa == 0x7u) return sign * std::nanf("");
  if (exponent == 0) return sign * std::ldexp(static_cast<float>(mantissa), -9);
  return sign * std::ldexp(static_cast<float>(8u + mantissa), static_cast<int>(exponent) - 10);
}

// Round to nearest even, saturating: every magnitude above 448 (Inf included) becomes 448, as
// CUDA's __NV_SATFINITE conversion does (PyTorch's .to(float8_e4m3fn) gives NaN there instead:
// quantisers scale into range first). NaN stays NaN.
inline float8_e4m3_t to_float8_e4m3(float f) {
  const uint32_t u = float_to_bits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return {static_cast<uint8_t>(sign | 0x7fu)};  // NaN
  if (a < 0x3c800000u) {
    // Below 2^-6, the smallest normal: a multiple of 2^-9, rounded by the FPU (nearest even).
    // 8 * 2^-9 is 2^-6, whose code is 8 too: the count is the code.
    return {static_cast<uint8_t>(sign | static_cast<uint8_t>(std::nearbyint(bits_to_float(a) * 512.0f)))};
  }
  // Keep 3 of the 23 mantissa bits, rounding to nearest even (a carry bumps the exponent), and
  // rebias the exponent 127 -> 7.
  const uint32_t rounded = a + 0x7ffffu + ((a >> 20) & 1u);
  const uint32_t code = (((rounded >> 23) - 120u) << 3) | ((rounded >> 20) & 0x7u);
  return {static_cast<uint8_t>(sign | (code > 0x7eu ? 0x7eu : code))};
}

// Round to nearest even; NaN stays NaN.
inline bfloat16_t to_bfloat16(float f) {
  const uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {static_cast<uint16_t>((u >> 16) | 0x40u)};
  const uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return {static_cast<uint16_t>((u + rounding) >> 16)};
}

// Round to nearest even, overflow to Inf, underflow through subnormals to zero; NaN stays NaN.
inline half_t to_half(float f) {
  const uint32_t u = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return {static_cast<uint16_t>(sign | 0x7e00u)};  // NaN
  if (a >= 0x477ff000u) return {static_cast<uint16_t>(sign | 0x7c00u)};  // rounds to Inf
  if (a < 0x38800000u) {
    // Subnormal or zero half: adding 0.5 makes the FPU do the rounding to a multiple of 2^-24.
    const float rounded = bits_to_float(a) + 0.5f;
    return {static_cast<uint16_t>(sign | (float_to_bits(rounded) - 0x3f000000u))};
  }
  const uint32_t mantissa_odd = (a >> 13) & 1u;
  const uint32_t biased = a + 0xc8000fffu + mantissa_odd;  // rebias exponent 127 -> 15, round
  return {static_cast<uint16_t>(sign | (biased >> 13))};
}

template <typename T>
T from_float(float f);
template <>
inline float from_float<float>(float f) {
  return f;
}
template <>
inline half_t from_float<half_t>(float f) {
  return to_half(f);
}
template <>
inline bfloat16_t from_float<bfloat16_t>(float f) {
  return to_bfloat16(f);
}
template <>
inline float8_e4m3_t from_float<float8_e4m3_t>(float f) {
  return to_float8_e4m3(f);
}

// Rounds a float through storage type T and back (what storing in T loses).
template <typename T>
float round_through(float f) {
  return to_float(from_float<T>(f));
}

}  // namespace flashattn::detail

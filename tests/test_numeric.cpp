// The fp16/bf16 storage conversions, checked exhaustively or against an independent rule.
#include <cmath>
#include <limits>

#include "support.hpp"

namespace flashattn::detail {
namespace {

// IEEE binary16 decoded from its fields with ldexp: an independent statement of the format.
double decode_half(uint16_t h) {
  const int sign = h >> 15, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  double magnitude;
  if (exponent == 0x1f)
    magnitude = mantissa ? std::numeric_limits<double>::quiet_NaN()
                         : std::numeric_limits<double>::infinity();
  else if (exponent == 0)
    magnitude = std::ldexp(mantissa, -24);
  else
    magnitude = std::ldexp(1024 + mantissa, exponent - 25);
  return sign ? -magnitude : magnitude;
}

TEST(Numeric, HalfToFloatIsExactForEveryBitPattern) {
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    const double expected = decode_half(static_cast<uint16_t>(bits));
    const float got = to_float(half_t{static_cast<uint16_t>(bits)});
    if (std::isnan(expected))
      ASSERT_TRUE(std::isnan(got)) << bits;
    else
      ASSERT_EQ(static_cast<double>(got), expected) << bits;
  }
}

TEST(Numeric, HalfRoundTripsEveryNonNanValue) {
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    const half_t h{static_cast<uint16_t>(bits)};
    if (std::isnan(to_float(h))) {
      EXPECT_TRUE(std::isnan(to_float(to_half(to_float(h)))));
      continue;
    }
    ASSERT_EQ(to_half(to_float(h)).bits, h.bits) << bits;
  }
}

// The result of rounding f must be a nearest representable value, ties to even mantissa.
template <typename T>
void expect_rounds_to_nearest_even(float f, T got, T below, T above) {
  const double d = f, lo = to_float(below), hi = to_float(above), g = to_float(got);
  const double err_lo = std::abs(d - lo), err_hi = std::abs(d - hi);
  if (err_lo < err_hi) {
    EXPECT_EQ(g, lo) << f;
  } else if (err_hi < err_lo) {
    EXPECT_EQ(g, hi) << f;
  } else {
    EXPECT_EQ(got.bits % 2, 0) << "tie must round to even: " << f;
  }
}

TEST(Numeric, FloatToHalfRoundsToNearestEven) {
  for (int n = 0; n < 200000; ++n) {
    // Finite floats within half's range (max 65504), including subnormal halves.
    const float f = std::ldexp(std::uniform_real_distribution<float>(-1.0f, 1.0f)(testing::rng()),
                               std::uniform_int_distribution<int>(-26, 15)(testing::rng()));
    const half_t got = to_half(f);
    // The two halves around |f| (walking the bit pattern is monotone for one sign).
    const uint16_t sign = f < 0 ? 0x8000 : 0;
    uint16_t mag = static_cast<uint16_t>(got.bits & 0x7fff);
    const double af = std::abs(static_cast<double>(f));
    if (to_float(half_t{mag}) > af && mag > 0) --mag;
    expect_rounds_to_nearest_even(f, got, half_t{static_cast<uint16_t>(sign | mag)},
                                  half_t{static_cast<uint16_t>(sign | (mag + 1))});
  }
  EXPECT_EQ(to_half(65520.0f).bits, 0x7c00);  // halfway past the largest half: Inf
  EXPECT_EQ(to_half(65519.0f).bits, 0x7bff);
  EXPECT_EQ(to_half(-1e9f).bits, 0xfc00);
  EXPECT_EQ(to_half(std::ldexp(1.0f, -25)).bits, 0);       // tie between 0 and 2^-24: even
  EXPECT_EQ(to_half(std::ldexp(1.5f, -25)).bits, 1);       // just above the tie
  EXPECT_TRUE(std::isnan(to_float(to_half(std::nanf("")))));
}

TEST(Numeric, FloatToBfloat16RoundsToNearestEven) {
  for (int n = 0; n < 200000; ++n) {
    const float f = std::ldexp(std::uniform_real_distribution<float>(-1.0f, 1.0f)(testing::rng()),
                               std::uniform_int_distribution<int>(-130, 120)(testing::rng()));
    const bfloat16_t got = to_bfloat16(f);
    const uint32_t truncated = float_to_bits(f) >> 16;  // toward zero
    expect_rounds_to_nearest_even(f, got, bfloat16_t{static_cast<uint16_t>(truncated)},
                                  bfloat16_t{static_cast<uint16_t>(truncated + 1)});
  }
  EXPECT_TRUE(std::isnan(to_float(to_bfloat16(std::nanf("")))));
  EXPECT_EQ(to_float(to_bfloat16(std::numeric_limits<float>::infinity())),
            std::numeric_limits<float>::infinity());
}

}  // namespace
}  // namespace flashattn::detail

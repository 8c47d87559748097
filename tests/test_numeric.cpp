// The fp16/bf16/fp8 e4m3 storage conversions, checked exhaustively or against an independent rule.
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


// FP8 e4m3 (float8_e4m3fn) decoded from its fields with ldexp: 4 exponent bits of bias 7, 3
// mantissa bits, subnormals m * 2^-9, no infinities, S.1111.111 NaN.
double decode_e4m3(uint8_t x) {
  const int sign = x >> 7, exponent = (x >> 3) & 0xf, mantissa = x & 7;
  double magnitude;
  if (exponent == 0xf && mantissa == 7)
    magnitude = std::numeric_limits<double>::quiet_NaN();
  else if (exponent == 0)
    magnitude = std::ldexp(mantissa, -9);
  else
    magnitude = std::ldexp(8 + mantissa, exponent - 10);
  return sign ? -magnitude : magnitude;
}

TEST(Numeric, E4m3ToFloatIsExactForEveryBitPattern) {
  EXPECT_EQ(decode_e4m3(0x7e), 448.0);
  EXPECT_EQ(decode_e4m3(0x01), std::ldexp(1.0, -9));
  for (uint32_t bits = 0; bits < 256; ++bits) {
    const double expected = decode_e4m3(static_cast<uint8_t>(bits));
    const float got = to_float(float8_e4m3_t{static_cast<uint8_t>(bits)});
    if (std::isnan(expected))
      ASSERT_TRUE(std::isnan(got)) << bits;
    else
      ASSERT_EQ(static_cast<double>(got), expected) << bits;
  }
}

TEST(Numeric, E4m3RoundTripsEveryNonNanValue) {
  for (uint32_t bits = 0; bits < 256; ++bits) {
    const float8_e4m3_t x{static_cast<uint8_t>(bits)};
    if (std::isnan(to_float(x))) {
      EXPECT_TRUE(std::isnan(to_float(to_float8_e4m3(to_float(x)))));
      continue;
    }
    ASSERT_EQ(to_float8_e4m3(to_float(x)).bits, x.bits) << bits;
  }
}

// The nearest of the 127 positive finite values (and zero) by search, ties to the even
// code; magnitudes above 448 saturate to 448.
uint8_t nearest_e4m3_code(double magnitude) {
  uint8_t best = 0;
  for (uint8_t c = 1; c <= 0x7e; ++c) {
    const double d = std::abs(decode_e4m3(c) - magnitude), db = std::abs(decode_e4m3(best) - magnitude);
    if (d < db || (d == db && c % 2 == 0)) best = c;
  }
  return best;
}

TEST(Numeric, FloatToE4m3RoundsToNearestEvenAndSaturates) {
  std::vector<float> values{0.0f, 448.0f, 449.0f, 464.0f, 465.0f, 1e6f, 1e-9f, 0x1p-10f,
                            0x3p-11f, std::numeric_limits<float>::infinity()};
  // Every value, every midpoint between neighbours and points near them.
  for (uint32_t c = 0; c < 0x7e; ++c) {
    const double lo = decode_e4m3(uint8_t(c)), hi = decode_e4m3(uint8_t(c + 1));
    const float mid = static_cast<float>((lo + hi) / 2);
    values.insert(values.end(), {static_cast<float>(lo), mid, std::nextafter(mid, 0.0f),
                                 std::nextafter(mid, 1e9f)});
  }
  std::mt19937 gen(1);
  std::uniform_real_distribution<float> exponent(-12.0f, 10.0f);
  for (int n = 0; n < 20000; ++n) values.push_back(std::exp2(exponent(gen)));
  for (const float f : values)
    for (const float s : {f, -f}) {
      const uint8_t expected = static_cast<uint8_t>((s < 0 || std::signbit(s) ? 0x80 : 0) |
                                                    nearest_e4m3_code(std::abs(double(s))));
      ASSERT_EQ(to_float8_e4m3(s).bits, expected) << s;
    }
  EXPECT_TRUE(std::isnan(to_float(to_float8_e4m3(std::nanf("")))));
}

}  // namespace
}  // namespace flashattn::detail

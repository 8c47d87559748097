// Division by multiply and shift (src/common/divisor.hpp), which the sm90 forward uses to split
// tile indices: every quotient and remainder against the / and % operators, over divisors of
// every size and dividends at the edges where a wrong magic number shows first (multiples of
// the divisor and their neighbours, and the top of the range, 2^31 - 1).
#include "common/divisor.hpp"

#include <cstdint>
#include <random>
#include <vector>

#include "support.hpp"

namespace flashattn::detail {
namespace {

std::vector<uint32_t> divisors() {
  std::vector<uint32_t> d;
  for (uint32_t x = 1; x <= 1100; ++x) d.push_back(x);
  for (int k = 11; k < 31; ++k) {
    const uint32_t p = 1u << k;
    for (uint32_t x : {p - 1, p, p + 1, p + p / 2, p + p / 3}) d.push_back(x);
  }
  d.push_back(0x7fffffffu);
  std::mt19937 rng(7);
  for (int i = 0; i < 200; ++i) d.push_back(1 + rng() % 0x7ffffffeu);
  return d;
}

std::vector<uint32_t> dividends(uint32_t d, std::mt19937& rng) {
  constexpr uint32_t kTop = 0x7fffffffu;
  std::vector<uint32_t> n;
  for (uint32_t x = 0; x < 300; ++x) n.push_back(x);
  for (uint32_t x = 0; x < 300; ++x) n.push_back(kTop - x);
  // Around multiples of d spread over the range, the highest ones included.
  const uint64_t last_multiple = kTop / d;
  for (uint64_t q : {uint64_t{1}, uint64_t{2}, last_multiple / 2, last_multiple - 1, last_multiple})
    for (int64_t delta = -2; delta <= 2; ++delta) {
      const int64_t x = static_cast<int64_t>(q * d) + delta;
      if (x >= 0 && x <= kTop) n.push_back(static_cast<uint32_t>(x));
    }
  for (int i = 0; i < 2000; ++i) n.push_back(rng() & kTop);
  return n;
}

TEST(Divisor, QuotientAndRemainderMatchTheOperators) {
  std::mt19937 rng(11);
  for (const uint32_t d : divisors()) {
    const Divisor div = Divisor::of(d);
    for (const uint32_t n : dividends(d, rng)) {
      const uint32_t q = div.quotient(n);
      ASSERT_EQ(q, n / d) << "n = " << n << ", d = " << d;
      ASSERT_EQ(div.remainder(n, q), n % d) << "n = " << n << ", d = " << d;
    }
  }
}

}  // namespace
}  // namespace flashattn::detail

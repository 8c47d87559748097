// What the C++ benchmark programs share: the median of a run's times and random bf16 inputs.
#ifndef FLASHATTN_BENCH_COMMON_HPP
#define FLASHATTN_BENCH_COMMON_HPP

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "common/numeric.hpp"

namespace bench {

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// n standard normal values rounded to bf16, as raw bits.
inline std::vector<uint16_t> random_bf16(size_t n, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> normal;
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = flashattn::detail::to_bfloat16(normal(g)).bits;
  return v;
}

inline double bf16_value(uint16_t bits) {
  return flashattn::detail::to_float(flashattn::detail::bfloat16_t{bits});
}

}  // namespace bench

#endif  // FLASHATTN_BENCH_COMMON_HPP

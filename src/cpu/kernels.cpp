#include "cpu/kernels.hpp"

#include <cmath>
#include <cstring>
#include <limits>

// Compile each inner loop for several instruction sets and pick at load time (GCC/Clang
// ifunc). x86-64-v3 is AVX2+FMA+F16C, x86-64-v4 adds AVX-512.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(FLASHATTN_NO_MULTIVERSION)
#define FA_CPU_DISPATCH \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FA_CPU_DISPATCH
#endif

namespace flashattn::detail::cpu {
namespace {

// exp(x) in float with a relative error of a few ulp, written so that loops over it
// vectorise (std::exp does not without -ffast-math): x = n ln2 + r with |r| <= ln2/2
// (Cody-Waite split of ln2), exp(r) by its Taylor series to degree 7 (truncation < 1e-8),
// times 2^n built in the exponent bits. -inf and anything below the smallest normal give 0;
// NaN stays NaN.
inline float exp_approx(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693145751953125f;  // ln2 with its low bits cleared: n*hi is exact
  constexpr float kLn2Lo = 1.42860682030941723e-6f;
  const float clamped = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
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

}  // namespace

FA_CPU_DISPATCH void convert_row(const float* src, float* dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) dst[i] = scale * src[i];
}

FA_CPU_DISPATCH void convert_row(const half_t* src, float* dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) dst[i] = scale * to_float(src[i]);
}

FA_CPU_DISPATCH void convert_row(const bfloat16_t* src, float* dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) dst[i] = scale * to_float(src[i]);
}

FA_CPU_DISPATCH void score_tile(const float* q, const float* kt, float* s, int rows,
                                int head_dim) {
  // Outer product form: for each query row, 64 running sums updated with one broadcast
  // q value per d. The j loop is unit-stride and of fixed length, so it vectorises without
  // reassociating a reduction and its 64 sums can stay in registers.
  for (int i = 0; i < rows; ++i) {
    float row[kBlockK] = {};
    const float* qi = q + static_cast<int64_t>(i) * head_dim;
    for (int d = 0; d < head_dim; ++d) {
      const float qd = qi[d];
      const float* kd = kt + static_cast<int64_t>(d) * kBlockK;
      for (int j = 0; j < kBlockK; ++j) row[j] += qd * kd[j];
    }
    std::memcpy(s + static_cast<int64_t>(i) * kBlockK, row, sizeof row);
  }
}

FA_CPU_DISPATCH void softmax_step(float* scores, float* m, float* l, float* acc,
                                  int head_dim_v) {
  float block_max = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : block_max)
  for (int j = 0; j < kBlockK; ++j) block_max = scores[j] > block_max ? scores[j] : block_max;
  const float m_new = *m > block_max ? *m : block_max;
  // Nothing visible in this row yet: every probability is 0 and the row stays as it was.
  // The max skips NaN, so a block whose scores are all NaN (or NaN and masked) also lands
  // here: then the running sum becomes NaN, which poisons the row's out and lse, as in the
  // reference. (A block with some finite scores poisons the row through exp(NaN) below.)
  if (m_new == -std::numeric_limits<float>::infinity()) {
    for (int j = 0; j < kBlockK; ++j) {
      if (scores[j] != scores[j]) *l = scores[j];
      scores[j] = 0.0f;
    }
    return;
  }
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int j = 0; j < kBlockK; ++j) {
    const float p = exp_approx(scores[j] - m_new);
    scores[j] = p;
    sum += p;
  }
  const float alpha = exp_approx(*m - m_new);  // 0 when the row had seen nothing before
  *l = *l * alpha + sum;
  *m = m_new;
  if (alpha != 1.0f)
    for (int d = 0; d < head_dim_v; ++d) acc[d] *= alpha;
}

FA_CPU_DISPATCH void accumulate_pv(const float* p, const float* v, float* acc, int cols,
                                   int head_dim_v) {
  for (int j = 0; j < cols; ++j) {
    const float pj = p[j];
    if (pj == 0.0f) continue;  // masked key: its value row may be padding
    const float* vj = v + static_cast<int64_t>(j) * head_dim_v;
    for (int d = 0; d < head_dim_v; ++d) acc[d] += pj * vj[d];
  }
}

}  // namespace flashattn::detail::cpu

#include "cpu/kernels.hpp"

#include "cpu/exp_approx.hpp"

#include <cmath>
#include <cstring>
#include <limits>


namespace flashattn::detail::cpu {

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
  // Outer-product form over a register block of kRowBlock query rows x kColBlock keys: per d,
  // kColBlock keys are loaded once and used by every row of the block, and the block's
  // running sums stay in registers (8 AVX-512 or 16 AVX2 registers). The inner loops are
  // unit-stride and fixed-length, so they vectorise without reassociating a reduction.
  constexpr int kRowBlock = 4, kColBlock = 32;
  int i = 0;
  for (; i + kRowBlock <= rows; i += kRowBlock) {
    const float* q0 = q + static_cast<int64_t>(i) * head_dim;
    const float* q1 = q0 + head_dim;
    const float* q2 = q1 + head_dim;
    const float* q3 = q2 + head_dim;
    for (int c = 0; c < kBlockK; c += kColBlock) {
      float a0[kColBlock] = {}, a1[kColBlock] = {}, a2[kColBlock] = {}, a3[kColBlock] = {};
      for (int d = 0; d < head_dim; ++d) {
        const float* kd = kt + static_cast<int64_t>(d) * kBlockK + c;
        const float x0 = q0[d], x1 = q1[d], x2 = q2[d], x3 = q3[d];
        for (int j = 0; j < kColBlock; ++j) {
          a0[j] += x0 * kd[j];
          a1[j] += x1 * kd[j];
          a2[j] += x2 * kd[j];
          a3[j] += x3 * kd[j];
        }
      }
      float* out = s + static_cast<int64_t>(i) * kBlockK + c;
      std::memcpy(out, a0, sizeof a0);
      std::memcpy(out + kBlockK, a1, sizeof a1);
      std::memcpy(out + 2 * kBlockK, a2, sizeof a2);
      std::memcpy(out + 3 * kBlockK, a3, sizeof a3);
    }
  }
  for (; i < rows; ++i) {  // the last rows of a short block, one at a time
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

FA_CPU_DISPATCH void accumulate_pv(const float* p, const float* v, float* acc, int rows,
                                   int cols, int head_dim_v) {
  // Register block of kRowBlock rows x kColBlock output columns: each value row chunk is
  // loaded once per key and used by every row of the block. A probability of exactly 0 is a
  // masked key (or one whose weight underflowed): such keys are skipped, as in the
  // reference, so that a masked value row holding Inf or NaN cannot leak into the output.
  constexpr int kRowBlock = 4, kColBlock = 32;
  int i = 0;
  for (; i + kRowBlock <= rows && head_dim_v % kColBlock == 0; i += kRowBlock) {
    const float* p0 = p + static_cast<int64_t>(i) * kBlockK;
    const float* p1 = p0 + kBlockK;
    const float* p2 = p1 + kBlockK;
    const float* p3 = p2 + kBlockK;
    for (int c = 0; c < head_dim_v; c += kColBlock) {
      float* out0 = acc + static_cast<int64_t>(i) * head_dim_v + c;
      float* out1 = out0 + head_dim_v;
      float* out2 = out1 + head_dim_v;
      float* out3 = out2 + head_dim_v;
      float a0[kColBlock], a1[kColBlock], a2[kColBlock], a3[kColBlock];
      std::memcpy(a0, out0, sizeof a0);
      std::memcpy(a1, out1, sizeof a1);
      std::memcpy(a2, out2, sizeof a2);
      std::memcpy(a3, out3, sizeof a3);
      for (int j = 0; j < cols; ++j) {
        const float* vj = v + static_cast<int64_t>(j) * head_dim_v + c;
        const float x0 = p0[j], x1 = p1[j], x2 = p2[j], x3 = p3[j];
        if (x0 != 0.0f && x1 != 0.0f && x2 != 0.0f && x3 != 0.0f) {
          for (int d = 0; d < kColBlock; ++d) {
            a0[d] += x0 * vj[d];
            a1[d] += x1 * vj[d];
            a2[d] += x2 * vj[d];
            a3[d] += x3 * vj[d];
          }
          continue;
        }
        if (x0 != 0.0f)
          for (int d = 0; d < kColBlock; ++d) a0[d] += x0 * vj[d];
        if (x1 != 0.0f)
          for (int d = 0; d < kColBlock; ++d) a1[d] += x1 * vj[d];
        if (x2 != 0.0f)
          for (int d = 0; d < kColBlock; ++d) a2[d] += x2 * vj[d];
        if (x3 != 0.0f)
          for (int d = 0; d < kColBlock; ++d) a3[d] += x3 * vj[d];
      }
      std::memcpy(out0, a0, sizeof a0);
      std::memcpy(out1, a1, sizeof a1);
      std::memcpy(out2, a2, sizeof a2);
      std::memcpy(out3, a3, sizeof a3);
    }
  }
  for (; i < rows; ++i) {  // leftover rows (and head dims that are not multiples of 32)
    const float* pi = p + static_cast<int64_t>(i) * kBlockK;
    float* out = acc + static_cast<int64_t>(i) * head_dim_v;
    for (int j = 0; j < cols; ++j) {
      if (pi[j] == 0.0f) continue;
      const float* vj = v + static_cast<int64_t>(j) * head_dim_v;
      for (int d = 0; d < head_dim_v; ++d) out[d] += pi[j] * vj[d];
    }
  }
}

}  // namespace flashattn::detail::cpu

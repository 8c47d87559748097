// AVX-512 helpers shared by the CPU engine's AVX-512 variants (cpu/kernels.cpp) and its AMX
// path (cpu/amx.cpp): a cheaper exponential, lane reductions, a 16 x 16 transpose. Each carries the avx512f
// target itself, so that only functions compiled for AVX-512 call it.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(FLASHATTN_NO_MULTIVERSION)
#include <immintrin.h>

#include <cstdint>

#include "cpu/kernels.hpp"

namespace flashattn::detail::cpu::avx512 {

#define FA_AVX512 __attribute__((target("avx512f"))) inline

// 2^y for y = x a + c: 2^f by its Taylor series to degree 6 on f = y - round(y) in [-1/2, 1/2]
// (relative truncation below 2e-7), scaled by 2^round(y) (VSCALEFPS); y below -126 gives
// exactly 0 (masked scores, -inf), NaN gives 0 too (callers that must keep NaN check for it).
FA_AVX512 __m512 exp2_fma(__m512 x, __m512 a, __m512 c) {
  constexpr float c1 = 0.693147180559945f, c2 = 0.240226506959101f, c3 = 0.0555041086648216f,
                  c4 = 0.00961812910762848f, c5 = 0.00133335581464284f, c6 = 0.000154035303933816f;
  const __m512 y = _mm512_fmadd_ps(x, a, c);
  const __mmask16 live = _mm512_cmp_ps_mask(y, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
  // The zero-masked forms with every lane kept: GCC 12 warns of the plain ones' undefined
  // pass-through operand.
  const __m512 n = _mm512_maskz_roundscale_ps(0xFFFF, y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(c6), f, _mm512_set1_ps(c5));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c4));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c3));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c2));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c1));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(live, p, n);
}

// Transposes 16 x 16 32-bit words held a row per register: register i ends up holding column
// i (pairs within 32-bit lanes, then 64-bit lanes, then 128-bit quarters twice). The
// zero-masked forms with every lane kept: GCC 12 warns of the plain ones' pass-through operand.
FA_AVX512 void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_maskz_unpacklo_epi32(0xFFFF, r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_maskz_unpackhi_epi32(0xFFFF, r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_maskz_unpacklo_epi64(0xFF, t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_maskz_unpackhi_epi64(0xFF, t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_maskz_unpacklo_epi64(0xFF, t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_maskz_unpackhi_epi64(0xFF, t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_maskz_shuffle_i32x4(0xFFFF, r[8 * i + j], r[8 * i + 4 + j], 0x88);
      t[8 * i + 4 + j] = _mm512_maskz_shuffle_i32x4(0xFFFF, r[8 * i + j], r[8 * i + 4 + j], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_maskz_shuffle_i32x4(0xFFFF, t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_maskz_shuffle_i32x4(0xFFFF, t[j], t[8 + j], 0xdd);
  }
}

// Loads 16 rows of 16 floats, `stride` floats apart, and transposes them: register k holds
// column k (as 32-bit words).
FA_AVX512 void load_transposed16(const float* src, int64_t stride, __m512i r[16]) {
  for (int i = 0; i < 16; ++i) r[i] = _mm512_castps_si512(_mm512_loadu_ps(src + i * stride));
  transpose16(r);
}

// The max and the sum of a vector's lanes, by halving swaps.
FA_AVX512 __m512 lane_swaps(__m512 v, int step) {
  switch (step) {
    case 0: return _mm512_maskz_shuffle_f32x4(0xFFFF, v, v, 0x4E);  // 256-bit halves
    case 1: return _mm512_maskz_shuffle_f32x4(0xFFFF, v, v, 0xB1);  // 128-bit quarters
    case 2: return _mm512_maskz_permute_ps(0xFFFF, v, 0x4E);        // 64-bit pairs
    default: return _mm512_maskz_permute_ps(0xFFFF, v, 0xB1);       // lanes
  }
}
FA_AVX512 float lanes_max(__m512 v) {
  for (int step = 0; step < 4; ++step) v = _mm512_maskz_max_ps(0xFFFF, v, lane_swaps(v, step));
  return _mm512_cvtss_f32(v);
}
FA_AVX512 float lanes_sum(__m512 v) {
  for (int step = 0; step < 4; ++step) v = _mm512_add_ps(v, lane_swaps(v, step));
  return _mm512_cvtss_f32(v);
}

// exp(x scale - shift) for 16 lanes, with x scale - shift taken by one multiply-add before
// the conversion to base 2, so that the row's max gives exactly 1 and large shifts lose no
// accuracy (folding shift log2(e) into exp2_fma's constant did: its rounding, relative to
// the shift, is absolute in the exponent).
FA_AVX512 __m512 exp_shifted(__m512 x, __m512 scale, __m512 neg_shift) {
  constexpr float kLog2e = 1.44269504088896341f;
  return exp2_fma(_mm512_fmadd_ps(x, scale, neg_shift), _mm512_set1_ps(kLog2e), _mm512_setzero_ps());
}

// One online-softmax step (softmax_step, cpu/kernels.hpp) for a row of kBlockK scores, each
// taken times `scale` (> 0), by exp2_fma: the probabilities (fp32) go to `out` (which may be
// `scores`). Returns false, touching nothing, for a row the exact step must take: NaN or
// infinite scores, or no visible key yet.
FA_AVX512 bool softmax_step(const float* scores, float* m, float* l, float* acc, int head_dim_v,
                            float scale, float* out) {
  constexpr float kInf = __builtin_inff();
  constexpr int kVectors = kBlockK / 16;
  __m512 row[kVectors];
  __m512 vmax = _mm512_set1_ps(-kInf), vprobe = _mm512_setzero_ps();
  for (int v = 0; v < kVectors; ++v) {
    row[v] = _mm512_loadu_ps(scores + 16 * v);
    vmax = _mm512_maskz_max_ps(0xFFFF, vmax, row[v]);
    vprobe = _mm512_add_ps(vprobe, row[v]);  // NaN if a score is NaN or two are opposite infinities
  }
  const float block_max = lanes_max(vmax), probe = lanes_sum(vprobe);
  const float scaled_max = scale * block_max;
  const float m_new = *m > scaled_max ? *m : scaled_max;
  if (probe != probe || m_new == kInf || m_new == -kInf || block_max != block_max) return false;
  const __m512 scale_v = _mm512_set1_ps(scale), neg_shift = _mm512_set1_ps(-m_new);
  __m512 vsum = _mm512_setzero_ps();
  for (int v = 0; v < kVectors; ++v) {
    const __m512 e = exp_shifted(row[v], scale_v, neg_shift);
    vsum = _mm512_add_ps(vsum, e);
    _mm512_storeu_ps(out + 16 * v, e);
  }
  // exp(m - m_new) of the row's previous max (0 when the row had seen nothing before).
  const float alpha =
      *m == -kInf ? 0.0f
                  : _mm512_cvtss_f32(exp_shifted(_mm512_set1_ps(*m), _mm512_set1_ps(1.0f), neg_shift));
  *l = *l * alpha + lanes_sum(vsum);
  *m = m_new;
  if (alpha != 1.0f) {
    const __m512 factor = _mm512_set1_ps(alpha);
    int d = 0;
    for (; d + 16 <= head_dim_v; d += 16)
      _mm512_storeu_ps(acc + d, _mm512_mul_ps(factor, _mm512_loadu_ps(acc + d)));
    for (; d < head_dim_v; ++d) acc[d] *= alpha;
  }
  return true;
}

// backward_probabilities (cpu/kernels.hpp) with each score taken times `scale`:
// prob[j] = exp(scale prob[j] - lse) for j < kBlockK; masked scores (-inf) give 0, NaN stays NaN.
FA_AVX512 void probabilities(float* prob, float lse, float scale) {
  const __m512 scale_v = _mm512_set1_ps(scale), neg_lse = _mm512_set1_ps(-lse);
  for (int j = 0; j < kBlockK; j += 16) {
    const __m512 x = _mm512_loadu_ps(prob + j);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    _mm512_storeu_ps(prob + j, _mm512_mask_blend_ps(nan, exp_shifted(x, scale_v, neg_lse), x));
  }
}

#undef FA_AVX512

}  // namespace flashattn::detail::cpu::avx512
#endif

// The score modifiers, the mask, the online softmax and dropout of the forward kernels, on a
// lane's score fragment. The sm80 (mma.sync) and sm90 (wgmma) kernels share the layout: for
// each n8 tile t of a key block, s[4 t + 2 r + e] is the score of the lane's row r (r = 0: row
// lane / 4 of its m16 tile, r = 1: that row + 8) and block column 8 t + 2 (lane % 4) + e. A
// row's four lanes (a quad) hold its columns between them.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common/mask.hpp"
#include "common/philox.hpp"
#include "cuda/common/ptx.cuh"

namespace flashattn::detail::cuda {

// The scales of the score path. The plain path (no softcap, no ALiBi, positive scale) keeps
// raw dot products in S and folds the scale into the exponent: p = 2^(s c - m c) with
// c = exp = scale log2 e, one FFMA a score. The general path first turns S into scores x by
// modify_scores_row; p = 2^(x c - m c) again:
//   no softcap: x = s scale log2 e - slope log2 e |distance|, and c = 1;
//   softcap k:  x = tanh(s scale / k) - (slope / k) |distance|, and c = k log2 e
// (x in units of the cap: its factor rides on the exponent's FFMA instead of a multiply a score).
struct ScoreScales {
  float score;  // s -> s score (the tanh's argument with a softcap)
  float slope;  // the ALiBi slope's factor
  float exp;    // c
};
__device__ __forceinline__ ScoreScales score_scales(bool plain, float softmax_scale, float softcap) {
  constexpr float kLog2e = 1.4426950408889634f;
  if (plain) return {1.0f, 0.0f, softmax_scale * kLog2e};
  if (softcap > 0.0f) return {softmax_scale / softcap, 1.0f / softcap, softcap * kLog2e};
  return {softmax_scale * kLog2e, kLog2e, 1.0f};
}

// Softcap and ALiBi on row r's scores (the general path; ScoreScales says in which units):
// the distance is |diagonal - column|, where diagonal = i + Sk - Sq - j0 for the row's query i
// and the block's first key j0.
template <int kSTiles>
__device__ __forceinline__ void modify_scores_row(float* s, int r, const ScoreScales& scales, bool softcap,
                                                  float slope, int diagonal, int quad_col) {
  // The lane's columns are quad_col + (8 t + e): relative to the quad's first column the
  // offsets are immediates (a column index per score would hold a register each). The
  // distance is taken in fp32 (exact below 2^24; a conversion per score would occupy the MUFU
  // unit's pipe, which the exponentials already fill).
  const float lane_diagonal = static_cast<float>(diagonal - quad_col);
  const float scaled_slope = slope * scales.slope;
  // tanh_of_scaled wants k <= 0: a negative softmax scale is taken as tanh(-s |scale| / cap).
  const float tanh_exponent = -2.0f * 1.4426950408889634f * fabsf(scales.score);
  const auto modify = [&](auto score, auto with_alibi) {
#pragma unroll
    for (int t = 0; t < kSTiles; ++t)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = s[4 * t + 2 * r + e];
        x = score(x);
        if constexpr (decltype(with_alibi)::value)
          x = fmaf(-scaled_slope, fabsf(lane_diagonal - static_cast<float>(t * 8 + e)), x);
      }
  };
  // The tests outside the loop: inside, ptxas keeps a branch per score, and each score's tanh
  // then waits for the one before it. A zero slope (no ALiBi, or a head whose slope is 0)
  // skips the distance's two instructions a score.
  const auto with_alibi = [&](auto score) {
    if (slope != 0.0f)
      modify(score, std::true_type{});
    else
      modify(score, std::false_type{});
  };
  if (softcap && scales.score >= 0.0f)
    with_alibi([=](float x) { return ptx::tanh_of_scaled(x, tanh_exponent); });
  else if (softcap)  // (the negation folds into the copysign)
    with_alibi([=](float x) { return ptx::tanh_of_scaled(-x, tanh_exponent); });
  else
    with_alibi([=](float x) { return x * scales.score; });
}

// The columns [lo, hi) of a key block starting at key j0 (kBlockN keys) that lie in `visible`.
struct BlockColumns {
  int lo, hi;
};
template <int kBlockN>
__device__ __forceinline__ BlockColumns block_columns(const KeyRange& visible, int64_t j0) {
  const int64_t lo = visible.begin - j0, hi = visible.end - j0;
  return {lo < 0 ? 0 : (lo > kBlockN ? kBlockN : static_cast<int>(lo)),
          hi < 0 ? 0 : (hi > kBlockN ? kBlockN : static_cast<int>(hi))};
}

// Sets row r's scores outside `columns` to -inf (quad_col = 2 (lane % 4)).
// The bounds are shifted by quad_col rather than each column: the comparisons then take the
// offsets 8 t + e as immediates. Where nothing is hidden on the left (causal masks, windows
// whose left edge the block does not reach) only the right bound is compared: one comparison
// per score instead of two.
template <int kSTiles>
__device__ __forceinline__ void mask_row(float* s, int r, BlockColumns columns, int quad_col) {
  const int lo = columns.lo - quad_col, hi = columns.hi - quad_col;
  if (lo <= 0) {
#pragma unroll
    for (int t = 0; t < kSTiles; ++t)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        if (t * 8 + e >= hi) s[4 * t + 2 * r + e] = -INFINITY;
  } else {
#pragma unroll
    for (int t = 0; t < kSTiles; ++t)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        if (t * 8 + e < lo || t * 8 + e >= hi) s[4 * t + 2 * r + e] = -INFINITY;
  }
}

// One key block of row r's online softmax: the new running max (across the quad, in score
// units), p = 2^(s c - max c) in place of the scores (c = exp_scale), the running sum of this
// lane's p, and the factor by which the row's O must be rescaled, returned (1 where the max
// did not grow).
template <int kSTiles>
__device__ __forceinline__ float online_softmax_row(float* s, int r, float& row_max, float& row_sum,
                                                    float exp_scale) {
  float block_max = -INFINITY;
#pragma unroll
  for (int t = 0; t < kSTiles; ++t) block_max = fmaxf(block_max, fmaxf(s[4 * t + 2 * r], s[4 * t + 2 * r + 1]));
  block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffffu, block_max, 1));
  block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffffu, block_max, 2));
  const float new_max = fmaxf(row_max, block_max);
  // A row with nothing visible so far keeps max -inf; subtract 0 instead so that
  // 2^(-inf - base) is 0 rather than NaN.
  const float base = new_max == -INFINITY ? 0.0f : new_max * exp_scale;
  // Exactly 1 where the max stayed (the exponent's FMA would leave the rounding error of
  // row_max c, a factor 1 + 2^-22 or so): O's rescale can then be skipped (the sm90 kernel).
  const float scale_o = new_max == row_max ? 1.0f : ptx::exp2_approx(row_max * exp_scale - base);
  row_max = new_max;
  float sum = 0.0f;
#pragma unroll
  for (int t = 0; t < kSTiles; ++t)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float p = ptx::exp2_approx(fmaf(s[4 * t + 2 * r + e], exp_scale, -base));
      s[4 * t + 2 * r + e] = p;
      sum += p;
    }
  row_sum = row_sum * scale_o + sum;
  return scale_o;
}

// Dropout on row r's probabilities, after the row sum (so l and lse are of the undropped
// softmax): key column j = j0 + c of query row i keeps its p iff bit j % 4 of the Philox call
// for group j / 4 is set (common/philox.hpp), the same bits as on the CPU. i and j0 are
// tokens of the whole sequence (the call's rows and keys moved by Options::positions), so j0
// may be any integer: a lane's two columns share one call unless they straddle groups.
template <int kSTiles>
__device__ __forceinline__ void dropout_row(float* s, int r, const DropoutRng& rng, uint32_t b, uint32_t h,
                                            uint32_t i, int64_t j0, int quad_col) {
#pragma unroll
  for (int t = 0; t < kSTiles; ++t) {
    const uint32_t j = static_cast<uint32_t>(j0 + t * 8 + quad_col);
    const uint32_t bits = rng.keep_bits2(b, h, i, j);
    if (!(bits & 1u)) s[4 * t + 2 * r] = 0.0f;
    if (!(bits & 2u)) s[4 * t + 2 * r + 1] = 0.0f;
  }
}

}  // namespace flashattn::detail::cuda

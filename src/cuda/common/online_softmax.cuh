// The score modifiers, the mask, the online softmax and dropout of the forward kernels, on a
// lane's score fragment. The sm80 (mma.sync) and sm90 (wgmma) kernels share the layout: for
// each n8 tile t of a key block, s[4 t + 2 r + e] is the score of the lane's row r (r = 0: row
// lane / 4 of its m16 tile, r = 1: that row + 8) and block column 8 t + 2 (lane % 4) + e. A
// row's four lanes (a quad) hold its columns between them.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/mask.hpp"
#include "common/philox.hpp"
#include "cuda/common/ptx.cuh"

namespace flashattn::detail::cuda {

// Softcap and ALiBi on row r's scores, which become base-2 scores x (the general kernels: the
// exponent's scale is then 1): x = s score_scale; with a softcap c > 0, x = c tanh(x) log2 e
// (score_scale = scale / c); then x -= slope log2 e |diagonal - column|, where
// diagonal = i + Sk - Sq - j0 for the row's query i and the block's first key j0.
template <int kSTiles>
__device__ __forceinline__ void modify_scores_row(float* s, int r, float score_scale, float softcap,
                                                  float slope, int diagonal, int quad_col) {
  constexpr float kLog2e = 1.4426950408889634f;
  // The lane's columns are quad_col + (8 t + e): relative to the quad's first column the
  // offsets are immediates (a column index per score would hold a register each). The
  // distance is taken in fp32 (exact below 2^24; a conversion per score would occupy the MUFU
  // unit's pipe, which the exponentials already fill).
  const float lane_diagonal = static_cast<float>(diagonal - quad_col);
  const float slope2 = slope * kLog2e;
  const float cap2 = softcap * kLog2e;
  const auto modify = [&](auto cap) {  // cap(x): the softcap, or nothing
#pragma unroll
    for (int t = 0; t < kSTiles; ++t)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        s[4 * t + 2 * r + e] = fmaf(-slope2, fabsf(lane_diagonal - static_cast<float>(t * 8 + e)),
                                    cap(s[4 * t + 2 * r + e] * score_scale));
  };
  // The softcap's test outside the loop: inside, ptxas keeps a branch per score, and each
  // score's tanh then waits for the one before it.
  if (softcap > 0.0f)
    modify([cap2](float x) { return cap2 * ptx::tanh_for_softcap(x); });
  else
    modify([](float x) { return x; });
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
// lane's p, and the factor by which the row's O must be rescaled, returned.
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
  const float scale_o = ptx::exp2_approx(row_max * exp_scale - base);
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
// for group j / 4 is set (common/philox.hpp), the same bits as on the CPU. A lane's two
// columns share one call unless they straddle groups.
template <int kSTiles>
__device__ __forceinline__ void dropout_row(float* s, int r, const DropoutRng& rng, uint32_t b, uint32_t h,
                                            uint32_t i, int64_t j0, int quad_col) {
#pragma unroll
  for (int t = 0; t < kSTiles; ++t) {
    const uint32_t j = static_cast<uint32_t>(j0 + t * 8 + quad_col);
    uint32_t bits = rng.keep_bits4(b, h, i, j / 4) >> (j % 4);
    if (j % 4 == 3) bits = (bits & 1u) | (rng.keep_bits4(b, h, i, j / 4 + 1) & 1u) << 1;
    if (!(bits & 1u)) s[4 * t + 2 * r] = 0.0f;
    if (!(bits & 2u)) s[4 * t + 2 * r + 1] = 0.0f;
  }
}

}  // namespace flashattn::detail::cuda

// The mask and the online softmax of the forward kernels, on a lane's score fragment. The
// sm80 (mma.sync) and sm90 (wgmma) kernels share the layout: for each n8 tile t of a key
// block, s[4 t + 2 r + e] is the score of the lane's row r (r = 0: row lane / 4 of its m16
// tile, r = 1: that row + 8) and block column 8 t + 2 (lane % 4) + e. A row's four lanes
// (a quad) hold its columns between them.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/mask.hpp"
#include "cuda/common/ptx.cuh"

namespace flashattn::detail::cuda {

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
template <int kSTiles>
__device__ __forceinline__ void mask_row(float* s, int r, BlockColumns columns, int quad_col) {
#pragma unroll
  for (int t = 0; t < kSTiles; ++t)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int c = t * 8 + quad_col + e;
      if (c < columns.lo || c >= columns.hi) s[4 * t + 2 * r + e] = -INFINITY;
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

}  // namespace flashattn::detail::cuda

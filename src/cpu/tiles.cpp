#include "cpu/tiles.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/mask.hpp"

namespace flashattn::detail::cpu {

void modify_scores(const ForwardParams& p, const SequenceView& seq, float slope, float* s,
                   int64_t i0, int rows, int64_t j0, int cols, float* softcap_grad) {
  const bool full = cols == kBlockK && block_fully_visible(i0, i0 + rows, j0, j0 + cols,
                                                          seq.seqlen_q, seq.seqlen_k,
                                                          p.window_left, p.window_right);
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int r = 0; r < rows; ++r) {
    float* row = s + static_cast<int64_t>(r) * kBlockK;
    const int64_t i = i0 + r;
    if (p.softcap > 0.0f) {  // q was pre-divided by the cap, so the row holds s / cap already
      float* grad = softcap_grad ? softcap_grad + static_cast<int64_t>(r) * kBlockK : nullptr;
      for (int j = 0; j < cols; ++j) {
        const float t = std::tanh(row[j]);
        row[j] = p.softcap * t;
        if (grad) grad[j] = 1.0f - t * t;
      }
    }
    if (p.alibi_slopes != nullptr)
      for (int j = 0; j < cols; ++j)
        row[j] += alibi_bias(slope, i, j0 + j, alibi_diagonal(p, seq));
    if (full) continue;
    const KeyRange keys = visible_keys(i, seq.seqlen_q, seq.seqlen_k, p.window_left,
                                       p.window_right);
    const int64_t lo = std::clamp<int64_t>(keys.begin - j0, 0, cols);
    const int64_t hi = std::clamp<int64_t>(keys.end - j0, lo, cols);
    for (int64_t j = 0; j < lo; ++j) row[j] = kNegInf;
    for (int64_t j = hi; j < kBlockK; ++j) row[j] = kNegInf;
  }
}

void dropout_multipliers(const ForwardParams& p, const DropoutRng& rng, int32_t b, int32_t h,
                         int64_t i, int64_t j0, int cols, float* m) {
  // One Philox call per group of 4 keys; a block that starts mid-group (windows and positions
  // start anywhere) uses part of its first group. j counts key tokens.
  const int64_t first = j0 + p.key_position0;
  int64_t j = first;
  const int64_t end = first + cols;
  const uint32_t row = static_cast<uint32_t>(i + p.query_position0);
  while (j < end) {
    const uint32_t bits = rng.keep_bits4(static_cast<uint32_t>(b), static_cast<uint32_t>(h), row,
                                         static_cast<uint32_t>(j / 4));
    for (; j < end; ++j) {
      m[j - first] = (bits >> (j % 4)) & 1u ? rng.scale : 0.0f;
      if (j % 4 == 3) {
        ++j;
        break;
      }
    }
  }
}

}  // namespace flashattn::detail::cpu

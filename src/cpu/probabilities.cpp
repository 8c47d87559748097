// attention_probabilities on the CPU: the forward engine's score tiles, kept instead of folded.
//
// Work item = (batch, head, block of kTileRows rows of probs: one score tile). A thread loads
// the block's query rows once (converted, pre-scaled: cpu/tiles.hpp), then
//   pass 1: walks the keys its rows can see, kBlockK at a time, computes the score tile and
//           applies softcap, ALiBi and the mask with the forward's own code (score_tile,
//           modify_scores), stores the scores into probs and keeps each row's max;
//   pass 2: turns each stored score of a visible key into exp(s - max) and negates it where
//           dropout drops it (dropout_multipliers: the forward's and backward's keep bits).
// Every other element (masked keys, keys and rows past the sequence) is 0. The output is the
// O(B H Sq Sk) matrix the forward never holds: a testing aid (docs/SPEC.md).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>

#include "common/mask.hpp"
#include "common/numeric.hpp"
#include "cpu/attention.hpp"
#include "cpu/forward.hpp"
#include "cpu/kernels.hpp"
#include "cpu/tiles.hpp"

namespace flashattn::detail::cpu {

namespace {

template <typename T>
void probabilities_of_block(const ProbabilitiesParams& pp, const DropoutRng* dropout, int32_t b,
                            int32_t h, int64_t block, Tiles& t) {
  const ForwardParams& p = pp.fwd;
  const SequenceView seq = sequence_view(p, b);
  const int64_t i0 = block * kTileRows;
  const int rows = static_cast<int>(std::min<int64_t>(kTileRows, p.seqlen_q - i0));
  const auto probs_row = [&](int r) {
    return pp.probs + b * pp.probs_batch_stride + h * pp.probs_head_stride +
           (i0 + r) * pp.probs_row_stride;
  };
  for (int r = 0; r < rows; ++r) std::fill(probs_row(r), probs_row(r) + p.seqlen_k, 0.0f);
  // Varlen: rows past this sequence's length stay 0.
  const int seq_rows = static_cast<int>(std::clamp<int64_t>(seq.seqlen_q - i0, 0, rows));
  if (seq_rows == 0) return;

  const int D = p.head_dim;
  const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride +
               (seq.q_row0 + i0) * p.q_row_stride + h * p.q_head_stride;
  const T* k = static_cast<const T*>(p.k) + b * p.k_batch_stride + seq.k_row0 * p.k_row_stride +
               (h / p.group_size()) * p.k_head_stride;
  const float slope =
      p.alibi_slopes != nullptr ? p.alibi_slopes[b * p.alibi_batch_stride + h] : 0.0f;
  load_rows(q, p.q_row_stride, seq_rows, D, query_scale(p), t.q);
  std::fill(t.m, t.m + seq_rows, -std::numeric_limits<float>::infinity());

  // Pass 1: the scores (-inf where masked) and each row's max over its visible keys.
  const KeyRange keys = visible_keys_of_rows(i0, i0 + seq_rows, seq.seqlen_q, seq.seqlen_k,
                                             p.window_left, p.window_right);
  const auto block_cols = [&](int64_t j0) {
    return static_cast<int>(std::min<int64_t>(kBlockK, keys.end - j0));
  };
  for (int64_t j0 = keys.begin; j0 < keys.end; j0 += kBlockK) {
    const int cols = block_cols(j0);
    load_transposed(k + j0 * p.k_row_stride, p.k_row_stride, cols, D, t.kt);
    score_tile(t.q, t.kt, t.s, seq_rows, D);
    modify_scores(p, seq, slope, t.s, i0, seq_rows, j0, cols);
    for (int r = 0; r < seq_rows; ++r) {
      const float* s = t.s + static_cast<int64_t>(r) * kBlockK;
      std::copy(s, s + cols, probs_row(r) + j0);
      for (int j = 0; j < cols; ++j) t.m[r] = std::max(t.m[r], s[j]);
    }
  }

  // Pass 2: exp(s - max) for the visible keys, negated where dropped; masked keys 0 (only
  // visible ones carry a sign, so that a 0 with its sign bit set always means "dropped").
  float multipliers[kBlockK];
  for (int r = 0; r < seq_rows; ++r) {
    float* row = probs_row(r);
    const float m = t.m[r];
    const KeyRange seen = visible_keys(i0 + r, seq.seqlen_q, seq.seqlen_k, p.window_left,
                                       p.window_right);
    for (int64_t j0 = keys.begin; j0 < keys.end; j0 += kBlockK) {
      const int cols = block_cols(j0);
      if (dropout != nullptr) dropout_multipliers(p, *dropout, b, h, i0 + r, j0, cols, multipliers);
      for (int c = 0; c < cols; ++c) {
        const int64_t j = j0 + c;
        float& x = row[j];
        if (j < seen.begin || j >= seen.end) {
          x = 0.0f;
          continue;
        }
        x = std::exp(x - m);
        if (dropout != nullptr && multipliers[c] == 0.0f) x = -x;
      }
    }
  }
}

template <typename T>
size_t probabilities_typed(const ProbabilitiesParams& pp) {
  const ForwardParams& p = pp.fwd;
  const int64_t query_blocks = (p.seqlen_q + kTileRows - 1) / kTileRows;
  return over_query_blocks(p, query_blocks, p.head_dim,
                           [&](const DropoutRng* dropout, int32_t b, int32_t h, int64_t block,
                               Tiles& tiles) { probabilities_of_block<T>(pp, dropout, b, h, block, tiles); });
}

}  // namespace

size_t probabilities(const ProbabilitiesParams& params) {
  switch (params.fwd.dtype) {
    case DType::Float32:
      return probabilities_typed<float>(params);
    case DType::Float16:
      return probabilities_typed<half_t>(params);
    case DType::BFloat16:
      return probabilities_typed<bfloat16_t>(params);
    case DType::Int32:
    case DType::Float8E4M3:  // forward only: refused by validation
      break;
  }
  throw Error(ErrorCode::Internal, "dtype", "fp32, fp16 or bf16 after validation",
              dtype_name(params.fwd.dtype));
}

}  // namespace flashattn::detail::cpu

// The CPU forward engine: FlashAttention's tiling on the host.
//
// Work item = (batch, head, block of kBlockQ query rows). A thread loads its query block once
// (converted to fp32, pre-scaled), then walks the visible key blocks: converts kBlockK keys
// (transposed) and values to fp32, computes the score tile, applies softcap/ALiBi/mask, and
// folds the tile into a running max, sum and output accumulator (online softmax), dropping
// probabilities (common/philox.hpp) after they entered the sum. Keys that
// no row of the block can see are never loaded. Working memory is a fixed set of tiles per
// thread, so it does not depend on the sequence lengths at all.
#include "cpu/forward.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "common/mask.hpp"
#include "common/numeric.hpp"
#include "cpu/kernels.hpp"
#include "cpu/tiles.hpp"

namespace flashattn::detail::cpu {
namespace {

constexpr int64_t kAlignFloats = 16;  // 64-byte alignment for every tile

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// One thread's tiles, carved out of a single allocation.
struct Tiles {
  float* q;    // kBlockQ x D, pre-multiplied by the softmax scale (and 1/softcap)
  float* kt;   // D x kBlockK: keys transposed, zero beyond the last key
  float* v;    // kBlockK x Dv
  float* s;    // kBlockQ x kBlockK: scores, then probabilities
  float* acc;  // kBlockQ x Dv: unnormalised output
  float* m;    // kBlockQ: running max of each row
  float* l;    // kBlockQ: running sum of exp(score - max) of each row

  static int64_t floats_needed(int head_dim, int head_dim_v) {
    return round_up(int64_t{kBlockQ} * head_dim, kAlignFloats) +
           round_up(int64_t{kBlockK} * head_dim, kAlignFloats) +
           round_up(int64_t{kBlockK} * head_dim_v, kAlignFloats) +
           round_up(int64_t{kBlockQ} * kBlockK, kAlignFloats) +
           round_up(int64_t{kBlockQ} * head_dim_v, kAlignFloats) + 2 * round_up(kBlockQ, kAlignFloats);
  }

  Tiles(float* base, int head_dim, int head_dim_v) {
    float* p = base;
    const auto take = [&p](int64_t n) {
      float* r = p;
      p += round_up(n, kAlignFloats);
      return r;
    };
    q = take(int64_t{kBlockQ} * head_dim);
    kt = take(int64_t{kBlockK} * head_dim);
    v = take(int64_t{kBlockK} * head_dim_v);
    s = take(int64_t{kBlockQ} * kBlockK);
    acc = take(int64_t{kBlockQ} * head_dim_v);
    m = take(kBlockQ);
    l = take(kBlockQ);
  }
};

template <typename T>
void attend_query_block(const ForwardParams& p, const DropoutRng* dropout, int32_t b,
                        int32_t h, int64_t block, Tiles& t) {
  const SequenceView seq = sequence_view(p, b);
  const int64_t i0 = block * kBlockQ;
  if (i0 >= seq.seqlen_q) return;  // varlen: this sequence is shorter than max_seqlen_q
  const int rows = static_cast<int>(std::min<int64_t>(kBlockQ, seq.seqlen_q - i0));
  const int D = p.head_dim, Dv = p.head_dim_v;
  const int32_t hk = h / p.group_size();

  const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride +
               (seq.q_row0 + i0) * p.q_row_stride + h * p.q_head_stride;
  const T* k = static_cast<const T*>(p.k) + b * p.k_batch_stride + seq.k_row0 * p.k_row_stride +
               hk * p.k_head_stride;
  const T* v = static_cast<const T*>(p.v) + b * p.v_batch_stride + seq.k_row0 * p.v_row_stride +
               hk * p.v_head_stride;

  load_rows(q, p.q_row_stride, rows, D, query_scale(p), t.q);
  std::fill(t.m, t.m + rows, -std::numeric_limits<float>::infinity());
  std::fill(t.l, t.l + rows, 0.0f);
  std::fill(t.acc, t.acc + static_cast<int64_t>(rows) * Dv, 0.0f);
  const float slope =
      p.alibi_slopes != nullptr ? p.alibi_slopes[b * p.alibi_batch_stride + h] : 0.0f;

  const KeyRange keys = visible_keys_of_rows(i0, i0 + rows, seq.seqlen_q, seq.seqlen_k,
                                             p.window_left, p.window_right);
  for (int64_t j0 = keys.begin; j0 < keys.end; j0 += kBlockK) {
    const int cols = static_cast<int>(std::min<int64_t>(kBlockK, keys.end - j0));
    load_transposed(k + j0 * p.k_row_stride, p.k_row_stride, cols, D, t.kt);
    load_rows(v + j0 * p.v_row_stride, p.v_row_stride, cols, Dv, 1.0f, t.v);

    score_tile(t.q, t.kt, t.s, rows, D);
    modify_scores(p, seq, slope, t.s, i0, rows, j0, cols);
    for (int r = 0; r < rows; ++r) {
      float* row = t.s + static_cast<int64_t>(r) * kBlockK;
      softmax_step(row, t.m + r, t.l + r, t.acc + static_cast<int64_t>(r) * Dv, Dv);
      // Dropout acts after the row sum is taken: l (and so lse) is of the undropped softmax,
      // and only what multiplies v is dropped and rescaled.
      if (dropout != nullptr) {
        float m[kBlockK];
        dropout_multipliers(*dropout, b, h, i0 + r, j0, cols, m);
        for (int j = 0; j < cols; ++j) row[j] *= m[j];
      }
    }
    accumulate_pv(t.s, t.v, t.acc, rows, cols, Dv);
  }

  // out = acc / l; a row that saw no key gets out = 0 and lse = -inf.
  T* out = static_cast<T*>(p.out) + b * p.out_batch_stride +
           (seq.q_row0 + i0) * p.out_row_stride + h * p.out_head_stride;
  for (int r = 0; r < rows; ++r) {
    const float l = t.l[r];
    const float inv = l == 0.0f ? 0.0f : 1.0f / l;
    const float* acc = t.acc + static_cast<int64_t>(r) * Dv;
    T* o = out + r * p.out_row_stride;
    for (int d = 0; d < Dv; ++d) o[d] = from_float<T>(acc[d] * inv);
  }
  if (p.lse != nullptr) {
    float* lse = p.lse + b * p.lse_batch_stride + h * p.lse_head_stride + seq.q_row0 + i0;
    for (int r = 0; r < rows; ++r)
      lse[r] = t.l[r] == 0.0f ? -std::numeric_limits<float>::infinity()
                              : t.m[r] + std::log(t.l[r]);
  }
}

template <typename T>
size_t forward_typed(const ForwardParams& p) {
  // Varlen: max_seqlen_q is only a bound, and the lengths are in host memory here, so the
  // grid follows the longest real sequence.
  int64_t longest_q = p.seqlen_q;
  if (p.is_varlen()) {
    longest_q = 0;
    for (int32_t b = 0; b < p.batch; ++b)
      longest_q = std::max<int64_t>(longest_q, p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b]);
  }
  const int64_t query_blocks = (longest_q + kBlockQ - 1) / kBlockQ;
  const int64_t work_items = int64_t{p.batch} * p.heads * query_blocks;
  if (work_items == 0) return 0;
  const int64_t threads =
      std::min<int64_t>(p.num_threads > 0 ? p.num_threads : omp_get_max_threads(), work_items);
  const int64_t per_thread = Tiles::floats_needed(p.head_dim, p.head_dim_v);
  std::optional<DropoutRng> dropout;
  if (p.dropout_p > 0.0f)
    dropout = make_dropout_rng(p.dropout_seed, p.dropout_offset, p.dropout_p);
  std::vector<float> workspace(static_cast<size_t>(threads * per_thread + kAlignFloats));
  float* base = workspace.data();
  while (reinterpret_cast<uintptr_t>(base) % (kAlignFloats * sizeof(float)) != 0) ++base;

#pragma omp parallel num_threads(static_cast<int>(threads))
  {
    Tiles tiles(base + omp_get_thread_num() * per_thread, p.head_dim, p.head_dim_v);
    // Dynamic scheduling: with causal or window masks, blocks differ a lot in cost.
#pragma omp for collapse(3) schedule(dynamic, 1)
    for (int32_t b = 0; b < p.batch; ++b)
      for (int32_t h = 0; h < p.heads; ++h)
        for (int64_t block = 0; block < query_blocks; ++block)
          attend_query_block<T>(p, dropout ? &*dropout : nullptr, b, h, block, tiles);
  }
  return workspace.size() * sizeof(float);
}

}  // namespace

size_t forward(const ForwardParams& params) {
  switch (params.dtype) {
    case DType::Float32:
      return forward_typed<float>(params);
    case DType::Float16:
      return forward_typed<half_t>(params);
    case DType::BFloat16:
      return forward_typed<bfloat16_t>(params);
    case DType::Int32:
      break;
  }
  throw Error(ErrorCode::Internal, "dtype", "fp32, fp16 or bf16 after validation",
              dtype_name(params.dtype));
}

}  // namespace flashattn::detail::cpu

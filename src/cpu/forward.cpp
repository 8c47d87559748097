// The CPU forward engine: FlashAttention's tiling on the host.
//
// Work item = (batch, head, block of query rows: kBlockQ, or fewer where causal items need
// balancing, rows_per_item). A thread loads its query block once
// (converted to fp32, pre-scaled), then walks the visible key blocks: converts kBlockK keys
// (transposed) and values to fp32, computes the score tile, applies softcap/ALiBi/mask, and
// folds the tile into a running max, sum and output accumulator (online softmax), dropping
// probabilities (common/philox.hpp) after they entered the sum. Keys that
// no row of the block can see are never loaded. Working memory is a fixed set of tiles per
// thread, so it does not depend on the sequence lengths at all.
//
// The work item itself (attend_rows, declared in cpu/attention.hpp) is also what the KV-cache
// forward runs: it reads keys through KeyRows (contiguous rows here, cache positions there)
// and may be limited to a chunk of the keys, whose partial result cpu/kvcache.cpp merges.
#include "cpu/forward.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "common/mask.hpp"
#include "common/numeric.hpp"
#include "cpu/amx.hpp"
#include "cpu/attention.hpp"
#include "cpu/fp8.hpp"
#include "cpu/kernels.hpp"
#include "cpu/tiles.hpp"

namespace flashattn::detail::cpu {

namespace {

constexpr int64_t kAlignFloats = 16;  // 64-byte alignment for every tile

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Where the values of a key block are: fp32 rows of the caller's tensor, or t.v.
struct ValueRows {
  const float* v;
  int64_t row_stride;
};

// Loads keys [j0, j0 + cols) transposed into t.kt (zero-padded) and their values into t.v,
// one run of equally strided rows at a time (a block may straddle pages of a paged cache).
// fp32 values are copied too, although accumulate_pv could read them where they are: rows of
// a (B, S, H, D) tensor lie H * D floats apart, a multiple of 4 KiB at H * D = 1024, so the
// block's rows of one column chunk fell into a few sets of the L1 cache and were fetched
// again for every block of query rows (the P V product ran a quarter slower than Q K^T).
template <typename T>
ValueRows load_key_block(const KeyRows& keys, int64_t j0, int cols, int D, int Dv, Tiles& t) {
  for (int c = 0; c < cols;) {
    const KeyRows::Run<T> run = keys.run<T>(j0 + c, cols - c);
    transpose_rows(run.k, keys.k_row_stride, run.count, D, t.kt, c);
    load_rows(run.v, keys.v_row_stride, run.count, Dv, 1.0f, t.v + static_cast<int64_t>(c) * Dv);
    c += run.count;
  }
  zero_columns_from(cols, D, t.kt);
  return {t.v, Dv};
}

}  // namespace

KeyRows KeyRows::of_sequence(const ForwardParams& p, int32_t b, const SequenceView& seq,
                             int32_t hk) {
  KeyRows r;
  // Paged: the pages' origin at head hk (the batch stride is the page stride).
  const int64_t k_offset = (p.is_paged() ? 0 : b * p.k_batch_stride + seq.k_row0 * p.k_row_stride) +
                           hk * p.k_head_stride;
  const int64_t v_offset = (p.is_paged() ? 0 : b * p.v_batch_stride + seq.k_row0 * p.v_row_stride) +
                           hk * p.v_head_stride;
  const size_t elem = dtype_size(p.dtype);
  // Null only for empty keys (validation), which no loop reads: no offset is applied to them.
  if (p.k != nullptr) r.k = static_cast<const char*>(p.k) + k_offset * static_cast<int64_t>(elem);
  if (p.v != nullptr) r.v = static_cast<const char*>(p.v) + v_offset * static_cast<int64_t>(elem);
  r.k_row_stride = p.k_row_stride;
  r.v_row_stride = p.v_row_stride;
  if (p.is_paged()) {
    r.paged = &p;
    r.b = b;
    r.k_batch_stride = p.k_batch_stride;
    r.v_batch_stride = p.v_batch_stride;
  }
  return r;
}

KeyRows KeyRows::of_cache(const KvCacheParams& p, int32_t b, const KvSequence& seq, int32_t hk) {
  const ForwardParams& a = p.attn;
  KeyRows r;
  const size_t elem = dtype_size(a.dtype);
  if (a.k != nullptr) r.k = static_cast<const char*>(a.k) + hk * a.k_head_stride * static_cast<int64_t>(elem);
  if (a.v != nullptr) r.v = static_cast<const char*>(a.v) + hk * a.v_head_stride * static_cast<int64_t>(elem);
  r.k_row_stride = a.k_row_stride;
  r.v_row_stride = a.v_row_stride;
  r.cache = &p;
  r.b = b;
  r.seq = seq;
  r.k_batch_stride = a.k_batch_stride;
  r.v_batch_stride = a.v_batch_stride;
  return r;
}

int64_t Tiles::floats_needed(int head_dim, int head_dim_v) {
  return round_up(int64_t{kBlockQ} * head_dim, kAlignFloats) +
         round_up(int64_t{kBlockK} * head_dim, kAlignFloats) +
         round_up(int64_t{kBlockK} * head_dim_v, kAlignFloats) +
         round_up(int64_t{kTileRows} * kBlockK, kAlignFloats) +
         round_up(int64_t{kBlockQ} * head_dim_v, kAlignFloats) + 2 * round_up(kBlockQ, kAlignFloats);
}

Tiles::Tiles(float* base, int head_dim, int head_dim_v) {
  float* p = base;
  const auto take = [&p](int64_t n) {
    float* r = p;
    p += round_up(n, kAlignFloats);
    return r;
  };
  q = take(int64_t{kBlockQ} * head_dim);
  kt = take(int64_t{kBlockK} * head_dim);
  v = take(int64_t{kBlockK} * head_dim_v);
  s = take(int64_t{kTileRows} * kBlockK);
  acc = take(int64_t{kBlockQ} * head_dim_v);
  m = take(kBlockQ);
  l = take(kBlockQ);
}

TileArena::TileArena(int64_t threads, int head_dim, int head_dim_v)
    : storage_(threads * Tiles::floats_needed(head_dim, head_dim_v)),
      base_(storage_.data()),
      per_thread_(Tiles::floats_needed(head_dim, head_dim_v)),
      head_dim_(head_dim),
      head_dim_v_(head_dim_v) {}

namespace {

// The rows of keys [j0, j0 + count) (values when `values`), a pointer per key, through the
// key rows' runs (a block may straddle pages of a paged cache); null past count up to `total`.
void key_row_pointers(const KeyRows& keys, int64_t j0, int count, int total, bool values,
                      const bfloat16_t** rows) {
  for (int c = 0; c < count;) {
    const KeyRows::Run<bfloat16_t> run = keys.run<bfloat16_t>(j0 + c, count - c);
    const bfloat16_t* first = values ? run.v : run.k;
    const int64_t stride = values ? keys.v_row_stride : keys.k_row_stride;
    for (int x = 0; x < run.count; ++x) rows[c + x] = first + x * stride;
    c += run.count;
  }
  for (int c = count; c < total; ++c) rows[c] = nullptr;
}

// Asks for row r of the next key block's keys and values while row r of this block's scores is
// worked on, so that the next block's staging finds them in cache (no row past next.count).
template <typename T>
void prefetch_next_row(const KeyRows& keys, const KeyRows::Run<T>& next, int r, int D, int Dv) {
  if (r >= next.count) return;
  prefetch_row(next.k + r * keys.k_row_stride, D);
  prefetch_row(next.v + r * keys.v_row_stride, Dv);
}

// modify_scores over the score tile of rows [r0, r0 + n) of `block` (keys [j0, j0 + cols)): a
// packed block's rows each have their own position and head (ALiBi slope), a plain one's one.
void modify_tile(const ForwardParams& p, const SequenceView& seq, int32_t b, const RowBlock& block,
                 int r0, int n, int64_t j0, int cols, float* s) {
  const auto slope_of = [&](int r) {
    return p.alibi_slopes != nullptr ? p.alibi_slopes[b * p.alibi_batch_stride + block.head(r)]
                                     : 0.0f;
  };
  if (block.group > 1) {
    for (int r = 0; r < n; ++r)
      modify_scores(p, seq, slope_of(r0 + r), s + static_cast<int64_t>(r) * kBlockK,
                    block.position(r0 + r), 1, j0, cols);
  } else {
    modify_scores(p, seq, slope_of(0), s, block.position(r0), n, j0, cols);
  }
}

// attend_rows for bf16 with the two matrix products on AMX tiles (cpu/amx.hpp): the same steps
// (scores, modify_scores, softmax_step, dropout, P V) with the query block and each key block
// staged as bf16 in AMX's layouts, in the float tiles' storage (a bf16 operand takes half of
// its fp32 tile), and P rounded to bf16 for P V as on the GPU (the row sums stay those of the
// fp32 probabilities). Rows are handled in whole 32-row tiles, the padding rows zero.
void attend_rows_amx(const ForwardParams& p, const SequenceView& seq, const KeyRows& keys,
                     KeyRange chunk, const DropoutRng* dropout, int32_t b, const RowBlock& block,
                     Tiles& t) {
  const int D = p.head_dim, Dv = p.head_dim_v, rows = block.rows;
  const int padded_rows = static_cast<int>(round_up(rows, 32));
  auto* q = reinterpret_cast<uint16_t*>(t.q);                  // padded_rows x D
  uint16_t* probabilities = q + int64_t{kBlockQ} * D;          // kTileRows x kBlockK
  auto* key_pairs = reinterpret_cast<uint16_t*>(t.kt);         // kBlockK x D, packed
  auto* value_pairs = reinterpret_cast<uint16_t*>(t.v);        // kBlockK x Dv, packed
  static_assert(sizeof(bfloat16_t) == sizeof(uint16_t), "bf16 is 16 bits");
  for (int r = 0; r < padded_rows; ++r) {
    uint16_t* dst = q + int64_t{r} * D;
    if (r < rows) {
      const bfloat16_t* src = static_cast<const bfloat16_t*>(p.q) + b * p.q_batch_stride +
                              (seq.q_row0 + block.position(r)) * p.q_row_stride +
                              block.head(r) * p.q_head_stride;
      std::memcpy(dst, src, sizeof(uint16_t) * D);
    } else {
      std::fill(dst, dst + D, uint16_t{0});
    }
  }
  const float scale = query_scale(p);
  // Without softcap and ALiBi, modify_scores only masks (-inf whatever the scale), so the
  // softmax takes the scale in its exponent's multiply-add instead of a pass over the tile.
  const float softmax_scale = scale > 0.0f && p.softcap == 0.0f && p.alibi_slopes == nullptr
                                  ? scale
                                  : 1.0f;
  const bool scale_in_softmax = softmax_scale != 1.0f;
  std::fill(t.m, t.m + rows, -std::numeric_limits<float>::infinity());
  std::fill(t.l, t.l + rows, 0.0f);
  std::fill(t.acc, t.acc + static_cast<int64_t>(padded_rows) * Dv, 0.0f);
  amx::configure_tiles();

  const KeyRange visible =
      visible_keys_of_rows(block.position(0), block.position(rows - 1) + 1, seq.seqlen_q,
                           seq.seqlen_k, p.window_left, p.window_right);
  const int64_t begin = std::max(visible.begin, chunk.begin);
  const int64_t end = std::min(visible.end, chunk.end);
  const bfloat16_t* row_of[kBlockK];
  for (int64_t j0 = begin; j0 < end; j0 += kBlockK) {
    const int cols = static_cast<int>(std::min<int64_t>(kBlockK, end - j0));
    const int padded_cols = static_cast<int>(round_up(cols, 32));
    key_row_pointers(keys, j0, cols, padded_cols, false, row_of);
    amx::pack_pairs_of_rows(row_of, D, padded_cols, key_pairs);
    key_row_pointers(keys, j0, cols, padded_cols, true, row_of);
    amx::pack_pairs_of_columns(row_of, Dv, padded_cols, value_pairs);
    KeyRows::Run<bfloat16_t> next{nullptr, nullptr, 0};
    if (j0 + kBlockK < end)
      next = keys.run<bfloat16_t>(j0 + kBlockK,
                                  static_cast<int>(std::min<int64_t>(kBlockK, end - j0 - kBlockK)));

    for (int r0 = 0; r0 < rows; r0 += kTileRows) {
      const int n = std::min(kTileRows, rows - r0);
      const int padded_n = static_cast<int>(round_up(n, 32));
      const KeyRange seen =
          visible_keys_of_rows(block.position(r0), block.position(r0 + n - 1) + 1,
                               seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right);
      if (seen.end <= j0 || seen.begin >= j0 + cols) continue;
      amx::product(q + int64_t{r0} * D, D, key_pairs, padded_n, D, padded_cols, t.s, kBlockK,
                   false, scale_in_softmax ? 1.0f : scale);
      modify_tile(p, seq, b, block, r0, n, j0, cols, t.s);
      for (int r = 0; r < n; ++r) {
        prefetch_next_row(keys, next, r0 + r, D, Dv);
        float* row = t.s + static_cast<int64_t>(r) * kBlockK;
        float* acc_row = t.acc + static_cast<int64_t>(r0 + r) * Dv;
        uint16_t* p_row = probabilities + static_cast<int64_t>(r) * kBlockK;
        if (dropout == nullptr && amx::softmax_step_bf16(row, t.m + r0 + r, t.l + r0 + r, acc_row,
                                                         Dv, p_row, softmax_scale))
          continue;
        if (dropout == nullptr || !amx::softmax_step_bf16(row, t.m + r0 + r, t.l + r0 + r, acc_row,
                                                          Dv, nullptr, softmax_scale)) {
          if (scale_in_softmax)  // softmax_step takes scaled scores
            for (int j = 0; j < kBlockK; ++j) row[j] *= softmax_scale;
          softmax_step(row, t.m + r0 + r, t.l + r0 + r, acc_row, Dv);
        }
        if (dropout != nullptr) {
          float m[kBlockK];
          dropout_multipliers(p, *dropout, b, block.head(r0 + r), block.position(r0 + r), j0, cols,
                              m);
          for (int j = 0; j < cols; ++j) row[j] *= m[j];
        }
        amx::round_to_bf16(row, padded_cols, p_row);
      }
      for (int r = n; r < padded_n; ++r)
        std::fill_n(probabilities + static_cast<int64_t>(r) * kBlockK, padded_cols, uint16_t{0});
      amx::product(probabilities, kBlockK, value_pairs, padded_n, padded_cols, Dv,
                   t.acc + static_cast<int64_t>(r0) * Dv, Dv, true);
    }
  }
  amx::release_tiles();
}

}  // namespace

template <typename T>
void attend_rows(const ForwardParams& p, const SequenceView& seq, const KeyRows& keys,
                 KeyRange chunk, const DropoutRng* dropout, int32_t b, const RowBlock& block,
                 Tiles& t) {
  if constexpr (std::is_same_v<T, bfloat16_t>) {
    if (amx::available() && amx::fits(p.head_dim, p.head_dim_v)) {
      attend_rows_amx(p, seq, keys, chunk, dropout, b, block, t);
      return;
    }
  }
  const int D = p.head_dim, Dv = p.head_dim_v, rows = block.rows;
  const bool packed = block.group > 1;
  const auto q_row = [&](int r) {
    return static_cast<const T*>(p.q) + b * p.q_batch_stride +
           (seq.q_row0 + block.position(r)) * p.q_row_stride + block.head(r) * p.q_head_stride;
  };
  if (packed) {
    for (int r = 0; r < rows; ++r)
      load_rows(q_row(r), p.q_row_stride, 1, D, query_scale(p), t.q + static_cast<int64_t>(r) * D);
  } else {
    load_rows(q_row(0), p.q_row_stride, rows, D, query_scale(p), t.q);
  }
  std::fill(t.m, t.m + rows, -std::numeric_limits<float>::infinity());
  std::fill(t.l, t.l + rows, 0.0f);
  std::fill(t.acc, t.acc + static_cast<int64_t>(rows) * Dv, 0.0f);

  const KeyRange visible =
      visible_keys_of_rows(block.position(0), block.position(rows - 1) + 1, seq.seqlen_q,
                           seq.seqlen_k, p.window_left, p.window_right);
  const int64_t begin = std::max(visible.begin, chunk.begin);
  const int64_t end = std::min(visible.end, chunk.end);
  for (int64_t j0 = begin; j0 < end; j0 += kBlockK) {
    const int cols = static_cast<int>(std::min<int64_t>(kBlockK, end - j0));
    const ValueRows values = load_key_block<T>(keys, j0, cols, D, Dv, t);
    // The next block's key and value rows (or those of its first page), asked for a row per
    // row of scores below, so that load_key_block finds them in cache.
    KeyRows::Run<T> next{nullptr, nullptr, 0};
    if (j0 + kBlockK < end)
      next = keys.run<T>(j0 + kBlockK, static_cast<int>(std::min<int64_t>(kBlockK, end - j0 - kBlockK)));

    // The block's rows a score tile at a time (the staged keys serve them all); rows that
    // see none of these keys skip them (a causal block's diagonal).
    for (int r0 = 0; r0 < rows; r0 += kTileRows) {
      const int n = std::min(kTileRows, rows - r0);
      const KeyRange seen =
          visible_keys_of_rows(block.position(r0), block.position(r0 + n - 1) + 1,
                               seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right);
      if (seen.end <= j0 || seen.begin >= j0 + cols) continue;
      score_tile(t.q + static_cast<int64_t>(r0) * D, t.kt, t.s, n, D);
      modify_tile(p, seq, b, block, r0, n, j0, cols, t.s);
      for (int r = 0; r < n; ++r) {
        prefetch_next_row(keys, next, r0 + r, D, Dv);
        float* row = t.s + static_cast<int64_t>(r) * kBlockK;
        softmax_step(row, t.m + r0 + r, t.l + r0 + r,
                     t.acc + static_cast<int64_t>(r0 + r) * Dv, Dv);
        // Dropout acts after the row sum is taken: l (and so lse) is of the undropped
        // softmax, and only what multiplies v is dropped and rescaled.
        if (dropout != nullptr) {
          float m[kBlockK];
          dropout_multipliers(p, *dropout, b, block.head(r0 + r), block.position(r0 + r), j0, cols,
                              m);
          for (int j = 0; j < cols; ++j) row[j] *= m[j];
        }
      }
      accumulate_pv(Weights{t.s, kBlockK, 1}, values.v, values.row_stride,
                    t.acc + static_cast<int64_t>(r0) * Dv, Dv, n, cols, Dv);
    }
  }
}

template void attend_rows<float>(const ForwardParams&, const SequenceView&, const KeyRows&,
                                 KeyRange, const DropoutRng*, int32_t, const RowBlock&, Tiles&);
template void attend_rows<half_t>(const ForwardParams&, const SequenceView&, const KeyRows&,
                                  KeyRange, const DropoutRng*, int32_t, const RowBlock&, Tiles&);
template void attend_rows<bfloat16_t>(const ForwardParams&, const SequenceView&,
                                      const KeyRows&, KeyRange, const DropoutRng*, int32_t,
                                      const RowBlock&, Tiles&);

namespace {

// The query rows of a work item: kBlockQ, but where a causal mask or a right window makes
// the items differ in cost (and no left window: every row's keys then start at key 0, so the
// key blocks, and the result, do not depend on the rows per item), halved down to kTileRows
// until each thread has 4 items to balance. 2-core AMD VM, fp32 head dim 128, 2 threads
// (dev/cpu_ab.cpp, rows 256 against 64-128): causal 512 x 2 heads 1.14x, 1k x 1 head 1.11x,
// 2k x 1 head 1.01x; without a mask, whose items cost the same, 1k x 1 head lost 3 % to
// staging each key block for more items, so it keeps kBlockQ.
int rows_per_item(const ForwardParams& p, int64_t longest_q) {
  const bool items_differ = p.window_left < 0 && p.window_right >= 0;
  const int64_t threads = p.num_threads > 0 ? p.num_threads : omp_get_max_threads();
  int rows = kBlockQ;
  while (items_differ && rows > kTileRows &&
         int64_t{p.batch} * p.heads * ((longest_q + rows - 1) / rows) < 4 * threads)
    rows /= 2;
  return rows;
}

// One work item of a dense or ragged forward: query block `block` (of block_rows rows) of
// (b, h) against all of its sequence's keys, written to out/lse.
template <typename T>
void attend_query_block(const ForwardParams& p, const DropoutRng* dropout, int32_t b,
                        int32_t h, int64_t block, int block_rows, Tiles& t) {
  const SequenceView seq = sequence_view(p, b);
  const int64_t i0 = block * block_rows;
  if (i0 >= seq.seqlen_q) return;  // varlen: this sequence is shorter than max_seqlen_q
  const int rows = static_cast<int>(std::min<int64_t>(block_rows, seq.seqlen_q - i0));
  const KeyRows keys = KeyRows::of_sequence(p, b, seq, h / p.group_size());
  attend_rows<T>(p, seq, keys, {0, seq.seqlen_k}, dropout, b, RowBlock{i0, rows, h, 1}, t);
  T* out = static_cast<T*>(p.out) + b * p.out_batch_stride +
           (seq.q_row0 + i0) * p.out_row_stride + h * p.out_head_stride;
  float* lse = p.lse != nullptr
                   ? p.lse + b * p.lse_batch_stride + h * p.lse_head_stride + seq.q_row0 + i0
                   : nullptr;
  store_rows(t, rows, p.head_dim_v, out, p.out_row_stride, lse);
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
  const int block_rows = rows_per_item(p, longest_q);
  const int64_t query_blocks = (longest_q + block_rows - 1) / block_rows;
  return over_query_blocks(p, query_blocks, p.head_dim_v,
                           [&](const DropoutRng* dropout, int32_t b, int32_t h, int64_t block,
                               Tiles& tiles) { attend_query_block<T>(p, dropout, b, h, block, block_rows, tiles); });
}

}  // namespace

size_t forward(const ForwardParams& params) {
  amx::check_setting();
  switch (params.dtype) {
    case DType::Float32:
      return forward_typed<float>(params);
    case DType::Float16:
      return forward_typed<half_t>(params);
    case DType::BFloat16:
      return forward_typed<bfloat16_t>(params);
    case DType::Float8E4M3:
      return forward_fp8(params);
    case DType::Int32:
      break;
  }
  throw Error(ErrorCode::Internal, "dtype", "fp32, fp16 or bf16 after validation",
              dtype_name(params.dtype));
}

}  // namespace flashattn::detail::cpu

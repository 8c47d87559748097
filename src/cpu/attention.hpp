// The CPU forward engine's unit of work, shared by the dense/varlen forward (cpu/forward.cpp)
// and the KV-cache forward (cpu/kvcache.cpp): a block of query rows of one (batch, head)
// attends to a range of keys with the online softmax, leaving the unnormalised accumulator,
// running max and running sum in the thread's tiles; store_row(s) then normalises them into
// an output (the call's out/lse, or an fp32 partial result of a key chunk).
//
// The two callers differ only in where a key row lives, which KeyRows says: contiguous rows
// of a dense or ragged batch, or cache positions of a (possibly paged) KV cache.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "common/kvcache.hpp"
#include "common/mask.hpp"
#include "common/numeric.hpp"
#include "common/params.hpp"
#include "common/philox.hpp"
#include "cpu/amx.hpp"
#include "cpu/kernels.hpp"
#include "cpu/tiles.hpp"

namespace flashattn::detail::cpu {

// Where the keys and values of one (sequence, key/value head) live, by key index j (0-based
// within the sequence, the index the mask counts).
struct KeyRows {
  const void* k = nullptr;  // contiguous: key 0; cache: the cache's origin at head hk
  const void* v = nullptr;
  int64_t k_row_stride = 0, v_row_stride = 0;
  // A KV cache (null: rows are contiguous at the row strides): key j is cache position
  // seq.begin + j of sequence b, addressed by kv_position_offset (dense row or page).
  const KvCacheParams* cache = nullptr;
  // Paged varlen keys (null: none): key j of sequence b is at paged_row (validated pages).
  const ForwardParams* paged = nullptr;
  int32_t b = 0;
  KvSequence seq;
  int64_t k_batch_stride = 0, v_batch_stride = 0;

  // The keys of sequence b (rows seq.k_row0 ..., or its pages) of a dense or ragged batch,
  // head hk.
  static KeyRows of_sequence(const ForwardParams& p, int32_t b, const SequenceView& seq,
                             int32_t hk);
  // The keys of sequence b of a KV cache, head hk.
  static KeyRows of_cache(const KvCacheParams& p, int32_t b, const KvSequence& seq, int32_t hk);

  // Keys j .. j + count - 1 (count <= n) are rows at a fixed stride from these pointers:
  // all n of them unless a page ends first.
  template <typename T>
  struct Run {
    const T* k;
    const T* v;
    int count;
  };
  template <typename T>
  Run<T> run(int64_t j, int n) const {
    const T* kb = static_cast<const T*>(k);
    const T* vb = static_cast<const T*>(v);
    if (paged != nullptr) {
      const PagedRow at = paged_row(*paged, b, j);
      return {kb + at.page * k_batch_stride + at.row * k_row_stride,
              vb + at.page * v_batch_stride + at.row * v_row_stride,
              static_cast<int>(std::min<int64_t>(n, paged->page_size - at.row))};
    }
    if (cache == nullptr) return {kb + j * k_row_stride, vb + j * v_row_stride, n};
    const int64_t pos = seq.begin + j;
    int count = n;
    if (cache->is_paged())
      count = static_cast<int>(std::min<int64_t>(n, cache->page_size - pos % cache->page_size));
    return {kb + kv_position_offset(*cache, b, seq, pos, k_batch_stride, k_row_stride),
            vb + kv_position_offset(*cache, b, seq, pos, v_batch_stride, v_row_stride), count};
  }
};

// One thread's tiles, carved out of a TileArena.
struct Tiles {
  float* q;    // kBlockQ x D, pre-multiplied by the softmax scale (and 1/softcap)
  float* kt;   // D x kBlockK: keys transposed, zero beyond the last key
  float* v;    // kBlockK x Dv
  float* s;    // kTileRows x kBlockK: scores, then probabilities
  float* acc;  // kBlockQ x Dv: unnormalised output
  float* m;    // kBlockQ: running max of each row
  float* l;    // kBlockQ: running sum of exp(score - max) of each row

  static int64_t floats_needed(int head_dim, int head_dim_v);
  Tiles(float* base, int head_dim, int head_dim_v);
};

// Tiles for `threads` threads in one 64-byte aligned allocation. Working memory does not
// depend on the sequence lengths at all.
class TileArena {
 public:
  TileArena(int64_t threads, int head_dim, int head_dim_v);
  Tiles tiles(int thread) const { return Tiles(base_ + thread * per_thread_, head_dim_, head_dim_v_); }
  size_t bytes() const { return storage_.bytes(); }

 private:
  ScratchFloats storage_;
  float* base_ = nullptr;
  int64_t per_thread_ = 0;
  int head_dim_ = 0, head_dim_v_ = 0;
};

// Runs block(dropout, b, h, query_block, tiles) for every (batch, head, query block) of
// kBlockQ rows, on p.num_threads threads (0: all) with one TileArena slice each; returns the
// arena's bytes. Dynamic scheduling: with causal or window masks, blocks differ a lot in cost.
template <typename Block>
size_t over_query_blocks(const ForwardParams& p, int64_t query_blocks, int head_dim_v,
                         const Block& block) {
  const int64_t work_items = int64_t{p.batch} * p.heads * query_blocks;
  if (work_items == 0) return 0;
  const int64_t threads =
      std::min<int64_t>(p.num_threads > 0 ? p.num_threads : omp_get_max_threads(), work_items);
  std::optional<DropoutRng> dropout;
  if (p.dropout_p > 0.0f)
    dropout = make_dropout_rng(p.dropout_seed, p.dropout_offset, p.dropout_p);
  const TileArena arena(threads, p.head_dim, head_dim_v);

#pragma omp parallel num_threads(static_cast<int>(threads))
  {
    Tiles tiles = arena.tiles(omp_get_thread_num());
#pragma omp for collapse(3) schedule(dynamic, 1)
    for (int32_t b = 0; b < p.batch; ++b)
      for (int32_t h = 0; h < p.heads; ++h)
        for (int64_t q_block = 0; q_block < query_blocks; ++q_block)
          block(dropout ? &*dropout : nullptr, b, h, q_block, tiles);
  }
  return arena.bytes();
}

// The query rows of one work item. Packed index x = first + r (row r of the item) is query
// position x / group of head head0 + x % group: with group 1, consecutive positions of one
// head (the forward); with group G = H / Hk, the query heads that share a key/value head,
// position by position (the KV-cache path: each key block is then loaded once for all G).
struct RowBlock {
  int64_t first = 0;
  int rows = 0;
  int32_t head0 = 0;
  int32_t group = 1;
  int64_t position(int r) const { return (first + r) / group; }
  int32_t head(int r) const { return head0 + static_cast<int32_t>((first + r) % group); }
};

// The rows of `block` of sequence `seq` (rows of p.q from seq.q_row0) against the keys of
// `chunk` that the mask lets them see. Mask, ALiBi and dropout indices stay those of the
// whole sequence, so a chunk is exactly a slice of the unsplit problem. Leaves acc
// (unnormalised), m and l of each row in `t`. Defined for float, half_t and bfloat16_t
// (cpu/forward.cpp).
template <typename T>
void attend_rows(const ForwardParams& p, const SequenceView& seq, const KeyRows& keys,
                 KeyRange chunk, const DropoutRng* dropout, int32_t b, const RowBlock& block,
                 Tiles& t);

// Normalises row r of what attend_rows left: out = acc / l (0 for a row that saw no key),
// *lse = m + log(l) (-inf for such a row; skipped when lse is null).
// `vector_bf16` (bf16 out, AMX processors): the conversion by amx::scale_to_bf16.
template <typename Out>
void store_normalised(const float* acc, float m, float l, int head_dim_v, Out* out, float* lse,
                      bool vector_bf16 = false) {
  const float inv = l == 0.0f ? 0.0f : 1.0f / l;
  if constexpr (std::is_same_v<Out, bfloat16_t>) {
    if (vector_bf16)
      amx::scale_to_bf16(acc, inv, head_dim_v, reinterpret_cast<uint16_t*>(out));
    else
      for (int d = 0; d < head_dim_v; ++d) out[d] = from_float<Out>(acc[d] * inv);
  } else {
    for (int d = 0; d < head_dim_v; ++d) out[d] = from_float<Out>(acc[d] * inv);
  }
  if (lse != nullptr) *lse = l == 0.0f ? -std::numeric_limits<float>::infinity() : m + std::log(l);
}
template <typename Out>
void store_row(const Tiles& t, int r, int head_dim_v, Out* out, float* lse,
               bool vector_bf16 = false) {
  store_normalised(t.acc + static_cast<int64_t>(r) * head_dim_v, t.m[r], t.l[r], head_dim_v, out,
                   lse, vector_bf16);
}

// store_row for rows [0, rows) going to consecutive out rows and lse entries.
template <typename Out>
void store_rows(const Tiles& t, int rows, int head_dim_v, Out* out, int64_t out_row_stride,
                float* lse) {
  const bool vector_bf16 = std::is_same_v<Out, bfloat16_t> && amx::available();
  for (int r = 0; r < rows; ++r)
    store_row(t, r, head_dim_v, out + r * out_row_stride, lse != nullptr ? lse + r : nullptr,
              vector_bf16);
}

}  // namespace flashattn::detail::cpu

// The normalised description of one forward_kvcache call (validated by src/api), the
// addressing rules of a KV cache, written once for every backend, and what a backend reports
// back (KvCacheRun).
//
// attn describes the attention as a dense forward: q/out/lse and their strides as usual, k/v
// pointing at the caches (k_batch_stride = the stride of the cache's first dimension: a
// sequence row of a dense cache, a page of a paged one), seqlen_k = the positions a sequence
// can hold. Which positions take part, and where they are, is decided per sequence here.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/host_device.hpp"
#include "common/params.hpp"

namespace flashattn::detail {

// What a KV-cache forward did, for RunInfo.
struct KvCacheRun {
  size_t workspace_bytes = 0;
  int32_t num_splits = 1;  // the key chunks it merged (num_splits resolved)
};

// Queries take their rotary position from their own row when the mask depends on it (window
// bounds as the params hold them: causal is a right bound of 0). One rule for the kernels and
// for the validator that checks the rotary tables have the rows the kernels will read.
FA_HOST_DEVICE bool kvcache_rotary_q_per_row(int32_t window_left, int32_t window_right) {
  return window_left >= 0 || window_right >= 0;
}

struct KvCacheParams {
  ForwardParams attn;
  // The caches' dtype: attn.dtype (q's), or fp8 e4m3, whose values stand for value times
  // attn.k_descale / attn.v_descale (one factor per sequence and key/value head).
  DType cache_dtype = DType::Float32;

  const int32_t* cache_seqlens = nullptr;    // (B)
  const int32_t* cache_batch_idx = nullptr;  // (B); null: sequence b uses cache row b
  const int32_t* cache_leftpad = nullptr;    // (B); null: every sequence starts at position 0
  const int32_t* block_table = nullptr;      // (B, max_pages); null: dense cache
  int64_t block_table_batch_stride = 0;
  int32_t page_size = 0;                     // paged only
  int64_t cache_rows = 0;  // the caches' dim 0: B_cache sequence rows, or num_pages pages

  // Appended keys and values (null: none), (B, seqlen_new, Hk, D), attn's dtype.
  const void* k_new = nullptr;
  const void* v_new = nullptr;
  int64_t seqlen_new = 0;
  int64_t k_new_batch_stride = 0, k_new_row_stride = 0, k_new_head_stride = 0;
  int64_t v_new_batch_stride = 0, v_new_row_stride = 0, v_new_head_stride = 0;

  // Rotary (null: none): cos/sin (rotary_seqlen, rotary_dim / 2), attn's dtype.
  const void* rotary_cos = nullptr;
  const void* rotary_sin = nullptr;
  int64_t rotary_cos_row_stride = 0, rotary_sin_row_stride = 0;
  int64_t rotary_seqlen = 0;
  int32_t rotary_dim = 0;
  bool rotary_interleaved = false;

  // As asked: 0 = the backend chooses, else the number of key chunks.
  int32_t num_splits = 0;

  FA_HOST_DEVICE bool is_paged() const { return block_table != nullptr; }
  FA_HOST_DEVICE bool rotary_q_per_row() const {
    return kvcache_rotary_q_per_row(attn.window_left, attn.window_right);
  }
};

// Sequence b's keys: the cache positions [begin, end) after the append, and the dense cache
// row it lives in (ignored when paged). seqlen_k = end - begin is what the mask aligns to.
// filled = cache_seqlens[b]: positions from there on are the appended ones.
struct KvSequence {
  int64_t begin = 0, end = 0;
  int64_t filled = 0;
  int64_t cache_row = 0;
  FA_HOST_DEVICE int64_t seqlen_k() const { return end - begin; }
};

FA_HOST_DEVICE KvSequence kv_sequence(const KvCacheParams& p, int32_t b) {
  KvSequence s;
  s.begin = p.cache_leftpad != nullptr ? p.cache_leftpad[b] : 0;
  s.filled = p.cache_seqlens[b];
  s.end = s.filled + (p.k_new != nullptr ? p.seqlen_new : 0);
  s.cache_row = p.cache_batch_idx != nullptr ? p.cache_batch_idx[b] : b;
  return s;
}

// Whether sequence s's per-sequence values address only what the call was given: 0 <=
// cache_leftpad <= cache_seqlens, cache_seqlens + S_new within the capacity (S_cache, or
// max_pages * page_size), a dense cache row in [0, B_cache), rotary tables that reach every
// position rotated (k_new's, and q's: rotary_q_position). The validator's rules for host
// values (validate.cpp, check_kvcache_values), as one predicate: on CUDA, where the values are
// read by the kernels, a sequence that fails it reads and writes nothing and its out and lse
// rows are NaN (docs/SPEC.md). A large value in range counts the same as a wrong one.
FA_HOST_DEVICE bool kv_sequence_in_range(const KvCacheParams& p, const KvSequence& s) {
  bool ok = s.begin >= 0 && s.begin <= s.filled && s.end <= p.attn.seqlen_k;
  if (p.cache_batch_idx != nullptr) ok = ok && s.cache_row >= 0 && s.cache_row < p.cache_rows;
  if (p.rotary_cos != nullptr) {
    const bool appends = p.k_new != nullptr && p.seqlen_new > 0;
    const int64_t q_end =
        p.attn.seqlen_q > 0 ? s.filled + (p.rotary_q_per_row() ? p.attn.seqlen_q : 1) : 0;
    ok = ok && (!appends || s.end <= p.rotary_seqlen) && q_end <= p.rotary_seqlen;
  }
  return ok;
}

// Whether a block_table entry names one of the cache's pages. On CUDA a page out of range is
// never read or written: a sequence whose append would write into one is treated as out of
// range (nothing appended, NaN rows, as above); otherwise the page's positions read as keys of
// NaN (values of 0), so exactly the query rows that attend to one of them have NaN out and lse.
FA_HOST_DEVICE bool kv_page_in_range(const KvCacheParams& p, int64_t page) {
  return page >= 0 && page < p.cache_rows;
}

// The element offset of cache position `pos` of sequence b (head 0) in a cache with the given
// strides: dense caches index (cache_row, pos); paged ones (block_table[b][pos / page_size],
// pos % page_size).
FA_HOST_DEVICE int64_t kv_position_offset(const KvCacheParams& p, int32_t b,
                                          const KvSequence& s, int64_t pos,
                                          int64_t batch_stride, int64_t row_stride) {
  if (p.block_table == nullptr) return s.cache_row * batch_stride + pos * row_stride;
  const int64_t page = p.block_table[b * p.block_table_batch_stride + pos / p.page_size];
  return page * batch_stride + (pos % p.page_size) * row_stride;
}

// The rotary position of query row t (0-based) of sequence b.
FA_HOST_DEVICE int64_t rotary_q_position(const KvCacheParams& p, int32_t b, int64_t t) {
  return int64_t{p.cache_seqlens[b]} + (p.rotary_q_per_row() ? t : 0);
}

}  // namespace flashattn::detail

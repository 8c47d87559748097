// The masking rule and the score modifiers of SPEC.md, written once for every backend.
// (The float64 reference in src/reference deliberately re-implements them literally, so
// that it can catch a mistake made here.)
#pragma once

#include <cmath>
#include <cstdint>

#include "common/host_device.hpp"

namespace flashattn::detail {

// The keys query row i may see: [begin, end). The diagonal is aligned to the bottom-right
// corner: row i sits at key position d = i + seqlen_k - seqlen_q, and sees keys
// d - left .. d + right (a bound of -1 is unbounded). begin and end never decrease as i
// grows, which is what lets a block of rows be summarised by its first and last row.
struct KeyRange {
  int64_t begin = 0, end = 0;
  FA_HOST_DEVICE bool empty() const { return end <= begin; }
};

FA_HOST_DEVICE int64_t clamp64(int64_t x, int64_t lo, int64_t hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

FA_HOST_DEVICE KeyRange visible_keys(int64_t i, int64_t seqlen_q, int64_t seqlen_k,
                                     int32_t left, int32_t right) {
  const int64_t d = i + seqlen_k - seqlen_q;
  KeyRange r;
  r.begin = left >= 0 ? clamp64(d - left, 0, seqlen_k) : 0;
  r.end = right >= 0 ? clamp64(d + right + 1, 0, seqlen_k) : seqlen_k;
  if (r.end < r.begin) r.end = r.begin;
  return r;
}

// Keys seen by at least one of the rows [i0, i1) (i1 > i0): everything outside can be skipped.
FA_HOST_DEVICE KeyRange visible_keys_of_rows(int64_t i0, int64_t i1, int64_t seqlen_q,
                                             int64_t seqlen_k, int32_t left, int32_t right) {
  KeyRange r;
  r.begin = visible_keys(i0, seqlen_q, seqlen_k, left, right).begin;
  r.end = visible_keys(i1 - 1, seqlen_q, seqlen_k, left, right).end;
  if (r.end < r.begin) r.end = r.begin;
  return r;
}

// True when every row of [i0, i1) sees every key of [j0, j1): such a block needs no masking.
FA_HOST_DEVICE bool block_fully_visible(int64_t i0, int64_t i1, int64_t j0, int64_t j1,
                                        int64_t seqlen_q, int64_t seqlen_k, int32_t left,
                                        int32_t right) {
  return visible_keys(i1 - 1, seqlen_q, seqlen_k, left, right).begin <= j0 &&
         j1 <= visible_keys(i0, seqlen_q, seqlen_k, left, right).end;
}

// The key blocks that every row of [i0, i1) sees whole, as block indices [begin, end) within
// the n_blocks blocks of block_n keys that start at key `first_key` (end <= begin: none).
// Blocks outside need the mask; the forward kernels find this range once, before their loop.
FA_HOST_DEVICE KeyRange fully_visible_blocks(int64_t i0, int64_t i1, int64_t first_key, int64_t block_n,
                                             int64_t n_blocks, int64_t seqlen_q, int64_t seqlen_k,
                                             int32_t left, int32_t right) {
  const int64_t seen_by_all_from = visible_keys(i1 - 1, seqlen_q, seqlen_k, left, right).begin - first_key;
  const int64_t seen_by_all_to = visible_keys(i0, seqlen_q, seqlen_k, left, right).end - first_key;
  const int64_t first = seen_by_all_from <= 0 ? 0 : (seen_by_all_from + block_n - 1) / block_n;
  const int64_t last = seen_by_all_to < block_n ? 0 : (seen_by_all_to - block_n) / block_n + 1;
  KeyRange r;
  r.begin = first < n_blocks ? first : n_blocks;
  r.end = last < n_blocks ? last : n_blocks;
  return r;
}

// The row blocks (n_blocks blocks of block_m rows from first_row, the last one ending at
// seqlen_q at the latest) whose every row sees every key of [j0, j1), as block indices
// [begin, end) (end <= begin: none); the backward's steps outside need the mask. A block sees
// [j0, j1) whole iff its first row's visible keys end at j1 or later and its last row's begin
// at j0 or earlier; both hold from some block on and up to some block (begin and end never
// decrease with the row), so each bound is a binary search, done once per key block.
FA_HOST_DEVICE KeyRange fully_visible_row_blocks(int64_t first_row, int64_t block_m, int64_t n_blocks,
                                                 int64_t j0, int64_t j1, int64_t seqlen_q, int64_t seqlen_k,
                                                 int32_t left, int32_t right) {
  int64_t lo = 0, hi = n_blocks;  // the first block whose first row sees up to j1
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (j1 <= visible_keys(first_row + mid * block_m, seqlen_q, seqlen_k, left, right).end)
      hi = mid;
    else
      lo = mid + 1;
  }
  KeyRange r;
  r.begin = lo;
  lo = 0;
  hi = n_blocks;  // the first block whose last row starts past j0
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    const int64_t end_row = first_row + (mid + 1) * block_m;
    const int64_t last = (end_row < seqlen_q ? end_row : seqlen_q) - 1;
    if (visible_keys(last, seqlen_q, seqlen_k, left, right).begin <= j0)
      lo = mid + 1;
    else
      hi = mid;
  }
  r.end = lo;
  return r;
}

// The query rows that see at least one key of [j0, j1) (0 <= j0 < j1 <= seqlen_k), as a
// [begin, end) range within [0, seqlen_q): row i sees a key there iff d + right >= j0 (when
// right >= 0) and d - left < j1 (when left >= 0), d = i + seqlen_k - seqlen_q, both
// monotone in i. The backward's key-parallel pass walks only these rows.
FA_HOST_DEVICE KeyRange rows_seeing_keys(int64_t j0, int64_t j1, int64_t seqlen_q,
                                         int64_t seqlen_k, int32_t left, int32_t right) {
  const int64_t shift = seqlen_k - seqlen_q;
  KeyRange r;
  r.begin = right >= 0 ? clamp64(j0 - right - shift, 0, seqlen_q) : 0;
  r.end = left >= 0 ? clamp64(j1 + left - shift, 0, seqlen_q) : seqlen_q;
  if (r.end < r.begin) r.end = r.begin;
  return r;
}

// ALiBi: the bias added to the score of (i, j), -slope * |i + diagonal - j|, diagonal =
// seqlen_k - seqlen_q for the call's own bottom-right alignment (alibi_diagonal in params.hpp).
FA_HOST_DEVICE float alibi_bias(float slope, int64_t i, int64_t j, int64_t diagonal) {
  int64_t distance = i + diagonal - j;
  if (distance < 0) distance = -distance;
  return -slope * static_cast<float>(distance);
}

}  // namespace flashattn::detail

namespace flashattn::detail {

// Softcap c > 0: s = c * tanh(s / c), bounding every score to (-c, c).
FA_HOST_DEVICE float apply_softcap(float s, float cap) { return cap * tanhf(s / cap); }

}  // namespace flashattn::detail

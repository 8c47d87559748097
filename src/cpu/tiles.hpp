// What the CPU forward and backward do to a tile alike: hold their threads' tiles, load rows of
// a strided tensor into fp32 tiles, turn a score tile into masked, capped, biased scores, and
// draw dropout's multipliers. One copy, so that the backward recomputes exactly the forward's
// scores.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>

#include "common/numeric.hpp"
#include "common/params.hpp"
#include "common/philox.hpp"
#include "cpu/kernels.hpp"

namespace flashattn::detail::cpu {

// A call's scratch floats for its threads' tiles, 64-byte aligned and left uninitialised:
// every tile is written before it is read. Zeroing them (a std::vector) was a serial memset of
// the whole arena on the calling thread before the parallel region, up to 6.6 MiB at 16
// threads and head dim 128 (the forward's 256-row tiles), which also faulted every page in on
// that thread; now each thread first touches its own slice.
class ScratchFloats {
 public:
  static constexpr int64_t kAlignFloats = 16;  // 64 bytes
  explicit ScratchFloats(int64_t floats)
      : storage_(new float[static_cast<size_t>(floats + kAlignFloats)]), floats_(floats) {
    base_ = storage_.get();
    while (reinterpret_cast<uintptr_t>(base_) % (kAlignFloats * sizeof(float)) != 0) ++base_;
  }
  float* data() const { return base_; }
  size_t bytes() const { return static_cast<size_t>(floats_ + kAlignFloats) * sizeof(float); }

 private:
  std::unique_ptr<float[]> storage_;
  float* base_ = nullptr;
  int64_t floats_ = 0;
};

// dst (rows x width, packed) = scale * the first `rows` rows of a strided tensor.
template <typename T>
void load_rows(const T* src, int64_t row_stride, int rows, int width, float scale, float* dst) {
  for (int r = 0; r < rows; ++r)
    convert_row(src + r * row_stride, dst + static_cast<int64_t>(r) * width, width, scale);
}

// Writes `cols` rows of k (or v) transposed into columns [col0, col0 + cols) of a
// width x kBlockK tile. fp32 rows are transposed where they are; others are converted a few
// rows at a time first, so that transpose_block gets whole groups of rows.
template <typename T>
void transpose_rows(const T* src, int64_t row_stride, int cols, int width, float* dst, int col0) {
  if constexpr (std::is_same_v<T, float>) {
    transpose_block(src, row_stride, cols, width, dst, col0);
  } else {
    constexpr int kRows = 8;
    float rows[kRows * 256];  // kRows rows in fp32 (head dims are at most 256)
    for (int j = 0; j < cols; j += kRows) {
      const int n = cols - j < kRows ? cols - j : kRows;
      for (int r = 0; r < n; ++r)
        convert_row(src + (j + r) * row_stride, rows + r * width, width, 1.0f);
      transpose_block(rows, width, n, width, dst, col0 + j);
    }
  }
}

// Asks for the cache lines of `width` elements at src (one row of a strided tensor) ahead of
// their use: a hint that changes no result. The rows that a tile loads from the caller's
// tensors lie a row stride (H * D elements) apart and come from L3 or memory; loaded as they
// are needed, their misses stalled the copies (the backward's loads of q, dO and out were a
// tenth of its time at head dim 64, almost all waiting on the loads).
template <typename T>
inline void prefetch_row(const T* src, int width) {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(src) & ~uintptr_t{63};
  const uintptr_t end = reinterpret_cast<uintptr_t>(src + width);
  for (uintptr_t a = begin; a < end; a += 64) __builtin_prefetch(reinterpret_cast<const void*>(a), 0, 3);
}

// Zeroes columns [cols, kBlockK) of a width x kBlockK tile (score_tile reads all kBlockK
// columns, so a short last block must be padded).
inline void zero_columns_from(int cols, int width, float* dst) {
  for (int d = 0; cols < kBlockK && d < width; ++d)
    for (int j = cols; j < kBlockK; ++j) dst[static_cast<int64_t>(d) * kBlockK + j] = 0.0f;
}

// Loads `cols` rows of k (or v) transposed into width x kBlockK, zero beyond the last one.
template <typename T>
void load_transposed(const T* src, int64_t row_stride, int cols, int width, float* dst) {
  transpose_rows(src, row_stride, cols, width, dst, 0);
  zero_columns_from(cols, width, dst);
}

// The factor the query tile is loaded with: with a softcap, q is pre-divided by the cap so
// that score_tile yields s / cap, the argument of tanh.
inline float query_scale(const ForwardParams& p) {
  return p.softcap > 0.0f ? p.softmax_scale / p.softcap : p.softmax_scale;
}

// Applies softcap, ALiBi and the mask to a score tile of rows [i0, i0+rows) x keys
// [j0, j0+cols) of sequence `seq`. Entries past `cols` (the zero padding of a short last
// block) become -inf. With a softcap and `softcap_grad` non-null, also writes the softcap's
// derivative 1 - tanh^2 of every entry there (rows x kBlockK), for the backward.
void modify_scores(const ForwardParams& p, const SequenceView& seq, float slope, float* s,
                   int64_t i0, int rows, int64_t j0, int cols, float* softcap_grad = nullptr);

// Dropout's multipliers of row i, keys [j0, j0+cols) of (b, h): scale (kept) or 0 (dropped).
// The keep bits are those of the tokens (p's positions added).
void dropout_multipliers(const ForwardParams& p, const DropoutRng& rng, int32_t b, int32_t h,
                         int64_t i, int64_t j0, int cols, float* m);

}  // namespace flashattn::detail::cpu

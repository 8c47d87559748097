// Shared-memory tiles as wgmma reads them (ptx::wgmma_descriptor): 64-column panels of 128-byte
// rows (64 16-bit values) with the 128-byte swizzle, the 16-byte chunk c of row r stored at
// chunk position c ^ (r % 8); a tile of R rows is R x 128 bytes per panel, panel after panel.
// Its base must be 1024-byte aligned. Used by the sm90 forward and backward kernels.
#pragma once

#include <cstdint>

#include "cuda/common/ptx.cuh"

namespace flashattn::detail::cuda::sm90 {

// Byte offset of element column `col` (a multiple of 8) of row `row` in a swizzled tile of
// kRows rows: panel col / 64, then the row, then its 16-byte chunk at position chunk ^ (row % 8).
template <int kRows>
__device__ __forceinline__ uint32_t swizzled_offset(int row, int col) {
  const int chunk = (col % 64) / 8;
  return static_cast<uint32_t>((col / 64) * kRows * 128 + row * 128 + ((chunk ^ (row % 8)) * 16));
}

// Copies a kRows x kHeadDim tile into its swizzled shared form with cp.async, all threads
// helping (consecutive threads take consecutive chunks of a row, so reads coalesce). Rows
// from `valid_rows` on and columns from `valid_cols` on are zero-filled. Where the threads
// cover whole rows per pass, each thread keeps one column and walks its rows with one
// pointer (precomputed per-copy 64-bit offsets would hold registers the wgmma accumulators
// need: the hdim-256 kernel spilled).
template <typename Cfg, int kRows>
__device__ __forceinline__ void load_swizzled(uint32_t tile, const typename Cfg::Element* src,
                                              int64_t row_stride, int64_t valid_rows, int valid_cols) {
  constexpr int kCopies = kRows * Cfg::kChunksPerRow / Cfg::kThreads;
  static_assert(kRows * Cfg::kChunksPerRow % Cfg::kThreads == 0, "whole passes");
  if constexpr (Cfg::kThreads % Cfg::kChunksPerRow == 0) {
    constexpr int kRowsPerPass = Cfg::kThreads / Cfg::kChunksPerRow;
    const int row0 = static_cast<int>(threadIdx.x) / Cfg::kChunksPerRow;
    const int col = (static_cast<int>(threadIdx.x) % Cfg::kChunksPerRow) * 8;
    const typename Cfg::Element* from = src + row0 * row_stride + col;
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const int row = row0 + i * kRowsPerPass;
      const bool valid = row < valid_rows && col < valid_cols;
      ptx::cp_async_16(tile + swizzled_offset<kRows>(row, col), valid ? from : src, valid);
      from += kRowsPerPass * row_stride;
    }
  } else {
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const int idx = static_cast<int>(threadIdx.x) + i * Cfg::kThreads;
      const int row = idx / Cfg::kChunksPerRow, col = (idx % Cfg::kChunksPerRow) * 8;
      const bool valid = row < valid_rows && col < valid_cols;
      ptx::cp_async_16(tile + swizzled_offset<kRows>(row, col), valid ? src + row * row_stride + col : src,
                       valid);
    }
  }
}

}  // namespace flashattn::detail::cuda::sm90

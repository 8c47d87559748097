// The tile loads of the sm80 kernels: global -> padded shared tiles by cp.async, with a
// thread-to-chunk mapping fixed for the whole kernel. Any configuration with Element,
// kThreads, kRowStride (elements per shared row) and kChunksPerRow (16-byte chunks of the
// head-dim bucket) can use it.
#pragma once

#include <cstdint>

#include "cuda/common/ptx.cuh"

namespace flashattn::detail::cuda::sm80 {

// Copies tiles of kRows x kHeadDim elements from global memory into padded shared tiles,
// all threads helping, with a thread-to-chunk mapping fixed for the whole kernel: groups of
// kThreadsPerRow threads cover a row's 16-byte chunks (128 contiguous bytes per pass, so the
// global reads coalesce), kRowsPerPass rows per pass. Everything that depends only on the
// thread (its row, its columns, whether they lie inside head_dim) is computed once, so a
// full tile costs one cp.async and one 64-bit add per chunk; only tiles at the end of a
// sequence test rows. Rows from `valid_rows` on and columns from `head_dim` on are zero-filled.
// kL2PrefetchBytes: the L2 prefetch hint of the copies (ptx::cp_async_16).
template <typename Cfg, int kRows, int kL2PrefetchBytes = 0>
struct TileLoader {
  static constexpr int kThreadsPerRow = Cfg::kChunksPerRow < 8 ? Cfg::kChunksPerRow : 8;
  static constexpr int kColumnPasses = (Cfg::kChunksPerRow + kThreadsPerRow - 1) / kThreadsPerRow;
  static constexpr int kRowsPerPass = Cfg::kThreads / kThreadsPerRow;
  static constexpr int kRowPasses = kRows / kRowsPerPass;
  static_assert(Cfg::kThreads % kThreadsPerRow == 0 && kRows % kRowsPerPass == 0, "tile loader");

  int row;                 // this thread's first row in the tile
  int chunk;               // this thread's first 16-byte chunk in a row
  uint32_t column_valid;   // bit c: the chunk of column pass c lies inside head_dim

  __device__ explicit TileLoader(int head_dim) {
    row = static_cast<int>(threadIdx.x) / kThreadsPerRow;
    chunk = static_cast<int>(threadIdx.x) % kThreadsPerRow;
    column_valid = 0;
#pragma unroll
    for (int c = 0; c < kColumnPasses; ++c)
      if ((chunk + c * kThreadsPerRow) * 8 < head_dim) column_valid |= 1u << c;
  }

  // `src` points at the tile's row 0; rows from `valid_rows` on are zero-filled.
  __device__ __forceinline__ void load(uint32_t tile, const typename Cfg::Element* src,
                                       int64_t row_stride, int64_t valid_rows) const {
    load_thread(tile, thread_source(src, row_stride), src, row_stride, valid_rows);
  }

  // This thread's first chunk of a tile whose row 0 is at `src`: kernels that walk tiles at
  // fixed strides keep it and advance it, rather than recompute it per tile.
  __device__ __forceinline__ const typename Cfg::Element* thread_source(
      const typename Cfg::Element* src, int64_t row_stride) const {
    return src + row * row_stride + chunk * 8;
  }

  // load() from this thread's first chunk (thread_source); `any_valid` is any readable
  // address, read (with zero fill) in place of rows and columns outside the tile.
  __device__ __forceinline__ void load_thread(uint32_t tile, const typename Cfg::Element* thread_src,
                                              const typename Cfg::Element* any_valid,
                                              int64_t row_stride, int64_t valid_rows) const {
    constexpr uint32_t kElementBytes = sizeof(typename Cfg::Element);
    const bool full = valid_rows >= kRows;
    const uint32_t thread_tile = tile + (row * Cfg::kRowStride + chunk * 8) * kElementBytes;
#pragma unroll
    for (int r = 0; r < kRowPasses; ++r) {
      const bool row_ok = full || row + r * kRowsPerPass < valid_rows;
#pragma unroll
      for (int c = 0; c < kColumnPasses; ++c) {
        // Head dims that are not a multiple of 8 chunks: in the last pass some threads have
        // no chunk (theirs would spill into the next row).
        if (Cfg::kChunksPerRow % kThreadsPerRow != 0 && c == kColumnPasses - 1 &&
            chunk + c * kThreadsPerRow >= Cfg::kChunksPerRow)
          continue;
        const bool valid = row_ok && ((column_valid >> c) & 1u);
        ptx::cp_async_16<kL2PrefetchBytes>(
            thread_tile + (r * kRowsPerPass * Cfg::kRowStride + c * kThreadsPerRow * 8) * kElementBytes,
            valid ? thread_src + c * kThreadsPerRow * 8 : any_valid, valid);
      }
      thread_src += kRowsPerPass * row_stride;
    }
  }

  // The same copies one at a time, for kernels that spread a tile's copies over their MMAs.
  // Here a chunk outside the tile (a row past rows_left, a column from head_dim on) is a copy
  // with src-size 0, which writes zeros and reads nothing, so its address needs no substitute:
  // every copy is the row pass's pointer plus an immediate, its row test one 32-bit compare
  // (load_thread's substitutes and 64-bit tests are ~300 of the hdim-256 forward loop's 1281
  // SASS instructions). Measured on the H200 (docs/PERFORMANCE.md, 2026-11-30): spread over
  // Q K^T in the double-buffered forward, ours / flash went from 1.03-1.07 to 1.09-1.17 at
  // hdim 64 and from 0.97-1.09 to 0.999-1.14 at 128. In the single-buffered hdim-256 forward
  // every placement tried (bursts, spread, mixed) was 1-14 % slower than load_thread's
  // bursts, and in the backward no faster, so those keep load_thread.
  static constexpr int kCopies = kRowPasses * kColumnPasses;  // per thread and tile

  // This thread's rows of a tile with `valid_rows` rows to read, counted from its first row
  // (<= 0: none).
  __device__ __forceinline__ int rows_left(int64_t valid_rows) const {
    return static_cast<int>(valid_rows >= kRows ? kRows : (valid_rows > 0 ? valid_rows : 0)) - row;
  }

  // Copy i (0 .. kCopies - 1) of this thread's share of a tile whose first chunk for this
  // thread is `thread_src` (thread_source): row pass i / kColumnPasses, column pass
  // i % kColumnPasses.
  __device__ __forceinline__ void load_copy(uint32_t tile, const typename Cfg::Element* thread_src,
                                            int64_t row_stride, int rows_left, int i) const {
    const int r = i / kColumnPasses;
    load_copy_row(tile, thread_src + r * kRowsPerPass * row_stride, r * kRowsPerPass < rows_left, i);
  }

  // Copy i as load_copy makes it, from `row_src`, this thread's first chunk of the row of copy
  // i (row pass i / kColumnPasses), read only when `row_valid`: for tiles whose rows are not
  // a fixed stride apart (paged keys and values, each row in a page of its own).
  __device__ __forceinline__ void load_copy_row(uint32_t tile, const typename Cfg::Element* row_src,
                                                bool row_valid, int i) const {
    constexpr uint32_t kElementBytes = sizeof(typename Cfg::Element);
    const int r = i / kColumnPasses, c = i % kColumnPasses;
    if (Cfg::kChunksPerRow % kThreadsPerRow != 0 && c == kColumnPasses - 1 &&
        chunk + c * kThreadsPerRow >= Cfg::kChunksPerRow)
      return;  // no chunk of this thread in the last column pass (see load_thread)
    const bool valid = row_valid && ((column_valid >> c) & 1u);
    ptx::cp_async_16<kL2PrefetchBytes>(
        tile + ((row + r * kRowsPerPass) * Cfg::kRowStride + (chunk + c * kThreadsPerRow) * 8) * kElementBytes,
        row_src + c * kThreadsPerRow * 8, valid);
  }
};

}  // namespace flashattn::detail::cuda::sm80

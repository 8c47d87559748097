// Where the rows of a shared-memory tile lie, for tiles that cp.async fills in 16-byte chunks
// and ldmatrix reads 8 rows x 16 bytes at a time. Host-compilable, so that the CPU tests check
// the layouts' arithmetic (tests/test_tile_layout.cpp).
//
// - Pad16: rows padded by 16 bytes. ldmatrix is conflict-free (consecutive rows start 16
//   bytes apart modulo 128), but every other row starts 16 bytes into a 32-byte unit, so a
//   32-byte global sector lands in two units. Nsight Compute shows L2 sending the decode
//   kernel's SMs 1.5x its K/V bytes with this layout (24 sectors per cp.async warp
//   instruction where 16 carry data; H200, 2026-12-01, docs/PERFORMANCE.md).
// - Pad32: rows padded by 32 bytes: every sector lands in one unit; ldmatrix 2-way conflicted.
// - Swizzle: unpadded rows, chunk c of row r at position c ^ (r % 8) within its group of 8:
//   conflict-free, and every sector in one 32-byte unit (an odd row swaps its two halves).
#pragma once

#include <cstdint>

#include "common/host_device.hpp"

namespace flashattn::detail::cuda {

enum class TileLayout { Pad16, Pad32, Swizzle };

template <TileLayout kLayout, int kRowElements, int kElementBytes>
struct SharedTile {
  static_assert(kRowElements * kElementBytes % 16 == 0, "whole 16-byte chunks per row");
  static_assert(kLayout != TileLayout::Swizzle || kRowElements * kElementBytes % 128 == 0,
                "the swizzle permutes groups of 8 chunks: rows of a multiple of 128 bytes");
  static constexpr int kPadBytes =
      kLayout == TileLayout::Pad16 ? 16 : kLayout == TileLayout::Pad32 ? 32 : 0;
  static constexpr int kRowStride = kRowElements + kPadBytes / kElementBytes;  // elements
  static constexpr int kRowBytes = kRowStride * kElementBytes;

  // What the swizzle XORs into the byte offsets of row `row` (0 for the padded layouts).
  FA_HOST_DEVICE static uint32_t row_swizzle(int row) {
    return kLayout == TileLayout::Swizzle ? static_cast<uint32_t>(row % 8) * 16 : 0u;
  }
  // Byte offset of element `e` of row `row` from the tile's start.
  FA_HOST_DEVICE static uint32_t offset(int row, int e) {
    return static_cast<uint32_t>(row * kRowBytes) + (static_cast<uint32_t>(e * kElementBytes) ^ row_swizzle(row));
  }
};

}  // namespace flashattn::detail::cuda

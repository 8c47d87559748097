// The shared-memory tile layouts' arithmetic (src/cuda/common/tile_layout.hpp), checked on the
// CPU: every chunk has its own place inside its row, ldmatrix's 8-row reads are conflict-free
// where the layout says so, and a 32-byte global sector lands in one 32-byte shared unit where
// the layout says so. The GPU suites check the kernels that use them.
#include <gtest/gtest.h>

#include <cstdint>
#include <set>

#include "cuda/common/tile_layout.hpp"

namespace {

using flashattn::detail::cuda::SharedTile;
using flashattn::detail::cuda::TileLayout;

constexpr int kRows = 64;  // a 64-key block

template <typename Tile, int kRowElements>
void expect_chunks_placed_once_in_their_row() {
  constexpr int kChunks = kRowElements * 2 / 16;
  std::set<uint32_t> seen;
  for (int row = 0; row < kRows; ++row) {
    for (int c = 0; c < kChunks; ++c) {
      const uint32_t at = Tile::offset(row, c * 8);
      EXPECT_EQ(at % 16, 0u) << "row " << row << " chunk " << c;
      EXPECT_GE(at, static_cast<uint32_t>(row * Tile::kRowBytes)) << "row " << row << " chunk " << c;
      EXPECT_LT(at + 16, static_cast<uint32_t>(row * Tile::kRowBytes + kRowElements * 2 + 1))
          << "row " << row << " chunk " << c;
      EXPECT_TRUE(seen.insert(at).second) << "row " << row << " chunk " << c << " reuses " << at;
      for (int k = 1; k < 8; ++k)  // a chunk's elements stay together, in order
        EXPECT_EQ(Tile::offset(row, c * 8 + k), at + 2u * k) << "row " << row << " element " << c * 8 + k;
    }
  }
}

// ldmatrix reads one 16-byte chunk from each of 8 rows (r0 .. r0 + 7, r0 a multiple of 8) at
// the same logical column: conflict-free when the 8 chunks fall in distinct 16-byte groups of
// the 128-byte bank window. Returns the largest number of chunks sharing one group.
template <typename Tile, int kRowElements>
int worst_ldmatrix_conflict() {
  int worst = 0;
  for (int r0 = 0; r0 < kRows; r0 += 8)
    for (int c = 0; c < kRowElements / 8; ++c) {
      int count[8] = {};
      for (int r = r0; r < r0 + 8; ++r) ++count[(Tile::offset(r, c * 8) % 128) / 16];
      for (int n : count) worst = n > worst ? n : worst;
    }
  return worst;
}

// Rows whose global 32-byte sectors (chunks 2k, 2k + 1) are split over two 32-byte shared
// units: cp.async then seems to move such a sector twice (docs/ARCHITECTURE.md, "The KV-cache
// path on CUDA").
template <typename Tile, int kRowElements>
int rows_splitting_sectors() {
  int rows = 0;
  for (int row = 0; row < kRows; ++row) {
    bool splits = false;
    for (int k = 0; k < kRowElements / 16; ++k)
      splits |= Tile::offset(row, 16 * k) / 32 != Tile::offset(row, 16 * k + 8) / 32;
    rows += splits;
  }
  return rows;
}

template <int kRowElements>
void check_layouts() {
  using Pad16 = SharedTile<TileLayout::Pad16, kRowElements, 2>;
  using Pad32 = SharedTile<TileLayout::Pad32, kRowElements, 2>;
  using Swizzle = SharedTile<TileLayout::Swizzle, kRowElements, 2>;
  expect_chunks_placed_once_in_their_row<Pad16, kRowElements>();
  expect_chunks_placed_once_in_their_row<Pad32, kRowElements>();
  expect_chunks_placed_once_in_their_row<Swizzle, kRowElements>();
  EXPECT_EQ((worst_ldmatrix_conflict<Pad16, kRowElements>()), 1);
  EXPECT_EQ((worst_ldmatrix_conflict<Pad32, kRowElements>()), 2);  // the price of its alignment
  EXPECT_EQ((worst_ldmatrix_conflict<Swizzle, kRowElements>()), 1);
  EXPECT_EQ((rows_splitting_sectors<Pad16, kRowElements>()), kRows / 2);  // every other row
  EXPECT_EQ((rows_splitting_sectors<Pad32, kRowElements>()), 0);
  EXPECT_EQ((rows_splitting_sectors<Swizzle, kRowElements>()), 0);
}

TEST(TileLayout, HeadDim64Rows) { check_layouts<64>(); }
TEST(TileLayout, HeadDim128Rows) { check_layouts<128>(); }
TEST(TileLayout, HeadDim256Rows) { check_layouts<256>(); }

TEST(TileLayout, PaddedStridesAndTheUnpaddedSwizzle) {
  EXPECT_EQ((SharedTile<TileLayout::Pad16, 128, 2>::kRowBytes), 272);
  EXPECT_EQ((SharedTile<TileLayout::Pad32, 128, 2>::kRowBytes), 288);
  EXPECT_EQ((SharedTile<TileLayout::Swizzle, 128, 2>::kRowBytes), 256);
  // Row 3 of the swizzle: chunk 0 at position 3, chunk 3 at position 0, chunk 8 (the second
  // group of 8) at position 11.
  using Swizzle = SharedTile<TileLayout::Swizzle, 128, 2>;
  EXPECT_EQ(Swizzle::offset(3, 0), 3u * 256 + 3 * 16);
  EXPECT_EQ(Swizzle::offset(3, 24), 3u * 256 + 0);
  EXPECT_EQ(Swizzle::offset(3, 64), 3u * 256 + 11 * 16);
}

}  // namespace

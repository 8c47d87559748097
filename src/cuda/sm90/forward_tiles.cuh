// The sm90 forward's unit of work: a tile of query rows of one (batch element, head), where its
// rows lie in their sequence and which key blocks they see.
#pragma once

#include <cstdint>

#include "common/divisor.hpp"
#include "common/mask.hpp"
#include "common/params.hpp"

namespace flashattn::detail::cuda::sm90 {

// The tiles of a forward call: query blocks x heads x batch elements, in the order the
// hardware would start one CTA per tile (cuda/common/tile_order.cuh: under causal and windowed
// masks the heaviest query block of every head first). The grid is persistent or has one CTA
// per tile (forward_configs.cuh); a CTA takes tiles round by round (forward_ws_kernel.cuh).
struct ForwardTiles {
  ForwardParams p;
  int64_t tiles = 0;        // query blocks x heads x batch
  int32_t m_blocks = 0;     // query blocks per (batch element, head)
  int32_t heads_first = 0;  // tile order: heads fastest (masks) or query blocks fastest
  // The index's two inner extents, fastest first (heads or query blocks, then the other):
  // Tile splits indices below 2^31 with them (forward_tiles makes them).
  Divisor fastest, middle;
};

// One tile's coordinates, its sequence and the key blocks its rows see.
template <typename Cfg>
struct Tile {
  int b = 0, h = 0;
  SequenceView seq;
  int64_t m0 = 0, rows_here = 0;  // rows_here <= 0: past its sequence (varlen), nothing to do
  KeyRange keys;
  int n_blocks = 0;
  int full_begin = 0, full_end = 0;  // the blocks every row sees whole: no mask there

  __device__ Tile(const ForwardTiles& t, int64_t index) {
    const ForwardParams& p = t.p;
    int64_t rank;
    if (t.tiles <= INT32_MAX) {  // every call whose tensors fit in a GPU's memory
      const uint32_t i = static_cast<uint32_t>(index);
      const uint32_t outer = t.fastest.quotient(i), inner = t.fastest.remainder(i, outer);
      const uint32_t q = t.middle.quotient(outer), middle = t.middle.remainder(outer, q);
      b = static_cast<int>(q);
      h = static_cast<int>(t.heads_first ? inner : middle);
      rank = t.heads_first ? middle : inner;
    } else if (t.heads_first) {
      h = static_cast<int>(index % p.heads);
      rank = index / p.heads % t.m_blocks;
      b = static_cast<int>(index / p.heads / t.m_blocks);
    } else {
      rank = index % t.m_blocks;
      h = static_cast<int>(index / t.m_blocks % p.heads);
      b = static_cast<int>(index / t.m_blocks / p.heads);
    }
    seq = sequence_view(p, b);
    m0 = (t.m_blocks - 1 - rank) * Cfg::kBlockM;  // heavier (later) query blocks first
    rows_here = seq.seqlen_q - m0 < Cfg::kBlockM ? seq.seqlen_q - m0 : Cfg::kBlockM;
    if (rows_here <= 0) return;
    keys = visible_keys_of_rows(m0, m0 + rows_here, seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right);
    // Paged keys load in boxes that must not cross a page, and FP8's k and v descales are
    // per block of kFp8ScaleBlockRows keys: blocks start at multiples of kBlockN (the keys
    // before the visible ones are masked).
    if ((p.is_paged() || Cfg::kFp8) && !keys.empty()) keys.begin -= keys.begin % Cfg::kBlockN;
    n_blocks = keys.empty() ? 0 : static_cast<int>((keys.end - keys.begin + Cfg::kBlockN - 1) / Cfg::kBlockN);
    if (n_blocks == 0) return;
    const KeyRange full = fully_visible_blocks(m0, m0 + rows_here, keys.begin, Cfg::kBlockN, n_blocks,
                                               seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right);
    full_begin = static_cast<int>(full.begin);
    full_end = static_cast<int>(full.end);
  }
};

}  // namespace flashattn::detail::cuda::sm90

// The order in which the attention kernels' CTAs take their tiles.
//
// The hardware starts a grid's CTAs in linear order, x fastest. With the blocks along the
// sequence in x, that runs one (batch, head) pair's blocks after another: under a causal mask
// the blocks' work differs (the last query block sees every key, the first almost none), and
// heavy-first within each pair is not enough, since the last pairs' heaviest blocks start
// when little other work is left and the tail runs on a few SMs. A schedule model of the
// benchmark grid (one CTA per SM) put that tail at 6-13 % of a causal forward from 512 to 8k
// keys (docs/PERFORMANCE.md).
//
// So where the blocks' work differs (a causal or windowed mask), the heads go in x and the
// blocks in y: the heaviest block of every head of a batch element starts first, then the
// next heaviest, longest job first across the heads. Where every block does the same work
// (no mask), the blocks go in x: the CTAs running at once then share one or two heads' K and
// V in L2 rather than reading every head's. y is limited to 65535 blocks, so beyond that
// (sequences of millions of rows) the blocks go in x whatever the mask.
// The kernels read the layout off the grid: heads in x exactly when gridDim.x equals the
// head count. Where blocks and heads are equal in number the two layouts give the same grid,
// which the kernels read as heads in x; every (head, block) is still covered once. The
// coordinates come from special registers and kernel parameters alone, so the compiler may
// reread them instead of keeping them live.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <optional>

#include "common/knobs.hpp"
#include "cuda/common/grid.hpp"

namespace flashattn::detail::cuda {

// Whether the blocks along the sequence do different amounts of work: under a causal or
// windowed mask (window_right >= 0 after causal is folded in, or window_left >= 0).
inline bool blocks_work_differs(int32_t window_left, int32_t window_right) {
#ifdef FLASHATTN_SM80_TUNING
  // Tuning builds: FLASHATTN_CUDA_GRID=heads (or blocks) forces one layout, for A/B timing.
  if (const std::optional<bool> forced = knobs::forced_heads_first()) return *forced;
#endif
  return window_left >= 0 || window_right >= 0;
}

inline dim3 attention_grid(int64_t blocks, int64_t heads, int64_t batch, bool heads_first) {
  if (!heads_first || blocks > kMaxGridYZ)
    return dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(heads), static_cast<unsigned>(batch));
  return dim3(static_cast<unsigned>(heads), static_cast<unsigned>(blocks), static_cast<unsigned>(batch));
}

// `heads`: the grid's head count (query heads, or key/value heads for key-parallel kernels).
__device__ __forceinline__ bool heads_in_x(int heads) { return gridDim.x == static_cast<unsigned>(heads); }
// This CTA's head and batch element.
__device__ __forceinline__ int tile_head(int heads) { return heads_in_x(heads) ? blockIdx.x : blockIdx.y; }
__device__ __forceinline__ int tile_batch() { return blockIdx.z; }
// This CTA's rank among its head's blocks: 0 starts first. A kernel maps it to the heaviest
// block: the last query block under a causal mask, the first key block in the backward.
__device__ __forceinline__ int tile_rank(int heads) { return heads_in_x(heads) ? blockIdx.y : blockIdx.x; }
__device__ __forceinline__ int tile_blocks(int heads) { return heads_in_x(heads) ? gridDim.y : gridDim.x; }

}  // namespace flashattn::detail::cuda

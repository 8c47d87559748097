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
// So the heads go in x and the blocks in y: the heaviest block of every head of a batch
// element starts first, then the next heaviest, longest job first across the heads. The
// heads of one batch element are also what shares the L2 best (GQA groups read the same K
// and V), and the blocks of different heads at the same rank walk their keys in step.
// y is limited to 65535 blocks; beyond that (sequences of millions of rows) the blocks go
// in x and the heads in y as before, and the kernels tell the layouts apart by gridDim.x
// above 65535, which heads never reach (check_heads_and_batch). The coordinates come from
// the special registers alone, so the compiler may reread them instead of keeping them live.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/grid.hpp"

namespace flashattn::detail::cuda {

inline dim3 attention_grid(int64_t blocks, int64_t heads, int64_t batch) {
  if (blocks > kMaxGridYZ)
    return dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(heads), static_cast<unsigned>(batch));
  return dim3(static_cast<unsigned>(heads), static_cast<unsigned>(blocks), static_cast<unsigned>(batch));
}

__device__ __forceinline__ bool blocks_in_x() { return gridDim.x > kMaxGridYZ; }
// This CTA's head (query head, or key/value head for key-parallel kernels) and batch element.
__device__ __forceinline__ int tile_head() { return blocks_in_x() ? blockIdx.y : blockIdx.x; }
__device__ __forceinline__ int tile_batch() { return blockIdx.z; }
// This CTA's rank among its pair's blocks: 0 starts first. A kernel maps it to the heaviest
// block: the last query block under a causal mask, the first key block in the backward.
__device__ __forceinline__ int tile_rank() { return blocks_in_x() ? blockIdx.x : blockIdx.y; }
__device__ __forceinline__ int tile_blocks() { return blocks_in_x() ? gridDim.x : gridDim.y; }

}  // namespace flashattn::detail::cuda

// TMA tensor maps for the sm90 kernels: the descriptor the tensor-memory accelerator reads to
// copy a box of a strided tensor into shared memory, built on the host per call.
//
// A q/k/v tensor is seen as 4-D, innermost first: (head-dim column, row, head, batch), with
// the caller's element strides. A box is 64 columns (128 bytes: one panel of the 128-byte
// swizzle, cuda/sm90/swizzled_tile.cuh) by box_rows rows of one head of one batch element;
// the TMA unit writes it in exactly the swizzled layout the wgmma descriptors read, and fills
// what lies outside the tensor (rows past the sequence, columns past the head dim) with zeros.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "flashattn/flashattn.hpp"

namespace flashattn::detail::cuda::sm90 {

struct TiledTensor {
  const void* base = nullptr;
  DType dtype = DType::Float16;  // 16-bit elements only
  int64_t cols = 0, rows = 0, heads = 0, batch = 0;
  int64_t row_stride = 0, head_stride = 0, batch_stride = 0;  // elements
};

// Encodes `tensor` with boxes of 64 x box_rows into `map`. False where TMA cannot describe
// the tensor (a base or stride not a multiple of 16 bytes, a size past its limits) or the
// driver offers no encoder: the caller then takes a kernel that loads without TMA.
bool encode_tiled(CUtensorMap& map, const TiledTensor& tensor, int box_rows);

}  // namespace flashattn::detail::cuda::sm90

// TMA tensor maps for the sm90 kernels: the descriptor the tensor-memory accelerator reads to
// copy a box of a strided tensor into shared memory, built on the host per call.
//
// A q/k/v tensor is seen as 4-D, innermost first: (head-dim column, row, head, batch), with
// the caller's element strides. A box is 128 bytes of columns (64 16-bit or 128 e4m3 values:
// one panel of the 128-byte swizzle, cuda/sm90/swizzled_tile.cuh) by box_rows rows of one
// head of one batch element;
// the TMA unit writes it in exactly the swizzled layout the wgmma descriptors read, and fills
// what lies outside the tensor (rows past the sequence, columns past the head dim) with zeros.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "common/params.hpp"
#include "flashattn/flashattn.hpp"

namespace flashattn::detail::cuda::sm90 {

struct TiledTensor {
  const void* base = nullptr;
  DType dtype = DType::Float16;  // 16-bit or e4m3 elements
  int64_t cols = 0, rows = 0, heads = 0, batch = 0;
  int64_t row_stride = 0, head_stride = 0, batch_stride = 0;  // elements
};

// A call's q, k and v (and out) as such tensors: dense, (B, S, H, D); varlen, one batch
// element of all the sequences' rows, (1, total, H, D) (SequenceView's row0 picks a sequence).
inline TiledTensor tiled_q(const ForwardParams& p) {
  return {p.q, p.dtype, p.head_dim, p.is_varlen() ? p.total_q : p.seqlen_q, p.heads, p.is_varlen() ? 1 : p.batch,
          p.q_row_stride, p.q_head_stride, p.q_batch_stride};
}
inline TiledTensor tiled_k(const ForwardParams& p) {
  return {p.k, p.dtype, p.head_dim, p.is_varlen() ? p.total_k : p.seqlen_k, p.heads_k, p.is_varlen() ? 1 : p.batch,
          p.k_row_stride, p.k_head_stride, p.k_batch_stride};
}
inline TiledTensor tiled_v(const ForwardParams& p) {
  return {p.v, p.dtype, p.head_dim_v, p.is_varlen() ? p.total_k : p.seqlen_k, p.heads_k, p.is_varlen() ? 1 : p.batch,
          p.v_row_stride, p.v_head_stride, p.v_batch_stride};
}
// FP8 v given (d, seqlen)-major (ForwardParams::values_seqlen_major): its keys are the
// contiguous "columns" and its head-dim columns the "rows", so that a box of 128 keys by the
// head dim lands as the transposed tile the P V wgmma reads.
inline TiledTensor tiled_v_seqlen_major(const ForwardParams& p) {
  return {p.v, p.dtype, p.is_varlen() ? p.total_k : p.seqlen_k, p.head_dim_v, p.heads_k, p.is_varlen() ? 1 : p.batch,
          p.v_dim_stride, p.v_head_stride, p.v_batch_stride};
}
// Paged keys and values: (num_pages, page_size, Hk, D), a page per batch element.
inline TiledTensor tiled_k_pages(const ForwardParams& p) {
  return {p.k, p.dtype, p.head_dim, p.page_size, p.heads_k, p.num_pages, p.k_row_stride, p.k_head_stride, p.k_batch_stride};
}
inline TiledTensor tiled_v_pages(const ForwardParams& p) {
  return {p.v, p.dtype, p.head_dim_v, p.page_size, p.heads_k, p.num_pages, p.v_row_stride, p.v_head_stride, p.v_batch_stride};
}
inline TiledTensor tiled_out(const ForwardParams& p) {  // bf16 for FP8 inputs
  return {p.out, p.dtype == DType::Float8E4M3 ? DType::BFloat16 : p.dtype, p.head_dim_v, p.is_varlen() ? p.total_q : p.seqlen_q, p.heads, p.is_varlen() ? 1 : p.batch,
          p.out_row_stride, p.out_head_stride, p.out_batch_stride};
}

inline int64_t element_bytes(DType dtype) { return dtype == DType::Float8E4M3 ? 1 : 2; }

// Encodes `tensor` with boxes of 128 bytes x box_rows into `map`. False where TMA cannot describe
// the tensor (a base or stride not a multiple of 16 bytes, a size past its limits) or the
// driver offers no encoder: the caller then takes a kernel that loads without TMA.
bool encode_tiled(CUtensorMap& map, const TiledTensor& tensor, int box_rows);

// 128 rows of 128 bytes of NaNs of `dtype` in device memory (the module's own, initialised
// with it), in boxes of 128 bytes x box_rows: what the forward loads for the keys of a page outside the block
// table's range. False as encode_tiled.
bool encode_nan_rows(CUtensorMap& map, DType dtype, int box_rows);

}  // namespace flashattn::detail::cuda::sm90

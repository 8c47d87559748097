// Tile shapes of the sm90 (TMA, warp-specialised) forward kernel per 64-column head-dim bucket,
// with the reasons, and its launch. Each (dtype, bucket) instantiates it in its own generated
// file (src/CMakeLists.txt). Calls it cannot take (pages of a size that is not a multiple of
// 64, tensors TMA cannot describe) run on the sm80 kernel (cuda/forward.cu).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>

#include "cuda/common/kernel_code.cuh"
#include "cuda/common/per_device.hpp"
#include "cuda/common/tile_order.cuh"
#include "cuda/devices.hpp"
#include "common/knobs.hpp"
#include "cuda/sm90/forward_tiles.cuh"
#include "cuda/sm90/forward_ws_kernel.cuh"
#include "cuda/sm90/tensor_maps.hpp"

namespace flashattn::detail::cuda::sm90 {

// WsForwardConfig<Element, head dim, keys per block, stages, ping-pong> of the TMA kernel
// (forward_ws_kernel.cuh): two consumer warpgroups of 64 query rows, two K and two V buffers
// (three at 128, O then staged in Q: 0.94-1.00x of two, H100, 2026-12-06, 512-16k).
// 64 and 128: 128-key blocks (S 64 + P 32 + O 32 or 64 registers of the consumers' 240;
// 80 and 160 KiB of shared memory), the consumers' wgmmas taking turns. 192 and 256: 64-key
// blocks (O alone is 96 or 128 registers; 144 and 192 KiB) without turns: as in
// FlashAttention-3, a large O makes the softmax short against the matrix products.
template <typename E, int kHeadDim>
struct TunedWsForward {
  static constexpr int kBlockN = kHeadDim <= 128 ? 128 : 64;
  using Config = WsForwardConfig<E, kHeadDim, kBlockN, 2, kHeadDim <= 128>;
};
// FP8 (e4m3), head dims 128 and 256 (128-column buckets): 128-row tiles (a tile's rows one q
// descale block); 128-key blocks at 128 and 64 at 256, where S 64 + O 128 + P 16 registers
// would leave the producer warpgroup 24, too few beside the transposing warps (the
// registers' comment in forward_ws_kernel.cuh); two stages of K, V and its transposed copy
// (112 and 160 KiB), the consumers' wgmmas taking turns at 128 as above. Not yet tuned by
// measurement.
template <int kHeadDim>
struct TunedWsForward<__nv_fp8_e4m3, kHeadDim> {
  using Config = WsForwardConfig<__nv_fp8_e4m3, kHeadDim, kHeadDim <= 128 ? 128 : 64, 2, kHeadDim <= 128>;
};
// FP8 v given (d, seqlen)-major: no transposing warps, so 24 / 240 registers, which hold
// 128-key blocks at head dim 256 too (S 64 + O 128 + P 16); two stages (112 and 160 KiB).
// Dense calls only: a TMA box's start in the contiguous (key) dimension must be a 16-byte
// multiple, and a varlen sequence's first key need not be (the validator refuses those; on
// an H100 such a box raised an illegal-instruction error, 2026-12-07). Not yet tuned by
// measurement.
template <int kHeadDim>
using SeqlenMajorValuesWsForward = WsForwardConfig<__nv_fp8_e4m3, kHeadDim, 128, 2, kHeadDim <= 128, true, 2, true>;
// At 64 plain calls (the general variant spills at 160 registers) take a second shape with
// three consumer warpgroups: 192 query rows x 128 keys, registers 32 / 160 (S 64 + P 32 + O 32),
// 112 KiB. Each K/V tile read serves half as many rows again, and the turn passes round three
// warpgroups, so that two softmaxes run under one warpgroup's matrix products: at 64 the
// softmax is as long as the two GEMMs. H200, 2026-12-03, bf16, eager TFLOP/s against the
// two-consumer shapes it replaced (128 x 128 to 2k keys, 128 x 192 from 4k): non-causal 1.20x
// at 512, 1.18x at 1k, 1.26x at 2k, 1.16-1.18x at 4k-16k; causal 1.00-1.01x at 512-1k, 1.16x at
// 2k, 1.09-1.13x at 4k-16k. Dropped after the same run: 128 x 192 (0.85-0.91x of this shape
// from 4k) and 192 x 96 (0.84-1.01x).
template <typename E>
using TallWsForward = WsForwardConfig<E, 64, 128, 2, true, false, 3>;

// The kernel variant of a call (ScoreVariant, forward_ws_kernel.cuh).
inline ScoreVariant score_variant(const ForwardParams& p) {
  if (p.dropout_p > 0.0f) return ScoreVariant::Dropout;
  if (p.softcap > 0.0f || p.alibi_slopes != nullptr || !(p.softmax_scale > 0.0f)) return ScoreVariant::Modified;
  return ScoreVariant::Plain;
}

// The tiles of a call with block_m query rows per tile, and their order (tile_order.cuh).
inline ForwardTiles forward_tiles(const ForwardParams& p, int block_m) {
  ForwardTiles tiles;
  tiles.p = p;
  tiles.m_blocks = static_cast<int32_t>((p.seqlen_q + block_m - 1) / block_m);
  tiles.tiles = int64_t{tiles.m_blocks} * p.heads * p.batch;
  tiles.heads_first = blocks_work_differs(p.window_left, p.window_right) ? 1 : 0;
  const Divisor heads = Divisor::of(static_cast<uint32_t>(std::max(p.heads, 1)));
  const Divisor m_blocks = Divisor::of(static_cast<uint32_t>(std::max(tiles.m_blocks, 1)));
  tiles.fastest = tiles.heads_first ? heads : m_blocks;
  tiles.middle = tiles.heads_first ? m_blocks : heads;
  return tiles;
}

// The grids. Without a mask every tile does the same work: one CTA per SM (its registers and
// shared memory allow no second one) walks its share. Under causal and windowed masks the
// tiles' work differs, and a static share leaves SMs idle at the end (H200, the cp.async
// kernel before this one: -3 to -30 % at 512-4k causal): one CTA per tile, started by the
// hardware as SMs free up (up to the grid's x extent, 2^31 - 1; past it the persistent grid
// takes those calls too).
inline unsigned persistent_ctas(const ForwardTiles& tiles) {
  return static_cast<unsigned>(std::min<int64_t>(tiles.tiles, std::max(1, multiprocessor_count())));
}
inline unsigned forward_ctas(const ForwardTiles& tiles) {
  return tiles.heads_first && tiles.tiles <= INT32_MAX ? static_cast<unsigned>(tiles.tiles) : persistent_ctas(tiles);
}

// The kernel's grid: as forward_ctas, or persistent under the masks as well (its
// tile_of_round then evens out the CTAs' work). Persistent by default where a sequence has at
// most kPersistentBlocks query blocks: there a tile is a few key blocks and a CTA's start and
// Q load weigh most. H200, bench/forward.py causal bf16, persistent against one CTA per tile:
// two consumers (128-row tiles, 2026-12-03): 1.23-1.25x at 512 at head dims 64 and 128, 1.04x
// at 256; 0.71-0.98x at 1k-4k, 0.99-1.01x at 16k: beyond 4 blocks the static deal leaves SMs
// idle at the end. Three consumers (192-row tiles at head dim 64, 2026-12-04): 1.03x at 512,
// 1.17x at 1k, 1.07x at 2k, 1.04x at 4k, 0.99-1.00x at 8k-16k: persistent up to 4096 rows (22
// blocks). FLASHATTN_SM90_FORWARD_GRID chooses either everywhere.
template <typename Cfg>
unsigned ws_forward_ctas(const ForwardTiles& tiles) {
  constexpr int kPersistentBlocks = Cfg::kConsumers == 3 ? (4096 + Cfg::kBlockM - 1) / Cfg::kBlockM : 4;
  const knobs::Sm90ForwardGrid chosen = knobs::sm90_forward_grid();
  const bool persistent = chosen == knobs::Sm90ForwardGrid::Persistent ||
                          (chosen == knobs::Sm90ForwardGrid::Default && tiles.m_blocks <= kPersistentBlocks);
  return persistent ? persistent_ctas(tiles) : forward_ctas(tiles);
}

// The rows of a paged call's k and v boxes: the largest power of two up to kBlockN that
// divides the page size, so that a box never crosses a page; 0 (the sm80 kernel takes the
// call) below kMinPageBoxRows. H200, 2026-12-06, bench/forward_features.py, 64k tokens in 14
// sequences, hdim 128, eager TFLOP/s full / causal: pages of 256 (one 128-row box a block)
// 539 / 509 against the sm80 kernel's 279 / 268 (1.93x / 1.90x, and level with the dense
// varlen call's 535 / 542); pages of 16 (eight 16-row boxes a block) 227 / 217, below the
// sm80 kernel at 256 (whose per-row loads do not depend on the page size), so small boxes
// stay there. 64 (two boxes a block) was not timed.
inline constexpr int kMinPageBoxRows = 64;
template <typename Cfg>
int page_box_rows(const ForwardParams& p) {
  int rows = Cfg::kBlockN;
  while (rows >= kMinPageBoxRows && p.page_size % rows != 0) rows /= 2;
  return rows >= kMinPageBoxRows ? rows : 0;
}

// Launches the kernel for a dense, varlen or paged varlen call; false, launching nothing,
// where it cannot take the call: varlen on a shape that does not take it, pages of a size
// that is not a multiple of kMinPageBoxRows, a general call on a shape without that variant, its code or
// shared memory not here, or tensors TMA cannot describe.
template <typename Cfg>
bool launch_forward_ws(const ForwardParams& p) {
  const ScoreVariant variant = score_variant(p);
  if ((p.is_varlen() && !Cfg::kTakesVarlen) || (!Cfg::kHasGeneral && variant != ScoreVariant::Plain) ||
      p.values_seqlen_major() != Cfg::kSeqlenMajorValues || (Cfg::kSeqlenMajorValues && p.is_varlen()))
    return false;
  const int box_rows = p.is_paged() ? page_box_rows<Cfg>(p) : 0;
  if (p.is_paged() && box_rows == 0) return false;
  static PerDevice<bool> sm90_code;
  if (!sm90_code.get([] { return kernel_ptx_version(forward_ws_kernel<Cfg, ScoreVariant::Plain>) >= 90; }) ||
      Cfg::kSharedBytes > shared_bytes_per_block_limit())
    return false;
  WsForwardArgs args{};
  args.page_box_rows = box_rows;
  if (!encode_tiled(args.q, tiled_q(p), Cfg::kBlockM) || !encode_tiled(args.out, tiled_out(p), kOutBoxRows))
    return false;
  // No keys at all (TMA describes no empty tensor): no tile loads any, every row's out is 0
  // and its lse -inf; q's map stands in. (The 16-bit calls take the sm80 kernel instead; FP8
  // has no other kernel.)
  const bool no_keys = Cfg::kFp8 && !p.is_paged() && tiled_k(p).rows == 0;
  if (no_keys) args.k = args.v = args.q;
  const bool kv_mapped = no_keys || (p.is_paged() ? encode_tiled(args.k, tiled_k_pages(p), box_rows) &&
                                                        encode_tiled(args.v, tiled_v_pages(p), box_rows) &&
                                                        encode_nan_rows(args.nan_rows, p.dtype, box_rows)
                                                  : encode_tiled(args.k, tiled_k(p), Cfg::kBlockN) &&
                                                        (Cfg::kSeqlenMajorValues
                                                             ? encode_tiled(args.v, tiled_v_seqlen_major(p), Cfg::kHeadDim)
                                                             : encode_tiled(args.v, tiled_v(p), Cfg::kBlockN)));
  if (!kv_mapped) return false;
  // The general variants' kernels where the shape compiles them (else the plain one thrice).
  constexpr auto plain_kernel = forward_ws_kernel<Cfg, ScoreVariant::Plain>;
  constexpr auto modified_kernel = forward_ws_kernel<Cfg, Cfg::kHasGeneral ? ScoreVariant::Modified : ScoreVariant::Plain>;
  // (FP8 takes no dropout: no kernel of its own for it.)
  constexpr auto dropout_kernel =
      forward_ws_kernel<Cfg, Cfg::kHasGeneral && !Cfg::kFp8 ? ScoreVariant::Dropout : ScoreVariant::Plain>;
  static PerDevice<bool> shared_bytes_allowed;
  shared_bytes_allowed.get([] {
    for (const auto kernel : {plain_kernel, modified_kernel, dropout_kernel}) allow_shared_bytes(kernel, Cfg::kSharedBytes);
    return true;
  });
  const auto kernel = variant == ScoreVariant::Dropout    ? dropout_kernel
                      : variant == ScoreVariant::Modified ? modified_kernel
                                                          : plain_kernel;
  args.tiles = forward_tiles(p, Cfg::kBlockM);
  kernel<<<ws_forward_ctas<Cfg>(args.tiles), Cfg::kThreads, Cfg::kSharedBytes, static_cast<cudaStream_t>(p.stream)>>>(
      args);
  return true;
}

// The kernel of a (dtype, bucket) for the call: at head dim 64 the three-consumer shape
// where it takes the call (FLASHATTN_SM90_FORWARD_SHAPE=128x128 keeps plain calls on two).
template <typename E, int kHeadDim>
bool launch_tuned_forward_ws(const ForwardParams& p) {
  if constexpr (std::is_same_v<E, __nv_fp8_e4m3>)
    if (p.values_seqlen_major()) return launch_forward_ws<SeqlenMajorValuesWsForward<kHeadDim>>(p);
  if constexpr (kHeadDim == 64) {
    const bool tall = knobs::sm90_forward_shape() != knobs::Sm90ForwardShape::Rows128Keys128;
    if (tall && launch_forward_ws<TallWsForward<E>>(p)) return true;
  }
  return launch_forward_ws<typename TunedWsForward<E, kHeadDim>::Config>(p);
}

// Defined once per (dtype, bucket) in its own generated file: runs the call and returns true,
// or returns false (launching nothing) where the kernel cannot take it or cannot run on the
// current device.
template <typename Element, int kHeadDim>
bool run_forward(const ForwardParams& params);

}  // namespace flashattn::detail::cuda::sm90

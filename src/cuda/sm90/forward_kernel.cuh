// The sm90 (Hopper) forward kernel: FlashAttention-2's schedule with warpgroup MMAs (wgmma).
//
// A CTA owns kBlockM = 64 * kWarpGroups query rows of one (batch, head); each warpgroup (4
// warps) owns 64 of them for the whole kernel. Per key block of kBlockN keys:
//
//   S = Q K^T      wgmma, A (Q) and B (K) both from shared memory; fp32 S in registers
//   mask           only on blocks some row does not see whole (causal, window, the end)
//   softmax        online, base-2 exponentials, row max/sum across the lane quad (the
//                  accumulator layout is mma.sync's, so this is the sm80 kernel's softmax)
//   O += P V       wgmma, A (P) from registers, B (V) from shared memory read MN-major
//
// Against mma.sync, one wgmma multiplies a 64 x N x 16 block per warpgroup and reads its
// shared operands itself (no ldmatrix), which is where the sm80 kernels spend their issue
// slots and, on the H200's power cap, their energy (docs/PERFORMANCE.md).
//
// The two wgmmas of consecutive blocks overlap: block n issues S(n) = Q K(n)^T and
// O += P(n - 1) V(n - 1) together and computes the softmax of S(n) while the second runs.
//
// Shared tiles are stored as wgmma reads them: 64-column panels of 128-byte rows with the
// 128-byte swizzle (ptx::wgmma_descriptor), filled by cp.async from all threads. K and V are
// double-buffered: K(n + 1) and V(n) load while block n is computed.
//
// Every forward feature: masks, GQA, varlen, LSE, and in the general variant softcap, ALiBi,
// dropout and any scale (the sm80 kernel's code for them, cuda/common/online_softmax.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "common/mask.hpp"
#include "common/params.hpp"
#include "common/philox.hpp"
#include "cuda/common/online_softmax.cuh"
#include "cuda/common/per_device.hpp"
#include "cuda/common/ptx.cuh"
#include "cuda/common/tile_order.cuh"
#include "cuda/common/wgmma.cuh"
#include "cuda/sm90/swizzled_tile.cuh"

namespace flashattn::detail::cuda::sm90 {

template <typename Element_, int kHeadDim_, int kBlockN_, int kWarpGroups_>
struct ForwardConfig {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;  // a multiple of 64: whole 128-byte panels
  static constexpr int kBlockN = kBlockN_;    // keys per block: a multiple of 16
  static constexpr int kWarpGroups = kWarpGroups_;
  static constexpr int kThreads = 128 * kWarpGroups;
  static constexpr int kBlockM = 64 * kWarpGroups;
  static constexpr int kChunksPerRow = kHeadDim / 8;  // 16-byte chunks
  static constexpr int kQBytes = kBlockM * kHeadDim * static_cast<int>(sizeof(Element));
  static constexpr int kTileBytes = kBlockN * kHeadDim * static_cast<int>(sizeof(Element));
  // Q, two stages of K and V, and 1 KiB to align the base to a swizzle atom.
  static constexpr int kSharedBytes = 1024 + kQBytes + 4 * kTileBytes;
  static constexpr int kMaxSharedBytes = kSharedBytes;
  static_assert(kHeadDim % 64 == 0 && kHeadDim <= 256 && kBlockN % 16 == 0 && kBlockN <= 256, "shapes");
  static_assert(sizeof(Element) == 2, "16-bit elements: 64 of them fill a 128-byte row");
};

// A CTA walks the tiles (query block, head, batch element) blockIdx.x, + gridDim.x, ..., in
// the order the hardware would start one CTA per tile (cuda/common/tile_order.cuh: under
// causal and windowed masks the heaviest query block of every head first). Without a mask
// the grid is persistent, one CTA per SM (forward_configs.cuh), and a CTA copies the next
// tile's Q and K(0) while it writes the current tile's output, so that short sequences, whose
// tiles have only a few key blocks, do not pay a tile's prologue and epilogue latency one
// after the other. Under the masks the grid has one CTA per tile, which then does one.
struct ForwardTiles {
  ForwardParams p;
  int64_t tiles = 0;        // query blocks x heads x batch
  int32_t m_blocks = 0;     // query blocks per (batch element, head)
  int32_t heads_first = 0;  // tile order: heads fastest (masks) or query blocks fastest
};

// One tile's coordinates, its sequence and the key blocks its rows see.
template <typename Cfg>
struct Tile {
  using Element = typename Cfg::Element;
  int b = 0, h = 0;
  SequenceView seq;
  int64_t m0 = 0, rows_here = 0;  // rows_here <= 0: past its sequence (varlen), nothing to do
  const Element *q = nullptr, *k = nullptr, *v = nullptr;
  KeyRange keys;
  int n_blocks = 0;
  int full_begin = 0, full_end = 0;  // the blocks every row sees whole: no mask there

  __device__ Tile(const ForwardTiles& t, int64_t index) {
    const ForwardParams& p = t.p;
    int64_t rank;
    if (t.heads_first) {
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
    const int hk = h / p.group_size();
    q = static_cast<const Element*>(p.q) + b * p.q_batch_stride + (seq.q_row0 + m0) * p.q_row_stride +
        h * p.q_head_stride;
    k = static_cast<const Element*>(p.k) + b * p.k_batch_stride + seq.k_row0 * p.k_row_stride +
        hk * p.k_head_stride;
    v = static_cast<const Element*>(p.v) + b * p.v_batch_stride + seq.k_row0 * p.v_row_stride +
        hk * p.v_head_stride;
    keys = visible_keys_of_rows(m0, m0 + rows_here, seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right);
    n_blocks = keys.empty() ? 0 : static_cast<int>((keys.end - keys.begin + Cfg::kBlockN - 1) / Cfg::kBlockN);
    if (n_blocks == 0) return;
    const KeyRange full = fully_visible_blocks(m0, m0 + rows_here, keys.begin, Cfg::kBlockN, n_blocks,
                                               seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right);
    full_begin = static_cast<int>(full.begin);
    full_end = static_cast<int>(full.end);
  }

  // Q and K(0), as one copy group.
  __device__ void load_first(const ForwardParams& p, uint32_t sQ, uint32_t sK) const {
    load_swizzled<Cfg, Cfg::kBlockM>(sQ, q, p.q_row_stride, rows_here, p.head_dim);
    if (n_blocks > 0)
      load_swizzled<Cfg, Cfg::kBlockN>(sK, k + keys.begin * p.k_row_stride, p.k_row_stride,
                                       keys.end - keys.begin, p.head_dim);
    ptx::cp_async_commit();
  }
};

// kGeneral: softcap, ALiBi, a non-positive scale or dropout may occur (the general variant,
// as in the sm80 kernel: without them S holds raw dot products and the scale folds into the
// exponent, and the kernel is compiled without that code).
template <typename Cfg, bool kGeneral>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    forward_kernel(const __grid_constant__ ForwardTiles tiles) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Element = typename Cfg::Element;
  using SMma = ptx::Wgmma<Element, Cfg::kBlockN>;    // S = Q K^T: 64 x kBlockN per warpgroup
  using OMma = ptx::Wgmma<Element, Cfg::kHeadDim>;   // O += P V: 64 x kHeadDim per warpgroup
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHeadDim = Cfg::kHeadDim;
  constexpr int kSTiles = kBlockN / 8;   // n8 tiles of S per row pair
  constexpr int kOTiles = kHeadDim / 8;  // n8 tiles of O
  constexpr float kLog2e = 1.4426950408889634f;
  const ForwardParams& p = tiles.p;

  extern __shared__ __align__(16) unsigned char shared_raw[];
  const uint32_t sQ = (ptx::shared_address(shared_raw) + 1023) & ~1023u;
  const uint32_t sK = sQ + Cfg::kQBytes;            // two stages
  const uint32_t sV = sK + 2 * Cfg::kTileBytes;     // two stages; the output's staging at the end
  static_assert(2 * Cfg::kTileBytes >= Cfg::kQBytes, "the output tile fits in the V stages");

  const int warpgroup = threadIdx.x / 128;
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;  // warp within the warpgroup
  const int quad_col = (lane % 4) * 2;  // this lane's columns within each n8 tile
  // This lane's rows within the CTA tile: r = 0, 1 (the accumulator layout, wgmma.cuh).
  const auto cta_row = [&](int r) { return warpgroup * 64 + warp * 16 + lane / 4 + r * 8; };
  // The plain path keeps raw dot products in S and folds the scale into the exponent:
  // p = 2^(s c - m c) with c = scale log2(e). Otherwise S becomes base-2 scores first
  // (modify_scores_row) and c = 1. Dropout's kept probabilities enter P V unscaled; 1 / (1 - p)
  // is applied once in the epilogue.
  const bool softcap = kGeneral && p.softcap > 0.0f;
  const bool plain = !kGeneral || (!softcap && p.alibi_slopes == nullptr && p.softmax_scale > 0.0f);
  const bool dropout = kGeneral && p.dropout_p > 0.0f;
  const DropoutRng rng = dropout ? make_dropout_rng(p.dropout_seed, p.dropout_offset, p.dropout_p) : DropoutRng{};
  const float exp_scale = plain ? p.softmax_scale * kLog2e : 1.0f;
  const float score_scale = softcap ? p.softmax_scale / p.softcap : p.softmax_scale * kLog2e;

  // Descriptors: this warpgroup's 64 rows of Q, and stage 0 of K and V; a k-step or a stage
  // moves the start address only (descriptor addresses count 16-byte units).
  const uint64_t q_desc = ptx::wgmma_descriptor(sQ + warpgroup * 64 * 128, 16, 1024);
  const uint64_t k_desc = ptx::wgmma_descriptor(sK, 16, 1024);
  const uint64_t v_desc = ptx::wgmma_descriptor(sV, kBlockN * 128, 1024);
  const auto panel_step = [](int kk, int rows) -> uint64_t {
    return static_cast<uint64_t>(((kk / 4) * rows * 128 + (kk % 4) * 32) >> 4);
  };
  // O += P V for the block whose V is in `stage` (P in pf), 16 keys per wgmma.
  const auto issue_pv = [&](float (&o)[kOTiles * 4], const uint32_t (&pf)[kBlockN / 16][4], int stage) {
    const uint64_t v_stage = v_desc + ((stage * Cfg::kTileBytes) >> 4);
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) OMma::rs(o, pf[kk], v_stage + ((kk * 16 * 128) >> 4));
  };
  int64_t index = blockIdx.x;
  Tile<Cfg> tile(tiles, index);
  bool first_loaded = false;  // the tile's Q and K(0) copies are issued
  while (true) {
    // Tiles past their sequence (varlen) are skipped; the same for the whole CTA.
    while (tile.rows_here <= 0 && index + gridDim.x < tiles.tiles) {
      index += gridDim.x;
      tile = Tile<Cfg>(tiles, index);
      first_loaded = false;
    }
    if (tile.rows_here <= 0) break;
    if (!first_loaded) tile.load_first(p, sQ, sK);
    const int64_t m0 = tile.m0;
    const KeyRange keys = tile.keys;
    const int n_blocks = tile.n_blocks;
    const SequenceView seq = tile.seq;

    float o[kOTiles * 4] = {};
    float s[kSTiles * 4] = {};
    uint32_t pf[kBlockN / 16][4] = {};
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};

    // Block n: S(n) = Q K(n)^T and O += P(n - 1) V(n - 1) run on the tensor cores together,
    // and the softmax of S(n) overlaps the second; O is rescaled once the latter is done. K(n)
    // and V(n - 1) were copied during block n - 1 (V a block behind K, since P V comes a block
    // after Q K^T), into the stages that block n - 2 used.
    for (int n = 0; n < n_blocks; ++n) {
      const int64_t j0 = keys.begin + int64_t{n} * kBlockN;
      ptx::cp_async_wait<0>();
      // The copies wrote through the generic proxy; wgmma reads through the async proxy. The
      // barrier also tells that every warpgroup is done with block n - 1's wgmmas.
      ptx::fence_proxy_async_shared();
      __syncthreads();

      ptx::wgmma_hold(s);
      ptx::wgmma_hold(o);
      ptx::wgmma_hold(pf);
      ptx::wgmma_fence();
      const uint64_t k_stage = k_desc + (((n & 1) * Cfg::kTileBytes) >> 4);
#pragma unroll
      for (int kk = 0; kk < kHeadDim / 16; ++kk)
        SMma::ss(s, q_desc + panel_step(kk, kBlockM), k_stage + panel_step(kk, kBlockN), kk > 0);
      ptx::wgmma_commit();
      if (n > 0) issue_pv(o, pf, (n - 1) & 1);
      ptx::wgmma_commit();

      // K(n + 1) and V(n) for the next block, while the wgmmas run.
      if (n + 1 < n_blocks)
        load_swizzled<Cfg, kBlockN>(sK + ((n + 1) & 1) * Cfg::kTileBytes, tile.k + (j0 + kBlockN) * p.k_row_stride,
                                    p.k_row_stride, keys.end - (j0 + kBlockN), p.head_dim);
      load_swizzled<Cfg, kBlockN>(sV + (n & 1) * Cfg::kTileBytes, tile.v + j0 * p.v_row_stride, p.v_row_stride,
                                  keys.end - j0, p.head_dim_v);
      ptx::cp_async_commit();

      ptx::wgmma_wait<1>();  // S(n) is done; P V may still run
      ptx::wgmma_hold(s);

      // Softcap and ALiBi, the mask on blocks that some row does not see whole, then the online
      // softmax and dropout.
      if (!plain) {
        const float slope = p.alibi_slopes != nullptr ? p.alibi_slopes[tile.b * p.alibi_batch_stride + tile.h] : 0.0f;
#pragma unroll
        for (int r = 0; r < 2; ++r)
          modify_scores_row<kSTiles>(s, r, score_scale, softcap ? p.softcap : 0.0f, slope,
                                     static_cast<int>(m0 + cta_row(r) + seq.seqlen_k - seq.seqlen_q - j0), quad_col);
      }
      if (n < tile.full_begin || n >= tile.full_end) {
#pragma unroll
        for (int r = 0; r < 2; ++r)
          mask_row<kSTiles>(s, r,
                            block_columns<kBlockN>(visible_keys(m0 + cta_row(r), seq.seqlen_q, seq.seqlen_k,
                                                                p.window_left, p.window_right),
                                                   j0),
                            quad_col);
      }
      float scale_o[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        scale_o[r] = online_softmax_row<kSTiles>(s, r, row_max[r], row_sum[r], exp_scale);
        if (dropout)
          dropout_row<kSTiles>(s, r, rng, tile.b, tile.h, static_cast<uint32_t>(m0 + cta_row(r)), j0, quad_col);
      }

      ptx::wgmma_wait<0>();  // O += P(n - 1) V(n - 1) is done: O and pf are free
      ptx::wgmma_hold(o);
      ptx::wgmma_hold(pf);
#pragma unroll
      for (int t = 0; t < kOTiles; ++t) {
        o[4 * t + 0] *= scale_o[0];
        o[4 * t + 1] *= scale_o[0];
        o[4 * t + 2] *= scale_o[1];
        o[4 * t + 3] *= scale_o[1];
      }
      // P(n) as A fragments: the S accumulators of two adjacent n8 tiles are one (16 keys).
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        pf[kk][0] = ptx::pack2<Element>(s[8 * kk + 0], s[8 * kk + 1]);
        pf[kk][1] = ptx::pack2<Element>(s[8 * kk + 2], s[8 * kk + 3]);
        pf[kk][2] = ptx::pack2<Element>(s[8 * kk + 4], s[8 * kk + 5]);
        pf[kk][3] = ptx::pack2<Element>(s[8 * kk + 6], s[8 * kk + 7]);
      }
    }
    // The last block's O += P V, once its V has landed.
    if (n_blocks > 0) {
      ptx::cp_async_wait<0>();
      ptx::fence_proxy_async_shared();
      __syncthreads();
      ptx::wgmma_hold(o);
      ptx::wgmma_hold(pf);
      ptx::wgmma_fence();
      issue_pv(o, pf, (n_blocks - 1) & 1);
      ptx::wgmma_commit();
      ptx::wgmma_wait<0>();
      ptx::wgmma_hold(o);
    }

    // Every warpgroup is done with this tile's shared memory (with no key block at all, Q's
    // copies may still be in flight). Epilogue: out = O / l in the storage dtype, staged in
    // this warp's own 16 rows of the V stages (so that global stores are 16 bytes per lane);
    // lse = ln 2 * (c max + log2 l). This tile's coordinates are recomputed here rather than
    // kept in registers through the loop.
    ptx::cp_async_wait<0>();
    __syncthreads();
    const Tile<Cfg> done(tiles, index);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = row_sum[r];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const float inv = l == 0.0f ? 0.0f : (dropout ? rng.scale : 1.0f) / l;  // no key seen: out = 0
#pragma unroll
      for (int t = 0; t < kOTiles; ++t)
        ptx::st_shared_32(sV + swizzled_offset<kBlockM>(cta_row(r), t * 8) + quad_col * 2,
                          ptx::pack2<Element>(o[4 * t + 2 * r] * inv, o[4 * t + 2 * r + 1] * inv));
      const int64_t i = done.m0 + cta_row(r);
      if (p.lse != nullptr && lane % 4 == 0 && i < done.seq.seqlen_q)
        p.lse[done.b * p.lse_batch_stride + done.h * p.lse_head_stride + done.seq.q_row0 + i] =
            l == 0.0f ? -INFINITY : (row_max[r] * exp_scale + log2f(l)) * 0.6931471805599453f;
    }
    // The next tile's Q and K(0) copies, while this tile's output is stored.
    index += gridDim.x;
    first_loaded = false;
    if (index < tiles.tiles) {
      tile = Tile<Cfg>(tiles, index);
      first_loaded = tile.rows_here > 0;
      if (first_loaded) tile.load_first(p, sQ, sK);
    }
    __syncwarp();
    const int warp_row0 = warpgroup * 64 + warp * 16;
    Element* out = static_cast<Element*>(p.out) + done.b * p.out_batch_stride +
                   (done.seq.q_row0 + done.m0 + warp_row0) * p.out_row_stride + done.h * p.out_head_stride;
    const int64_t warp_rows_valid = done.seq.seqlen_q - (done.m0 + warp_row0);
#pragma unroll
    for (int pass = 0; pass < 16 * Cfg::kChunksPerRow / 32; ++pass) {
      const int idx = lane + 32 * pass;
      const int row = idx / Cfg::kChunksPerRow, col = (idx % Cfg::kChunksPerRow) * 8;
      if (row < warp_rows_valid && col < p.head_dim_v)
        ptx::st_global_128(out + row * p.out_row_stride + col,
                           ptx::ld_shared_128(sV + swizzled_offset<kBlockM>(warp_row0 + row, col)));
    }
    // The staging is read back by the warp that wrote it; the next tile's first barrier keeps
    // its V copies from overwriting it early.
    if (index >= tiles.tiles) break;
  }
#else
  __trap();  // compiled for sm_90a only; the host launches it only where that code is loaded
#endif
}

}  // namespace flashattn::detail::cuda::sm90

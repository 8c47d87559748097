// The sm80 backward kernels: FlashAttention-2's backward schedule with mma.sync.
//
// Given the forward's lse, P is recomputed tile by tile and never stored in global memory:
//
//   S  = Q K^T                  (scores, modified exactly as the forward: softcap, ALiBi, mask)
//   P  = 2^(S log2e - lse log2e), dropped and scaled by dropout's keep bits (common/philox.hpp)
//   dP = dO V^T  (o dropout's multipliers)
//   dS = P o (dP - D) [o (1 - tanh^2) with a softcap],   D_i = rowsum(dO_i o O_i)
//   dV += P^T dO     dK += dS^T Q     dQ += dS K         (dK, dQ scaled by softmax_scale last)
//
// backward_dkdv_kernel: grid (Hk, key blocks, B) (cuda/common/tile_order.cuh). A CTA owns
//   kBlockN keys of one key/value head and walks every query head of its GQA group and every
//   block of kBlockM query rows that can see those keys (rows_seeing_keys: block skipping
//   under causal/window masks), with Q and dO double-buffered by cp.async. dK and dV stay in fp32 registers for the whole
//   walk and are written once, so GQA's sum over the group needs no atomics and no expanded
//   copy. In the default mode each step also adds its dS K to an fp32 dQ accumulator in
//   global memory with atomicAdd (converted to dq's dtype by a last kernel).
// backward_dq_kernel (deterministic mode): grid (H, query blocks, B). A CTA owns kBlockM
//   query rows and walks the key blocks they see in a fixed order, recomputing S, P, dP and
//   dS, accumulating dQ in registers and writing it once: no atomics, bitwise reproducible.
//   The key-parallel kernel then skips its dQ step.
//
// Register fragments follow ptx.cuh's conventions. P and dS go through shared memory (as
// 16-bit values, like the MMA operands they become) because they are consumed in three
// different warp layouts: transposed as the A operand of P^T dO and dS^T Q (each warp owns 16
// keys x a slice of the head dim, so its dK/dV accumulators never move), and untransposed as
// the A operand of dS K (each warp owns 16 query rows x a slice of the head dim).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common/knobs.hpp"
#include "common/mask.hpp"
#include "common/params.hpp"
#include "common/philox.hpp"
#include "cuda/common/kernel_code.cuh"
#include "cuda/common/per_device.hpp"
#include "cuda/common/ptx.cuh"
#include "cuda/common/tile_order.cuh"
#include "cuda/devices.hpp"
#include "cuda/sm80/tile_loader.cuh"

namespace flashattn::detail::cuda::sm80 {

// What the backward kernels get besides the call itself: the workspace and the dropout key.
struct BackwardKernelParams {
  BackwardParams bp;
  // fp32 dQ accumulator (default mode, and the sm90 TMA kernel's deterministic one; unused by
  // the sm80 kernels in deterministic mode): row i of (b, h) is at
  // row_index(b, h, i) * accum_dim, accum_dim being the head-dim bucket.
  float* dq_accum = nullptr;
  int32_t accum_dim = 0;
  // D_i = rowsum(dO_i o O_i) in fp32, indexed like lse: row_index(b, h, i).
  float* delta = nullptr;
  DropoutRng dropout;
  bool has_dropout = false;
  // sm_90: the key-parallel kernel adds dQ with bulk reductions from Cfg::kDqStagingBytes of
  // extra shared memory (set at launch where that fits) instead of per-element atomics.
  bool bulk_dq = false;
  // The sm90 TMA kernel (sm90/backward_ws_kernel.cuh) reads the stats from padded copies that
  // the preprocess writes instead of delta: lse log2(e) (+inf where a row saw no key and for
  // rows past the sequence) and D (0 there), in whole 64-row steps of each sequence and head
  // (sm90::padded_stats_row says where; padded_rows is a whole number of steps). Null for the
  // other kernels.
  float* lse_log2 = nullptr;
  float* delta_padded = nullptr;
  int64_t padded_rows = 0;
  // The TMA kernel's accumulator holds each row's 16-byte chunks swizzled
  // (sm90::dq_chunk); the conversion reads them back in place.
  bool dq_accum_swizzled = false;
  // The TMA kernel in deterministic mode: one turn counter per (b, h, 64-row step), zeroed,
  // at the step's first padded_stats_row / 64; the key blocks add dQ in their order (write_dq).
  int* dq_turns = nullptr;
};

// Row i of sequence b, head h in lse-shaped buffers (dense (B, H, Sq); varlen (H, total_q)).
__device__ __forceinline__ int64_t row_index(const ForwardParams& p, int32_t b, int32_t h,
                                             int64_t q_row0, int64_t i) {
  return b * p.lse_batch_stride + h * p.lse_head_stride + q_row0 + i;
}

template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_>
struct BackwardConfig {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;  // the bucket: a multiple of 32
  static constexpr int kBlockM = kBlockM_;    // query rows per step
  static constexpr int kBlockN = kBlockN_;    // keys per CTA (key-parallel) / per step (dq)
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kRowStride = kHeadDim + 8;  // Q, dO, K, V rows in shared memory
  static constexpr int kPStride = kBlockN + 8;     // P, dS rows (padded like the others)
  static constexpr int kChunksPerRow = kHeadDim / 8;

  // S and dP (kBlockM x kBlockN): kWarpsM warps along the rows, kMTiles m16 tiles each, times
  // kWarpsN along the keys, kSTiles n8 tiles each. dQ (kBlockM x kHeadDim) uses the same
  // warps, split along the head dim instead of the keys. Two m16 tiles per warp, where the
  // key slice stays whole n16 slices, make every B fragment read from shared memory feed two
  // MMAs: shared-memory reads per MMA, not MMAs, bound this kernel (FA2's layout).
  static constexpr int kMTiles =
      kBlockM % 32 == 0 && kWarps % (kBlockM / 32) == 0 && (kBlockN / (kWarps / (kBlockM / 32))) % 16 == 0 ? 2 : 1;
  static constexpr int kWarpsM = kBlockM / (16 * kMTiles);
  static constexpr int kWarpsN = kWarps / kWarpsM;
  static constexpr int kSTiles = kBlockN / kWarpsN / 8;   // n8 tiles of S per warp
  static constexpr int kQTiles = kHeadDim / kWarpsN / 8;  // n8 tiles of dQ per warp
  // dK and dV (kBlockN x kHeadDim): kWarpsKeys warps along the keys, kKvMTiles m16 tiles
  // each (two where the head dim splits evenly, for the same reason), times the rest along
  // the head dim; these accumulators live in registers for the whole CTA.
  static constexpr int kKvMTiles =
      kBlockN % 32 == 0 && kWarps % (kBlockN / 32) == 0 && kHeadDim % (8 * (kWarps / (kBlockN / 32))) == 0 ? 2 : 1;
  static constexpr int kWarpsKeys = kBlockN / (16 * kKvMTiles);
  static constexpr int kWarpsKD = kWarps / kWarpsKeys;
  static constexpr int kKTiles = kHeadDim / kWarpsKD / 8;  // n8 tiles of dK (and dV) per warp

  static constexpr int kTileBytes = kRowStride * 2;  // bytes of one padded row (16-bit)
  static constexpr int kQBytes = kBlockM * kRowStride * 2;
  static constexpr int kKBytes = kBlockN * kRowStride * 2;
  static constexpr int kPBytes = kBlockM * kPStride * 2;
  static constexpr int kRowStatBytes = kBlockM * 4;
  // Key-parallel kernel: Q, dO (2 stages each), K, V, P, dS, lse and D (2 stages each).
  static constexpr int kDkdvSharedBytes = 4 * kQBytes + 2 * kKBytes + 2 * kPBytes + 4 * kRowStatBytes;
  // dQ kernel: Q, dO, K and V (2 stages each), dS, lse and D.
  static constexpr int kDqSharedBytes = 2 * kQBytes + 4 * kKBytes + kPBytes + 2 * kRowStatBytes;
  // sm_90's bulk dQ reduction: the CTA stages its kBlockM x kHeadDim dQ block (fp32), rows
  // padded to a stride of 8 (mod 32) floats so that the fragment stores (4 rows x 8 columns
  // per half-warp) hit 32 distinct banks; each row is one bulk reduction of a whole
  // accumulator row (kHeadDim floats: 16-byte aligned at both ends).
  static constexpr int kDqRowBytes = kHeadDim * 4;
  static constexpr int kDqStagingStride = kHeadDim + 8;
  static constexpr int kDqStagingBytes = kBlockM * kDqStagingStride * 4;
  // Where the staging fits next to the rest (227 KiB: the H100/H200 limit), and only from
  // head dim 128 on: measured on the H200 (2026-11-30, docs/PERFORMANCE.md) bulk reductions
  // gain 1-3 % at head dim 128 but lose 5-6 % at 64, where a row is only 256 bytes and the
  // staging round trip and its barrier cost more than the atomics they replace.
  static constexpr bool kBulkDqPossible =
      kHeadDim >= 128 && kDkdvSharedBytes + kDqStagingBytes <= 227 * 1024;
  // What the device must allow for both modes (the dQ kernel runs in deterministic mode).
  static constexpr int kMaxSharedBytes =
      kDkdvSharedBytes > kDqSharedBytes ? kDkdvSharedBytes : kDqSharedBytes;

  static_assert(kHeadDim % 32 == 0 && kBlockM % 16 == 0 && kBlockN % 16 == 0, "tile shapes");
  static_assert(kWarps % kWarpsM == 0 && kWarps % kWarpsKeys == 0 && kWarpsM * 16 * kMTiles == kBlockM &&
                    kWarpsKeys * 16 * kKvMTiles == kBlockN, "warp layouts");
  static_assert(kSTiles % 2 == 0 && kSTiles * 8 * kWarpsN == kBlockN, "S split in n16 slices");
  static_assert(kQTiles * 8 * kWarpsN == kHeadDim && kKTiles * 8 * kWarpsKD == kHeadDim,
                "head dim split in n8 slices");
};

// The lane's byte offset within a 16x16 fragment of a shared tile with `stride` elements per
// row, for the two ldmatrix address patterns (see ptx.cuh: lane l addresses row l % 8 of
// matrix l / 8):
//  - rows l % 16, column (l / 16) * 8: an A operand stored row-major (A rows = tile rows), or
//    a B operand stored k-major (tile rows = k), loaded with .trans;
//  - rows l % 8 + (l / 16) * 8, column ((l / 8) % 2) * 8: a B operand stored n-major (tile
//    rows = n, like K for Q K^T), or an A operand stored k-major (tile rows = k, like P for
//    P^T dO), loaded with .trans.
template <int kStride>
__device__ __forceinline__ uint32_t lane_offset_rows16(int lane) {
  return static_cast<uint32_t>(((lane % 16) * kStride + (lane / 16) * 8) * 2);
}
template <int kStride>
__device__ __forceinline__ uint32_t lane_offset_rows8(int lane) {
  return static_cast<uint32_t>(((lane % 8 + (lane / 16) * 8) * kStride + ((lane / 8) % 2) * 8) * 2);
}

// acc (16 kMTiles x 8 kNTiles) += A (16 kMTiles x 16 kKSteps) B (16 kKSteps x 8 kNTiles) for
// one warp, both operands in shared memory at the lane's address for m-tile 0 / k-step 0 /
// n-tile 0. Each B fragment loaded feeds kMTiles MMAs, each A fragment kNTiles.
//  kATrans false: A is stored row-major with kAStride elements per row (k-steps are columns);
//          true:  A is stored k-major (A^T row-major), read with ldmatrix.trans.
//  kBTrans false: B is stored n-major (B^T row-major, rows = n);
//          true:  B is stored k-major (rows = k), read with ldmatrix.trans.
// With kBTrans an odd tile count ends with an x2 load.
template <typename Element, int kMTiles, int kKSteps, int kNTiles, bool kATrans, int kAStride,
          bool kBTrans, int kBStride>
__device__ __forceinline__ void warp_mma(float (&acc)[kMTiles][kNTiles][4], uint32_t a_addr,
                                         uint32_t b_addr) {
  static_assert(kBTrans || kNTiles % 2 == 0, "n-major B operands come in n16 slices");
  constexpr uint32_t kAStep = kATrans ? 16 * kAStride * 2 : 32;  // bytes per k-step
  constexpr uint32_t kAMTile = kATrans ? 32 : 16 * kAStride * 2;  // bytes per m16 tile
  constexpr uint32_t kBStep = kBTrans ? 16 * kBStride * 2 : 32;
  constexpr uint32_t kBTile = kBTrans ? 16 : 8 * kBStride * 2;   // bytes per n8 tile
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk) {
    uint32_t a[kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      if (kATrans)
        ptx::ldmatrix_x4_trans(a[mt], a_addr + kk * kAStep + mt * kAMTile);
      else
        ptx::ldmatrix_x4(a[mt], a_addr + kk * kAStep + mt * kAMTile);
    }
#pragma unroll
    for (int t = 0; t + 1 < kNTiles; t += 2) {
      uint32_t bf[4];
      if (kBTrans)
        ptx::ldmatrix_x4_trans(bf, b_addr + kk * kBStep + t * kBTile);
      else
        ptx::ldmatrix_x4(bf, b_addr + kk * kBStep + t * kBTile);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        ptx::mma_16816<Element>(acc[mt][t], a[mt], bf[0], bf[1]);
        ptx::mma_16816<Element>(acc[mt][t + 1], a[mt], bf[2], bf[3]);
      }
    }
    if constexpr (kNTiles % 2 == 1) {
      uint32_t bf[2];
      ptx::ldmatrix_x2_trans(bf, b_addr + kk * kBStep + (kNTiles - 1) * kBTile);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
        ptx::mma_16816<Element>(acc[mt][kNTiles - 1], a[mt], bf[0], bf[1]);
    }
  }
}

// Everything one (query block, key block) tile needs to turn S and dP into P and dS.
struct TileContext {
  int32_t b, h;
  int64_t m0, j0;           // first query row and first key of the tile (within the sequence)
  int64_t seqlen_q, seqlen_k;
  bool needs_mask;          // the tile is not fully visible (block_fully_visible)
  float slope;              // ALiBi slope of (b, h), 0 when off
};

// kGeneral: softcap, ALiBi or dropout may occur. Without them (the common case) the kernels
// are compiled without that code, as the forward's plain variant is: a shorter loop body (the
// profile against FA2 showed instruction-cache stalls) and no per-element flag tests.
//
// For one warp: S (in s) and dP (in dp) of its 16 kMTiles rows x 8 kSTiles keys become P o M (in s,
// written to sP when kStoreP) and dS (in dp, written to sdS). sLse holds each row's lse as
// the forward wrote it (-inf for a row that saw nothing, 0 past the sequence: zero-filled by
// load_row_stats), sD holds D (0 past the sequence).
template <typename Cfg, bool kStoreP, bool kGeneral>
__device__ __forceinline__ void probabilities_and_ds(
    const BackwardKernelParams& kp, const TileContext& tc, float (&s)[Cfg::kMTiles][Cfg::kSTiles][4],
    float (&dp)[Cfg::kMTiles][Cfg::kSTiles][4], const float* sLse, const float* sD,
    typename Cfg::Element* sP, typename Cfg::Element* sdS, int warp_row0, int warp_col0,
    int lane) {
  using Element = typename Cfg::Element;
  constexpr float kLog2e = 1.4426950408889634f;
  const ForwardParams& p = kp.bp.fwd;
  const bool softcap = kGeneral && p.softcap > 0.0f;
  // Without softcap and ALiBi S stays raw and the scale goes into the exponent (one FFMA).
  const bool plain = !kGeneral || (!softcap && p.alibi_slopes == nullptr);
  const float score_scale = softcap ? p.softmax_scale / p.softcap : p.softmax_scale * kLog2e;
  const int quad_row = lane / 4, quad_col = (lane % 4) * 2;
  // The loop below is compiled twice: without the mask's per-element tests for the tiles that
  // every row sees whole (most of them), and with them for the boundary tiles.
  const auto tile = [&](auto masked_tag) {
  constexpr bool kMasked = decltype(masked_tag)::value;
#pragma unroll
  for (int mt = 0; mt < Cfg::kMTiles; ++mt)
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = warp_row0 + mt * 16 + quad_row + r * 8;  // within the tile
    const int64_t i = tc.m0 + row;
    const float lse = sLse[row], delta = sD[row];
    // +inf gives P = 0: rows that saw nothing, and, in the general variant, rows past the
    // sequence (there a negative ALiBi slope or a dropout scale near 1 / (1 - p) -> inf could
    // make P overflow, and inf x their zero dO would be NaN; the plain variant's P is exactly
    // 1 there, which their zero dO and D cancel).
    const float lse2 = lse == -INFINITY || (kGeneral && i >= tc.seqlen_q) ? INFINITY : lse * kLog2e;
    int lo = 0, hi = Cfg::kBlockN;
    if (kMasked) {
      const KeyRange visible =
          visible_keys(i, tc.seqlen_q, tc.seqlen_k, p.window_left, p.window_right);
      const int64_t lo64 = visible.begin - tc.j0, hi64 = visible.end - tc.j0;
      lo = lo64 < 0 ? 0 : (lo64 > Cfg::kBlockN ? Cfg::kBlockN : static_cast<int>(lo64));
      hi = hi64 < 0 ? 0 : (hi64 > Cfg::kBlockN ? Cfg::kBlockN : static_cast<int>(hi64));
    }
    // ALiBi's |i + alibi_diagonal - j| = |diagonal - c| for the tile column c = j - j0.
    const int diagonal = static_cast<int>(i + alibi_diagonal(p, tc.seqlen_q, tc.seqlen_k) - tc.j0);
    const bool dropout = kGeneral && kp.has_dropout;
    const bool draw = dropout && i < tc.seqlen_q;
#pragma unroll
    for (int t = 0; t < Cfg::kSTiles; ++t) {
      const int c0 = warp_col0 + t * 8 + quad_col;
      // The keep bits of tokens (i, j) and (i, j + 1) of the whole sequence (the call's row
      // and key moved by Options::positions): one group of 4 keys unless j % 4 == 3.
      uint32_t keep = 3u;
      if (draw) keep = kp.dropout.keep_bits2(static_cast<uint32_t>(tc.b), static_cast<uint32_t>(tc.h),
                                             static_cast<uint32_t>(i + p.query_position0),
                                             static_cast<uint32_t>(tc.j0 + c0 + p.key_position0));
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = c0 + e;
        float x = s[mt][t][2 * r + e];
        float grad = 1.0f;  // d(softcapped score) / d(scaled score)
        if (plain) {
          x = fmaf(x, score_scale, -lse2);
        } else {
          x *= score_scale;
          if (softcap) {
            const float th = ptx::tanh_for_softcap(x);
            grad = 1.0f - th * th;
            x = p.softcap * th * kLog2e;
          }
          x -= tc.slope * kLog2e * static_cast<float>(abs(diagonal - c));
          x -= lse2;
        }
        if (kMasked && (c < lo || c >= hi)) x = -INFINITY;
        const float prob = ptx::exp2_approx(x);  // masked, or a row that saw nothing: 0
        float dpe = dp[mt][t][2 * r + e];
        float kept_prob = prob;
        if (dropout) {
          const bool kept = (keep >> e) & 1u;
          dpe = kept ? dpe * kp.dropout.scale : 0.0f;
          kept_prob = kept ? prob * kp.dropout.scale : 0.0f;
        }
        s[mt][t][2 * r + e] = kept_prob;
        dp[mt][t][2 * r + e] = prob * (dpe - delta) * grad;
      }
      if (kStoreP)
        *reinterpret_cast<uint32_t*>(sP + row * Cfg::kPStride + c0) =
            ptx::pack2<Element>(s[mt][t][2 * r], s[mt][t][2 * r + 1]);
      *reinterpret_cast<uint32_t*>(sdS + row * Cfg::kPStride + c0) =
          ptx::pack2<Element>(dp[mt][t][2 * r], dp[mt][t][2 * r + 1]);
    }
  }
  };
  if (tc.needs_mask)
    tile(std::true_type{});
  else
    tile(std::false_type{});
}

// Starts copying lse and D of query rows [m0, m0 + kBlockM) of (b, h) into shared memory
// (cp.async, in the caller's commit group; rows past the sequence read as 0). lse becomes
// lse log2(e) where it is used (probabilities_and_ds says what rows past the sequence and
// rows that saw no key get there).
template <typename Cfg>
__device__ __forceinline__ void load_row_stats(const BackwardKernelParams& kp, int32_t b,
                                               int32_t h, const SequenceView& seq, int64_t m0,
                                               uint32_t sLse, uint32_t sD) {
  for (int r = threadIdx.x; r < Cfg::kBlockM; r += Cfg::kThreads) {
    const int64_t i = m0 + r;
    const bool valid = i < seq.seqlen_q;
    const int64_t at = valid ? row_index(kp.bp.fwd, b, h, seq.q_row0, i) : 0;
    ptx::cp_async_4(sLse + r * 4, kp.bp.fwd.lse + at, valid);
    ptx::cp_async_4(sD + r * 4, kp.delta + at, valid);
  }
}

template <typename Cfg, bool kGeneral>
__global__ void __launch_bounds__(Cfg::kThreads)
    backward_dkdv_kernel(const __grid_constant__ BackwardKernelParams kp) {
  using Element = typename Cfg::Element;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHeadDim = Cfg::kHeadDim;
  constexpr int kRowStride = Cfg::kRowStride, kPStride = Cfg::kPStride;
  constexpr int kSTiles = Cfg::kSTiles, kKTiles = Cfg::kKTiles, kQTiles = Cfg::kQTiles;
  constexpr int kMTiles = Cfg::kMTiles, kKvMTiles = Cfg::kKvMTiles;
  const BackwardParams& bp = kp.bp;
  const ForwardParams& p = bp.fwd;

  extern __shared__ __align__(16) unsigned char shared_raw[];
  Element* sQ = reinterpret_cast<Element*>(shared_raw);  // 2 stages
  Element* sdO = sQ + 2 * kBlockM * kRowStride;          // 2 stages
  Element* sK = sdO + 2 * kBlockM * kRowStride;
  Element* sV = sK + kBlockN * kRowStride;
  Element* sP = sV + kBlockN * kRowStride;
  Element* sdS = sP + kBlockM * kPStride;
  float* sLse = reinterpret_cast<float*>(sdS + kBlockM * kPStride);  // 2 stages
  float* sD = sLse + 2 * kBlockM;                                     // 2 stages
  float* sDqStaging = sD + 2 * kBlockM;  // kp.bulk_dq only: Cfg::kDqStagingBytes (see below)

  // Heavier (earlier, under causal masks) key blocks first, across the key/value heads
  // (cuda/common/tile_order.cuh), for a shorter tail.
  const int n_block = tile_rank(p.heads_k), hk = tile_head(p.heads_k), b = tile_batch();
  const SequenceView seq = sequence_view(p, b);
  // Keys past seqused_k take no part but are still this CTA's to write (with zeros).
  const int64_t stored_k = seq.rows_k;
  const int64_t j0 = int64_t{n_block} * kBlockN;
  if (j0 >= stored_k) return;
  const int64_t keys_here = seq.seqlen_k - j0 < 0 ? 0
                            : (seq.seqlen_k - j0 < kBlockN ? seq.seqlen_k - j0 : kBlockN);

  // The query blocks that see these keys, for each head of the group.
  int64_t m_first = 0;
  int m_blocks = 0;
  if (keys_here > 0 && seq.seqlen_q > 0) {
    const KeyRange rows = rows_seeing_keys(j0, j0 + keys_here, seq.seqlen_q, seq.seqlen_k,
                                           p.window_left, p.window_right);
    if (!rows.empty()) {
      m_first = rows.begin / kBlockM;
      m_blocks = static_cast<int>((rows.end + kBlockM - 1) / kBlockM - m_first);
    }
  }
  const int group = p.group_size();
  const int steps = group * m_blocks;

  const Element* k = static_cast<const Element*>(p.k) + b * p.k_batch_stride +
                     (seq.k_row0 + j0) * p.k_row_stride + hk * p.k_head_stride;
  const Element* v = static_cast<const Element*>(p.v) + b * p.v_batch_stride +
                     (seq.k_row0 + j0) * p.v_row_stride + hk * p.v_head_stride;
  // Q, dO, lse and D of the next step into `stage`. Steps run over the group's heads, each
  // over its query blocks, so each source advances by one block per step, or to the next
  // head's first block: the cursors below move by an add or two per step instead of being
  // recomputed from (h, m0) with 64-bit products (the profile against FA2 counted 9 % more
  // instructions, much of it this address arithmetic).
  const TileLoader<Cfg, kBlockM> q_loader(p.head_dim), do_loader(p.head_dim_v);
  const Element* const q_any = static_cast<const Element*>(p.q);
  const Element* const do_any = static_cast<const Element*>(bp.dout);
  const int64_t first_row = seq.q_row0 + m_first * kBlockM;
  const Element* q_next = q_loader.thread_source(
      q_any + b * p.q_batch_stride + first_row * p.q_row_stride + int64_t{hk} * group * p.q_head_stride,
      p.q_row_stride);
  const Element* do_next = do_loader.thread_source(
      do_any + b * bp.dout_batch_stride + first_row * bp.dout_row_stride +
          int64_t{hk} * group * bp.dout_head_stride,
      bp.dout_row_stride);
  // lse and D of this thread's row (threads below kBlockM each copy one row's).
  int64_t stat_next = row_index(p, b, hk * group, seq.q_row0, m_first * kBlockM) + threadIdx.x;
  int64_t m0_next = m_first * kBlockM;  // the next step's first row within the sequence
  int m_index_next = 0;
  static_assert(kBlockM <= Cfg::kThreads, "one row of lse and D per thread");
  const auto load_next_step = [&](int stage) {
    q_loader.load_thread(ptx::shared_address(sQ + stage * kBlockM * kRowStride), q_next, q_any,
                         p.q_row_stride, seq.seqlen_q - m0_next);
    do_loader.load_thread(ptx::shared_address(sdO + stage * kBlockM * kRowStride), do_next, do_any,
                          bp.dout_row_stride, seq.seqlen_q - m0_next);
    if (threadIdx.x < kBlockM) {  // rows past the sequence read as 0
      const bool valid = m0_next + threadIdx.x < seq.seqlen_q;
      ptx::cp_async_4(ptx::shared_address(sLse + stage * kBlockM + threadIdx.x),
                      p.lse + (valid ? stat_next : 0), valid);
      ptx::cp_async_4(ptx::shared_address(sD + stage * kBlockM + threadIdx.x),
                      kp.delta + (valid ? stat_next : 0), valid);
    }
    if (++m_index_next < m_blocks) {
      q_next += kBlockM * p.q_row_stride;
      do_next += kBlockM * bp.dout_row_stride;
      stat_next += kBlockM;
      m0_next += kBlockM;
    } else {  // the next head's first block
      const int64_t back = int64_t{m_blocks - 1} * kBlockM;
      q_next += p.q_head_stride - back * p.q_row_stride;
      do_next += bp.dout_head_stride - back * bp.dout_row_stride;
      stat_next += p.lse_head_stride - back;
      m0_next -= back;
      m_index_next = 0;
    }
  };

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // S/dP/dQ layout: 16 kMTiles rows x a slice of keys (S) or of the head dim (dQ).
  const int warp_m = warp % Cfg::kWarpsM, warp_n = warp / Cfg::kWarpsM;
  // dK/dV layout: 16 kKvMTiles keys x a slice of the head dim.
  const int warp_key = warp % Cfg::kWarpsKeys, warp_kd = warp / Cfg::kWarpsKeys;

  float dk[kKvMTiles][kKTiles][4] = {}, dv[kKvMTiles][kKTiles][4] = {};

  if (steps > 0) {
    TileLoader<Cfg, kBlockN>(p.head_dim).load(ptx::shared_address(sK), k, p.k_row_stride, keys_here);
    TileLoader<Cfg, kBlockN>(p.head_dim_v).load(ptx::shared_address(sV), v, p.v_row_stride, keys_here);
    load_next_step(0);
    ptx::cp_async_commit();
  }

  const uint32_t q_lane = lane_offset_rows16<kRowStride>(lane);     // A of S, dP; B^T-trans
  const uint32_t k_lane = lane_offset_rows8<kRowStride>(lane);      // B of S, dP
  const uint32_t p_lane_t = lane_offset_rows8<kPStride>(lane);      // A^T of dV, dK
  const uint32_t p_lane = lane_offset_rows16<kPStride>(lane);       // A of dQ
  const uint32_t sQ_addr = ptx::shared_address(sQ), sdO_addr = ptx::shared_address(sdO);
  const uint32_t sK_addr = ptx::shared_address(sK), sV_addr = ptx::shared_address(sV);
  const uint32_t sP_addr = ptx::shared_address(sP), sdS_addr = ptx::shared_address(sdS);
  constexpr uint32_t kStageBytes = Cfg::kQBytes;

  // sm_90 bulk dQ (kp.bulk_dq): at step it every warp writes its dQ fragments into the
  // staging block; at the top of step it + 1, after its barrier, thread kRowIssuer r adds row
  // r of it to the accumulator with one bulk reduction (a warp issues them one lane at a
  // time: kBlockM / kWarps rows per warp, instead of 16 kMTiles kQTiles atomics per thread),
  // which then overlaps the step; before the step's second barrier the issuing threads wait
  // until their row has been read, so that the staging may be rewritten after it.
  constexpr int kRowIssuer = Cfg::kThreads / kBlockM;  // row r's issuing thread: kRowIssuer r
  static_assert(Cfg::kThreads % kBlockM == 0, "bulk dQ rows spread over the warps");
  // Only the destination stays live across the loop (the general variant has no registers to
  // spare); the row and its staging address are recomputed from threadIdx where used.
  float* staged_dq_row = nullptr;  // the destination of the staged row this thread issues, or null

  int h = hk * group, m_index = 0;  // step it's query head and block
  for (int it = 0; it < steps; ++it) {
    const int stage = it & 1;
    const int64_t m0 = (m_first + m_index) * kBlockM;
    const bool last_block = m_index + 1 == m_blocks;
    const int next_h = last_block ? h + 1 : h, next_m_index = last_block ? 0 : m_index + 1;
    ptx::cp_async_wait<0>();
    __syncthreads();  // step it has landed, and every warp is done with step it - 1
    if (it + 1 < steps) load_next_step(stage ^ 1);
    ptx::cp_async_commit();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (Cfg::kBulkDqPossible && staged_dq_row != nullptr)
      ptx::bulk_reduce_add_f32(staged_dq_row,
                               ptx::shared_address(sDqStaging + threadIdx.x / kRowIssuer * Cfg::kDqStagingStride),
                               Cfg::kDqRowBytes);
#endif

    const uint32_t q_addr = sQ_addr + stage * kStageBytes, do_addr = sdO_addr + stage * kStageBytes;
    // S = Q K^T and dP = dO V^T for this warp's 16 kMTiles rows x kSTiles * 8 keys.
    float s[kMTiles][kSTiles][4] = {}, dpv[kMTiles][kSTiles][4] = {};
    const uint32_t a_row = warp_m * kMTiles * 16 * kRowStride * 2;
    const uint32_t b_row = warp_n * kSTiles * 8 * kRowStride * 2;
    warp_mma<Element, kMTiles, kHeadDim / 16, kSTiles, false, kRowStride, false, kRowStride>(
        s, q_addr + a_row + q_lane, sK_addr + b_row + k_lane);
    warp_mma<Element, kMTiles, kHeadDim / 16, kSTiles, false, kRowStride, false, kRowStride>(
        dpv, do_addr + a_row + q_lane, sV_addr + b_row + k_lane);

    TileContext tc;
    tc.b = b;
    tc.h = h;
    tc.m0 = m0;
    tc.j0 = j0;
    tc.seqlen_q = seq.seqlen_q;
    tc.seqlen_k = seq.seqlen_k;
    const int64_t m1 = m0 + kBlockM < seq.seqlen_q ? m0 + kBlockM : seq.seqlen_q;
    tc.needs_mask = !block_fully_visible(m0, m1, j0, j0 + kBlockN, seq.seqlen_q, seq.seqlen_k,
                                         p.window_left, p.window_right);
    tc.slope = p.alibi_slopes != nullptr ? p.alibi_slopes[b * p.alibi_batch_stride + h] : 0.0f;
    probabilities_and_ds<Cfg, true, kGeneral>(kp, tc, s, dpv, sLse + stage * kBlockM, sD + stage * kBlockM,
                                    sP, sdS, warp_m * kMTiles * 16, warp_n * kSTiles * 8, lane);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // (ptxas waits for bulk and cp.async groups on one counter, so this also waits for the
    // prefetch issued at the top: by now it has had the S/dP products to land. Moving the
    // prefetch below the barrier instead made the general variant spill.)
    if (Cfg::kBulkDqPossible && staged_dq_row != nullptr) {
      ptx::bulk_wait_read();  // staged row read: the barrier below releases the staging
      staged_dq_row = nullptr;
    }
#endif
    __syncthreads();  // P and dS are in shared memory (and the dQ staging is free)

    // dV += (P o M)^T dO and dK += dS^T Q: 16 kKvMTiles keys x kKTiles * 8 columns per warp.
    const uint32_t pt_col = warp_key * kKvMTiles * 16 * 2;
    const uint32_t d_col = warp_kd * kKTiles * 8 * 2;
    warp_mma<Element, kKvMTiles, kBlockM / 16, kKTiles, true, kPStride, true, kRowStride>(
        dv, sP_addr + pt_col + p_lane_t, do_addr + d_col + q_lane);
    // dK's product runs between the first dQ chunk and the rest (below), so that the first
    // chunk's atomics have it to drain before the next chunk's fragments reuse their registers.
    const auto dk_product = [&] {
      warp_mma<Element, kKvMTiles, kBlockM / 16, kKTiles, true, kPStride, true, kRowStride>(
          dk, sdS_addr + pt_col + p_lane_t, q_addr + d_col + q_lane);
    };

    // dQ += dS K, added to the fp32 accumulator (default mode), in chunks of at most 8 m16n8
    // tiles so that the partial sums never hold more than 32 registers: by per-element vector
    // atomics, or on sm_90 (kp.bulk_dq) through the staging block (see above), which spares
    // the atomics' register stalls (each atomic's source registers stall their next reuse
    // until it has read them: the profile's long-scoreboard gap to FA2). Deterministic mode
    // (the dQ kernel's) runs only dK's product here.
    {
      const bool accumulate_dq = !bp.deterministic;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      const bool bulk = Cfg::kBulkDqPossible && kp.bulk_dq;
#else
      constexpr bool bulk = false;  // no bulk reductions before sm_90
#endif
      // Chunks of kChunkTiles n8 tiles (halves where they divide evenly, else at most 8 / kMTiles
      // tiles and a smaller last chunk: head dims 160 and 224 with two m16 tiles).
      constexpr int kHalves = kMTiles * kQTiles > 8 ? 2 : 1;
      constexpr bool kEven = kQTiles % kHalves == 0 && kMTiles * (kQTiles / kHalves) <= 8;
      constexpr int kChunkTiles = kEven ? kQTiles / kHalves : 8 / kMTiles;
      constexpr int kFullChunks = kQTiles / kChunkTiles, kRestTiles = kQTiles % kChunkTiles;
      // The atomics of this lane all address one base (its first row and first column pair)
      // plus compile-time offsets: accumulator rows of one (b, h) are consecutive, so row
      // + 8 is kHeadDim floats further. One base register pair for all of them, where a
      // pointer per row would be recomputed into the registers the previous row's atomics
      // still read (an atomic holds its source registers until the memory pipe takes it:
      // the long-scoreboard stalls of the profile at hdim 256, where no staging fits).
      const int warp_row0 = warp_m * kMTiles * 16 + lane / 4;
      const int64_t rows_left = seq.seqlen_q - (m0 + warp_row0);  // rows from this lane's first
      float* const dq_lane = bulk || !accumulate_dq ? nullptr
                                  : kp.dq_accum + row_index(p, b, h, seq.q_row0, m0 + warp_row0) * kHeadDim +
                                        warp_n * kQTiles * 8 + (lane % 4) * 2;
      // chunk_col: the chunk's first column within this warp's kQTiles * 8.
      const auto dq_chunk = [&](auto tile_count, int chunk_col) {
        constexpr int kTiles = decltype(tile_count)::value;
        const int col0 = warp_n * kQTiles * 8 + chunk_col;
        float dq[kMTiles][kTiles][4] = {};
        warp_mma<Element, kMTiles, kBlockN / 16, kTiles, false, kPStride, true, kRowStride>(
            dq, sdS_addr + warp_m * kMTiles * 16 * kPStride * 2 + p_lane, sK_addr + col0 * 2 + q_lane);
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row_in_block = (warp_m * kMTiles + mt) * 16 + lane / 4 + r * 8;
          if (bulk) {
            float* staged = sDqStaging + row_in_block * Cfg::kDqStagingStride + col0 + (lane % 4) * 2;
#pragma unroll
            for (int t = 0; t < kTiles; ++t)
              *reinterpret_cast<float2*>(staged + t * 8) = make_float2(dq[mt][t][2 * r], dq[mt][t][2 * r + 1]);
            continue;
          }
          // Rows of the accumulator are the whole bucket wide (accum_dim = kHeadDim), so the
          // padding columns (0 here: K's are zero-filled) need no test.
          const int row_offset = mt * 16 + r * 8;
          if (row_offset >= rows_left) continue;
          float* row = dq_lane + row_offset * kHeadDim + chunk_col;
#pragma unroll
          for (int t = 0; t < kTiles; ++t)
            ptx::atomic_add_f32x2(row + t * 8, dq[mt][t][2 * r], dq[mt][t][2 * r + 1]);
        }
      };
#pragma unroll
      for (int chunk = 0; chunk < kFullChunks; ++chunk) {
        if (accumulate_dq) dq_chunk(std::integral_constant<int, kChunkTiles>{}, chunk * kChunkTiles * 8);
        if (chunk == 0) dk_product();
      }
      if constexpr (kRestTiles > 0)
        if (accumulate_dq) dq_chunk(std::integral_constant<int, kRestTiles>{}, kFullChunks * kChunkTiles * 8);
      if (accumulate_dq && bulk) {
        ptx::fence_proxy_async_shared();  // the stores, to the async proxy that reads them
        const int64_t i = m0 + threadIdx.x / kRowIssuer;
        if (threadIdx.x % kRowIssuer == 0 && i < seq.seqlen_q)
          staged_dq_row = kp.dq_accum + row_index(p, b, h, seq.q_row0, i) * kHeadDim;
      }
    }
    h = next_h;
    m_index = next_m_index;
  }

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // The last step's rows, once every warp has staged (and fenced) its part.
  if (Cfg::kBulkDqPossible && kp.bulk_dq) {
    __syncthreads();
    if (staged_dq_row != nullptr)
      ptx::bulk_reduce_add_f32(staged_dq_row,
                               ptx::shared_address(sDqStaging + threadIdx.x / kRowIssuer * Cfg::kDqStagingStride),
                               Cfg::kDqRowBytes);
  }
#endif

  // dK = softmax_scale dS^T Q and dV, in the storage dtype, for every stored key of the block.
  const int64_t rows_out = stored_k - j0 < kBlockN ? stored_k - j0 : kBlockN;
#pragma unroll
  for (int mt = 0; mt < kKvMTiles; ++mt)
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = (warp_key * kKvMTiles + mt) * 16 + lane / 4 + r * 8;
    if (key >= rows_out) continue;
    const int64_t row = seq.k_row0 + j0 + key;
    Element* dk_row = static_cast<Element*>(bp.dk) + b * bp.dk_batch_stride +
                      row * bp.dk_row_stride + hk * bp.dk_head_stride;
    Element* dv_row = static_cast<Element*>(bp.dv) + b * bp.dv_batch_stride +
                      row * bp.dv_row_stride + hk * bp.dv_head_stride;
#pragma unroll
    for (int t = 0; t < kKTiles; ++t) {
      const int col = (warp_kd * kKTiles + t) * 8 + (lane % 4) * 2;
      if (col < p.head_dim)
        *reinterpret_cast<uint32_t*>(dk_row + col) = ptx::pack2<Element>(
            dk[mt][t][2 * r] * p.softmax_scale, dk[mt][t][2 * r + 1] * p.softmax_scale);
      if (col < p.head_dim_v)
        *reinterpret_cast<uint32_t*>(dv_row + col) =
            ptx::pack2<Element>(dv[mt][t][2 * r], dv[mt][t][2 * r + 1]);
    }
  }
  // The bulk dQ reductions complete before the CTA exits (their source is this CTA's shared
  // memory); waiting here lets the last ones overlap the dK/dV stores.
  if (Cfg::kBulkDqPossible && kp.bulk_dq) ptx::bulk_wait_all();
}

template <typename Cfg, bool kGeneral>
__global__ void __launch_bounds__(Cfg::kThreads)
    backward_dq_kernel(const __grid_constant__ BackwardKernelParams kp) {
  using Element = typename Cfg::Element;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHeadDim = Cfg::kHeadDim;
  constexpr int kRowStride = Cfg::kRowStride, kPStride = Cfg::kPStride;
  constexpr int kSTiles = Cfg::kSTiles, kQTiles = Cfg::kQTiles, kMTiles = Cfg::kMTiles;
  const BackwardParams& bp = kp.bp;
  const ForwardParams& p = bp.fwd;

  extern __shared__ __align__(16) unsigned char shared_raw[];
  Element* sQ = reinterpret_cast<Element*>(shared_raw);
  Element* sdO = sQ + kBlockM * kRowStride;
  Element* sK = sdO + kBlockM * kRowStride;  // 2 stages
  Element* sV = sK + 2 * kBlockN * kRowStride;  // 2 stages
  Element* sdS = sV + 2 * kBlockN * kRowStride;
  float* sLse = reinterpret_cast<float*>(sdS + kBlockM * kPStride);
  float* sD = sLse + kBlockM;

  // Heavier (later, under causal masks) query blocks first, across the heads
  // (cuda/common/tile_order.cuh), for a shorter tail.
  const int m_block = tile_blocks(p.heads) - 1 - tile_rank(p.heads);
  const int h = tile_head(p.heads), b = tile_batch();
  const SequenceView seq = sequence_view(p, b);
  const int64_t m0 = int64_t{m_block} * kBlockM;
  if (m0 >= seq.seqlen_q) return;
  const int64_t rows_here = seq.seqlen_q - m0 < kBlockM ? seq.seqlen_q - m0 : kBlockM;
  const int hk = h / p.group_size();

  // The key blocks these rows see, aligned to kBlockN so that every block starts on a group
  // of 4 keys (one Philox call per column pair) like the key-parallel kernel's.
  const KeyRange keys = visible_keys_of_rows(m0, m0 + rows_here, seq.seqlen_q, seq.seqlen_k,
                                             p.window_left, p.window_right);
  const int64_t n_begin = keys.empty() ? 0 : keys.begin / kBlockN * kBlockN;
  const int n_blocks =
      keys.empty() ? 0 : static_cast<int>((keys.end - n_begin + kBlockN - 1) / kBlockN);

  const Element* k = static_cast<const Element*>(p.k) + b * p.k_batch_stride +
                     seq.k_row0 * p.k_row_stride + hk * p.k_head_stride;
  const Element* v = static_cast<const Element*>(p.v) + b * p.v_batch_stride +
                     seq.k_row0 * p.v_row_stride + hk * p.v_head_stride;
  const TileLoader<Cfg, kBlockN> k_loader(p.head_dim), v_loader(p.head_dim_v);
  const auto load_keys = [&](int n, int stage) {
    const int64_t j = n_begin + int64_t{n} * kBlockN;
    k_loader.load(ptx::shared_address(sK + stage * kBlockN * kRowStride), k + j * p.k_row_stride,
                  p.k_row_stride, seq.seqlen_k - j);
    v_loader.load(ptx::shared_address(sV + stage * kBlockN * kRowStride), v + j * p.v_row_stride,
                  p.v_row_stride, seq.seqlen_k - j);
  };

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_m = warp % Cfg::kWarpsM, warp_n = warp / Cfg::kWarpsM;
  float dq[kMTiles][kQTiles][4] = {};

  if (n_blocks > 0) {
    const int64_t row = seq.q_row0 + m0;
    TileLoader<Cfg, kBlockM>(p.head_dim).load(ptx::shared_address(sQ),
        static_cast<const Element*>(p.q) + b * p.q_batch_stride + row * p.q_row_stride +
            h * p.q_head_stride,
        p.q_row_stride, rows_here);
    TileLoader<Cfg, kBlockM>(p.head_dim_v).load(ptx::shared_address(sdO),
        static_cast<const Element*>(bp.dout) + b * bp.dout_batch_stride +
            row * bp.dout_row_stride + h * bp.dout_head_stride,
        bp.dout_row_stride, rows_here);
    load_row_stats<Cfg>(kp, b, h, seq, m0, ptx::shared_address(sLse), ptx::shared_address(sD));
    load_keys(0, 0);
    ptx::cp_async_commit();
  }

  const uint32_t q_lane = lane_offset_rows16<kRowStride>(lane);
  const uint32_t k_lane = lane_offset_rows8<kRowStride>(lane);
  const uint32_t p_lane = lane_offset_rows16<kPStride>(lane);
  const uint32_t sQ_addr = ptx::shared_address(sQ), sdO_addr = ptx::shared_address(sdO);
  const uint32_t sK_addr = ptx::shared_address(sK), sV_addr = ptx::shared_address(sV);
  const uint32_t sdS_addr = ptx::shared_address(sdS);
  constexpr uint32_t kStageBytes = Cfg::kKBytes;
  const float slope =
      p.alibi_slopes != nullptr ? p.alibi_slopes[b * p.alibi_batch_stride + h] : 0.0f;

  for (int n = 0; n < n_blocks; ++n) {
    const int stage = n & 1;
    const int64_t j0 = n_begin + int64_t{n} * kBlockN;
    ptx::cp_async_wait<0>();
    __syncthreads();  // block n has landed, and every warp is done with block n - 1
    if (n + 1 < n_blocks) load_keys(n + 1, stage ^ 1);
    ptx::cp_async_commit();

    const uint32_t k_addr = sK_addr + stage * kStageBytes, v_addr = sV_addr + stage * kStageBytes;
    float s[kMTiles][kSTiles][4] = {}, dpv[kMTiles][kSTiles][4] = {};
    const uint32_t a_row = warp_m * kMTiles * 16 * kRowStride * 2;
    const uint32_t b_row = warp_n * kSTiles * 8 * kRowStride * 2;
    warp_mma<Element, kMTiles, kHeadDim / 16, kSTiles, false, kRowStride, false, kRowStride>(
        s, sQ_addr + a_row + q_lane, k_addr + b_row + k_lane);
    warp_mma<Element, kMTiles, kHeadDim / 16, kSTiles, false, kRowStride, false, kRowStride>(
        dpv, sdO_addr + a_row + q_lane, v_addr + b_row + k_lane);

    TileContext tc;
    tc.b = b;
    tc.h = h;
    tc.m0 = m0;
    tc.j0 = j0;
    tc.seqlen_q = seq.seqlen_q;
    tc.seqlen_k = seq.seqlen_k;
    tc.needs_mask = !block_fully_visible(m0, m0 + rows_here, j0, j0 + kBlockN, seq.seqlen_q,
                                         seq.seqlen_k, p.window_left, p.window_right);
    tc.slope = slope;
    probabilities_and_ds<Cfg, false, kGeneral>(kp, tc, s, dpv, sLse, sD, nullptr, sdS,
                                     warp_m * kMTiles * 16, warp_n * kSTiles * 8, lane);
    __syncthreads();  // dS is in shared memory

    warp_mma<Element, kMTiles, kBlockN / 16, kQTiles, false, kPStride, true, kRowStride>(
        dq, sdS_addr + warp_m * kMTiles * 16 * kPStride * 2 + p_lane,
        k_addr + warp_n * kQTiles * 8 * 2 + q_lane);
  }

  // dq = softmax_scale dS K in the storage dtype (0 for rows that see no key).
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t i = m0 + (warp_m * kMTiles + mt) * 16 + lane / 4 + r * 8;
    if (i >= seq.seqlen_q) continue;
    Element* dq_row = static_cast<Element*>(bp.dq) + b * bp.dq_batch_stride +
                      (seq.q_row0 + i) * bp.dq_row_stride + h * bp.dq_head_stride;
#pragma unroll
    for (int t = 0; t < kQTiles; ++t) {
      const int col = (warp_n * kQTiles + t) * 8 + (lane % 4) * 2;
      if (col < p.head_dim)
        *reinterpret_cast<uint32_t*>(dq_row + col) = ptx::pack2<Element>(
            dq[mt][t][2 * r] * p.softmax_scale, dq[mt][t][2 * r + 1] * p.softmax_scale);
    }
  }
}

// Launches the key-parallel kernel (and, in deterministic mode, the dQ kernel) for one
// (dtype, head-dim bucket) configuration. The workspace is ready (D computed, the dQ
// accumulator zeroed) before the first launch.
template <typename Cfg>
void launch_backward(const BackwardKernelParams& kp) {
  const ForwardParams& p = kp.bp.fwd;
  const cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  // Shared-memory opt-in, once per device: the key-parallel kernel with room for sm_90's dQ
  // staging where the device allows it (staging_allowed), without it otherwise.
  static PerDevice<bool> staging_allowed_on;
  const bool staging_allowed = staging_allowed_on.get([] {
    bool allowed = Cfg::kBulkDqPossible;
    for (const auto kernel : {backward_dkdv_kernel<Cfg, false>, backward_dkdv_kernel<Cfg, true>}) {
      if (allowed && cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          Cfg::kDkdvSharedBytes + Cfg::kDqStagingBytes) != cudaSuccess) {
        cudaGetLastError();
        allowed = false;
      }
      if (!allowed) allow_shared_bytes(kernel, Cfg::kDkdvSharedBytes);
    }
    if (!allowed) allow_shared_bytes(backward_dkdv_kernel<Cfg, false>, Cfg::kDkdvSharedBytes);
    allow_shared_bytes(backward_dq_kernel<Cfg, false>, Cfg::kDqSharedBytes);
    allow_shared_bytes(backward_dq_kernel<Cfg, true>, Cfg::kDqSharedBytes);
    return allowed;
  });
  // dQ by bulk reductions (the key-parallel kernel) where its loaded code has them (compiled
  // for sm_90 and newer: kernel_code.cuh) and the staging fits the device's limit as the
  // launchers see it (FLASHATTN_CUDA_SMEM_LIMIT can lower it).
  // FLASHATTN_CUDA_DQ_ATOMICS=1 keeps the atomics, so that an sm_90 test run covers the path
  // older GPUs take.
  BackwardKernelParams run = kp;
  static PerDevice<bool> bulk_code_on;
  const bool bulk_code = bulk_code_on.get([] {
    return kernel_ptx_version(backward_dkdv_kernel<Cfg, false>) >= 90 &&
           kernel_ptx_version(backward_dkdv_kernel<Cfg, true>) >= 90;
  });
  run.bulk_dq = staging_allowed && !kp.bp.deterministic && bulk_code &&
                Cfg::kDkdvSharedBytes + Cfg::kDqStagingBytes <= shared_bytes_per_block_limit() &&
                !knobs::dq_atomics_forced();
  const int dkdv_bytes = Cfg::kDkdvSharedBytes + (run.bulk_dq ? Cfg::kDqStagingBytes : 0);
  const bool general = p.softcap > 0.0f || p.alibi_slopes != nullptr || kp.has_dropout;
  const auto dkdv_kernel = general ? backward_dkdv_kernel<Cfg, true> : backward_dkdv_kernel<Cfg, false>;
  const auto dq_kernel = general ? backward_dq_kernel<Cfg, true> : backward_dq_kernel<Cfg, false>;
  const bool heads_first = blocks_work_differs(p.window_left, p.window_right);
  if (p.seqlen_k > 0) {
    const dim3 grid = attention_grid((p.seqlen_k + Cfg::kBlockN - 1) / Cfg::kBlockN, p.heads_k, p.batch,
                                     heads_first);
    dkdv_kernel<<<grid, Cfg::kThreads, dkdv_bytes, stream>>>(run);
  }
  if (kp.bp.deterministic && p.seqlen_q > 0) {
    const dim3 grid = attention_grid((p.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM, p.heads, p.batch,
                                     heads_first);
    dq_kernel<<<grid, Cfg::kThreads, Cfg::kDqSharedBytes, stream>>>(kp);
  }
}

}  // namespace flashattn::detail::cuda::sm80

// The sm90 (Hopper) backward's key-parallel kernel: dK, dV and the dQ accumulation with
// warpgroup MMAs (wgmma). The same algorithm as the sm80 kernel (sm80/backward_kernel.cuh
// says it in full): P is recomputed from the forward's lse, dK and dV stay in registers for
// the whole CTA, dQ goes to the fp32 accumulator with atomics; the preprocess (D) and the dQ
// conversion are backward.cu's.
//
// A CTA owns kBlockN = 128 keys of one (batch, kv head), 64 per warpgroup, and walks the
// 64-row query blocks of every query head of its GQA group that see them. Per step, each
// warpgroup computes its keys' part transposed (keys are wgmma's M):
//
//   S^T  = K Q^T       wgmma, K and Q from shared memory (both K-major)
//   dP^T = V dO^T      wgmma, likewise
//   P^T = 2^(S^T c - lse), dS^T = P^T o (dP^T - D)      in registers (lse, D per column)
//   dV += P^T dO       wgmma, P^T from registers, dO read MN-major
//   dK += dS^T Q       wgmma, dS^T from registers, Q read MN-major
//   dQ += dS K         wgmma over both warpgroups' keys, dS^T through shared memory (read
//                      MN-major as A), K MN-major as B; warpgroup g takes half g of the head
//                      dim and adds it to the accumulator with vector atomics.
//
// At head dim 256 dK and dV of 64 keys do not fit one warpgroup's registers: there both
// warpgroups take the same 64 keys and split the head dim instead (BackwardSplitConfig,
// backward_dkdv_split_kernel below).
//
// The Hopper backward covers the plain call (no softcap, ALiBi or dropout), head-dim buckets
// 64, 128 and 256, and the default (atomic dQ) mode; other calls take the sm80 kernels.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common/mask.hpp"
#include "common/params.hpp"
#include "cuda/common/kernel_code.cuh"
#include "cuda/common/per_device.hpp"
#include "cuda/common/ptx.cuh"
#include "cuda/common/tile_order.cuh"
#include "cuda/common/wgmma.cuh"
#include "cuda/sm80/backward_kernel.cuh"  // BackwardKernelParams, row_index
#include "cuda/sm90/swizzled_tile.cuh"
#include "cuda/devices.hpp"

namespace flashattn::detail::cuda::sm90 {

using sm80::BackwardKernelParams;

// Head-dim buckets 64 and 128: the keys split between the warpgroups (64 each), each keeping
// dK and dV of its keys whole.
template <typename Element_, int kHeadDim_>
struct BackwardConfig {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;  // 64 or 128
  static constexpr int kBlockN = 128;         // keys per CTA: 64 per warpgroup
  static constexpr int kBlockM = 64;          // query rows per step
  static constexpr int kThreads = 256;
  static constexpr int kChunksPerRow = kHeadDim / 8;
  static constexpr int kKBytes = kBlockN * kHeadDim * 2;  // K or V
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;  // Q or dO, per stage
  static constexpr int kDsBytes = kBlockN * kBlockM * 2;  // dS^T: [key][row], one 128-byte panel
  static constexpr int kStatBytes = kBlockM * 4;          // lse or D, per stage
  // K, V; Q and dO in two stages; dS^T; lse and D in two stages; 1 KiB to align the base.
  static constexpr int kSharedBytes = 1024 + 2 * kKBytes + 4 * kQBytes + kDsBytes + 4 * kStatBytes;
  static constexpr bool kSplitHeadDim = false;
  static_assert(kHeadDim == 64 || kHeadDim == 128, "head-dim buckets 64 and 128");
  static_assert(sizeof(Element) == 2, "16-bit elements");
};

// Head-dim bucket 256, where dK and dV of 64 keys whole (128 fp32 registers per thread each)
// do not fit one warpgroup: both warpgroups take the same 64 keys and split the head dim, each
// keeping its half of dK and dV (and computing its half of dQ). For S^T, dP^T, P^T and dS^T
// they split the step's 64 query rows instead (32 each) and meet through shared memory (P^T
// and dS^T, 16-bit, as the dV / dK / dQ wgmmas read them).
template <typename Element_>
struct BackwardSplitConfig {
  using Element = Element_;
  static constexpr int kHeadDim = 256;
  static constexpr int kHalf = kHeadDim / 2;  // head-dim columns per warpgroup
  static constexpr int kRowsPerWarpgroup = 32;  // query rows of S^T, dP^T per warpgroup
  static constexpr int kBlockN = 64;          // keys per CTA, both warpgroups'
  static constexpr int kBlockM = 64;          // query rows per step
  static constexpr int kThreads = 256;
  static constexpr int kChunksPerRow = kHeadDim / 8;
  static constexpr int kKBytes = kBlockN * kHeadDim * 2;    // K or V
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;    // Q or dO, per stage
  static constexpr int kTileBytes = kBlockN * kBlockM * 2;  // P^T or dS^T: one 128-byte panel
  static constexpr int kStatBytes = kBlockM * 4;            // lse or D, per stage
  // K, V; Q, dO, lse and D in two stages; P^T, dS^T; 1 KiB to align the base: 210 KiB.
  static constexpr int kSharedBytes = 1024 + 2 * kKBytes + 2 * (2 * kQBytes + 2 * kStatBytes) + 2 * kTileBytes;
  static constexpr bool kSplitHeadDim = true;
  static_assert(sizeof(Element) == 2, "16-bit elements");
};

// The configuration of a head-dim bucket (64, 128 or 256).
template <typename Element, int kHeadDim>
using BackwardConfigFor =
    std::conditional_t<kHeadDim == 256, BackwardSplitConfig<Element>, BackwardConfig<Element, kHeadDim>>;

// The CTA's key block and the query steps that visit it (one per query block that sees the
// keys, for each query head of the GQA group), from the grid position (tile_order.cuh:
// heavier key blocks first).
struct BackwardBlock {
  int hk, b;
  SequenceView seq;
  int64_t stored_k;   // keys written (past seqused_k too, with zeros)
  int64_t j0;         // first key
  int64_t keys_here;  // keys of the block within the sequence
  int64_t m_first;    // first query block that sees them
  int m_blocks, group, steps;
  KeyRange full_steps;  // the blocks (m_index) that see every key whole: no mask there

  // A step's query head and block (m_first + m_index): the steps walk the blocks of a head, then
  // the next head, kept as counters (no division per step).
  struct Step {
    int head, m_index;
  };
  __device__ Step first_step() const { return {hk * group, 0}; }
  __device__ Step next(Step s) const { return s.m_index + 1 == m_blocks ? Step{s.head + 1, 0} : Step{s.head, s.m_index + 1}; }
  template <int kBlockM>
  __device__ int64_t first_row(Step s) const {
    return (m_first + s.m_index) * kBlockM;
  }
  __device__ bool needs_mask(Step s) const { return s.m_index < full_steps.begin || s.m_index >= full_steps.end; }
};

template <int kBlockN, int kBlockM>
__device__ __forceinline__ BackwardBlock backward_block(const ForwardParams& p) {
  BackwardBlock blk;
  const int n_block = tile_rank(p.heads_k);
  blk.hk = tile_head(p.heads_k);
  blk.b = tile_batch();
  blk.seq = sequence_view(p, blk.b);
  const SequenceView& seq = blk.seq;
  blk.stored_k = seq.rows_k;
  blk.j0 = int64_t{n_block} * kBlockN;
  const int64_t left = seq.seqlen_k - blk.j0;
  blk.keys_here = left < 0 ? 0 : (left < kBlockN ? left : kBlockN);
  blk.m_first = 0;
  blk.m_blocks = 0;
  if (blk.keys_here > 0 && seq.seqlen_q > 0) {
    const KeyRange rows = rows_seeing_keys(blk.j0, blk.j0 + blk.keys_here, seq.seqlen_q, seq.seqlen_k,
                                           p.window_left, p.window_right);
    if (!rows.empty()) {
      blk.m_first = rows.begin / kBlockM;
      blk.m_blocks = static_cast<int>((rows.end + kBlockM - 1) / kBlockM - blk.m_first);
    }
  }
  blk.group = p.group_size();
  blk.steps = blk.group * blk.m_blocks;
  blk.full_steps = fully_visible_row_blocks(blk.m_first * kBlockM, kBlockM, blk.m_blocks, blk.j0, blk.j0 + kBlockN,
                                            seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right);
  return blk;
}

// Where a step's rows start: Q and dO at its first query row (this CTA's batch, the step's
// head), and that row's index in the lse-shaped buffers (lse, D, the dQ accumulator, whose rows
// of one head are consecutive). Within a head the next step's are one block further (adds
// only); at a new head they are computed again.
template <typename Cfg>
struct StepRows {
  using Element = typename Cfg::Element;
  const Element* q;
  const Element* dout;
  int64_t row;  // lse-shaped index of the first row
  int64_t m0;   // the first query row

  __device__ static StepRows of(const BackwardKernelParams& kp, const BackwardBlock& blk, BackwardBlock::Step s) {
    const ForwardParams& p = kp.bp.fwd;
    const BackwardParams& bp = kp.bp;
    StepRows r;
    r.m0 = blk.first_row<Cfg::kBlockM>(s);
    const int64_t q_row = blk.seq.q_row0 + r.m0;
    r.q = static_cast<const Element*>(p.q) + blk.b * p.q_batch_stride + q_row * p.q_row_stride +
          s.head * p.q_head_stride;
    r.dout = static_cast<const Element*>(bp.dout) + blk.b * bp.dout_batch_stride + q_row * bp.dout_row_stride +
             s.head * bp.dout_head_stride;
    r.row = sm80::row_index(p, blk.b, s.head, blk.seq.q_row0, r.m0);
    return r;
  }
  // The rows of `next`, the step after this one.
  __device__ StepRows after(const BackwardKernelParams& kp, const BackwardBlock& blk,
                            BackwardBlock::Step next) const {
    if (next.m_index == 0) return of(kp, blk, next);
    StepRows r = *this;
    r.q += Cfg::kBlockM * kp.bp.fwd.q_row_stride;
    r.dout += Cfg::kBlockM * kp.bp.dout_row_stride;
    r.row += Cfg::kBlockM;
    r.m0 += Cfg::kBlockM;
    return r;
  }
};

// Q, dO, lse and D of a step into one stage (addresses given); rows past the sequence are
// zero-filled (lse and D too).
template <typename Cfg>
__device__ __forceinline__ void load_backward_step(const BackwardKernelParams& kp, const BackwardBlock& blk,
                                                   const StepRows<Cfg>& rows, uint32_t sQ, uint32_t sdO,
                                                   uint32_t sLse, uint32_t sD) {
  constexpr int kBlockM = Cfg::kBlockM;
  const ForwardParams& p = kp.bp.fwd;
  const int64_t rows_left = blk.seq.seqlen_q - rows.m0;
  const int valid_rows = rows_left < kBlockM ? static_cast<int>(rows_left) : kBlockM;
  load_swizzled<Cfg, kBlockM>(sQ, rows.q, p.q_row_stride, valid_rows, p.head_dim);
  load_swizzled<Cfg, kBlockM>(sdO, rows.dout, kp.bp.dout_row_stride, valid_rows, p.head_dim_v);
  if (threadIdx.x < kBlockM) {
    const bool valid = static_cast<int>(threadIdx.x) < valid_rows;
    const int64_t at = valid ? rows.row + threadIdx.x : 0;
    ptx::cp_async_4(sLse + threadIdx.x * 4, p.lse + at, valid);
    ptx::cp_async_4(sD + threadIdx.x * 4, kp.delta + at, valid);
  }
}

// The CTA's K and V (kBlockN keys; keys past the sequence zero-filled).
template <typename Cfg>
__device__ __forceinline__ void load_keys_and_values(const ForwardParams& p, const BackwardBlock& blk, uint32_t sK,
                                                     uint32_t sV) {
  using Element = typename Cfg::Element;
  const int64_t row0 = blk.seq.k_row0 + blk.j0;
  load_swizzled<Cfg, Cfg::kBlockN>(
      sK, static_cast<const Element*>(p.k) + blk.b * p.k_batch_stride + row0 * p.k_row_stride + blk.hk * p.k_head_stride,
      p.k_row_stride, blk.keys_here, p.head_dim);
  load_swizzled<Cfg, Cfg::kBlockN>(
      sV, static_cast<const Element*>(p.v) + blk.b * p.v_batch_stride + row0 * p.v_row_stride + blk.hk * p.v_head_stride,
      p.v_row_stride, blk.keys_here, p.head_dim_v);
}

// P^T in place of S^T (64 keys x kCols query rows, the wgmma accumulator layout; this lane's
// keys key0 and key0 + 8 of the block starting at j0): column c is query row m0 + c, with its
// lse at lse_cols[c] in shared memory (+inf, so that P = 0, for a row that saw no key). Where the step needs the
// mask (BackwardBlock::needs_mask), key j sees the rows rows_seeing_keys(j, j + 1) and keys
// past the sequence see none; elsewhere the loop is the exponentials alone. kLog2Lse: lse_cols
// holds lse log2(e) already, +inf where a row saw no key (the TMA kernel's padded copy).
template <int kCols, bool kLog2Lse = false>
__device__ __forceinline__ void probabilities_from_scores(float (&st)[kCols / 2], const float* lse_cols,
                                                          const BackwardBlock& blk, const ForwardParams& p,
                                                          int64_t m0, int key0, float score_scale,
                                                          bool needs_mask) {
  constexpr float kLog2e = 1.4426950408889634f;
  const int quad_col = (threadIdx.x % 4) * 2;
  float lse2[kCols / 4];  // this lane's columns t * 8 + quad_col + e, scaled to base 2
#pragma unroll
  for (int t = 0; t < kCols / 8; ++t)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float lse = lse_cols[t * 8 + quad_col + e];
      lse2[2 * t + e] = kLog2Lse ? lse : (lse == -INFINITY ? INFINITY : lse * kLog2e);
    }
  if (!needs_mask) {
#pragma unroll
    for (int t = 0; t < kCols / 8; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        st[4 * t + i] = ptx::exp2_approx(fmaf(st[4 * t + i], score_scale, -lse2[2 * t + i % 2]));
    return;
  }
  const SequenceView& seq = blk.seq;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    int lo = 0, hi = 0;  // the block columns key j sees
    const int64_t j = blk.j0 + key0 + r * 8;
    if (j < seq.seqlen_k) {
      const KeyRange rows = rows_seeing_keys(j, j + 1, seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right);
      const int64_t lo64 = rows.begin - m0, hi64 = rows.end - m0;
      lo = lo64 < 0 ? 0 : (lo64 > kCols ? kCols : static_cast<int>(lo64));
      hi = hi64 < 0 ? 0 : (hi64 > kCols ? kCols : static_cast<int>(hi64));
    }
#pragma unroll
    for (int t = 0; t < kCols / 8; ++t)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = t * 8 + quad_col + e;
        const float prob = ptx::exp2_approx(fmaf(st[4 * t + 2 * r + e], score_scale, -lse2[2 * t + e]));
        st[4 * t + 2 * r + e] = c >= lo && c < hi ? prob : 0.0f;
      }
  }
}

// Dropout's keep bits of this lane's scores of key row r (key j = j0 + key0 + 8 r; the
// layout of probabilities_from_scores), bit 2 t + e for column t * 8 + quad_col + e; m0 and j
// are tokens of the whole sequence (moved by Options::positions). One Philox call gives the
// bits of 4 consecutive keys of one query row (common/philox.hpp); in this transposed layout
// those keys belong to the 4 lanes 16 a + 4 m + c (m = 0..3, m = j % 4), so each of them makes
// a quarter of the calls and the words are exchanged by shuffles: 8 calls a step per thread at
// 64 columns, where one per score would be 32. That needs keys j - m .. j - m + 3 to be one
// group: a key position that is a multiple of 4 (cuda/backward.cu sends the others to the
// sm80 kernels; the calls of both groups here made the kernel at head dim 128 spill).
template <int kCols>
__device__ __forceinline__ uint32_t dropout_keep_mask(const DropoutRng& rng, uint32_t b, uint32_t h, uint32_t m0,
                                                      uint32_t j) {
  constexpr int kColumns = kCols / 4;  // this lane's columns: q = 2 t + e
  static_assert(kColumns <= 32, "one bit per column in a word");
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int m = (lane / 4) % 4, quad_col = (lane % 4) * 2;
  const uint32_t group = static_cast<uint32_t>(j / 4);
  uint32_t made = 0;  // nibble k: the call of column q = 4 k + m, bit n for key 4 group + n
  // Two calls at a time (one Philox call is a chain of dependent multiplies, and a scheduler
  // has two consumer warps to interleave); fully unrolled, the h128 kernel spills.
#pragma unroll 2
  for (int k = 0; k < kColumns / 4; ++k) {
    const int q = 4 * k + m;
    const uint32_t i = static_cast<uint32_t>(m0 + (q / 2) * 8 + quad_col + q % 2);
    made |= rng.keep_bits4(b, h, i, group) << (4 * k);
  }
  uint32_t mask = 0;
  const int first_lane = (lane & 16) | (lane & 3);
#pragma unroll
  for (int other = 0; other < 4; ++other) {  // the columns q = 4 k + other, made by lane `other`
    const uint32_t word = __shfl_sync(0xffffffffu, made, first_lane + 4 * other);
#pragma unroll
    for (int k = 0; k < kColumns / 4; ++k) mask |= ((word >> (4 * k + m)) & 1u) << (4 * k + other);
  }
  return mask;
}

// The general variant of the TMA kernel (softcap, ALiBi, dropout), once dP^T is in: S^T (raw
// dot products, the layout of probabilities_from_scores) becomes the kept P^T (P o M / (1 - p),
// what dV takes) in st and dS^T = P^T o (dP^T o M / (1 - p) - D) o g in dpt, where g =
// 1 - tanh^2 with a softcap (the derivative of the capped score by the scaled one; the scale
// itself is applied to dK and dQ at the end), else 1. The scores are those of the forward's
// general path (online_softmax.cuh): x = cap tanh(s scale / cap) or s scale, minus slope
// |i + alibi_diagonal - j| (params.hpp); P = 2^(x log2 e - lse log2 e). The tanh is taken
// here rather than under dP^T's wgmma so that no third array (g) is held across it. d_cols: this lane's D, column
// t * 8 + e at d_cols[t * 8 + e]; keep: dropout's keep bits of this lane's keys key0 and
// key0 + 8 (dropout_keep_mask; all ones without dropout), drawn by the caller while the
// matrix products run; rng: null without dropout.
template <int kCols>
__device__ __forceinline__ void general_probabilities_and_ds(float (&st)[kCols / 2], float (&dpt)[kCols / 2],
                                                             const float* lse_cols, const float* d_cols,
                                                             const BackwardBlock& blk, const ForwardParams& p,
                                                             int64_t m0, int key0, float slope, bool needs_mask,
                                                             const DropoutRng* rng, const uint32_t (&keep)[2]) {
  constexpr float kLog2e = 1.4426950408889634f;
  const int quad_col = (threadIdx.x % 4) * 2;
  const SequenceView& seq = blk.seq;
  const bool softcap = p.softcap > 0.0f;
  // tanh(s scale / cap) = sign(scale) tanh(s |scale| / cap): the sign rides on cap2 (x =
  // cap2 tanh), and 1 - tanh^2 does not see it.
  const float cap2 = softcap ? copysignf(p.softcap * kLog2e, p.softmax_scale) : 0.0f;
  const float tanh_exponent = softcap ? -2.0f * kLog2e * fabsf(p.softmax_scale) / p.softcap : 0.0f;
  const float score_scale = p.softmax_scale * kLog2e;
  const float slope2 = slope * kLog2e;
  const float keep_scale = rng != nullptr ? rng->scale : 1.0f;
  // ALiBi's |i + alibi_diagonal - j| for column c = t * 8 + quad_col + e of key row r:
  // |diagonal0 - 8 r + 8 t + e|, one float held instead of the diagonal's terms.
  const float diagonal0 = static_cast<float>(m0 + quad_col + alibi_diagonal(p, seq) - blk.j0 - key0);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t j = blk.j0 + key0 + r * 8;
    int lo = 0, hi = kCols;  // the block columns key j sees
    if (needs_mask) {
      lo = hi = 0;
      if (j < seq.seqlen_k) {
        const KeyRange rows = rows_seeing_keys(j, j + 1, seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right);
        const int64_t lo64 = rows.begin - m0, hi64 = rows.end - m0;
        lo = lo64 < 0 ? 0 : (lo64 > kCols ? kCols : static_cast<int>(lo64));
        hi = hi64 < 0 ? 0 : (hi64 > kCols ? kCols : static_cast<int>(hi64));
      }
    }
    const float lane_diagonal = diagonal0 - static_cast<float>(8 * r);
#pragma unroll
    for (int t = 0; t < kCols / 8; ++t)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = t * 8 + quad_col + e;
        float& score = st[4 * t + 2 * r + e];
        float x, grad = 1.0f;
        if (softcap) {
          const float th = ptx::tanh_of_scaled(score, tanh_exponent);
          grad = fmaf(-th, th, 1.0f);
          x = cap2 * th;
        } else {
          x = score * score_scale;
        }
        x = fmaf(-slope2, fabsf(lane_diagonal + static_cast<float>(t * 8 + e)), x);
        const float prob = c >= lo && c < hi ? ptx::exp2_approx(x - lse_cols[c]) : 0.0f;
        const bool kept = (keep[r] >> (2 * t + e)) & 1u;
        float& ds = dpt[4 * t + 2 * r + e];
        ds = prob * ((kept ? ds * keep_scale : 0.0f) - d_cols[t * 8 + e]) * grad;
        score = kept ? prob * keep_scale : 0.0f;
      }
  }
}

// A 64-row dQ tile of this warpgroup (kCols columns from col0, the accumulator layout) into the
// fp32 accumulator with vector atomics, its first row at lse-shaped index `row` (query row m0);
// rows past the sequence are skipped.
template <int kCols>
__device__ __forceinline__ void add_to_dq_accumulator(const BackwardKernelParams& kp, const BackwardBlock& blk,
                                                      int64_t row, int64_t m0, int col0, int accum_dim,
                                                      const float (&dq)[kCols / 2]) {
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = warp * 16 + lane / 4 + r * 8;
    if (m0 + i >= blk.seq.seqlen_q) continue;
    float* acc = kp.dq_accum + (row + i) * accum_dim + col0 + (lane % 4) * 2;
#pragma unroll
    for (int t = 0; t < kCols / 8; ++t) ptx::atomic_add_f32x2(acc + t * 8, dq[4 * t + 2 * r], dq[4 * t + 2 * r + 1]);
  }
}

// dK = softmax_scale dS^T Q and dV of this lane's keys key0 and key0 + 8 (kCols columns from
// col0, the accumulator layout), in the storage dtype; keys past stored_k are not the block's.
template <typename Element, int kCols>
__device__ __forceinline__ void store_dk_dv(const BackwardKernelParams& kp, const BackwardBlock& blk, int key0,
                                            int col0, int64_t keys_out, const float (&dk)[kCols / 2],
                                            const float (&dv)[kCols / 2]) {
  const BackwardParams& bp = kp.bp;
  const ForwardParams& p = bp.fwd;
  const int quad_col = (threadIdx.x % 4) * 2;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = key0 + r * 8;
    if (key >= keys_out) continue;
    const int64_t row = blk.seq.k_row0 + blk.j0 + key;
    Element* dk_row = static_cast<Element*>(bp.dk) + blk.b * bp.dk_batch_stride + row * bp.dk_row_stride +
                      blk.hk * bp.dk_head_stride;
    Element* dv_row = static_cast<Element*>(bp.dv) + blk.b * bp.dv_batch_stride + row * bp.dv_row_stride +
                      blk.hk * bp.dv_head_stride;
#pragma unroll
    for (int t = 0; t < kCols / 8; ++t) {
      const int col = col0 + t * 8 + quad_col;
      if (col < p.head_dim)
        *reinterpret_cast<uint32_t*>(dk_row + col) =
            ptx::pack2<Element>(dk[4 * t + 2 * r] * p.softmax_scale, dk[4 * t + 2 * r + 1] * p.softmax_scale);
      if (col < p.head_dim_v)
        *reinterpret_cast<uint32_t*>(dv_row + col) = ptx::pack2<Element>(dv[4 * t + 2 * r], dv[4 * t + 2 * r + 1]);
    }
  }
}

// Start of k-step kk (16 columns) in a K-major swizzled tile of `rows` rows: panel kk / 4, then
// 32 bytes per step within the 128-byte row (descriptor units of 16 bytes).
__device__ __forceinline__ uint64_t panel_step(int kk, int rows) {
  return static_cast<uint64_t>(((kk / 4) * rows * 128 + (kk % 4) * 32) >> 4);
}
constexpr uint64_t kRows16 = (16 * 128) >> 4;  // 16 rows further in an MN-major operand

template <typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    backward_dkdv_kernel(const __grid_constant__ BackwardKernelParams kp) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Element = typename Cfg::Element;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHeadDim = Cfg::kHeadDim;
  using TMma = ptx::Wgmma<Element, kBlockM>;        // S^T, dP^T: 64 keys x 64 rows
  using KvMma = ptx::Wgmma<Element, kHeadDim>;      // dV, dK: 64 keys x head dim
  using QMma = ptx::Wgmma<Element, kHeadDim / 2>;   // dQ: 64 rows x half the head dim
  constexpr int kTTiles = kBlockM / 8;
  constexpr float kLog2e = 1.4426950408889634f;
  const ForwardParams& p = kp.bp.fwd;

  extern __shared__ __align__(16) unsigned char shared_raw[];
  const uint32_t sK = (ptx::shared_address(shared_raw) + 1023) & ~1023u;
  const uint32_t sV = sK + Cfg::kKBytes;
  const uint32_t sQ = sV + Cfg::kKBytes;           // two stages
  const uint32_t sdO = sQ + 2 * Cfg::kQBytes;      // two stages
  const uint32_t sdS = sdO + 2 * Cfg::kQBytes;
  const uint32_t sLse = sdS + Cfg::kDsBytes;       // two stages
  const uint32_t sD = sLse + 2 * Cfg::kStatBytes;  // two stages
  const float* lse_smem = reinterpret_cast<const float*>(shared_raw + (sLse - ptx::shared_address(shared_raw)));
  const float* d_smem = reinterpret_cast<const float*>(shared_raw + (sD - ptx::shared_address(shared_raw)));

  const BackwardBlock blk = backward_block<kBlockN, kBlockM>(p);
  if (blk.j0 >= blk.stored_k) return;
  const int steps = blk.steps;
  const auto load_step = [&](const StepRows<Cfg>& rows, int stage) {
    load_backward_step<Cfg>(kp, blk, rows, sQ + stage * Cfg::kQBytes, sdO + stage * Cfg::kQBytes,
                            sLse + stage * Cfg::kStatBytes, sD + stage * Cfg::kStatBytes);
  };

  const int warpgroup = threadIdx.x / 128;
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int quad_col = (lane % 4) * 2;
  // This lane's first key within the CTA (the accumulator rows of S^T, dP^T, dK, dV): the
  // other is 8 further.
  const int key0 = warpgroup * 64 + warp * 16 + lane / 4;

  // Descriptors (addresses in 16-byte units; a k-step or a stage moves the start only).
  // K and V as the A operand of S^T / dP^T: this warpgroup's 64 rows, K-major.
  const uint64_t k_a = ptx::wgmma_descriptor(sK + warpgroup * 64 * 128, 16, 1024);
  const uint64_t v_a = ptx::wgmma_descriptor(sV + warpgroup * 64 * 128, 16, 1024);
  // Q and dO as the B operand of S^T / dP^T (K-major), and of dK / dV (MN-major: rows are k).
  const uint64_t q_b = ptx::wgmma_descriptor(sQ, 16, 1024), do_b = ptx::wgmma_descriptor(sdO, 16, 1024);
  const uint64_t q_mn = ptx::wgmma_descriptor(sQ, kBlockM * 128, 1024);
  const uint64_t do_mn = ptx::wgmma_descriptor(sdO, kBlockM * 128, 1024);
  // dS^T as the A operand of dQ (MN-major: its 64 rows are one 128-byte row per key), and K as
  // its B operand (MN-major), from column warpgroup * kHeadDim / 2 on.
  const uint64_t ds_a = ptx::wgmma_descriptor(sdS, 1024, 1024);
  const uint64_t k_mn = ptx::wgmma_descriptor(
      sK + (warpgroup * (kHeadDim / 2)) / 64 * kBlockN * 128 + (warpgroup * (kHeadDim / 2)) % 64 * 2, kBlockN * 128,
      1024);

  float dk[kHeadDim / 2] = {}, dv[kHeadDim / 2] = {};
  float st[kBlockM / 2] = {}, dpt[kBlockM / 2] = {};
  float dq[kHeadDim / 4] = {};
  uint32_t pf[kBlockM / 16][4] = {}, dsf[kBlockM / 16][4] = {};
  const float score_scale = p.softmax_scale * kLog2e;

  if (steps > 0) {
    load_keys_and_values<Cfg>(p, blk, sK, sV);
    load_step(StepRows<Cfg>::of(kp, blk, blk.first_step()), 0);
  }
  ptx::cp_async_commit();

  BackwardBlock::Step step = blk.first_step();
  StepRows<Cfg> rows = StepRows<Cfg>::of(kp, blk, step);
  for (int it = 0; it < steps; ++it) {
    const int stage = it & 1;
    const int64_t m0 = rows.m0;
    const BackwardBlock::Step next = blk.next(step);
    ptx::cp_async_wait<0>();
    // The copies went through the generic proxy, the wgmmas read through the async proxy; the
    // barrier also tells that every warpgroup is done with step it - 1 (its dQ read dS^T).
    ptx::fence_proxy_async_shared();
    __syncthreads();
    if (it + 1 < steps) load_step(rows.after(kp, blk, next), stage ^ 1);
    ptx::cp_async_commit();

    // S^T = K Q^T and dP^T = V dO^T for this warpgroup's 64 keys x the block's 64 rows, in two
    // commit groups: P is computed (and dV issued) while dP^T is still in the tensor cores.
    const uint64_t q_stage = q_b + ((stage * Cfg::kQBytes) >> 4), do_stage = do_b + ((stage * Cfg::kQBytes) >> 4);
    ptx::wgmma_hold(st);
    ptx::wgmma_hold(dpt);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk)
      TMma::ss(st, k_a + panel_step(kk, kBlockN), q_stage + panel_step(kk, kBlockM), kk > 0);
    ptx::wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk)
      TMma::ss(dpt, v_a + panel_step(kk, kBlockN), do_stage + panel_step(kk, kBlockM), kk > 0);
    ptx::wgmma_commit();
    ptx::wgmma_wait<1>();  // S^T
    ptx::wgmma_hold(st);

    probabilities_from_scores<kBlockM>(st, lse_smem + stage * kBlockM, blk, p, m0, key0, score_scale,
                                       blk.needs_mask(step));
    // P^T as A fragments (16 rows of the block each), then dV += P^T dO.
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk)
#pragma unroll
      for (int i = 0; i < 4; ++i) pf[kk][i] = ptx::pack2<Element>(st[8 * kk + 2 * i], st[8 * kk + 2 * i + 1]);
    const uint64_t do_stage_mn = do_mn + ((stage * Cfg::kQBytes) >> 4);
    const uint64_t q_stage_mn = q_mn + ((stage * Cfg::kQBytes) >> 4);
    ptx::wgmma_hold(dv);
    ptx::wgmma_hold(pf);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) KvMma::rs(dv, pf[kk], do_stage_mn + kk * kRows16);
    ptx::wgmma_commit();

    // dS^T = P^T o (dP^T - D), D per column; into A fragments and, for dQ, shared memory.
    ptx::wgmma_wait<1>();  // dP^T
    ptx::wgmma_hold(dpt);
    const float* d_stage = d_smem + stage * kBlockM;
#pragma unroll
    for (int t = 0; t < kTTiles; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) dpt[4 * t + i] = st[4 * t + i] * (dpt[4 * t + i] - d_stage[t * 8 + quad_col + i % 2]);
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk)
#pragma unroll
      for (int i = 0; i < 4; ++i) dsf[kk][i] = ptx::pack2<Element>(dpt[8 * kk + 2 * i], dpt[8 * kk + 2 * i + 1]);
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int t = 0; t < kTTiles; ++t)
        ptx::st_shared_32(sdS + swizzled_offset<kBlockN>(key0 + r * 8, t * 8) + quad_col * 2,
                          dsf[t / 2][(t % 2) * 2 + r]);
    ptx::fence_proxy_async_shared();
    __syncthreads();  // both warpgroups' dS^T are in shared memory

    // dQ (64 rows x this warpgroup's half of the head dim) = dS K over all 128 keys, then
    // dK += dS^T Q in a second group: dQ's atomics are issued while dK is in the tensor cores.
    ptx::wgmma_hold(dq);
    ptx::wgmma_hold(dk);
    ptx::wgmma_hold(dsf);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) QMma::ss_mn(dq, ds_a + kk * kRows16, k_mn + kk * kRows16, kk > 0);
    ptx::wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) KvMma::rs(dk, dsf[kk], q_stage_mn + kk * kRows16);
    ptx::wgmma_commit();
    ptx::wgmma_wait<1>();  // dV and dQ
    ptx::wgmma_hold(dq);
    // Accumulator rows are the bucket wide (kHeadDim floats).
    add_to_dq_accumulator<kHeadDim / 2>(kp, blk, rows.row, m0, warpgroup * (kHeadDim / 2), kHeadDim, dq);
    ptx::wgmma_wait<0>();
    ptx::wgmma_hold(dv);
    ptx::wgmma_hold(dk);
    ptx::wgmma_hold(pf);
    ptx::wgmma_hold(dsf);
    rows = rows.after(kp, blk, next);  // adds again, rather than registers held through the step
    step = next;
  }

  const int64_t keys_out = blk.stored_k - blk.j0 < kBlockN ? blk.stored_k - blk.j0 : kBlockN;
  store_dk_dv<Element, kHeadDim>(kp, blk, key0, 0, keys_out, dk, dv);
#else
  __trap();  // compiled for sm_90a only; the host launches it only where that code is loaded
#endif
}

// The head-dim-256 kernel (BackwardSplitConfig). Per step of 64 query rows, warpgroup g:
//   S^T and dP^T for the 64 keys x its 32 rows (32 g ..), then P^T and dS^T = P^T o (dP^T - D)
//   in registers, both to shared memory (16-bit);
//   after a barrier, for its half of the head dim: dV += P^T dO, dK += dS^T Q (P^T and dS^T
//   K-major from shared memory), dQ = dS K (dS^T read MN-major), added to the accumulator with
//   atomics.
template <typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    backward_dkdv_split_kernel(const __grid_constant__ BackwardKernelParams kp) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Element = typename Cfg::Element;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHeadDim = Cfg::kHeadDim, kHalf = Cfg::kHalf;
  constexpr int kCols = Cfg::kRowsPerWarpgroup;
  using ColMma = ptx::Wgmma<Element, kCols>;   // S^T, dP^T: 64 keys x 32 query rows
  using HalfMma = ptx::Wgmma<Element, kHalf>;  // dV, dK: 64 keys x half; dQ: 64 rows x half
  constexpr float kLog2e = 1.4426950408889634f;
  const ForwardParams& p = kp.bp.fwd;

  extern __shared__ __align__(16) unsigned char shared_raw[];
  const uint32_t shared_base = ptx::shared_address(shared_raw);
  const uint32_t sK = (shared_base + 1023) & ~1023u;
  const uint32_t sV = sK + Cfg::kKBytes;
  const uint32_t sQ = sV + Cfg::kKBytes;           // two stages
  const uint32_t sdO = sQ + 2 * Cfg::kQBytes;      // two stages
  const uint32_t sP = sdO + 2 * Cfg::kQBytes;      // P^T, 16-bit: [key][row]
  const uint32_t sdS = sP + Cfg::kTileBytes;       // dS^T, 16-bit: [key][row]
  const uint32_t sLse = sdS + Cfg::kTileBytes;     // two stages
  const uint32_t sD = sLse + 2 * Cfg::kStatBytes;  // two stages
  const float* lse_smem = reinterpret_cast<const float*>(shared_raw + (sLse - shared_base));
  const float* d_smem = reinterpret_cast<const float*>(shared_raw + (sD - shared_base));

  const BackwardBlock blk = backward_block<kBlockN, kBlockM>(p);
  if (blk.j0 >= blk.stored_k) return;
  const int steps = blk.steps;
  const auto load_step = [&](const StepRows<Cfg>& rows, int stage) {
    load_backward_step<Cfg>(kp, blk, rows, sQ + stage * Cfg::kQBytes, sdO + stage * Cfg::kQBytes,
                            sLse + stage * Cfg::kStatBytes, sD + stage * Cfg::kStatBytes);
  };

  const int warpgroup = threadIdx.x / 128;
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int quad_col = (lane % 4) * 2;
  const int key0 = warp * 16 + lane / 4;   // this lane's first key (and key0 + 8) in the block
  const int col0 = warpgroup * kHalf;      // this warpgroup's half of the head dim
  const int row0 = warpgroup * kCols;      // and its query rows of the step, for S^T and dP^T

  // Descriptors (addresses in 16-byte units; a k-step or a stage moves the start only).
  // S^T and dP^T: K and V as A, this warpgroup's 32 rows of Q and dO as B, all K-major.
  const uint64_t k_a = ptx::wgmma_descriptor(sK, 16, 1024), v_a = ptx::wgmma_descriptor(sV, 16, 1024);
  const uint64_t q_b = ptx::wgmma_descriptor(sQ + row0 * 128, 16, 1024);
  const uint64_t do_b = ptx::wgmma_descriptor(sdO + row0 * 128, 16, 1024);
  // dV and dK: P^T and dS^T as A (K-major, one panel), dO and Q as B (MN-major: rows are k),
  // from this warpgroup's first panel on.
  const uint64_t p_a = ptx::wgmma_descriptor(sP, 16, 1024);
  const uint64_t ds_a = ptx::wgmma_descriptor(sdS, 16, 1024);
  const uint64_t do_mn = ptx::wgmma_descriptor(sdO + col0 / 64 * kBlockM * 128, kBlockM * 128, 1024);
  const uint64_t q_mn = ptx::wgmma_descriptor(sQ + col0 / 64 * kBlockM * 128, kBlockM * 128, 1024);
  // dQ: dS^T as A read MN-major (dS), K as B (MN-major: keys are k) from this half on.
  const uint64_t ds_mn = ptx::wgmma_descriptor(sdS, 1024, 1024);
  const uint64_t k_mn = ptx::wgmma_descriptor(sK + col0 / 64 * kBlockN * 128, kBlockN * 128, 1024);

  float dk[kHalf / 2] = {}, dv[kHalf / 2] = {}, dq[kHalf / 2] = {};
  float st[kCols / 2] = {}, dpt[kCols / 2] = {};
  const float score_scale = p.softmax_scale * kLog2e;

  if (steps > 0) {
    load_keys_and_values<Cfg>(p, blk, sK, sV);
    load_step(StepRows<Cfg>::of(kp, blk, blk.first_step()), 0);
  }
  ptx::cp_async_commit();

  BackwardBlock::Step step = blk.first_step();
  StepRows<Cfg> rows = StepRows<Cfg>::of(kp, blk, step);
  for (int it = 0; it < steps; ++it) {
    const int stage = it & 1;
    const int64_t m0 = rows.m0;
    const BackwardBlock::Step next = blk.next(step);
    const uint64_t stage_offset = (stage * Cfg::kQBytes) >> 4;
    ptx::cp_async_wait<0>();
    // Copies (generic proxy) before wgmma reads (async proxy); the barrier also tells that
    // step it - 1 is done everywhere (its wgmmas were waited for: P^T, dS^T and the stage read).
    ptx::fence_proxy_async_shared();
    __syncthreads();
    if (it + 1 < steps) load_step(rows.after(kp, blk, next), stage ^ 1);
    ptx::cp_async_commit();

    // S^T and dP^T in two commit groups: P^T is computed while dP^T runs.
    ptx::wgmma_hold(st);
    ptx::wgmma_hold(dpt);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk)
      ColMma::ss(st, k_a + panel_step(kk, kBlockN), q_b + stage_offset + panel_step(kk, kBlockM), kk > 0);
    ptx::wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk)
      ColMma::ss(dpt, v_a + panel_step(kk, kBlockN), do_b + stage_offset + panel_step(kk, kBlockM), kk > 0);
    ptx::wgmma_commit();
    ptx::wgmma_wait<1>();  // S^T
    ptx::wgmma_hold(st);
    probabilities_from_scores<kCols>(st, lse_smem + stage * kBlockM + row0, blk, p, m0 + row0, key0, score_scale,
                                     blk.needs_mask(step));
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int t = 0; t < kCols / 8; ++t)
        ptx::st_shared_32(sP + swizzled_offset<kBlockN>(key0 + r * 8, row0 + t * 8) + quad_col * 2,
                          ptx::pack2<Element>(st[4 * t + 2 * r], st[4 * t + 2 * r + 1]));

    // dS^T = P^T o (dP^T - D), D per column.
    ptx::wgmma_wait<0>();  // dP^T
    ptx::wgmma_hold(dpt);
    const float* d_cols = d_smem + stage * kBlockM + row0;
#pragma unroll
    for (int t = 0; t < kCols / 8; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) dpt[4 * t + i] = st[4 * t + i] * (dpt[4 * t + i] - d_cols[t * 8 + quad_col + i % 2]);
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int t = 0; t < kCols / 8; ++t)
        ptx::st_shared_32(sdS + swizzled_offset<kBlockN>(key0 + r * 8, row0 + t * 8) + quad_col * 2,
                          ptx::pack2<Element>(dpt[4 * t + 2 * r], dpt[4 * t + 2 * r + 1]));
    ptx::fence_proxy_async_shared();
    __syncthreads();  // both warpgroups' P^T and dS^T are in shared memory

    // dQ = dS K first, then dV += P^T dO and dK += dS^T Q in a second group, this half of the
    // head dim: dQ's atomics are issued while dV and dK are in the tensor cores.
    ptx::wgmma_hold(dv);
    ptx::wgmma_hold(dk);
    ptx::wgmma_hold(dq);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) HalfMma::ss_mn(dq, ds_mn + kk * kRows16, k_mn + kk * kRows16, kk > 0);
    ptx::wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk)
      HalfMma::ss_kmn(dv, p_a + ((kk * 32) >> 4), do_mn + stage_offset + kk * kRows16, 1);
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk)
      HalfMma::ss_kmn(dk, ds_a + ((kk * 32) >> 4), q_mn + stage_offset + kk * kRows16, 1);
    ptx::wgmma_commit();
    ptx::wgmma_wait<1>();  // dQ
    ptx::wgmma_hold(dq);
    add_to_dq_accumulator<kHalf>(kp, blk, rows.row, m0, col0, kHeadDim, dq);
    ptx::wgmma_wait<0>();
    ptx::wgmma_hold(dk);
    ptx::wgmma_hold(dv);
    rows = rows.after(kp, blk, next);  // adds again, rather than registers held through the step
    step = next;
  }

  const int64_t keys_out = blk.stored_k - blk.j0 < kBlockN ? blk.stored_k - blk.j0 : kBlockN;
  store_dk_dv<Element, kHalf>(kp, blk, key0, col0, keys_out, dk, dv);
#else
  __trap();  // compiled for sm_90a only; the host launches it only where that code is loaded
#endif
}

// The kernel of a configuration.
template <typename Cfg>
constexpr auto backward_kernel_of() {
  if constexpr (Cfg::kSplitHeadDim)
    return backward_dkdv_split_kernel<Cfg>;
  else
    return backward_dkdv_kernel<Cfg>;
}

// Whether the kernel for Cfg can run here (its sm_90a code loaded, its shared memory fits).
template <typename Cfg>
bool backward_runs_here() {
  // The loaded code once per device; the limit on every call (FLASHATTN_CUDA_SMEM_LIMIT may
  // lower it for one call).
  static PerDevice<bool> sm90_code;
  return sm90_code.get([] { return kernel_ptx_version(backward_kernel_of<Cfg>()) >= 90; }) &&
         Cfg::kSharedBytes <= shared_bytes_per_block_limit();
}

template <typename Cfg>
void launch_backward(const BackwardKernelParams& kp) {
  const ForwardParams& p = kp.bp.fwd;
  static PerDevice<bool> shared_bytes_allowed;
  shared_bytes_allowed.get([] {
    allow_shared_bytes(backward_kernel_of<Cfg>(), Cfg::kSharedBytes);
    return true;
  });
  if (p.seqlen_k == 0) return;
  const dim3 grid = attention_grid((p.seqlen_k + Cfg::kBlockN - 1) / Cfg::kBlockN, p.heads_k, p.batch,
                                   blocks_work_differs(p.window_left, p.window_right));
  backward_kernel_of<Cfg>()<<<grid, Cfg::kThreads, Cfg::kSharedBytes, static_cast<cudaStream_t>(p.stream)>>>(kp);
}

// Defined once per (dtype, bucket) in its own generated file: runs the key-parallel kernel and
// returns true, or returns false (launching nothing) where it cannot run on this device.
template <typename Element, int kHeadDim>
bool run_backward(const BackwardKernelParams& params);

}  // namespace flashattn::detail::cuda::sm90

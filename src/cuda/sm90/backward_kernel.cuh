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
// This first Hopper backward covers the plain call (no softcap, ALiBi or dropout), head-dim
// buckets 64 and 128, and the default (atomic dQ) mode; other calls take the sm80 kernels.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

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
  static_assert(kHeadDim == 64 || kHeadDim == 128, "head-dim buckets 64 and 128");
  static_assert(sizeof(Element) == 2, "16-bit elements");
};

template <typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    backward_dkdv_kernel(const __grid_constant__ BackwardKernelParams kp) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Element = typename Cfg::Element;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHeadDim = Cfg::kHeadDim;
  using TMma = ptx::Wgmma<Element, kBlockM>;        // S^T, dP^T: 64 keys x 64 rows
  using KvMma = ptx::Wgmma<Element, kHeadDim>;      // dV, dK: 64 keys x head dim
  using QMma = ptx::Wgmma<Element, kHeadDim / 2>;   // dQ: 64 rows x half the head dim
  constexpr int kTTiles = kBlockM / 8, kKvTiles = kHeadDim / 8, kQTiles = kHeadDim / 16;
  constexpr float kLog2e = 1.4426950408889634f;
  const BackwardParams& bp = kp.bp;
  const ForwardParams& p = bp.fwd;

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

  // Heavier (earlier, under causal masks) key blocks first (cuda/common/tile_order.cuh).
  const int n_block = tile_rank(p.heads_k), hk = tile_head(p.heads_k), b = tile_batch();
  const SequenceView seq = sequence_view(p, b);
  // Keys past seqused_k take no part but are still this CTA's to write (with zeros).
  const int64_t stored_k = p.is_varlen() ? int64_t{p.cu_seqlens_k[b + 1]} - p.cu_seqlens_k[b] : seq.seqlen_k;
  const int64_t j0 = int64_t{n_block} * kBlockN;
  if (j0 >= stored_k) return;
  const int64_t keys_here = seq.seqlen_k - j0 < 0 ? 0 : (seq.seqlen_k - j0 < kBlockN ? seq.seqlen_k - j0 : kBlockN);

  // The query blocks that see these keys, for each head of the group.
  int64_t m_first = 0;
  int m_blocks = 0;
  if (keys_here > 0 && seq.seqlen_q > 0) {
    const KeyRange rows = rows_seeing_keys(j0, j0 + keys_here, seq.seqlen_q, seq.seqlen_k, p.window_left,
                                           p.window_right);
    if (!rows.empty()) {
      m_first = rows.begin / kBlockM;
      m_blocks = static_cast<int>((rows.end + kBlockM - 1) / kBlockM - m_first);
    }
  }
  const int group = p.group_size();
  const int steps = group * m_blocks;

  const Element* k = static_cast<const Element*>(p.k) + b * p.k_batch_stride + (seq.k_row0 + j0) * p.k_row_stride +
                     hk * p.k_head_stride;
  const Element* v = static_cast<const Element*>(p.v) + b * p.v_batch_stride + (seq.k_row0 + j0) * p.v_row_stride +
                     hk * p.v_head_stride;
  // Q, dO, lse and D of step `step` (head hk * group + step / m_blocks, block step % m_blocks)
  // into `stage`; rows past the sequence are zero-filled.
  const auto load_step = [&](int step, int stage) {
    const int h = hk * group + step / m_blocks;
    const int64_t m0 = (m_first + step % m_blocks) * kBlockM;
    const Element* q = static_cast<const Element*>(p.q) + b * p.q_batch_stride + (seq.q_row0 + m0) * p.q_row_stride +
                       h * p.q_head_stride;
    const Element* dout = static_cast<const Element*>(bp.dout) + b * bp.dout_batch_stride +
                          (seq.q_row0 + m0) * bp.dout_row_stride + h * bp.dout_head_stride;
    load_swizzled<Cfg, kBlockM>(sQ + stage * Cfg::kQBytes, q, p.q_row_stride, seq.seqlen_q - m0, p.head_dim);
    load_swizzled<Cfg, kBlockM>(sdO + stage * Cfg::kQBytes, dout, bp.dout_row_stride, seq.seqlen_q - m0,
                                p.head_dim_v);
    if (threadIdx.x < kBlockM) {
      const bool valid = m0 + threadIdx.x < seq.seqlen_q;
      const int64_t at = valid ? sm80::row_index(p, b, h, seq.q_row0, m0 + threadIdx.x) : 0;
      ptx::cp_async_4(sLse + stage * Cfg::kStatBytes + threadIdx.x * 4, p.lse + at, valid);
      ptx::cp_async_4(sD + stage * Cfg::kStatBytes + threadIdx.x * 4, kp.delta + at, valid);
    }
  };

  const int warpgroup = threadIdx.x / 128;
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int quad_col = (lane % 4) * 2;
  // This lane's keys within the CTA (the accumulator rows of S^T, dP^T, dK, dV): r = 0, 1.
  const auto cta_key = [&](int r) { return warpgroup * 64 + warp * 16 + lane / 4 + r * 8; };

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
  const auto panel_step = [](int kk, int rows) -> uint64_t {
    return static_cast<uint64_t>(((kk / 4) * rows * 128 + (kk % 4) * 32) >> 4);
  };
  constexpr uint64_t kRows16 = (16 * 128) >> 4;  // 16 rows further in an MN-major operand

  float dk[kKvTiles * 4] = {}, dv[kKvTiles * 4] = {};
  float st[kTTiles * 4] = {}, dpt[kTTiles * 4] = {};
  float dq[kQTiles * 4] = {};
  uint32_t pf[kBlockM / 16][4] = {}, dsf[kBlockM / 16][4] = {};
  const float score_scale = p.softmax_scale * kLog2e;

  if (steps > 0) {
    load_swizzled<Cfg, kBlockN>(sK, k, p.k_row_stride, keys_here, p.head_dim);
    load_swizzled<Cfg, kBlockN>(sV, v, p.v_row_stride, keys_here, p.head_dim_v);
    load_step(0, 0);
  }
  ptx::cp_async_commit();

  for (int it = 0; it < steps; ++it) {
    const int stage = it & 1;
    const int h = hk * group + it / m_blocks;
    const int64_t m0 = (m_first + it % m_blocks) * kBlockM;
    ptx::cp_async_wait<0>();
    // The copies went through the generic proxy, the wgmmas read through the async proxy; the
    // barrier also tells that every warpgroup is done with step it - 1 (its dQ read dS^T).
    ptx::fence_proxy_async_shared();
    __syncthreads();
    if (it + 1 < steps) load_step(it + 1, stage ^ 1);
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

    // P^T. Column c of the block is query row m0 + c: its lse (+inf, so that P = 0, for a row
    // that saw no key) comes from shared memory. Under a mask, key j sees the rows
    // rows_seeing_keys(j, j + 1); keys past the sequence see none.
    const int64_t m1 = m0 + kBlockM < seq.seqlen_q ? m0 + kBlockM : seq.seqlen_q;
    const bool needs_mask =
        !block_fully_visible(m0, m1, j0, j0 + kBlockN, seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right);
    const float* lse_stage = lse_smem + stage * kBlockM;
    const float* d_stage = d_smem + stage * kBlockM;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      int lo = 0, hi = kBlockM;  // the block columns key j sees
      if (needs_mask) {
        const int64_t j = j0 + cta_key(r);
        lo = hi = 0;
        if (j < seq.seqlen_k) {
          const KeyRange rows =
              rows_seeing_keys(j, j + 1, seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right);
          const int64_t lo64 = rows.begin - m0, hi64 = rows.end - m0;
          lo = lo64 < 0 ? 0 : (lo64 > kBlockM ? kBlockM : static_cast<int>(lo64));
          hi = hi64 < 0 ? 0 : (hi64 > kBlockM ? kBlockM : static_cast<int>(hi64));
        }
      }
#pragma unroll
      for (int t = 0; t < kTTiles; ++t)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = t * 8 + quad_col + e;
          const float lse = lse_stage[c];
          const float lse2 = lse == -INFINITY ? INFINITY : lse * kLog2e;
          float prob = ptx::exp2_approx(fmaf(st[4 * t + 2 * r + e], score_scale, -lse2));
          if (needs_mask && (c < lo || c >= hi)) prob = 0.0f;
          st[4 * t + 2 * r + e] = prob;
        }
    }
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
        ptx::st_shared_32(sdS + swizzled_offset<kBlockN>(cta_key(r), t * 8) + quad_col * 2,
                          dsf[t / 2][(t % 2) * 2 + r]);
    ptx::fence_proxy_async_shared();

    // dK += dS^T Q, running while the warpgroups meet below.
    ptx::wgmma_hold(dk);
    ptx::wgmma_hold(dsf);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) KvMma::rs(dk, dsf[kk], q_stage_mn + kk * kRows16);
    ptx::wgmma_commit();
    __syncthreads();  // both warpgroups' dS^T are in shared memory

    // dQ (64 rows x this warpgroup's half of the head dim) = dS K over all 128 keys.
    ptx::wgmma_hold(dq);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) QMma::ss_mn(dq, ds_a + kk * kRows16, k_mn + kk * kRows16, kk > 0);
    ptx::wgmma_commit();
    ptx::wgmma_wait<0>();
    ptx::wgmma_hold(dq);
    ptx::wgmma_hold(dv);
    ptx::wgmma_hold(dk);
    ptx::wgmma_hold(pf);
    ptx::wgmma_hold(dsf);

    // Into the accumulator: row m0 + 16 warp + lane / 4 (+ 8), columns from
    // warpgroup * kHeadDim / 2 (accumulator rows are the bucket wide: kHeadDim floats).
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = warp * 16 + lane / 4 + r * 8;
      if (m0 + row >= seq.seqlen_q) continue;
      float* acc = kp.dq_accum + sm80::row_index(p, b, h, seq.q_row0, m0 + row) * kHeadDim +
                   warpgroup * (kHeadDim / 2) + quad_col;
#pragma unroll
      for (int t = 0; t < kQTiles; ++t) ptx::atomic_add_f32x2(acc + t * 8, dq[4 * t + 2 * r], dq[4 * t + 2 * r + 1]);
    }
  }

  // dK = softmax_scale dS^T Q and dV, in the storage dtype, for every stored key of the block.
  const int64_t rows_out = stored_k - j0 < kBlockN ? stored_k - j0 : kBlockN;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = cta_key(r);
    if (key >= rows_out) continue;
    const int64_t row = seq.k_row0 + j0 + key;
    Element* dk_row = static_cast<Element*>(bp.dk) + b * bp.dk_batch_stride + row * bp.dk_row_stride +
                      hk * bp.dk_head_stride;
    Element* dv_row = static_cast<Element*>(bp.dv) + b * bp.dv_batch_stride + row * bp.dv_row_stride +
                      hk * bp.dv_head_stride;
#pragma unroll
    for (int t = 0; t < kKvTiles; ++t) {
      const int col = t * 8 + quad_col;
      if (col < p.head_dim)
        *reinterpret_cast<uint32_t*>(dk_row + col) =
            ptx::pack2<Element>(dk[4 * t + 2 * r] * p.softmax_scale, dk[4 * t + 2 * r + 1] * p.softmax_scale);
      if (col < p.head_dim_v)
        *reinterpret_cast<uint32_t*>(dv_row + col) = ptx::pack2<Element>(dv[4 * t + 2 * r], dv[4 * t + 2 * r + 1]);
    }
  }
#else
  __trap();  // compiled for sm_90a only; the host launches it only where that code is loaded
#endif
}

// Whether the kernel for Cfg can run here (its sm_90a code loaded, its shared memory fits).
template <typename Cfg>
bool backward_runs_here() {
  static PerDevice<bool> runs;
  return runs.get([] {
    return kernel_ptx_version(backward_dkdv_kernel<Cfg>) >= 90 && Cfg::kSharedBytes <= shared_bytes_per_block_limit();
  });
}

template <typename Cfg>
void launch_backward(const BackwardKernelParams& kp) {
  const ForwardParams& p = kp.bp.fwd;
  static PerDevice<bool> shared_bytes_allowed;
  shared_bytes_allowed.get([] {
    allow_shared_bytes(backward_dkdv_kernel<Cfg>, Cfg::kSharedBytes);
    return true;
  });
  if (p.seqlen_k == 0) return;
  const dim3 grid = attention_grid((p.seqlen_k + Cfg::kBlockN - 1) / Cfg::kBlockN, p.heads_k, p.batch,
                                   blocks_work_differs(p.window_left, p.window_right));
  backward_dkdv_kernel<Cfg><<<grid, Cfg::kThreads, Cfg::kSharedBytes, static_cast<cudaStream_t>(p.stream)>>>(kp);
}

// Defined once per (dtype, bucket) in its own generated file: runs the key-parallel kernel and
// returns true, or returns false (launching nothing) where it cannot run on this device.
template <typename Element, int kHeadDim>
bool run_backward(const BackwardKernelParams& params);

}  // namespace flashattn::detail::cuda::sm90

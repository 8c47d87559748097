// The sm80 forward kernel: FlashAttention-2's schedule with mma.sync.
//
// A CTA owns kBlockM = 16 * kWarps query rows of one (batch, head); each warp owns 16 of them
// for the whole kernel, so the softmax statistics of a row never leave the four lanes that
// hold it. The CTA walks the key blocks its rows can see, kBlockN keys at a time, with K and V
// double-buffered in shared memory (cp.async prefetches block n+1 while block n is computed):
//
//   S = Q K^T          mma.sync, Q fragments kept in registers, K via ldmatrix
//   softcap / ALiBi / mask (the mask only on blocks that are not fully visible)
//   online softmax     in registers, base-2 exponentials, row max/sum across the lane quad
//   O += P V           P reused from the S accumulators as the A operand (never stored),
//                      V via ldmatrix.trans
//
// Shared-memory rows are padded by 16 bytes: ldmatrix then reads 8 rows whose 16-byte chunks
// fall in 8 different bank groups, without the swizzle a power-of-two row would need, and any
// head-dim bucket works. Head dims are rounded up to the bucket; the padding columns are
// zero-filled on load and never stored.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "common/mask.hpp"
#include "common/params.hpp"
#include "cuda/common/ptx.cuh"

namespace flashattn::detail::cuda::sm80 {

template <typename Element_, int kHeadDim_, int kBlockN_, int kWarps_>
struct ForwardConfig {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;  // the bucket: a multiple of 32
  static constexpr int kBlockN = kBlockN_;    // keys per step: a multiple of 16
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBlockM = 16 * kWarps;
  static constexpr int kRowStride = kHeadDim + 8;  // shared-memory row, in elements
  static constexpr int kChunksPerRow = kHeadDim / 8;  // 16-byte chunks
  static constexpr int kSharedBytes =
      (kBlockM + 2 * 2 * kBlockN) * kRowStride * static_cast<int>(sizeof(Element));
  static_assert(kHeadDim % 32 == 0 && kBlockN % 16 == 0, "tile shapes");
};

// Copies `rows` x kHeadDim elements (rows `valid_rows` and beyond, and columns from
// `head_dim` on, as zeros) from global memory into a padded shared tile, all threads helping.
template <typename Cfg>
__device__ __forceinline__ void load_tile(typename Cfg::Element* tile,
                                          const typename Cfg::Element* src, int64_t row_stride,
                                          int rows, int64_t valid_rows, int head_dim) {
  for (int chunk = threadIdx.x; chunk < rows * Cfg::kChunksPerRow; chunk += Cfg::kThreads) {
    const int row = chunk / Cfg::kChunksPerRow, col = (chunk % Cfg::kChunksPerRow) * 8;
    const bool valid = row < valid_rows && col < head_dim;
    ptx::cp_async_16(ptx::shared_address(tile + row * Cfg::kRowStride + col),
                     valid ? src + row * row_stride + col : src, valid);
  }
}

template <typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads)
    forward_kernel(const __grid_constant__ ForwardParams p) {
  using Element = typename Cfg::Element;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHeadDim = Cfg::kHeadDim;
  constexpr int kRowStride = Cfg::kRowStride;
  constexpr int kKSteps = kHeadDim / 16;   // mma k-steps over the head dim for S = Q K^T
  constexpr int kSTiles = kBlockN / 8;     // n8 tiles of S per warp
  constexpr int kOTiles = kHeadDim / 8;    // n8 tiles of O per warp
  constexpr float kLog2e = 1.4426950408889634f;

  extern __shared__ __align__(16) unsigned char shared_raw[];
  Element* sQ = reinterpret_cast<Element*>(shared_raw);
  Element* sK = sQ + kBlockM * kRowStride;       // 2 stages
  Element* sV = sK + 2 * kBlockN * kRowStride;   // 2 stages

  // Heavier (later, under causal masks) query blocks first, for a better tail.
  const int m_block = gridDim.x - 1 - blockIdx.x;
  const int h = blockIdx.y, b = blockIdx.z;
  const SequenceView seq = sequence_view(p, b);
  const int64_t m0 = int64_t{m_block} * kBlockM;
  if (m0 >= seq.seqlen_q) return;
  const int64_t rows_here = seq.seqlen_q - m0 < kBlockM ? seq.seqlen_q - m0 : kBlockM;
  const int hk = h / p.group_size();

  const Element* q = static_cast<const Element*>(p.q) + b * p.q_batch_stride +
                     (seq.q_row0 + m0) * p.q_row_stride + h * p.q_head_stride;
  const Element* k = static_cast<const Element*>(p.k) + b * p.k_batch_stride +
                     seq.k_row0 * p.k_row_stride + hk * p.k_head_stride;
  const Element* v = static_cast<const Element*>(p.v) + b * p.v_batch_stride +
                     seq.k_row0 * p.v_row_stride + hk * p.v_head_stride;

  const KeyRange keys = visible_keys_of_rows(m0, m0 + rows_here, seq.seqlen_q, seq.seqlen_k,
                                             p.window_left, p.window_right);
  const int n_blocks = keys.empty() ? 0 : static_cast<int>((keys.end - keys.begin + kBlockN - 1) / kBlockN);

  // Prologue: Q and the first K/V block.
  load_tile<Cfg>(sQ, q, p.q_row_stride, kBlockM, rows_here, p.head_dim);
  if (n_blocks > 0) {
    load_tile<Cfg>(sK, k + keys.begin * p.k_row_stride, p.k_row_stride, kBlockN,
                   keys.end - keys.begin, p.head_dim);
    load_tile<Cfg>(sV, v + keys.begin * p.v_row_stride, p.v_row_stride, kBlockN,
                   keys.end - keys.begin, p.head_dim_v);
  }
  ptx::cp_async_commit();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int quad_row = lane / 4;         // this lane's rows: quad_row and quad_row + 8
  const int quad_col = (lane % 4) * 2;   // and its columns within each n8 tile
  // This lane's two query rows, their visible keys and ALiBi slope.
  const int64_t row_i[2] = {m0 + warp * 16 + quad_row, m0 + warp * 16 + quad_row + 8};
  const KeyRange row_keys[2] = {
      visible_keys(row_i[0], seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right),
      visible_keys(row_i[1], seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right)};
  const float slope = p.alibi_slopes != nullptr ? p.alibi_slopes[b * p.alibi_batch_stride + h] : 0.0f;
  const bool softcap = p.softcap > 0.0f;
  // Scores enter the softmax in base 2: x = log2(e) * s.
  const float score_scale = softcap ? p.softmax_scale / p.softcap : p.softmax_scale * kLog2e;

  float o[kOTiles][4] = {};
  float row_max[2] = {-INFINITY, -INFINITY};  // running max of x
  float row_sum[2] = {0.0f, 0.0f};            // this lane's part of the running sum
  // Q fragments stay in registers up to head dim 128; above, O alone takes up to 128
  // registers, so they are re-read from shared memory at each k-step instead.
  constexpr bool kQInRegisters = kHeadDim <= 128;
  uint32_t qf[kQInRegisters ? kKSteps : 1][4];
  const auto q_fragment_address = [&](int kk) {
    return ptx::shared_address(sQ + (warp * 16 + lane % 16) * kRowStride + kk * 16 + (lane / 16) * 8);
  };

  for (int n = 0; n < n_blocks; ++n) {
    const int stage = n & 1;
    const int64_t j0 = keys.begin + int64_t{n} * kBlockN;
    ptx::cp_async_wait<0>();
    __syncthreads();  // block n has landed, and every warp is done with block n - 1
    if (n + 1 < n_blocks) {  // prefetch block n + 1 into the other stage
      const int64_t j1 = j0 + kBlockN;
      load_tile<Cfg>(sK + (stage ^ 1) * kBlockN * kRowStride, k + j1 * p.k_row_stride,
                     p.k_row_stride, kBlockN, keys.end - j1, p.head_dim);
      load_tile<Cfg>(sV + (stage ^ 1) * kBlockN * kRowStride, v + j1 * p.v_row_stride,
                     p.v_row_stride, kBlockN, keys.end - j1, p.head_dim_v);
    }
    ptx::cp_async_commit();
    if (kQInRegisters && n == 0) {  // Q fragments once: rows warp*16 .. +15, whole head dim
#pragma unroll
      for (int kk = 0; kk < kKSteps; ++kk) ptx::ldmatrix_x4(qf[kQInRegisters ? kk : 0], q_fragment_address(kk));
    }

    // S = Q K^T for this warp's 16 rows x kBlockN keys.
    const Element* k_tile = sK + stage * kBlockN * kRowStride;
    float s[kSTiles][4] = {};
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      if (!kQInRegisters) ptx::ldmatrix_x4(qf[0], q_fragment_address(kk));
      const uint32_t(&a)[4] = qf[kQInRegisters ? kk : 0];
#pragma unroll
      for (int t = 0; t < kSTiles; t += 2) {
        uint32_t kf[4];
        ptx::ldmatrix_x4(kf, ptx::shared_address(k_tile + (t * 8 + lane % 8 + (lane / 16) * 8) * kRowStride +
                                                 kk * 16 + ((lane / 8) % 2) * 8));
        ptx::mma_16816<Element>(s[t], a, kf[0], kf[1]);
        ptx::mma_16816<Element>(s[t + 1], a, kf[2], kf[3]);
      }
    }

    // Scores in base 2, with softcap, ALiBi and (on boundary blocks) the mask.
    const bool needs_mask = !block_fully_visible(m0, m0 + rows_here, j0, j0 + kBlockN,
                                                 seq.seqlen_q, seq.seqlen_k, p.window_left,
                                                 p.window_right);
#pragma unroll
    for (int t = 0; t < kSTiles; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e / 2;
        const int64_t j = j0 + t * 8 + quad_col + (e % 2);
        float x = s[t][e] * score_scale;
        if (softcap) x = p.softcap * tanhf(x) * kLog2e;
        if (p.alibi_slopes != nullptr)
          x += alibi_bias(slope, row_i[r], j, seq.seqlen_q, seq.seqlen_k) * kLog2e;
        if (needs_mask && (j < row_keys[r].begin || j >= row_keys[r].end)) x = -INFINITY;
        s[t][e] = x;
      }
    }

    // Online softmax: new running max per row (across the lane quad), rescale, exponentiate.
    float scale_o[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float block_max = -INFINITY;
#pragma unroll
      for (int t = 0; t < kSTiles; ++t)
        block_max = fmaxf(block_max, fmaxf(s[t][2 * r], s[t][2 * r + 1]));
      block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffffu, block_max, 1));
      block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffffu, block_max, 2));
      const float new_max = fmaxf(row_max[r], block_max);
      // A row with nothing visible so far keeps max -inf; subtract 0 instead so that
      // exp2(-inf - base) is 0 rather than NaN.
      const float base = new_max == -INFINITY ? 0.0f : new_max;
      scale_o[r] = ptx::exp2_approx(row_max[r] - base);
      row_max[r] = new_max;
      float sum = 0.0f;
#pragma unroll
      for (int t = 0; t < kSTiles; ++t) {
        s[t][2 * r] = ptx::exp2_approx(s[t][2 * r] - base);
        s[t][2 * r + 1] = ptx::exp2_approx(s[t][2 * r + 1] - base);
        sum += s[t][2 * r] + s[t][2 * r + 1];
      }
      row_sum[r] = row_sum[r] * scale_o[r] + sum;
    }
#pragma unroll
    for (int t = 0; t < kOTiles; ++t) {
      o[t][0] *= scale_o[0];
      o[t][1] *= scale_o[0];
      o[t][2] *= scale_o[1];
      o[t][3] *= scale_o[1];
    }

    // O += P V: the S accumulators of two adjacent key tiles are exactly one A fragment.
    const Element* v_tile = sV + stage * kBlockN * kRowStride;
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const uint32_t pf[4] = {ptx::pack2<Element>(s[2 * kk][0], s[2 * kk][1]),
                              ptx::pack2<Element>(s[2 * kk][2], s[2 * kk][3]),
                              ptx::pack2<Element>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              ptx::pack2<Element>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int t = 0; t < kOTiles; t += 2) {
        uint32_t vf[4];
        ptx::ldmatrix_x4_trans(vf, ptx::shared_address(v_tile + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * kRowStride +
                                                      t * 8 + (lane / 16) * 8));
        ptx::mma_16816<Element>(o[t], pf, vf[0], vf[1]);
        ptx::mma_16816<Element>(o[t + 1], pf, vf[2], vf[3]);
      }
    }
  }

  // Epilogue: out = O / l in the storage dtype; lse = ln 2 * (max + log2 l).
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = row_sum[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const float inv = l == 0.0f ? 0.0f : 1.0f / l;  // a row that saw no key: out = 0
    if (row_i[r] >= seq.seqlen_q) continue;
    Element* out = static_cast<Element*>(p.out) + b * p.out_batch_stride +
                   (seq.q_row0 + row_i[r]) * p.out_row_stride + h * p.out_head_stride;
#pragma unroll
    for (int t = 0; t < kOTiles; ++t) {
      const int col = t * 8 + quad_col;
      if (col < p.head_dim_v)
        *reinterpret_cast<uint32_t*>(out + col) =
            ptx::pack2<Element>(o[t][2 * r] * inv, o[t][2 * r + 1] * inv);
    }
    if (p.lse != nullptr && lane % 4 == 0)
      p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + seq.q_row0 + row_i[r]] =
          l == 0.0f ? -INFINITY : (row_max[r] + log2f(l)) * 0.6931471805599453f;
  }
}

// Launches the kernel for one (dtype, head-dim bucket) configuration.
template <typename Cfg>
void launch_forward(const ForwardParams& p) {
  const auto kernel = forward_kernel<Cfg>;
  if (Cfg::kSharedBytes > 48 * 1024) {
    static const cudaError_t attribute_status = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSharedBytes);
    (void)attribute_status;  // a failure shows up as a launch error below
  }
  const dim3 grid(static_cast<unsigned>((p.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM),
                  static_cast<unsigned>(p.heads), static_cast<unsigned>(p.batch));
  kernel<<<grid, Cfg::kThreads, Cfg::kSharedBytes, static_cast<cudaStream_t>(p.stream)>>>(p);
}

}  // namespace flashattn::detail::cuda::sm80

// The sm80 forward kernel: FlashAttention-2's schedule with mma.sync.
//
// A CTA owns kBlockM = 16 * kMTiles * kWarps query rows of one (batch, head); each warp owns
// kMTiles m16 tiles of them for the whole kernel, so the softmax statistics of a row never
// leave the four lanes that hold it. The CTA walks the key blocks its rows can see, kBlockN
// keys at a time, with K and V double-buffered in shared memory (cp.async prefetches block
// n+1 while block n is computed; or single-buffered, Cfg::kKvStages):
//
//   S = Q K^T          mma.sync; each K fragment read from shared memory feeds kMTiles MMAs
//   softcap / ALiBi / mask (the mask only on blocks that are not fully visible)
//   online softmax     in registers, base-2 exponentials, row max/sum across the lane quad
//   dropout            keep bits from the shared Philox generator, applied after the row sum
//   O += P V           P reused from the S accumulators as the A operand (never stored),
//                      V via ldmatrix.trans, each V fragment feeding kMTiles MMAs
//
// Paged keys and values (ForwardParams::block_table) take a variant of each configuration
// (PagedForwardConfig) whose K/V rows are each copied from their own page.
//
// Shared-memory rows are padded by 16 bytes: ldmatrix then reads 8 rows whose 16-byte chunks
// fall in 8 different bank groups, without the swizzle a power-of-two row would need, and any
// head-dim bucket works. Head dims are rounded up to the bucket; the padding columns are
// zero-filled on load and never stored.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <type_traits>

#include "common/mask.hpp"
#include "common/params.hpp"
#include "common/philox.hpp"
#include "cuda/common/online_softmax.cuh"
#include "cuda/common/per_device.hpp"
#include "cuda/common/ptx.cuh"
#include "cuda/common/tile_order.cuh"
#include "cuda/sm80/tile_loader.cuh"

namespace flashattn::detail::cuda::sm80 {

template <typename Element_, int kHeadDim_, int kBlockN_, int kWarps_, int kMTiles_,
          bool kQInRegisters_, int kL2Prefetch_ = 0, int kKvStages_ = 2>
struct ForwardConfig {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;  // the bucket: a multiple of 32
  static constexpr int kBlockN = kBlockN_;    // keys per step: a multiple of 16
  static constexpr int kWarps = kWarps_;
  static constexpr int kMTiles = kMTiles_;    // m16 tiles per warp
  static constexpr bool kQInRegisters = kQInRegisters_;  // else re-read at every k-step
  static constexpr int kL2Prefetch = kL2Prefetch_;  // L2 prefetch hint of the K/V loads (bytes)
  // 2: K and V of block n + 1 load while block n is computed (double-buffered).
  // 1: one buffer each, FA2's schedule: V(n) loads during S = Q K(n)^T, K(n + 1) during the
  //    softmax and P V(n). Half the K/V shared memory, so that two CTAs fit per SM.
  static constexpr int kKvStages = kKvStages_;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBlockM = 16 * kMTiles * kWarps;
  static constexpr int kRowStride = kHeadDim + 8;  // shared-memory row, in elements
  static constexpr int kChunksPerRow = kHeadDim / 8;  // 16-byte chunks
  static constexpr int kSharedBytes =
      (kBlockM + kKvStages * 2 * kBlockN) * kRowStride * static_cast<int>(sizeof(Element));
  static constexpr int kMaxSharedBytes = kSharedBytes;  // what the device must allow
  static constexpr bool kPaged = false;
  static_assert(kHeadDim % 32 == 0 && kBlockN % 16 == 0, "tile shapes");
  static_assert(kKvStages == 1 || kKvStages == 2, "K/V stages");
};

// The variant of a configuration for paged keys and values: the same tiles and shared memory.
// Per K/V block the CTA looks each key's page up once (write_page_table in the kernel) and
// writes its row's K and V element offsets into the 16 bytes of padding of a shared-memory row
// (what no copy or ldmatrix touches), where every copy of that row reads them. A thread's
// rows kept in registers instead, or the K/V base pointers, spilled the hdim-64 kernel, which
// has no register to spare across its loop (ptxas, sm_90a).
template <typename Cfg>
struct PagedForwardConfig : Cfg {
  static constexpr bool kPaged = true;
  static_assert(Cfg::kRowStride - Cfg::kHeadDim == 8 && sizeof(typename Cfg::Element) == 2,
                "16 bytes of padding per row hold a row's two offsets");
};

// kGeneral: softcap, ALiBi, a non-positive scale or dropout may occur. Without them (the
// common case) S holds raw dot products and the scale folds into the exponent; the kernel is
// then compiled without that code, which frees registers and instructions in the inner loop.
template <typename Cfg, bool kGeneral>
__global__ void __launch_bounds__(Cfg::kThreads)
    forward_kernel(const __grid_constant__ ForwardParams p) {
  using Element = typename Cfg::Element;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHeadDim = Cfg::kHeadDim;
  constexpr int kRowStride = Cfg::kRowStride, kMTiles = Cfg::kMTiles;
  constexpr bool kQInRegisters = Cfg::kQInRegisters;
  constexpr int kKSteps = kHeadDim / 16;   // mma k-steps over the head dim for S = Q K^T
  constexpr int kSTiles = kBlockN / 8;     // n8 tiles of S per m-tile
  constexpr int kOTiles = kHeadDim / 8;    // n8 tiles of O per m-tile
  constexpr float kLog2e = 1.4426950408889634f;

  // Shared memory: Q (kBlockM rows), then K and V (kBlockN rows each, kKvStages stages each).
  extern __shared__ __align__(16) unsigned char shared_raw[];
  constexpr uint32_t kElementBytes = sizeof(Element);
  constexpr uint32_t kStageBytes = kBlockN * kRowStride * kElementBytes;
  const uint32_t sQ_address = ptx::shared_address(shared_raw);
  const uint32_t sK_address = sQ_address + kBlockM * kRowStride * kElementBytes;
  const uint32_t sV_address = sK_address + Cfg::kKvStages * kStageBytes;
  constexpr bool kDoubleBuffered = Cfg::kKvStages == 2;

  // Heavier (later, under causal masks) query blocks first, across the heads where the
  // blocks' work differs (cuda/common/tile_order.cuh), for a shorter tail.
  const int m_block = tile_blocks(p.heads) - 1 - tile_rank(p.heads);
  const int h = tile_head(p.heads), b = tile_batch();
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
  constexpr bool kPaged = Cfg::kPaged;  // k and v unused: rows are found by write_page_table

  const KeyRange keys = visible_keys_of_rows(m0, m0 + rows_here, seq.seqlen_q, seq.seqlen_k,
                                             p.window_left, p.window_right);
  const int n_blocks =
      keys.empty() ? 0 : static_cast<int>((keys.end - keys.begin + kBlockN - 1) / kBlockN);

  // The key blocks that every row of the CTA sees whole, [full_begin, full_end) (empty when
  // full_end <= full_begin): the others are masked. Found once here in 64 bits, so that the
  // loop's test is two 32-bit compares (per block it cost ~60 instructions, sm_90a SASS).
  // The single-buffered kernel (hdim 256) keeps the per-block test: with the two extra live
  // registers its general variant spilled 188 bytes (ptxas, sm_90a), against none.
  int full_begin = 0, full_end = 0;
  if (kDoubleBuffered && n_blocks > 0) {
    const KeyRange full = fully_visible_blocks(m0, m0 + rows_here, keys.begin, kBlockN, n_blocks, seq.seqlen_q,
                                               seq.seqlen_k, p.window_left, p.window_right);
    full_begin = static_cast<int>(full.begin);
    full_end = static_cast<int>(full.end);
  }

  // Prologue: Q and the first K block (and V block, double-buffered). Double-buffered, K and
  // V then load through per-thread cursors (this thread's first chunk of the next tile),
  // advanced a block at a time, copy by copy (TileLoader::load_copy).
  using KvLoader = TileLoader<Cfg, kBlockN, Cfg::kL2Prefetch>;
  const KvLoader k_loader(p.head_dim), v_loader(p.head_dim_v);
  TileLoader<Cfg, kBlockM>(p.head_dim).load(sQ_address, q, p.q_row_stride, rows_here);

  // kPaged: block n's offsets ("page table") are in the padding of the rows of stage n % 2 of
  // the K/V region (double-buffered: K stage 0 or 1; single-buffered: the K or the V stage),
  // row t holding key t's K and V element offsets (head hk included; -1: no row to read). The
  // CTA writes them (write_page_table) a barrier before any copy of block n reads them, and
  // after every copy of block n - 2 has: in the prologue (blocks 0 and 1) or at the top of a
  // step (after its barrier: block n + 2; single-buffered n + 1, whose K copies follow the
  // step's second barrier). The block table's values are the caller's and unchecked on the
  // GPU: the keys are bounded by its width (sequence_view), and a page index outside
  // [0, num_pages) is never dereferenced: its row is zero-filled and a flag (in the padding of
  // Q's row 0) set, which turns this CTA's rows of out and lse to NaN (docs/SPEC.md), so that
  // the bug shows.
  const auto page_entry = [&](int n, int t) {
    return sK_address + (n & 1) * kStageBytes + (t * kRowStride + kHeadDim) * kElementBytes;
  };
  const uint32_t bad_page_flag = sQ_address + kHeadDim * kElementBytes;
  const auto write_page_table = [&](int n) {
    for (int t = threadIdx.x; t < kBlockN; t += Cfg::kThreads) {
      const int64_t j = keys.begin + int64_t{n} * kBlockN + t;
      int64_t k_offset = -1, v_offset = -1;
      if (j < keys.end) {
        const PagedRow at = paged_row(p, b, j);
        if (page_exists(p, at.page)) {
          k_offset = at.page * p.k_batch_stride + at.row * p.k_row_stride + hk * p.k_head_stride;
          v_offset = at.page * p.v_batch_stride + at.row * p.v_row_stride + hk * p.v_head_stride;
        } else {
          ptx::st_shared_32(bad_page_flag, 1);
        }
      }
      ptx::st_shared_128(page_entry(n, t),
                         make_uint4(static_cast<uint32_t>(k_offset), static_cast<uint32_t>(k_offset >> 32),
                                    static_cast<uint32_t>(v_offset), static_cast<uint32_t>(v_offset >> 32)));
    }
  };
  // Copy i of this thread's share of block n's K (kv = 0) or V (kv = 1) tile.
  const auto paged_copy = [&](const KvLoader& loader, uint32_t tile, int kv, int n, int i) {
    const int t = loader.row + (i / KvLoader::kColumnPasses) * KvLoader::kRowsPerPass;
    const uint2 words = ptx::ld_shared_64(page_entry(n, t) + kv * 8);
    const int64_t offset = static_cast<int64_t>((uint64_t{words.y} << 32) | words.x);
    const Element* base = static_cast<const Element*>(kv == 0 ? p.k : p.v);
    loader.load_copy_row(tile, base + (offset < 0 ? 0 : offset) + loader.chunk * 8, offset >= 0, i);
  };
  const auto load_paged = [&](const KvLoader& loader, uint32_t tile, int kv, int n) {
#pragma unroll
    for (int i = 0; i < KvLoader::kCopies; ++i) paged_copy(loader, tile, kv, n, i);
  };
  const Element* k_next = k_loader.thread_source(k + keys.begin * p.k_row_stride, p.k_row_stride);
  const Element* v_next = v_loader.thread_source(v + keys.begin * p.v_row_stride, p.v_row_stride);
  const int64_t k_block_stride = kBlockN * p.k_row_stride, v_block_stride = kBlockN * p.v_row_stride;
  // Every copy of block 0 through a cursor, which then moves to block 1.
  const auto load_first_block = [&](const auto& loader, uint32_t tile, const Element*& cursor,
                                    int64_t row_stride, int64_t block_stride) {
    const int rows = loader.rows_left(keys.end - keys.begin);
#pragma unroll
    for (int i = 0; i < std::decay_t<decltype(loader)>::kCopies; ++i)
      loader.load_copy(tile, cursor, row_stride, rows, i);
    cursor += block_stride;
  };
  if (n_blocks > 0) {
    if constexpr (kPaged) {  // n_blocks is the same for the whole CTA
      if (threadIdx.x == 0) ptx::st_shared_32(bad_page_flag, 0);
      __syncthreads();
      write_page_table(0);
      if (kDoubleBuffered && n_blocks > 1) write_page_table(1);
      __syncthreads();
      load_paged(k_loader, sK_address, 0, 0);
      if (kDoubleBuffered) load_paged(v_loader, sV_address, 1, 0);
    } else if (kDoubleBuffered) {
      load_first_block(k_loader, sK_address, k_next, p.k_row_stride, k_block_stride);
      load_first_block(v_loader, sV_address, v_next, p.v_row_stride, v_block_stride);
    } else {
      k_loader.load(sK_address, k + keys.begin * p.k_row_stride, p.k_row_stride, keys.end - keys.begin);
    }
  }
  ptx::cp_async_commit();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int quad_row = lane / 4;         // this lane's rows in each m-tile: quad_row, quad_row + 8
  const int quad_col = (lane % 4) * 2;   // and its columns within each n8 tile
  const int warp_row0 = warp * 16 * kMTiles;  // first row of this warp within the CTA tile

  // This lane's query rows: 2 per m-tile. (Recomputed where needed rather than kept: the
  // registers are better spent on O.)
  const auto row_of = [&](int mt, int r) -> int64_t {
    return m0 + warp_row0 + mt * 16 + quad_row + r * 8;
  };
  const float slope = kGeneral && p.alibi_slopes != nullptr
                          ? p.alibi_slopes[b * p.alibi_batch_stride + h]
                          : 0.0f;
  const bool softcap = kGeneral && p.softcap > 0.0f;
  // The plain path (no softcap, no ALiBi, positive scale) keeps raw dot products in S and
  // folds the scale into the exponent; otherwise S is turned into scores first (ScoreScales).
  const bool plain = !kGeneral || (!softcap && p.alibi_slopes == nullptr && p.softmax_scale > 0.0f);
  // Dropout (common/philox.hpp): kept probabilities enter P V unscaled; 1 / (1 - p) is applied
  // once in the epilogue. The row sum l (and so lse) is of the undropped probabilities.
  const bool dropout = kGeneral && p.dropout_p > 0.0f;
  const DropoutRng rng = dropout ? make_dropout_rng(p.dropout_seed, p.dropout_offset, p.dropout_p)
                                 : DropoutRng{};
  const ScoreScales scales = score_scales(plain, p.softmax_scale, softcap ? p.softcap : 0.0f);
  const float exp_scale = scales.exp;

  float o[kMTiles][kOTiles][4] = {};
  float row_max[kMTiles][2], row_sum[kMTiles][2];  // max in S units; this lane's part of l
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_max[mt][r] = -INFINITY;
      row_sum[mt][r] = 0.0f;
    }
  uint32_t qf[kQInRegisters ? kMTiles * kKSteps : kMTiles][4];
  // ldmatrix addresses as one 32-bit shared base per tile (this lane's row and column within
  // the fragment) plus compile-time offsets, so each load is [register + immediate]: pointer
  // arithmetic per unrolled load would hold dozens of address registers and spill.
  const uint32_t q_base =
      sQ_address +
      ((warp_row0 + lane % 16) * kRowStride + (lane / 16) * 8) * kElementBytes;
  const uint32_t k_lane = ((lane % 8 + (lane / 16) * 8) * kRowStride + ((lane / 8) % 2) * 8) * kElementBytes;
  const uint32_t v_lane = ((lane % 8 + ((lane / 8) % 2) * 8) * kRowStride + (lane / 16) * 8) * kElementBytes;
  const auto q_fragment_address = [&](int mt, int kk) {
    return q_base + (mt * 16 * kRowStride + kk * 16) * kElementBytes;
  };

  for (int n = 0; n < n_blocks; ++n) {
    const int stage = kDoubleBuffered ? n & 1 : 0;
    const int64_t j0 = keys.begin + int64_t{n} * kBlockN;
    ptx::cp_async_wait<0>();
    __syncthreads();  // K(n) (and V(n)) have landed, and every warp is done with block n - 1
    // Single-buffered: V(n) at once (TileLoader::load_copy says why). Double-buffered: K(n + 1)
    // and V(n + 1) into the other stage, spread copy by copy over the k-steps of S = Q K^T.
    if (!kDoubleBuffered) {
      if constexpr (kPaged)
        load_paged(v_loader, sV_address, 1, n);
      else
        v_loader.load(sV_address, v + j0 * p.v_row_stride, p.v_row_stride, keys.end - j0);
      ptx::cp_async_commit();
    }
    // Paged: block n + 2's offsets over block n's, whose copies (issued in step n - 1) read
    // them before the barrier above; single-buffered, block n + 1's over block n - 1's.
    if constexpr (kPaged) {
      const int next = n + (kDoubleBuffered ? 2 : 1);
      if (next < n_blocks) write_page_table(next);
    }
    const bool copies_now = kDoubleBuffered && n + 1 < n_blocks;
    const int k_rows_left = k_loader.rows_left(keys.end - (j0 + kBlockN));
    const int v_rows_left = v_loader.rows_left(keys.end - (j0 + kBlockN));
    constexpr int kKCopies = decltype(k_loader)::kCopies, kVCopies = decltype(v_loader)::kCopies;
    const auto copies_during_qk = [&](int kk) {
#pragma unroll
      for (int i = 0; i < kKCopies + kVCopies; ++i) {
        if (!copies_now || i * kKSteps / (kKCopies + kVCopies) != kk) continue;
        if constexpr (kPaged) {
          if (i < kKCopies)
            paged_copy(k_loader, sK_address + (stage ^ 1) * kStageBytes, 0, n + 1, i);
          else
            paged_copy(v_loader, sV_address + (stage ^ 1) * kStageBytes, 1, n + 1, i - kKCopies);
        } else if (i < kKCopies) {
          k_loader.load_copy(sK_address + (stage ^ 1) * kStageBytes, k_next, p.k_row_stride, k_rows_left, i);
        } else {
          v_loader.load_copy(sV_address + (stage ^ 1) * kStageBytes, v_next, p.v_row_stride, v_rows_left,
                             i - kKCopies);
        }
      }
    };
    if (kQInRegisters && n == 0) {  // Q fragments once, for the whole head dim
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int kk = 0; kk < kKSteps; ++kk)
          ptx::ldmatrix_x4(qf[kQInRegisters ? mt * kKSteps + kk : mt], q_fragment_address(mt, kk));
    }

    // S = Q K^T for this warp's rows x kBlockN keys.
    const uint32_t k_base = sK_address + stage * kStageBytes + k_lane;
    float s[kMTiles][kSTiles][4] = {};
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      copies_during_qk(kk);
      if (!kQInRegisters)
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) ptx::ldmatrix_x4(qf[mt], q_fragment_address(mt, kk));
#pragma unroll
      for (int t = 0; t < kSTiles; t += 2) {
        uint32_t kf[4];
        ptx::ldmatrix_x4(kf, k_base + (t * 8 * kRowStride + kk * 16) * kElementBytes);
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          const uint32_t(&a)[4] = qf[kQInRegisters ? mt * kKSteps + kk : mt];
          ptx::mma_16816<Element>(s[mt][t], a, kf[0], kf[1]);
          ptx::mma_16816<Element>(s[mt][t + 1], a, kf[2], kf[3]);
        }
      }
    }

    if (kDoubleBuffered) {
      if (copies_now) {
        k_next += k_block_stride;
        v_next += v_block_stride;
      }
      ptx::cp_async_commit();
    }

    // Softcap and ALiBi (into base-2 scores), then the mask on boundary blocks. Column
    // arithmetic is relative to the block, in 32 bits.
    const bool needs_mask =
        kDoubleBuffered ? n < full_begin || n >= full_end
                        : !block_fully_visible(m0, m0 + rows_here, j0, j0 + kBlockN, seq.seqlen_q,
                                               seq.seqlen_k, p.window_left, p.window_right);
    if (!plain) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          modify_scores_row<kSTiles>(&s[mt][0][0], r, scales, softcap, slope,
                                     static_cast<int>(row_of(mt, r) + alibi_diagonal(p, seq) - j0), quad_col);
    }
    if (needs_mask) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          mask_row<kSTiles>(&s[mt][0][0], r,
                            block_columns<kBlockN>(visible_keys(row_of(mt, r), seq.seqlen_q, seq.seqlen_k,
                                                                p.window_left, p.window_right),
                                                   j0),
                            quad_col);
    }

    if (!kDoubleBuffered) {
      ptx::cp_async_wait<0>();
      __syncthreads();  // V(n) has landed, and every warp is done with K(n)
      if (n + 1 < n_blocks) {
        const int64_t j1 = j0 + kBlockN;
        if constexpr (kPaged)
          load_paged(k_loader, sK_address, 0, n + 1);
        else
          k_loader.load(sK_address, k + j1 * p.k_row_stride, p.k_row_stride, keys.end - j1);
      }
      ptx::cp_async_commit();
    }

    // Online softmax: new running max per row (across the lane quad), rescale, exponentiate.
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      float scale_o[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        scale_o[r] = online_softmax_row<kSTiles>(&s[mt][0][0], r, row_max[mt][r], row_sum[mt][r], exp_scale);
        if (dropout)
          dropout_row<kSTiles>(&s[mt][0][0], r, rng, b, h,
                               static_cast<uint32_t>(row_of(mt, r) + p.query_position0), j0 + p.key_position0,
                               quad_col);
      }
#pragma unroll
      for (int t = 0; t < kOTiles; ++t) {
        o[mt][t][0] *= scale_o[0];
        o[mt][t][1] *= scale_o[0];
        o[mt][t][2] *= scale_o[1];
        o[mt][t][3] *= scale_o[1];
      }
    }

    // O += P V: the S accumulators of two adjacent key tiles are exactly one A fragment.
    const uint32_t v_base = sV_address + stage * kStageBytes + v_lane;
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      uint32_t pf[kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        pf[mt][0] = ptx::pack2<Element>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        pf[mt][1] = ptx::pack2<Element>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        pf[mt][2] = ptx::pack2<Element>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        pf[mt][3] = ptx::pack2<Element>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int t = 0; t < kOTiles; t += 2) {
        uint32_t vf[4];
        ptx::ldmatrix_x4_trans(vf, v_base + (kk * 16 * kRowStride + t * 8) * kElementBytes);
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          ptx::mma_16816<Element>(o[mt][t], pf[mt], vf[0], vf[1]);
          ptx::mma_16816<Element>(o[mt][t + 1], pf[mt], vf[2], vf[3]);
        }
      }
    }
  }

  // Epilogue: out = O / l in the storage dtype; lse = ln 2 * (c max + log2 l). O goes through
  // this warp's own rows of the Q tile in shared memory (no other warp reads them, so a warp
  // barrier suffices), so that global stores are 16 bytes per lane and whole rows per pass.
  // With no key block at all, the copies of Q (by every thread of the CTA) may still be in
  // flight; n_blocks is the same for the whole CTA.
  if (n_blocks == 0) {
    ptx::cp_async_wait<0>();
    __syncthreads();
  }
  // The flag's last writes came a barrier before (block n's table is written in the prologue
  // or in step n - 2 (n - 1 single-buffered), ahead of step n - 1's (second) barrier).
  const bool bad_page = kPaged && n_blocks > 0 && ptx::ld_shared_32(bad_page_flag) != 0;
  __syncwarp();
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = row_sum[mt][r];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      // A row that saw no key: out = 0. A page index out of range: NaN.
      const float inv = kPaged && bad_page ? NAN : l == 0.0f ? 0.0f : (dropout ? rng.scale : 1.0f) / l;
      const uint32_t row_address =
          sQ_address + ((warp_row0 + mt * 16 + quad_row + r * 8) * kRowStride + quad_col) * kElementBytes;
#pragma unroll
      for (int t = 0; t < kOTiles; ++t)
        ptx::st_shared_32(row_address + t * 8 * kElementBytes,
                          ptx::pack2<Element>(o[mt][t][2 * r] * inv, o[mt][t][2 * r + 1] * inv));
      const int64_t i = row_of(mt, r);
      if (p.lse != nullptr && lane % 4 == 0 && i < seq.seqlen_q)
        p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + seq.q_row0 + i] =
            kPaged && bad_page ? NAN
            : l == 0.0f        ? -INFINITY
                               : (row_max[mt][r] * exp_scale + log2f(l)) * 0.6931471805599453f;
    }
  __syncwarp();
  constexpr int kWarpRows = 16 * kMTiles;
  Element* out = static_cast<Element*>(p.out) + b * p.out_batch_stride +
                 (seq.q_row0 + m0 + warp_row0) * p.out_row_stride + h * p.out_head_stride;
  const int64_t warp_rows_valid = seq.seqlen_q - (m0 + warp_row0);
  static_assert(kWarpRows * Cfg::kChunksPerRow % 32 == 0, "epilogue passes");
#pragma unroll
  for (int pass = 0; pass < kWarpRows * Cfg::kChunksPerRow / 32; ++pass) {
    const int idx = lane + 32 * pass;
    const int row = idx / Cfg::kChunksPerRow, col = (idx % Cfg::kChunksPerRow) * 8;
    if (row < warp_rows_valid && col < p.head_dim_v)
      ptx::st_global_128(out + row * p.out_row_stride + col,
                         ptx::ld_shared_128(sQ_address + ((warp_row0 + row) * kRowStride + col) * kElementBytes));
  }
}

// Launches the kernel for one (dtype, head-dim bucket) configuration (paged or not).
template <typename Cfg>
void launch_forward(const ForwardParams& p) {
  const bool general = p.softcap > 0.0f || p.alibi_slopes != nullptr ||
                       !(p.softmax_scale > 0.0f) || p.dropout_p > 0.0f;
  const auto kernel = general ? forward_kernel<Cfg, true> : forward_kernel<Cfg, false>;
  static PerDevice<bool> shared_bytes_allowed;  // once per kernel and device
  shared_bytes_allowed.get([] {
    allow_shared_bytes(forward_kernel<Cfg, true>, Cfg::kSharedBytes);
    allow_shared_bytes(forward_kernel<Cfg, false>, Cfg::kSharedBytes);
    return true;
  });
  const dim3 grid = attention_grid((p.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM, p.heads, p.batch,
                                   blocks_work_differs(p.window_left, p.window_right));
  kernel<<<grid, Cfg::kThreads, Cfg::kSharedBytes, static_cast<cudaStream_t>(p.stream)>>>(p);
}

}  // namespace flashattn::detail::cuda::sm80

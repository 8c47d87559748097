// The warp-specialised sm90 (Hopper) backward kernel: FlashAttention-3's backward on our own
// primitives (cuda/sm90/pipeline.cuh, cuda/common/wgmma.cuh). The arithmetic is the
// key-parallel kernel's (backward_kernel.cuh says it in full: S^T, dP^T, P^T, dS^T, dV, dK
// and dQ per step, keys as wgmma's M); what differs is who loads and who adds dQ.
//
// A CTA owns kBlockN = 128 keys of one (batch, kv head) and has three warpgroups:
//   warpgroup 0, the producer, gives most of its registers back (setmaxnreg). One thread of
//     its warp 0 loads K and V once and then, step after step, Q with lse log2(e) and dO
//     with D into a two-stage ring, all through TMA, each stage guarded by a full and an
//     empty mbarrier. Its warp 1 adds each step's dQ tile to the fp32 accumulator with bulk
//     reductions (cp.reduce.async.bulk, one per row) from shared memory. Its warp 2, in
//     varlen calls, zeroes the rows of boxes that reach past their sequence (below). Warp 3
//     exits.
//   warpgroups 1 and 2, the consumers, 64 keys each, take the registers given back. Per step:
//       S^T = K Q^T, then dP^T = V dO^T (two commit groups); P^T while dP^T runs;
//       dS^T = P^T o (dP^T - D), to shared memory; dV += P^T dO (P^T from registers);
//       (both consumers' dS^T written) dQ = dS K, this consumer's half of the head dim;
//       dK += dS^T Q (dS^T from shared memory) while dQ's tile goes to shared memory for
//       the writer warp.
//     Q and dO are released as soon as the wgmmas that read them are done, so the producer
//     loads step it + 2 while step it + 1 runs.
// Named barriers: the consumers meet once per step (every dS^T written before dQ reads it),
// and the writer warp and the consumers hand the dQ tile back and forth.
//
// Softcap, ALiBi and dropout run in its general variant (general_probabilities_and_ds: P^T and
// dS^T together once dP^T is in); in deterministic mode the key blocks add to each dQ tile in
// their order (write_dq).
// It takes dense and varlen calls (no block table). Dense tensors are the 4-D boxes TMA reads,
// rows past a sequence's end filled with zeros. A varlen batch is one tensor of all its
// sequences' rows (cu_seqlens): a box at a sequence's end reads rows of the next one, or rows
// seqused_k leaves out, which nothing promises to be finite (and 0 x NaN is NaN), so the
// tail warp zeroes those rows of K and V, and of a step's Q and dO, once they have landed:
// the arithmetic then sees what a dense call sees. The stats come from the preprocess in a
// padded copy (BackwardKernelParams::lse_log2, delta_padded, padded_stats_row), rows rounded
// up to whole 64-row steps, so that each step's 256 bytes are one bulk copy inside the buffer
// and rows past the end give P = 0 (lse log2(e) = +inf there).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/kernel_code.cuh"
#include "cuda/common/per_device.hpp"
#include "cuda/common/tile_order.cuh"
#include "cuda/devices.hpp"
#include "cuda/sm90/backward_kernel.cuh"
#include "cuda/sm90/pipeline.cuh"
#include "cuda/sm90/tensor_maps.hpp"

namespace flashattn::detail::cuda::sm90 {

template <typename Element_, int kHeadDim_>
struct WsBackwardConfig {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;  // 64 or 128: dK and dV of 64 keys in registers
  static constexpr int kBlockN = 128;         // keys per CTA: 64 per consumer
  static constexpr int kBlockM = 64;          // query rows per step
  static constexpr int kStages = 2;           // Q and dO buffers each
  static constexpr int kConsumers = 2;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kPanels = kHeadDim / 64;
  static constexpr int kKBytes = kBlockN * kHeadDim * 2;  // K or V
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;  // Q or dO, per stage
  static constexpr int kDsBytes = kBlockN * kBlockM * 2;  // dS^T: [key][row], one 128-byte panel
  static constexpr int kStatBytes = kBlockM * 4;          // lse log2(e) or D, per stage
  // The dQ tile in fp32, rows as in the accumulator (kHeadDim floats), so that one bulk
  // reduction adds the whole tile; 16-byte chunks swizzled (dq_chunk) in both.
  static constexpr int kDqRowBytes = kHeadDim * 4;
  static constexpr int kDqBytes = kBlockM * kDqRowBytes;
  static constexpr int kDsOffset = 2 * kKBytes + 2 * kStages * kQBytes;  // dS^T, from K's start
  static constexpr int kDqOffset = kDsOffset + kDsBytes;                 // the dQ tile, likewise
  // kv_full, q/do full/empty per stage, kv_landed, q/do landed per stage (a varlen box whose
  // rows past the sequence the tail warp zeroes lands there first).
  static constexpr int kBarriers = 2 + 6 * kStages;
  // Every consumer thread arrives on the empty barriers: each has read the stage's lse or D
  // with plain shared loads, and its own arrival (release) orders those reads before the
  // producer's next copy into the stage. One elected thread after the consumers' named
  // barrier orders them too by the memory model's cumulativity, but compute-sanitizer's
  // racecheck does not follow that chain and reports every such read (dev/racecheck_bulk_copy.cu).
  static constexpr int kEmptyArrivals = 128 * kConsumers;
  // 1 KiB to align the base to a swizzle atom; K, V, the Q and dO rings and dS^T (each a
  // multiple of 1 KiB), the dQ tile, the stats, the barriers. 100 KiB at 64, 182 KiB at 128.
  static constexpr int kSharedBytes =
      1024 + 2 * kKBytes + 2 * kStages * kQBytes + kDsBytes + kDqBytes + 2 * kStages * kStatBytes + 8 * kBarriers;
  // The launch gives every thread 168 registers (64,512 of the SM's 65,536 for 384 threads);
  // setmaxnreg moves them: 128 x 24 + 256 x 240 = 64,512. (A consumer's claim waits until the
  // producer has given back enough: asking more than the launch gave hangs the CTA.)
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;
  static_assert(kHeadDim == 64 || kHeadDim == 128, "head-dim buckets 64 and 128");
  static_assert(sizeof(Element) == 2, "16-bit elements: 64 of them fill a 128-byte row");
};

// The kernel's parameters: the tensor maps of q and dout (boxes of a step's 64 rows), k and v
// (the CTA's 128 keys), and the call.
struct WsBackwardArgs {
  CUtensorMap q, k, v, dout;
  BackwardKernelParams kp;
};

template <typename Cfg>
struct WsBackwardShared {
  uint32_t k, v, q, dout, ds, dq, lse, delta;  // shared addresses; q, dout, lse, delta: kStages each
  unsigned char* generic;                       // k's generic address
  uint64_t* barriers;

  __device__ explicit WsBackwardShared(unsigned char* raw) {
    const uint32_t base = ptx::shared_address(raw);
    generic = raw + (((base + 1023) & ~1023u) - base);
    k = ptx::shared_address(generic);
    v = k + Cfg::kKBytes;
    q = v + Cfg::kKBytes;
    dout = q + Cfg::kStages * Cfg::kQBytes;
    ds = k + Cfg::kDsOffset;
    dq = k + Cfg::kDqOffset;
    lse = dq + Cfg::kDqBytes;
    delta = lse + Cfg::kStages * Cfg::kStatBytes;
    barriers = reinterpret_cast<uint64_t*>(generic + (delta + Cfg::kStages * Cfg::kStatBytes - k));
  }
  __device__ Mbarrier kv_full() const { return {barriers}; }
  __device__ Mbarrier q_full(int stage) const { return {barriers + 1 + 4 * stage}; }
  __device__ Mbarrier q_empty(int stage) const { return {barriers + 2 + 4 * stage}; }
  __device__ Mbarrier do_full(int stage) const { return {barriers + 3 + 4 * stage}; }
  __device__ Mbarrier do_empty(int stage) const { return {barriers + 4 + 4 * stage}; }
  __device__ Mbarrier kv_landed() const { return {barriers + 1 + 4 * Cfg::kStages}; }
  __device__ Mbarrier q_landed(int stage) const { return {barriers + 2 + 4 * Cfg::kStages + 2 * stage}; }
  __device__ Mbarrier do_landed(int stage) const { return {barriers + 3 + 4 * Cfg::kStages + 2 * stage}; }
  __device__ const float* stats(uint32_t at) const {  // a generic pointer into lse or delta
    return reinterpret_cast<const float*>(generic + (at - k));
  }
};

// The named barriers (0 is __syncthreads): every dS^T of a step written (the consumers' 256
// threads), and the dQ tile handed to the writer warp and back (those and its 32).
inline constexpr int kDsWrittenBarrier = 1, kDqFullBarrier = 2, kDqEmptyBarrier = 3;
inline constexpr int kConsumerThreads = 256, kDqHandoffThreads = 256 + 32;

// Where the 16-byte chunk `chunk` (4 floats) of query row i of dQ lies in the tile and in
// the accumulator (BackwardKernelParams::dq_accum_swizzled): within each group of 8 chunks
// (128 bytes) at chunk ^ (i % 8). A warp's float2 stores (8 rows x 4 lanes at one column
// pair) then fall on distinct banks but for the two wavefronts they need anyway; the
// conversion reads the chunks back in place (cuda/backward.cu).
__host__ __device__ __forceinline__ int dq_chunk(int chunk, int64_t i) {
  return (chunk & ~7) | ((chunk ^ static_cast<int>(i & 7)) & 7);
}

// Row i of (b, head) in the padded stats (and i / 64 its dQ turn counter). Dense: the rows of
// (b, head) from (b H + head) padded_rows on. Varlen: per head padded_rows (total_q + 64 B
// rounded up to 64), sequence b from (q_row0 + 64 b) rounded down to 64 on, which is at least
// its whole 64-row steps past the sequence before's start, as FlashAttention-3 lays them out.
__host__ __device__ __forceinline__ int64_t padded_stats_row(const BackwardKernelParams& kp, int b, int head,
                                                             int64_t q_row0, int64_t i) {
  const ForwardParams& p = kp.bp.fwd;
  if (p.is_varlen()) return head * kp.padded_rows + (q_row0 + 64 * int64_t{b}) / 64 * 64 + i;
  return (int64_t{b} * p.heads + head) * kp.padded_rows + i;
}

// Where a varlen box's rows past its sequence begin (kRows: none, or not varlen): the rows of
// the next sequence, or those seqused_k leaves out, lie inside the tensor; past the tensor's
// end TMA fills zeros itself.
template <int kRows>
__device__ __forceinline__ int varlen_zero_from(const ForwardParams& p, int64_t seq_row0, int64_t seqlen,
                                                int64_t total, int64_t first) {
  return p.is_varlen() && seq_row0 + seqlen < total && first + kRows > seqlen ? static_cast<int>(seqlen - first)
                                                                              : kRows;
}
template <typename Cfg>
__device__ __forceinline__ int k_zero_from(const ForwardParams& p, const BackwardBlock& blk) {
  return varlen_zero_from<Cfg::kBlockN>(p, blk.seq.k_row0, blk.seq.seqlen_k, p.total_k, blk.j0);
}
// Of the query rows: only a block's last step (of each head) can reach past its sequence.
template <typename Cfg>
__device__ __forceinline__ int q_zero_from(const ForwardParams& p, const BackwardBlock& blk) {
  return varlen_zero_from<Cfg::kBlockM>(p, blk.seq.q_row0, blk.seq.seqlen_q, p.total_q,
                                        (blk.m_first + blk.m_blocks - 1) * Cfg::kBlockM);
}

// The producer: one thread issues every load. A varlen box that reaches past its sequence
// lands on a barrier of its own (kv_landed, or its stage's q_landed / do_landed), where the
// tail warp zeroes those rows and then arrives on the consumers' barrier.
template <typename Cfg>
__device__ __forceinline__ void produce_backward(const WsBackwardArgs& args, const WsBackwardShared<Cfg>& sh,
                                                 const BackwardBlock& blk) {
  const BackwardKernelParams& kp = args.kp;
  const ForwardParams& p = kp.bp.fwd;
  prefetch_tensor_map(&args.q);
  prefetch_tensor_map(&args.k);
  prefetch_tensor_map(&args.v);
  prefetch_tensor_map(&args.dout);
  // Varlen tensors are one batch element of all the sequences' rows.
  const int batch = p.is_varlen() ? 0 : blk.b;
  {
    const int32_t k_row = static_cast<int32_t>(blk.seq.k_row0 + blk.j0);
    const Mbarrier landed = k_zero_from<Cfg>(p, blk) < Cfg::kBlockN ? sh.kv_landed() : sh.kv_full();
    landed.arrive_expect_bytes(2 * Cfg::kKBytes);
#pragma unroll
    for (int panel = 0; panel < Cfg::kPanels; ++panel) {
      tma_load(sh.k + panel * Cfg::kBlockN * 128, &args.k, panel * 64, k_row, blk.hk, batch, landed);
      tma_load(sh.v + panel * Cfg::kBlockN * 128, &args.v, panel * 64, k_row, blk.hk, batch, landed);
    }
  }
  // The steps as two loops (heads of the group, then query blocks) over 32-bit counters that
  // move by a block: the producer has 24 registers. (The padded stats hold fewer than 2^31
  // rows: Q, 128 bytes or more a row, would not fit in memory.)
  int it = 0;
  const int m_end = static_cast<int>(blk.m_first) + blk.m_blocks;
  const bool last_zeroes = q_zero_from<Cfg>(p, blk) < Cfg::kBlockM;
  const int32_t first_q_row = static_cast<int32_t>(blk.seq.q_row0 + blk.m_first * Cfg::kBlockM);
#pragma unroll 1
  for (int head = blk.hk * blk.group; head < (blk.hk + 1) * blk.group; ++head) {
    uint32_t stats_row =
        static_cast<uint32_t>(padded_stats_row(kp, blk.b, head, blk.seq.q_row0, blk.m_first * Cfg::kBlockM));
    int32_t q_row = first_q_row;
#pragma unroll 1
    for (int m = static_cast<int>(blk.m_first); m < m_end;
         ++m, ++it, q_row += Cfg::kBlockM, stats_row += Cfg::kBlockM) {
      const RingSlot slot = ring_slot<Cfg::kStages>(it);
      const bool zeroes = last_zeroes && m + 1 == m_end;
      const auto load = [&](const void* map, uint32_t ring, uint32_t stats, const float* stats_src, Mbarrier full,
                            Mbarrier landed, Mbarrier empty) {
        empty.wait(slot.parity ^ 1);
        const Mbarrier arrival = zeroes ? landed : full;
        arrival.arrive_expect_bytes(Cfg::kQBytes + Cfg::kStatBytes);
        const uint32_t dst = ring + slot.stage * Cfg::kQBytes;
#pragma unroll
        for (int panel = 0; panel < Cfg::kPanels; ++panel)
          tma_load(dst + panel * Cfg::kBlockM * 128, map, panel * 64, q_row, head, batch, arrival);
        bulk_load(stats + slot.stage * Cfg::kStatBytes, stats_src, Cfg::kStatBytes, arrival);
      };
      load(&args.q, sh.q, sh.lse, kp.lse_log2 + stats_row, sh.q_full(slot.stage), sh.q_landed(slot.stage),
           sh.q_empty(slot.stage));
      load(&args.dout, sh.dout, sh.delta, kp.delta_padded + stats_row, sh.do_full(slot.stage),
           sh.do_landed(slot.stage), sh.do_empty(slot.stage));
    }
  }
}

// Zeroes rows [from, kRows) of a tile of kRows rows (kPanels panels of 128-byte rows) that has
// landed, by the 32 lanes of the calling warp, and makes the zeros visible to the wgmmas.
template <int kRows, int kPanels>
__device__ __forceinline__ void zero_tile_rows(uint32_t tile, int from, int lane) {
  // Whole 128-byte rows of every panel (the swizzle only permutes chunks within a row).
  for (int r = from; r < kRows; ++r)
#pragma unroll
    for (int panel = 0; panel < kPanels; ++panel) ptx::st_shared_32(tile + (panel * kRows + r) * 128 + lane * 4, 0u);
  ptx::fence_proxy_async_shared();
  __syncwarp();
}

// The tail warp (varlen calls): the rows past the sequence of the boxes the producer sent to
// the landed barriers, zeroed before the consumers see them, so that the arithmetic sees what
// a dense call sees (0 x NaN is NaN, and nothing promises those rows to be finite). A stage's
// landed barrier is armed again only after the consumers have released the stage, which they
// do after this warp's arrival: its phases are this warp's count of that stage's tails.
template <typename Cfg>
__device__ __forceinline__ void zero_varlen_tails(const WsBackwardShared<Cfg>& sh, const BackwardBlock& blk,
                                                  const ForwardParams& p, int lane) {
  const int k_from = k_zero_from<Cfg>(p, blk);
  if (k_from < Cfg::kBlockN) {
    sh.kv_landed().wait(0);
    zero_tile_rows<Cfg::kBlockN, Cfg::kPanels>(sh.k, k_from, lane);
    zero_tile_rows<Cfg::kBlockN, Cfg::kPanels>(sh.v, k_from, lane);
    if (lane == 0) sh.kv_full().arrive();
  }
  const int q_from = q_zero_from<Cfg>(p, blk);
  if (q_from >= Cfg::kBlockM) return;
  uint32_t tails_of_stage = 0;  // bit s: the parity of stage s's next tail
#pragma unroll 1
  for (int g = 0; g < blk.group; ++g) {
    const int stage = ring_slot<Cfg::kStages>(g * blk.m_blocks + blk.m_blocks - 1).stage;
    const uint32_t parity = (tails_of_stage >> stage) & 1;
    tails_of_stage ^= 1u << stage;
    sh.q_landed(stage).wait(parity);
    zero_tile_rows<Cfg::kBlockM, Cfg::kPanels>(sh.q + stage * Cfg::kQBytes, q_from, lane);
    if (lane == 0) sh.q_full(stage).arrive();
    sh.do_landed(stage).wait(parity);
    zero_tile_rows<Cfg::kBlockM, Cfg::kPanels>(sh.dout + stage * Cfg::kQBytes, q_from, lane);
    if (lane == 0) sh.do_full(stage).arrive();
  }
}

// The writer warp: each step's dQ tile from shared memory into the accumulator as one bulk
// reduction of its rows within the sequence (the tile's rows are the accumulator's, 64
// consecutive rows of one head), then the tile back to the consumers once it has been read.
// In deterministic mode (kp.dq_turns) the key blocks that add to a tile take turns in their
// order: the keys that rows [m0, m0 + 64) see are one range (each row's range starts and ends
// no earlier than the row before's, and overlaps it), starting at the first row's first key,
// so the blocks adding to it are n_first .. n_last with none missing, and block n waits for
// the tile's counter to reach n - n_first, adds, waits for its addition to complete, and moves
// the counter on. A block only waits for blocks the hardware started before it (lower
// linear index, tile_order.cuh), which never wait for it.
template <typename Cfg>
__device__ __forceinline__ void write_dq(const WsBackwardArgs& args, const WsBackwardShared<Cfg>& sh,
                                         const BackwardBlock& blk, int lane) {
  const BackwardKernelParams& kp = args.kp;
  if (blk.steps == 0) return;
  named_barrier_arrive(kDqEmptyBarrier, kDqHandoffThreads);  // the tile starts free
  BackwardBlock::Step step = blk.first_step();
  for (int it = 0; it < blk.steps; ++it, step = blk.next(step)) {
    const int64_t m0 = blk.first_row<Cfg::kBlockM>(step);
    named_barrier_sync(kDqFullBarrier, kDqHandoffThreads);
    if (lane == 0) {
      const ForwardParams& p = kp.bp.fwd;
      const int64_t left = blk.seq.seqlen_q - m0;
      const int rows = left < Cfg::kBlockM ? static_cast<int>(left) : Cfg::kBlockM;
      int* turns = nullptr;
      int turn = 0;
      if (kp.dq_turns != nullptr) {
        turns = kp.dq_turns + padded_stats_row(kp, blk.b, step.head, blk.seq.q_row0, m0) / Cfg::kBlockM;
        const int64_t first_key = visible_keys(m0, blk.seq.seqlen_q, blk.seq.seqlen_k, p.window_left,
                                               p.window_right).begin;
        turn = static_cast<int>(blk.j0 / Cfg::kBlockN - first_key / Cfg::kBlockN);
        while (ptx::ld_acquire_gpu(turns) != turn) {
        }
        ptx::fence_proxy_async_global();
      }
      ptx::bulk_reduce_add_f32(kp.dq_accum + sm80::row_index(p, blk.b, step.head, blk.seq.q_row0, m0) * kp.accum_dim,
                               sh.dq,
                               static_cast<uint32_t>(rows * Cfg::kDqRowBytes));
      if (turns != nullptr) {
        ptx::bulk_wait_all();
        ptx::fence_proxy_async_global();
        ptx::st_release_gpu(turns, turn + 1);
      } else {
        ptx::bulk_wait_read();
      }
    }
    __syncwarp();
    // The last step's tile is not handed back: every arrival then has its wait.
    if (it + 1 < blk.steps) named_barrier_arrive(kDqEmptyBarrier, kDqHandoffThreads);
  }
  if (lane == 0) ptx::bulk_wait_all();  // the reduction completes before the CTA's memory goes
}

// kGeneral: softcap, ALiBi or dropout (general_probabilities_and_ds); plain calls run a kernel
// without that code.
template <typename Cfg, bool kGeneral>
__device__ __forceinline__ void consume_backward(const WsBackwardArgs& args, const WsBackwardShared<Cfg>& sh,
                                                 const BackwardBlock& blk, int consumer) {
  using Element = typename Cfg::Element;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHeadDim = Cfg::kHeadDim;
  using TMma = ptx::Wgmma<Element, kBlockM>;       // S^T, dP^T: 64 keys x 64 rows
  using KvMma = ptx::Wgmma<Element, kHeadDim>;     // dV, dK: 64 keys x head dim
  using QMma = ptx::Wgmma<Element, kHeadDim / 2>;  // dQ: 64 rows x half the head dim
  constexpr int kTTiles = kBlockM / 8;
  constexpr float kLog2e = 1.4426950408889634f;
  const BackwardKernelParams& kp = args.kp;
  const ForwardParams& p = kp.bp.fwd;

  // The thread index read afresh where the main loop needs values derived from it (this
  // lane's keys, its store addresses): derived once at the start, they would be registers
  // held through the loop, and at head dim 128 spilled. The shared base likewise.
  const auto fresh_tid = [] {
    uint32_t tid;
    asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(tid));
    return static_cast<int>(tid);
  };
  // This lane's keys in the block: key0 (consumer * 64 + warp * 16 + lane / 4) and key0 + 8.
  const auto lane_key0 = [](int tid) { return (tid - 128) / 32 * 16 + tid % 32 / 4; };

  // Descriptors as in the key-parallel kernel (a k-step or a stage moves the start only).
  const uint64_t k_a = ptx::wgmma_descriptor(sh.k + consumer * 64 * 128, 16, 1024);
  const uint64_t v_a = ptx::wgmma_descriptor(sh.v + consumer * 64 * 128, 16, 1024);
  const uint64_t q_b = ptx::wgmma_descriptor(sh.q, 16, 1024), do_b = ptx::wgmma_descriptor(sh.dout, 16, 1024);
  const uint64_t q_mn = ptx::wgmma_descriptor(sh.q, kBlockM * 128, 1024);
  const uint64_t do_mn = ptx::wgmma_descriptor(sh.dout, kBlockM * 128, 1024);
  // dS^T: as dQ's A read MN-major (dS, all 128 keys), and as dK's A read K-major (this
  // consumer's 64 keys, one 128-byte row of query rows each).
  const uint64_t ds_mn = ptx::wgmma_descriptor(sh.ds, 1024, 1024);
  const uint64_t ds_a = ptx::wgmma_descriptor(sh.ds + consumer * 64 * 128, 16, 1024);
  const int dq_col0 = consumer * (kHeadDim / 2);
  const uint64_t k_mn =
      ptx::wgmma_descriptor(sh.k + dq_col0 / 64 * kBlockN * 128 + dq_col0 % 64 * 2, kBlockN * 128, 1024);

  float dk[kHeadDim / 2] = {}, dv[kHeadDim / 2] = {};
  uint32_t pf[kBlockM / 16][4] = {};
  const float score_scale = p.softmax_scale * kLog2e;

  if (blk.steps > 0) sh.kv_full().wait(0);
  BackwardBlock::Step step = blk.first_step();
  for (int it = 0; it < blk.steps; ++it) {
    const RingSlot slot = ring_slot<Cfg::kStages>(it);
    const int stage = slot.stage;
    const int64_t m0 = blk.first_row<kBlockM>(step);
    const uint64_t stage_offset = (stage * Cfg::kQBytes) >> 4;
    // Declared per step: the wgmmas that overwrite them take them as read-write operands, so
    // declared outside the loop they would stay live from one step to the next (96 registers
    // at head dim 128, and a spill).
    float st[kBlockM / 2] = {}, dpt[kBlockM / 2] = {};
    float dq[kHeadDim / 4] = {};

    // S^T = K Q^T, then dP^T = V dO^T in a second group: P^T is computed while dP^T runs.
    sh.q_full(stage).wait(slot.parity);
    ptx::wgmma_hold(st);
    ptx::wgmma_hold(dpt);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk)
      TMma::ss(st, k_a + panel_step(kk, kBlockN), q_b + stage_offset + panel_step(kk, kBlockM), kk > 0);
    ptx::wgmma_commit();
    sh.do_full(stage).wait(slot.parity);
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk)
      TMma::ss(dpt, v_a + panel_step(kk, kBlockN), do_b + stage_offset + panel_step(kk, kBlockM), kk > 0);
    ptx::wgmma_commit();
    // Dropout's keep bits of this lane's two keys, drawn while S^T and dP^T run (they depend
    // on no data; drawn after dP^T arrived, the Philox rounds stood alone between the matrix
    // products). One word each.
    uint32_t keep[2] = {~0u, ~0u};
    if constexpr (kGeneral) {
      if (kp.has_dropout) {
        const int key0 = lane_key0(fresh_tid());
#pragma unroll
        for (int r = 0; r < 2; ++r)
          keep[r] = dropout_keep_mask<kBlockM>(kp.dropout, static_cast<uint32_t>(blk.b),
                                               static_cast<uint32_t>(step.head),
                                               static_cast<uint32_t>(m0 + p.query_position0),
                                               static_cast<uint32_t>(blk.j0 + key0 + r * 8 + p.key_position0));
      }
    }
    ptx::wgmma_wait<1>();  // S^T
    ptx::wgmma_hold(st);
    const float* lse_cols = sh.stats(sh.lse + stage * Cfg::kStatBytes);
    if constexpr (!kGeneral)
      probabilities_from_scores<kBlockM, true>(st, lse_cols, blk, p, m0, lane_key0(fresh_tid()), score_scale,
                                               blk.needs_mask(step));

    // dS^T = P^T o (dP^T - D), D per column, into shared memory (16-bit) for dQ and dK. dV is
    // issued after it, as in FlashAttention-3: P^T's fragments are then not held through it
    // (the consumers' 240 registers hold dK, dV, S^T and dP^T at that point).
    ptx::wgmma_wait<0>();  // dP^T
    ptx::wgmma_hold(dpt);
    // This lane's columns of D: t * 8 + 2 (lane % 4) + 0..1.
    const float* d_cols = sh.stats(sh.delta + stage * Cfg::kStatBytes) + fresh_tid() % 4 * 2;
    if constexpr (kGeneral) {
      const float slope =
          p.alibi_slopes != nullptr ? p.alibi_slopes[blk.b * p.alibi_batch_stride + step.head] : 0.0f;
      general_probabilities_and_ds<kBlockM>(st, dpt, lse_cols, d_cols, blk, p, m0, lane_key0(fresh_tid()), slope,
                                            blk.needs_mask(step), kp.has_dropout ? &kp.dropout : nullptr, keep);
    } else {
#pragma unroll
      for (int t = 0; t < kTTiles; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) dpt[4 * t + i] = st[4 * t + i] * (dpt[4 * t + i] - d_cols[t * 8 + i % 2]);
    }
    const int ds_tid = fresh_tid();  // the stores' addresses from it (see fresh_tid)
    uint32_t ds_base = sh.k;
    asm volatile("" : "+r"(ds_base));
    const int ds_key = lane_key0(ds_tid);
    ds_base += Cfg::kDsOffset + (ds_tid % 4) * 4;
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int t = 0; t < kTTiles; ++t)
        ptx::st_shared_32(ds_base + swizzled_offset<kBlockN>(ds_key + r * 8, t * 8),
                          ptx::pack2<Element>(dpt[4 * t + 2 * r], dpt[4 * t + 2 * r + 1]));
    // P^T as A fragments (16 rows of the block each), then dV += P^T dO.
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk)
#pragma unroll
      for (int i = 0; i < 4; ++i) pf[kk][i] = ptx::pack2<Element>(st[8 * kk + 2 * i], st[8 * kk + 2 * i + 1]);
    ptx::wgmma_hold(dv);
    ptx::wgmma_hold(pf);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) KvMma::rs(dv, pf[kk], do_mn + stage_offset + kk * kRows16);
    ptx::wgmma_commit();
    ptx::fence_proxy_async_shared();
    named_barrier_sync(kDsWrittenBarrier, kConsumerThreads);  // both consumers' dS^T

    // dQ (64 rows x this consumer's half of the head dim) = dS K over all 128 keys.
    ptx::wgmma_hold(dq);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) QMma::ss_mn(dq, ds_mn + kk * kRows16, k_mn + kk * kRows16, kk > 0);
    ptx::wgmma_commit();
    ptx::wgmma_wait<1>();  // dV: dO is free
    ptx::wgmma_hold(dv);
    ptx::wgmma_hold(pf);
    sh.do_empty(stage).arrive();  // every thread: see kEmptyArrivals
    // dK += dS^T Q (dS^T of this consumer's keys from shared memory) while dQ's tile goes to
    // the writer warp.
    ptx::wgmma_hold(dk);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk)
      KvMma::ss_kmn(dk, ds_a + ((kk * 32) >> 4), q_mn + stage_offset + kk * kRows16, 1);
    ptx::wgmma_commit();
    ptx::wgmma_wait<1>();  // dQ
    ptx::wgmma_hold(dq);
    named_barrier_sync(kDqEmptyBarrier, kDqHandoffThreads);  // the writer has read the last tile
    // Addresses from the thread index read afresh, as for dS^T above. Row i = warp * 16 +
    // lane / 4 + 8 r, so i % 8 = lane / 4; column dq_col0 + 8 t + quad_col is chunk
    // dq_col0 / 4 + 2 t + quad_col / 4, at byte (quad_col % 4) * 4 = (lane % 2) * 8 within it.
    const int dq_tid = fresh_tid();
    uint32_t dq_base = sh.k;
    asm volatile("" : "+r"(dq_base));
    const int dq_lane = dq_tid % 32, dq_first_col = (dq_tid / 128 - 1) * (kHeadDim / 2);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint32_t row = dq_base + Cfg::kDqOffset + (dq_tid % 128 / 32 * 16 + dq_lane / 4 + r * 8) * Cfg::kDqRowBytes +
                           (dq_lane % 2) * 8;
#pragma unroll
      for (int t = 0; t < kHeadDim / 16; ++t)
        ptx::st_shared_64(row + dq_chunk(dq_first_col / 4 + 2 * t + (dq_lane % 4) / 2, dq_lane / 4) * 16,
                          dq[4 * t + 2 * r], dq[4 * t + 2 * r + 1]);
    }
    ptx::fence_proxy_async_shared();
    named_barrier_arrive(kDqFullBarrier, kDqHandoffThreads);
    ptx::wgmma_wait<0>();  // dK: Q and this consumer's dS^T are free
    ptx::wgmma_hold(dk);
    sh.q_empty(stage).arrive();
    step = blk.next(step);
  }

  const int64_t keys_out = blk.stored_k - blk.j0 < kBlockN ? blk.stored_k - blk.j0 : kBlockN;
  store_dk_dv<Element, kHeadDim>(kp, blk, lane_key0(fresh_tid()), 0, keys_out, dk, dv);
}

template <typename Cfg, bool kGeneral>
__global__ void __launch_bounds__(Cfg::kThreads, 1) backward_ws_kernel(const __grid_constant__ WsBackwardArgs args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(16) unsigned char backward_ws_shared[];  // aligned to 1 KiB below
  const WsBackwardShared<Cfg> sh(backward_ws_shared);
  const BackwardBlock blk = backward_block<Cfg::kBlockN, Cfg::kBlockM>(args.kp.bp.fwd);
  if (blk.j0 >= blk.stored_k) return;  // the whole CTA: a key block past the sequence
  const int warpgroup = static_cast<int>(threadIdx.x) / 128;
  if (threadIdx.x == 0) {
    sh.kv_full().init(1);
    sh.kv_landed().init(1);
    for (int s = 0; s < Cfg::kStages; ++s) {
      sh.q_landed(s).init(1);
      sh.do_landed(s).init(1);
      sh.q_full(s).init(1);
      sh.do_full(s).init(1);
      sh.q_empty(s).init(Cfg::kEmptyArrivals);
      sh.do_empty(s).init(Cfg::kEmptyArrivals);
    }
    fence_barrier_init();
  }
  __syncthreads();
  if (warpgroup == 0) {
    release_registers<Cfg::kProducerRegisters>();
    const int warp = static_cast<int>(threadIdx.x) / 32;
    if (warp == 0 && threadIdx.x == 0 && blk.steps > 0) produce_backward<Cfg>(args, sh, blk);
    if (warp == 2 && args.kp.bp.fwd.is_varlen() && blk.steps > 0)
      zero_varlen_tails<Cfg>(sh, blk, args.kp.bp.fwd, static_cast<int>(threadIdx.x) % 32);
    if (warp == 1) write_dq<Cfg>(args, sh, blk, static_cast<int>(threadIdx.x) % 32);
    return;
  }
  claim_registers<Cfg::kConsumerRegisters>();
  consume_backward<Cfg, kGeneral>(args, sh, blk, warpgroup - 1);
#else
  __trap();  // compiled for sm_90a only; the host launches it only where that code is loaded
#endif
}

// Whether the kernel for Cfg can take the call here (its sm_90a code loaded, its shared memory
// fits, every tensor TMA-describable), encoding the tensor maps into `args` if so.
template <typename Cfg>
bool prepare_ws_backward(const BackwardKernelParams& kp, WsBackwardArgs& args) {
  static PerDevice<bool> sm90_code;
  if (!sm90_code.get([] { return kernel_ptx_version(backward_ws_kernel<Cfg, false>) >= 90; }) ||
      Cfg::kSharedBytes > shared_bytes_per_block_limit())
    return false;
  const ForwardParams& p = kp.bp.fwd;
  const BackwardParams& bp = kp.bp;
  // dout is addressed like out, with its own strides.
  TiledTensor dout = tiled_out(p);
  dout.base = bp.dout;
  dout.row_stride = bp.dout_row_stride;
  dout.head_stride = bp.dout_head_stride;
  dout.batch_stride = bp.dout_batch_stride;
  return encode_tiled(args.q, tiled_q(p), Cfg::kBlockM) && encode_tiled(args.k, tiled_k(p), Cfg::kBlockN) &&
         encode_tiled(args.v, tiled_v(p), Cfg::kBlockN) && encode_tiled(args.dout, dout, Cfg::kBlockM);
}

// One CTA per key block (heavier first under the masks, tile_order.cuh), as the cp.async kernel.
template <typename Cfg>
void launch_ws_backward(const WsBackwardArgs& args) {
  static PerDevice<bool> shared_bytes_allowed;
  shared_bytes_allowed.get([] {
    allow_shared_bytes(backward_ws_kernel<Cfg, false>, Cfg::kSharedBytes);
    allow_shared_bytes(backward_ws_kernel<Cfg, true>, Cfg::kSharedBytes);
    return true;
  });
  const ForwardParams& p = args.kp.bp.fwd;
  if (p.seqlen_k == 0) return;
  const dim3 grid = attention_grid((p.seqlen_k + Cfg::kBlockN - 1) / Cfg::kBlockN, p.heads_k, p.batch,
                                   blocks_work_differs(p.window_left, p.window_right));
  const auto stream = static_cast<cudaStream_t>(p.stream);
  if (p.softcap > 0.0f || p.alibi_slopes != nullptr || args.kp.has_dropout)
    backward_ws_kernel<Cfg, true><<<grid, Cfg::kThreads, Cfg::kSharedBytes, stream>>>(args);
  else
    backward_ws_kernel<Cfg, false><<<grid, Cfg::kThreads, Cfg::kSharedBytes, stream>>>(args);
}

// The TMA kernel takes buckets 64 and 128; at 256 dK and dV of 64 keys do not fit a
// consumer's registers, and the cp.async kernel's split layout runs there.
constexpr bool has_ws_backward(int head_dim_bucket) { return head_dim_bucket == 64 || head_dim_bucket == 128; }
template <typename Element, int kHeadDim>
bool prepare_ws_backward_for(const BackwardKernelParams& kp, WsBackwardArgs& args) {
  if constexpr (has_ws_backward(kHeadDim))
    return prepare_ws_backward<WsBackwardConfig<Element, kHeadDim>>(kp, args);
  else
    return false;
}
template <typename Element, int kHeadDim>
void launch_ws_backward_for(const WsBackwardArgs& args) {
  if constexpr (has_ws_backward(kHeadDim)) launch_ws_backward<WsBackwardConfig<Element, kHeadDim>>(args);
}

// Defined once per (dtype, bucket) in its own generated file (the two above): false, and no
// launch, at the buckets without the kernel. The caller fills args.kp (the padded stats, the
// accumulator) between the two.
template <typename Element, int kHeadDim>
bool prepare_backward_ws(const BackwardKernelParams& kp, WsBackwardArgs& args);
template <typename Element, int kHeadDim>
void launch_backward_ws(const WsBackwardArgs& args);

}  // namespace flashattn::detail::cuda::sm90

// The warp-specialised sm90 (Hopper) forward kernel, FlashAttention-3's design on our own
// primitives (cuda/sm90/pipeline.cuh, cuda/common/wgmma.cuh).
//
// A CTA has one producer warpgroup and two or three consumers. Warpgroup 0 is the producer:
// it gives most of its registers back (setmaxnreg) and one of its threads issues every load
// as a TMA copy (cuda/sm90/tensor_maps.hpp) into shared memory: Q once per tile, K and V
// block after block into rings of kStages buffers, each buffer guarded by a "full" mbarrier
// (the copy has landed) and an "empty" one (every consumer is done with it). The consumers
// take the registers the producer gave back, and each owns 64 of the tile's kBlockM = 128 or
// 192 query rows. Per key block n a consumer
//
//   waits for K(n), then (ping-pong) for its turn at the tensor cores;
//   issues S(n) = Q K(n)^T and O += P(n - 1) V(n - 1) back to back, and passes the turn on;
//   waits for S(n) only, releases K(n), and runs block n's mask and online softmax while
//       its P V still runs (and, with ping-pong, while the other consumers' wgmmas run);
//   waits for V(n), then for P V, releases V(n - 1), rescales O and turns S(n) into P(n).
//
// The turn (a named barrier per consumer, passed round a ring) makes the consumers issue
// their wgmmas one after another, so that one's softmax (MUFU and FMA work) overlaps the
// others' matrix products. The producer runs ahead by up to kStages blocks and into the next
// tile. Each warp writes its 16 rows of O into a shared buffer in the swizzled layout and one
// of its threads stores them with TMA.
// Where shared memory holds a buffer for O beside Q (head dims up to 192), Q is released
// after the tile's last S and the next tile's Q loads under the last P V and the epilogue;
// at 256 O is staged in the warp's own rows of Q, released after the store has read them.
//
// It takes dense and varlen calls (no block table). Dense tensors are 4-D boxes TMA reads
// directly, rows past a sequence's end filled with zeros. A varlen batch is one tensor of all
// its sequences' rows (cu_seqlens): a block at a sequence's end reads rows of the next one,
// where keys are masked anyway and the producer warp zeroes the values' rows (0 x NaN is NaN,
// and seqused_k leaves rows of the caller's memory that nothing promises to be finite), and a
// warp whose 16 rows of O cross the sequence's end stores its rows itself instead of by TMA.
// Every forward feature: masks, GQA, LSE, and in the general variant softcap, ALiBi, dropout
// and any scale, on the sm80 kernels' code for them (cuda/common/online_softmax.cuh). The
// plain variant keeps raw dot products in S and folds the scale into the exponent; the general
// one turns S into scores first (modify_scores_row, ScoreScales) and applies dropout's 1 / (1 - p)
// once in the epilogue.
#pragma once

#include <cuda.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common/params.hpp"
#include "common/philox.hpp"
#include "cuda/common/online_softmax.cuh"
#include "cuda/common/ptx.cuh"
#include "cuda/common/wgmma.cuh"
#include "cuda/sm90/forward_tiles.cuh"
#include "cuda/sm90/pipeline.cuh"

namespace flashattn::detail::cuda::sm90 {

template <typename Element_, int kHeadDim_, int kBlockN_, int kStages_, bool kPingPong_, bool kHasGeneral_ = true,
          int kConsumers_ = 2, bool kSeqlenMajorValues_ = false>
struct WsForwardConfig {
  using Element = Element_;
  // FP8 (e4m3) inputs: out is bf16, and V is transposed in shared memory (transpose_values),
  // unless the caller gives it (d, seqlen)-major (kSeqlenMajorValues): TMA then loads its
  // columns as the transposed tiles themselves, and the consumers put P's registers in key
  // order (s_to_p).
  static constexpr bool kFp8 = sizeof(Element) == 1;
  static constexpr bool kSeqlenMajorValues = kSeqlenMajorValues_;
  static constexpr bool kTransposes = kFp8 && !kSeqlenMajorValues;
  using OutElement = std::conditional_t<kFp8, __nv_bfloat16, Element>;
  static constexpr int kPanelCols = 128 / static_cast<int>(sizeof(Element));  // a 128-byte row
  static constexpr int kKStep = 32 / static_cast<int>(sizeof(Element));      // k of one wgmma
  static constexpr int kHeadDim = kHeadDim_;  // whole 128-byte panels
  static constexpr int kBlockN = kBlockN_;    // keys per block: an N of wgmma.cuh
  static constexpr int kStages = kStages_;    // K and V buffers each
  static constexpr bool kPingPong = kPingPong_;
  // Whether the general variant (softcap, ALiBi, dropout ...) is compiled for this shape; a
  // shape without it takes plain calls only.
  static constexpr bool kHasGeneral = kHasGeneral_;
  static constexpr int kConsumers = kConsumers_;  // warpgroups of 64 query rows: 2 or 3
  // Whether varlen calls may take this shape: at three consumers' 160 registers the epilogue's
  // varlen branch (rows of O stored by the warp) makes ptxas spill in the main loop.
  static constexpr bool kTakesVarlen = kConsumers == 2;
  static constexpr int kBlockM = 64 * kConsumers;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kPanels = kHeadDim / kPanelCols;
  static constexpr int kQBytes = kBlockM * kHeadDim * static_cast<int>(sizeof(Element));
  static constexpr int kTileBytes = kBlockN * kHeadDim * static_cast<int>(sizeof(Element));
  // FP8's transposed V tile: a 128-byte row per head-dim column, its first kBlockN bytes the
  // block's keys (the swizzle's row; 64-key blocks leave half of each row unused). A
  // (d, seqlen)-major V tile has that layout as TMA loads it (128 keys: kTileBytes).
  static constexpr int kVtBytes = kTransposes ? kHeadDim * 128 : 0;
  // The rings: K and V, and with FP8 V's transposed copies (Vt), a full and an empty barrier
  // per buffer; the producer's other three warps transpose.
  static constexpr int kRings = kTransposes ? 3 : 2;
  static constexpr int kTransposeWarps = kTransposes ? 3 : 0;
  static constexpr int kBarrierBytes = 8 * (4 + 2 * kRings * kStages);  // and FP8's end flag
  // 1 KiB to align the base to a swizzle atom, Q, the rings, the barriers, and the O buffer
  // (as large as Q) where the 227 KiB of an H100/H200 CTA hold it; else O is staged in Q's
  // rows. The barriers' area is padded to a whole atom when O's buffer follows it. FP8 stores
  // O (bf16, twice Q's bytes) from registers.
  static constexpr int kBaseBytes = 1024 + kQBytes + kStages * (2 * kTileBytes + kVtBytes);
  static constexpr bool kSeparateO = !kFp8 && kBaseBytes + 1024 + kQBytes <= 227 * 1024;
  static constexpr bool kOInQ = !kFp8 && !kSeparateO;
  static_assert(kBarrierBytes <= 1024, "the barriers fit one atom");
  static constexpr int kSharedBytes = kBaseBytes + (kSeparateO ? 1024 + kQBytes : kBarrierBytes);
  // Registers per thread: 128 x 24 + 256 x 240 = 64,512 of the 65,536 of the SM with two
  // consumers, 128 x 32 + 384 x 160 = 65,536 with three. FP8: the transposing warps beside
  // the TMA warp want 40, 48 at 64-key blocks where two units are in flight
  // (transpose_values; at 40 they spilled 20-24 bytes there; ptxas allocates the two roles
  // together); the consumers take the rest, 232 or 224 (at head dim 256 with 128-key blocks
  // they needed 240 for S 64 + O 128 + P 16, which left the producer 24, where it spilled 84
  // bytes: 256 takes 64-key blocks). At 128-key blocks two units in flight with 48 / 224
  // registers ran at 0.96-0.98x of one with 40 / 232 (H100, 2026-12-07). (d, seqlen)-major
  // values need no transposing warps: 24 / 240 as for 16-bit inputs, which holds S 64 + O 128
  // + P 16 at head dim 256 with 128-key blocks.
  static constexpr int kProducerRegisters = kTransposes ? (kBlockN == 64 ? 48 : 40) : kConsumers == 3 ? 32 : 24;
  static constexpr int kConsumerRegisters = kTransposes ? (kBlockN == 64 ? 224 : 232) : kConsumers == 2 ? 240 : 160;
  static_assert(kConsumers == 2 || kConsumers == 3, "two or three consumer warpgroups");
  // setmaxnreg shares out only the registers the CTA launched with (ptxas gives each thread
  // 65,536 / kThreads rounded down to a multiple of 8): asking for more makes the consumers'
  // setmaxnreg.inc wait forever.
  static_assert(128 * kProducerRegisters + 128 * kConsumers * kConsumerRegisters <=
                    65536 / (128 * (1 + kConsumers)) / 8 * 8 * (128 * (1 + kConsumers)),
                "the register split fits the CTA's launch registers");
  static_assert(kHeadDim % kPanelCols == 0 && kHeadDim <= 256 && kBlockN % 32 == 0 && kBlockN <= 256, "shapes");
  static_assert(sizeof(Element) == 2 || sizeof(Element) == 1, "16-bit or FP8 elements");
  // FP8: a Vt row holds one block's keys within one 128-byte panel, a key block lies in one
  // descale block, and a tile's rows share a q descale.
  static_assert(!kFp8 || ((kBlockN == 64 || kBlockN == 128) && kConsumers == 2 && kBlockM == kFp8ScaleBlockRows),
                "FP8 shapes");
  // A (d, seqlen)-major V tile is one TMA box of 128 keys (128 bytes) by the head dim.
  static_assert(!kSeqlenMajorValues || (kFp8 && kBlockN == 128), "(d, seqlen)-major values: FP8, 128-key blocks");
};

// The kernel's parameters: the four tensor maps (64-byte aligned, read by the TMA unit from
// the parameter space; out's boxes are a warp's 16 rows) and the tiles.
inline constexpr int kOutBoxRows = 16;
struct WsForwardArgs {
  CUtensorMap q, k, v, out;
  ForwardTiles tiles;
  // Paged keys and values (0: none): the rows of k's and v's boxes, which divide both kBlockN
  // and the page size (k and v are then mapped as (num_pages, page_size, Hk, D)); nan_rows
  // maps 128 rows of 64 NaNs (encode_nan_rows), what a key box of a page outside the table's range
  // loads instead.
  int32_t page_box_rows = 0;
  CUtensorMap nan_rows;
};

// The shared-memory carve-up, the same in every thread. The barriers are found by arithmetic
// on one base (a runtime stage indexing an array of pointers would put that array in local
// memory, and its loads in the main loop).
template <typename Cfg>
struct WsShared {
  uint32_t q, k, v;    // shared addresses: Q, then kStages K tiles, then kStages V tiles
  uint32_t vt;         // FP8: then kStages transposed V tiles
  uint32_t o;          // O's staging buffer: after the barriers, or Q itself
  uint64_t* barriers;  // q_full, q_empty, per stage and ring a full and an empty one, tail

  __device__ explicit WsShared(unsigned char* raw) {
    const uint32_t base = ptx::shared_address(raw);
    unsigned char* aligned = raw + (((base + 1023) & ~1023u) - base);
    q = ptx::shared_address(aligned);
    k = q + Cfg::kQBytes;
    v = k + Cfg::kStages * Cfg::kTileBytes;
    vt = v + Cfg::kStages * Cfg::kTileBytes;
    barriers = reinterpret_cast<uint64_t*>(aligned + Cfg::kQBytes + Cfg::kStages * (2 * Cfg::kTileBytes + Cfg::kVtBytes));
    o = Cfg::kSeparateO ? ptx::shared_address(barriers) + 1024 : q;  // the atom after the barriers
  }
  __device__ Mbarrier q_full() const { return {barriers}; }
  __device__ Mbarrier q_empty() const { return {barriers + 1}; }
  // The rings' barriers: kv = kKeysRing, kValuesRing or (FP8) kTransposedRing.
  __device__ Mbarrier full(int kv, int stage) const { return {barriers + 2 + 2 * Cfg::kRings * stage + 2 * kv}; }
  __device__ Mbarrier empty(int kv, int stage) const { return {barriers + 3 + 2 * Cfg::kRings * stage + 2 * kv}; }
  // Where a varlen tile's last V block lands before the producer zeroes its rows past the
  // sequence and completes the stage's full barrier itself.
  __device__ Mbarrier tail_landed() const { return {barriers + 2 + 2 * Cfg::kRings * Cfg::kStages}; }
  // FP8: 0 until the producer has issued every V block of the CTA, then their number plus one
  // (transpose_values). Written and read by atomics once the warps run: a transposing warp
  // may read it while the producer writes it.
  __device__ uint32_t* values_end() const {
    return reinterpret_cast<uint32_t*>(barriers + 3 + 2 * Cfg::kRings * Cfg::kStages);
  }
};
// The rings; the consumers read V from the transposed one where FP8's is transposed here
// (kReadValuesRing).
inline constexpr int kKeysRing = 0, kValuesRing = 1, kTransposedRing = 2;
template <typename Cfg>
inline constexpr int kReadValuesRing = Cfg::kTransposes ? kTransposedRing : kValuesRing;

// The kernel's variants: plain calls (raw dot products, the scale folded into the exponent);
// softcap, ALiBi or a non-positive scale (the scores modified first); and dropout, with any of
// those. Dropout has a kernel of its own: its Philox rounds, inlined in the loop beside the
// modifiers, made the loop's code several times longer than what a softcap or ALiBi call runs.
enum class ScoreVariant { Plain, Modified, Dropout };

// The tiles a CTA takes, round by round: round r deals tiles [r G, r G + G) out to the G CTAs,
// every other round in reverse, so that under the masks (tiles in heaviest-first order,
// tile_order.cuh) the CTA that took one round's heaviest tile takes the next one's lightest.
// -1 past the last tile. With one CTA per tile, round 0 is the only one. (The CTA's
// coordinates are read afresh each round: hoisted out of the tile loop, they and the values
// made of them held registers the producer warp does not have, and spilled.)
__device__ __forceinline__ int64_t tile_of_round(const ForwardTiles& tiles, int round) {
  uint32_t cta, ctas;
  asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(cta));
  asm volatile("mov.u32 %0, %%nctaid.x;" : "=r"(ctas));
  const int64_t index = int64_t{round} * ctas + ((round & 1) ? ctas - 1 - cta : cta);
  return index < tiles.tiles ? index : -1;
}

// The producer warp: every load of every tile of this CTA, in the order the consumers read
// them, each as soon as its buffer is free; lane 0 issues them, the whole warp zeroes the
// rows of a varlen tile's last V block that lie past its sequence.
template <typename Cfg>
__device__ __forceinline__ void produce(const WsForwardArgs& args, const WsShared<Cfg>& sh) {
  const ForwardTiles& tiles = args.tiles;
  const ForwardParams& p = tiles.p;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const bool issues = lane == 0;
  if (issues) {
    prefetch_tensor_map(&args.q);
    prefetch_tensor_map(&args.k);
    prefetch_tensor_map(&args.v);
    prefetch_tensor_map(&args.out);
  }
  // Few live values (the producer has 24 or 32 registers): the blocks of the tiles before this
  // one (a tile's K(n) and V(n) take the rings' slots blocks_before + n), and the phases of
  // the barriers waited for once per use, Q's empty one (bit 0) and tail_landed (bit 1).
  int blocks_before = 0;
  uint32_t phases = 0;
  // The ring's next buffer of `kv`, once free: its address and stage. Its copies complete on
  // the stage's full barrier, or on tail_landed where rows are fixed up after landing.
  struct Buffer {
    uint32_t dst;
    int kv, stage;
    bool fixes;
    __device__ Mbarrier full(const WsShared<Cfg>& shared) const { return shared.full(kv, stage); }
    __device__ Mbarrier landed(const WsShared<Cfg>& shared) const { return fixes ? shared.tail_landed() : full(shared); }
  };
  const auto next_buffer = [&](uint32_t ring, int kv, int iteration, bool fixes) {
    const RingSlot slot = ring_slot<Cfg::kStages>(iteration);
    sh.empty(kv, slot.stage).wait(slot.parity ^ 1);
    return Buffer{ring + slot.stage * Cfg::kTileBytes, kv, slot.stage, fixes};
  };
  // After a V buffer's copies have landed, the warp zeroes its rows from `zero_from` on (a
  // block at its sequence's end, whose rows past it are the next sequence's or anything: 0 x
  // NaN is NaN) and completes the stage's full barrier itself. ((d, seqlen)-major values come
  // in dense calls only, launch_forward_ws, so their blocks never need it.)
  const auto fix_rows = [&](const Buffer& buffer, int zero_from) {
    buffer.landed(sh).wait((phases >> 1) & 1);
    phases ^= 2;
    // (The lane behind an opaque copy: computed from `lane`, the addresses are hoisted out of
    // the tile loop and hold registers the producer does not have.)
    int fix_lane = lane;
    asm volatile("" : "+r"(fix_lane));
    // Whole 128-byte rows of every panel: the swizzle only permutes chunks within a row.
    for (int r = zero_from + fix_lane / 8; r < Cfg::kBlockN; r += 4)
#pragma unroll
      for (int panel = 0; panel < Cfg::kPanels; ++panel)
        ptx::st_shared_128(buffer.dst + (panel * Cfg::kBlockN + r) * 128 + (fix_lane % 8) * 16, make_uint4(0, 0, 0, 0));
    ptx::fence_proxy_async_shared();  // the zeros, visible to the wgmmas that read the stage
    __syncwarp();
    if (issues) buffer.full(sh).arrive();
  };
  // Rows [row, row + kBlockN) of the tensor into the ring's next buffer, zeroed from
  // `zero_from` on. (d, seqlen)-major values: one box of those keys by the head dim.
  const auto load_kv = [&](const void* map, uint32_t ring, int kv, int iteration, int64_t row, int head,
                           int batch, int zero_from) {
    const bool zeroes = zero_from < Cfg::kBlockN;
    const Buffer buffer = next_buffer(ring, kv, iteration, zeroes);
    if (issues) {
      buffer.landed(sh).arrive_expect_bytes(Cfg::kTileBytes);
      if (Cfg::kSeqlenMajorValues && kv == kValuesRing) {
        tma_load(buffer.dst, map, static_cast<int32_t>(row), 0, head, batch, buffer.landed(sh));
      } else {
#pragma unroll
        for (int panel = 0; panel < Cfg::kPanels; ++panel)
          tma_load(buffer.dst + panel * Cfg::kBlockN * 128, map, panel * Cfg::kPanelCols, static_cast<int32_t>(row),
                   head, batch, buffer.landed(sh));
      }
    }
    if (zeroes) fix_rows(buffer, zero_from);
  };
  // Paged: keys [j0, j0 + kBlockN) of sequence b (j0 a multiple of kBlockN, so that each box
  // of page_box_rows lies in one page) in boxes of their pages, looked up by the issuing lane
  // (32-bit: keys are below 2^31; the producer has 24 registers). A box past the sequence's
  // keys is never looked up and one whose page lies outside [0, num_pages) is never read: both
  // load at page -1, which TMA fills with zeros without touching memory, but a key box of a
  // bad page loads NaN rows (args.nan_rows), so that the query rows that see it come out NaN.
  const auto load_kv_paged = [&](int kv, int iteration, uint32_t j0, int head, int b, uint32_t seqlen_k) {
    const int box_rows = args.page_box_rows;
    const int zero_from = kv == kValuesRing && j0 + Cfg::kBlockN > seqlen_k
                              ? static_cast<int>(seqlen_k > j0 ? seqlen_k - j0 : 0)
                              : Cfg::kBlockN;
    const Buffer buffer = next_buffer(kv == kKeysRing ? sh.k : sh.v, kv, iteration, zero_from < Cfg::kBlockN);
    if (issues) {
      buffer.landed(sh).arrive_expect_bytes(Cfg::kTileBytes);
#pragma unroll 1
      for (int x = 0; x < Cfg::kBlockN / box_rows; ++x) {
        const uint32_t key = j0 + static_cast<uint32_t>(x * box_rows);
        int32_t page = -1, row = 0;
        if (key < seqlen_k) {
          page = p.block_table[b * p.block_table_batch_stride + key / static_cast<uint32_t>(p.page_size)];
          row = static_cast<int32_t>(key % static_cast<uint32_t>(p.page_size));
        }
        const bool nan = kv == kKeysRing && key < seqlen_k && !page_exists(p, page);
        if (!page_exists(p, page)) page = -1;
#pragma unroll
        for (int panel = 0; panel < Cfg::kPanels; ++panel)
          tma_load(buffer.dst + (panel * Cfg::kBlockN + x * box_rows) * 128,
                   nan ? &args.nan_rows : (kv == kKeysRing ? &args.k : &args.v), nan ? 0 : panel * Cfg::kPanelCols,
                   nan ? 0 : row,
                   nan ? 0 : head, nan ? 0 : page, buffer.landed(sh));
      }
    }
    if (buffer.fixes) fix_rows(buffer, zero_from);
  };
  // Varlen tensors are one batch element of all the sequences' rows.
  const bool varlen = p.is_varlen();
  for (int round = 0; true; ++round) {
    const int64_t index = tile_of_round(tiles, round);
    if (index < 0) break;
    const Tile<Cfg> tile(tiles, index);
    if (tile.rows_here <= 0) continue;
    const int hk = tile.h / p.group_size();
    const int batch = varlen ? 0 : tile.b;
    sh.q_empty().wait((phases & 1) ^ 1);
    phases ^= 1;
    if (issues) {
      sh.q_full().arrive_expect_bytes(Cfg::kQBytes);
#pragma unroll
      for (int panel = 0; panel < Cfg::kPanels; ++panel)
        tma_load(sh.q + panel * Cfg::kBlockM * 128, &args.q, panel * Cfg::kPanelCols,
                 static_cast<int32_t>(tile.seq.q_row0 + tile.m0),
                 tile.h, batch, sh.q_full());
    }
    // K(n) goes a block ahead of V(n - 1): the consumers use them in that order.
    const int64_t k_row0 = tile.seq.k_row0;
    const auto load_v = [&](int n) {
      const int64_t j0 = tile.keys.begin + int64_t{n} * Cfg::kBlockN;
      // Rows past the sequence inside the tensor: the next sequence's or unused (seqused_k).
      const bool inside = varlen && k_row0 + tile.seq.seqlen_k < p.total_k;
      const int zero_from = inside && j0 + Cfg::kBlockN > tile.seq.seqlen_k
                                ? static_cast<int>(tile.seq.seqlen_k - j0)
                                : Cfg::kBlockN;
      load_kv(&args.v, sh.v, kValuesRing, blocks_before + n, k_row0 + j0, hk, batch, zero_from);
    };
    if (args.page_box_rows > 0) {
      // (One running slot and key for both loads: offsets from the tile's start would be
      // hoisted into registers of their own.)
      const int end = blocks_before + tile.n_blocks;
      uint32_t j0 = static_cast<uint32_t>(tile.keys.begin);
      for (; blocks_before <= end; ++blocks_before, j0 += Cfg::kBlockN) {
        if (blocks_before < end)
          load_kv_paged(kKeysRing, blocks_before, j0, hk, tile.b, static_cast<uint32_t>(tile.seq.seqlen_k));
        if (blocks_before > end - tile.n_blocks)
          load_kv_paged(kValuesRing, blocks_before - 1, j0 - Cfg::kBlockN, hk, tile.b,
                        static_cast<uint32_t>(tile.seq.seqlen_k));
      }
      blocks_before = end;
      continue;
    }
    for (int n = 0; n < tile.n_blocks; ++n) {
      load_kv(&args.k, sh.k, kKeysRing, blocks_before + n, k_row0 + tile.keys.begin + int64_t{n} * Cfg::kBlockN, hk,
              batch, Cfg::kBlockN);
      if (n > 0) load_v(n - 1);
    }
    if (tile.n_blocks > 0) load_v(tile.n_blocks - 1);
    blocks_before += tile.n_blocks;
  }
  if constexpr (Cfg::kTransposes) {  // the transposing warps' end: the next V buffer, full of nothing
    const RingSlot slot = ring_slot<Cfg::kStages>(blocks_before);
    sh.empty(kValuesRing, slot.stage).wait(slot.parity ^ 1);
    if (issues) {
      atomicExch(sh.values_end(), static_cast<uint32_t>(blocks_before) + 1);  // the V blocks, plus one
      sh.full(kValuesRing, slot.stage).arrive();  // releases the write to the waiters
    }
  }
}

// FP8: the wgmma of O += P V takes its B operand K-major only (FP8 wgmmas have no
// transpose), so the producer's warps 1-3 copy each V block (kBlockN keys x head dim, as TMA
// loaded it) into the transposed ring: row d of a Vt buffer holds column d of V, its key
// slots the first kBlockN bytes of one 128-byte swizzled row. Within every 32 keys the slots
// are permuted to match P's A fragments, which the consumers pack straight from the S
// accumulators (s_to_p): slot 4 q + i (q < 4, i < 4) of each 16 holds key
// 2 q + (i & 1) + 8 (i >> 1). A unit of work is a 16-column chunk of V, in four rounds: a
// lane takes one slot group (four keys) and one word (4 columns) of the chunk, turned with the
// round, loads it from its four key rows, gathers each column's four bytes (a 4 x 4 byte
// transpose) and stores the column's 32-bit word of slots. A 128-key block's 32 slot groups
// take the warp's 32 lanes; a 64-key block's 16 take each half-warp, the two halves taking
// two units at once, and two such steps are in flight per lane (the loop unrolled), so that
// one's loads wait under the other's work: head dim 256 (64-key blocks) ran at 0.53-0.78x of
// the bf16 kernel with half of each warp idle and one unit at a time, 1.33-1.39x faster with
// this (H100, 2026-12-07). The lanes' stores fall on 32 distinct banks, their loads on 16 (a
// 2-way conflict per load, as Nsight Compute counts). The warps take the V blocks in the
// ring's order up to the producer's count (values_end): they need not walk the tiles, whose
// 64-bit index arithmetic would not fit the producer's registers.
template <typename Cfg>
__device__ __forceinline__ void transpose_values(const WsShared<Cfg>& sh, int transposer) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  constexpr int kSlotGroups = Cfg::kBlockN / 4;      // lanes per unit: 32 or 16
  constexpr int kUnitsAtOnce = 32 / kSlotGroups;     // units per warp step: 1 or 2
  const int group = lane % kSlotGroups;              // the lane's slot group
  // The block-relative key of the group's slot 4 group (the others: + 1, + 8, + 9).
  const int key0 = 32 * (group / 8) + 16 * (group / 4 % 2) + 2 * (group % 4);
  const int slot_chunk = group / 4, slot_word = group % 4;  // the 16-byte chunk and word of Vt rows
  constexpr int kUnits = Cfg::kPanels * 8 * 4;              // (panel, 16-byte chunk, round)
  const int first_unit = transposer * kUnitsAtOnce + lane / kSlotGroups;
  for (int iteration = 0;; ++iteration) {
    const RingSlot slot = ring_slot<Cfg::kStages>(iteration);
    sh.full(kValuesRing, slot.stage).wait(slot.parity);
    // The producer writes the end once every warp here has released the slot of block
    // count - kStages, so a slower warp may read it still before a real block: only the block
    // past the last ends the loop. (A plain flag ended such a warp early, its blocks never
    // transposed, and the consumers waited for them forever: the hang at head dim 256.)
    uint32_t end = 0;
    if (lane == 0) end = atomicOr(sh.values_end(), 0u);
    end = __shfl_sync(0xffffffffu, end, 0);
    if (end != 0 && static_cast<uint32_t>(iteration) + 1 >= end) return;
    sh.empty(kTransposedRing, slot.stage).wait(slot.parity ^ 1);
    const uint32_t from = sh.v + slot.stage * Cfg::kTileBytes, to = sh.vt + slot.stage * Cfg::kVtBytes;
#pragma unroll(kUnitsAtOnce)
    for (int unit = first_unit; unit < kUnits; unit += Cfg::kTransposeWarps * kUnitsAtOnce) {
      const int panel = unit / 32, chunk = unit / 4 % 8, word = (slot_chunk + unit) % 4;
      uint32_t x[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int key = key0 + (i & 1) + 8 * (i >> 1);
        x[i] = ptx::ld_shared_32(from + (panel * Cfg::kBlockN + key) * 128 + ((chunk ^ (key % 8)) << 4) + word * 4);
      }
      // Byte j of the four words is column 4 word + j of the four keys: gather each column.
      const uint32_t ab01 = __byte_perm(x[0], x[1], 0x5140), cd01 = __byte_perm(x[2], x[3], 0x5140);
      const uint32_t ab23 = __byte_perm(x[0], x[1], 0x7362), cd23 = __byte_perm(x[2], x[3], 0x7362);
      const uint32_t columns[4] = {__byte_perm(ab01, cd01, 0x5410), __byte_perm(ab01, cd01, 0x7632),
                                   __byte_perm(ab23, cd23, 0x5410), __byte_perm(ab23, cd23, 0x7632)};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int row = panel * 128 + chunk * 16 + word * 4 + j;
        ptx::st_shared_32(to + row * 128 + ((slot_chunk ^ (row % 8)) << 4) + slot_word * 4, columns[j]);
      }
    }
    ptx::fence_proxy_async_shared();  // the copies, visible to the wgmmas that read them
    __syncwarp();
    if (lane == 0) {
      sh.full(kTransposedRing, slot.stage).arrive();
      sh.empty(kValuesRing, slot.stage).arrive();
    }
  }
}

// The named barriers of the consumers' turn at the tensor cores, passed round a ring:
// consumer c waits on kTurnBarrier + c (its 128 threads and the 128 of the one before it),
// and passes the turn by arriving on the next one's.
inline constexpr int kTurnBarrier = 1;

template <typename Cfg, ScoreVariant kVariant>
__device__ __forceinline__ void consume(const WsForwardArgs& args, const WsShared<Cfg>& sh, int consumer) {
  using Element = typename Cfg::Element;
  using SMma = ptx::Wgmma<Element, Cfg::kBlockN>;   // S = Q K^T: 64 x kBlockN per warpgroup
  using OMma = ptx::Wgmma<Element, Cfg::kHeadDim>;  // O += P V: 64 x kHeadDim per warpgroup
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHeadDim = Cfg::kHeadDim;
  constexpr bool kFp8 = Cfg::kFp8;
  constexpr int kSTiles = kBlockN / 8;   // n8 tiles of S per row pair
  constexpr int kOTiles = kHeadDim / 8;  // n8 tiles of O
  constexpr int kPSteps = kBlockN / Cfg::kKStep;  // P V's wgmmas per block: 16 or (FP8) 32 keys each
  constexpr int kTurnThreads = 2 * 128;
  const ForwardTiles& tiles = args.tiles;
  const ForwardParams& p = tiles.p;

  const int thread = static_cast<int>(threadIdx.x) % 128;  // within the warpgroup
  const int warp = thread / 32, lane = thread % 32;
  const bool releases = thread == 0;  // one arrival per warpgroup on the empty barriers
  const int quad_col = (lane % 4) * 2;
  const auto cta_row = [&](int r) { return consumer * 64 + warp * 16 + lane / 4 + r * 8; };
  constexpr bool kGeneral = kVariant != ScoreVariant::Plain;
  const bool softcap = kGeneral && p.softcap > 0.0f;
  const bool plain = !kGeneral || (!softcap && p.alibi_slopes == nullptr && p.softmax_scale > 0.0f);
  const bool dropout = kVariant == ScoreVariant::Dropout && p.dropout_p > 0.0f;
  const DropoutRng rng = dropout ? make_dropout_rng(p.dropout_seed, p.dropout_offset, p.dropout_p) : DropoutRng{};
  const ScoreScales scales = score_scales(plain, p.softmax_scale, softcap ? p.softcap : 0.0f);
  const float exp_scale = scales.exp;

  const ptx::WgmmaDescriptor q_desc = ptx::wgmma_descriptor(sh.q + consumer * 64 * 128, 16, 1024);
  const ptx::WgmmaDescriptor k_desc = ptx::wgmma_descriptor(sh.k, 16, 1024);
  // V as stored (MN-major B), or FP8's transposed copy or (d, seqlen)-major tile (K-major,
  // like K).
  const ptx::WgmmaDescriptor v_desc = kFp8 ? ptx::wgmma_descriptor(Cfg::kTransposes ? sh.vt : sh.v, 16, 1024)
                                           : ptx::wgmma_descriptor(sh.v, kBlockN * 128, 1024);
  constexpr int kReadValuesBytes = Cfg::kTransposes ? Cfg::kVtBytes : Cfg::kTileBytes;  // a stage
  const auto panel_step = [](int kk, int rows) -> uint32_t {
    return static_cast<uint32_t>(((kk / 4) * rows * 128 + (kk % 4) * 32) >> 4);
  };
  const auto take_turn = [&] {
    if constexpr (Cfg::kPingPong) named_barrier_sync(kTurnBarrier + consumer, kTurnThreads);
  };
  const auto pass_turn = [&] {
    // (With two consumers the other's barrier as 1 - consumer: ptxas allocates the h128
    // general variant without a spill that way, not with the ring's expression.)
    if constexpr (Cfg::kPingPong && Cfg::kConsumers == 2) named_barrier_arrive(kTurnBarrier + 1 - consumer, kTurnThreads);
    if constexpr (Cfg::kPingPong && Cfg::kConsumers == 3)
      named_barrier_arrive(kTurnBarrier + (consumer == 2 ? 0 : consumer + 1), kTurnThreads);
  };
  const auto issue_pv = [&](float (&o)[kOTiles * 4], const uint32_t (&pf)[kPSteps][4], int stage) {
    stage = __shfl_sync(0xffffffffu, stage, 0);  // warp-uniform: v_stage in uniform registers
    const ptx::WgmmaDescriptor v_stage = v_desc + ((stage * kReadValuesBytes) >> 4);
#pragma unroll
    for (int kk = 0; kk < kPSteps; ++kk) OMma::rs(o, pf[kk], v_stage + ((kFp8 ? kk * 32 : kk * 16 * 128) >> 4));
  };
  // Consumer 0 takes the first turn (the last one passes it a turn it did not take).
  if (consumer == Cfg::kConsumers - 1) pass_turn();

  int tile_count = 0, k_iteration = 0, v_iteration = 0;
  for (int round = 0; true; ++round) {
    const int64_t index = tile_of_round(tiles, round);
    if (index < 0) break;
    const Tile<Cfg> tile(tiles, index);
    if (tile.rows_here <= 0) continue;
    const int64_t m0 = tile.m0;
    const SequenceView seq = tile.seq;
    sh.q_full().wait(static_cast<uint32_t>(tile_count & 1));
    // With a buffer of its own for O, Q is released after the tile's last S = Q K^T (every
    // warp of both consumers arrives): the next tile's Q then loads under this tile's end.
    const auto release_q_after_last_s = [&](int n) {
      if constexpr (!Cfg::kOInQ)
        if (n == tile.n_blocks - 1 && lane == 0) sh.q_empty().arrive();
    };
    if (tile.n_blocks == 0) release_q_after_last_s(-1);

    float o[kOTiles * 4] = {};
    float s[kSTiles * 4] = {};
    uint32_t pf[kPSteps][4] = {};
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};

    // FP8's descales (common/params.hpp): the tile's rows share q's factor (kBlockM rows, a
    // descale block) and a key block its k and v factors (blocks aligned, forward_tiles.cuh).
    // Scores are q k^T qd kd: the product is folded into the exponent's scale where one factor
    // serves the tile and it is positive (the plain variant's max of raw dot products then
    // still orders the scores), else S is multiplied by it per block (s_factor). O accumulates
    // in units of a v factor (v_unit): the per-head one, or with per-block factors that of the
    // last block added, O being multiplied by vd(n - 1) / vd(n) with the softmax's rescale
    // before block n's P V (unit_ratio), so that P is rounded to e4m3 as it is, at most 1 (a
    // block scaled down by its factor first would fall into e4m3's subnormals); out is
    // multiplied by v_unit at the end. A block whose factor is 0 adds nothing (p_factor 0).
    float tile_exp_scale = exp_scale, v_unit = 1.0f, q_factor = 1.0f;
    bool fold_factors = true;
    // (A tile without key blocks reads no k or v factor: a sequence without keys may have none.)
    if (kFp8 && tile.n_blocks > 0) {
      const int hk = tile.h / p.group_size();
      q_factor = p.q_descale.at(tile.b, hk, m0);
      const float qk = q_factor * p.k_descale.at(tile.b, hk, tile.keys.begin);
      fold_factors = plain && p.k_descale.block_stride == 0 && qk > 0.0f;
      if (fold_factors) tile_exp_scale = exp_scale * qk;
      if (p.v_descale.block_stride == 0) v_unit = p.v_descale.at(tile.b, hk, tile.keys.begin);
    }
    const auto fp8_factors = [&](int n, float& s_factor, float& p_factor, float& unit_ratio) {
      const int hk = tile.h / p.group_size();
      const int64_t j0 = tile.keys.begin + int64_t{n} * kBlockN;
      s_factor = fold_factors ? 1.0f : q_factor * p.k_descale.at(tile.b, hk, j0);
      if (p.v_descale.block_stride != 0) {
        const float v_factor = p.v_descale.at(tile.b, hk, j0);
        p_factor = v_factor > 0.0f ? 1.0f : 0.0f;
        if (v_factor > 0.0f) {
          unit_ratio = v_unit / v_factor;
          v_unit = v_factor;
        }
      }
    };

    // Block n's scores in S: softcap and ALiBi, the mask where some row does not see the
    // block whole, the online softmax (S becomes P, unnormalised) and dropout; returns O's
    // rescale factors for the two rows.
    const auto softmax_block = [&](int n, float (&scale_o)[2], float s_factor) {
      const int64_t j0 = tile.keys.begin + int64_t{n} * kBlockN;
      if (kFp8 && s_factor != 1.0f) {
#pragma unroll
        for (int i = 0; i < kSTiles * 4; ++i) s[i] *= s_factor;
      }
      if (!plain) {
        const float slope = p.alibi_slopes != nullptr ? p.alibi_slopes[tile.b * p.alibi_batch_stride + tile.h] : 0.0f;
#pragma unroll
        for (int r = 0; r < 2; ++r)
          modify_scores_row<kSTiles>(s, r, scales, softcap, slope,
                                     static_cast<int>(m0 + cta_row(r) + alibi_diagonal(p, seq) - j0), quad_col);
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
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        scale_o[r] = online_softmax_row<kSTiles>(s, r, row_max[r], row_sum[r], tile_exp_scale);
        if (dropout)
          dropout_row<kSTiles>(s, r, rng, tile.b, tile.h, static_cast<uint32_t>(m0 + cta_row(r) + p.query_position0),
                               j0 + p.key_position0, quad_col);
      }
    };
    // P as A fragments of the P V wgmma: the S accumulators of two adjacent n8 tiles are one
    // 16-key fragment. FP8: those of four n8 tiles one 32-key fragment, each register taking
    // two columns of two tiles, which the transposed V's slot order matches
    // (transpose_values); P scaled by p_factor first (FP8's v descales). (d, seqlen)-major V
    // holds its keys in order: a fragment register of lane q (lane % 4) must hold keys 4 q ..
    // 4 q + 3 of its 16, of which the accumulators give this lane 2 q, 2 q + 1 (the even n8
    // tile) and 8 + 2 q, 9 + 2 q (the odd one). Each lane packs both rows' pair of the even
    // tile into one word (T) and of the odd tile into another (U); in two shuffles within
    // the quad every lane gives one of them (the first: T on even lanes, U on odd; the
    // second: the other) and takes the two words that hold its keys (q < 2: T of lanes 2 q
    // and 2 q + 1; else U of lanes 2 q - 3 and 2 q - 4), then puts each row's pairs in order.
    const int quad_lane = lane % 4, quad_first = lane - quad_lane;
    const int take_first = quad_first + (quad_lane < 2 ? 2 * quad_lane : 2 * quad_lane - 3);
    const int take_second = quad_first + (quad_lane < 2 ? 2 * quad_lane + 1 : 2 * quad_lane - 4);
    const uint32_t give_first = quad_lane % 2 == 0 ? 0x3210u : 0x7654u;  // T or U of (T, U)
    const uint32_t give_second = give_first ^ 0x4444u;
    const uint32_t row_r_keys = quad_lane < 2 ? 0x5410u : 0x1054u;  // of (first, second)
    const uint32_t row_r8_keys = row_r_keys + 0x2222u;
    const auto s_to_p = [&](float p_factor) {
      if constexpr (kFp8) {
        if (p_factor != 1.0f) {
#pragma unroll
          for (int i = 0; i < kSTiles * 4; ++i) s[i] *= p_factor;
        }
        if constexpr (Cfg::kSeqlenMajorValues) {
#pragma unroll
          for (int half = 0; half < 2 * kPSteps; ++half) {  // 16 keys: n8 tiles 2 half, 2 half + 1
            const float* x = s + 8 * half;
            const uint32_t t = ptx::pack4_e4m3(x[0], x[1], x[2], x[3]), u = ptx::pack4_e4m3(x[4], x[5], x[6], x[7]);
            const uint32_t first = __shfl_sync(0xffffffffu, __byte_perm(t, u, give_first), take_first);
            const uint32_t second = __shfl_sync(0xffffffffu, __byte_perm(t, u, give_second), take_second);
            pf[half / 2][2 * (half % 2)] = __byte_perm(first, second, row_r_keys);
            pf[half / 2][2 * (half % 2) + 1] = __byte_perm(first, second, row_r8_keys);
          }
        } else {
#pragma unroll
          for (int kk = 0; kk < kPSteps; ++kk) {
            const float* x = s + 16 * kk;
            pf[kk][0] = ptx::pack4_e4m3(x[0], x[1], x[4], x[5]);
            pf[kk][1] = ptx::pack4_e4m3(x[2], x[3], x[6], x[7]);
            pf[kk][2] = ptx::pack4_e4m3(x[8], x[9], x[12], x[13]);
            pf[kk][3] = ptx::pack4_e4m3(x[10], x[11], x[14], x[15]);
          }
        }
      } else {
#pragma unroll
        for (int kk = 0; kk < kPSteps; ++kk) {
          pf[kk][0] = ptx::pack2<Element>(s[8 * kk + 0], s[8 * kk + 1]);
          pf[kk][1] = ptx::pack2<Element>(s[8 * kk + 2], s[8 * kk + 3]);
          pf[kk][2] = ptx::pack2<Element>(s[8 * kk + 4], s[8 * kk + 5]);
          pf[kk][3] = ptx::pack2<Element>(s[8 * kk + 6], s[8 * kk + 7]);
        }
      }
    };
    const auto issue_s = [&](int stage) {
      stage = __shfl_sync(0xffffffffu, stage, 0);  // warp-uniform: k_stage in uniform registers
      const ptx::WgmmaDescriptor k_stage = k_desc + ((stage * Cfg::kTileBytes) >> 4);
#pragma unroll
      for (int kk = 0; kk < kHeadDim / Cfg::kKStep; ++kk)
        SMma::ss(s, q_desc + panel_step(kk, kBlockM), k_stage + panel_step(kk, kBlockN), kk > 0);
    };

    // V(n) is waited for in block n, after its softmax: the wait's retry loop is a basic-block
    // boundary that keeps ptxas from hoisting the wait for P V above the softmax (within one
    // block it schedules that wait as early as it can), and V(n) has long landed by then.
    RingSlot v_next{};
    const auto wait_for_next_v = [&] {
      v_next = ring_slot<Cfg::kStages>(v_iteration++);
      sh.full(kReadValuesRing<Cfg>, v_next.stage).wait(v_next.parity);
    };
    if (tile.n_blocks > 0) {
      // Block 0: S(0) alone.
      const RingSlot k_slot = ring_slot<Cfg::kStages>(k_iteration++);
      sh.full(kKeysRing, k_slot.stage).wait(k_slot.parity);
      take_turn();
      ptx::wgmma_hold(s);
      ptx::wgmma_fence();
      issue_s(k_slot.stage);
      ptx::wgmma_commit();
      pass_turn();
      ptx::wgmma_wait<0>();
      ptx::wgmma_hold(s);
      if (releases) sh.empty(kKeysRing, k_slot.stage).arrive();
      release_q_after_last_s(0);
      float unused[2], s_factor = 1.0f, p_factor = 1.0f, unit_ratio = 1.0f;
      if constexpr (kFp8) fp8_factors(0, s_factor, p_factor, unit_ratio);  // (O is 0: no ratio)
      softmax_block(0, unused, s_factor);  // the first block's rescale is of an O of zeros
      s_to_p(p_factor);
      wait_for_next_v();
    }
    // Block n: S(n) and O += P(n - 1) V(n - 1) issued together; the softmax of S(n) runs
    // while the second (and the other consumer's wgmmas) run.
    for (int n = 1; n < tile.n_blocks; ++n) {
      const RingSlot k_slot = ring_slot<Cfg::kStages>(k_iteration++);
      const RingSlot v_slot = v_next;  // V(n - 1)
      sh.full(kKeysRing, k_slot.stage).wait(k_slot.parity);
      take_turn();
      ptx::wgmma_hold(s);
      ptx::wgmma_hold(o);
      ptx::wgmma_hold(pf);
      ptx::wgmma_fence();
      issue_s(k_slot.stage);
      ptx::wgmma_commit();
      issue_pv(o, pf, v_slot.stage);
      ptx::wgmma_commit();
      pass_turn();

      ptx::wgmma_wait<1>();  // S(n) is done (K(n) is free); P V may still run
      ptx::wgmma_hold(s);
      if (releases) sh.empty(kKeysRing, k_slot.stage).arrive();
      release_q_after_last_s(n);
      float scale_o[2], s_factor = 1.0f, p_factor = 1.0f, unit_ratio = 1.0f;
      if constexpr (kFp8) fp8_factors(n, s_factor, p_factor, unit_ratio);
      softmax_block(n, scale_o, s_factor);
      if constexpr (kFp8) {
        scale_o[0] *= unit_ratio;
        scale_o[1] *= unit_ratio;
      }
      ptx::wgmma_hold(s);  // the exponentials stay above the wait loop
      wait_for_next_v();

      ptx::wgmma_wait<0>();  // O += P(n - 1) V(n - 1) is done: O, pf and V(n - 1) are free
      ptx::wgmma_hold(o);
      ptx::wgmma_hold(pf);
      if (releases) sh.empty(kReadValuesRing<Cfg>, v_slot.stage).arrive();
      // After the first blocks a row's max rarely grows, and where none of the warp's 16 rows'
      // did, every factor is exactly 1: the warp skips O's multiplications (kHeadDim / 2 a
      // thread, between the wait for P V and the next turn), which changes no bit.
      if (__any_sync(0xffffffffu, scale_o[0] != 1.0f || scale_o[1] != 1.0f)) {
#pragma unroll
        for (int t = 0; t < kOTiles; ++t) {
          o[4 * t + 0] *= scale_o[0];
          o[4 * t + 1] *= scale_o[0];
          o[4 * t + 2] *= scale_o[1];
          o[4 * t + 3] *= scale_o[1];
        }
      }
      s_to_p(p_factor);
    }
    // The last block's O += P V.
    if (tile.n_blocks > 0) {
      take_turn();
      ptx::wgmma_hold(o);
      ptx::wgmma_hold(pf);
      ptx::wgmma_fence();
      issue_pv(o, pf, v_next.stage);
      ptx::wgmma_commit();
      pass_turn();
      ptx::wgmma_wait<0>();
      ptx::wgmma_hold(o);
      if (releases) sh.empty(kReadValuesRing<Cfg>, v_next.stage).arrive();
    }

    // Epilogue: out = O / l in the storage dtype, written by the warp into its 16 rows of the
    // staging buffer (O's own, or Q's, whose wgmmas are all done), then stored by TMA (rows
    // past the sequence and columns past head_dim_v are not written); lse as in the cp.async
    // kernel. The addresses come from this opaque copy of the lane index: computed from
    // `lane`, the compiler hoists them out of the tile loop, where they hold registers
    // through the main loop (and spill).
    int epilogue_lane = lane;
    asm volatile("" : "+r"(epilogue_lane));
    const int warp_row0 = consumer * 64 + warp * 16;
    if constexpr (Cfg::kSeparateO) {  // the warp's previous store has read its rows
      if (lane == 0) ptx::bulk_wait_read();
      __syncwarp();
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = row_sum[r];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      // (Approximate: out is rounded to 16 bits, and an IEEE division's slow path would be a
      // call between the tensor cores' last work of this tile and their first of the next.)
      const float inv = l == 0.0f ? 0.0f : (dropout ? rng.scale : v_unit) * ptx::rcp_approx(l);
      const int row = warp_row0 + epilogue_lane / 4 + r * 8;
      const int64_t i = m0 + row;
      if constexpr (kFp8) {  // bf16 out, twice Q's bytes: stored from the registers
        if (i < seq.seqlen_q) {
          using Out = typename Cfg::OutElement;
          Out* out_row = static_cast<Out*>(p.out) + (p.is_varlen() ? 0 : tile.b * p.out_batch_stride) +
                         (seq.q_row0 + i) * p.out_row_stride + int64_t{tile.h} * p.out_head_stride;
#pragma unroll
          for (int t = 0; t < kOTiles; ++t) {
            const int col = 8 * t + 2 * (epilogue_lane % 4);
            if (col + 1 < p.head_dim_v)
              *reinterpret_cast<uint32_t*>(out_row + col) =
                  ptx::pack2<Out>(o[4 * t + 2 * r] * inv, o[4 * t + 2 * r + 1] * inv);
            else if (col < p.head_dim_v)
              out_row[col] = __float2bfloat16_rn(o[4 * t + 2 * r] * inv);
          }
        }
      } else {
        const uint32_t row_start = sh.o + row * 128 + (epilogue_lane % 4) * 4;
#pragma unroll
        for (int t = 0; t < kOTiles; ++t)  // swizzled_offset(row, 8 t), + this lane's 2 columns
          ptx::st_shared_32(row_start + (t / 8) * kBlockM * 128 + (((t % 8) ^ (row % 8)) << 4),
                            ptx::pack2<Element>(o[4 * t + 2 * r] * inv, o[4 * t + 2 * r + 1] * inv));
      }
      if (p.lse != nullptr && lane % 4 == 0 && i < seq.seqlen_q)
        p.lse[tile.b * p.lse_batch_stride + tile.h * p.lse_head_stride + seq.q_row0 + i] =
            l == 0.0f ? -INFINITY : (row_max[r] * tile_exp_scale + ptx::log2_approx(l)) * 0.6931471805599453f;
    }
    if constexpr (!kFp8) {  // FP8 stored its rows above
      // The rows' generic-proxy writes, made visible to the TMA unit, then one thread's store.
      // A varlen tensor holds the next sequence's rows after this one's: a warp whose rows
      // cross the end writes the rows inside from the staging buffer itself.
      ptx::fence_proxy_async_shared();
      __syncwarp();
      // (The warp's first row behind an opaque copy, for the reason above.)
      int64_t warp_m0 = m0 + warp_row0;
      asm volatile("" : "+l"(warp_m0));
      const int64_t rows_left = seq.seqlen_q - warp_m0;
      if (!Cfg::kTakesVarlen || !p.is_varlen() || rows_left >= kOutBoxRows) {
        if (lane == 0) {
#pragma unroll
          for (int panel = 0; panel < Cfg::kPanels; ++panel)
            tma_store(&args.out, sh.o + panel * kBlockM * 128 + warp_row0 * 128, panel * 64,
                      static_cast<int32_t>(seq.q_row0 + warp_m0), tile.h, p.is_varlen() ? 0 : tile.b);
        }
      } else if (rows_left > 0) {
        Element* out_rows = static_cast<Element*>(p.out) + (seq.q_row0 + warp_m0) * p.out_row_stride +
                            int64_t{tile.h} * p.out_head_stride;
        // 16-byte chunks: 8 per panel row, row-major over (row, panel, chunk).
        for (int c = epilogue_lane; c < static_cast<int>(rows_left) * Cfg::kPanels * 8; c += 32) {
          const int row = c / (Cfg::kPanels * 8), panel = c / 8 % Cfg::kPanels, chunk = c % 8;
          const int col = panel * 64 + chunk * 8;
          const int buffer_row = warp_row0 + row;
          if (col < p.head_dim_v)
            ptx::st_global_128(out_rows + row * p.out_row_stride + col,
                               ptx::ld_shared_128(sh.o + panel * kBlockM * 128 + buffer_row * 128 +
                                                  ((chunk ^ (buffer_row % 8)) << 4)));
        }
        __syncwarp();  // every lane's reads of the rows, before lane 0 releases them below
      }
      if constexpr (Cfg::kOInQ) {  // the next tile's Q may overwrite the rows once read
        if (lane == 0) {
          ptx::bulk_wait_read();
          sh.q_empty().arrive();
        }
      }
    }
    ++tile_count;
  }
  if (lane == 0) ptx::bulk_wait_all();  // the stores complete before the CTA's memory goes
  // The last consumer passed the turn once more than consumer 0 took it (its first pass_turn
  // had no turn before it): consumer 0 takes that last one, so every barrier ends balanced.
  if (consumer == 0) take_turn();
}

template <typename Cfg, ScoreVariant kVariant>
__global__ void __launch_bounds__(Cfg::kThreads, 1) forward_ws_kernel(const __grid_constant__ WsForwardArgs args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char shared_raw[];
  const WsShared<Cfg> sh(shared_raw);
  // Broadcast from lane 0, so that the compiler knows it is the same in the warp: what is
  // made of it (the Q descriptor) can then live in uniform registers.
  const int warpgroup = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
  if (threadIdx.x == 0) {
    sh.q_full().init(1);
    sh.q_empty().init(4 * Cfg::kConsumers);  // every consumer warp
    for (int s = 0; s < Cfg::kStages; ++s) {
      // FP8: V is read by the transposing warps, its transposed copy by the consumers (where
      // V came (d, seqlen)-major, by the consumers).
      sh.full(kKeysRing, s).init(1);
      sh.empty(kKeysRing, s).init(Cfg::kConsumers);
      sh.full(kValuesRing, s).init(1);
      sh.empty(kValuesRing, s).init(Cfg::kTransposes ? Cfg::kTransposeWarps : Cfg::kConsumers);
      if constexpr (Cfg::kTransposes) {
        sh.full(kTransposedRing, s).init(Cfg::kTransposeWarps);
        sh.empty(kTransposedRing, s).init(Cfg::kConsumers);
      }
    }
    sh.tail_landed().init(1);
    *sh.values_end() = 0;
    fence_barrier_init();
  }
  __syncthreads();
  if (warpgroup == 0) {
    release_registers<Cfg::kProducerRegisters>();
    const int warp = static_cast<int>(threadIdx.x) / 32;
    if (warp == 0)
      produce<Cfg>(args, sh);
    else if constexpr (Cfg::kTransposes)
      transpose_values<Cfg>(sh, warp - 1);
    return;
  }
  claim_registers<Cfg::kConsumerRegisters>();
  consume<Cfg, kVariant>(args, sh, warpgroup - 1);
#else
  __trap();  // compiled for sm_90a only; the host launches it only where that code is loaded
#endif
}

}  // namespace flashattn::detail::cuda::sm90

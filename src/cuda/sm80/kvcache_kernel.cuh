// The sm80 KV-cache (decoding) kernel: split-KV attention over a dense or paged cache, with
// the append of k_new/v_new and the rotary embedding fused in, and the combine kernel that
// merges the splits' partial results exactly.
//
// Decoding reads the whole cache to produce a handful of query rows, so the kernel is built
// to stream K and V at memory bandwidth rather than to saturate the tensor cores:
//
// - GQA packing: a CTA owns one (batch, kv head) and 16 "packed" rows, row r being query
//   position t = r / G of query head hk * G + r % G (G = H / Hk): the query heads that share a
//   kv head read each K/V tile once, together (one query token with G = 4 fills 4 rows).
// - Split-KV: grid.x splits each sequence's keys into num_splits equal runs of key blocks, so
//   that a batch of one still puts every SM to work; each split writes a normalised partial
//   output and its log-sum-exp (fp32), and kvcache_combine_kernel merges them:
//   lse = log sum_s exp(lse_s), out = sum_s exp(lse_s - lse) out_s.
// - Inside a CTA the warps split the keys again: warp w takes keys 16w..16w+15 of every
//   kBlockN-key block (S = Q K^T and O += P V with mma.sync on a 16-key slice), keeping its own
//   running max, sum and O; the warps' results are merged through shared memory at the end.
// - K and V stream through kStages shared-memory stages with cp.async, kStages - 1 blocks in
//   flight, addressed row by row so that a paged cache of any page size costs one block-table
//   lookup per row (per block where a block lies in one page: page sizes that are multiples
//   of kBlockN, sequences starting on a block boundary).
// - Append: positions cache_seqlens[b] .. + S_new - 1 are read from k_new/v_new (k_new
//   rotated and rounded to the cache dtype, exactly what is stored) instead of the cache, and
//   written into the cache, at the end, by the CTAs of row block 0 whose split covers them, so
//   every new position is written once and no CTA reads a position another one writes.
// - Rotary on q is applied while loading Q (each CTA rotates its own rows).
// - Guards (docs/SPEC.md, "What each backend supports and checks"): the int32 tensors are read
//   here, in device memory, so no value of theirs may make the kernel touch memory outside the
//   tensors it was given, host checks or not (a CUDA graph replays whatever they hold). A
//   sequence whose values fail kv_sequence_in_range, or whose append would write into a page
//   that fails kv_page_in_range, takes no keys, appends nothing and writes NaN rows (a few
//   compares per CTA); any other page that fails is not read, its keys read as NaN (a compare
//   per block-table lookup). Every other index is derived from those values and the grid.
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common/kvcache.hpp"
#include "common/mask.hpp"
#include "cuda/common/ptx.cuh"
#include "cuda/common/tile_layout.hpp"

namespace flashattn::detail::cuda::sm80 {

// kLayout: how the K/V tiles lie in shared memory (cuda/common/tile_layout.hpp). The release
// keeps every 32-byte global sector in one 32-byte unit of shared memory, so that L2 sends
// the SMs no more bytes than the cache holds: the swizzle where rows are whole 128-byte
// groups (head dims that are multiples of 64), 32-byte padding otherwise. Rows padded by 16
// bytes, the layout before, made L2 send 1.5x the cache (Nsight Compute, H200, 2026-12-01).
template <int kHeadDim, typename Element>
inline constexpr TileLayout kReleaseKvLayout =
    kHeadDim * sizeof(Element) % 128 == 0 ? TileLayout::Swizzle : TileLayout::Pad32;

// CacheElement: the caches' dtype, Element's (q's) or fp8 e4m3 (docs/SPEC.md, "Decoding with
// a KV cache"; the kernel's "FP8 caches" comment says what changes).
template <typename Element_, int kHeadDim_, int kWarps_, int kStages_, int kL2Prefetch_,
          TileLayout kLayout_ = kReleaseKvLayout<kHeadDim_, Element_>,
          typename CacheElement_ = Element_>
struct KvCacheConfig {
  using Element = Element_;
  using CacheElement = CacheElement_;
  static constexpr bool kFp8Cache = !std::is_same_v<CacheElement, Element>;
  static_assert(!kFp8Cache || std::is_same_v<CacheElement, __nv_fp8_e4m3>, "fp8 caches are e4m3");
  // The type of the tensor-core products: q's, or fp16 with fp8 caches (e4m3 -> fp16 is exact
  // and one instruction; q is brought into fp16's range by a power of two per row).
  using MmaElement = std::conditional_t<kFp8Cache, __half, Element>;
  static constexpr int kHeadDim = kHeadDim_;  // the bucket: a multiple of 32
  static constexpr int kWarps = kWarps_;
  static constexpr int kStages = kStages_;    // shared-memory stages of K and V
  static constexpr int kL2Prefetch = kL2Prefetch_;  // L2 prefetch hint of the K/V loads (bytes)
  static constexpr TileLayout kLayout = kLayout_;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBlockM = 16;          // packed query rows per CTA
  static constexpr int kWarpKeys = 16;        // keys per warp per block
  static constexpr int kBlockN = kWarpKeys * kWarps;
  static constexpr int kElementBytes = static_cast<int>(sizeof(Element));  // q's, Q's tile's
  static constexpr int kCacheBytes = static_cast<int>(sizeof(CacheElement));
  using KvTile = SharedTile<kLayout, kHeadDim, kCacheBytes>;
  // Shared-memory rows, in elements: K/V after kLayout, Q always padded by 16 bytes (it is
  // stored by st.shared, not copied).
  static constexpr int kRowStride = KvTile::kRowStride;
  static constexpr int kQRowStride = kHeadDim + 8;
  static constexpr int kChunkElements = 16 / kCacheBytes;  // cache elements per 16-byte copy
  static constexpr int kChunksPerRow = kHeadDim / kChunkElements;
  static constexpr int kQChunksPerRow = kHeadDim / 8;
  static constexpr int kTileBytes = kBlockN * kRowStride * kCacheBytes;
  static constexpr int kQBytes = kBlockM * kQRowStride * kElementBytes;
  // fp8 caches: the power of two each Q row was scaled by (a float per row).
  static constexpr int kQScaleBytes = kFp8Cache ? kBlockM * 4 : 0;
  static constexpr int kStageBytes = 2 * kStages * kTileBytes;
  // The warps' partial results (O, max, sum per row; fp32) reuse the K/V stages at the end.
  static constexpr int kPartialStride = kHeadDim + 4;  // floats per row of a warp's O
  static constexpr int kPartialBytes = kWarps * kBlockM * (kPartialStride + 2) * 4;
  static constexpr int kSharedBytes =
      kQBytes + kQScaleBytes + (kPartialBytes > kStageBytes ? kPartialBytes : kStageBytes);
  static constexpr int kMaxSharedBytes = kSharedBytes;
  static_assert(kHeadDim % 32 == 0 && kStages >= 2, "shapes");
  static_assert(!kFp8Cache || kHeadDim == 64 || kHeadDim % 128 == 0,
                "fp8 caches: the fragment layout below covers buckets 64, 128 and 256");
};

// Eight fp16 or bf16 NaNs (all-ones bits) in global memory: what the general kernel's K tile
// copies in place of a key chunk on a page out of range.
static __device__ uint4 nan_key_chunk = {~0u, ~0u, ~0u, ~0u};

// What the kernels need beyond the validated call.
struct KvCacheKernelParams {
  KvCacheParams kv;
  int32_t num_splits = 1;
  int32_t row_blocks = 1;          // ceil(Sq * G / 16), at least 1 (the append needs a CTA)
  float* partial_out = nullptr;    // num_splits > 1: (num_splits, B, H, Sq, head_dim)
  float* partial_lse = nullptr;    // num_splits > 1: (num_splits, B, H, Sq), natural log
  // nan_key_chunk's device address (a parameter: the kernel reads it from the constant bank).
  const void* nan_keys = nullptr;
};

// Element e of a row of head_dim values after the rotary embedding at position `pos`
// (unchanged from rotary_dim on, or without rotary). Multiplications and the sum are rounded
// separately (no fused multiply-add), the way the CPU engine computes it.
template <typename Element>
__device__ __forceinline__ float rotated(const Element* row, int e, const KvCacheParams& kv,
                                         int64_t pos) {
  const float x = static_cast<float>(row[e]);
  if (kv.rotary_cos == nullptr || e >= kv.rotary_dim) return x;
  const int half = kv.rotary_dim / 2;
  const bool first = kv.rotary_interleaved ? e % 2 == 0 : e < half;
  const int i = kv.rotary_interleaved ? e / 2 : (first ? e : e - half);
  const int partner_index = kv.rotary_interleaved ? (first ? e + 1 : e - 1) : (first ? e + half : e - half);
  const float partner = static_cast<float>(row[partner_index]);
  const float c = static_cast<float>(
      static_cast<const Element*>(kv.rotary_cos)[pos * kv.rotary_cos_row_stride + i]);
  const float s = static_cast<float>(
      static_cast<const Element*>(kv.rotary_sin)[pos * kv.rotary_sin_row_stride + i]);
  return first ? __fsub_rn(__fmul_rn(x, c), __fmul_rn(partner, s))
               : __fadd_rn(__fmul_rn(x, c), __fmul_rn(partner, s));
}

// Elements e0 .. e0 + 7 of a row (16-byte aligned) after the rotary embedding at position
// `pos`, as 8 values of the row's dtype. Every load (the chunk, the partners, cos and sin) is
// issued before any is used, so a chunk costs one memory round trip, not one per element.
template <typename Element>
__device__ __forceinline__ uint4 rotated_chunk(const Element* row, int e0,
                                               const KvCacheParams& kv, int64_t pos) {
  const uint4 raw = *reinterpret_cast<const uint4*>(row + e0);
  if (kv.rotary_cos == nullptr || e0 >= kv.rotary_dim) return raw;
  const Element* cos_row = static_cast<const Element*>(kv.rotary_cos) + pos * kv.rotary_cos_row_stride;
  const Element* sin_row = static_cast<const Element*>(kv.rotary_sin) + pos * kv.rotary_sin_row_stride;
  const int half = kv.rotary_dim / 2;
  __align__(16) Element x[8];
  Element partner[8], c[8], s[8];
  *reinterpret_cast<uint4*>(x) = raw;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const int e = e0 + k;
    if (e < kv.rotary_dim) {
      const bool first = kv.rotary_interleaved ? e % 2 == 0 : e < half;
      const int i = kv.rotary_interleaved ? e / 2 : (first ? e : e - half);
      partner[k] = row[kv.rotary_interleaved ? (first ? e + 1 : e - 1) : (first ? e + half : e - half)];
      c[k] = cos_row[i];
      s[k] = sin_row[i];
    }
  }
  __align__(16) Element y[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const int e = e0 + k;
    if (e < kv.rotary_dim) {
      const bool first = kv.rotary_interleaved ? e % 2 == 0 : e < half;
      const float xf = static_cast<float>(x[k]), pf = static_cast<float>(partner[k]);
      const float cf = static_cast<float>(c[k]), sf = static_cast<float>(s[k]);
      y[k] = Element(first ? __fsub_rn(__fmul_rn(xf, cf), __fmul_rn(pf, sf))
                           : __fadd_rn(__fmul_rn(xf, cf), __fmul_rn(pf, sf)));
    } else {
      y[k] = x[k];
    }
  }
  return *reinterpret_cast<const uint4*>(y);
}

// Element offsets of cache position `pos` of sequence b in the K and the V cache (head 0);
// valid is false where the position's page is out of range (the offsets are then meaningless).
// pos must be a position of a sequence that passed kv_sequence_in_range, so that its
// block-table slot exists.
struct CacheOffsets {
  int64_t k, v;
  bool valid = true;
};
// The page of position `pos` of sequence b: positions are below cache_seqlens + S_new < 2^32,
// so a 32-bit division (a 64-bit one is a ~70-instruction subroutine, once per row of every
// block).
__device__ __forceinline__ int64_t page_of(const KvCacheParams& kv, int32_t b, uint32_t pos,
                                           uint32_t& page_index) {
  page_index = pos / static_cast<uint32_t>(kv.page_size);
  return kv.block_table[b * kv.block_table_batch_stride + page_index];
}
__device__ __forceinline__ CacheOffsets cache_offsets(const KvCacheParams& kv, int32_t b,
                                                      const KvSequence& seq, int64_t pos) {
  const ForwardParams& p = kv.attn;
  if (!kv.is_paged())
    return {seq.cache_row * p.k_batch_stride + pos * p.k_row_stride,
            seq.cache_row * p.v_batch_stride + pos * p.v_row_stride};
  uint32_t page_index;
  const int64_t page = page_of(kv, b, static_cast<uint32_t>(pos), page_index);
  const int64_t in_page = static_cast<uint32_t>(pos) - page_index * static_cast<uint32_t>(kv.page_size);
  return {page * p.k_batch_stride + in_page * p.k_row_stride,
          page * p.v_batch_stride + in_page * p.v_row_stride, kv_page_in_range(kv, page)};
}

// ---- FP8 caches --------------------------------------------------------------------------
// With e4m3 caches (Cfg::kFp8Cache) the K/V tiles hold the caches' bytes as they are, and each
// warp turns its own fragments into fp16 on their way to the tensor cores (mma.sync takes no
// e4m3 under a 16-bit q):
// - S = Q K^T: lane (g = lane / 4, c = lane % 4) reads its two key rows in 16-byte pieces, one
//   4-byte word per k-step; the step's k-slots 2c, 2c+1, 2c+8, 2c+9 then stand for head dims
//   fp8_key_dim(c, 4 kk) + 0..3, and Q's fragments are read with the same permutation (the dot
//   product does not see an order of the dims).
// - O += P V: lane (g, c) reads its four keys' rows (2c, 2c+1, 2c+8, 2c+9) in 4-byte words at
//   bytes 32 j + 4 g; a byte permute pairs two keys' bytes into a B register, so n-tile 4 j + i
//   holds dims fp8_value_dim(4 j + i, n); O's columns follow, restored where the warps'
//   partials are written.
// - q (bf16 or fp16) enters as fp16 times a power of two per row that puts the row's largest
//   magnitude in [2^14, 2^15) (exact, unless an element lies more than 2^31 below it), the
//   inverse folded into the row's score scale with k_descale; v_descale multiplies 1/l at the
//   end. P is rounded to fp16 for the P V product.
// - The append stores e4m3(x / factor) (quantise_e4m3), into the tile and the cache alike.
// The row layouts (swizzle at 128 and 256, padding at 64) keep both read patterns free of
// bank conflicts at 128 and 256.

// The head dim held by byte b (0 <= b < D / 4) of lane c's share of a key row: 16-byte
// pieces; at 64 one piece per lane, above that 32-byte runs 128 bytes apart (which keeps the
// quarter-warps' reads on distinct banks under the swizzle).
template <int kHeadDim>
__device__ __forceinline__ int fp8_key_dim(int c, int b) {
  if constexpr (kHeadDim == 64)
    return 16 * c + b;
  else
    return 128 * (b / 32) + 32 * c + b % 32;
}

// The head dim held by column n (0..7) of n-tile t of O with fp8 caches.
__device__ __forceinline__ int fp8_value_dim(int t, int n) { return 4 * (8 * (t / 4) + n) + t % 4; }

// Two e4m3 values (bits 0-7 and 8-15 of `pair`) as an fp16 pair, the first in the low half;
// exact (every e4m3 value, NaN included, is an fp16 one). sm_89 and newer convert in one
// instruction; older GPUs place e4m3's bits in fp16's fields (its exponent 8 below fp16's bias)
// and multiply by 2^8, NaN set apart.
__device__ __forceinline__ uint32_t e4m3x2_to_half2(uint32_t pair) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint32_t h;
  asm("{\n.reg .b16 p;\ncvt.u16.u32 p, %1;\ncvt.rn.f16x2.e4m3x2 %0, p;\n}\n" : "=r"(h) : "r"(pair));
  return h;
#else
  const uint32_t spread = (pair & 0xffu) | ((pair & 0xff00u) << 8);
  const uint32_t magnitude = spread & 0x007f007fu;
  uint32_t bits = (magnitude << 7) | ((spread & 0x00800080u) << 8);
  bits |= __vcmpeq2(magnitude, 0x007f007fu) & 0x7e007e00u;  // NaN: fp16's all-ones exponent
  const __half2 value = __hmul2(*reinterpret_cast<const __half2*>(&bits), __floats2half2_rn(256.0f, 256.0f));
  return *reinterpret_cast<const uint32_t*>(&value);
#endif
}

// What an fp8 cache stores for an appended value x: e4m3 of x / factor (IEEE division),
// rounded to nearest even, saturating at +-448, NaN staying NaN.
__device__ __forceinline__ __nv_fp8_storage_t quantise_e4m3(float x, float factor) {
  return __nv_cvt_float_to_fp8(__fdiv_rn(x, factor), __NV_SATFINITE, __NV_E4M3);
}

// kGeneral: an append (k_new/v_new), rotary, ALiBi or softcap may occur. Without them (a
// plain decoding step) the kernel is compiled without that code: a CTA runs its few key
// blocks through the body only a handful of times, so the body's size is paid in
// instruction-cache misses (the profile at batch 1 showed them as the largest stall).
template <typename Cfg, bool kGeneral>
__global__ void __launch_bounds__(Cfg::kThreads)
    kvcache_kernel(const __grid_constant__ KvCacheKernelParams kp) {
  using Element = typename Cfg::Element;
  using CacheElement = typename Cfg::CacheElement;
  using MmaElement = typename Cfg::MmaElement;
  constexpr bool kFp8 = Cfg::kFp8Cache;
  constexpr int kChunkElements = Cfg::kChunkElements;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHeadDim = Cfg::kHeadDim;
  constexpr int kRowStride = Cfg::kRowStride, kStages = Cfg::kStages;
  constexpr int kThreads = Cfg::kThreads, kWarps = Cfg::kWarps;
  constexpr int kKSteps = kHeadDim / 16;
  constexpr int kOTiles = kHeadDim / 8;
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr uint32_t kElementBytes = sizeof(Element);
  const KvCacheParams& kv = kp.kv;
  const ForwardParams& p = kv.attn;

  extern __shared__ __align__(16) unsigned char shared_raw[];
  const uint32_t sQ = ptx::shared_address(shared_raw);
  float* q_row_scale = reinterpret_cast<float*>(shared_raw + Cfg::kQBytes);  // fp8 caches
  const uint32_t sK = sQ + Cfg::kQBytes + Cfg::kQScaleBytes;  // kStages tiles
  const uint32_t sV = sK + kStages * Cfg::kTileBytes;        // kStages tiles

  // The combine kernel (launched as a programmatic dependent on sm_90) may be scheduled now;
  // it waits for this grid's completion before reading anything.
  ptx::allow_dependent_launch();

  const int split = blockIdx.x;
  const int row_block = static_cast<int>(blockIdx.y) % kp.row_blocks;
  const int hk = static_cast<int>(blockIdx.y) / kp.row_blocks;
  const int b = blockIdx.z;
  const int group = p.group_size();
  // Packed rows number Sq G < 2^20 (at most 65535 row blocks of 16, checked at launch): their
  // divisions by G are 32-bit (a 64-bit division is a ~70-instruction subroutine).
  const uint32_t ugroup = static_cast<uint32_t>(group);
  const KvSequence seq = kv_sequence(kv, b);
  // A sequence whose values are out of range is given no keys (nothing read or appended) and
  // NaN rows at the end; in range, seqlen_k >= 0 (leftpad <= cache_seqlens <= the end).
  const bool seq_ok = kv_sequence_in_range(kv, seq);
  const int64_t seqlen_k = seq_ok ? seq.seqlen_k() : 0;
  const int64_t cached_end = seq.filled;  // positions below come from the cache
  const int64_t seqlen_q = p.seqlen_q;
  // fp8 caches: this (sequence, kv head)'s factors.
  const float k_factor = kFp8 ? p.k_descale.at(b, hk, 0) : 1.0f;
  const float v_factor = kFp8 ? p.v_descale.at(b, hk, 0) : 1.0f;

  // This split's keys (indices relative to seq.begin): equal runs of whole key blocks.
  // Fewer than 2^26 key blocks (positions are below 2^32): a 32-bit division.
  const int64_t total_blocks = (seqlen_k + kBlockN - 1) / kBlockN;
  const int64_t blocks_per_split =
      (static_cast<uint32_t>(total_blocks) + kp.num_splits - 1) / static_cast<uint32_t>(kp.num_splits);
  const int64_t split_begin = split * blocks_per_split * kBlockN;
  const int64_t split_end =
      (split + 1) * blocks_per_split * kBlockN < seqlen_k ? (split + 1) * blocks_per_split * kBlockN
                                                          : seqlen_k;

  // The pages the append writes into: one out of range makes the whole sequence bad (nothing
  // appended, NaN rows), which every CTA of the sequence decides alike before its main loop.
  // This thread's share of their block-table entries is loaded first and tested after the
  // K/V prologue and the Q loads have been issued, so that its latency overlaps theirs.
  // (Threads past the pages hold page 0: in range unless num_pages is 0, and then the pages
  // that do exist in the table are out of range as well.)
  const bool appends_to_pages = kGeneral && kv.k_new != nullptr && kv.seqlen_new > 0 && kv.is_paged() && seq_ok;
  const auto append_slot_range = [&](uint32_t& first, uint32_t& count) {
    first = static_cast<uint32_t>(cached_end) / static_cast<uint32_t>(kv.page_size);
    count = static_cast<uint32_t>(seq.end - 1) / static_cast<uint32_t>(kv.page_size) - first + 1;
  };
  int32_t append_page = 0;
  if (appends_to_pages) {
    uint32_t first_slot, slots;
    append_slot_range(first_slot, slots);
    if (threadIdx.x < slots)
      append_page = kv.block_table[b * kv.block_table_batch_stride + first_slot + threadIdx.x];
  }

  // This CTA's packed rows and the keys they can see within the split.
  const int64_t rows_total = seqlen_q * group;
  const uint32_t r0 = static_cast<uint32_t>(row_block) * kBlockM;
  const int rows_here =
      rows_total - r0 >= kBlockM ? kBlockM : (rows_total - r0 > 0 ? static_cast<int>(rows_total - r0) : 0);
  int64_t lo = split_begin, hi = split_end;
  if (rows_here > 0) {
    const KeyRange visible =
        visible_keys_of_rows(r0 / ugroup, (r0 + rows_here - 1) / ugroup + 1, seqlen_q, seqlen_k,
                             p.window_left, p.window_right);
    lo = visible.begin > lo ? visible.begin : lo;
    hi = visible.end < hi ? visible.end : hi;
  }
  const int64_t first_block = lo / kBlockN;
  const int n_blocks = rows_here > 0 && lo < hi
                           ? static_cast<int>((hi + kBlockN - 1) / kBlockN - first_block)
                           : 0;

  // K/V block loads: cached rows by cp.async (16-byte chunks, a fixed chunk per thread as in
  // the forward's TileLoader), appended rows element by element from k_new/v_new, rows past
  // the CTA's keys zero-filled (so that P = 0 meets finite V).
  constexpr int kThreadsPerRow = Cfg::kChunksPerRow < 8 ? Cfg::kChunksPerRow : 8;
  constexpr int kColumnPasses = (Cfg::kChunksPerRow + kThreadsPerRow - 1) / kThreadsPerRow;
  constexpr int kRowsPerPass = kThreads / kThreadsPerRow;
  static_assert(kThreads % kThreadsPerRow == 0 && kBlockN % kRowsPerPass == 0, "loader");
  const int load_row = threadIdx.x / kThreadsPerRow, load_chunk = threadIdx.x % kThreadsPerRow;
  const CacheElement* k_cache = static_cast<const CacheElement*>(p.k) + hk * p.k_head_stride;
  const CacheElement* v_cache = static_cast<const CacheElement*>(p.v) + hk * p.v_head_stride;
  // In a dense cache this thread's rows are a fixed stride apart: their offsets advance by
  // additions (no per-row 64-bit multiplications); a paged cache looks each row's page up.
  const bool paged = kv.is_paged();
  // Pages whose size is a multiple of kBlockN, in a sequence that starts on a block boundary
  // (no cache_leftpad, or a multiple of kBlockN): each key block lies in one page, found by
  // one (CTA-uniform) block-table lookup per block instead of one per row.
  const bool page_per_block = paged && kv.page_size % kBlockN == 0 && seq.begin % kBlockN == 0;
  const CacheOffsets dense_row0 = paged ? CacheOffsets{0, 0} : cache_offsets(kv, b, seq, seq.begin + load_row);
  const int64_t k_pass_stride = int64_t{kRowsPerPass} * p.k_row_stride;
  const int64_t v_pass_stride = int64_t{kRowsPerPass} * p.v_row_stride;
  // Plain decoding from a dense cache (the common case): this thread's first chunk of the next
  // block to load, advanced by kBlockN rows per block (blocks load in order), and which of its
  // column passes lie inside head_dim; full blocks then cost a pointer add per pass and one
  // cp.async per chunk, with no per-row offsets or range tests.
  const bool dense_cursor = !kGeneral && !paged;
  const CacheElement* k_next = k_cache + dense_row0.k + first_block * kBlockN * p.k_row_stride + load_chunk * kChunkElements;
  const CacheElement* v_next = v_cache + dense_row0.v + first_block * kBlockN * p.v_row_stride + load_chunk * kChunkElements;
  // Bit c: this thread's chunk of column pass c lies inside head_dim. all_columns: every
  // chunk it has lies inside (the same for every thread when the head dim fills its bucket,
  // so that whole blocks take one path per warp).
  uint32_t column_valid = 0, column_exists = 0;
#pragma unroll
  for (int c = 0; c < kColumnPasses; ++c) {
    const int chunk = load_chunk + c * kThreadsPerRow;
    if (chunk < Cfg::kChunksPerRow) column_exists |= 1u << c;
    if (chunk * kChunkElements < p.head_dim) column_valid |= 1u << c;
  }
  const bool all_columns = column_valid == column_exists;
  const auto load_block = [&](int n, int stage) {
    const int64_t j0 = (first_block + n) * kBlockN;
    const uint32_t k_tile = sK + stage * Cfg::kTileBytes, v_tile = sV + stage * Cfg::kTileBytes;
    if (dense_cursor) {
      // A full block whose chunks all lie inside head_dim: no tests at all; else each chunk
      // tests its row and column.
      const bool whole = j0 + kBlockN <= hi && all_columns;
      const auto copy_rows = [&](auto whole_tag) {
        constexpr bool kWhole = decltype(whole_tag)::value;
        const CacheElement* k_row = k_next;
        const CacheElement* v_row = v_next;
#pragma unroll
        for (int pass = 0; pass < Cfg::kBlockN / kRowsPerPass; ++pass) {
          const int row = load_row + pass * kRowsPerPass;
          const bool in_range = kWhole || j0 + row < hi;
#pragma unroll
          for (int c = 0; c < kColumnPasses; ++c) {
            const int chunk = load_chunk + c * kThreadsPerRow;
            if (Cfg::kChunksPerRow % kThreadsPerRow != 0 && chunk >= Cfg::kChunksPerRow) continue;
            const bool valid = kWhole || (in_range && ((column_valid >> c) & 1u));
            const uint32_t offset = Cfg::KvTile::offset(row, chunk * kChunkElements);
            ptx::cp_async_16<Cfg::kL2Prefetch>(k_tile + offset, valid ? k_row + c * kThreadsPerRow * kChunkElements : k_cache, valid);
            ptx::cp_async_16<Cfg::kL2Prefetch>(v_tile + offset, valid ? v_row + c * kThreadsPerRow * kChunkElements : v_cache, valid);
          }
          k_row += k_pass_stride;
          v_row += v_pass_stride;
        }
      };
      if (whole)
        copy_rows(std::true_type{});
      else
        copy_rows(std::false_type{});
      k_next += kBlockN * p.k_row_stride;
      v_next += kBlockN * p.v_row_stride;
      return;
    }
    // Every row's offsets first: in a paged cache each is a block-table load, and issuing them
    // all before the first copy keeps them to one round trip per block instead of one per row.
    // Rows outside the keys get any offset: their copies are zero-fills.
    constexpr int kPasses = kBlockN / kRowsPerPass;
    CacheOffsets row_at[kPasses];
    if (page_per_block) {
      // The block's first position is a key of the sequence (j0 < hi), so its page exists;
      // rows past the keys get offsets past it, never used (their copies are zero-fills).
      const uint32_t pos0 = static_cast<uint32_t>(seq.begin + j0);
      uint32_t page_index;
      const int64_t page = page_of(kv, b, pos0, page_index);
      const int64_t in_page = pos0 - page_index * static_cast<uint32_t>(kv.page_size) + load_row;
      CacheOffsets at{page * p.k_batch_stride + in_page * p.k_row_stride,
                      page * p.v_batch_stride + in_page * p.v_row_stride, kv_page_in_range(kv, page)};
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) {
        row_at[pass] = at;
        at.k += k_pass_stride;
        at.v += v_pass_stride;
      }
    } else if (paged) {
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) {
        const int64_t j = j0 + load_row + pass * kRowsPerPass, pos = seq.begin + j;
        row_at[pass] = j < hi && pos < cached_end ? cache_offsets(kv, b, seq, pos) : CacheOffsets{0, 0};
      }
    } else {
      CacheOffsets at{dense_row0.k + j0 * p.k_row_stride, dense_row0.v + j0 * p.v_row_stride};
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) {
        row_at[pass] = at;
        at.k += k_pass_stride;
        at.v += v_pass_stride;
      }
    }
    // A key on a page out of range is NaN (its padding columns stay 0), its value 0. Two ways
    // to the same tile, each the one that costs its variant no spills (ptxas 13.0, sm_80 and
    // sm_90a, every bucket): the general kernel copies the key chunk from guard NaNs (a
    // select of the source); the plain one skips that copy and stores NaN into the rows it
    // marked in `holes`, in a branch of its own after the copies.
    uint32_t holes = 0;  // plain kernel: bit `pass` set where that row's page is out of range
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const int row = load_row + pass * kRowsPerPass;
      const int64_t j = j0 + row, pos = seq.begin + j;
      const bool in_range = j < hi;
      if (kGeneral && in_range && pos >= cached_end) continue;  // appended: written below
      const CacheOffsets at = row_at[pass];
      if (!kGeneral && in_range && !at.valid) holes |= 1u << pass;
#pragma unroll
      for (int c = 0; c < kColumnPasses; ++c) {
        const int chunk = load_chunk + c * kThreadsPerRow;
        if (Cfg::kChunksPerRow % kThreadsPerRow != 0 && chunk >= Cfg::kChunksPerRow) continue;
        const bool inside = in_range && chunk * kChunkElements < p.head_dim;
        const bool valid = inside && at.valid;
        const uint32_t offset = Cfg::KvTile::offset(row, chunk * kChunkElements);
        if constexpr (kGeneral) {
          const void* k_src = valid ? k_cache + at.k + chunk * kChunkElements : inside ? kp.nan_keys : k_cache;
          ptx::cp_async_16<Cfg::kL2Prefetch>(k_tile + offset, k_src, inside);
        } else if (valid || !inside) {
          ptx::cp_async_16<Cfg::kL2Prefetch>(k_tile + offset, valid ? k_cache + at.k + chunk * kChunkElements : k_cache, valid);
        }
        ptx::cp_async_16<Cfg::kL2Prefetch>(v_tile + offset, valid ? v_cache + at.v + chunk * kChunkElements : v_cache, valid);
      }
    }
    if (!kGeneral && holes != 0) {
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) {
        if (((holes >> pass) & 1u) == 0) continue;
#pragma unroll
        for (int c = 0; c < kColumnPasses; ++c) {
          const int chunk = load_chunk + c * kThreadsPerRow;
          if (chunk < Cfg::kChunksPerRow && chunk * kChunkElements < p.head_dim)
            ptx::st_shared_128(k_tile + Cfg::KvTile::offset(load_row + pass * kRowsPerPass, chunk * kChunkElements),
                               make_uint4(~0u, ~0u, ~0u, ~0u));
        }
      }
    }
    if (kGeneral && kv.k_new != nullptr && seq.begin + j0 + kBlockN > cached_end) {
      const int64_t first = cached_end - seq.begin > j0 ? cached_end - seq.begin : j0;
      const int64_t last = j0 + kBlockN < hi ? j0 + kBlockN : hi;
      for (int64_t idx = threadIdx.x; idx < (last - first) * kHeadDim; idx += kThreads) {
        const int64_t j = first + idx / kHeadDim;
        const int e = static_cast<int>(idx % kHeadDim);
        const int64_t pos = seq.begin + j, t = pos - cached_end;
        Element k_value(0.0f), v_value(0.0f);
        if (e < p.head_dim) {
          const Element* k_row = static_cast<const Element*>(kv.k_new) + b * kv.k_new_batch_stride +
                                 t * kv.k_new_row_stride + hk * kv.k_new_head_stride;
          k_value = Element(rotated(k_row, e, kv, pos));
          v_value = static_cast<const Element*>(kv.v_new)[b * kv.v_new_batch_stride +
                                                          t * kv.v_new_row_stride +
                                                          hk * kv.v_new_head_stride + e];
        }
        const uint32_t offset = Cfg::KvTile::offset(static_cast<int>(j - j0), e);
        if constexpr (kFp8) {
          // What the append stores, so that this call reads what the next one will.
          const unsigned short k_byte = e < p.head_dim ? quantise_e4m3(static_cast<float>(k_value), k_factor) : 0;
          const unsigned short v_byte = e < p.head_dim ? quantise_e4m3(static_cast<float>(v_value), v_factor) : 0;
          asm volatile("st.shared.b8 [%0], %1;\n" ::"r"(k_tile + offset), "h"(k_byte));
          asm volatile("st.shared.b8 [%0], %1;\n" ::"r"(v_tile + offset), "h"(v_byte));
        } else {
          asm volatile("st.shared.b16 [%0], %1;\n" ::"r"(k_tile + offset),
                       "h"(*reinterpret_cast<const unsigned short*>(&k_value)));
          asm volatile("st.shared.b16 [%0], %1;\n" ::"r"(v_tile + offset),
                       "h"(*reinterpret_cast<const unsigned short*>(&v_value)));
        }
      }
    }
  };

  // Prologue: kStages - 1 blocks in flight (one commit group each, empty ones included, so
  // that the wait count below is the same for every iteration).
#pragma unroll 1  // one copy of load_block's code, not kStages - 1 (instruction cache)
  for (int n = 0; n < kStages - 1; ++n) {
    if (n < n_blocks) load_block(n, n);
    ptx::cp_async_commit();
  }

  // Q: 16-byte chunks, rotated at their positions, zero-padded; every chunk's loads are issued
  // before the first store, so the tile costs one round trip, and after the K/V prologue, so
  // that round trip overlaps the first blocks' (a short split has only a few key blocks to
  // hide latency behind). The loop's first barrier publishes the stores.
  {
    constexpr int kQChunks = kBlockM * Cfg::kQChunksPerRow;
    constexpr int kQIters = (kQChunks + kThreads - 1) / kThreads;
    uint4 chunk_value[kQIters];
#pragma unroll
    for (int i = 0; i < kQIters; ++i) {
      const int idx = threadIdx.x + i * kThreads;
      const int r = idx / Cfg::kQChunksPerRow, e0 = (idx % Cfg::kQChunksPerRow) * 8;
      chunk_value[i] = make_uint4(0u, 0u, 0u, 0u);
      if (idx < kQChunks && r < rows_here && e0 < p.head_dim && seq_ok) {
        const uint32_t row = r0 + r, t = row / ugroup;
        const int h = hk * group + static_cast<int>(row - t * ugroup);
        const Element* q = static_cast<const Element*>(p.q) + b * p.q_batch_stride +
                           t * p.q_row_stride + h * p.q_head_stride;
        chunk_value[i] = kGeneral ? rotated_chunk(q, e0, kv, cached_end + (kv.rotary_q_per_row() ? t : 0))
                                  : *reinterpret_cast<const uint4*>(q + e0);
      }
    }
    if constexpr (kFp8) {
      // fp16 times 2^e per row, e putting the row's largest magnitude in [2^14, 2^15) (a row
      // without a finite nonzero largest keeps e = 0); 2^-e goes to q_row_scale. A row's
      // chunks lie in kQChunksPerRow consecutive lanes (at most 32), which reduce the row's
      // largest magnitude among themselves.
      static_assert(Cfg::kQChunksPerRow <= 32 && kThreads % 32 == 0, "a Q row within a warp");
#pragma unroll
      for (int i = 0; i < kQIters; ++i) {
        const int idx = threadIdx.x + i * kThreads;
        const Element* x = reinterpret_cast<const Element*>(&chunk_value[i]);
        float largest = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; ++k) largest = fmaxf(largest, fabsf(static_cast<float>(x[k])));
#pragma unroll
        for (int offset = Cfg::kQChunksPerRow / 2; offset > 0; offset /= 2)
          largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, offset));
        int e = 0;
        if (largest > 0.0f && largest <= 3.4028235e38f) {
          const int exponent = static_cast<int>((__float_as_uint(largest) >> 23) & 0xffu) - 127;
          e = 14 - exponent < 126 ? 14 - exponent : 126;  // 2^-e stays a normal float
        }
        const float scale = __uint_as_float(static_cast<uint32_t>(e + 127) << 23);
        __align__(16) __half2 h[4];
#pragma unroll
        for (int k = 0; k < 4; ++k)
          h[k] = __floats2half2_rn(static_cast<float>(x[2 * k]) * scale, static_cast<float>(x[2 * k + 1]) * scale);
        chunk_value[i] = *reinterpret_cast<const uint4*>(h);
        if (idx < kQChunks && idx % Cfg::kQChunksPerRow == 0)
          q_row_scale[idx / Cfg::kQChunksPerRow] = __uint_as_float(static_cast<uint32_t>(127 - e) << 23);
      }
    }
#pragma unroll
    for (int i = 0; i < kQIters; ++i) {
      const int idx = threadIdx.x + i * kThreads;
      if (idx < kQChunks)
        ptx::st_shared_128(sQ + ((idx / Cfg::kQChunksPerRow) * Cfg::kQRowStride +
                                 (idx % Cfg::kQChunksPerRow) * 8) * kElementBytes,
                           chunk_value[i]);
    }
  }

  // The sequence's range, final (the pages the append writes; CTA-uniform, so the barrier is
  // reached by every thread or none).
  bool sequence_in_range = seq_ok;
  if (appends_to_pages) {
    bool append_page_bad = !kv_page_in_range(kv, append_page);
    uint32_t first_slot, slots;
    append_slot_range(first_slot, slots);
    // More pages than threads (a long append to small pages): the rest now.
    for (uint32_t slot = threadIdx.x + kThreads; slot < slots; slot += kThreads)
      append_page_bad = append_page_bad ||
                        !kv_page_in_range(kv, kv.block_table[b * kv.block_table_batch_stride + first_slot + slot]);
    sequence_in_range = __syncthreads_or(append_page_bad) == 0;
  }

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int quad_row = lane / 4, quad_col = (lane % 4) * 2;
  // This lane's two rows (quad_row, quad_row + 8): their query position, the keys they may
  // see within the split, and their ALiBi slope (in base-2 units). A row past the CTA's
  // (zero Q, never written out) is given every key, so that it never forces the mask: a
  // decoding step with G = 4 fills 4 of the 16 rows, and every lane holds such a row, so
  // otherwise every block would pay the per-element mask.
  int64_t row_t[2], row_lo[2], row_hi[2];
  float row_slope[2];
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int r = quad_row + 8 * rr;
    const uint32_t row = r0 + r, t = row / ugroup;
    row_t[rr] = t;
    row_lo[rr] = INT64_MIN;
    row_hi[rr] = INT64_MAX;
    row_slope[rr] = 0.0f;
    if (r < rows_here) {
      const KeyRange visible =
          visible_keys(row_t[rr], seqlen_q, seqlen_k, p.window_left, p.window_right);
      row_lo[rr] = visible.begin > split_begin ? visible.begin : split_begin;
      row_hi[rr] = visible.end < split_end ? visible.end : split_end;
      if (kGeneral && p.alibi_slopes != nullptr)
        row_slope[rr] = p.alibi_slopes[b * p.alibi_batch_stride + hk * group + (row - t * ugroup)] * kLog2e;
    }
  }
  // The keys both of this lane's rows see.
  const int64_t lane_lo = row_lo[0] > row_lo[1] ? row_lo[0] : row_lo[1];
  const int64_t lane_hi = row_hi[0] < row_hi[1] ? row_hi[0] : row_hi[1];
  const bool alibi = kGeneral && p.alibi_slopes != nullptr;
  const bool softcap = kGeneral && p.softcap > 0.0f;
  const float score_scale = softcap ? p.softmax_scale / p.softcap : p.softmax_scale * kLog2e;

  float o[kOTiles][4] = {};
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};  // base-2 units
  const uint32_t q_base = sQ + ((lane % 16) * Cfg::kQRowStride + (lane / 16) * 8) * kElementBytes;
  // The K/V tile rows and columns this lane addresses in ldmatrix; its rows are all lane % 8
  // modulo 8, so one swizzle serves them all.
  const uint32_t k_lane_row = (warp * 16 + lane % 8 + (lane / 16) * 8) * kRowStride * kElementBytes;
  const uint32_t k_lane_col = ((lane / 8) % 2) * 8 * kElementBytes;
  const uint32_t v_lane_row = (warp * 16 + lane % 8 + ((lane / 8) % 2) * 8) * kRowStride * kElementBytes;
  const uint32_t v_lane_col = (lane / 16) * 8 * kElementBytes;
  const uint32_t lane_swizzle = Cfg::KvTile::row_swizzle(lane % 8);

  // Up to head dim 128 the Q fragments stay in registers for the whole loop (4 kKSteps
  // registers: 32 at 128), loaded once after the first barrier; above, they are re-read from
  // shared memory every block (the registers are needed elsewhere there).
  constexpr bool kQInRegisters = kHeadDim <= 128;
  uint32_t q_frag[kQInRegisters ? kKSteps : 1][4];
  // fp8 caches: Q's fragment of k-step kk, its dims permuted as the keys' (fp8_key_dim).
  const auto fp8_q_fragment = [&](int kk, uint32_t(&qf)[4]) {
    const int dim = fp8_key_dim<kHeadDim>(lane % 4, 4 * kk);
    const uint2 row_g = ptx::ld_shared_64(sQ + (quad_row * Cfg::kQRowStride + dim) * kElementBytes);
    const uint2 row_g8 = ptx::ld_shared_64(sQ + ((quad_row + 8) * Cfg::kQRowStride + dim) * kElementBytes);
    qf[0] = row_g.x;
    qf[1] = row_g8.x;
    qf[2] = row_g.y;
    qf[3] = row_g8.y;
  };
  // The scale of this lane's two rows' scores (fp8 caches: times k_descale and the inverse of
  // the row's power of two, set once Q has landed).
  float row_score_scale[2] = {score_scale, score_scale};

  for (int n = 0; n < n_blocks; ++n) {
    const int stage = n % kStages;
    ptx::cp_async_wait<kStages - 2>();
    __syncthreads();  // block n has landed; every warp is done with block n - 1's stage
    if (n + kStages - 1 < n_blocks) load_block(n + kStages - 1, (n + kStages - 1) % kStages);
    ptx::cp_async_commit();
    if (kQInRegisters && n == 0) {
#pragma unroll
      for (int kk = 0; kk < (kQInRegisters ? kKSteps : 1); ++kk) {
        if constexpr (kFp8)
          fp8_q_fragment(kk, q_frag[kk]);
        else
          ptx::ldmatrix_x4(q_frag[kk], q_base + kk * 16 * kElementBytes);
      }
    }
    if (kFp8 && n == 0) {
#pragma unroll
      for (int rr = 0; rr < 2; ++rr)
        row_score_scale[rr] = score_scale * k_factor * q_row_scale[quad_row + 8 * rr];
    }

    // S = Q K^T over this warp's 16 keys of the block.
    const int64_t j0 = (first_block + n) * kBlockN + warp * 16;
    float s[2][4] = {};
    const uint32_t k_base = sK + stage * Cfg::kTileBytes + k_lane_row;
    // fp8 caches: this lane's bytes of its two key rows, a 4-byte word per k-step.
    uint32_t k_words[kFp8 ? 2 : 1][kFp8 ? kKSteps : 1];
    if constexpr (kFp8) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int piece = 0; piece < kHeadDim / 64; ++piece) {
          const uint4 w = ptx::ld_shared_128(sK + stage * Cfg::kTileBytes +
                                        Cfg::KvTile::offset(warp * 16 + nt * 8 + quad_row,
                                                            fp8_key_dim<kHeadDim>(lane % 4, 16 * piece)));
          k_words[nt][4 * piece] = w.x;
          k_words[nt][4 * piece + 1] = w.y;
          k_words[nt][4 * piece + 2] = w.z;
          k_words[nt][4 * piece + 3] = w.w;
        }
    }
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      uint32_t qf[4], kf[4];
      if constexpr (kQInRegisters) {
        qf[0] = q_frag[kk][0];
        qf[1] = q_frag[kk][1];
        qf[2] = q_frag[kk][2];
        qf[3] = q_frag[kk][3];
      } else if constexpr (kFp8) {
        fp8_q_fragment(kk, qf);
      } else {
        ptx::ldmatrix_x4(qf, q_base + kk * 16 * kElementBytes);
      }
      if constexpr (kFp8) {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
          ptx::mma_16816<__half>(s[nt], qf, e4m3x2_to_half2(k_words[nt][kk] & 0xffffu),
                                 e4m3x2_to_half2(k_words[nt][kk] >> 16));
      } else {
        ptx::ldmatrix_x4(kf, k_base + ((kk * 16 * kElementBytes + k_lane_col) ^ lane_swizzle));
        ptx::mma_16816<Element>(s[0], qf, kf[0], kf[1]);
        ptx::mma_16816<Element>(s[1], qf, kf[2], kf[3]);
      }
    }

    // Scores in base-2 units, softcap and ALiBi, the mask (only where one of this lane's rows
    // does not see all 16 keys: the edges of the split and of a causal or local window); then
    // the online softmax.
    const bool lane_sees_all = j0 >= lane_lo && j0 + 16 <= lane_hi;
    float scale_o[2];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
#pragma unroll
      for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float x = s[t][2 * rr + e] * row_score_scale[rr];
          if (softcap) x = p.softcap * ptx::tanh_for_softcap(x) * kLog2e;
          s[t][2 * rr + e] = x;
        }
      if (alibi) {
        const int64_t diagonal = row_t[rr] + seqlen_k - seqlen_q;
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int64_t distance = diagonal - (j0 + t * 8 + quad_col + e);
            s[t][2 * rr + e] -= row_slope[rr] * static_cast<float>(distance < 0 ? -distance : distance);
          }
      }
      if (!lane_sees_all) {
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int64_t j = j0 + t * 8 + quad_col + e;
            if (j < row_lo[rr] || j >= row_hi[rr]) s[t][2 * rr + e] = -INFINITY;
          }
      }
      float block_max = fmaxf(fmaxf(s[0][2 * rr], s[0][2 * rr + 1]), fmaxf(s[1][2 * rr], s[1][2 * rr + 1]));
      block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffffu, block_max, 1));
      block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffffu, block_max, 2));
      const float new_max = fmaxf(row_max[rr], block_max);
      const float base = new_max == -INFINITY ? 0.0f : new_max;
      // Exactly 1 when the max did not move, also for a row that has seen nothing yet (-inf
      // both; its O and sum are 0), so that the rescale below can be skipped.
      scale_o[rr] = row_max[rr] == new_max ? 1.0f : ptx::exp2_approx(row_max[rr] - base);
      row_max[rr] = new_max;
      float sum = 0.0f;
#pragma unroll
      for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pe = ptx::exp2_approx(s[t][2 * rr + e] - base);
          s[t][2 * rr + e] = pe;
          sum += pe;
        }
      row_sum[rr] = row_sum[rr] * scale_o[rr] + sum;
    }

    // O += P V over the same 16 keys.
    uint32_t pf[4];
    pf[0] = ptx::pack2<MmaElement>(s[0][0], s[0][1]);
    pf[1] = ptx::pack2<MmaElement>(s[0][2], s[0][3]);
    pf[2] = ptx::pack2<MmaElement>(s[1][0], s[1][1]);
    pf[3] = ptx::pack2<MmaElement>(s[1][2], s[1][3]);
    const uint32_t v_base = sV + stage * Cfg::kTileBytes + v_lane_row;
    // Rescale O only when some row's running max moved (after the first blocks it rarely
    // does): one warp vote instead of 4 kOTiles multiplications per block.
    if (__any_sync(0xffffffffu, scale_o[0] != 1.0f || scale_o[1] != 1.0f)) {
#pragma unroll
      for (int t = 0; t < kOTiles; ++t) {
        o[t][0] *= scale_o[0];
        o[t][1] *= scale_o[0];
        o[t][2] *= scale_o[1];
        o[t][3] *= scale_o[1];
      }
    }
    if constexpr (kFp8) {
      // Keys 2c, 2c+1 (b0) and 2c+8, 2c+9 (b1) of this warp's 16: their words at byte
      // 32 j + 4 g hold n-tiles 4 j .. 4 j + 3 (fp8_value_dim), paired key by key.
      const uint32_t tile = sV + stage * Cfg::kTileBytes;
      const int key = warp * 16 + 2 * (lane % 4);
#pragma unroll
      for (int j = 0; j < kHeadDim / 32; ++j) {
        const int byte = 32 * j + 4 * quad_row;
        const uint32_t w0 = ptx::ld_shared_32(tile + Cfg::KvTile::offset(key, byte));
        const uint32_t w1 = ptx::ld_shared_32(tile + Cfg::KvTile::offset(key + 1, byte));
        const uint32_t w8 = ptx::ld_shared_32(tile + Cfg::KvTile::offset(key + 8, byte));
        const uint32_t w9 = ptx::ld_shared_32(tile + Cfg::KvTile::offset(key + 9, byte));
        const uint32_t low01 = __byte_perm(w0, w1, 0x5140), low23 = __byte_perm(w0, w1, 0x7362);
        const uint32_t high01 = __byte_perm(w8, w9, 0x5140), high23 = __byte_perm(w8, w9, 0x7362);
        ptx::mma_16816<__half>(o[4 * j], pf, e4m3x2_to_half2(low01 & 0xffffu), e4m3x2_to_half2(high01 & 0xffffu));
        ptx::mma_16816<__half>(o[4 * j + 1], pf, e4m3x2_to_half2(low01 >> 16), e4m3x2_to_half2(high01 >> 16));
        ptx::mma_16816<__half>(o[4 * j + 2], pf, e4m3x2_to_half2(low23 & 0xffffu), e4m3x2_to_half2(high23 & 0xffffu));
        ptx::mma_16816<__half>(o[4 * j + 3], pf, e4m3x2_to_half2(low23 >> 16), e4m3x2_to_half2(high23 >> 16));
      }
    } else {
#pragma unroll
      for (int t = 0; t < kOTiles; t += 2) {
        uint32_t vf[4];
        ptx::ldmatrix_x4_trans(vf, v_base + ((t * 8 * kElementBytes + v_lane_col) ^ lane_swizzle));
        ptx::mma_16816<Element>(o[t], pf, vf[0], vf[1]);
        ptx::mma_16816<Element>(o[t + 1], pf, vf[2], vf[3]);
      }
    }
  }

  // Merge the warps: each writes its O, max and sum per row into the (now idle) stages.
  ptx::cp_async_wait<0>();
  __syncthreads();
  float* partial_o = reinterpret_cast<float*>(shared_raw + Cfg::kQBytes + Cfg::kQScaleBytes);
  float* partial_max = partial_o + kWarps * kBlockM * Cfg::kPartialStride;
  float* partial_sum = partial_max + kWarps * kBlockM;
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int r = quad_row + 8 * rr;
    float* row = partial_o + (warp * kBlockM + r) * Cfg::kPartialStride;
    if constexpr (kFp8) {  // O's columns back in order: 4 consecutive dims per (4 n-tiles, column)
#pragma unroll
      for (int t = 0; t < kOTiles; t += 4)
#pragma unroll
        for (int e = 0; e < 2; ++e)
          *reinterpret_cast<float4*>(row + fp8_value_dim(t, quad_col + e)) =
              make_float4(o[t][2 * rr + e], o[t + 1][2 * rr + e], o[t + 2][2 * rr + e], o[t + 3][2 * rr + e]);
    } else {
#pragma unroll
      for (int t = 0; t < kOTiles; ++t)
        *reinterpret_cast<float2*>(row + t * 8 + quad_col) = make_float2(o[t][2 * rr], o[t][2 * rr + 1]);
    }
    float l = row_sum[rr];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (lane % 4 == 0) {
      partial_max[warp * kBlockM + r] = row_max[rr];
      partial_sum[warp * kBlockM + r] = l;
    }
  }
  __syncthreads();

  // Each row is merged by kThreads / kBlockM threads, each taking every such-numbered 4-float
  // chunk of it: the row's weights are computed once per thread, not once per element.
  constexpr int kThreadsPerMergeRow = kThreads / kBlockM;
  constexpr int kMergeChunks = kHeadDim / 4;
  constexpr int kMergeIters = (kMergeChunks + kThreadsPerMergeRow - 1) / kThreadsPerMergeRow;
  static_assert(kThreads % kBlockM == 0, "merge");
  const int merge_row = threadIdx.x / kThreadsPerMergeRow;
  if (merge_row < rows_here) {
    // A warp that saw no key has max -inf and weight 0; subtracting 0 when no warp saw one
    // keeps the weights 0 rather than NaN, while a NaN row (NaN sum, -inf max: fmaxf skips
    // NaN) still turns l, and so out and lse, into NaN.
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m = fmaxf(m, partial_max[w * kBlockM + merge_row]);
    const float base = m == -INFINITY ? 0.0f : m;
    float weight[kWarps];
    float l = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      weight[w] = ptx::exp2_approx(partial_max[w * kBlockM + merge_row] - base);
      l += weight[w] * partial_sum[w * kBlockM + merge_row];
    }
    // A sequence out of range: NaN rows (its l is 0: no keys), through the combine too.
    const float nan = __int_as_float(0x7fffffff);
    // (v_factor: fp8 caches' v_descale; 1 otherwise.)
    const float inv_l = !sequence_in_range ? nan : l == 0.0f ? 0.0f : v_factor / l;
    const float lse = !sequence_in_range ? nan : l == 0.0f ? -INFINITY : (base + log2f(l)) * 0.6931471805599453f;
    const uint32_t row = r0 + merge_row, t = row / ugroup;
    const int h = hk * group + static_cast<int>(row - t * ugroup);
    const int64_t split_row = ((int64_t{split} * p.batch + b) * p.heads + h) * seqlen_q + t;
    Element* out = static_cast<Element*>(p.out) + b * p.out_batch_stride + t * p.out_row_stride +
                   h * p.out_head_stride;
#pragma unroll
    for (int i = 0; i < kMergeIters; ++i) {
      const int d = (threadIdx.x % kThreadsPerMergeRow + i * kThreadsPerMergeRow) * 4;
      if (d >= p.head_dim) break;  // head_dim is a multiple of 8 (<= the bucket): no chunk straddles it
      float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float4 v = *reinterpret_cast<const float4*>(
            partial_o + (w * kBlockM + merge_row) * Cfg::kPartialStride + d);
        acc.x += weight[w] * v.x;
        acc.y += weight[w] * v.y;
        acc.z += weight[w] * v.z;
        acc.w += weight[w] * v.w;
      }
      acc = make_float4(acc.x * inv_l, acc.y * inv_l, acc.z * inv_l, acc.w * inv_l);
      if (kp.num_splits == 1) {
        uint2 packed;
        packed.x = ptx::pack2<Element>(acc.x, acc.y);
        packed.y = ptx::pack2<Element>(acc.z, acc.w);
        *reinterpret_cast<uint2*>(out + d) = packed;
      } else {
        *reinterpret_cast<float4*>(kp.partial_out + split_row * p.head_dim + d) = acc;
      }
    }
    if (threadIdx.x % kThreadsPerMergeRow == 0) {
      if (kp.num_splits > 1)
        kp.partial_lse[split_row] = lse;
      else if (p.lse != nullptr)
        p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + t] = lse;
    }
  }

  // The append, last (the attention above read the new positions from k_new/v_new, and no
  // CTA reads what another writes): this split's new positions, once per (b, kv head), for a
  // sequence in range only.
  if (kGeneral && kv.k_new != nullptr && row_block == 0 && sequence_in_range) {
    const int64_t first = seq.begin + split_begin > cached_end ? seq.begin + split_begin : cached_end;
    const int64_t last = seq.begin + split_end;
    const Element* k_new = static_cast<const Element*>(kv.k_new) + b * kv.k_new_batch_stride +
                           hk * kv.k_new_head_stride;
    const Element* v_new = static_cast<const Element*>(kv.v_new) + b * kv.v_new_batch_stride +
                           hk * kv.v_new_head_stride;
    for (int64_t idx = threadIdx.x; idx < (last - first) * p.head_dim; idx += kThreads) {
      const int64_t pos = first + idx / p.head_dim;
      const int e = static_cast<int>(idx % p.head_dim);
      const int64_t t = pos - cached_end;  // row of k_new / v_new
      const CacheOffsets at = cache_offsets(kv, b, seq, pos);
      if (!at.valid) continue;  // never: sequence_in_range covers these pages (a guard at the store)
      const Element k_value = Element(rotated(k_new + t * kv.k_new_row_stride, e, kv, pos));
      const Element v_value = v_new[t * kv.v_new_row_stride + e];
      if constexpr (kFp8) {
        static_cast<__nv_fp8_storage_t*>(const_cast<void*>(p.k))[at.k + hk * p.k_head_stride + e] =
            quantise_e4m3(static_cast<float>(k_value), k_factor);
        static_cast<__nv_fp8_storage_t*>(const_cast<void*>(p.v))[at.v + hk * p.v_head_stride + e] =
            quantise_e4m3(static_cast<float>(v_value), v_factor);
      } else {
        static_cast<Element*>(const_cast<void*>(p.k))[at.k + hk * p.k_head_stride + e] = k_value;
        static_cast<Element*>(const_cast<void*>(p.v))[at.v + hk * p.v_head_stride + e] = v_value;
      }
    }
  }
}

// Merges the splits of one (b, h, t) row per CTA. The loads are what costs (a decoding step
// merges a few dozen splits of a few rows), so they are spread over the threads: every
// split's lse at once, then warp w adds splits w, w + 4, ... of 4-float chunks of the row,
// eight loads in flight per thread, and the warps' sums meet in shared memory. The first
// eight of each thread's partial-row loads do not depend on the lse, so they are issued
// together with the lse loads: one memory round trip before the sums instead of two.
constexpr int kCombineWarps = 4;
constexpr int kCombineEarlyLoads = 8;  // per thread, issued with the lse loads
constexpr int kCombineMaxSplits = 1024;  // validation's bound on num_splits
constexpr int kCombineMaxChunks = 64;    // 4-float chunks of a 256-wide row

template <typename Element>
__global__ void __launch_bounds__(32 * kCombineWarps)
    kvcache_combine_kernel(const __grid_constant__ KvCacheKernelParams kp) {
  const ForwardParams& p = kp.kv.attn;
  __shared__ float weights[kCombineMaxSplits];
  __shared__ float reduce[kCombineWarps];
  __shared__ float4 sums[kCombineWarps][kCombineMaxChunks];
  const int64_t rows = int64_t{p.batch} * p.heads * p.seqlen_q;
  const int64_t row = blockIdx.x;
  const int64_t t = row % p.seqlen_q;
  const int64_t h = (row / p.seqlen_q) % p.heads, b = row / (p.seqlen_q * p.heads);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int splits = kp.num_splits;
  // Launched as a programmatic dependent of the split kernel on sm_90: its CTAs start while
  // the split kernel's last CTAs run, and the partials are read only after it has completed.
  ptx::wait_for_primary_grids();

  // This thread's first chunk (lane) of its warp's first kCombineEarlyLoads splits.
  const int chunks = p.head_dim / 4;
  const auto partial_chunk = [&](int s, int c) {
    return *reinterpret_cast<const float4*>(kp.partial_out + (s * rows + row) * p.head_dim + 4 * c);
  };
  float4 early[kCombineEarlyLoads];
#pragma unroll
  for (int i = 0; i < kCombineEarlyLoads; ++i) {
    const int s = warp + i * kCombineWarps;
    early[i] = lane < chunks && s < splits ? partial_chunk(s, lane) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }

  // lse = log sum_s exp(lse_s), with the same -inf/NaN handling as the in-CTA merge.
  float m = -INFINITY;
  for (int s = threadIdx.x; s < splits; s += 32 * kCombineWarps) {
    weights[s] = kp.partial_lse[s * rows + row];
    m = fmaxf(m, weights[s]);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
  if (lane == 0) reduce[warp] = m;
  __syncthreads();
  m = -INFINITY;
#pragma unroll
  for (int w = 0; w < kCombineWarps; ++w) m = fmaxf(m, reduce[w]);
  const float base = m == -INFINITY ? 0.0f : m;
  float sum = 0.0f;
  for (int s = threadIdx.x; s < splits; s += 32 * kCombineWarps) sum += __expf(weights[s] - base);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  __syncthreads();  // every warp has read reduce[]
  if (lane == 0) reduce[warp] = sum;
  __syncthreads();
  sum = 0.0f;
#pragma unroll
  for (int w = 0; w < kCombineWarps; ++w) sum += reduce[w];
  const float lse = sum == 0.0f ? -INFINITY : base + __logf(sum);
  for (int s = threadIdx.x; s < splits; s += 32 * kCombineWarps)
    weights[s] = sum == 0.0f ? 0.0f : __expf(weights[s] - lse);
  __syncthreads();

  // out = sum_s weight_s out_s, 4 floats per thread and chunk (the early loads first).
  const auto add = [](float4& acc, float w, const float4& v) {
    acc.x += w * v.x;
    acc.y += w * v.y;
    acc.z += w * v.z;
    acc.w += w * v.w;
  };
  for (int c = lane; c < chunks; c += 32) {
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    int s = warp;
    if (c == lane) {
#pragma unroll
      for (int i = 0; i < kCombineEarlyLoads; ++i, s += kCombineWarps)
        if (s < splits) add(acc, weights[s], early[i]);
    }
#pragma unroll 8
    for (; s < splits; s += kCombineWarps) add(acc, weights[s], partial_chunk(s, c));
    sums[warp][c] = acc;
  }
  __syncthreads();
  Element* out = static_cast<Element*>(p.out) + b * p.out_batch_stride + t * p.out_row_stride +
                 h * p.out_head_stride;
  for (int c = threadIdx.x; c < chunks; c += 32 * kCombineWarps) {
    float4 acc = sums[0][c];
#pragma unroll
    for (int w = 1; w < kCombineWarps; ++w) {
      acc.x += sums[w][c].x;
      acc.y += sums[w][c].y;
      acc.z += sums[w][c].z;
      acc.w += sums[w][c].w;
    }
    uint2 packed;
    packed.x = ptx::pack2<Element>(acc.x, acc.y);
    packed.y = ptx::pack2<Element>(acc.z, acc.w);
    *reinterpret_cast<uint2*>(out + 4 * c) = packed;
  }
  if (threadIdx.x == 0 && p.lse != nullptr)
    p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + t] = lse;
}

}  // namespace flashattn::detail::cuda::sm80

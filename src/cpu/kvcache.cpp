// The CPU KV-cache forward (decoding): flash_attn_with_kvcache on the host.
//
// Three steps, each parallel over the threads:
//   1. append: k_new (rotated) and v_new are written into the cache at positions
//      cache_seqlens[b] .. + S_new - 1 of each sequence (a dense row or pages);
//   2. rotary: q is rotated into a temporary of its own dtype (rounded there, as a GPU kernel
//      holding it in registers at that precision would);
//   3. attention: the forward engine's work item (cpu/attention.hpp) over each sequence's
//      cache positions [begin, end), read in place through KeyRows. With num_splits > 1 the
//      keys of every sequence are cut into chunks of whole key blocks, each chunk's partial
//      (out, lse) goes to an fp32 workspace, and a last pass merges them exactly:
//        lse = log sum_s exp(lse_s),   out = sum_s exp(lse_s - lse) out_s.
//
// Splitting only pays when there are fewer (batch, head, query block) items than threads:
// decoding one token of a long cache at batch 1 would otherwise run on a few cores.
//
// Decoding (at most kDecodeRows query rows per key/value head: Sq x H/Hk) takes a path of its
// own in step 3, bound by reading the cache rather than by arithmetic:
//   - a work item is (sequence, group of key/value heads, key chunk), and walks the cache in
//     position order, all heads of its group at each position, kDecodeStep positions at a
//     time: the hardware reads a position's heads as one contiguous run (one head's rows
//     alone, D elements every Hk x D, read at a quarter of the bandwidth: dev/cpu_read_patterns.cpp);
//   - the products read the cache rows in place, converting as they load
//     (decode_scores, decode_accumulate_pv), instead of staging transposed fp32 key blocks
//     that only a few query rows would use;
//   - the rows of the walk's next step are requested in address order (a position's heads as
//     one run of lines) while the current step computes, spread over its calls;
//   - without a thread per (sequence, head group) the keys are split into chunks.
// Its per-thread state is the group's query rows, accumulators and one block of scores.
#include "cpu/kvcache.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "common/numeric.hpp"
#include "common/mask.hpp"
#include "cpu/amx.hpp"
#include "cpu/attention.hpp"
#include "cpu/kernels.hpp"
#include "cpu/tiles.hpp"

namespace flashattn::detail::cpu {
namespace {

// A key chunk shorter than this many blocks costs more in merging than it gains in parallelism.
constexpr int64_t kMinBlocksPerSplit = 4;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// y = x rotated at cache position `pos` (rotary_dim leading dims; the rest copied), computed
// in fp32 and rounded once to T. x and y may not alias.
template <typename T>
void rotate_row(const KvCacheParams& p, int64_t pos, const T* x, T* y) {
  const int D = p.attn.head_dim;
  const int half = p.rotary_dim / 2;
  const T* cos = static_cast<const T*>(p.rotary_cos) + pos * p.rotary_cos_row_stride;
  const T* sin = static_cast<const T*>(p.rotary_sin) + pos * p.rotary_sin_row_stride;
  for (int i = 0; i < half; ++i) {
    // Interleaved rotates the pairs (2i, 2i+1), GPT-NeoX the halves (i, i + rotary_dim/2).
    const int a = p.rotary_interleaved ? 2 * i : i;
    const int b = p.rotary_interleaved ? 2 * i + 1 : i + half;
    const float x0 = to_float(x[a]), x1 = to_float(x[b]);
    const float c = to_float(cos[i]), s = to_float(sin[i]);
    y[a] = from_float<T>(x0 * c - x1 * s);
    y[b] = from_float<T>(x0 * s + x1 * c);
  }
  std::memcpy(y + p.rotary_dim, x + p.rotary_dim, sizeof(T) * static_cast<size_t>(D - p.rotary_dim));
}

// Step 1: k_new (rotated when there is rotary) and v_new into the cache, in place: copies into
// a cache of their dtype T; into an fp8 cache (Cache = float8_e4m3_t), k (rotated and rounded
// to T, as a T cache would store it) and v each divided by its factor and rounded to e4m3,
// saturating (docs/SPEC.md, "Decoding with a KV cache").
template <typename T, typename Cache = T>
void append_new_rows(const KvCacheParams& p, int threads) {
  if (p.k_new == nullptr || p.seqlen_new == 0) return;
  const ForwardParams& a = p.attn;
  const int D = a.head_dim;
  const size_t row_bytes = sizeof(T) * static_cast<size_t>(D);
#pragma omp parallel for collapse(3) num_threads(threads)
  for (int32_t b = 0; b < a.batch; ++b)
    for (int64_t t = 0; t < p.seqlen_new; ++t)
      for (int32_t hk = 0; hk < a.heads_k; ++hk) {
        const KvSequence s = kv_sequence(p, b);
        const int64_t pos = p.cache_seqlens[b] + t;
        const T* k_new = static_cast<const T*>(p.k_new) + b * p.k_new_batch_stride +
                         t * p.k_new_row_stride + hk * p.k_new_head_stride;
        const T* v_new = static_cast<const T*>(p.v_new) + b * p.v_new_batch_stride +
                         t * p.v_new_row_stride + hk * p.v_new_head_stride;
        Cache* k = static_cast<Cache*>(const_cast<void*>(a.k)) +
                   kv_position_offset(p, b, s, pos, a.k_batch_stride, a.k_row_stride) +
                   hk * a.k_head_stride;
        Cache* v = static_cast<Cache*>(const_cast<void*>(a.v)) +
                   kv_position_offset(p, b, s, pos, a.v_batch_stride, a.v_row_stride) +
                   hk * a.v_head_stride;
        if constexpr (std::is_same_v<Cache, T>) {
          if (p.rotary_cos != nullptr)
            rotate_row(p, pos, k_new, k);
          else
            std::memcpy(k, k_new, row_bytes);
          std::memcpy(v, v_new, row_bytes);
        } else {
          T rotated[256];  // head dims are at most 256
          if (p.rotary_cos != nullptr) {
            rotate_row(p, pos, k_new, rotated);
            k_new = rotated;
          }
          const float k_factor = a.k_descale.at(b, hk, 0), v_factor = a.v_descale.at(b, hk, 0);
          for (int d = 0; d < D; ++d) {
            k[d] = to_float8_e4m3(to_float(k_new[d]) / k_factor);
            v[d] = to_float8_e4m3(to_float(v_new[d]) / v_factor);
          }
        }
      }
}

// Step 2: q rotated at rotary_q_position into a contiguous (B, Sq, H, D) tensor of q's dtype.
template <typename T>
std::vector<T> rotated_queries(const KvCacheParams& p, int threads) {
  const ForwardParams& a = p.attn;
  const int64_t D = a.head_dim;
  std::vector<T> rotated(static_cast<size_t>(a.batch * a.seqlen_q * a.heads * D));
#pragma omp parallel for collapse(3) num_threads(threads)
  for (int32_t b = 0; b < a.batch; ++b)
    for (int64_t t = 0; t < a.seqlen_q; ++t)
      for (int32_t h = 0; h < a.heads; ++h) {
        const T* q = static_cast<const T*>(a.q) + b * a.q_batch_stride + t * a.q_row_stride +
                     h * a.q_head_stride;
        rotate_row(p, rotary_q_position(p, b, t), q,
                   rotated.data() + ((b * a.seqlen_q + t) * a.heads + h) * D);
      }
  return rotated;
}

// num_splits = 0: one pass unless there are fewer work items (of packed rows) than threads;
// then enough chunks of at least kMinBlocksPerSplit key blocks to give every thread work.
int32_t resolve_splits(const KvCacheParams& p, int64_t row_blocks, int threads) {
  if (p.num_splits > 0) return p.num_splits;
  const int64_t items = int64_t{p.attn.batch} * p.attn.heads_k * row_blocks;
  if (items == 0 || items >= threads) return 1;
  int64_t longest = 0;
  for (int32_t b = 0; b < p.attn.batch; ++b)
    longest = std::max(longest, kv_sequence(p, b).seqlen_k());
  const int64_t by_keys = ceil_div(longest, kBlockK) / kMinBlocksPerSplit;
  const int64_t by_threads = ceil_div(threads, items);
  return static_cast<int32_t>(std::max<int64_t>(1, std::min(by_keys, by_threads)));
}

// Chunk `split` of `splits` over keys [0, seqlen_k): whole key blocks, the last chunks
// possibly empty.
KeyRange key_chunk(int64_t seqlen_k, int32_t splits, int32_t split) {
  const int64_t per_split = ceil_div(ceil_div(seqlen_k, kBlockK), splits) * kBlockK;
  KeyRange r;
  r.begin = std::min(split * per_split, seqlen_k);
  r.end = std::min(r.begin + per_split, seqlen_k);
  return r;
}

// Step 3b: out and lse of every row from its chunks' partials. Partials are laid out
// (split, B, H, Sq) rows of head_dim_v floats, lse likewise.
template <typename T>
void merge_splits(const ForwardParams& a, int32_t splits, const float* part_out,
                  const float* part_lse, int threads) {
  const int64_t rows_per_split = int64_t{a.batch} * a.heads * a.seqlen_q;
  const int Dv = a.head_dim_v;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
#pragma omp parallel for collapse(3) num_threads(threads)
  for (int32_t b = 0; b < a.batch; ++b)
    for (int32_t h = 0; h < a.heads; ++h)
      for (int64_t i = 0; i < a.seqlen_q; ++i) {
        const int64_t row = (int64_t{b} * a.heads + h) * a.seqlen_q + i;
        T* out = static_cast<T*>(a.out) + b * a.out_batch_stride + i * a.out_row_stride +
                 h * a.out_head_stride;
        // An empty chunk (lse -inf) weighs 0; a NaN in any chunk makes the row NaN, as the
        // unsplit engine's would be.
        float largest = kNegInf;
        bool nan = false;
        for (int32_t s = 0; s < splits; ++s) {
          const float l = part_lse[s * rows_per_split + row];
          nan = nan || std::isnan(l);
          largest = std::max(largest, l);
        }
        float lse;
        if (nan) {
          lse = std::numeric_limits<float>::quiet_NaN();
        } else if (largest == kNegInf) {
          lse = kNegInf;  // no chunk saw a key
        } else {
          float sum = 0.0f;
          for (int32_t s = 0; s < splits; ++s)
            sum += std::exp(part_lse[s * rows_per_split + row] - largest);
          lse = largest + std::log(sum);
        }
        float acc[256] = {};  // head dims are at most 256
        if (lse == kNegInf) {
          // out = 0
        } else if (nan) {
          std::fill(acc, acc + Dv, lse);
        } else {
          for (int32_t s = 0; s < splits; ++s) {
            const float w = std::exp(part_lse[s * rows_per_split + row] - lse);
            if (w == 0.0f) continue;
            const float* o = part_out + (s * rows_per_split + row) * Dv;
            for (int d = 0; d < Dv; ++d) acc[d] += w * o[d];
          }
        }
        for (int d = 0; d < Dv; ++d) out[d] = from_float<T>(acc[d]);
        if (a.lse != nullptr) a.lse[b * a.lse_batch_stride + h * a.lse_head_stride + i] = lse;
      }
}

// ---- The decode path ----------------------------------------------------------------------

// Query rows per key/value head (Sq x H/Hk) up to which a call takes the decode path.
constexpr int64_t kDecodeRows = 16;
// Positions per step of a decode item's walk over the cache, all heads of its group at each.
constexpr int kDecodeStep = 8;
// Bytes of one head's rows per product call of the walk (keys of a step, fewer where rows are
// wider), and of the next step requested before it. With a position of the next step (8 heads x
// 512 bytes: 64 prefetches) before each 8-key fp32 call, the burst stalled on outstanding
// misses while no product ran; two bursts of 32 before calls of 4 keys read fp32 caches
// 1.14-1.20x faster (bf16 calls, 8 keys of 256 bytes, unchanged; 2-core AMD VM, 2026-12-07).
constexpr int64_t kDecodeCallBytes = 2048;
// A decode item holds its heads' query rows, accumulators and block of scores: a group of
// key/value heads is as many as fit in this many floats (at least one).
constexpr int64_t kDecodeStateFloats = 32768;
// A key chunk of a decode item reads at least this many bytes of K and V: a split costs a
// partial (out, lse) per query row, written and merged, which must stay small beside it.
constexpr int64_t kMinDecodeSplitBytes = 128 * 1024;

constexpr int64_t kStateAlign = 16;  // floats: 64 bytes
int64_t align_floats(int64_t n) { return (n + kStateAlign - 1) / kStateAlign * kStateAlign; }

struct DecodeShape {
  int rows;      // query rows per key/value head: Sq x G, packed as RowBlock packs them
  int heads;     // key/value heads per group
  int groups;    // ceil(Hk / heads)
  int32_t splits;
  int64_t state_floats;  // per thread

  int64_t q_floats(const ForwardParams& a) const { return align_floats(int64_t{heads} * rows * a.head_dim); }
  int64_t acc_floats(const ForwardParams& a) const { return align_floats(int64_t{heads} * rows * a.head_dim_v); }
  int64_t s_floats() const { return align_floats(int64_t{heads} * rows * kBlockK); }
  int64_t ml_floats() const { return align_floats(int64_t{heads} * rows); }
};

DecodeShape decode_shape(const KvCacheParams& p, int threads) {
  const ForwardParams& a = p.attn;
  DecodeShape d;
  d.rows = static_cast<int>(a.seqlen_q * a.group_size());
  const int64_t per_head = int64_t{d.rows} * (a.head_dim + a.head_dim_v + kBlockK + 2);
  const int64_t fit = std::max<int64_t>(1, kDecodeStateFloats / per_head);
  d.groups = static_cast<int>(ceil_div(a.heads_k, std::min<int64_t>(fit, a.heads_k)));
  d.heads = static_cast<int>(ceil_div(a.heads_k, d.groups));  // groups as even as they go
  d.state_floats = d.q_floats(a) + d.acc_floats(a) + d.s_floats() + 2 * d.ml_floats();
  if (p.num_splits > 0) {
    d.splits = p.num_splits;
    return d;
  }
  // Chunks only when (sequence, group) items leave threads idle: as many as the threads need,
  // each of whole key blocks and at least kMinDecodeSplitBytes.
  const int64_t items = int64_t{a.batch} * d.groups;
  d.splits = 1;
  if (items == 0 || items >= threads) return d;
  int64_t longest = 0;
  for (int32_t b = 0; b < a.batch; ++b)
    longest = std::max(longest, kv_sequence(p, b).seqlen_k());
  const int64_t key_bytes = int64_t{d.heads} * (a.head_dim + a.head_dim_v) *
                            static_cast<int64_t>(dtype_size(a.dtype));
  const int64_t by_bytes = longest * key_bytes / kMinDecodeSplitBytes;
  const int64_t by_blocks = ceil_div(longest, kBlockK);
  const int64_t by_threads = ceil_div(threads, items);
  d.splits = static_cast<int32_t>(std::max<int64_t>(1, std::min({by_bytes, by_blocks, by_threads})));
  return d;
}

// A row of n floats into (to_pairs) or out of the order of the bf16 decode products: each
// whole group of `group` elements held as its even elements then its odd ones
// (decode_bf16_group).
void pair_order(float* row, int n, int group, bool to_pairs) {
  float tmp[32];  // a group: 2 x the widest vector's lanes (AVX-512: 16)
  const int half = group / 2;
  for (int g0 = 0; g0 + group <= n; g0 += group) {
    float* x = row + g0;
    for (int i = 0; i < half; ++i) {
      if (to_pairs) {
        tmp[i] = x[2 * i];
        tmp[half + i] = x[2 * i + 1];
      } else {
        tmp[2 * i] = x[i];
        tmp[2 * i + 1] = x[half + i];
      }
    }
    std::copy(tmp, tmp + group, x);
  }
}

// One decode item: the query rows of sequence b, key/value heads [hk0, hk0 + heads), against
// the keys of `chunk` that the mask lets them see; writes out/lse (one split) or the chunk's
// partial rows. Row r of head hk0 + g is query position r / G of query head (hk0 + g) G + r % G.
template <typename T>
void decode_item(const KvCacheParams& p, const DecodeShape& shape, int32_t b, int32_t hk0,
                 int32_t split, float* state, float* part_out, float* part_lse) {
  const ForwardParams& a = p.attn;
  const int D = a.head_dim, Dv = a.head_dim_v, R = shape.rows;
  const int32_t G = a.group_size();
  const int heads = std::min<int>(shape.heads, a.heads_k - hk0);
  float* q = state;
  float* acc = q + shape.q_floats(a);
  float* s = acc + shape.acc_floats(a);
  float* m = s + shape.s_floats();
  float* l = m + shape.ml_floats();
  const auto position = [G](int r) { return static_cast<int64_t>(r / G); };
  const auto head = [G, hk0](int g, int r) { return (hk0 + g) * G + r % G; };

  const KvSequence sequence = kv_sequence(p, b);
  SequenceView seq;
  seq.seqlen_q = a.seqlen_q;
  seq.seqlen_k = sequence.seqlen_k();
  const KeyRows keys = KeyRows::of_cache(p, b, sequence, hk0);

  // bf16 caches where AVX512-BF16 is available (amx.hpp): the scores by VDPBF16PS from the
  // query rows as stored (bf16, scaled after the products); otherwise fp32 query rows, scaled.
  const bool bf16_dots = std::is_same_v<T, bfloat16_t> && amx::available();
  bfloat16_t* q16 = reinterpret_cast<bfloat16_t*>(q);  // bf16_dots: heads x R rows of D, in q's floats
  for (int g = 0; g < heads; ++g)
    for (int r = 0; r < R; ++r) {
      const T* from = static_cast<const T*>(a.q) + b * a.q_batch_stride + position(r) * a.q_row_stride +
                      head(g, r) * a.q_head_stride;
      if constexpr (std::is_same_v<T, bfloat16_t>)
        if (bf16_dots) {
          std::copy(from, from + D, q16 + (int64_t{g} * R + r) * D);
          continue;
        }
      convert_row(from, q + (int64_t{g} * R + r) * D, D, query_scale(a));
    }
  const int pair_group = std::is_same_v<T, bfloat16_t> ? decode_bf16_group() : 0;
  if (pair_group > 0 && !bf16_dots)
    for (int row = 0; row < heads * R; ++row) pair_order(q + int64_t{row} * D, D, pair_group, true);
  std::fill(m, m + heads * R, -std::numeric_limits<float>::infinity());
  std::fill(l, l + heads * R, 0.0f);
  std::fill(acc, acc + int64_t{heads} * R * Dv, 0.0f);

  const KeyRange chunk = key_chunk(seq.seqlen_k, shape.splits, split);
  const KeyRange visible =
      visible_keys_of_rows(0, a.seqlen_q, seq.seqlen_q, seq.seqlen_k, a.window_left, a.window_right);
  const int64_t begin = std::max(visible.begin, chunk.begin);
  const int64_t end = std::min(visible.end, chunk.end);
  // The walk reads, block by block, the keys of its positions then their values, a step of
  // kDecodeStep positions at a time, each step as product calls head by head (a head's rows,
  // D elements every row stride; at most kDecodeCallBytes of them a call). The hardware would
  // see that as `heads` strided streams; instead, the step after the current one is requested
  // in address order, a position's heads as one run of lines, one prefetch per 64-byte line,
  // in equal shares before each of the current step's calls (prefetch_lines). Steps of 8
  // positions, not 16 (fp32 0.83-0.85x), we think because with 16 the step requested and the
  // one read (2 x 32 KiB of bf16, 2 x 64 KiB of fp32) and the item's state (48 KiB at 8 heads)
  // overflow the 48 KiB L1. bf16 caches 1.10-1.47x, fp32 1.09-1.13x against requesting each
  // call's rows one call ahead, head by head (2-core AMD VM, 2026-12-07; docs/PERFORMANCE.md).
  struct Step {
    const T* rows = nullptr;  // the step's first position, head hk0
    int count = 0;            // positions (0: the walk's end)
    bool values = false;
  };
  // The step after the one that ends at key c_next of pass `values` of the block at j0 (cols
  // keys): the pass's next step, else the block's values, else the next block's keys.
  const auto step_after = [&](int64_t j0, int cols, int c_next, bool values) {
    Step next;
    int64_t at = j0 + c_next;
    int n = cols - c_next;
    if (n <= 0 && !values) {
      at = j0;
      n = cols;
      values = true;
    } else if (n <= 0) {
      at = j0 + kBlockK;
      n = static_cast<int>(std::min<int64_t>(kBlockK, end - at));
      values = false;
    }
    if (n <= 0) return next;
    const KeyRows::Run<T> run = keys.run<T>(at, std::min(kDecodeStep, n));
    next.rows = values ? run.v : run.k;
    next.count = run.count;
    next.values = values;
    return next;
  };
  // The lines of a step in address order (a position's heads as one span where they are
  // contiguous, else a span each), handed out a share at a time by prefetch_lines.
  struct Lines {
    const char* rows = nullptr;
    int64_t row_stride = 0, head_stride = 0, span = 0, off = 0;
    int spans = 0, count = 0, x = 0, g = 0;
    int64_t bytes() const { return int64_t{count} * spans * span; }
  };
  const auto lines_of = [&](const Step& step) {
    Lines lines;
    const bool dense = step.values ? a.v_head_stride == Dv : a.k_head_stride == D;
    const int64_t width = sizeof(T) * (step.values ? Dv : D);
    lines.rows = reinterpret_cast<const char*>(step.rows);
    lines.row_stride = sizeof(T) * (step.values ? keys.v_row_stride : keys.k_row_stride);
    lines.head_stride = sizeof(T) * (step.values ? a.v_head_stride : a.k_head_stride);
    lines.spans = dense ? 1 : heads;
    lines.span = dense ? heads * width : width;
    lines.count = step.count;
    return lines;
  };
  // Requests the next `bytes` of `lines` (every line they touch: one at a share's edge may be
  // asked for twice). Always inlined: out of line, GCC took a function of prefetches alone
  // for one without effects and dropped its calls (it did so to a lambda of them here before).
  const auto prefetch_lines = [](Lines& lines, int64_t bytes) __attribute__((always_inline)) {
    while (bytes > 0 && lines.x < lines.count) {
      const uintptr_t first = reinterpret_cast<uintptr_t>(lines.rows + lines.x * lines.row_stride +
                                                          lines.g * lines.head_stride) + lines.off;
      const int64_t n = std::min(lines.span - lines.off, bytes);
      for (uintptr_t line = first & ~uintptr_t{63}; line < first + n; line += 64)
        __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 3);
      bytes -= n;
      lines.off += n;
      if (lines.off == lines.span) {
        lines.off = 0;
        if (++lines.g == lines.spans) {
          lines.g = 0;
          ++lines.x;
        }
      }
    }
  };
  // Keys per product call: a call reads at most kDecodeCallBytes of one head's rows and
  // requests as many bytes of the next step before it.
  const int k_call = static_cast<int>(std::clamp<int64_t>(kDecodeCallBytes / (int64_t{D} * sizeof(T)), 1, kDecodeStep));
  const int v_call = static_cast<int>(std::clamp<int64_t>(kDecodeCallBytes / (int64_t{Dv} * sizeof(T)), 1, kDecodeStep));
  for (int64_t j0 = begin; j0 < end; j0 += kBlockK) {
    const int cols = static_cast<int>(std::min<int64_t>(kBlockK, end - j0));
    for (int pass = 0; pass < 2; ++pass) {  // scores, then values
      const bool values = pass == 1;
      if (values)
        for (int g = 0; g < heads; ++g)
          for (int r = 0; r < R; ++r) {
            const int64_t row = int64_t{g} * R + r;
            const float slope =
                a.alibi_slopes != nullptr ? a.alibi_slopes[b * a.alibi_batch_stride + head(g, r)] : 0.0f;
            modify_scores(a, seq, slope, s + row * kBlockK, position(r), 1, j0, cols);
            softmax_step(s + row * kBlockK, m + row, l + row, acc + row * Dv, Dv);
          }
      const int per_call = values ? v_call : k_call;
      for (int c = 0; c < cols;) {
        const KeyRows::Run<T> run = keys.run<T>(j0 + c, std::min(kDecodeStep, cols - c));
        if (j0 == begin && c == 0 && !values) {  // the walk's first step: nothing requested it
          Lines first = lines_of({run.k, run.count, false});
          prefetch_lines(first, first.bytes());
        }
        Lines next = lines_of(step_after(j0, cols, c + run.count, values));
        const int calls = heads * static_cast<int>(ceil_div(run.count, per_call));
        const int64_t share = ceil_div(next.bytes(), calls);
        for (int g = 0; g < heads; ++g)
          for (int x0 = 0; x0 < run.count; x0 += per_call) {
            const int n = std::min(per_call, run.count - x0);
            prefetch_lines(next, share);
            float* sx = s + int64_t{g} * R * kBlockK + c + x0;
            if (values)
              decode_accumulate_pv(sx, kBlockK, R, run.v + g * a.v_head_stride + x0 * keys.v_row_stride,
                                   keys.v_row_stride, n, acc + int64_t{g} * R * Dv, Dv, Dv);
            else if (bf16_dots)
              amx::decode_scores(reinterpret_cast<const bfloat16_t*>(q16 + int64_t{g} * R * D), D, R, D,
                                 reinterpret_cast<const bfloat16_t*>(run.k + g * a.k_head_stride +
                                                                     x0 * keys.k_row_stride),
                                 keys.k_row_stride, n, query_scale(a), sx, kBlockK);
            else
              decode_scores(q + int64_t{g} * R * D, R, D, run.k + g * a.k_head_stride + x0 * keys.k_row_stride,
                            keys.k_row_stride, n, sx, kBlockK);
          }
        c += run.count;
      }
    }
  }

  const int64_t rows_per_split = int64_t{a.batch} * a.heads * a.seqlen_q;
  for (int g = 0; g < heads; ++g)
    for (int r = 0; r < R; ++r) {
      const int64_t row = int64_t{g} * R + r, i = position(r);
      const int32_t h = head(g, r);
      if (pair_group > 0) pair_order(acc + row * Dv, Dv, pair_group, false);
      if (shape.splits == 1) {
        T* out = static_cast<T*>(a.out) + b * a.out_batch_stride + i * a.out_row_stride +
                 h * a.out_head_stride;
        float* lse = a.lse != nullptr ? a.lse + b * a.lse_batch_stride + h * a.lse_head_stride + i
                                      : nullptr;
        store_normalised(acc + row * Dv, m[row], l[row], Dv, out, lse);
      } else {
        const int64_t at = split * rows_per_split + (int64_t{b} * a.heads + h) * a.seqlen_q + i;
        store_normalised(acc + row * Dv, m[row], l[row], Dv, part_out + at * Dv, part_lse + at);
      }
    }
}

// Step 3 for decoding: every (sequence, head group, key chunk) item, then the merge.
template <typename T>
void decode(const KvCacheParams& p, int threads, KvCacheRun& run) {
  const ForwardParams& a = p.attn;
  const DecodeShape shape = decode_shape(p, threads);
  run.num_splits = shape.splits;
  const int64_t items = int64_t{a.batch} * shape.groups * shape.splits;
  if (items == 0) return;
  const int workers = static_cast<int>(std::min<int64_t>(threads, items));
  // Not zeroed: decode_item writes every float of its state before reading it, and every
  // partial row of its chunk.
  const int64_t state_floats = workers * shape.state_floats + kStateAlign;
  const std::unique_ptr<float[]> state(new float[static_cast<size_t>(state_floats)]);
  float* state0 = state.get();
  while (reinterpret_cast<uintptr_t>(state0) % (kStateAlign * sizeof(float)) != 0) ++state0;
  const int64_t rows_per_split = int64_t{a.batch} * a.heads * a.seqlen_q;
  const int64_t part_floats = shape.splits > 1 ? shape.splits * rows_per_split * (a.head_dim_v + 1) : 0;
  const std::unique_ptr<float[]> parts(new float[static_cast<size_t>(part_floats)]);
  float* part_out = parts.get();
  float* part_lse = part_out + shape.splits * rows_per_split * a.head_dim_v;
  run.workspace_bytes += static_cast<size_t>(state_floats + part_floats) * sizeof(float);
#pragma omp parallel num_threads(workers)
  {
    float* mine = state0 + omp_get_thread_num() * shape.state_floats;
#pragma omp for collapse(3) schedule(dynamic, 1)
    for (int32_t b = 0; b < a.batch; ++b)
      for (int32_t group = 0; group < shape.groups; ++group)
        for (int32_t split = 0; split < shape.splits; ++split)
          decode_item<T>(p, shape, b, group * shape.heads, split, mine, part_out, part_lse);
  }
  if (shape.splits > 1) merge_splits<T>(a, shape.splits, part_out, part_lse, workers);
}

template <typename T>
KvCacheRun forward_kvcache_typed(const KvCacheParams& params) {
  const int threads = params.attn.num_threads > 0 ? params.attn.num_threads : omp_get_max_threads();
  KvCacheRun run;
  append_new_rows<T>(params, threads);

  KvCacheParams p = params;
  ForwardParams& a = p.attn;
  std::vector<T> rotated_q;
  if (p.rotary_cos != nullptr && a.batch > 0 && a.seqlen_q > 0) {
    rotated_q = rotated_queries<T>(params, threads);
    a.q = rotated_q.data();
    a.q_head_stride = a.head_dim;
    a.q_row_stride = int64_t{a.heads} * a.head_dim;
    a.q_batch_stride = a.seqlen_q * a.q_row_stride;
    run.workspace_bytes += rotated_q.size() * sizeof(T);
  }

  // Work items hold the G = H / Hk query heads of one key/value head packed position by
  // position (RowBlock), kBlockQ packed rows each: a key block is loaded (and converted to
  // fp32) once for all of them instead of once per query head.
  const int32_t group = a.group_size();
  const int64_t packed_rows = a.seqlen_q * group;
  if (packed_rows > 0 && packed_rows <= kDecodeRows) {
    decode<T>(p, threads, run);
    return run;
  }
  const int64_t row_blocks = ceil_div(packed_rows, kBlockQ);
  const int32_t splits = resolve_splits(p, row_blocks, threads);
  run.num_splits = splits;
  const int64_t items = int64_t{a.batch} * a.heads_k * row_blocks * splits;
  if (items == 0) return run;
  const int workers = static_cast<int>(std::min<int64_t>(threads, items));
  const TileArena arena(workers, a.head_dim, a.head_dim_v);
  std::vector<float> part_out, part_lse;
  const int64_t rows_per_split = int64_t{a.batch} * a.heads * a.seqlen_q;
  if (splits > 1) {
    part_out.resize(static_cast<size_t>(splits * rows_per_split * a.head_dim_v));
    part_lse.resize(static_cast<size_t>(splits * rows_per_split));
  }
  run.workspace_bytes += arena.bytes() + (part_out.size() + part_lse.size()) * sizeof(float);

#pragma omp parallel num_threads(workers)
  {
    Tiles tiles = arena.tiles(omp_get_thread_num());
#pragma omp for collapse(4) schedule(dynamic, 1)
    for (int32_t b = 0; b < a.batch; ++b)
      for (int32_t hk = 0; hk < a.heads_k; ++hk)
        for (int64_t block = 0; block < row_blocks; ++block)
          for (int32_t split = 0; split < splits; ++split) {
            const KvSequence s = kv_sequence(p, b);
            SequenceView seq;
            seq.seqlen_q = a.seqlen_q;
            seq.seqlen_k = s.seqlen_k();
            RowBlock rows;
            rows.first = block * kBlockQ;
            rows.rows = static_cast<int>(std::min<int64_t>(kBlockQ, packed_rows - rows.first));
            rows.head0 = hk * group;
            rows.group = group;
            const KeyRows keys = KeyRows::of_cache(p, b, s, hk);
            attend_rows<T>(a, seq, keys, key_chunk(seq.seqlen_k, splits, split), nullptr, b,
                           rows, tiles);
            for (int r = 0; r < rows.rows; ++r) {
              const int64_t i = rows.position(r);
              const int32_t h = rows.head(r);
              if (splits == 1) {
                T* out = static_cast<T*>(a.out) + b * a.out_batch_stride + i * a.out_row_stride +
                         h * a.out_head_stride;
                float* lse = a.lse != nullptr
                                 ? a.lse + b * a.lse_batch_stride + h * a.lse_head_stride + i
                                 : nullptr;
                store_row(tiles, r, a.head_dim_v, out, lse);
              } else {
                const int64_t row = split * rows_per_split + (int64_t{b} * a.heads + h) * a.seqlen_q + i;
                store_row(tiles, r, a.head_dim_v, part_out.data() + row * a.head_dim_v,
                          part_lse.data() + row);
              }
            }
          }
  }
  if (splits > 1) merge_splits<T>(a, splits, part_out.data(), part_lse.data(), workers);
  return run;
}

// ---- FP8 caches ---------------------------------------------------------------------------
// fp8 e4m3 caches (docs/SPEC.md, "Decoding with a KV cache"): the semantics, not speed. The
// appended rows are quantised into the caches in place; then each sequence's keys and values,
// dequantised (value times its factor: exact up to the product's one rounding), and q
// (rotated in its own dtype, as for any cache) are copied into fp32 tensors, and the fp32
// path above attends over them as a dense cache that holds just those positions; its out is
// rounded to q's dtype.

template <typename T>
KvCacheRun forward_kvcache_fp8(const KvCacheParams& params) {
  const int threads = params.attn.num_threads > 0 ? params.attn.num_threads : omp_get_max_threads();
  append_new_rows<T, float8_e4m3_t>(params, threads);

  const ForwardParams& a = params.attn;
  const int32_t B = a.batch, H = a.heads, Hk = a.heads_k, D = a.head_dim;
  const int64_t Sq = a.seqlen_q;
  std::vector<int32_t> lengths(static_cast<size_t>(B));
  int64_t longest = 0;
  for (int32_t b = 0; b < B; ++b) {
    // Validated: in range, and shorter than the cache's 2^31 positions.
    lengths[size_t(b)] = static_cast<int32_t>(kv_sequence(params, b).seqlen_k());
    longest = std::max<int64_t>(longest, lengths[size_t(b)]);
  }
  const int64_t kv_floats = int64_t{B} * longest * Hk * D;
  std::vector<float> k(static_cast<size_t>(kv_floats)), v(static_cast<size_t>(kv_floats));
#pragma omp parallel for collapse(2) num_threads(threads)
  for (int32_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < longest; ++j) {
      const KvSequence s = kv_sequence(params, b);
      if (j >= s.seqlen_k()) continue;
      const int64_t pos = s.begin + j;
      const int64_t k_row = kv_position_offset(params, b, s, pos, a.k_batch_stride, a.k_row_stride);
      const int64_t v_row = kv_position_offset(params, b, s, pos, a.v_batch_stride, a.v_row_stride);
      for (int32_t hk = 0; hk < Hk; ++hk) {
        const auto* k8 = static_cast<const float8_e4m3_t*>(a.k) + k_row + hk * a.k_head_stride;
        const auto* v8 = static_cast<const float8_e4m3_t*>(a.v) + v_row + hk * a.v_head_stride;
        const float k_factor = a.k_descale.at(b, hk, 0), v_factor = a.v_descale.at(b, hk, 0);
        float* k_to = k.data() + ((b * longest + j) * Hk + hk) * D;
        float* v_to = v.data() + ((b * longest + j) * Hk + hk) * D;
        for (int32_t d = 0; d < D; ++d) {
          k_to[d] = to_float(k8[d]) * k_factor;
          v_to[d] = to_float(v8[d]) * v_factor;
        }
      }
    }

  // q after rotary, in T, then exactly in fp32.
  std::vector<T> rotated;
  if (params.rotary_cos != nullptr && B > 0 && Sq > 0) rotated = rotated_queries<T>(params, threads);
  const int64_t q_floats = int64_t{B} * Sq * H * D;
  std::vector<float> q(static_cast<size_t>(q_floats)), out(static_cast<size_t>(q_floats));
#pragma omp parallel for collapse(3) num_threads(threads)
  for (int32_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < Sq; ++t)
      for (int32_t h = 0; h < H; ++h) {
        const T* from = rotated.empty()
                            ? static_cast<const T*>(a.q) + b * a.q_batch_stride + t * a.q_row_stride +
                                  h * a.q_head_stride
                            : rotated.data() + ((b * Sq + t) * H + h) * D;
        float* to = q.data() + ((b * Sq + t) * H + h) * D;
        for (int32_t d = 0; d < D; ++d) to[d] = to_float(from[d]);
      }

  KvCacheParams f;
  f.attn = a;
  ForwardParams& fa = f.attn;
  fa.dtype = DType::Float32;
  f.cache_dtype = DType::Float32;
  fa.q = q.data();
  fa.k = k.data();
  fa.v = v.data();
  fa.out = out.data();  // lse: the caller's, as it is
  fa.seqlen_k = longest;
  fa.q_row_stride = fa.out_row_stride = int64_t{H} * D;
  fa.q_batch_stride = fa.out_batch_stride = Sq * fa.q_row_stride;
  fa.q_head_stride = fa.out_head_stride = D;
  fa.k_row_stride = fa.v_row_stride = int64_t{Hk} * D;
  fa.k_batch_stride = fa.v_batch_stride = longest * fa.k_row_stride;
  fa.k_head_stride = fa.v_head_stride = D;
  fa.q_descale = fa.k_descale = fa.v_descale = Descale{};
  f.cache_seqlens = lengths.data();
  f.cache_rows = B;
  f.num_splits = params.num_splits;
  KvCacheRun run = forward_kvcache_typed<float>(f);

#pragma omp parallel for collapse(3) num_threads(threads)
  for (int32_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < Sq; ++t)
      for (int32_t h = 0; h < H; ++h) {
        const float* from = out.data() + ((b * Sq + t) * H + h) * D;
        T* to = static_cast<T*>(a.out) + b * a.out_batch_stride + t * a.out_row_stride +
                h * a.out_head_stride;
        for (int32_t d = 0; d < D; ++d) to[d] = from_float<T>(from[d]);
      }
  run.workspace_bytes += (k.size() + v.size() + q.size() + out.size()) * sizeof(float) +
                         rotated.size() * sizeof(T);
  return run;
}

}  // namespace

KvCacheRun forward_kvcache(const KvCacheParams& params) {
  amx::check_setting();
  // q's dtype picks T (fp32, fp16 or bf16: validated; never fp8), the caches' the path.
  const auto run = [&params](auto q_type) {
    using T = decltype(q_type);
    return params.cache_dtype == DType::Float8E4M3 ? forward_kvcache_fp8<T>(params)
                                                   : forward_kvcache_typed<T>(params);
  };
  switch (params.attn.dtype) {
    case DType::Float32:
      return run(float{});
    case DType::Float16:
      return run(half_t{});
    case DType::BFloat16:
      return run(bfloat16_t{});
    case DType::Int32:
    case DType::Float8E4M3:  // refused by validation
      break;
  }
  throw Error(ErrorCode::Internal, "dtype", "fp32, fp16 or bf16 after validation",
              dtype_name(params.attn.dtype));
}

}  // namespace flashattn::detail::cpu

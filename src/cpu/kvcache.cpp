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
#include "cpu/kvcache.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "common/numeric.hpp"
#include "cpu/attention.hpp"
#include "cpu/kernels.hpp"

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

// Step 1: k_new (rotated when there is rotary) and v_new into the cache, in place.
template <typename T>
void append_new_rows(const KvCacheParams& p, int threads) {
  if (p.k_new == nullptr || p.seqlen_new == 0) return;
  const ForwardParams& a = p.attn;
  const size_t row_bytes = sizeof(T) * static_cast<size_t>(a.head_dim);
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
        T* k = static_cast<T*>(const_cast<void*>(a.k)) +
               kv_position_offset(p, b, s, pos, a.k_batch_stride, a.k_row_stride) +
               hk * a.k_head_stride;
        T* v = static_cast<T*>(const_cast<void*>(a.v)) +
               kv_position_offset(p, b, s, pos, a.v_batch_stride, a.v_row_stride) +
               hk * a.v_head_stride;
        if (p.rotary_cos != nullptr)
          rotate_row(p, pos, k_new, k);
        else
          std::memcpy(k, k_new, row_bytes);
        std::memcpy(v, v_new, row_bytes);
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

}  // namespace

KvCacheRun forward_kvcache(const KvCacheParams& params) {
  switch (params.attn.dtype) {
    case DType::Float32:
      return forward_kvcache_typed<float>(params);
    case DType::Float16:
      return forward_kvcache_typed<half_t>(params);
    case DType::BFloat16:
      return forward_kvcache_typed<bfloat16_t>(params);
    case DType::Int32:
    case DType::Float8E4M3:  // forward only: refused by validation
      break;
  }
  throw Error(ErrorCode::Internal, "dtype", "fp32, fp16 or bf16 after validation",
              dtype_name(params.attn.dtype));
}

}  // namespace flashattn::detail::cpu

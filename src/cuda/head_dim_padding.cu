// The padded copies of a call whose head dim is not a multiple of 8 (cuda/head_dim_padding.hpp):
// the plan (which tensors, where their copies go in one allocation), the two copy kernels
// (whole tensors; the positions of a kv cache) and the three entry points.
#include "cuda/head_dim_padding.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "cuda/common/stream_allocation.hpp"

namespace flashattn::detail::cuda {
namespace {

// The CUDA backend takes fp16 and bf16 only (api/validate.cpp): both are copied as 16-bit
// patterns, so a copy is bit-exact (NaN payloads included) and needs no dtype dispatch.
using Bits = uint16_t;
constexpr int kChunk = static_cast<int>(kHeadDimMultiple);  // elements per 16-byte chunk
constexpr int kThreads = 256;
// Grid-stride loops beyond this many blocks (several waves on any current GPU).
constexpr int64_t kMaxBlocks = 4096;
// A cache copy's blocks per sequence: the rows a sequence holds are known only on the device.
constexpr int64_t kMaxBlocksPerSequence = 64;
// Each copy starts on its own 256-byte boundary (the kernels' 16-byte rows need 16).
constexpr size_t kAlignment = 256;

// Columns [col, col + 8) of a row: the caller's (width elements, read one by one, since the
// caller's rows need not be 16-byte aligned) into the padded copy, zero from width on.
__device__ __forceinline__ void pad_chunk(const Bits* caller, Bits* padded, int col, int width) {
  uint32_t words[kChunk / 2];
#pragma unroll
  for (int e = 0; e < kChunk; e += 2) {
    const uint32_t lo = col + e < width ? caller[col + e] : 0u;
    const uint32_t hi = col + e + 1 < width ? caller[col + e + 1] : 0u;
    words[e / 2] = lo | hi << 16;
  }
  *reinterpret_cast<uint4*>(padded + col) = make_uint4(words[0], words[1], words[2], words[3]);
}

// The reverse: columns [col, col + 8) of the padded copy back into the caller's row, those
// below width only.
__device__ __forceinline__ void unpad_chunk(const Bits* padded, Bits* caller, int col, int width) {
  const uint4 v = *reinterpret_cast<const uint4*>(padded + col);
  const uint32_t words[kChunk / 2] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int e = 0; e < kChunk; ++e)
    if (col + e < width) caller[col + e] = static_cast<Bits>(words[e / 2] >> (16 * (e % 2)));
}

// A (batches, rows, heads, width) tensor as the params address it, and its padded copy,
// contiguous (batches, rows, heads, padded_width). Varlen tensors are one batch of total rows.
struct TensorRows {
  Bits* caller = nullptr;  // an input's rows are only read
  int64_t batch_stride = 0, row_stride = 0, head_stride = 0;
  Bits* padded = nullptr;
  int64_t batches = 0, rows = 0, heads = 0;
  const int32_t* row_end = nullptr;  // varlen: &cu_seqlens[B]; the rows from there on are none
                                     // of the call's
  int32_t width = 0, padded_width = 0;

  __host__ __device__ int64_t units() const {  // 16-byte chunks of the padded copy
    return batches * rows * heads * (padded_width / kChunk);
  }
};

// One thread per 16-byte chunk of the padded copy.
template <bool kToPadded>
__global__ void __launch_bounds__(kThreads) copy_tensor_rows(const __grid_constant__ TensorRows t) {
  const int chunks = t.padded_width / kChunk;
  const int64_t units = t.units();
  const int64_t row_end = t.row_end != nullptr ? *t.row_end : t.rows;
  for (int64_t u = int64_t{blockIdx.x} * kThreads + threadIdx.x; u < units;
       u += int64_t{gridDim.x} * kThreads) {
    const int64_t row = u / chunks;  // of the padded copy
    const int col = static_cast<int>(u - row * chunks) * kChunk;
    const int64_t h = row % t.heads, batch_row = row / t.heads;
    const int64_t s = batch_row % t.rows, b = batch_row / t.rows;
    if (s >= row_end) continue;
    Bits* caller = t.caller + b * t.batch_stride + s * t.row_stride + h * t.head_stride;
    Bits* padded = t.padded + row * t.padded_width;
    if constexpr (kToPadded)
      pad_chunk(caller, padded, col, t.width);
    else
      unpad_chunk(padded, caller, col, t.width);
  }
}

// A kv cache (k or v) of the caller's call, addressed as its params say (dense rows picked by
// cache_batch_idx, or pages), and its padded copy: dense (B, capacity, Hk, padded_width),
// position p of sequence b at row (b, p).
struct CacheRows {
  KvCacheParams kv;  // the caller's call
  bool value = false;  // the v cache (else k): what a missing page reads as differs
  Bits* caller = nullptr;
  int64_t batch_stride = 0, row_stride = 0, head_stride = 0;
  Bits* padded = nullptr;
  int32_t width = 0, padded_width = 0;
};

// Whether sequence b of the caller's call passes the KV-cache kernels' guard
// (common/kvcache.hpp): its values in range, and every page its append writes into exists.
// Block-uniform: the threads share the append's pages, then agree in one barrier.
__device__ bool sequence_passes_guard(const KvCacheParams& kv, int32_t b, const KvSequence& s) {
  bool ok = kv_sequence_in_range(kv, s);
  if (ok && kv.is_paged() && kv.k_new != nullptr && s.end > s.filled) {
    const int64_t first = s.filled / kv.page_size, last = (s.end - 1) / kv.page_size;
    for (int64_t slot = first + threadIdx.x; slot <= last; slot += kThreads)
      ok = ok && kv_page_in_range(kv, kv.block_table[b * kv.block_table_batch_stride + slot]);
  }
  return __syncthreads_and(ok) != 0;
}

// NaN in both fp16 and bf16 (all exponent bits and a non-zero mantissa): a missing page's keys.
constexpr Bits kNanBits = 0x7FFF;

// Sequence blockIdx.y: into the copy, the positions it holds before the call (the kernel reads
// no others, and writes the appended ones); back, the positions it appended. A sequence that
// fails the guard is neither read nor written back (its rows are made NaN after the kernels,
// poison_guarded_sequences), and a page out of range that it only reads is never read: its
// keys are copied as NaN and its values as 0, as the kernels read them.
template <bool kToPadded>
__global__ void __launch_bounds__(kThreads) copy_cache_rows(const __grid_constant__ CacheRows c) {
  const int32_t b = static_cast<int32_t>(blockIdx.y);
  const KvSequence seq = kv_sequence(c.kv, b);
  if (!sequence_passes_guard(c.kv, b, seq)) return;
  const int64_t first = kToPadded ? seq.begin : seq.filled, end = kToPadded ? seq.filled : seq.end;
  const int chunks = c.padded_width / kChunk;
  const int64_t heads_k = c.kv.attn.heads_k;
  const int64_t units = (end - first) * heads_k * chunks;
  for (int64_t u = int64_t{blockIdx.x} * kThreads + threadIdx.x; u < units;
       u += int64_t{gridDim.x} * kThreads) {
    const int64_t row = u / chunks;
    const int col = static_cast<int>(u - row * chunks) * kChunk;
    const int64_t hk = row % heads_k, pos = first + row / heads_k;
    Bits* padded = c.padded + ((b * c.kv.attn.seqlen_k + pos) * heads_k + hk) * c.padded_width;
    if (kToPadded && c.kv.is_paged() &&
        !kv_page_in_range(c.kv, c.kv.block_table[b * c.kv.block_table_batch_stride +
                                                 pos / c.kv.page_size])) {
      const uint32_t word = c.value ? 0u : (uint32_t{kNanBits} | uint32_t{kNanBits} << 16);
      *reinterpret_cast<uint4*>(padded + col) = make_uint4(word, word, word, word);
      continue;
    }
    Bits* caller = c.caller + kv_position_offset(c.kv, b, seq, pos, c.batch_stride, c.row_stride) +
                   hk * c.head_stride;
    if constexpr (kToPadded)
      pad_chunk(caller, padded, col, c.width);
    else
      unpad_chunk(padded, caller, col, c.width);
  }
}

// The caller's out and lse rows of every sequence that fails the guard: NaN, as the kernels
// write them (the kernels ran on the dense copy, which has no cache_batch_idx or pages to
// judge). Sequence blockIdx.x; out (B, Sq, H, Dv), lse (B, H, Sq) as the params address them.
__global__ void __launch_bounds__(kThreads) poison_guarded_sequences(
    const __grid_constant__ KvCacheParams kv) {
  const int32_t b = static_cast<int32_t>(blockIdx.x);
  if (sequence_passes_guard(kv, b, kv_sequence(kv, b))) return;
  const ForwardParams& a = kv.attn;
  Bits* out = static_cast<Bits*>(a.out) + b * a.out_batch_stride;
  const int64_t elements = int64_t{a.seqlen_q} * a.heads * a.head_dim_v;
  for (int64_t e = threadIdx.x; e < elements; e += kThreads) {
    const int64_t d = e % a.head_dim_v, row = e / a.head_dim_v;
    out[(row / a.heads) * a.out_row_stride + (row % a.heads) * a.out_head_stride + d] = kNanBits;
  }
  if (a.lse == nullptr) return;
  for (int64_t e = threadIdx.x; e < int64_t{a.heads} * a.seqlen_q; e += kThreads)
    a.lse[b * a.lse_batch_stride + (e / a.seqlen_q) * a.lse_head_stride + e % a.seqlen_q] = NAN;
}

unsigned blocks_for(int64_t units, int64_t at_most) {
  return static_cast<unsigned>(std::min((units + kThreads - 1) / kThreads, at_most));
}

Bits* bits(const void* p) { return static_cast<Bits*>(const_cast<void*>(p)); }

// The padded copies of one call: planned first (add_tensor, add_cache), then allocated in one
// stream-ordered block with the params pointed at the copies and the inputs copied in (start),
// then, after the kernels, the outputs copied back (finish).
class PaddedCopies {
 public:
  explicit PaddedCopies(cudaStream_t stream) : stream_(stream) {}

  // A (batches, rows, heads, width) tensor of the params, through references to its pointer
  // and strides, which start() rewrites to the copy's; `output`: written by the kernels and
  // copied back, else copied in.
  template <typename Pointer>
  void add_tensor(Pointer& data, int64_t& batch_stride, int64_t& row_stride, int64_t& head_stride,
                  int64_t batches, int64_t rows, int64_t heads, const int32_t* row_end,
                  int32_t width, bool output) {
    TensorRows t;
    t.caller = bits(data);
    t.batch_stride = batch_stride;
    t.row_stride = row_stride;
    t.head_stride = head_stride;
    t.batches = batches;
    t.rows = rows;
    t.heads = heads;
    t.row_end = row_end;
    t.width = width;
    t.padded_width = static_cast<int32_t>(padded_head_dim(width));
    const size_t offset = reserve(batches * rows * heads, width);
    const int64_t head = t.padded_width, row = heads * head;
    // A varlen batch is found through cu_seqlens: its batch stride stays 0.
    const int64_t batch = row_end != nullptr ? 0 : rows * row;
    tensors_.push_back({t, offset, output, [&data, &batch_stride, &row_stride, &head_stride, batch,
                                            row, head](Bits* copy) {
                          data = copy;
                          batch_stride = batch;
                          row_stride = row;
                          head_stride = head;
                        }});
  }

  // A kv cache of the caller's call `kv` (its k cache, or its v cache when `value`); start()
  // points `padded`'s attention at the copy, a dense cache of one row per sequence.
  void add_cache(const KvCacheParams& kv, bool value, KvCacheParams& padded) {
    const ForwardParams& a = kv.attn;
    CacheRows c;
    c.kv = kv;
    c.value = value;
    c.caller = bits(value ? a.v : a.k);
    c.batch_stride = value ? a.v_batch_stride : a.k_batch_stride;
    c.row_stride = value ? a.v_row_stride : a.k_row_stride;
    c.head_stride = value ? a.v_head_stride : a.k_head_stride;
    c.width = value ? a.head_dim_v : a.head_dim;
    c.padded_width = static_cast<int32_t>(padded_head_dim(c.width));
    const size_t offset = reserve(int64_t{a.batch} * a.seqlen_k * a.heads_k, c.width);
    const int64_t head = c.padded_width, row = a.heads_k * head, batch = a.seqlen_k * row;
    caches_.push_back({c, offset, [&padded, value, batch, row, head](Bits* copy) {
                         ForwardParams& p = padded.attn;
                         (value ? p.v : p.k) = copy;
                         (value ? p.v_batch_stride : p.k_batch_stride) = batch;
                         (value ? p.v_row_stride : p.k_row_stride) = row;
                         (value ? p.v_head_stride : p.k_head_stride) = head;
                         padded.cache_batch_idx = nullptr;
                         padded.block_table = nullptr;
                         padded.block_table_batch_stride = 0;
                         padded.page_size = 0;
                       }});
  }

  void start() {
    storage_.emplace(bytes_, stream_, "head-dim padding copies");
    char* base = static_cast<char*>(storage_->data());
    for (Tensor& t : tensors_) {
      t.rows.padded = reinterpret_cast<Bits*>(base + t.offset);
      t.point(t.rows.padded);
      if (!t.output) launch_tensor<true>(t.rows);
    }
    for (Cache& c : caches_) {
      c.rows.padded = reinterpret_cast<Bits*>(base + c.offset);
      c.point(c.rows.padded);
      launch_cache<true>(c.rows, c.rows.kv.attn.seqlen_k);
    }
    throw_if_failed(cudaGetLastError(), "successful launches of the head-dim padding copies");
  }

  // The outputs back into the caller's tensors, and the appended positions into its caches.
  void finish() {
    for (const Tensor& t : tensors_)
      if (t.output) launch_tensor<false>(t.rows);
    for (const Cache& c : caches_)
      if (c.rows.kv.k_new != nullptr) launch_cache<false>(c.rows, c.rows.kv.seqlen_new);
    throw_if_failed(cudaGetLastError(), "successful launches of the head-dim padding copies");
  }

  size_t bytes() const { return bytes_; }

 private:
  struct Tensor {
    TensorRows rows;
    size_t offset;
    bool output;
    std::function<void(Bits*)> point;  // points the params at the copy
  };
  struct Cache {
    CacheRows rows;
    size_t offset;
    std::function<void(Bits*)> point;
  };

  size_t reserve(int64_t rows, int32_t width) {
    const size_t offset = bytes_;
    const size_t size = static_cast<size_t>(rows * padded_head_dim(width)) * sizeof(Bits);
    bytes_ += (size + kAlignment - 1) / kAlignment * kAlignment;
    return offset;
  }

  template <bool kToPadded>
  void launch_tensor(const TensorRows& t) const {
    const int64_t units = t.units();
    if (units > 0)
      copy_tensor_rows<kToPadded><<<blocks_for(units, kMaxBlocks), kThreads, 0, stream_>>>(t);
  }

  // `positions`: the most a sequence copies (the capacity in, S_new back).
  template <bool kToPadded>
  void launch_cache(const CacheRows& c, int64_t positions) const {
    const int64_t units = positions * c.kv.attn.heads_k * (c.padded_width / kChunk);
    if (units <= 0 || c.kv.attn.batch == 0) return;
    const dim3 grid(blocks_for(units, kMaxBlocksPerSequence),
                    static_cast<unsigned>(c.kv.attn.batch));
    copy_cache_rows<kToPadded><<<grid, kThreads, 0, stream_>>>(c);
  }

  cudaStream_t stream_;
  size_t bytes_ = 0;
  std::vector<Tensor> tensors_;
  std::vector<Cache> caches_;
  std::optional<StreamAllocation> storage_;
};

bool pads(const ForwardParams& p) {
  return pads_head_dim(p.head_dim) || pads_head_dim(p.head_dim_v);
}

cudaStream_t stream_of(const ForwardParams& p) { return static_cast<cudaStream_t>(p.stream); }

// The row dimension of a dense or varlen call's tensors, as the copies see it: dense (B, S,
// H, D) tensors are B batches of S rows; varlen ones one batch of total rows, of which those
// from cu_seqlens[B] on are none of the call's (neither read nor written); paged keys and
// values (num_pages, page_size, Hk, D) num_pages batches of page_size rows, the whole pool
// (which pages a sequence uses is known only on the device; the copy keeps the page layout,
// so the block table addresses it as it does the caller's).
struct Extents {
  int64_t batches_q, batches_k, rows_q, rows_k;
  const int32_t* end_q;
  const int32_t* end_k;
  explicit Extents(const ForwardParams& p)
      : batches_q(p.is_varlen() ? 1 : p.batch),
        batches_k(p.is_paged() ? p.num_pages : batches_q),
        rows_q(p.is_varlen() ? p.total_q : p.seqlen_q),
        rows_k(p.is_paged() ? p.page_size : p.is_varlen() ? p.total_k : p.seqlen_k),
        end_q(p.is_varlen() ? p.cu_seqlens_q + p.batch : nullptr),
        end_k(p.is_varlen() && !p.is_paged() ? p.cu_seqlens_k + p.batch : nullptr) {}
};

// q, k and v as inputs, and out (an output of the forward, an input of the backward).
void add_attention_tensors(PaddedCopies& copies, const Extents& e, ForwardParams& p,
                           bool out_is_output) {
  copies.add_tensor(p.q, p.q_batch_stride, p.q_row_stride, p.q_head_stride, e.batches_q,
                    e.rows_q, p.heads, e.end_q, p.head_dim, false);
  copies.add_tensor(p.k, p.k_batch_stride, p.k_row_stride, p.k_head_stride, e.batches_k,
                    e.rows_k, p.heads_k, e.end_k, p.head_dim, false);
  copies.add_tensor(p.v, p.v_batch_stride, p.v_row_stride, p.v_head_stride, e.batches_k,
                    e.rows_k, p.heads_k, e.end_k, p.head_dim_v, false);
  copies.add_tensor(p.out, p.out_batch_stride, p.out_row_stride, p.out_head_stride,
                    e.batches_q, e.rows_q, p.heads, e.end_q, p.head_dim_v, out_is_output);
}

// The params' head dims once their tensors are the padded copies.
void pad_head_dims(ForwardParams& p) {
  p.head_dim = static_cast<int32_t>(padded_head_dim(p.head_dim));
  p.head_dim_v = static_cast<int32_t>(padded_head_dim(p.head_dim_v));
}

}  // namespace

size_t run_with_padded_head_dim(const ForwardParams& params,
                                const std::function<size_t(const ForwardParams&)>& run) {
  if (!pads(params)) return run(params);
  ForwardParams padded = params;
  PaddedCopies copies(stream_of(params));
  add_attention_tensors(copies, Extents(params), padded, true);
  pad_head_dims(padded);
  copies.start();
  const size_t workspace = run(padded);
  copies.finish();
  return workspace + copies.bytes();
}

size_t run_with_padded_head_dim(const BackwardParams& params,
                                const std::function<size_t(const BackwardParams&)>& run) {
  const ForwardParams& p = params.fwd;
  if (!pads(p)) return run(params);
  BackwardParams padded = params;
  PaddedCopies copies(stream_of(p));
  const Extents e(p);
  add_attention_tensors(copies, e, padded.fwd, false);
  // dout like out, the gradients like what they differentiate.
  copies.add_tensor(padded.dout, padded.dout_batch_stride, padded.dout_row_stride,
                    padded.dout_head_stride, e.batches_q, e.rows_q, p.heads, e.end_q, p.head_dim_v,
                    false);
  copies.add_tensor(padded.dq, padded.dq_batch_stride, padded.dq_row_stride, padded.dq_head_stride,
                    e.batches_q, e.rows_q, p.heads, e.end_q, p.head_dim, true);
  copies.add_tensor(padded.dk, padded.dk_batch_stride, padded.dk_row_stride, padded.dk_head_stride,
                    e.batches_k, e.rows_k, p.heads_k, e.end_k, p.head_dim, true);
  copies.add_tensor(padded.dv, padded.dv_batch_stride, padded.dv_row_stride, padded.dv_head_stride,
                    e.batches_k, e.rows_k, p.heads_k, e.end_k, p.head_dim_v, true);
  pad_head_dims(padded.fwd);
  copies.start();
  const size_t workspace = run(padded);
  copies.finish();
  return workspace + copies.bytes();
}

KvCacheRun run_with_padded_head_dim(const KvCacheParams& params,
                                    const std::function<KvCacheRun(const KvCacheParams&)>& run) {
  const ForwardParams& p = params.attn;
  if (!pads(p)) return run(params);
  KvCacheParams padded = params;
  ForwardParams& a = padded.attn;
  PaddedCopies copies(stream_of(p));
  copies.add_tensor(a.q, a.q_batch_stride, a.q_row_stride, a.q_head_stride, p.batch, p.seqlen_q,
                    p.heads, nullptr, p.head_dim, false);
  copies.add_tensor(a.out, a.out_batch_stride, a.out_row_stride, a.out_head_stride, p.batch,
                    p.seqlen_q, p.heads, nullptr, p.head_dim_v, true);
  if (params.k_new != nullptr) {
    copies.add_tensor(padded.k_new, padded.k_new_batch_stride, padded.k_new_row_stride,
                      padded.k_new_head_stride, p.batch, params.seqlen_new, p.heads_k, nullptr,
                      p.head_dim, false);
    copies.add_tensor(padded.v_new, padded.v_new_batch_stride, padded.v_new_row_stride,
                      padded.v_new_head_stride, p.batch, params.seqlen_new, p.heads_k, nullptr,
                      p.head_dim_v, false);
  }
  copies.add_cache(params, false, padded);
  copies.add_cache(params, true, padded);
  pad_head_dims(a);
  copies.start();
  KvCacheRun result = run(padded);
  copies.finish();
  if (p.batch > 0)
    poison_guarded_sequences<<<static_cast<unsigned>(p.batch), kThreads, 0, stream_of(p)>>>(
        params);
  throw_if_failed(cudaGetLastError(), "a successful launch of the kv-cache guard's NaN rows");
  result.workspace_bytes += copies.bytes();
  return result;
}

}  // namespace flashattn::detail::cuda

// attention_probabilities on CUDA: a testing aid, written for correctness over speed.
//
// One thread block per (b, h, query row) of probs (a grid-stride loop over them, so any B, H
// and Sq fit the grid), two passes over the row's keys:
//   pass 1: the threads share the keys the row sees; each computes its keys' scores in fp32
//           (q pre-scaled, then softcap, ALiBi: common/mask.hpp, the rules every kernel uses),
//           stores them into probs and keeps its max; a block reduction gives the row's max;
//   pass 2: the same threads turn their scores into exp(s - max), negated where dropout drops
//           the element (common/philox.hpp: the forward's and backward's keep bits), and zero
//           every key the row does not see.
// Rows past a sequence's length (varlen) are zeroed. Reads and writes are element by element
// (no alignment needed); costs O(B H Sq Sk D) time and the O(B H Sq Sk) output (docs/SPEC.md).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/mask.hpp"
#include "common/philox.hpp"
#include "cuda/common/per_device.hpp"
#include "cuda/forward.hpp"

namespace flashattn::detail::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kMaxBlocks = int64_t{1} << 20;  // the grid-stride loop covers the rest

__device__ __forceinline__ float element_to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float element_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename Element>
__global__ void __launch_bounds__(kThreads)
    probabilities_kernel(const ProbabilitiesParams pp, const DropoutRng rng, const bool dropout) {
  const ForwardParams& p = pp.fwd;
  __shared__ float q_row[256];  // the row of q times the softmax scale (head dims are <= 256)
  __shared__ float warp_max[kWarps];
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  const int64_t row_count = int64_t{p.batch} * p.heads * p.seqlen_q;
  for (int64_t w = blockIdx.x; w < row_count; w += gridDim.x) {
    const int64_t i = w % p.seqlen_q;
    const int32_t h = static_cast<int32_t>(w / p.seqlen_q % p.heads);
    const int32_t b = static_cast<int32_t>(w / p.seqlen_q / p.heads);
    float* row = pp.probs + b * pp.probs_batch_stride + h * pp.probs_head_stride +
                 i * pp.probs_row_stride;
    const SequenceView seq = sequence_view(p, b);
    if (i >= seq.seqlen_q) {  // varlen: past this sequence
      for (int64_t j = threadIdx.x; j < p.seqlen_k; j += kThreads) row[j] = 0.0f;
      continue;
    }
    const Element* q = static_cast<const Element*>(p.q) + b * p.q_batch_stride +
                       (seq.q_row0 + i) * p.q_row_stride + h * p.q_head_stride;
    const Element* k = static_cast<const Element*>(p.k) + b * p.k_batch_stride +
                       seq.k_row0 * p.k_row_stride + (h / p.group_size()) * p.k_head_stride;
    __syncthreads();  // every thread is done with the previous row's q_row and warp_max
    for (int d = threadIdx.x; d < p.head_dim; d += kThreads)
      q_row[d] = element_to_float(q[d]) * p.softmax_scale;
    __syncthreads();

    KeyRange seen = visible_keys(i, seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right);
    // A row holds max_seqlen_k keys (p.seqlen_k); a device cu_seqlens_k or seqused_k (not
    // checked on the host) may give a sequence more. Keys past the row are not stored: that
    // sequence's probabilities are wrong, but every write stays inside probs.
    seen.end = seen.end < p.seqlen_k ? seen.end : p.seqlen_k;
    seen.begin = seen.begin < seen.end ? seen.begin : seen.end;
    const float slope =
        p.alibi_slopes != nullptr ? p.alibi_slopes[b * p.alibi_batch_stride + h] : 0.0f;
    float m = -INFINITY;
    for (int64_t j = seen.begin + threadIdx.x; j < seen.end; j += kThreads) {
      const Element* kj = k + j * p.k_row_stride;
      float s = 0.0f;
      for (int d = 0; d < p.head_dim; ++d) s = fmaf(q_row[d], element_to_float(kj[d]), s);
      if (p.softcap > 0.0f) s = apply_softcap(s, p.softcap);
      if (p.alibi_slopes != nullptr) s += alibi_bias(slope, i, j, alibi_diagonal(p, seq));
      row[j] = s;
      m = fmaxf(m, s);
    }
    for (int offset = 16; offset > 0; offset /= 2)
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
    if (lane == 0) warp_max[warp] = m;
    __syncthreads();
    m = warp_max[0];
    for (int n = 1; n < kWarps; ++n) m = fmaxf(m, warp_max[n]);

    // Each thread rewrites the scores it stored (the same j), so pass 2 reads its own writes.
    for (int64_t j = seen.begin + threadIdx.x; j < seen.end; j += kThreads) {
      float x = expf(row[j] - m);
      if (dropout && !rng.keep(static_cast<uint32_t>(b), static_cast<uint32_t>(h),
                               static_cast<uint32_t>(i + p.query_position0),
                               static_cast<uint32_t>(j + p.key_position0)))
        x = -x;
      row[j] = x;
    }
    for (int64_t j = threadIdx.x; j < p.seqlen_k; j += kThreads)
      if (j < seen.begin || j >= seen.end) row[j] = 0.0f;
  }
}

template <typename Element>
void launch(const ProbabilitiesParams& pp, int64_t row_count) {
  const ForwardParams& p = pp.fwd;
  const DropoutRng rng = p.dropout_p > 0.0f
                             ? make_dropout_rng(p.dropout_seed, p.dropout_offset, p.dropout_p)
                             : DropoutRng{};
  const unsigned blocks = static_cast<unsigned>(std::min(row_count, kMaxBlocks));
  probabilities_kernel<Element><<<blocks, kThreads, 0, static_cast<cudaStream_t>(p.stream)>>>(
      pp, rng, p.dropout_p > 0.0f);
}

}  // namespace

size_t probabilities(const ProbabilitiesParams& pp) {
  const ForwardParams& p = pp.fwd;
  const int64_t row_count = int64_t{p.batch} * p.heads * p.seqlen_q;
  if (row_count == 0 || p.seqlen_k == 0) return 0;  // probs has no elements
  const CurrentDevice on_the_tensors_gpu(p.device);
  if (p.dtype == DType::Float16)
    launch<__half>(pp, row_count);
  else
    launch<__nv_bfloat16>(pp, row_count);
  throw_if_failed(cudaGetLastError(), "a successful launch of the probabilities kernel");
  return 0;
}

}  // namespace flashattn::detail::cuda

// The normalised description of one forward call, produced by src/api after validation and
// consumed by every backend. Plain pointers and integers only, so it can be passed by value
// to a CUDA kernel. Dense and varlen batches share one addressing scheme (see SequenceView).
#pragma once

#include <cstdint>

#include "common/host_device.hpp"
#include "flashattn/flashattn.hpp"

namespace flashattn::detail {

struct ForwardParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;  // null: not wanted
  DType dtype = DType::Float32;

  int32_t batch = 0, heads = 0, heads_k = 0, head_dim = 0, head_dim_v = 0;
  // Dense: the sequence lengths. Varlen: the caller's max_seqlen_q/k (an upper bound).
  int64_t seqlen_q = 0, seqlen_k = 0;
  // Varlen only: the rows of q/out (total_q) and of k/v (total_k), which cu_seqlens[B] may
  // not reach; what a backend that copies whole tensors (cuda/head_dim_padding.hpp) sizes by.
  int64_t total_q = 0, total_k = 0;

  // Element strides. Row r of sequence b, head h of q lives at
  //   q + b * q_batch_stride + (row0_q(b) + r) * q_row_stride + h * q_head_stride
  // with row0 = 0 and the batch stride in use for dense inputs, and row0 = cu_seqlens[b]
  // and a batch stride of 0 for varlen inputs.
  int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  int64_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  int64_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;
  int64_t out_batch_stride = 0, out_row_stride = 0, out_head_stride = 0;
  int64_t lse_batch_stride = 0, lse_head_stride = 0;  // the row stride of lse is 1

  const int32_t* cu_seqlens_q = nullptr;  // varlen only
  const int32_t* cu_seqlens_k = nullptr;  // varlen only
  const int32_t* seqused_k = nullptr;     // varlen only, optional

  float softmax_scale = 1.0f;
  float softcap = 0.0f;       // 0: off
  int32_t window_left = -1;   // -1: unbounded; causal is already folded into window_right
  int32_t window_right = -1;
  const float* alibi_slopes = nullptr;  // null: off
  int64_t alibi_batch_stride = 0;       // 0 when the slopes are (H)
  // Dropout (common/philox.hpp): p = 0 is off; the keep bits come from (seed, offset).
  float dropout_p = 0.0f;
  uint64_t dropout_seed = 0, dropout_offset = 0;

  int32_t num_threads = 0;  // CPU only
  void* stream = nullptr;   // CUDA only
  int32_t device = 0;       // CUDA only: the GPU the tensors live on, where the call runs

  FA_HOST_DEVICE bool is_varlen() const { return cu_seqlens_q != nullptr; }
  FA_HOST_DEVICE int32_t group_size() const { return heads / heads_k; }  // query heads per key/value head
};

// The normalised description of one backward call: the forward it differentiates (whose out
// and lse are now inputs; lse is required) plus dout and the three gradients, addressed like
// out, q, k and v respectively (same row0 rule, their own strides).
struct BackwardParams {
  ForwardParams fwd;
  const void* dout = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  int64_t dout_batch_stride = 0, dout_row_stride = 0, dout_head_stride = 0;
  int64_t dq_batch_stride = 0, dq_row_stride = 0, dq_head_stride = 0;
  int64_t dk_batch_stride = 0, dk_row_stride = 0, dk_head_stride = 0;
  int64_t dv_batch_stride = 0, dv_row_stride = 0, dv_head_stride = 0;
  bool deterministic = false;  // what the caller asked; the CPU engine always is
};

// The normalised description of one attention_probabilities call: the forward it describes
// (v, out and lse null: the probabilities need only q, k and the options) and the fp32 output,
// (B, H, fwd.seqlen_q, fwd.seqlen_k): dense Sq x Sk, varlen max_seqlen_q x max_seqlen_k, with
// row i and column j of (b, h) the position within sequence b (last dimension contiguous).
struct ProbabilitiesParams {
  ForwardParams fwd;
  float* probs = nullptr;
  int64_t probs_batch_stride = 0, probs_head_stride = 0, probs_row_stride = 0;
};

// Where sequence b starts and how long it is, for dense and varlen alike.
struct SequenceView {
  int64_t q_row0 = 0, k_row0 = 0;  // first row in the row dimension of q/out and k/v
  int64_t seqlen_q = 0, seqlen_k = 0;  // seqlen_k counts only the keys that take part
};

FA_HOST_DEVICE SequenceView sequence_view(const ForwardParams& p, int32_t b) {
  SequenceView s;
  if (p.cu_seqlens_q == nullptr) {
    s.seqlen_q = p.seqlen_q;
    s.seqlen_k = p.seqlen_k;
    return s;
  }
  s.q_row0 = p.cu_seqlens_q[b];
  s.k_row0 = p.cu_seqlens_k[b];
  s.seqlen_q = p.cu_seqlens_q[b + 1] - s.q_row0;
  s.seqlen_k = p.seqused_k != nullptr ? p.seqused_k[b] : p.cu_seqlens_k[b + 1] - s.k_row0;
  return s;
}

}  // namespace flashattn::detail

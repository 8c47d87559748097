// The normalised description of one forward call, produced by src/api after validation and
// consumed by every backend. Plain pointers and integers only, so it can be passed by value
// to a CUDA kernel. Dense and varlen batches share one addressing scheme (see SequenceView).
#pragma once

#include <cstdint>

#include "common/host_device.hpp"
#include "flashattn/flashattn.hpp"

namespace flashattn::detail {

// The descale factors of one FP8 input (Options::q_descale and the like): row `row` (its
// position within sequence b) of key/value head hk stands for its stored value times
// data[b * batch_stride + hk * head_stride + (row / kFp8ScaleBlockRows) * block_stride].
// Per-(batch, head) factors have block_stride 0; null data means a factor of 1. A row past
// the factors' `blocks` (a varlen sequence in device memory longer than the max_seqlen the
// factors were sized by, which nothing checked) takes NaN: its outputs come out NaN rather
// than a factor read from outside the tensor.
struct Descale {
  const float* data = nullptr;
  int64_t batch_stride = 0, head_stride = 0, block_stride = 0, blocks = 1;

  FA_HOST_DEVICE float at(int32_t b, int32_t hk, int64_t row) const {
    if (data == nullptr) return 1.0f;
    const int64_t block = block_stride == 0 ? 0 : row / kFp8ScaleBlockRows;
    return block < blocks ? data[b * batch_stride + hk * head_stride + block * block_stride] : __builtin_nanf("");
  }
};

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
  // Element strides. Row r of sequence b, head h of q lives at
  //   q + b * q_batch_stride + (row0_q(b) + r) * q_row_stride + h * q_head_stride
  // with row0 = 0 and the batch stride in use for dense inputs, and row0 = cu_seqlens[b]
  // and a batch stride of 0 for varlen inputs.
  int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  int64_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  int64_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;
  // The stride between v's head-dim columns: 1, except for fp8 v given (d, seqlen)-major
  // (docs/SPEC.md, "FP8 inputs"), whose rows are then contiguous (v_row_stride 1).
  int64_t v_dim_stride = 1;
  bool values_seqlen_major() const { return v_dim_stride != 1; }
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

  // (These last: among the fields above they moved those fields' offsets in the kernels'
  // parameter space, which cost the kv-cache kernel's general variant 8 registers, ptxas.)
  // Varlen: the rows of q/out (total_q) and the key positions a sequence can have (total_k
  // rows of k/v; paged: max_pages * page_size), each at most 2^31 - 1 (every cu_seqlens value
  // is below). sequence_view holds every range inside them, whatever cu_seqlens and seqused_k
  // hold; cu_seqlens[B] may not reach them, and a backend that copies whole tensors
  // (cuda/head_dim_padding.hpp) sizes by them.
  int64_t total_q = 0, total_k = 0;

  // Paged keys and values (varlen only; null: none): key j of sequence b is row j % page_size
  // of page block_table[b * block_table_batch_stride + j / page_size], and k/v_batch_stride
  // are the page strides (docs/SPEC.md). Indices read from device memory are checked against
  // num_pages before use (page_exists).
  const int32_t* block_table = nullptr;
  int64_t block_table_batch_stride = 0;
  int64_t num_pages = 0;
  int32_t page_size = 0;

  // Positions (Options::positions; docs/SPEC.md): query row i of every sequence is token
  // query_position0 + i and key j token key_position0 + j (both 0 without positions), which
  // dropout's keep bits use; with positions, ALiBi measures between those tokens
  // (alibi_diagonal).
  bool has_positions = false;
  int64_t query_position0 = 0, key_position0 = 0;
  // FP8 (e4m3) q, k, v (dtype Float8E4M3, out bf16): their descales. A query head takes its
  // key/value head's q factor.
  Descale q_descale, k_descale, v_descale;

  FA_HOST_DEVICE bool is_varlen() const { return cu_seqlens_q != nullptr; }
  FA_HOST_DEVICE bool is_paged() const { return block_table != nullptr; }
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
  int64_t q_row0 = 0, k_row0 = 0;  // first row in the row dimension of q/out and k/v (paged: 0)
  int64_t seqlen_q = 0, seqlen_k = 0;  // seqlen_k counts only the keys that take part
  int64_t rows_k = 0;  // the sequence's keys, seqused_k or not (the backward writes them all)
};

template <typename T>
FA_HOST_DEVICE T clamped(T x, T lo, T hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}
FA_HOST_DEVICE uint32_t at_most(uint32_t x, uint32_t hi) { return x < hi ? x : hi; }

// Varlen values may live in device memory, where nothing checked them (the CPU backend's are
// validated): every range is held inside total_q and total_k here, so that a bad value gives
// a wrong result but never an access outside the tensors. In 32 bits and unsigned (a negative
// value is then past every bound), which is what kept the kernels' registers as they were:
// with 64-bit clamps the hdim-256 forward's general variant spilled 148 bytes, with signed
// 32-bit ones the sm90 hdim-256 backward 24 (ptxas, sm_90a).
FA_HOST_DEVICE SequenceView sequence_view(const ForwardParams& p, int32_t b) {
  SequenceView s;
  if (p.cu_seqlens_q == nullptr) {
    s.seqlen_q = p.seqlen_q;
    s.seqlen_k = s.rows_k = p.seqlen_k;
    return s;
  }
  const uint32_t total_q = static_cast<uint32_t>(p.total_q);
  const uint32_t total_k = static_cast<uint32_t>(p.total_k);
  const uint32_t q0 = at_most(static_cast<uint32_t>(p.cu_seqlens_q[b]), total_q);
  const uint32_t q1 = at_most(static_cast<uint32_t>(p.cu_seqlens_q[b + 1]), total_q);
  s.q_row0 = q0;
  s.seqlen_q = q1 > q0 ? q1 - q0 : 0;
  // Paged: the prefix sums give the length only (a 64-bit difference: any two int32 values),
  // and positions count from 0 in the sequence's pages.
  const int64_t paged_length = int64_t{p.cu_seqlens_k[b + 1]} - p.cu_seqlens_k[b];
  const uint32_t k0 = p.is_paged() ? 0 : at_most(static_cast<uint32_t>(p.cu_seqlens_k[b]), total_k);
  const uint32_t k1 = p.is_paged()
                          ? static_cast<uint32_t>(clamped<int64_t>(paged_length, 0, total_k))
                          : at_most(static_cast<uint32_t>(p.cu_seqlens_k[b + 1]), total_k);
  s.k_row0 = k0;
  s.rows_k = k1 > k0 ? k1 - k0 : 0;
  s.seqlen_k = p.seqused_k != nullptr
                   ? at_most(static_cast<uint32_t>(p.seqused_k[b]), static_cast<uint32_t>(s.rows_k))
                   : s.rows_k;
  return s;
}

// ALiBi's distance of (i, j) in sequence s is |i + alibi_diagonal - j|: the call's
// bottom-right alignment (seqlen_k - seqlen_q), or with positions the offset between the
// query and key tokens (the whole sequence is self-attention: token t sees token t at distance 0).
FA_HOST_DEVICE int64_t alibi_diagonal(const ForwardParams& p, int64_t seqlen_q, int64_t seqlen_k) {
  return p.has_positions ? p.query_position0 - p.key_position0 : seqlen_k - seqlen_q;
}
FA_HOST_DEVICE int64_t alibi_diagonal(const ForwardParams& p, const SequenceView& s) {
  return alibi_diagonal(p, s.seqlen_q, s.seqlen_k);
}

// Where key j (0 <= j < total_k < 2^31) of sequence b of a paged batch lives. The page index
// comes from the caller's block table: check it with page_exists before reading the page.
struct PagedRow {
  int32_t page = 0, row = 0;
};

FA_HOST_DEVICE PagedRow paged_row(const ForwardParams& p, int32_t b, int64_t j) {
  // A 32-bit division: a 64-bit one is a ~70-instruction subroutine on the GPU.
  const uint32_t slot = static_cast<uint32_t>(j) / static_cast<uint32_t>(p.page_size);
  PagedRow at;
  at.page = p.block_table[b * p.block_table_batch_stride + slot];
  at.row = static_cast<int32_t>(static_cast<uint32_t>(j) -
                                slot * static_cast<uint32_t>(p.page_size));
  return at;
}

FA_HOST_DEVICE bool page_exists(const ForwardParams& p, int64_t page) {
  return page >= 0 && page < p.num_pages;
}

}  // namespace flashattn::detail

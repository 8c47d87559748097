// Argument checking: the only place that validates. Checks a public call and returns what it
// learned (the backend and the call's dimensions), or throws flashattn::Error naming the
// argument, the expectation and the given value. Runs before any backend touches memory, so
// a rejected call writes nothing. The params are built from a validated call by
// api/params.hpp.
#pragma once

#include <cstdint>
#include <optional>

#include "flashattn/flashattn.hpp"

namespace flashattn::detail {

// A validated call's dimensions, as the params need them.
struct ValidatedCall {
  Backend backend = Backend::CPU;  // resolved: never Auto
  int64_t batch = 0, heads = 0, heads_k = 0, head_dim = 0;
  // The row dimension of q and of k: Sq and Sk (dense), total_q and total_k (varlen), Sq
  // and the positions a sequence can hold (kv-cache), total_q and the positions a sequence's
  // pages hold (paged varlen: max_pages * page_size).
  int64_t rows_q = 0, rows_k = 0;
};

ValidatedCall validate_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                               const TensorView& out, const std::optional<TensorView>& lse,
                               const Varlen* varlen, const Options& options,
                               const Execution& execution);

// Everything validate_forward checks (out and lse now being inputs, lse required), plus
// dout like out, dq/dk/dv like q/k/v, and gradients disjoint from every input and each other.
// Paged keys and values (Varlen::block_table) are refused: the backward has none.
ValidatedCall validate_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                                const TensorView& out, const TensorView& dout,
                                const TensorView& lse, const TensorView& dq,
                                const TensorView& dk, const TensorView& dv, const Varlen* varlen,
                                const Options& options, const Execution& execution);

// attention_probabilities' checks: q and k as the forward's (same dtype, shapes, GQA), the
// options, ALiBi slopes and varlen tensors alike, and probs fp32 (B, H, Sq, Sk) dense or
// (B, H, max_seqlen_q, max_seqlen_k) varlen on q's device, its elements distinct and disjoint
// from every input.
ValidatedCall validate_probabilities(const TensorView& q, const TensorView& k,
                                     const TensorView& probs, const Varlen* varlen,
                                     const Options& options, const Execution& execution);

// forward_kvcache's checks: the forward's rules for q, out, lse and the options (dropout
// rejected), the caches (dense or paged), k_new/v_new, the rotary tables and the int32
// per-sequence tensors, and that nothing written (out, lse, the caches when k_new is given)
// overlaps anything read. Integer values are checked where they can be read: in host memory
// (the CPU backend), every position read or written exists, no two sequences write one cache
// row, the rotary tables cover every rotated position; on CUDA, a paged cache's cache_seqlens
// is copied to the host for the checks that need only it (the block table's capacity among
// them), except while the stream is captured. The CUDA kernels guard every value no one
// checked (common/kvcache.hpp).
ValidatedCall validate_kvcache(const TensorView& q, const KvCache& cache, const TensorView& out,
                               const std::optional<TensorView>& lse, const Options& options,
                               const Execution& execution);

}  // namespace flashattn::detail

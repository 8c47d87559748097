#include "api/params.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>

namespace flashattn::detail {
namespace {

// A tensor and the params' fields for its (batch, row, head) strides.
struct RowStrides {
  const TensorView& t;
  int64_t& batch;
  int64_t& row;
  int64_t& head;
};

// The (batch, row, head) strides of dense (B, S, H, D) or varlen (total, H, D) tensors; a
// varlen batch has no batch stride (rows are found through cu_seqlens).
void fill_row_strides(bool is_varlen, std::initializer_list<RowStrides> tensors) {
  const size_t r = is_varlen ? 0 : 1;
  for (const RowStrides& s : tensors) {
    s.batch = is_varlen ? 0 : s.t.strides[0];
    s.row = s.t.strides[r];
    s.head = s.t.strides[r + 1];
  }
}

// An FP8 input's descale, (B, Hk) or (B, Hk, blocks) (validated), as the params address it.
Descale descale_of(const std::optional<TensorView>& factors) {
  Descale d;
  if (!factors) return d;
  d.data = static_cast<const float*>(factors->data);
  d.batch_stride = factors->strides[0];
  d.head_stride = factors->strides[1];
  d.block_stride = factors->ndim == 3 ? factors->strides[2] : 0;
  d.blocks = factors->ndim == 3 ? factors->sizes[2] : 1;
  return d;
}

// The options' part of the params (p.head_dim and p.heads already set), defaults resolved:
// scale 1/sqrt(D), causal folded into window_right = 0.
void fill_options(ForwardParams& p, const Options& options, const Execution& execution) {
  p.softmax_scale = options.softmax_scale ? *options.softmax_scale
                                          : 1.0f / std::sqrt(static_cast<float>(p.head_dim));
  p.softcap = options.softcap;
  p.window_left = options.window_left;
  p.window_right = window_right_of(options);
  if (options.alibi_slopes) {
    p.alibi_slopes = static_cast<const float*>(options.alibi_slopes->data);
    p.alibi_batch_stride = options.alibi_slopes->ndim == 2 ? p.heads : 0;
  }
  p.dropout_p = options.dropout_p;
  p.dropout_seed = options.dropout_seed;
  p.dropout_offset = options.dropout_offset;
  if (options.positions) {
    p.has_positions = true;
    p.query_position0 = options.positions->query;
    p.key_position0 = options.positions->key;
  }
  p.q_descale = descale_of(options.q_descale);
  p.k_descale = descale_of(options.k_descale);
  p.v_descale = descale_of(options.v_descale);
  p.num_threads = execution.num_threads;
  p.stream = execution.stream;
}

// The fields every forward-like call fills alike: pointers, dtype, shape, strides (the
// batch dims of q, k, v and out dense unless is_varlen), the options. lse's strides are the
// caller's.
ForwardParams attention_params(const TensorView& q, const TensorView& k, const TensorView& v,
                               const TensorView& out, const std::optional<TensorView>& lse,
                               bool is_varlen, const Options& options, const Execution& execution,
                               const ValidatedCall& call) {
  ForwardParams p;
  p.q = q.data;
  p.k = k.data;
  p.v = v.data;
  p.out = out.data;
  p.device = q.device.index;  // every tensor's, checked by the validator
  p.lse = lse ? static_cast<float*>(lse->data) : nullptr;
  p.dtype = q.dtype;
  p.batch = static_cast<int32_t>(call.batch);
  p.heads = static_cast<int32_t>(call.heads);
  p.heads_k = static_cast<int32_t>(call.heads_k);
  p.head_dim = static_cast<int32_t>(call.head_dim);
  p.head_dim_v = static_cast<int32_t>(call.head_dim);
  p.seqlen_q = call.rows_q;
  p.seqlen_k = call.rows_k;
  fill_row_strides(is_varlen, {{q, p.q_batch_stride, p.q_row_stride, p.q_head_stride},
                               {k, p.k_batch_stride, p.k_row_stride, p.k_head_stride},
                               {v, p.v_batch_stride, p.v_row_stride, p.v_head_stride},
                               {out, p.out_batch_stride, p.out_row_stride, p.out_head_stride}});
  p.lse_batch_stride = call.heads * call.rows_q;  // lse is contiguous (B, H, Sq)
  p.lse_head_stride = call.rows_q;
  // 1 unless v is fp8 given (d, seqlen)-major (the validator allows nothing else).
  if (v.sizes[static_cast<size_t>(v.ndim - 1)] > 1) p.v_dim_stride = v.strides[static_cast<size_t>(v.ndim - 1)];
  fill_options(p, options, execution);
  return p;
}

const int32_t* int32_data(const TensorView& t) { return static_cast<const int32_t*>(t.data); }

const int32_t* int32_data(const std::optional<TensorView>& t) {
  return t ? int32_data(*t) : nullptr;
}

}  // namespace

int32_t window_right_of(const Options& options) {
  return options.causal ? 0 : options.window_right;
}

ForwardParams forward_params(const TensorView& q, const TensorView& k, const TensorView& v,
                             const TensorView& out, const std::optional<TensorView>& lse,
                             const Varlen* varlen, const Options& options,
                             const Execution& execution, const ValidatedCall& call) {
  ForwardParams p =
      attention_params(q, k, v, out, lse, varlen != nullptr, options, execution, call);
  if (varlen != nullptr) {
    p.seqlen_q = varlen->max_seqlen_q;
    p.seqlen_k = varlen->max_seqlen_k;
    p.lse_batch_stride = 0;  // lse is contiguous (H, total_q)
    p.cu_seqlens_q = int32_data(varlen->cu_seqlens_q);
    p.cu_seqlens_k = int32_data(varlen->cu_seqlens_k);
    p.seqused_k = int32_data(varlen->seqused_k);
    // Every cu_seqlens value and length is below 2^31, so larger bounds bound nothing, and
    // these keep sequence_view's (and paged positions') arithmetic in 32 bits.
    p.total_q = std::min<int64_t>(call.rows_q, std::numeric_limits<int32_t>::max());
    p.total_k = std::min<int64_t>(call.rows_k, std::numeric_limits<int32_t>::max());
    if (varlen->block_table) {
      // k/v (num_pages, page_size, Hk, D): the batch stride is the page stride.
      fill_row_strides(false, {{k, p.k_batch_stride, p.k_row_stride, p.k_head_stride},
                               {v, p.v_batch_stride, p.v_row_stride, p.v_head_stride}});
      p.block_table = int32_data(varlen->block_table);
      p.block_table_batch_stride = varlen->block_table->strides[0];
      p.num_pages = k.sizes[0];
      p.page_size = static_cast<int32_t>(k.sizes[1]);
    }
  }
  return p;
}

BackwardParams backward_params(const TensorView& q, const TensorView& k, const TensorView& v,
                               const TensorView& out, const TensorView& dout,
                               const TensorView& lse, const TensorView& dq, const TensorView& dk,
                               const TensorView& dv, const Varlen* varlen, const Options& options,
                               const Execution& execution, const ValidatedCall& call) {
  BackwardParams p;
  p.fwd = forward_params(q, k, v, out, lse, varlen, options, execution, call);
  p.dout = dout.data;
  p.dq = dq.data;
  p.dk = dk.data;
  p.dv = dv.data;
  fill_row_strides(varlen != nullptr,
                   {{dout, p.dout_batch_stride, p.dout_row_stride, p.dout_head_stride},
                    {dq, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride},
                    {dk, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride},
                    {dv, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride}});
  p.deterministic = options.deterministic;
  return p;
}

ProbabilitiesParams probabilities_params(const TensorView& q, const TensorView& k,
                                         const TensorView& probs, const Varlen* varlen,
                                         const Options& options, const Execution& execution,
                                         const ValidatedCall& call) {
  ProbabilitiesParams pp;
  // The forward's params with k standing in for v and q for out (their strides are never
  // read), then v and out cleared: nothing may read or write them.
  pp.fwd = forward_params(q, k, k, q, std::nullopt, varlen, options, execution, call);
  pp.fwd.v = nullptr;
  pp.fwd.out = nullptr;
  pp.probs = static_cast<float*>(probs.data);
  pp.probs_batch_stride = probs.strides[0];
  pp.probs_head_stride = probs.strides[1];
  pp.probs_row_stride = probs.strides[2];
  return pp;
}

KvCacheParams kvcache_params(const TensorView& q, const KvCache& cache, const TensorView& out,
                             const std::optional<TensorView>& lse, const Options& options,
                             const Execution& execution, const ValidatedCall& call) {
  KvCacheParams kp;
  kp.attn = attention_params(q, cache.k_cache, cache.v_cache, out, lse, false, options,
                             execution, call);
  kp.cache_dtype = cache.k_cache.dtype;
  kp.cache_seqlens = int32_data(cache.cache_seqlens);
  kp.cache_batch_idx = int32_data(cache.cache_batch_idx);
  kp.cache_leftpad = int32_data(cache.cache_leftpad);
  kp.block_table = int32_data(cache.block_table);
  kp.cache_rows = cache.k_cache.sizes[0];
  if (cache.block_table) {
    kp.block_table_batch_stride = cache.block_table->strides[0];
    kp.page_size = static_cast<int32_t>(cache.k_cache.sizes[1]);
  }
  if (cache.k_new) {
    kp.k_new = cache.k_new->data;
    kp.v_new = cache.v_new->data;
    kp.seqlen_new = cache.k_new->sizes[1];
    fill_row_strides(
        false, {{*cache.k_new, kp.k_new_batch_stride, kp.k_new_row_stride, kp.k_new_head_stride},
                {*cache.v_new, kp.v_new_batch_stride, kp.v_new_row_stride, kp.v_new_head_stride}});
  }
  if (cache.rotary_cos) {
    kp.rotary_cos = cache.rotary_cos->data;
    kp.rotary_sin = cache.rotary_sin->data;
    kp.rotary_cos_row_stride = cache.rotary_cos->strides[0];
    kp.rotary_sin_row_stride = cache.rotary_sin->strides[0];
    kp.rotary_seqlen = cache.rotary_cos->sizes[0];
    kp.rotary_dim = static_cast<int32_t>(2 * cache.rotary_cos->sizes[1]);
    kp.rotary_interleaved = cache.rotary_interleaved;
  }
  kp.num_splits = cache.num_splits;
  return kp;
}

}  // namespace flashattn::detail

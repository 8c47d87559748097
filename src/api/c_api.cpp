// The C ABI: converts the plain-C structs to the C++ API and every exception to a status
// code plus a thread-local message. No exception crosses this boundary.
#include <new>
#include <string>

#include "flashattn/flashattn.h"
#include "flashattn/flashattn.hpp"

static_assert(FA_FP8_SCALE_BLOCK_ROWS == flashattn::kFp8ScaleBlockRows);

namespace {

using flashattn::Error;
using flashattn::ErrorCode;

thread_local std::string last_error;

flashattn::TensorView to_view(const fa_tensor* t, const char* name) {
  if (t == nullptr) throw Error(ErrorCode::InvalidArgument, name, "a tensor", "NULL");
  if (t->ndim < 0 || t->ndim > FA_MAX_DIMS)
    throw Error(ErrorCode::InvalidArgument, name, "0 to 6 dimensions",
                std::to_string(t->ndim) + " dimensions");
  flashattn::TensorView v;
  v.data = t->data;
  v.dtype = static_cast<flashattn::DType>(t->dtype);
  v.device = {static_cast<flashattn::DeviceType>(t->device_type), t->device_index};
  v.ndim = t->ndim;
  for (int d = 0; d < t->ndim; ++d) {
    v.sizes[static_cast<size_t>(d)] = t->sizes[d];
    v.strides[static_cast<size_t>(d)] = t->strides[d];
  }
  return v;
}

std::optional<flashattn::TensorView> to_optional_view(const fa_tensor* t, const char* name) {
  if (t == nullptr) return std::nullopt;
  return to_view(t, name);
}

template <typename Struct>
void check_struct_size(const Struct* s, const char* name, const char* init) {
  if (s != nullptr && s->struct_size != sizeof(Struct))
    throw Error(ErrorCode::InvalidArgument, name,
                "struct_size " + std::to_string(sizeof(Struct)) + " (fill it with " + init + ")",
                std::to_string(s->struct_size));
}

flashattn::Options to_options(const fa_options* o) {
  flashattn::Options options;
  if (o == nullptr) return options;
  check_struct_size(o, "options", "fa_options_init");
  if (o->has_softmax_scale) options.softmax_scale = o->softmax_scale;
  options.causal = o->causal != 0;
  options.window_left = o->window_left;
  options.window_right = o->window_right;
  options.softcap = o->softcap;
  options.alibi_slopes = to_optional_view(o->alibi_slopes, "alibi_slopes");
  options.dropout_p = o->dropout_p;
  options.dropout_seed = o->dropout_seed;
  options.dropout_offset = o->dropout_offset;
  options.deterministic = o->deterministic != 0;
  if (o->has_positions) options.positions = flashattn::Options::Positions{o->query_position, o->key_position};
  options.q_descale = to_optional_view(o->q_descale, "q_descale");
  options.k_descale = to_optional_view(o->k_descale, "k_descale");
  options.v_descale = to_optional_view(o->v_descale, "v_descale");
  return options;
}

flashattn::Execution to_execution(const fa_execution* e) {
  flashattn::Execution execution;
  if (e == nullptr) return execution;
  check_struct_size(e, "execution", "fa_execution_init");
  execution.backend = static_cast<flashattn::Backend>(e->backend);
  execution.stream = e->stream;
  execution.num_threads = e->num_threads;
  execution.trust_devices = e->trust_devices != 0;
  return execution;
}

void report(fa_run_info* info, const flashattn::RunInfo& result) {
  if (info == nullptr) return;
  info->backend = static_cast<int32_t>(result.backend);
  info->workspace_bytes = result.workspace_bytes;
  info->deterministic = result.deterministic ? 1 : 0;
  info->num_splits = result.num_splits;
}

flashattn::Varlen to_varlen(const fa_tensor* cu_seqlens_q, const fa_tensor* cu_seqlens_k,
                            int64_t max_seqlen_q, int64_t max_seqlen_k,
                            const fa_tensor* seqused_k, const fa_tensor* block_table) {
  flashattn::Varlen varlen;
  varlen.cu_seqlens_q = to_view(cu_seqlens_q, "cu_seqlens_q");
  varlen.cu_seqlens_k = to_view(cu_seqlens_k, "cu_seqlens_k");
  varlen.max_seqlen_q = max_seqlen_q;
  varlen.max_seqlen_k = max_seqlen_k;
  varlen.seqused_k = to_optional_view(seqused_k, "seqused_k");
  varlen.block_table = to_optional_view(block_table, "block_table");
  return varlen;
}

// Runs `body`, turning exceptions into a status and the thread's last error message.
template <typename Body>
fa_status guarded(Body&& body) {
  try {
    body();
    last_error.clear();
    return FA_OK;
  } catch (const Error& e) {
    last_error = e.what();
    return static_cast<fa_status>(e.code());
  } catch (const std::bad_alloc&) {
    last_error = "memory: expected an allocation to succeed, given out of memory";
    return FA_ERROR_BACKEND;
  } catch (const std::exception& e) {
    last_error = std::string("internal error: ") + e.what();
    return FA_ERROR_INTERNAL;
  } catch (...) {
    last_error = "internal error: unknown exception";
    return FA_ERROR_INTERNAL;
  }
}

// One attention call: info's struct_size checked first, then `call` (which returns the C++
// API's RunInfo) run and reported into info, every exception turned into a status.
template <typename Call>
fa_status run_call(fa_run_info* info, Call&& call) {
  return guarded([&] {
    check_struct_size(info, "info", "fa_run_info_init");
    report(info, call());
  });
}

// A varlen call: like run_call, with the Varlen converted before the other arguments.
template <typename Call>
fa_status run_varlen_call(fa_run_info* info, const fa_tensor* cu_seqlens_q,
                          const fa_tensor* cu_seqlens_k, int64_t max_seqlen_q,
                          int64_t max_seqlen_k, const fa_tensor* seqused_k,
                          const fa_tensor* block_table, Call&& call) {
  return run_call(info, [&] {
    return call(to_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                          block_table));
  });
}

}  // namespace

extern "C" {

void fa_options_init(fa_options* options) {
  if (options == nullptr) return;
  *options = fa_options{};
  options->struct_size = sizeof(fa_options);
  options->window_left = -1;
  options->window_right = -1;
}

void fa_execution_init(fa_execution* execution) {
  if (execution == nullptr) return;
  *execution = fa_execution{};
  execution->struct_size = sizeof(fa_execution);
}

void fa_run_info_init(fa_run_info* info) {
  if (info == nullptr) return;
  *info = fa_run_info{};
  info->struct_size = sizeof(fa_run_info);
  info->num_splits = 1;
}

void fa_kvcache_init(fa_kvcache* cache) {
  if (cache == nullptr) return;
  *cache = fa_kvcache{};
  cache->struct_size = sizeof(fa_kvcache);
}

fa_status fa_forward(const fa_tensor* q, const fa_tensor* k, const fa_tensor* v,
                     const fa_tensor* out, const fa_tensor* lse, const fa_options* options,
                     const fa_execution* execution, fa_run_info* info) {
  return run_call(info, [&] {
    return flashattn::forward(to_view(q, "q"), to_view(k, "k"), to_view(v, "v"),
                              to_view(out, "out"), to_optional_view(lse, "lse"),
                              to_options(options), to_execution(execution));
  });
}

fa_status fa_forward_varlen(const fa_tensor* q, const fa_tensor* k, const fa_tensor* v,
                            const fa_tensor* out, const fa_tensor* lse,
                            const fa_tensor* cu_seqlens_q, const fa_tensor* cu_seqlens_k,
                            int64_t max_seqlen_q, int64_t max_seqlen_k,
                            const fa_tensor* seqused_k, const fa_options* options,
                            const fa_execution* execution, fa_run_info* info) {
  return fa_forward_varlen_paged(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                 max_seqlen_k, seqused_k, nullptr, options, execution, info);
}

fa_status fa_forward_varlen_paged(const fa_tensor* q, const fa_tensor* k, const fa_tensor* v,
                                  const fa_tensor* out, const fa_tensor* lse,
                                  const fa_tensor* cu_seqlens_q, const fa_tensor* cu_seqlens_k,
                                  int64_t max_seqlen_q, int64_t max_seqlen_k,
                                  const fa_tensor* seqused_k, const fa_tensor* block_table,
                                  const fa_options* options, const fa_execution* execution,
                                  fa_run_info* info) {
  const auto call = [&](const flashattn::Varlen& varlen) {
    return flashattn::forward_varlen(to_view(q, "q"), to_view(k, "k"), to_view(v, "v"),
                                     to_view(out, "out"), to_optional_view(lse, "lse"), varlen,
                                     to_options(options), to_execution(execution));
  };
  return run_varlen_call(info, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                         block_table, call);
}

fa_status fa_backward(const fa_tensor* q, const fa_tensor* k, const fa_tensor* v,
                      const fa_tensor* out, const fa_tensor* dout, const fa_tensor* lse,
                      const fa_tensor* dq, const fa_tensor* dk, const fa_tensor* dv,
                      const fa_options* options, const fa_execution* execution,
                      fa_run_info* info) {
  return run_call(info, [&] {
    return flashattn::backward(to_view(q, "q"), to_view(k, "k"), to_view(v, "v"),
                               to_view(out, "out"), to_view(dout, "dout"), to_view(lse, "lse"),
                               to_view(dq, "dq"), to_view(dk, "dk"), to_view(dv, "dv"),
                               to_options(options), to_execution(execution));
  });
}

fa_status fa_backward_varlen(const fa_tensor* q, const fa_tensor* k, const fa_tensor* v,
                             const fa_tensor* out, const fa_tensor* dout, const fa_tensor* lse,
                             const fa_tensor* dq, const fa_tensor* dk, const fa_tensor* dv,
                             const fa_tensor* cu_seqlens_q, const fa_tensor* cu_seqlens_k,
                             int64_t max_seqlen_q, int64_t max_seqlen_k,
                             const fa_tensor* seqused_k, const fa_options* options,
                             const fa_execution* execution, fa_run_info* info) {
  const auto call = [&](const flashattn::Varlen& varlen) {
    return flashattn::backward_varlen(
        to_view(q, "q"), to_view(k, "k"), to_view(v, "v"), to_view(out, "out"),
        to_view(dout, "dout"), to_view(lse, "lse"), to_view(dq, "dq"), to_view(dk, "dk"),
        to_view(dv, "dv"), varlen, to_options(options), to_execution(execution));
  };
  return run_varlen_call(info, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                         nullptr, call);
}

fa_status fa_forward_kvcache(const fa_tensor* q, const fa_kvcache* cache, const fa_tensor* out,
                             const fa_tensor* lse, const fa_options* options,
                             const fa_execution* execution, fa_run_info* info) {
  return run_call(info, [&] {
    if (cache == nullptr)
      throw Error(ErrorCode::InvalidArgument, "cache", "a fa_kvcache (fill it with fa_kvcache_init)",
                  "NULL");
    check_struct_size(cache, "cache", "fa_kvcache_init");
    flashattn::KvCache c;
    c.k_cache = to_view(cache->k_cache, "k_cache");
    c.v_cache = to_view(cache->v_cache, "v_cache");
    c.cache_seqlens = to_view(cache->cache_seqlens, "cache_seqlens");
    c.k_new = to_optional_view(cache->k_new, "k_new");
    c.v_new = to_optional_view(cache->v_new, "v_new");
    c.rotary_cos = to_optional_view(cache->rotary_cos, "rotary_cos");
    c.rotary_sin = to_optional_view(cache->rotary_sin, "rotary_sin");
    c.rotary_interleaved = cache->rotary_interleaved != 0;
    c.cache_batch_idx = to_optional_view(cache->cache_batch_idx, "cache_batch_idx");
    c.cache_leftpad = to_optional_view(cache->cache_leftpad, "cache_leftpad");
    c.block_table = to_optional_view(cache->block_table, "block_table");
    c.num_splits = cache->num_splits;
    return flashattn::forward_kvcache(to_view(q, "q"), c, to_view(out, "out"),
                                      to_optional_view(lse, "lse"), to_options(options),
                                      to_execution(execution));
  });
}

fa_status fa_attention_probabilities(const fa_tensor* q, const fa_tensor* k,
                                     const fa_tensor* probs, const fa_options* options,
                                     const fa_execution* execution, fa_run_info* info) {
  return run_call(info, [&] {
    return flashattn::attention_probabilities(to_view(q, "q"), to_view(k, "k"),
                                              to_view(probs, "probs"), to_options(options),
                                              to_execution(execution));
  });
}

fa_status fa_attention_probabilities_varlen(const fa_tensor* q, const fa_tensor* k,
                                            const fa_tensor* probs,
                                            const fa_tensor* cu_seqlens_q,
                                            const fa_tensor* cu_seqlens_k, int64_t max_seqlen_q,
                                            int64_t max_seqlen_k, const fa_tensor* seqused_k,
                                            const fa_options* options,
                                            const fa_execution* execution, fa_run_info* info) {
  const auto call = [&](const flashattn::Varlen& varlen) {
    return flashattn::attention_probabilities_varlen(to_view(q, "q"), to_view(k, "k"),
                                                     to_view(probs, "probs"), varlen,
                                                     to_options(options),
                                                     to_execution(execution));
  };
  return run_varlen_call(info, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                         nullptr, call);
}

const char* fa_last_error(void) { return last_error.c_str(); }

const char* fa_version(void) { return flashattn::version(); }

int fa_cuda_compiled(void) { return flashattn::cuda_compiled() ? 1 : 0; }

}  // extern "C"

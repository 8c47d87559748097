/* flashattn C ABI: a plain-C mirror of include/flashattn/flashattn.hpp for other languages
 * (the Python module binds to this). Functions return a status code; on failure
 * fa_last_error() returns the message of the calling thread's last error, which names the
 * argument, what was expected and what was given. Nothing is written when a call fails.
 *
 * Structs that may grow carry `struct_size`: fill them with the matching *_init function,
 * which sets it. It tells struct versions apart; this version accepts exactly its own size.
 *
 * Head dims: any D in [1, 256] (k, v and out have q's). On the CUDA backend a D that is not a
 * multiple of 8 runs on zero-padded copies of the tensors, reported in workspace_bytes. */
#ifndef FLASHATTN_H
#define FLASHATTN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum fa_status {
  FA_OK = 0,
  FA_ERROR_INVALID_ARGUMENT = 1,
  FA_ERROR_UNSUPPORTED = 2,
  FA_ERROR_BACKEND = 3,
  FA_ERROR_INTERNAL = 4
} fa_status;

typedef enum fa_dtype {
  FA_FLOAT32 = 0,
  FA_FLOAT16 = 1,
  FA_BFLOAT16 = 2,
  FA_INT32 = 3,
  FA_FLOAT8_E4M3 = 4 /* fp8 e4m3 (float8_e4m3fn): the forward's q, k, v, with a bf16 out */
} fa_dtype;

typedef enum fa_device_type { FA_DEVICE_CPU = 0, FA_DEVICE_CUDA = 1 } fa_device_type;

typedef enum fa_backend { FA_BACKEND_AUTO = 0, FA_BACKEND_CPU = 1, FA_BACKEND_CUDA = 2 } fa_backend;

#define FA_MAX_DIMS 6

/* A non-owning strided view; sizes and strides in elements. */
typedef struct fa_tensor {
  void* data;
  int32_t dtype;        /* fa_dtype */
  int32_t device_type;  /* fa_device_type */
  int32_t device_index;
  int32_t ndim;
  int64_t sizes[FA_MAX_DIMS];
  int64_t strides[FA_MAX_DIMS];
} fa_tensor;

typedef struct fa_options {
  size_t struct_size;
  int32_t has_softmax_scale; /* 0: use 1/sqrt(D) */
  float softmax_scale;
  int32_t causal;
  int32_t window_left;  /* -1: unbounded */
  int32_t window_right; /* -1: unbounded */
  float softcap;        /* 0: off */
  const fa_tensor* alibi_slopes; /* NULL: off; fp32 (H) or (B, H) */
  float dropout_p;      /* [0, 1); 0: off (every backend, forward and backward) */
  uint64_t dropout_seed;
  uint64_t dropout_offset;
  int32_t deterministic; /* backward: bitwise reproducible gradients (the CPU always is) */
  /* Positions (Options::positions in flashattn.hpp): the call is a block of a longer
   * self-attention, its query row i token query_position + i and its key j token
   * key_position + j, for ALiBi and dropout. 0: none (the two positions are ignored). */
  int32_t has_positions;
  int64_t query_position;
  int64_t key_position;
  /* FP8 (e4m3) q, k, v: fp32 descales, NULL: 1. (B, Hk), or (B, Hk, ceil(S / 128)) per block
   * of FA_FP8_SCALE_BLOCK_ROWS rows (docs/SPEC.md, "FP8 inputs"). fa_forward_kvcache with fp8
   * caches: k_descale and v_descale, (B, Hk). */
  const fa_tensor* q_descale;
  const fa_tensor* k_descale;
  const fa_tensor* v_descale;
} fa_options;

#define FA_FP8_SCALE_BLOCK_ROWS 128

typedef struct fa_execution {
  size_t struct_size;
  int32_t backend; /* fa_backend */
  void* stream;    /* cudaStream_t for the CUDA backend */
  int32_t num_threads;
  int32_t trust_devices; /* 1: each tensor's device is where its memory lives (Execution) */
} fa_execution;

typedef struct fa_run_info {
  size_t struct_size;
  int32_t backend; /* the backend that ran */
  size_t workspace_bytes; /* peak memory the call allocated beyond the caller's tensors */
  int32_t deterministic; /* 1: the result is bitwise reproducible */
  int32_t num_splits;    /* fa_forward_kvcache: the key chunks it merged */
} fa_run_info;

/* A KV cache for fa_forward_kvcache (flashattn::KvCache documents every field). Optional
 * tensors are NULL when absent. */
typedef struct fa_kvcache {
  size_t struct_size;
  const fa_tensor* k_cache;
  const fa_tensor* v_cache;
  const fa_tensor* cache_seqlens;
  const fa_tensor* k_new;
  const fa_tensor* v_new;
  const fa_tensor* rotary_cos;
  const fa_tensor* rotary_sin;
  int32_t rotary_interleaved;
  const fa_tensor* cache_batch_idx;
  const fa_tensor* cache_leftpad;
  const fa_tensor* block_table;
  int32_t num_splits; /* 0: choose; else the key chunks to merge, 1 to 1024 */
} fa_kvcache;

void fa_options_init(fa_options* options);
void fa_execution_init(fa_execution* execution);
void fa_run_info_init(fa_run_info* info);
void fa_kvcache_init(fa_kvcache* cache);

/* Dense forward. lse, options, execution and info may be NULL (defaults / not wanted). */
fa_status fa_forward(const fa_tensor* q, const fa_tensor* k, const fa_tensor* v,
                     const fa_tensor* out, const fa_tensor* lse, const fa_options* options,
                     const fa_execution* execution, fa_run_info* info);

/* Varlen forward. seqused_k may be NULL. */
fa_status fa_forward_varlen(const fa_tensor* q, const fa_tensor* k, const fa_tensor* v,
                            const fa_tensor* out, const fa_tensor* lse,
                            const fa_tensor* cu_seqlens_q, const fa_tensor* cu_seqlens_k,
                            int64_t max_seqlen_q, int64_t max_seqlen_k,
                            const fa_tensor* seqused_k, const fa_options* options,
                            const fa_execution* execution, fa_run_info* info);

/* Varlen forward over paged keys and values (forward only): k and v are
 * (num_pages, page_size, Hk, D), any page_size >= 1, and block_table int32 (B, max_pages) says
 * where sequence b's keys are: position p in page block_table[b][p / page_size], row
 * p % page_size. Sequence b's keys are the first cu_seqlens_k[b+1] - cu_seqlens_k[b] positions
 * of its pages (seqused_k[b] when given); q, out and lse are as in fa_forward_varlen. With
 * block_table NULL this is fa_forward_varlen. */
fa_status fa_forward_varlen_paged(const fa_tensor* q, const fa_tensor* k, const fa_tensor* v,
                                  const fa_tensor* out, const fa_tensor* lse,
                                  const fa_tensor* cu_seqlens_q, const fa_tensor* cu_seqlens_k,
                                  int64_t max_seqlen_q, int64_t max_seqlen_k,
                                  const fa_tensor* seqused_k, const fa_tensor* block_table,
                                  const fa_options* options, const fa_execution* execution,
                                  fa_run_info* info);

/* Dense backward: gradients of sum(dout * out). lse (B, H, Sq) fp32 is required; dq, dk, dv
 * have the shapes and dtype of q, k, v. options, execution and info may be NULL. */
fa_status fa_backward(const fa_tensor* q, const fa_tensor* k, const fa_tensor* v,
                      const fa_tensor* out, const fa_tensor* dout, const fa_tensor* lse,
                      const fa_tensor* dq, const fa_tensor* dk, const fa_tensor* dv,
                      const fa_options* options, const fa_execution* execution,
                      fa_run_info* info);

/* Varlen backward. lse (H, total_q) is required; seqused_k may be NULL. */
fa_status fa_backward_varlen(const fa_tensor* q, const fa_tensor* k, const fa_tensor* v,
                             const fa_tensor* out, const fa_tensor* dout, const fa_tensor* lse,
                             const fa_tensor* dq, const fa_tensor* dk, const fa_tensor* dv,
                             const fa_tensor* cu_seqlens_q, const fa_tensor* cu_seqlens_k,
                             int64_t max_seqlen_q, int64_t max_seqlen_k,
                             const fa_tensor* seqused_k, const fa_options* options,
                             const fa_execution* execution, fa_run_info* info);

/* KV-cache forward (decoding): appends cache->k_new/v_new in place, then attends q to the
 * cache. lse, options, execution and info may be NULL. */
fa_status fa_forward_kvcache(const fa_tensor* q, const fa_kvcache* cache, const fa_tensor* out,
                             const fa_tensor* lse, const fa_options* options,
                             const fa_execution* execution, fa_run_info* info);

/* Testing aid (flashattn::attention_probabilities documents it; docs/SPEC.md, "Attention
 * probabilities"): writes probs, fp32 (B, H, Sq, Sk), with exp(s_ij - max_j s_ij) for the keys
 * query i sees, 0 elsewhere, negated where dropout drops the element: the probabilities of
 * the forward with the same q, k and options. O(B H Sq Sk) memory and time. options,
 * execution and info may be NULL. */
fa_status fa_attention_probabilities(const fa_tensor* q, const fa_tensor* k,
                                     const fa_tensor* probs, const fa_options* options,
                                     const fa_execution* execution, fa_run_info* info);

/* The same for a ragged batch: probs (B, H, max_seqlen_q, max_seqlen_k), row i and column j
 * of sequence b its positions i and j. seqused_k may be NULL. */
fa_status fa_attention_probabilities_varlen(const fa_tensor* q, const fa_tensor* k,
                                            const fa_tensor* probs,
                                            const fa_tensor* cu_seqlens_q,
                                            const fa_tensor* cu_seqlens_k, int64_t max_seqlen_q,
                                            int64_t max_seqlen_k, const fa_tensor* seqused_k,
                                            const fa_options* options,
                                            const fa_execution* execution, fa_run_info* info);

/* The calling thread's last error message ("" when none). Valid until its next call. */
const char* fa_last_error(void);
const char* fa_version(void);
int fa_cuda_compiled(void);

#ifdef __cplusplus
}
#endif

#endif /* FLASHATTN_H */

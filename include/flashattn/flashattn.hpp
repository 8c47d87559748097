// flashattn: exact attention that never materialises the Sq x Sk score matrix (but for
// attention_probabilities, a testing aid).
//
// The C++ API. Tensors are non-owning views (pointer, dtype, device, sizes, strides in
// elements); the library never allocates or frees the caller's tensors. Every entry point
// validates all of its arguments before it writes anything: a bad call throws
// flashattn::Error naming the argument, what was expected and what was given.
//
// Semantics: docs/SPEC.md. Layouts (the last dimension of every tensor is contiguous):
//   dense   q (B, Sq, H, D)   k (B, Sk, Hk, D)   v (B, Sk, Hk, Dv)   out (B, Sq, H, Dv)
//           lse (B, H, Sq) fp32, contiguous
//   varlen  q (total_q, H, D) k/v (total_k, Hk, D) out (total_q, H, Dv)
//           lse (H, total_q) fp32, contiguous; paged k/v (num_pages, page_size, Hk, D)
//           with Varlen::block_table
// Head dims: any D in [1, 256], Dv = D. On the CUDA backend a D that is not a multiple of 8
// runs on zero-padded copies of the tensors (exact; their memory in RunInfo::workspace_bytes).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace flashattn {

// Float8E4M3: FP8 e4m3 (the float8_e4m3fn of PyTorch and CUDA: 1 sign bit, 4 exponent bits of
// bias 7, 3 mantissa bits, no infinities, NaN = S.1111.111, largest finite 448), for the
// forward's q, k and v only, with descales in Options and a bf16 out (docs/SPEC.md, "FP8 inputs").
enum class DType : int32_t { Float32 = 0, Float16 = 1, BFloat16 = 2, Int32 = 3, Float8E4M3 = 4 };
enum class DeviceType : int32_t { CPU = 0, CUDA = 1 };

struct Device {
  DeviceType type = DeviceType::CPU;
  int32_t index = 0;
};

inline constexpr int kMaxDims = 6;

// A non-owning view of a strided tensor. Sizes and strides count elements and are 64-bit.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::Float32;
  Device device{};
  int32_t ndim = 0;
  std::array<int64_t, kMaxDims> sizes{};
  std::array<int64_t, kMaxDims> strides{};

  // A view with row-major (C-contiguous) strides.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<int64_t> sizes,
                               Device device = {});
  // A view with explicit strides (one per size).
  static TensorView strided(void* data, DType dtype, std::initializer_list<int64_t> sizes,
                            std::initializer_list<int64_t> strides, Device device = {});

  int64_t size(int dim) const { return sizes[static_cast<size_t>(dim)]; }
  int64_t stride(int dim) const { return strides[static_cast<size_t>(dim)]; }
  int64_t numel() const;  // throws flashattn::Error when the count overflows 64 bits
};

const char* dtype_name(DType dtype);
size_t dtype_size(DType dtype);

// What went wrong, for callers that branch on it (the C ABI maps these to status codes).
enum class ErrorCode : int32_t {
  InvalidArgument = 1,  // shape, dtype, device, stride, range or combination is wrong
  Unsupported = 2,      // valid by the contract but not available in this build/backend
  Backend = 3,          // the backend failed at run time (for example a CUDA error)
  Internal = 4,         // a bug in flashattn
};

// Thrown by every entry point. what() reads "<argument>: expected <expected>, given <given>".
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, std::string argument, std::string expected, std::string given);
  ErrorCode code() const { return code_; }
  const std::string& argument() const { return argument_; }
  const std::string& expected() const { return expected_; }
  const std::string& given() const { return given_; }

 private:
  ErrorCode code_;
  std::string argument_, expected_, given_;
};

// Every forward feature of docs/SPEC.md.
struct Options {
  std::optional<float> softmax_scale;  // default 1/sqrt(D)
  bool causal = false;                 // right window = 0, bottom-right aligned
  int32_t window_left = -1;            // -1: unbounded
  int32_t window_right = -1;           // -1: unbounded (forced to 0 by causal)
  float softcap = 0.0f;                // 0: off; c > 0: s = c * tanh(s / c)
  std::optional<TensorView> alibi_slopes;  // fp32, (H) or (B, H)
  // Dropout (training): each probability is kept with probability 1 - dropout_p and scaled by
  // 1 / (1 - dropout_p); the keep bit is a pure function of (seed, offset, b, h, i, j)
  // (src/common/philox.hpp), so a backward with the same options sees the forward's mask.
  // Forward and backward on both backends (the same keep bits on the CPU and on CUDA); lse
  // stays that of the undropped softmax.
  float dropout_p = 0.0f;              // in [0, 1); 0: off
  uint64_t dropout_seed = 0;
  uint64_t dropout_offset = 0;         // advance it between training steps for a fresh mask
  // Positions (docs/SPEC.md, "Positions"): this call computes a block of a longer
  // self-attention, its query row i being token query + i and its key j token key + j of that
  // sequence. ALiBi then measures |(query + i) - (key + j)| (instead of the call's bottom-right
  // distance) and dropout draws the keep bits of (query + i, key + j), so the block gets
  // exactly the biases and bits of the whole-sequence call (ring attention's chunk calls).
  // Masks (causal, window) stay the call's own. Not for forward_kvcache.
  struct Positions {
    int64_t query = 0;  // >= 0, query + (the longest sequence's rows) <= 2^31
    int64_t key = 0;    // >= 0, key + (the longest sequence's keys) <= 2^31
  };
  std::optional<Positions> positions;  // none: the call is the whole sequence
  // Backward: ask for gradients that are bitwise identical run to run. The CPU engine is
  // deterministic whatever this says; the CUDA backward's default mode adds dq with atomics
  // in no fixed order, and this option trades that for a second, query-parallel kernel
  // (docs/ARCHITECTURE.md says how).
  bool deterministic = false;
  // FP8 (e4m3) q, k, v (forward only): the fp32 factors that turn each stored value into the
  // value it stands for, q*q_descale and so on (absent: 1). Each is (B, Hk), one factor per
  // (sequence, key/value head; a query head takes its group's), or (B, Hk, ceil(S /
  // kFp8ScaleBlockRows)), one per block of kFp8ScaleBlockRows rows of a sequence (S: Sq for
  // q, Sk for k and v; varlen: max_seqlen_q/k), contiguous, on q's device (docs/SPEC.md).
  // forward_kvcache with fp8 e4m3 caches (q 16- or 32-bit): k_descale and v_descale, (B, Hk).
  std::optional<TensorView> q_descale, k_descale, v_descale;
};

// The rows of a sequence that share one factor of a block-scaled descale (Options::q_descale):
// the Hopper kernel's query tile.
inline constexpr int64_t kFp8ScaleBlockRows = 128;

// The mask of `options` (causal, window_left, window_right) for one sequence: the keys that
// query row `row` (0 <= row < seqlen_q) sees are positions [begin, end) of its seqlen_k keys,
// none when end <= begin. The diagonal is aligned to the bottom-right corner (docs/SPEC.md,
// "The score of query i and key j", step 4); this is the rule the engines apply, for callers
// that count the work of a call (FLOPs over the visible pairs) or want to know which rows see
// no key (out 0, lse -inf).
struct KeyRange {
  int64_t begin = 0, end = 0;
};
KeyRange visible_keys(int64_t row, int64_t seqlen_q, int64_t seqlen_k, const Options& options);

enum class Backend : int32_t { Auto = 0, CPU = 1, CUDA = 2 };
const char* backend_name(Backend backend);

// Where and how the call runs.
struct Execution {
  Backend backend = Backend::Auto;  // Auto: CUDA when the tensors live on a GPU, else CPU
  void* stream = nullptr;           // cudaStream_t for the CUDA backend; ignored on the CPU
  int32_t num_threads = 0;          // CPU threads; 0 = all available
  // The caller vouches that every tensor's device (type and index) is where its memory lives,
  // as a framework's tensors guarantee: the library then skips the per-pointer CUDA query
  // (about 1 us each) that otherwise turns a host pointer described as GPU memory, or the
  // like, into an InvalidArgument error instead of a fault.
  bool trust_devices = false;
};

// Ragged batches: sequence b occupies rows cu_seqlens[b] .. cu_seqlens[b+1]-1.
struct Varlen {
  TensorView cu_seqlens_q;  // int32 (B+1), starts at 0, non-decreasing
  TensorView cu_seqlens_k;  // int32 (B+1), starts at 0, non-decreasing
  int64_t max_seqlen_q = 0;  // >= every query length
  int64_t max_seqlen_k = 0;  // >= every key length
  std::optional<TensorView> seqused_k;  // int32 (B): only the first seqused_k[b] keys take part
  // Paged keys and values (forward only): int32 (B, max_pages); k is then
  // (num_pages, page_size, Hk, D) and v (num_pages, page_size, Hk, D), any page_size >= 1, and
  // key position p of sequence b lives in page block_table[b][p / page_size] at row
  // p % page_size. Sequence b's keys are the first cu_seqlens_k[b+1] - cu_seqlens_k[b]
  // positions of its pages (seqused_k[b] when given); q, out and lse stay packed as above.
  std::optional<TensorView> block_table;
};

// What a call did.
struct RunInfo {
  Backend backend = Backend::CPU;  // the backend that ran
  size_t workspace_bytes = 0;      // peak memory the engine allocated beyond the caller's tensors
                                   // (on CUDA, with the padded copies of a head dim that is
                                   // not a multiple of 8)
  bool deterministic = true;       // the result is bitwise reproducible (always, on the CPU;
                                   // on CUDA, the backward's Options::deterministic)
  int32_t num_splits = 1;          // forward_kvcache: the key chunks it merged (after choosing)
};

// out = dropout(softmax(mask(scale * q k^T))) v, and lse = logsumexp of each row (skipped when absent).
RunInfo forward(const TensorView& q, const TensorView& k, const TensorView& v,
                const TensorView& out, const std::optional<TensorView>& lse,
                const Options& options = {}, const Execution& execution = {});

RunInfo forward_varlen(const TensorView& q, const TensorView& k, const TensorView& v,
                       const TensorView& out, const std::optional<TensorView>& lse,
                       const Varlen& varlen, const Options& options = {},
                       const Execution& execution = {});

// A key/value cache for inference (docs/SPEC.md, "Decoding with a KV cache"). Positions count
// from row 0 of a sequence's cache; sequence b's keys are the cache positions
//   cache_leftpad[b] .. cache_seqlens[b] + S_new - 1
// (S_new = 0 without k_new), and q's rows are the last Sq of them (the usual bottom-right
// alignment of causal and window masks). Every tensor lives on q's device. The CPU backend
// checks the integer tensors' values (an Error names the bad one). On CUDA they live in device
// memory: with a paged cache cache_seqlens is copied to the host and checked (one stream
// synchronisation, skipped during CUDA-graph capture); every other value is guarded by the
// kernels, which never touch memory outside the given tensors: a sequence with an out-of-range
// value appends nothing and gets NaN out and lse rows, a page index out of range reads as NaN
// keys (docs/SPEC.md, "What each backend supports and checks").
struct KvCache {
  // Dense: (B_cache, S_cache, Hk, D), sequence b in row cache_batch_idx[b] (default b).
  // Paged (block_table given): (num_pages, page_size, Hk, D), any page_size >= 1.
  // q's dtype, or fp8 e4m3 (both caches): a stored value x then stands for x times
  // Options::k_descale / v_descale [b][kv head], and k_new/v_new (q's dtype) are stored as
  // e4m3(x / descale), saturating (CPU backend only, so far; docs/SPEC.md).
  TensorView k_cache, v_cache;
  TensorView cache_seqlens;  // int32 (B): positions already filled (cache_leftpad included)
  // (B, S_new, Hk, D), q's dtype: written into the cache in place at positions
  // cache_seqlens[b] .. cache_seqlens[b] + S_new - 1 before attending. Both or neither.
  std::optional<TensorView> k_new, v_new;
  // Rotary embedding, (S_rotary, rotary_dim / 2) each, q's dtype, rotary_dim even and <= D:
  // rotates k_new at its cache positions, and q at positions cache_seqlens[b] + t when the
  // call is causal or windowed (at cache_seqlens[b] for every t otherwise). Interleaved
  // rotates the pairs (2i, 2i+1); otherwise (i, i + rotary_dim / 2) (GPT-NeoX). Both or neither.
  std::optional<TensorView> rotary_cos, rotary_sin;
  bool rotary_interleaved = false;
  std::optional<TensorView> cache_batch_idx;  // int32 (B): the dense cache row of sequence b
  std::optional<TensorView> cache_leftpad;    // int32 (B): the first position of sequence b
  // int32 (B, max_pages): position p of sequence b lives in page block_table[b][p / page_size]
  // at row p % page_size.
  std::optional<TensorView> block_table;
  // 0: choose; 1: one pass over the keys; n > 1 (at most 1024): n key chunks whose partial
  // (out, lse) pairs are merged exactly. RunInfo::num_splits reports what ran.
  int32_t num_splits = 0;
};

// Decoding with a KV cache: appends k_new/v_new (rotated) in place, then
// out = softmax(mask(scale * q k^T)) v over each sequence's cached keys. q (B, Sq, H, D),
// out (B, Sq, H, D), lse (B, H, Sq) fp32. Options as for forward() except dropout.
RunInfo forward_kvcache(const TensorView& q, const KvCache& cache, const TensorView& out,
                        const std::optional<TensorView>& lse, const Options& options = {},
                        const Execution& execution = {});

// Gradients of L = sum(dout * out) for a forward call with the same options: q, k, v, out
// and lse (required) are the forward's inputs and outputs; dout has out's shape and dtype;
// dq, dk, dv (outputs, same shapes and dtype as q, k, v) are fully overwritten, with dk/dv
// summed over the query heads of each GQA group. Rows that saw no key get zero gradients.
// Varlen: rows of dq/dk/dv outside every sequence (past cu_seqlens[B]) are not written;
// paged keys and values (Varlen::block_table) have no backward (ErrorCode::Unsupported).
RunInfo backward(const TensorView& q, const TensorView& k, const TensorView& v,
                 const TensorView& out, const TensorView& dout, const TensorView& lse,
                 const TensorView& dq, const TensorView& dk, const TensorView& dv,
                 const Options& options = {}, const Execution& execution = {});

RunInfo backward_varlen(const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& out, const TensorView& dout, const TensorView& lse,
                        const TensorView& dq, const TensorView& dk, const TensorView& dv,
                        const Varlen& varlen, const Options& options = {},
                        const Execution& execution = {});

// A testing aid, not part of the fast path: the attention probabilities of the forward call
// with the same q, k, options (and varlen), materialised in the form FlashAttention 2's
// return_attn_probs gives them to its dropout tests (docs/SPEC.md, "Attention probabilities").
// probs is fp32 (B, H, Sq, Sk) dense and (B, H, max_seqlen_q, max_seqlen_k) varlen, indexed by
// the position within each sequence, and every element is written:
//   probs[b][h][i][j] = exp(s_ij - max_j' s_ij')   for a key j that query i sees (s: the full
//                                                  score, scale, softcap, ALiBi; the max over
//                                                  the keys i sees),
//                     = 0                          for a masked key and outside the sequence,
//                     negated (sign bit set)       where dropout drops a visible (b, h, i, j):
//                                                  the keep bits the forward and backward apply.
// So P_ij = |probs_ij| exp(max_i - lse_i), and out_i = sum_j P_ij v_j / (1 - p) over the j whose
// sign bit is clear. Costs O(B H Sq Sk) memory and time, which the forward never spends: for
// tests, not training.
RunInfo attention_probabilities(const TensorView& q, const TensorView& k, const TensorView& probs,
                                const Options& options = {}, const Execution& execution = {});

RunInfo attention_probabilities_varlen(const TensorView& q, const TensorView& k,
                                       const TensorView& probs, const Varlen& varlen,
                                       const Options& options = {},
                                       const Execution& execution = {});

// What this build holds and what it can see.
struct CudaDevice {
  int32_t index = 0;
  std::string name;
  int32_t compute_capability = 0;  // e.g. 90 for sm_90
  size_t memory_bytes = 0;
  int32_t multiprocessors = 0;
};

const char* version();
bool cuda_compiled();
std::vector<std::string> cuda_architectures();  // the SASS targets compiled in
// The visible CUDA devices; when none can be listed, `why` (if given) says why.
std::vector<CudaDevice> cuda_devices(std::string* why = nullptr);

}  // namespace flashattn

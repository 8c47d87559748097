// Any head dim on the CUDA backend: the kernels move rows in 16-byte chunks (8 fp16/bf16
// elements), so they take head dims that are multiples of 8 with 16-byte aligned rows. A call
// whose head dim is not one runs on zero-padded copies of its tensors instead: each tensor's
// rows copied into contiguous rows of round_up(D, 8) elements (the extra columns 0), the params
// pointed at the copies, the normal kernels run, and what the call writes (out, dq/dk/dv, the
// appended kv-cache rows) copied back into the caller's tensors, all on the call's stream.
//
// The padding is exact: a zero column adds 0 to every score q.k and to rowsum(dO o O), and the
// output or gradient columns it produces are sliced away. The softmax scale is the params' (its
// default 1/sqrt(D) was taken from the caller's D by api/params.cpp). A call with a head dim
// that is a multiple of 8 runs as given: no copy, no allocation.
//
// Host-only and free of CUDA types, so that the validator (api/validate.cpp) states the same
// rule: a call that is padded needs only element-aligned rows, since its rows are copied one
// element at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "common/kvcache.hpp"
#include "common/params.hpp"

namespace flashattn::detail::cuda {

inline constexpr int64_t kHeadDimMultiple = 8;  // elements per 16-byte chunk

// Whether a call with this head dim runs on padded copies.
constexpr bool pads_head_dim(int64_t head_dim) { return head_dim % kHeadDimMultiple != 0; }

constexpr int64_t padded_head_dim(int64_t head_dim) {
  return (head_dim + kHeadDimMultiple - 1) / kHeadDimMultiple * kHeadDimMultiple;
}

// Each runs `run` on the call, padded when its head dim asks for it (copies in before `run`,
// copies back after it; one stream-ordered allocation on the call's stream, freed on every
// path out), and returns what `run` returned with the padded copies' bytes added to the
// workspace. The caller has made the tensors' GPU current.
size_t run_with_padded_head_dim(const ForwardParams& params,
                                const std::function<size_t(const ForwardParams&)>& run);
size_t run_with_padded_head_dim(const BackwardParams& params,
                                const std::function<size_t(const BackwardParams&)>& run);
// The caches are copied as the positions each sequence holds before the call
// ([cache_leftpad[b], cache_seqlens[b])), into one dense (B, capacity, Hk, round_up(D, 8))
// cache per tensor that `run` sees without cache_batch_idx or block_table; only the appended
// positions are copied back, so no other cache row of the caller's is written.
KvCacheRun run_with_padded_head_dim(const KvCacheParams& params,
                                    const std::function<KvCacheRun(const KvCacheParams&)>& run);

}  // namespace flashattn::detail::cuda

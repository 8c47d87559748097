// The CUDA backend's KV-cache forward entry point (host side).
#pragma once

#include "common/kvcache.hpp"

namespace flashattn::detail::cuda {

// Runs the validated call on params.attn.stream: the split-KV kernel (append and rotary fused
// in) and, when it split the keys, the combine kernel; on padded copies when the head dim is
// not a multiple of 8 (cuda/head_dim_padding.hpp).
KvCacheRun forward_kvcache(const KvCacheParams& params);

}  // namespace flashattn::detail::cuda

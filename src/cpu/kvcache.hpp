// The CPU backend's KV-cache forward entry point.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/kvcache.hpp"

namespace flashattn::detail {

// What a KV-cache forward did, for RunInfo.
struct KvCacheRun {
  size_t workspace_bytes = 0;
  int32_t num_splits = 1;  // the key chunks it merged (num_splits resolved)
};

}  // namespace flashattn::detail

namespace flashattn::detail::cpu {

// Appends k_new/v_new (rotated) into the caches, then attends. Validated call.
KvCacheRun forward_kvcache(const KvCacheParams& params);

}  // namespace flashattn::detail::cpu

// The CPU backend's KV-cache forward entry point.
#pragma once

#include "common/kvcache.hpp"

namespace flashattn::detail::cpu {

// Appends k_new/v_new (rotated) into the caches, then attends. Validated call.
KvCacheRun forward_kvcache(const KvCacheParams& params);

}  // namespace flashattn::detail::cpu

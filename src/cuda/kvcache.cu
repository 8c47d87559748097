// The KV-cache forward on CUDA. (Placeholder until the split-KV kernel lands: reports the
// path as unsupported, so the CUDA tests of it fail loudly rather than pass.)
#include <string>

#include "cuda/kvcache.hpp"

namespace flashattn::detail::cuda {

KvCacheRun forward_kvcache(const KvCacheParams&) {
  throw Error(ErrorCode::Unsupported, "backend", "cpu (the cuda kv-cache kernel is not built yet)",
              "cuda");
}

}  // namespace flashattn::detail::cuda

// The CUDA queries of a build configured without CUDA.
#include "cuda/backward.hpp"
#include "cuda/devices.hpp"
#include "cuda/forward.hpp"
#include "cuda/kvcache.hpp"

namespace flashattn::detail::cuda {

bool compiled() { return false; }

std::vector<std::string> architectures() { return {}; }

std::vector<CudaDevice> devices(std::string* why) {
  if (why != nullptr) *why = "this build has no CUDA support (configured with FLASHATTN_CUDA=OFF or without nvcc)";
  return {};
}

PointerLocation locate(const void*) { return {}; }

bool copy_int32_to_host(const char*, const int32_t*, int64_t, int, void*, int32_t*) {
  return false;  // unreachable: validation rejects the cuda backend
}

size_t forward(const ForwardParams&) {  // unreachable: validation rejects the cuda backend
  throw Error(ErrorCode::Unsupported, "backend", "cpu or auto (this build has no CUDA backend)",
              "cuda");
}

size_t probabilities(const ProbabilitiesParams&) {  // unreachable, as above
  throw Error(ErrorCode::Unsupported, "backend", "cpu or auto (this build has no CUDA backend)",
              "cuda");
}

size_t backward(const BackwardParams&) {  // unreachable: validation rejects the cuda backend
  throw Error(ErrorCode::Unsupported, "backend", "cpu or auto (this build has no CUDA backend)",
              "cuda");
}

KvCacheRun forward_kvcache(const KvCacheParams&) {  // unreachable, as above
  throw Error(ErrorCode::Unsupported, "backend", "cpu or auto (this build has no CUDA backend)",
              "cuda");
}

}  // namespace flashattn::detail::cuda

// What the CUDA side of the build offers, answered without CUDA in a CPU-only build
// (src/cuda/no_cuda.cpp) and by the CUDA runtime otherwise (src/cuda/devices.cu).
#pragma once

#include <string>
#include <vector>

#include "flashattn/flashattn.hpp"

namespace flashattn::detail::cuda {

bool compiled();
std::vector<std::string> architectures();
std::vector<CudaDevice> devices(std::string* why);

// Where a pointer points, as far as the CUDA runtime knows. Host covers pageable memory the
// runtime has never seen; Managed memory is reachable from both sides.
struct PointerLocation {
  enum Kind { Unknown, Host, Device, Managed } kind = Unknown;
  int device = -1;  // for Device
};
PointerLocation locate(const void* pointer);

}  // namespace flashattn::detail::cuda

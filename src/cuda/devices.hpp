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

}  // namespace flashattn::detail::cuda

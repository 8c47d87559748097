// Which code of a kernel runs on the current device. A kernel's sm_90-only instructions
// (programmatic dependent launch, bulk reductions) are compiled in only where __CUDA_ARCH__
// >= 900; on a GPU newer than the build's machine code, the driver compiles the compute_80
// PTX instead, which has none of them. So host-side choices that the kernel must match are
// made from the PTX version of the loaded code, not from the device's compute capability.
#pragma once

#include <cuda_runtime.h>

namespace flashattn::detail::cuda {

// The virtual architecture (major * 10 + minor, e.g. 80 or 90) that `kernel`'s code for the
// current device was compiled from; 0 where the runtime cannot say (the caller then takes
// the path every architecture has).
template <typename Kernel>
int kernel_ptx_version(Kernel kernel) {
  cudaFuncAttributes attributes{};
  if (cudaFuncGetAttributes(&attributes, kernel) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return attributes.ptxVersion;
}

}  // namespace flashattn::detail::cuda

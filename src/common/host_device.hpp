// Lets the few ideas shared by the CPU engine and the CUDA kernels (the masking rule, the
// score modifiers, dtype conversion) be written once and compiled for both.
#pragma once

#if defined(__CUDACC__)
#define FA_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FA_HOST_DEVICE inline
#endif

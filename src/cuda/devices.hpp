// What the CUDA side of the build offers, answered without CUDA in a CPU-only build
// (src/cuda/no_cuda.cpp) and by the CUDA runtime otherwise (src/cuda/devices.cu).
#pragma once

#include <cstdint>
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

// Copies `count` int32 values (the tensor `name`) from device memory on `device` to `host`, ordered on `stream`
// (after the work queued there before, so that they are the values the call's kernels would
// read), and waits for them: one device synchronisation. Returns false, copying nothing, while
// the stream is being captured into a CUDA graph, where a copy would be recorded rather than
// run (the kernels' guards apply there). A CUDA error is thrown as ErrorCode::Backend.
bool copy_int32_to_host(const char* name, const int32_t* values, int64_t count, int device,
                        void* stream, int32_t* host);

// The most dynamic shared memory one block may use on the current device (the opt-in limit:
// 227 KiB on Hopper, 163 KiB on A100, 99 KiB on sm_86/sm_89), which decides the tile shapes
// a kernel can launch with. FLASHATTN_CUDA_SMEM_LIMIT=<bytes> lowers it (never raises it),
// so the tests can run the smaller GPUs' shapes on a large one.
int64_t shared_bytes_per_block_limit();

// The current device's multiprocessor count (0 when it cannot be read): what a grid must fill.
int32_t multiprocessor_count();

}  // namespace flashattn::detail::cuda

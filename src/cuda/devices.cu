// The CUDA queries of a build with CUDA: which architectures were compiled in, and which
// devices the runtime can see (none on a machine without a driver or GPU, with the reason).
#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <sstream>
#include <string>

#include "common/knobs.hpp"
#include "cuda/common/per_device.hpp"
#include "cuda/devices.hpp"

namespace flashattn::detail::cuda {

bool compiled() { return true; }

std::vector<std::string> architectures() {
  std::vector<std::string> result;
  std::istringstream list(FLASHATTN_CUDA_ARCHS);  // set by CMake, e.g. "sm_80 sm_90a"
  for (std::string arch; list >> arch;) result.push_back(arch);
  return result;
}

std::vector<CudaDevice> devices(std::string* why) {
  std::vector<CudaDevice> result;
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    if (why != nullptr) {
      if (status == cudaErrorInsufficientDriver)
        *why = "no CUDA driver, or one older than this build's CUDA runtime";
      else if (status == cudaErrorNoDevice)
        *why = "the CUDA driver sees no device";
      else
        *why = std::string("the CUDA runtime reports: ") + cudaGetErrorString(status);
    }
    cudaGetLastError();  // clear the sticky error so later calls start clean
    return result;
  }
  if (count == 0 && why != nullptr) *why = "the CUDA runtime sees no device";
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    CudaDevice d;
    d.index = i;
    d.name = prop.name;
    d.compute_capability = prop.major * 10 + prop.minor;
    d.memory_bytes = prop.totalGlobalMem;
    d.multiprocessors = prop.multiProcessorCount;
    result.push_back(d);
  }
  return result;
}

PointerLocation locate(const void* pointer) {
  PointerLocation where;
  // Asked once per process: every call checks several pointers, and without a driver each
  // query would fail the same way again.
  static const bool have_device = [] {
    int count = 0;
    const bool ok = cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
    cudaGetLastError();
    return ok;
  }();
  if (!have_device) return where;  // nothing can be said (and nothing is on a GPU)
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, pointer) != cudaSuccess) {
    cudaGetLastError();
    return where;
  }
  switch (attributes.type) {
    case cudaMemoryTypeDevice:
      where.kind = PointerLocation::Device;
      where.device = attributes.device;
      break;
    case cudaMemoryTypeManaged:
      where.kind = PointerLocation::Managed;
      break;
    case cudaMemoryTypeHost:
    case cudaMemoryTypeUnregistered:
      where.kind = PointerLocation::Host;
      break;
  }
  return where;
}

bool copy_int32_to_host(const char* name, const int32_t* values, int64_t count, int device,
                        void* stream, int32_t* host) {
  if (count <= 0) return true;
  const CurrentDevice on_the_tensors_gpu(device);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  // An error here (the legacy stream while another stream captures in global mode) means the
  // stream cannot be synchronised now either: skip, as for a captured stream.
  if (cudaStreamIsCapturing(s, &capture) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  if (capture != cudaStreamCaptureStatusNone) return false;
  // The copy and the wait are allowed on this (uncaptured) stream while another thread
  // captures in global mode only in relaxed mode (what PyTorch's capture guard does too).
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  throw_if_failed(cudaThreadExchangeStreamCaptureMode(&mode), "the capture mode set to relaxed");
  const cudaError_t copied = cudaMemcpyAsync(host, values, static_cast<size_t>(count) * sizeof(int32_t),
                                             cudaMemcpyDeviceToHost, s);
  const cudaError_t waited = copied == cudaSuccess ? cudaStreamSynchronize(s) : copied;
  cudaThreadExchangeStreamCaptureMode(&mode);  // back to the caller's
  throw_if_failed(waited, std::string("a successful copy of ") + name + " to the host");
  return true;
}

namespace {
// One attribute of the current device, read once per device (0 when it cannot be read). The
// cache holds value + 1, so that an attribute whose value is 0 is cached too.
template <cudaDeviceAttr kAttribute>
int32_t current_device_attribute() {
  static std::array<std::atomic<int32_t>, 64> cached{};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0) {
    cudaGetLastError();
    return 0;
  }
  const int32_t known = device < 64 ? cached[size_t(device)].load() : 0;
  if (known > 0) return known - 1;
  int value = 0;
  if (cudaDeviceGetAttribute(&value, kAttribute, device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  if (device < 64) cached[size_t(device)].store(value + 1);
  return value;
}
}  // namespace

int64_t shared_bytes_per_block_limit() {
  // The device attribute once per device (it cannot change); the override on every call, so
  // that a test can set it for one case.
  return knobs::shared_bytes_limit(current_device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>());
}

int32_t multiprocessor_count() { return current_device_attribute<cudaDevAttrMultiProcessorCount>(); }

}  // namespace flashattn::detail::cuda

// Running on the GPU the tensors live on, and what CUDA keeps per GPU.
//
// A process may drive several GPUs, from one thread or one thread each. CUDA keeps a kernel's
// shared-memory opt-in (cudaFuncSetAttribute) per device, and a kernel's occupancy and loaded
// code can differ between GPUs of different generations, so such things are set up or looked
// up once per (kernel, device), never once per process.
#pragma once

#include <cuda_runtime.h>

#include <mutex>
#include <string>

#include "cuda/common/stream_allocation.hpp"  // throw_if_failed

namespace flashattn::detail::cuda {

// Makes `device` the calling thread's current GPU for a scope and restores the previous one
// after: a call runs on the GPU its tensors live on, whichever the caller had current.
class CurrentDevice {
 public:
  explicit CurrentDevice(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      cudaGetLastError();
      previous_ = -1;
    }
    if (previous_ == device) return;
    throw_if_failed(cudaSetDevice(device), "cuda:" + std::to_string(device) + " made current for the call");
    switched_ = true;
  }
  CurrentDevice(const CurrentDevice&) = delete;
  CurrentDevice& operator=(const CurrentDevice&) = delete;
  ~CurrentDevice() {
    if (switched_ && previous_ >= 0 && cudaSetDevice(previous_) != cudaSuccess) cudaGetLastError();
  }

 private:
  int previous_ = -1;
  bool switched_ = false;
};

// Lets `kernel` launch with `bytes` of dynamic shared memory on the current device (needed
// above 48 KiB; CUDA keeps it per device, so call it through a PerDevice). A failure shows up
// as the launch's error.
template <typename Kernel>
void allow_shared_bytes(Kernel kernel, int bytes) {
  if (bytes > 48 * 1024) {
    const cudaError_t status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    (void)status;
  }
}

// A value computed once per device (the current one when asked): declare it static beside the
// kernel it is about. Devices past kMaxDevices compute it on every call.
template <typename T>
class PerDevice {
 public:
  template <typename Compute>
  T get(Compute&& compute) {
    int device = -1;
    if (cudaGetDevice(&device) != cudaSuccess) cudaGetLastError();
    if (device < 0 || device >= kMaxDevices) return compute();
    Slot& slot = slots_[device];
    std::call_once(slot.once, [&] { slot.value = compute(); });
    return slot.value;
  }

 private:
  static constexpr int kMaxDevices = 64;
  struct Slot {
    std::once_flag once;
    T value{};
  };
  Slot slots_[kMaxDevices];
};

}  // namespace flashattn::detail::cuda

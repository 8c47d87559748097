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
    if (previous_ != device)
      throw_if_failed(cudaSetDevice(device), "cuda:" + std::to_string(device) + " made current for the call");
  }
  CurrentDevice(const CurrentDevice&) = delete;
  CurrentDevice& operator=(const CurrentDevice&) = delete;
  ~CurrentDevice() {
    int now = -1;
    if (cudaGetDevice(&now) == cudaSuccess && previous_ >= 0 && now != previous_) cudaSetDevice(previous_);
    cudaGetLastError();
  }

 private:
  int previous_ = -1;
};

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

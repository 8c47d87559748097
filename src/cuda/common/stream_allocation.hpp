// Device memory a CUDA entry point needs for one call, allocated and freed stream-ordered on
// the caller's stream (no device-wide synchronisation), and freed on every path out of the
// call; plus the one way CUDA errors become flashattn::Error.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "flashattn/flashattn.hpp"

namespace flashattn::detail::cuda {

inline void throw_if_failed(cudaError_t status, const std::string& what) {
  if (status != cudaSuccess)
    throw Error(ErrorCode::Backend, "cuda", what,
                std::string(cudaGetErrorName(status)) + ": " + cudaGetErrorString(status));
}

class StreamAllocation {
 public:
  StreamAllocation(size_t bytes, cudaStream_t stream, const char* purpose) : stream_(stream) {
    if (bytes > 0)
      throw_if_failed(cudaMallocAsync(&data_, bytes, stream),
                      "a successful cudaMallocAsync of the " + std::to_string(bytes) + "-byte " +
                          purpose);
  }
  StreamAllocation(const StreamAllocation&) = delete;
  StreamAllocation& operator=(const StreamAllocation&) = delete;
  ~StreamAllocation() {
    if (data_ != nullptr) cudaFreeAsync(data_, stream_);
  }
  void* data() const { return data_; }

 private:
  void* data_ = nullptr;
  cudaStream_t stream_;
};

}  // namespace flashattn::detail::cuda

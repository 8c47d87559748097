// FLASHATTN_CUDA_FORWARD and FLASHATTN_CUDA_BACKWARD keep calls on one kernel family (the
// tests run the CUDA suites on each family with them, the benchmarks compare them). Read on
// every call, before anything runs: a value that names no family is an error naming the
// variable, not a silent default.
#pragma once

#include <cstdlib>
#include <string>
#include <string_view>

#include "flashattn/flashattn.hpp"

namespace flashattn::detail::cuda {

enum class KernelFamily {
  Default,  // the fastest kernel this GPU runs for the call
  Sm80,     // the mma.sync kernels only
  Sm90,     // the wgmma kernels wherever they cover the call, whatever the head dim
};

inline KernelFamily forced_kernel_family(const char* variable, bool sm90_choosable) {
  const char* value = std::getenv(variable);
  if (value == nullptr || *value == '\0') return KernelFamily::Default;
  const std::string_view given(value);
  if (given == "sm80") return KernelFamily::Sm80;
  if (given == "sm90" && sm90_choosable) return KernelFamily::Sm90;
  throw Error(ErrorCode::InvalidArgument, variable, sm90_choosable ? "sm80, sm90 or unset" : "sm80 or unset",
              std::string(given));
}

}  // namespace flashattn::detail::cuda

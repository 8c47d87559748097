// Head dims map to the kernels' buckets: multiples of 32 up to 256, one compiled kernel set
// each (the padding columns are zero-filled inside the kernels). Host side, shared by the
// forward and backward dispatch.
#pragma once

#include <string>
#include <type_traits>

#include "flashattn/flashattn.hpp"

namespace flashattn::detail::cuda {

inline int head_dim_bucket(int head_dim) { return (head_dim + 31) / 32 * 32; }

// Calls f(std::integral_constant<int, bucket>{}) for head_dim's bucket.
template <typename F>
void with_head_dim_bucket(int head_dim, F&& f) {
  switch (head_dim_bucket(head_dim)) {
    case 32: return f(std::integral_constant<int, 32>{});
    case 64: return f(std::integral_constant<int, 64>{});
    case 96: return f(std::integral_constant<int, 96>{});
    case 128: return f(std::integral_constant<int, 128>{});
    case 160: return f(std::integral_constant<int, 160>{});
    case 192: return f(std::integral_constant<int, 192>{});
    case 224: return f(std::integral_constant<int, 224>{});
    case 256: return f(std::integral_constant<int, 256>{});
  }
  throw Error(ErrorCode::Internal, "head_dim",
              "a multiple of 8 in [8, 256] after validation and padding (cuda/head_dim_padding.hpp)",
              std::to_string(head_dim));
}

}  // namespace flashattn::detail::cuda

// CUDA grids' y and z extents are limited to 65535: the kernels may put heads and the batch
// there, so a call that would need more is refused up front, naming what is too large.
#pragma once

#include <cstdint>
#include <string>

#include "flashattn/flashattn.hpp"

namespace flashattn::detail::cuda {

inline constexpr int64_t kMaxGridYZ = 65535;

// `expected` reads as "<expected> on the cuda backend", e.g. "at most 65535 heads".
inline void check_grid_extent(int64_t value, const std::string& expected, const std::string& given) {
  if (value > kMaxGridYZ)
    throw Error(ErrorCode::Unsupported, "q", expected + " on the cuda backend", given);
}

// The attention kernels' grids have the batch in z and the (query or key/value) heads in x or
// y (cuda/common/tile_order.cuh).
inline void check_heads_and_batch(int64_t heads, int64_t batch) {
  check_grid_extent(heads, "at most 65535 heads", "H = " + std::to_string(heads));
  check_grid_extent(batch, "a batch of at most 65535", "B = " + std::to_string(batch));
}

}  // namespace flashattn::detail::cuda

// Tile shapes against the device's shared memory. Each kernel lists its configurations in
// order of preference (the tuned one first, then smaller ones for GPUs with less shared memory
// per block); a call launches the first that fits the current device.
#pragma once

#include <cstdint>
#include <string>

#include "cuda/devices.hpp"
#include "flashattn/flashattn.hpp"

namespace flashattn::detail::cuda {

// Configurations in order of preference; each has a kMaxSharedBytes.
template <typename... Configs>
struct Candidates {};

// Calls launch(Config{}) with the first configuration whose shared memory per block fits the
// current device; when none does, a clear Unsupported error before anything is launched.
template <typename... Configs, typename Launch>
void launch_first_fitting(Candidates<Configs...>, int head_dim, const char* kernel,
                          Launch&& launch) {
  const int64_t limit = shared_bytes_per_block_limit();
  const bool launched =
      ((Configs::kMaxSharedBytes <= limit ? (launch(Configs{}), true) : false) || ...);
  if (launched) return;
  int64_t smallest = INT64_MAX;
  ((smallest = Configs::kMaxSharedBytes < smallest ? Configs::kMaxSharedBytes : smallest), ...);
  throw Error(ErrorCode::Unsupported, "head_dim",
              std::string("a head dim whose ") + kernel + " tiles fit in this GPU's " +
                  std::to_string(limit) + " bytes of shared memory per block",
              std::to_string(head_dim) + " (its smallest " + kernel + " tile needs " +
                  std::to_string(smallest) + " bytes)");
}

}  // namespace flashattn::detail::cuda

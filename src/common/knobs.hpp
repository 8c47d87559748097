// Every FLASHATTN_* environment variable the library reads, with its parsing: the one place
// that calls getenv. The table in docs/ARCHITECTURE.md ("Knobs") lists them with the build
// options. None changes what a call computes; they pick among kernels that compute the same
// thing (for the tests that cover each path, and for timing them against one another).
// Each is read on every call, so that a test can set it for one case.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>

#include "flashattn/flashattn.hpp"

namespace flashattn::detail::knobs {

inline constexpr char kCudaForward[] = "FLASHATTN_CUDA_FORWARD";
inline constexpr char kCudaBackward[] = "FLASHATTN_CUDA_BACKWARD";
inline constexpr char kCudaSmemLimit[] = "FLASHATTN_CUDA_SMEM_LIMIT";
inline constexpr char kSm90ForwardGrid[] = "FLASHATTN_SM90_FORWARD_GRID";
inline constexpr char kSm90ForwardShape[] = "FLASHATTN_SM90_FORWARD_SHAPE";
inline constexpr char kSm90BackwardLoads[] = "FLASHATTN_SM90_BACKWARD_LOADS";
inline constexpr char kCudaDqAtomics[] = "FLASHATTN_CUDA_DQ_ATOMICS";
inline constexpr char kCpuAmx[] = "FLASHATTN_CPU_AMX";
// Read only in tuning builds (-DFLASHATTN_SM80_TUNING=ON).
inline constexpr char kCudaGrid[] = "FLASHATTN_CUDA_GRID";
inline constexpr char kKvCacheConfig[] = "FLASHATTN_KVCACHE_CONFIG";
inline constexpr char kSm80Config[] = "FLASHATTN_SM80_CONFIG";
inline constexpr char kSm80BwdConfig[] = "FLASHATTN_SM80_BWD_CONFIG";

// The variable's value; null when it is not set.
inline const char* value(const char* variable) { return std::getenv(variable); }

enum class KernelFamily {
  Default,  // the fastest kernel this GPU runs for the call
  Sm80,     // the mma.sync kernels only
  Sm90,     // the wgmma kernels wherever they cover the call (the forward's default on Hopper)
};

namespace internal {
inline KernelFamily kernel_family(const char* variable, bool sm90_choosable) {
  const char* set = value(variable);
  if (set == nullptr || *set == '\0') return KernelFamily::Default;
  const std::string_view given(set);
  if (given == "sm80") return KernelFamily::Sm80;
  if (given == "sm90" && sm90_choosable) return KernelFamily::Sm90;
  // A value that names no family is an error naming the variable, not a silent default.
  throw Error(ErrorCode::InvalidArgument, variable, sm90_choosable ? "sm80, sm90 or unset" : "sm80 or unset",
              std::string(given));
}
}  // namespace internal

// FLASHATTN_CUDA_FORWARD=sm80 keeps every forward call on the sm80 kernels (the tests run the
// CUDA suite with it, the benchmarks compare); =sm90 is what Hopper takes by default.
inline KernelFamily forward_family() { return internal::kernel_family(kCudaForward, true); }

// FLASHATTN_CUDA_BACKWARD=sm80 keeps every backward call on the sm80 kernels.
inline KernelFamily backward_family() { return internal::kernel_family(kCudaBackward, false); }

// FLASHATTN_SM90_BACKWARD_LOADS=cp.async keeps the sm90 backward on its cp.async kernel (all
// threads load, no warp specialisation) where the TMA kernel would run (the tests run the CUDA
// backward suite both ways; the benchmarks compare them). =tma or unset: the TMA kernel
// wherever it covers the call.
inline bool sm90_backward_uses_tma() {
  const char* set = value(kSm90BackwardLoads);
  if (set == nullptr || *set == '\0' || std::string_view(set) == "tma") return true;
  if (std::string_view(set) == "cp.async") return false;
  throw Error(ErrorCode::InvalidArgument, kSm90BackwardLoads, "tma, cp.async or unset", std::string(set));
}

// FLASHATTN_SM90_FORWARD_GRID=persistent|per-tile: the grid of the TMA forward under causal
// and windowed masks, where tiles differ in work: one CTA per SM walking its share of the
// tiles, or one CTA per tile started by the hardware as SMs free up. Unset: the default of
// forward_configs.cuh (ws_forward_ctas, chosen by measurement). Calls without those masks
// are persistent either way.
enum class Sm90ForwardGrid { Default, Persistent, PerTile };
inline Sm90ForwardGrid sm90_forward_grid() {
  const char* set = value(kSm90ForwardGrid);
  if (set == nullptr || *set == '\0') return Sm90ForwardGrid::Default;
  if (std::string_view(set) == "persistent") return Sm90ForwardGrid::Persistent;
  if (std::string_view(set) == "per-tile") return Sm90ForwardGrid::PerTile;
  throw Error(ErrorCode::InvalidArgument, kSm90ForwardGrid, "persistent, per-tile or unset", std::string(set));
}

// FLASHATTN_SM90_FORWARD_SHAPE=128x128|192x128: the TMA forward's tile (query rows x keys per
// block) at head dim 64 for plain calls: two consumer warpgroups or three (the tests run the
// suite on each). Unset: the choice of forward_configs.cuh (launch_tuned_forward_ws).
enum class Sm90ForwardShape { Rows128Keys128, Rows192Keys128 };
inline std::optional<Sm90ForwardShape> sm90_forward_shape() {
  const char* set = value(kSm90ForwardShape);
  if (set == nullptr || *set == '\0') return std::nullopt;
  const std::string_view chosen(set);
  if (chosen == "128x128") return Sm90ForwardShape::Rows128Keys128;
  if (chosen == "192x128") return Sm90ForwardShape::Rows192Keys128;
  throw Error(ErrorCode::InvalidArgument, kSm90ForwardShape, "128x128, 192x128 or unset", std::string(set));
}

// FLASHATTN_CUDA_SMEM_LIMIT=<bytes> lowers the shared memory per block that the launchers
// take the device to have (never raises it): the tests reach the smaller-tile fallbacks with
// it. Values that are not a positive number of bytes below the device's limit are ignored.
inline int64_t shared_bytes_limit(int64_t device_limit) {
  if (const char* forced = value(kCudaSmemLimit)) {
    const long long bytes = std::atoll(forced);
    if (bytes > 0 && bytes < device_limit) return bytes;
  }
  return device_limit;
}

// FLASHATTN_CUDA_DQ_ATOMICS=1 keeps the sm80 backward's dQ on atomics where bulk reductions
// would run (sm_90 and newer), so that an sm_90 test run covers the path older GPUs take.
inline bool dq_atomics_forced() {
  const char* forced = value(kCudaDqAtomics);
  return forced != nullptr && std::strcmp(forced, "1") == 0;
}


// FLASHATTN_CPU_AMX=0 keeps the CPU engine's bf16 matrix products in fp32 on processors with
// AMX tiles or AVX512-BF16 (cpu/amx.hpp), which they take otherwise (=1 or unset): the tests
// run the CPU suites both ways, the benchmarks compare.
inline bool cpu_amx_allowed() {
  const char* set = value(kCpuAmx);
  if (set == nullptr || *set == '\0' || std::strcmp(set, "1") == 0) return true;
  if (std::strcmp(set, "0") == 0) return false;
  throw Error(ErrorCode::InvalidArgument, kCpuAmx, "0, 1 or unset", std::string(set));
}

// Tuning builds only. FLASHATTN_CUDA_GRID forces the grid layout of the forward and backward
// kernels (cuda/common/tile_order.cuh), for A/B timing: "heads" puts the heads on the grid's
// fastest axis (the layout causal and windowed calls get), any other value the sequence
// blocks (the layout of unmasked calls). Unset: the layout follows the mask.
inline std::optional<bool> forced_heads_first() {
  const char* forced = value(kCudaGrid);
  if (forced == nullptr) return std::nullopt;
  return std::strcmp(forced, "heads") == 0;
}

// Tuning builds only: the candidate tile shape named by FLASHATTN_SM80_CONFIG,
// FLASHATTN_SM80_BWD_CONFIG or FLASHATTN_KVCACHE_CONFIG (the kernels' tuning files list
// the names); null when unset. A set name that matches no candidate is an error there.
inline const char* tuning_candidate(const char* variable) { return value(variable); }

}  // namespace flashattn::detail::knobs

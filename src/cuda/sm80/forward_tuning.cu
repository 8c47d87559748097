// Tuning builds only (-DFLASHATTN_SM80_TUNING=ON): extra tile configurations of the sm80
// forward kernel, selected at run time by FLASHATTN_SM80_CONFIG="headdim,keys,warps,mtiles,qregs"
// (for example "128,64,8,1,1"; with ",128" or ",256" appended, an L2 prefetch hint of that
// many bytes on the K and V loads; with ",s1" appended, one K/V buffer each instead of two),
// so that one GPU session can time several candidates on the whole benchmark grid. A
// candidate serves every call, so it is meaningful for head dims up to its own: one built for
// 256 runs (and so can be tested on) every head dim. Release builds never compile or consult this.
#include <cstdio>
#include <cstring>

#include "common/knobs.hpp"
#include "cuda/common/fit.cuh"
#include "cuda/sm80/forward_kernel.cuh"

namespace flashattn::detail::cuda::sm80 {
namespace {

// The name: "D,N,W,M,Q", then ",P" for an L2 prefetch hint of P bytes on K and V, then ",s1"
// for single-buffered K and V.
template <int D, int N, int W, int M, bool Q, int P = 0, int S = 2>
bool try_candidate(const char* wanted, const ForwardParams& p) {
  char name[64];
  std::snprintf(name, sizeof name, "%d,%d,%d,%d,%d", D, N, W, M, Q ? 1 : 0);
  if (P != 0) std::snprintf(name + std::strlen(name), sizeof name - std::strlen(name), ",%d", P);
  if (S != 2) std::snprintf(name + std::strlen(name), sizeof name - std::strlen(name), ",s%d", S);
  if (std::strcmp(name, wanted) != 0) return false;
  // Through the release's fit check (as the backward's candidates).
  const auto launch = [&](auto config) { launch_forward<decltype(config)>(p); };
  if (p.dtype == DType::Float16)
    launch_first_fitting(Candidates<ForwardConfig<__half, D, N, W, M, Q, P, S>>{}, p.head_dim, "forward", launch);
  else
    launch_first_fitting(Candidates<ForwardConfig<__nv_bfloat16, D, N, W, M, Q, P, S>>{}, p.head_dim, "forward",
                         launch);
  return true;
}

}  // namespace

bool run_tuning_candidate(const ForwardParams& p) {
  const char* wanted = knobs::tuning_candidate(knobs::kSm80Config);
  if (wanted == nullptr) return false;
  if (try_candidate<256, 64, 4, 1, false, 0, 1>(wanted, p) ||
      try_candidate<256, 32, 4, 1, false, 0, 1>(wanted, p) ||
      try_candidate<128, 64, 4, 2, false, 0, 1>(wanted, p) ||
      try_candidate<64, 128, 4, 2, false, 128>(wanted, p) ||
      try_candidate<64, 128, 4, 2, false, 256>(wanted, p) ||
      try_candidate<128, 64, 4, 2, false, 128>(wanted, p) ||
      try_candidate<128, 64, 4, 2, false, 256>(wanted, p) ||
      try_candidate<64, 128, 4, 2, true>(wanted, p) ||
      try_candidate<64, 128, 4, 2, false>(wanted, p) ||
      try_candidate<64, 96, 4, 2, true>(wanted, p) ||
      try_candidate<128, 128, 4, 2, false>(wanted, p) ||
      try_candidate<128, 96, 4, 2, false>(wanted, p) ||
      try_candidate<128, 64, 4, 2, true>(wanted, p) ||
      try_candidate<128, 64, 4, 2, false>(wanted, p) ||
      try_candidate<256, 32, 4, 1, false>(wanted, p) ||
      try_candidate<256, 32, 8, 1, false>(wanted, p) ||
      try_candidate<256, 64, 4, 1, false>(wanted, p) ||
      try_candidate<192, 32, 4, 1, false>(wanted, p) ||
      try_candidate<256, 64, 8, 1, false>(wanted, p) ||
      try_candidate<256, 64, 8, 1, true>(wanted, p) ||
      try_candidate<256, 32, 8, 1, true>(wanted, p) ||
      try_candidate<192, 64, 8, 1, true>(wanted, p))
    return true;
  // A name that matches nothing must not time the release shape under its label.
  throw Error(ErrorCode::InvalidArgument, knobs::kSm80Config, "a candidate listed in src/cuda/sm80/forward_tuning.cu",
              wanted);
}

}  // namespace flashattn::detail::cuda::sm80

// Tuning builds only (-DFLASHATTN_SM80_TUNING=ON): extra tile configurations of the sm80
// forward kernel, selected at run time by FLASHATTN_SM80_CONFIG="headdim,keys,warps,mtiles,qregs"
// (for example "128,64,8,1,1"; with ",128" or ",256" appended, an L2 prefetch hint of that
// many bytes on the K and V loads), so that one GPU session can time several candidates on the
// whole benchmark grid. Release builds never compile or consult this.
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "cuda/sm80/forward_kernel.cuh"

namespace flashattn::detail::cuda::sm80 {
namespace {

// The name: "D,N,W,M,Q", and ",P" after it for an L2 prefetch hint of P bytes on K and V.
template <int D, int N, int W, int M, bool Q, int P = 0>
bool try_candidate(const char* wanted, const ForwardParams& p) {
  char name[64];
  std::snprintf(name, sizeof name, "%d,%d,%d,%d,%d", D, N, W, M, Q ? 1 : 0);
  if (P != 0) std::snprintf(name + std::strlen(name), sizeof name - std::strlen(name), ",%d", P);
  if (std::strcmp(name, wanted) != 0) return false;
  if (p.dtype == DType::Float16)
    launch_forward<ForwardConfig<__half, D, N, W, M, Q, P>>(p);
  else
    launch_forward<ForwardConfig<__nv_bfloat16, D, N, W, M, Q, P>>(p);
  return true;
}

}  // namespace

bool run_tuning_candidate(const ForwardParams& p) {
  const char* wanted = std::getenv("FLASHATTN_SM80_CONFIG");
  if (wanted == nullptr) return false;
  return try_candidate<64, 128, 4, 2, false, 128>(wanted, p) ||
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
         try_candidate<256, 64, 8, 1, true>(wanted, p) ||
         try_candidate<256, 32, 8, 1, true>(wanted, p) ||
         try_candidate<192, 64, 8, 1, true>(wanted, p);
}

}  // namespace flashattn::detail::cuda::sm80

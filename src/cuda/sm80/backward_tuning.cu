// Tuning builds only (-DFLASHATTN_SM80_TUNING=ON): extra tile configurations of the sm80
// backward kernels, selected at run time by FLASHATTN_SM80_BWD_CONFIG="headdim,rows,keys,warps"
// (for example "64,128,128,8": 128 query rows per step, 128 keys per CTA, 8 warps), so that
// one GPU session can test and time candidates against the release shapes. Release builds
// never compile or consult this.
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "cuda/common/buckets.hpp"
#include "cuda/sm80/backward_kernel.cuh"

namespace flashattn::detail::cuda::sm80 {
namespace {

template <int D, int M, int N, int W>
bool try_candidate(const char* wanted, const BackwardKernelParams& kp) {
  char name[64];
  std::snprintf(name, sizeof name, "%d,%d,%d,%d", D, M, N, W);
  // Calls of other head-dim buckets take the release shapes, so that a whole test suite can
  // run with the variable set and check the candidate on its own head dims.
  if (std::strcmp(name, wanted) != 0 || head_dim_bucket(kp.bp.fwd.head_dim) != D) return false;
  if (kp.bp.fwd.dtype == DType::Float16)
    launch_backward<BackwardConfig<__half, D, M, N, W>>(kp);
  else
    launch_backward<BackwardConfig<__nv_bfloat16, D, M, N, W>>(kp);
  return true;
}

}  // namespace

bool run_backward_tuning_candidate(const BackwardKernelParams& kp) {
  const char* wanted = std::getenv("FLASHATTN_SM80_BWD_CONFIG");
  if (wanted == nullptr) return false;
  // FA2's hdim-64 shape (128 query rows per step) against the release 64-row steps.
  if (try_candidate<64, 128, 128, 8>(wanted, kp)) return true;
  // A name that matches nothing must not time the release shape under its label.
  throw Error(ErrorCode::InvalidArgument, "FLASHATTN_SM80_BWD_CONFIG", "64,128,128,8", wanted);
}

}  // namespace flashattn::detail::cuda::sm80

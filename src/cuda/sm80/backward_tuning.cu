// Tuning builds only (-DFLASHATTN_SM80_TUNING=ON): extra tile configurations of the sm80
// backward kernels, selected at run time by FLASHATTN_SM80_BWD_CONFIG="headdim,rows,keys,warps"
// (for example "64,64,128,8": 64 query rows per step, 128 keys per CTA, 8 warps), so that
// one GPU session can test and time candidates against the release shapes. Release builds
// never compile or consult this.
#include <cstdio>
#include <cstring>

#include "common/knobs.hpp"
#include "cuda/common/buckets.hpp"
#include "cuda/common/fit.cuh"
#include "cuda/sm80/backward_kernel.cuh"

namespace flashattn::detail::cuda::sm80 {
namespace {

// Whether `wanted` names this candidate; if so, and the call is of its head-dim bucket, it
// is launched (`launched`). Calls of other buckets take the release shapes, so that a whole
// test suite can run with the variable set and check the candidate on its own head dims.
template <int D, int M, int N, int W>
bool try_candidate(const char* wanted, const BackwardKernelParams& kp, bool& launched) {
  char name[64];
  std::snprintf(name, sizeof name, "%d,%d,%d,%d", D, M, N, W);
  if (std::strcmp(name, wanted) != 0) return false;
  if (head_dim_bucket(kp.bp.fwd.head_dim) != D) return true;
  // Through the release's fit check, so that a forced candidate too fails with a clear error
  // where it needs more shared memory than the device (or FLASHATTN_CUDA_SMEM_LIMIT) allows.
  const auto launch = [&](auto config) { launch_backward<decltype(config)>(kp); };
  if (kp.bp.fwd.dtype == DType::Float16)
    launch_first_fitting(Candidates<BackwardConfig<__half, D, M, N, W>>{}, kp.bp.fwd.head_dim, "backward", launch);
  else
    launch_first_fitting(Candidates<BackwardConfig<__nv_bfloat16, D, M, N, W>>{}, kp.bp.fwd.head_dim, "backward",
                         launch);
  launched = true;
  return true;
}

}  // namespace

bool run_backward_tuning_candidate(const BackwardKernelParams& kp) {
  const char* wanted = knobs::tuning_candidate(knobs::kSm80BwdConfig);
  if (wanted == nullptr) return false;
  bool launched = false;
  // The hdim-64 shape before FA2's (64 query rows per step), for comparisons with the release.
  if (try_candidate<64, 64, 128, 8>(wanted, kp, launched)) return launched;
  // A name that matches nothing must not time the release shape under its label.
  throw Error(ErrorCode::InvalidArgument, knobs::kSm80BwdConfig, "64,64,128,8", wanted);
}

}  // namespace flashattn::detail::cuda::sm80

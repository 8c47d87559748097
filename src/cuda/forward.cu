// Chooses the forward kernel for a validated call: the sm80 (mma.sync) kernel instantiated for
// the call's dtype and head-dim bucket (head dims rounded up to a multiple of 32).
#include <cuda_runtime.h>

#include <string>

#include "cuda/common/buckets.hpp"
#include "cuda/common/grid.hpp"
#include "cuda/common/per_device.hpp"
#include "cuda/forward.hpp"
#include "cuda/sm80/forward_configs.cuh"

namespace flashattn::detail::cuda {
#ifdef FLASHATTN_SM80_TUNING
namespace sm80 {
bool run_tuning_candidate(const ForwardParams& params);  // forward_tuning.cu
}
#endif
namespace {

template <typename Element>
void run_bucket(const ForwardParams& p) {
  with_head_dim_bucket(p.head_dim, [&](auto bucket) {
    sm80::run_forward<Element, decltype(bucket)::value>(p);
  });
}

}  // namespace

size_t forward(const ForwardParams& p) {
  check_heads_and_batch(p.heads, p.batch);  // the grid holds H and B (cuda/common/tile_order.cuh)
  if (p.batch == 0 || p.seqlen_q == 0) return 0;
  const CurrentDevice on_the_tensors_gpu(p.device);
#ifdef FLASHATTN_SM80_TUNING
  if (!sm80::run_tuning_candidate(p))
#endif
  {
    if (p.dtype == DType::Float16)
      run_bucket<__half>(p);
    else
      run_bucket<__nv_bfloat16>(p);
  }
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess)
    throw Error(ErrorCode::Backend, "cuda", "a successful kernel launch",
                std::string(cudaGetErrorName(status)) + ": " + cudaGetErrorString(status));
  return 0;
}

}  // namespace flashattn::detail::cuda

// The KV-cache forward on CUDA (host side): the dispatch to the (dtype, head-dim bucket)
// instantiations (sm80/kvcache_configs.cuh, one generated file each) and, in tuning builds,
// the candidate shapes that FLASHATTN_KVCACHE_CONFIG selects.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "common/knobs.hpp"
#include "cuda/common/buckets.hpp"
#include "cuda/common/grid.hpp"
#include "cuda/common/per_device.hpp"
#include "cuda/head_dim_padding.hpp"
#include "cuda/kvcache.hpp"
#include "cuda/sm80/kvcache_configs.cuh"

namespace flashattn::detail::cuda {
namespace {

#ifdef FLASHATTN_SM80_TUNING
using sm80::KvCacheConfig;

// Tuning builds only: FLASHATTN_KVCACHE_CONFIG="warps,stages,L2 prefetch bytes[,variant]"
// replaces the head-dim-128 shape, so that one GPU session can time several against the
// decode benchmark. Variant: pad16 (rows padded by 16 bytes, TileLayout); without one,
// the release's layout (the swizzle at head dim 128). The release: 4,2,0 from a dense
// cache, 4,3,0 from a paged one (TunedKvCache).
template <typename Element, int kWarps, int kStages, int kL2Prefetch,
          TileLayout kLayout = sm80::kReleaseKvLayout<128, Element>>
bool try_tuning_candidate(const char* wanted, const char* variant, const KvCacheParams& kv,
                          KvCacheRun& result) {
  char name[48];
  std::snprintf(name, sizeof name, "%d,%d,%d%s%s", kWarps, kStages, kL2Prefetch, *variant ? "," : "", variant);
  if (std::strcmp(name, wanted) != 0) return false;
  // Through the release's fit check, as the release shapes (a clear error where it does not fit).
  launch_first_fitting(Candidates<KvCacheConfig<Element, 128, kWarps, kStages, kL2Prefetch, kLayout>>{},
                       kv.attn.head_dim, "kv-cache",
                       [&](auto config) { result = sm80::launch_kvcache<decltype(config)>(kv); });
  return true;
}

template <typename Element>
bool run_tuning_candidate(const KvCacheParams& kv, KvCacheRun& result) {
  const char* wanted = knobs::tuning_candidate(knobs::kKvCacheConfig);
  if (wanted == nullptr || head_dim_bucket(kv.attn.head_dim) != 128) return false;
  if (try_tuning_candidate<Element, 4, 3, 128>(wanted, "", kv, result) ||
      try_tuning_candidate<Element, 4, 3, 256>(wanted, "", kv, result) ||
      try_tuning_candidate<Element, 4, 2, 0>(wanted, "", kv, result) ||
      try_tuning_candidate<Element, 2, 3, 0>(wanted, "", kv, result) ||
      try_tuning_candidate<Element, 2, 4, 0>(wanted, "", kv, result) ||
      try_tuning_candidate<Element, 8, 3, 0>(wanted, "", kv, result) ||
      try_tuning_candidate<Element, 4, 3, 256, TileLayout::Pad16>(wanted, "pad16", kv, result))
    return true;
  // A name that matches nothing must not time the release shape under its label.
  throw Error(ErrorCode::InvalidArgument, knobs::kKvCacheConfig,
              "one of 4,3,128 4,3,256 4,2,0 2,3,0 2,4,0 8,3,0 4,3,256,pad16",
              wanted);
}
#endif

template <typename Element>
KvCacheRun run_dtype(const KvCacheParams& kv) {
  KvCacheRun result;
#ifdef FLASHATTN_SM80_TUNING
  if (run_tuning_candidate<Element>(kv, result)) return result;
#endif
  with_head_dim_bucket(kv.attn.head_dim, [&](auto bucket) {
    result = sm80::run_kvcache<Element, decltype(bucket)::value>(kv);
  });
  return result;
}

// fp8 e4m3 caches: head dims that are multiples of 16 (validated), so never padded, in
// buckets 64, 128 and 256 (sm80_kvcache_fp8).
template <typename Element>
KvCacheRun run_fp8_caches(const KvCacheParams& kv) {
  const int d = kv.attn.head_dim;
  if (d <= 64) return sm80::run_kvcache_fp8<Element, 64>(kv);
  if (d <= 128) return sm80::run_kvcache_fp8<Element, 128>(kv);
  return sm80::run_kvcache_fp8<Element, 256>(kv);
}

}  // namespace

KvCacheRun forward_kvcache(const KvCacheParams& kv) {
  const ForwardParams& p = kv.attn;
  check_grid_extent(p.batch, "a batch of at most 65535", "B = " + std::to_string(p.batch));
  if (p.batch == 0) return {};
  const CurrentDevice on_the_tensors_gpu(p.device);
  if (kv.cache_dtype == DType::Float8E4M3)
    return p.dtype == DType::Float16 ? run_fp8_caches<__half>(kv) : run_fp8_caches<__nv_bfloat16>(kv);
  return run_with_padded_head_dim(kv, [](const KvCacheParams& padded) {
    return padded.attn.dtype == DType::Float16 ? run_dtype<__half>(padded)
                                               : run_dtype<__nv_bfloat16>(padded);
  });
}

}  // namespace flashattn::detail::cuda

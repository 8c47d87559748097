// Tile shapes of the sm80 kv-cache kernel per head-dim bucket, with the reasons, and the host
// side of one configuration: the number of key splits, the partial-result workspace and the
// two launches (the split kernel and the combine). Each (dtype, bucket) instantiates it in
// its own generated file (src/CMakeLists.txt), so the kernels compile in parallel.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/kvcache.hpp"
#include "cuda/common/fit.cuh"
#include "cuda/common/grid.hpp"
#include "cuda/common/kernel_code.cuh"
#include "cuda/common/per_device.hpp"
#include "cuda/common/stream_allocation.hpp"
#include "cuda/devices.hpp"
#include "cuda/sm80/kvcache_kernel.cuh"

namespace flashattn::detail::cuda::sm80 {

// KvCacheConfig<Element, head dim, warps, stages, L2 prefetch bytes>: 4 warps take 64 keys
// per block. Shared memory per CTA (swizzled tiles): 66.25 KiB at 64 (4 stages), 68.25 KiB at
// 128 from a dense cache (2 stages), 100.25 KiB at 128 from a paged one (3 stages), 136.25 KiB
// at 256 (2 stages); registers hold the head-dim-128 kernel to two CTAs per SM on the H200.
// Then smaller shapes for GPUs with less shared memory per block (fit.cuh).
// Stages at head dims 65-128, measured on the H200 (2026-12-01, two rounds, decode shapes):
// from a dense cache 2 stages are 0.4-2.5 % ahead of 3; from a paged cache (one block-table
// lookup per block) 3 are 0.5-2.5 % ahead of 2.
// The copies carry no L2 prefetch hint: with the swizzled tiles, asking L2 for the aligned
// 256 bytes around each miss cost 1-7 % at every decode shape (head dim 128: 4.30 against
// 4.06 TB/s at 8 x 32k; a 128-byte hint was level with none).
template <typename E, int kHeadDim>
struct TunedKvCache {
  static constexpr int kL2Prefetch = 0;
  template <int kStages>
  using ConfigsFrom = Candidates<KvCacheConfig<E, kHeadDim, 4, kStages, kL2Prefetch>,
                                 KvCacheConfig<E, kHeadDim, 4, 2, kL2Prefetch>,
                                 KvCacheConfig<E, kHeadDim, 2, 2, kL2Prefetch>>;
  using DenseConfigs = ConfigsFrom<(kHeadDim <= 64 ? 4 : 2)>;
  using PagedConfigs = ConfigsFrom<(kHeadDim <= 64 ? 4 : kHeadDim <= 128 ? 3 : 2)>;
};

// fp8 e4m3 caches (head dims that are multiples of 16, in buckets 64, 128 and 256): twice the
// 16-bit shape's stages, the same bytes in flight (a tile is half the size). Not yet timed.
template <typename E, int kHeadDim>
struct TunedFp8KvCache {
  static constexpr TileLayout kLayout = kReleaseKvLayout<kHeadDim, __nv_fp8_e4m3>;
  template <int kWarps, int kStages>
  using Config = KvCacheConfig<E, kHeadDim, kWarps, kStages, 0, kLayout, __nv_fp8_e4m3>;
  template <int kStages>
  using ConfigsFrom = Candidates<Config<4, kStages>, Config<4, 2>, Config<2, 2>>;
  using DenseConfigs = ConfigsFrom<(kHeadDim <= 64 ? 8 : 4)>;
  using PagedConfigs = ConfigsFrom<(kHeadDim <= 64 ? 8 : kHeadDim <= 128 ? 6 : 4)>;
};

// Splits for num_splits = 0: as many as fit in one wave of CTAs over the SMs (rounded down:
// a second, partial wave would double the time of the last CTAs), each split keeping at
// least four key blocks of the largest sequence the cache can hold (fewer blocks per split
// would spend more on the combine than the extra parallelism gives back).
inline int choose_splits(int64_t ctas, int64_t ctas_per_wave, int64_t capacity_blocks) {
  if (ctas <= 0 || ctas_per_wave <= 0 || ctas * 5 >= ctas_per_wave * 4) return 1;
  int64_t splits = std::max<int64_t>(1, ctas_per_wave / ctas);
  splits = std::min<int64_t>(splits, std::max<int64_t>(1, capacity_blocks / 4));
  return static_cast<int>(std::min<int64_t>(splits, 128));
}

// CTAs of `kernel` (one variant of config Cfg) that fit on one SM of the current device.
template <typename Cfg, typename Kernel>
int resident_ctas(Kernel kernel) {
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, Cfg::kThreads, Cfg::kSharedBytes) !=
      cudaSuccess) {
    cudaGetLastError();
    n = 1;
  }
  return std::max(n, 1);
}

template <typename Cfg>
KvCacheRun launch_kvcache(const KvCacheParams& kv) {
  const ForwardParams& p = kv.attn;
  const cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  static PerDevice<bool> shared_bytes_allowed;  // once per kernel and device
  shared_bytes_allowed.get([] {
    allow_shared_bytes(kvcache_kernel<Cfg, false>, Cfg::kSharedBytes);
    allow_shared_bytes(kvcache_kernel<Cfg, true>, Cfg::kSharedBytes);
    return true;
  });
  // The plain variant when the call has no append, rotary, ALiBi or softcap (kvcache_kernel).
  const bool general = kv.k_new != nullptr || kv.rotary_cos != nullptr ||
                       p.alibi_slopes != nullptr || p.softcap > 0.0f;
  const auto kernel = general ? kvcache_kernel<Cfg, true> : kvcache_kernel<Cfg, false>;
  KvCacheKernelParams kp;
  kp.kv = kv;
  static PerDevice<const void*> nan_keys;
  kp.nan_keys = nan_keys.get([] {
    void* address = nullptr;
    throw_if_failed(cudaGetSymbolAddress(&address, nan_key_chunk), "the address of the NaN key chunk");
    return static_cast<const void*>(address);
  });
  const int64_t rows = p.seqlen_q * p.group_size();
  kp.row_blocks = static_cast<int32_t>(std::max<int64_t>(1, (rows + Cfg::kBlockM - 1) / Cfg::kBlockM));
  check_grid_extent(int64_t{p.heads_k} * kp.row_blocks,
                    "at most 65535 (kv heads x blocks of 16 packed query rows)",
                    std::to_string(int64_t{p.heads_k} * kp.row_blocks));
  kp.num_splits = kv.num_splits;
  if (kp.num_splits == 0) {
    // Per variant: the plain one may need fewer registers and so fit more CTAs per SM.
    static PerDevice<int> plain_ctas_per_sm, general_ctas_per_sm;
    const int ctas_per_sm =
        general ? general_ctas_per_sm.get([] { return resident_ctas<Cfg>(kvcache_kernel<Cfg, true>); })
                : plain_ctas_per_sm.get([] { return resident_ctas<Cfg>(kvcache_kernel<Cfg, false>); });
    const int64_t ctas = int64_t{p.batch} * p.heads_k * kp.row_blocks;
    kp.num_splits = choose_splits(ctas, int64_t{multiprocessor_count()} * ctas_per_sm,
                                  (p.seqlen_k + Cfg::kBlockN - 1) / Cfg::kBlockN);
  }
  // An explicit count is honoured as given (splits past the last key block only merge an
  // empty partial: out 0 with weight 0).

  const int64_t out_rows = int64_t{p.batch} * p.heads * p.seqlen_q;
  const size_t partial_bytes =
      kp.num_splits > 1 ? static_cast<size_t>(kp.num_splits) * out_rows * (p.head_dim + 1) * sizeof(float)
                        : 0;
  StreamAllocation workspace(partial_bytes, stream, "kv-cache split workspace");
  if (partial_bytes > 0) {
    kp.partial_out = static_cast<float*>(workspace.data());
    kp.partial_lse = kp.partial_out + static_cast<int64_t>(kp.num_splits) * out_rows * p.head_dim;
  }
  const dim3 grid(static_cast<unsigned>(kp.num_splits),
                  static_cast<unsigned>(int64_t{p.heads_k} * kp.row_blocks),
                  static_cast<unsigned>(p.batch));
  kernel<<<grid, Cfg::kThreads, Cfg::kSharedBytes, stream>>>(kp);
  throw_if_failed(cudaGetLastError(), "a successful kv-cache kernel launch");
  if (kp.num_splits > 1 && out_rows > 0) {
    // On sm_90 the combine is a programmatic dependent launch: its launch overlaps the split
    // kernel's tail instead of following its end (a few microseconds of a decoding step that
    // takes tens). Only where the combine's loaded code waits for the split kernel
    // (griddepcontrol.wait, compiled for sm_90 and newer; kernel_code.cuh).
    static PerDevice<bool> combine_waits_on;
    const bool combine_waits = combine_waits_on.get(
        [] { return kernel_ptx_version(kvcache_combine_kernel<typename Cfg::Element>) >= 90; });
    cudaLaunchConfig_t combine = {};
    combine.gridDim = dim3(static_cast<unsigned>(out_rows));
    combine.blockDim = dim3(32 * kCombineWarps);
    combine.stream = stream;
    cudaLaunchAttribute overlap[1];
    overlap[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    overlap[0].val.programmaticStreamSerializationAllowed = 1;
    combine.attrs = overlap;
    combine.numAttrs = combine_waits ? 1 : 0;
    throw_if_failed(cudaLaunchKernelEx(&combine, kvcache_combine_kernel<typename Cfg::Element>, kp),
                    "a successful kv-cache combine launch");
  }
  return KvCacheRun{partial_bytes, kp.num_splits};
}

// Defined once per (dtype, bucket) in its own generated file: the first of TunedKvCache's
// shapes that fits the device, launched.
template <typename Element, int kHeadDim>
KvCacheRun run_kvcache(const KvCacheParams& params);

// The same for fp8 e4m3 caches under a q of dtype Element (TunedFp8KvCache).
template <typename Element, int kHeadDim>
KvCacheRun run_kvcache_fp8(const KvCacheParams& params);

}  // namespace flashattn::detail::cuda::sm80

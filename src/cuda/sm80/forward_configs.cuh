// Tile shapes of the sm80 forward kernel per head-dim bucket, with the reason for each
// (registers and spills from `nvcc -Xptxas -v`; speed in docs/PERFORMANCE.md).
#pragma once

#include "cuda/common/fit.cuh"
#include "cuda/sm80/forward_kernel.cuh"

namespace flashattn::detail::cuda::sm80 {

template <typename Element, int kHeadDim>
struct TunedForward;

// ForwardConfig<Element, head dim, keys per step, warps, m16 tiles per warp, Q in registers>.
// Candidates: the tuned shape first (measured on the H200: 227 KiB of shared memory per
// block), then, where it needs more than an A100 (163 KiB) or an sm_86/sm_89 GPU (99 KiB)
// allows, the shape with the next smaller key step or row block that fits there: 32-key steps
// (measured on the H200 at 8-20 % below 64-key ones) and, last, 64-row CTAs of 4 warps.
// Two m-tiles per warp wherever registers allow: each K and V fragment read from shared
// memory then feeds two MMAs, halving shared-memory traffic per FLOP (with one m-tile the
// loads alone take as long as the MMAs). 4 warps x 32 rows = 128-row CTAs.
// Up to 64: O is <= 64 registers. Measured on the H200 (`scripts/gpu.sh tune`, hdim 64):
// 128-key steps with Q re-read from shared memory beat 64-key steps with Q in registers by
// 2-6 % (fewer syncs and rescales); with Q in registers as well they spill and lose 8-10 %.
template <typename E> struct TunedForward<E, 32> {
  using Configs = Candidates<ForwardConfig<E, 32, 128, 4, 2, false>>;
};
template <typename E> struct TunedForward<E, 64> {
  using Configs = Candidates<ForwardConfig<E, 64, 128, 4, 2, false>>;
};
// 96..128: O is up to 128 registers, so Q is re-read per k-step. 64-key steps: ptxas reports
// a ~60-byte spill there (against ~16 bytes with 32-key steps), but measured on the H200
// (`scripts/gpu.sh tune`, hdim 128) 64-key steps are 8-10 % faster: half the syncs and O
// rescales outweigh the spill traffic, which stays in L1.
template <typename E> struct TunedForward<E, 96> {
  using Configs = Candidates<ForwardConfig<E, 96, 64, 4, 2, false>>;
};
template <typename E> struct TunedForward<E, 128> {
  using Configs = Candidates<ForwardConfig<E, 128, 64, 4, 2, false>, ForwardConfig<E, 128, 32, 4, 2, false>>;
};
// 160..224: O alone would exceed the register file with two m-tiles, so one m-tile per warp
// and 8 warps keep the 128-row CTA (K/V read from L2 once per 128 query rows). 64-key steps
// halve the syncs and O rescales of 32-key steps.
// 256: FA2's H100 shape and schedule: 64-row CTAs of 4 warps, 64-key steps, one K and one V
// buffer (V(n) loads during Q K(n)^T, K(n+1) during the softmax and P V(n)): 99 KiB of
// shared memory, so two CTAs share an SM and one's softmax overlaps the other's MMAs.
// Measured on the H200 (2026-11-30, a tuning build) against the 128-row shape with
// double-buffered K/V (one CTA of 8 warps per SM): +4 to +12 % non-causal, +8 to +12 %
// causal up to 4k, -6 % causal at 16k; with the heads-first grid (tile_order.cuh) it is
// ahead of the old shape's table at every point, 16k causal included (docs/PERFORMANCE.md).
// No spill (ptxas, sm_90a).
template <typename E> struct TunedForward<E, 160> {
  using Configs = Candidates<ForwardConfig<E, 160, 64, 8, 1, false>, ForwardConfig<E, 160, 32, 8, 1, false>>;
};
template <typename E> struct TunedForward<E, 192> {
  using Configs = Candidates<ForwardConfig<E, 192, 64, 8, 1, false>, ForwardConfig<E, 192, 32, 4, 1, false>>;
};
template <typename E> struct TunedForward<E, 224> {
  using Configs = Candidates<ForwardConfig<E, 224, 64, 8, 1, false>, ForwardConfig<E, 224, 32, 8, 1, false>,
                                         ForwardConfig<E, 224, 32, 4, 1, false>>;
};
template <typename E> struct TunedForward<E, 256> {
  using Configs = Candidates<ForwardConfig<E, 256, 64, 4, 1, false, 0, 1>, ForwardConfig<E, 256, 32, 8, 1, false>,
                                         ForwardConfig<E, 256, 32, 4, 1, false>>;
};

template <typename... Configs>
Candidates<PagedForwardConfig<Configs>...> paged_candidates(Candidates<Configs...>) {
  return {};
}

// The first tuned shape that fits the device (its paged variant for paged keys and values,
// whose page tables can make a smaller shape the first that fits): the body of every
// generated instantiation.
template <typename Element, int kHeadDim, bool kPaged>
void launch_tuned_forward(const ForwardParams& params) {
  using Configs = typename TunedForward<Element, kHeadDim>::Configs;
  const auto launch = [&](auto config) { launch_forward<decltype(config)>(params); };
  if constexpr (kPaged)
    launch_first_fitting(paged_candidates(Configs{}), params.head_dim, "forward", launch);
  else
    launch_first_fitting(Configs{}, params.head_dim, "forward", launch);
}

// Defined once per (dtype, bucket, paged) in its own generated file, so the kernels compile in
// parallel (src/cuda/instantiate/sm80_forward.cu.in, sm80_forward_paged.cu.in).
template <typename Element, int kHeadDim, bool kPaged>
void run_forward(const ForwardParams& params);

}  // namespace flashattn::detail::cuda::sm80

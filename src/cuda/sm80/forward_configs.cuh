// Tile shapes of the sm80 forward kernel per head-dim bucket, with the reason for each.
// (Retuned by measurement on the H200; see docs/PERFORMANCE.md.)
#pragma once

#include "cuda/sm80/forward_kernel.cuh"

namespace flashattn::detail::cuda::sm80 {

template <typename Element, int kHeadDim>
struct TunedForward;

// Up to 64: O and Q fragments are small (<= 32 registers each), so 128-key steps halve the
// number of softmax rescales; 4 warps x 16 rows. Shared memory 64x72 + 4x128x72 elements
// (83 KiB): two CTAs per SM.
template <typename E> struct TunedForward<E, 32> { using Config = ForwardConfig<E, 32, 128, 4>; };
template <typename E> struct TunedForward<E, 64> { using Config = ForwardConfig<E, 64, 128, 4>; };
// 96..128: O is 64 registers and Q 32; 64-key steps keep S at 32 registers and the whole
// thread under ~170, so no spills. 4 warps; 4 stages x 64 x 136 + Q (87 KiB): two CTAs per SM.
template <typename E> struct TunedForward<E, 96> { using Config = ForwardConfig<E, 96, 64, 4>; };
template <typename E> struct TunedForward<E, 128> { using Config = ForwardConfig<E, 128, 64, 4>; };
// 160..256: O alone is up to 128 registers and Q 64, so S must stay small: 32-key steps.
template <typename E> struct TunedForward<E, 160> { using Config = ForwardConfig<E, 160, 32, 4>; };
template <typename E> struct TunedForward<E, 192> { using Config = ForwardConfig<E, 192, 32, 4>; };
template <typename E> struct TunedForward<E, 224> { using Config = ForwardConfig<E, 224, 32, 4>; };
template <typename E> struct TunedForward<E, 256> { using Config = ForwardConfig<E, 256, 32, 4>; };

// Defined once per (dtype, bucket) in its own generated file, so the kernels compile in parallel.
template <typename Element, int kHeadDim>
void run_forward(const ForwardParams& params);

}  // namespace flashattn::detail::cuda::sm80

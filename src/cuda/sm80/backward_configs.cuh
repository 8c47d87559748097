// Tile shapes of the sm80 backward kernels per head-dim bucket, with the reason for each
// (registers and spills from `nvcc -Xptxas -v`, recorded in docs/ARCHITECTURE.md; speed to be
// measured on the H200 with bench/gpu_backward.py).
#pragma once

#include "cuda/sm80/backward_kernel.cuh"

namespace flashattn::detail::cuda::sm80 {

template <typename Element, int kHeadDim>
struct TunedBackward;

// BackwardConfig<Element, head dim, query rows per step, keys per CTA, warps>.
// The key-parallel kernel keeps dK and dV of kBlockN keys x the head dim in fp32 registers
// for its whole walk: 2 kBlockN D / (32 warps) per thread, so that product sets the shapes.
// Up to 128: 64 x 64 tiles with 8 warps. dK + dV take D / 2 registers per thread (64 at 128),
// S and dP 16 each, a dQ chunk D / 4; shared memory (Q, dO double-buffered, K, V, P, dS) is
// 121 KiB at 128 and 63 KiB at 64.
template <typename E> struct TunedBackward<E, 32> { using Config = BackwardConfig<E, 32, 64, 64, 8>; };
template <typename E> struct TunedBackward<E, 64> { using Config = BackwardConfig<E, 64, 64, 64, 8>; };
template <typename E> struct TunedBackward<E, 96> { using Config = BackwardConfig<E, 96, 64, 64, 8>; };
template <typename E> struct TunedBackward<E, 128> { using Config = BackwardConfig<E, 128, 64, 64, 8>; };
// 160..256: 64 query rows x 32 keys per CTA, 8 warps. With 64 keys dK + dV alone would take
// 128 registers per thread at 256; with 32 keys they take D / 4 (64 at 256) and each warp
// owns 16 keys x D / 4 columns (5..8 n8 tiles). Shared memory is 176 KiB at 256 (one CTA per
// SM); K and V are re-read from L2 by twice as many CTAs, which the 64-row steps amortise.
template <typename E> struct TunedBackward<E, 160> { using Config = BackwardConfig<E, 160, 64, 32, 8>; };
template <typename E> struct TunedBackward<E, 192> { using Config = BackwardConfig<E, 192, 64, 32, 8>; };
template <typename E> struct TunedBackward<E, 224> { using Config = BackwardConfig<E, 224, 64, 32, 8>; };
template <typename E> struct TunedBackward<E, 256> { using Config = BackwardConfig<E, 256, 64, 32, 8>; };

// Defined once per (dtype, bucket) in its own generated file, so the kernels compile in parallel.
template <typename Element, int kHeadDim>
void run_backward(const BackwardKernelParams& params);

}  // namespace flashattn::detail::cuda::sm80

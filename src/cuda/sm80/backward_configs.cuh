// Tile shapes of the sm80 backward kernels per head-dim bucket, with the reason for each
// (registers and spills from `nvcc -Xptxas -v`, recorded in docs/ARCHITECTURE.md; speed
// measured on the H200: `scripts/gpu.sh bench`, bench/backward.py).
#pragma once

#include "cuda/common/fit.cuh"
#include "cuda/sm80/backward_kernel.cuh"

namespace flashattn::detail::cuda::sm80 {

template <typename Element, int kHeadDim>
struct TunedBackward;

// BackwardConfig<Element, head dim, query rows per step, keys per CTA, warps>.
// Candidates: the tuned shape first (H200, 227 KiB of shared memory per block), then smaller
// ones for an A100 (163 KiB) and sm_86/sm_89 GPUs (99 KiB): 64 keys per CTA, then 32 query
// rows per step (up to 128), or 64 x 32 and then 32 x 32 tiles with 4 warps (160..256; at
// 256 that still needs 107 KiB, so the 99 KiB GPUs have no backward at head dims above 224).
// The key-parallel kernel keeps dK and dV of kBlockN keys x the head dim in fp32 registers
// for its whole walk: 2 kBlockN D / (32 warps) per thread, so that product sets the shapes.
// Up to 128: 64 query rows x 128 keys per CTA, 8 warps (FA2's shape for 128; at 64 see below).
// Against 64 keys (the first version, measured at 0.29-0.45x FA2 on the H200): each Q and dO
// block loaded and each S/dP A-fragment read from shared memory serves twice the keys, and
// the dQ atomics per FLOP halve. dK + dV take D registers per thread (128 at 128), S and dP
// 32 each; ptxas: 238-255 registers, no spill on sm_90a (docs/ARCHITECTURE.md has the table).
// Shared memory is 174 KiB at 128: one CTA per SM, as the 64-key shape already had (by
// registers).
template <typename E> struct TunedBackward<E, 32> {
  using Configs = Candidates<BackwardConfig<E, 32, 64, 128, 8>>;
};
// 64: FA2's shape for it, 128 query rows x 128 keys per CTA, 8 warps (255 registers, no spill
// on sm_90a; 178 KiB of shared memory, so an A100 takes 64 x 128): each K/V fragment read
// feeds twice the rows. Measured on the H200 (2026-11-30, the tuning build, `scripts/gpu.sh
// tune`) against 64 x 128: +12 to +15 % (4k: 248.2 against 219.7 TFLOP/s non-causal, 236.2
// against 207.1 causal).
template <typename E> struct TunedBackward<E, 64> {
  using Configs = Candidates<BackwardConfig<E, 64, 128, 128, 8>, BackwardConfig<E, 64, 64, 128, 8>,
                             BackwardConfig<E, 64, 64, 64, 8>>;
};
template <typename E> struct TunedBackward<E, 96> {
  using Configs = Candidates<BackwardConfig<E, 96, 64, 128, 8>, BackwardConfig<E, 96, 64, 64, 8>>;
};
template <typename E> struct TunedBackward<E, 128> {
  using Configs = Candidates<BackwardConfig<E, 128, 64, 128, 8>, BackwardConfig<E, 128, 64, 64, 8>,
                                 BackwardConfig<E, 128, 32, 64, 8>>;
};
// 160..256: 64 query rows x 64 keys per CTA, 8 warps (FA2's shape for these head dims; not
// yet measured here): dK + dV take D / 2 registers per thread (128 at 256), and with two m16
// tiles per warp ptxas still fits everything in 212-247 registers without spilling on sm_90a.
// Against 32 keys, each Q/dO block loaded serves twice the keys and S/dP get two m16 tiles
// per warp (half the shared-memory reads per MMA). Shared memory is 217 KiB at 256. Then
// 64 x 32 (176 KiB at 256; what the previous release ran) and 32 x 32 with 4 warps.
template <typename E> struct TunedBackward<E, 160> {
  using Configs = Candidates<BackwardConfig<E, 160, 64, 64, 8>, BackwardConfig<E, 160, 64, 32, 8>,
                             BackwardConfig<E, 160, 32, 32, 4>>;
};
template <typename E> struct TunedBackward<E, 192> {
  using Configs = Candidates<BackwardConfig<E, 192, 64, 64, 8>, BackwardConfig<E, 192, 64, 32, 8>,
                             BackwardConfig<E, 192, 32, 32, 4>>;
};
template <typename E> struct TunedBackward<E, 224> {
  using Configs = Candidates<BackwardConfig<E, 224, 64, 64, 8>, BackwardConfig<E, 224, 64, 32, 8>,
                             BackwardConfig<E, 224, 32, 32, 4>>;
};
template <typename E> struct TunedBackward<E, 256> {
  using Configs = Candidates<BackwardConfig<E, 256, 64, 64, 8>, BackwardConfig<E, 256, 64, 32, 8>,
                             BackwardConfig<E, 256, 32, 32, 4>>;
};

// Defined once per (dtype, bucket) in its own generated file, so the kernels compile in parallel.
template <typename Element, int kHeadDim>
void run_backward(const BackwardKernelParams& params);

}  // namespace flashattn::detail::cuda::sm80

// The CUDA backward for a validated call: workspace, the preprocess step, the sm80 kernels of
// the call's dtype and head-dim bucket, and the dQ conversion.
//
//   1. preprocess:  D_i = rowsum(dO_i o O_i) in fp32 (O as the forward wrote it, dropout
//                   included), and the fp32 dQ accumulator zeroed (default mode);
//   2. sm80 kernels (backward_kernel.cuh): dK and dV; dQ into the accumulator with atomics
//                   (default), or dQ straight into dq by a query-parallel kernel
//                   (deterministic mode);
//   3. convert:     dq = softmax_scale * accumulator in dq's dtype (default mode).
//
// The workspace (accumulator, rows x bucket floats, and D, one float per row, both indexed
// like lse) is allocated and freed stream-ordered on the caller's stream: no device-wide
// synchronisation, and freed on every path out of this function.
#include <cuda_runtime.h>

#include <string>

#include "cuda/backward.hpp"
#include "common/knobs.hpp"
#include "cuda/common/buckets.hpp"
#include "cuda/common/grid.hpp"
#include "cuda/common/per_device.hpp"
#include "cuda/common/stream_allocation.hpp"
#include "cuda/head_dim_padding.hpp"
#include "cuda/sm80/backward_configs.cuh"
#include "cuda/sm90/backward_kernel.cuh"

namespace flashattn::detail::cuda {
#ifdef FLASHATTN_SM80_TUNING
namespace sm80 {
bool run_backward_tuning_candidate(const BackwardKernelParams& kp);  // backward_tuning.cu
}
#endif
namespace {

constexpr int kRowsPerCta = 16;   // preprocess / convert: 8 threads per row, 16-byte chunks
constexpr int kThreadsPerRow = 8;

template <typename Element>
__device__ __forceinline__ float2 unpack2(uint32_t bits);
template <>
__device__ __forceinline__ float2 unpack2<__half>(uint32_t bits) {
  return __half22float2(*reinterpret_cast<const __half2*>(&bits));
}
template <>
__device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t bits) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits));
}

template <typename Element>
__global__ void __launch_bounds__(kRowsPerCta * kThreadsPerRow)
    backward_preprocess_kernel(const __grid_constant__ sm80::BackwardKernelParams kp) {
  const ForwardParams& p = kp.bp.fwd;
  const int h = blockIdx.y, b = blockIdx.z;
  const SequenceView seq = sequence_view(p, b);
  const int64_t i = int64_t{blockIdx.x} * kRowsPerCta + threadIdx.x / kThreadsPerRow;
  const int part = threadIdx.x % kThreadsPerRow;
  const bool valid = i < seq.seqlen_q;
  float sum = 0.0f;
  if (valid) {
    const Element* out = static_cast<const Element*>(p.out) + b * p.out_batch_stride +
                         (seq.q_row0 + i) * p.out_row_stride + h * p.out_head_stride;
    const Element* dout = static_cast<const Element*>(kp.bp.dout) + b * kp.bp.dout_batch_stride +
                          (seq.q_row0 + i) * kp.bp.dout_row_stride + h * kp.bp.dout_head_stride;
    for (int col = part * 8; col < p.head_dim_v; col += kThreadsPerRow * 8) {
      const uint4 o = *reinterpret_cast<const uint4*>(out + col);
      const uint4 d = *reinterpret_cast<const uint4*>(dout + col);
      const uint32_t ow[4] = {o.x, o.y, o.z, o.w}, dw[4] = {d.x, d.y, d.z, d.w};
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        const float2 of = unpack2<Element>(ow[n]), df = unpack2<Element>(dw[n]);
        sum = fmaf(of.x, df.x, sum);
        sum = fmaf(of.y, df.y, sum);
      }
    }
  }
#pragma unroll
  for (int offset = 1; offset < kThreadsPerRow; offset *= 2)
    sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (!valid) return;
  const int64_t at = sm80::row_index(p, b, h, seq.q_row0, i);
  if (part == 0) kp.delta[at] = sum;
  if (kp.dq_accum != nullptr) {
    float4* row = reinterpret_cast<float4*>(kp.dq_accum + at * kp.accum_dim);
    for (int n = part; n < kp.accum_dim / 4; n += kThreadsPerRow)
      row[n] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
}

template <typename Element>
__global__ void __launch_bounds__(kRowsPerCta * kThreadsPerRow)
    backward_convert_dq_kernel(const __grid_constant__ sm80::BackwardKernelParams kp) {
  const ForwardParams& p = kp.bp.fwd;
  const int h = blockIdx.y, b = blockIdx.z;
  const SequenceView seq = sequence_view(p, b);
  const int64_t i = int64_t{blockIdx.x} * kRowsPerCta + threadIdx.x / kThreadsPerRow;
  if (i >= seq.seqlen_q) return;
  const float* acc =
      kp.dq_accum + sm80::row_index(p, b, h, seq.q_row0, i) * kp.accum_dim;
  Element* dq = static_cast<Element*>(kp.bp.dq) + b * kp.bp.dq_batch_stride +
                (seq.q_row0 + i) * kp.bp.dq_row_stride + h * kp.bp.dq_head_stride;
  for (int col = (threadIdx.x % kThreadsPerRow) * 8; col < p.head_dim;
       col += kThreadsPerRow * 8) {
    const float4 a = *reinterpret_cast<const float4*>(acc + col);
    const float4 c = *reinterpret_cast<const float4*>(acc + col + 4);
    const float s = p.softmax_scale;
    uint4 packed;
    packed.x = ptx::pack2<Element>(a.x * s, a.y * s);
    packed.y = ptx::pack2<Element>(a.z * s, a.w * s);
    packed.z = ptx::pack2<Element>(c.x * s, c.y * s);
    packed.w = ptx::pack2<Element>(c.z * s, c.w * s);
    *reinterpret_cast<uint4*>(dq + col) = packed;
  }
}

// The sm90 key-parallel kernel takes plain calls (no softcap, ALiBi or dropout) in the default
// (atomic dQ) mode with head-dim buckets 64, 128 and 256, on a GPU that loaded its sm_90a code.
// FLASHATTN_CUDA_BACKWARD=sm80 keeps every call on the sm80 kernels.
template <typename Element>
bool run_sm90(const sm80::BackwardKernelParams& kp, knobs::KernelFamily forced) {
  const ForwardParams& p = kp.bp.fwd;
  if (forced == knobs::KernelFamily::Sm80 || kp.bp.deterministic || kp.has_dropout || p.softcap > 0.0f ||
      p.alibi_slopes != nullptr)
    return false;
  switch (head_dim_bucket(p.head_dim)) {
    case 64: return sm90::run_backward<Element, 64>(kp);
    case 128: return sm90::run_backward<Element, 128>(kp);
    case 256: return sm90::run_backward<Element, 256>(kp);
  }
  return false;
}

template <typename Element>
void run_bucket(const sm80::BackwardKernelParams& kp, knobs::KernelFamily forced) {
  if (run_sm90<Element>(kp, forced)) return;
  with_head_dim_bucket(kp.bp.fwd.head_dim, [&](auto bucket) {
    sm80::run_backward<Element, decltype(bucket)::value>(kp);
  });
}

template <typename Element>
void run_all(const sm80::BackwardKernelParams& kp, knobs::KernelFamily forced) {
  const ForwardParams& p = kp.bp.fwd;
  const cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  const dim3 rows_grid(static_cast<unsigned>((p.seqlen_q + kRowsPerCta - 1) / kRowsPerCta),
                       static_cast<unsigned>(p.heads), static_cast<unsigned>(p.batch));
  constexpr int kThreads = kRowsPerCta * kThreadsPerRow;
  if (p.seqlen_q > 0)
    backward_preprocess_kernel<Element><<<rows_grid, kThreads, 0, stream>>>(kp);
#ifdef FLASHATTN_SM80_TUNING
  if (!sm80::run_backward_tuning_candidate(kp))
#endif
    run_bucket<Element>(kp, forced);
  if (kp.dq_accum != nullptr && p.seqlen_q > 0)
    backward_convert_dq_kernel<Element><<<rows_grid, kThreads, 0, stream>>>(kp);
}

// The backward of a call whose head dim is a multiple of 8 (backward() pads the others).
size_t run_backward(const BackwardParams& bp, knobs::KernelFamily forced) {
  const ForwardParams& p = bp.fwd;
  sm80::BackwardKernelParams kp;
  kp.bp = bp;
  kp.accum_dim = head_dim_bucket(p.head_dim);
  if (p.dropout_p > 0.0f) {
    kp.dropout = make_dropout_rng(p.dropout_seed, p.dropout_offset, p.dropout_p);
    kp.has_dropout = true;
  }
  // Rows of the lse-shaped buffers: B H Sq dense, H total_q varlen.
  const int64_t rows = p.is_varlen() ? int64_t{p.heads} * p.lse_head_stride
                                     : int64_t{p.batch} * p.lse_batch_stride;
  const size_t accum_bytes =
      bp.deterministic ? 0 : static_cast<size_t>(rows) * kp.accum_dim * sizeof(float);
  const size_t delta_bytes = static_cast<size_t>(rows) * sizeof(float);
  const cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  StreamAllocation workspace(accum_bytes + delta_bytes, stream, "backward workspace");
  char* base = static_cast<char*>(workspace.data());
  kp.dq_accum = accum_bytes > 0 ? reinterpret_cast<float*>(base) : nullptr;
  kp.delta = reinterpret_cast<float*>(base + accum_bytes);

  if (p.dtype == DType::Float16)
    run_all<__half>(kp, forced);
  else
    run_all<__nv_bfloat16>(kp, forced);
  throw_if_failed(cudaGetLastError(), "successful kernel launches");
  return accum_bytes + delta_bytes;
}

}  // namespace

size_t backward(const BackwardParams& bp) {
  const ForwardParams& p = bp.fwd;
  // The grids hold the heads (H, or Hk <= H) and the batch: the attention kernels' as
  // cuda/common/tile_order.cuh lays them out, the preprocess and conversion (row blocks, H, B).
  check_heads_and_batch(p.heads, p.batch);
  const knobs::KernelFamily forced = knobs::backward_family();
  if (p.batch == 0) return 0;
  // Before the workspace: it is freed on the same GPU, before the caller's is current again.
  const CurrentDevice on_the_tensors_gpu(p.device);
  return run_with_padded_head_dim(
      bp, [forced](const BackwardParams& padded) { return run_backward(padded, forced); });
}

}  // namespace flashattn::detail::cuda

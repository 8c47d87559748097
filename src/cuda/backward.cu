// The CUDA backward for a validated call: workspace, the preprocess step, the sm80 kernels of
// the call's dtype and head-dim bucket, and the dQ conversion.
//
//   1. preprocess:  D_i = rowsum(dO_i o O_i) in fp32 (O as the forward wrote it, dropout
//                   included), and the fp32 dQ accumulator zeroed (where there is one); for
//                   the sm90 TMA kernel D and lse log2(e) into padded copies instead;
//   2. the kernels: on Hopper the sm90 ones where they cover the call (the TMA kernel,
//                   sm90/backward_ws_kernel.cuh, for dense and varlen calls at buckets 64 and 128, every
//                   feature, both modes; the cp.async one, sm90/backward_kernel.cuh, for the
//                   other plain calls in the default mode), else the sm80 kernels
//                   (backward_kernel.cuh): dK and dV; dQ into the accumulator (default mode
//                   and the TMA kernel's deterministic one, which adds in a fixed order), or
//                   dQ straight into dq by a query-parallel kernel (sm80, deterministic mode);
//   3. convert:     dq = softmax_scale * accumulator in dq's dtype (where there is one).
//
// The workspace (accumulator, rows x bucket floats, and D, one float per row, both indexed
// like lse; or for the TMA kernel the padded D and lse copies instead of D) is allocated and
// freed stream-ordered on the caller's stream: no device-wide synchronisation, and freed on
// every path out of this function.
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
#include "cuda/sm90/backward_ws_kernel.cuh"

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
  const bool padded = kp.lse_log2 != nullptr;  // the TMA kernel's stats
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
  const int64_t at = sm80::row_index(p, b, h, seq.q_row0, i);
  if (padded && part == 0 && i < (seq.seqlen_q + 63) / 64 * 64) {  // the sequence's whole steps
    constexpr float kLog2e = 1.4426950408889634f;
    const float lse = valid ? p.lse[at] : -INFINITY;
    const int64_t padded_at = sm90::padded_stats_row(kp, b, h, seq.q_row0, i);
    kp.lse_log2[padded_at] = lse == -INFINITY ? INFINITY : lse * kLog2e;
    kp.delta_padded[padded_at] = valid ? sum : 0.0f;
  }
  if (!valid) return;
  if (!padded && part == 0) kp.delta[at] = sum;
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
    const int chunk = col / 4;  // and chunk + 1: where they lie (in place, or swizzled)
    const int first = kp.dq_accum_swizzled ? sm90::dq_chunk(chunk, i) : chunk;
    const int second = kp.dq_accum_swizzled ? sm90::dq_chunk(chunk + 1, i) : chunk + 1;
    const float4 a = *reinterpret_cast<const float4*>(acc + first * 4);
    const float4 c = *reinterpret_cast<const float4*>(acc + second * 4);
    const float s = p.softmax_scale;
    uint4 packed;
    packed.x = ptx::pack2<Element>(a.x * s, a.y * s);
    packed.y = ptx::pack2<Element>(a.z * s, a.w * s);
    packed.z = ptx::pack2<Element>(c.x * s, c.y * s);
    packed.w = ptx::pack2<Element>(c.z * s, c.w * s);
    *reinterpret_cast<uint4*>(dq + col) = packed;
  }
}

// The sm90 kernels take calls on a GPU that loaded their sm_90a code: the TMA kernel every
// feature (softcap, ALiBi and dropout in its general variant) in both modes, the cp.async
// kernel plain calls in the default (atomic dQ) mode. FLASHATTN_CUDA_BACKWARD=sm80 keeps every
// call on the sm80 kernels.
bool sm90_may_take(knobs::KernelFamily forced) { return forced != knobs::KernelFamily::Sm80; }
bool is_plain(const sm80::BackwardKernelParams& kp) {
  return kp.bp.fwd.softcap <= 0.0f && kp.bp.fwd.alibi_slopes == nullptr && !kp.has_dropout && !kp.bp.deterministic;
}

// The TMA kernel: dense and varlen calls at buckets 64 and 128 whose tensors TMA can describe (args gets
// their maps); FLASHATTN_SM90_BACKWARD_LOADS=cp.async leaves plain ones to the cp.async kernel.
// Dropout with a key position off the groups of 4 keys one Philox call covers stays on the
// sm80 kernels (sm90::dropout_keep_mask shares each call among the lanes of one group).
template <typename Element>
bool prepare_sm90_ws(const sm80::BackwardKernelParams& kp, knobs::KernelFamily forced, sm90::WsBackwardArgs& args) {
  const ForwardParams& p = kp.bp.fwd;
  if (!sm90_may_take(forced) || p.is_paged() || !knobs::sm90_backward_uses_tma()) return false;
  if (kp.has_dropout && p.key_position0 % 4 != 0) return false;
  switch (head_dim_bucket(p.head_dim)) {
    case 64: return sm90::prepare_backward_ws<Element, 64>(kp, args);
    case 128: return sm90::prepare_backward_ws<Element, 128>(kp, args);
  }
  return false;
}

// The cp.async key-parallel kernel: plain calls at buckets 64, 128 and 256.
template <typename Element>
bool run_sm90(const sm80::BackwardKernelParams& kp, knobs::KernelFamily forced) {
  const ForwardParams& p = kp.bp.fwd;
  if (!sm90_may_take(forced) || !is_plain(kp)) return false;
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

// ws: the TMA kernel's tensor maps where it takes the call (kp has its padded stats), else null.
template <typename Element>
void run_all(const sm80::BackwardKernelParams& kp, knobs::KernelFamily forced, sm90::WsBackwardArgs* ws) {
  const ForwardParams& p = kp.bp.fwd;
  const cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  const auto rows_grid = [&](int64_t rows) {
    return dim3(static_cast<unsigned>((rows + kRowsPerCta - 1) / kRowsPerCta), static_cast<unsigned>(p.heads),
                static_cast<unsigned>(p.batch));
  };
  constexpr int kThreads = kRowsPerCta * kThreadsPerRow;
  if (p.seqlen_q > 0)
    backward_preprocess_kernel<Element>
        <<<rows_grid(ws != nullptr ? (p.seqlen_q + 63) / 64 * 64 : p.seqlen_q), kThreads, 0, stream>>>(kp);
  if (ws != nullptr) {
    ws->kp = kp;
    if (head_dim_bucket(p.head_dim) == 64)
      sm90::launch_backward_ws<Element, 64>(*ws);
    else
      sm90::launch_backward_ws<Element, 128>(*ws);
  } else {
#ifdef FLASHATTN_SM80_TUNING
    if (!sm80::run_backward_tuning_candidate(kp))
#endif
      run_bucket<Element>(kp, forced);
  }
  if (kp.dq_accum != nullptr && p.seqlen_q > 0)
    backward_convert_dq_kernel<Element><<<rows_grid(p.seqlen_q), kThreads, 0, stream>>>(kp);
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
  sm90::WsBackwardArgs ws_args;
  const bool ws = p.dtype == DType::Float16 ? prepare_sm90_ws<__half>(kp, forced, ws_args)
                                            : prepare_sm90_ws<__nv_bfloat16>(kp, forced, ws_args);
  // Rows of the lse-shaped buffers: B H Sq dense, H total_q varlen.
  const int64_t rows = p.is_varlen() ? int64_t{p.heads} * p.lse_head_stride
                                     : int64_t{p.batch} * p.lse_batch_stride;
  // The accumulator, but for the sm80 kernels' deterministic mode (their dQ kernel writes dQ).
  const size_t accum_bytes =
      bp.deterministic && !ws ? 0 : static_cast<size_t>(rows) * kp.accum_dim * sizeof(float);
  // D indexed like lse, or (TMA kernel) D and lse log2(e) per (b, h) in whole 64-row steps
  // (sm90::padded_stats_row), and in deterministic mode a turn counter per step.
  if (ws) kp.padded_rows = p.is_varlen() ? (p.total_q + 64 * p.batch + 63) / 64 * 64 : (p.seqlen_q + 63) / 64 * 64;
  const int64_t padded_count = (p.is_varlen() ? int64_t{1} : int64_t{p.batch}) * p.heads * kp.padded_rows;
  const size_t padded_bytes = static_cast<size_t>(padded_count) * sizeof(float);
  const size_t stats_bytes = ws ? 2 * padded_bytes : static_cast<size_t>(rows) * sizeof(float);
  const size_t turns_bytes = ws && bp.deterministic ? static_cast<size_t>(padded_count / 64) * sizeof(int) : 0;
  const cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  StreamAllocation workspace(accum_bytes + stats_bytes + turns_bytes, stream, "backward workspace");
  char* base = static_cast<char*>(workspace.data());
  kp.dq_accum = accum_bytes > 0 ? reinterpret_cast<float*>(base) : nullptr;
  if (ws) {
    kp.dq_accum_swizzled = true;
    kp.lse_log2 = reinterpret_cast<float*>(base + accum_bytes);
    kp.delta_padded = reinterpret_cast<float*>(base + accum_bytes + padded_bytes);
    if (turns_bytes > 0) {
      kp.dq_turns = reinterpret_cast<int*>(base + accum_bytes + stats_bytes);
      throw_if_failed(cudaMemsetAsync(kp.dq_turns, 0, turns_bytes, stream), "zeroing the dQ turn counters");
    }
  } else {
    kp.delta = reinterpret_cast<float*>(base + accum_bytes);
  }

  if (p.dtype == DType::Float16)
    run_all<__half>(kp, forced, ws ? &ws_args : nullptr);
  else
    run_all<__nv_bfloat16>(kp, forced, ws ? &ws_args : nullptr);
  throw_if_failed(cudaGetLastError(), "successful kernel launches");
  return accum_bytes + stats_bytes + turns_bytes;
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

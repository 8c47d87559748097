// Chooses the forward kernel for a validated call: on Hopper, the sm90 (wgmma) kernel where it
// covers the call; otherwise the sm80 (mma.sync) kernel instantiated for the call's dtype and
// head-dim bucket (head dims rounded up to a multiple of 32); a head dim that is not a
// multiple of 8 runs on padded copies (cuda/head_dim_padding.hpp). Paged keys and values take
// the sm90 kernel where their page size is a multiple of 64, else the sm80 kernel's paged variant.
#include <cuda_runtime.h>

#include <string>

#include "common/knobs.hpp"
#include "cuda/common/buckets.hpp"
#include "cuda/common/grid.hpp"
#include "cuda/common/per_device.hpp"
#include "cuda/common/stream_allocation.hpp"
#include "cuda/forward.hpp"
#include "cuda/fp8_values.hpp"
#include "cuda/head_dim_padding.hpp"
#include "cuda/sm80/forward_configs.cuh"
#include "cuda/sm90/forward_configs.cuh"

namespace flashattn::detail::cuda {
#ifdef FLASHATTN_SM80_TUNING
namespace sm80 {
bool run_tuning_candidate(const ForwardParams& params);  // forward_tuning.cu
}
#endif
namespace {

// The sm90 kernel (TMA, warp-specialised) takes dense and varlen calls on a GPU that loaded its
// sm_90a code; head dims go up to the next multiple of 64 (H200, 2026-12-03, bench/forward.py,
// bf16 hdim 64, dense: 1.19-1.39x the sm80 kernel at 512-16k, causal 1.06-1.33x from 1k; varlen
// calls at 64 take its two-consumer shape, not yet timed against the sm80 kernel) and paged
// varlen calls whose page size is a multiple of 64 (sm90::page_box_rows). The calls it cannot take (other page sizes,
// tensors TMA cannot describe) run on the sm80 kernel, as every call with
// FLASHATTN_CUDA_FORWARD=sm80 (the tests run the CUDA suite both ways).
template <typename Element>
bool run_sm90(const ForwardParams& p, knobs::KernelFamily forced) {
  if (forced == knobs::KernelFamily::Sm80) return false;
  switch ((p.head_dim + 63) / 64 * 64) {
    case 64: return sm90::run_forward<Element, 64>(p);
    case 128: return sm90::run_forward<Element, 128>(p);
    case 192: return sm90::run_forward<Element, 192>(p);
    case 256: return sm90::run_forward<Element, 256>(p);
  }
  return false;
}

template <typename Element>
void run_bucket(const ForwardParams& p, knobs::KernelFamily forced) {
  if (run_sm90<Element>(p, forced)) return;
  with_head_dim_bucket(p.head_dim, [&](auto bucket) {
    if (p.is_paged())
      sm80::run_forward<Element, decltype(bucket)::value, true>(p);
    else
      sm80::run_forward<Element, decltype(bucket)::value, false>(p);
  });
}

// FP8 (e4m3) runs on the sm90 kernel alone, as in FlashAttention-3: head dims up to 256 in
// 128-column buckets (TMA fills the columns past the head dim with zeros: no padded copies);
// elsewhere (no sm_90a code or no Hopper GPU here, tensors TMA cannot describe, the sm80
// kernels forced) the call is refused before anything is written.
// A row-major v that the call reads often enough runs on a (d, seqlen)-major copy
// (cuda/fp8_values.hpp): returns the copy's bytes, the call's workspace.
size_t run_fp8(const ForwardParams& p, knobs::KernelFamily forced) {
  const auto run = [](const ForwardParams& call) {
    return call.head_dim <= 128 ? sm90::run_forward<__nv_fp8_e4m3, 128>(call)
                                : sm90::run_forward<__nv_fp8_e4m3, 256>(call);
  };
  if (forced != knobs::KernelFamily::Sm80 && copies_values_seqlen_major(p)) {
    const size_t bytes = seqlen_major_values_bytes(p);
    const StreamAllocation copy(bytes, static_cast<cudaStream_t>(p.stream), "(d, seqlen)-major copy of fp8 v");
    if (run(with_seqlen_major_values(p, copy.data()))) return bytes;
  }
  const bool ran = forced != knobs::KernelFamily::Sm80 && run(p);
  if (!ran)
    throw Error(ErrorCode::Unsupported, "q",
                "dtype fp16 or bf16 for this call (fp8_e4m3 runs on the Hopper kernel only: sm_90a "
                "code, a Hopper GPU, tensors TMA can describe, pages of a multiple of 64 keys)",
                "dtype fp8_e4m3 (head dim " + std::to_string(p.head_dim) + ") on cuda device " +
                    std::to_string(p.device));
  return 0;
}

}  // namespace

size_t forward(const ForwardParams& p) {
  check_heads_and_batch(p.heads, p.batch);  // the grid holds H and B (cuda/common/tile_order.cuh)
  const knobs::KernelFamily forced = knobs::forward_family();
  if (p.batch == 0 || p.seqlen_q == 0) return 0;
  const CurrentDevice on_the_tensors_gpu(p.device);
  if (p.dtype == DType::Float8E4M3) {
    const size_t workspace = run_fp8(p, forced);
    throw_if_failed(cudaGetLastError(), "a successful kernel launch");
    return workspace;
  }
  // The 16-bit forward allocates nothing itself: its workspace is the padded copies, if any.
  return run_with_padded_head_dim(p, [forced](const ForwardParams& padded) -> size_t {
#ifdef FLASHATTN_SM80_TUNING
    // A tuning candidate serves unpaged calls (its paged variant is not compiled).
    if (padded.is_paged() || !sm80::run_tuning_candidate(padded))
#endif
    {
      if (padded.dtype == DType::Float16)
        run_bucket<__half>(padded, forced);
      else
        run_bucket<__nv_bfloat16>(padded, forced);
    }
    throw_if_failed(cudaGetLastError(), "a successful kernel launch");
    return 0;
  });
}

}  // namespace flashattn::detail::cuda

// The few PTX instructions the kernels are built from, each wrapped once: cp.async (global ->
// shared copies that bypass registers), ldmatrix (shared -> the register fragments mma
// expects), mma.sync m16n8k16 with fp32 accumulation, ex2.approx, and for the sm90 kernels
// the wgmma descriptors and ordering (the wgmma instructions are in wgmma.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace flashattn::detail::cuda::ptx {

__device__ __forceinline__ uint32_t shared_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// Copies 16 bytes global -> shared asynchronously; with `valid` false it writes 16 zero bytes
// instead (the source is not read), which is how tile padding and ragged edges are zeroed.
// kL2PrefetchBytes (0, 128 or 256) asks L2 to fetch that much around the chunk on a miss: a
// hint only (no effect on the result), for rows that are read whole right after.
template <int kL2PrefetchBytes = 0>
__device__ __forceinline__ void cp_async_16(uint32_t shared_dst, const void* global_src,
                                            bool valid) {
  static_assert(kL2PrefetchBytes == 0 || kL2PrefetchBytes == 128 || kL2PrefetchBytes == 256,
                "L2 prefetch sizes: 0, 128 or 256 bytes");
  const int src_bytes = valid ? 16 : 0;
  if constexpr (kL2PrefetchBytes == 256)
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(shared_dst),
                 "l"(global_src), "r"(src_bytes));
  else if constexpr (kL2PrefetchBytes == 128)
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(shared_dst),
                 "l"(global_src), "r"(src_bytes));
  else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_dst),
                 "l"(global_src), "r"(src_bytes));
}
// The same for 4 bytes (4-byte aligned), through L1: per-row scalars such as lse.
__device__ __forceinline__ void cp_async_4(uint32_t shared_dst, const void* global_src, bool valid) {
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(shared_dst),
               "l"(global_src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPendingGroups>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPendingGroups));
}

// Four 8x8 b16 matrices; lane l gives the address of row (l % 8) of matrix (l / 8), and
// register i of lane l receives row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1 of matrix i.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t shared_src) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_src));
}
// The same, each matrix transposed: lane l receives rows 2 (l % 4) and 2 (l % 4) + 1 of
// column l / 4.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t shared_src) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_src));
}

// Two 8x8 b16 matrices, transposed (lanes 0-15 give the row addresses): what a B operand of a
// single n8 tile needs when it is stored k-major.
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], uint32_t shared_src) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(shared_src));
}

// Plain shared/global moves, for the epilogue and the paged forward's page tables.
__device__ __forceinline__ void st_shared_32(uint32_t shared_dst, uint32_t value) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(shared_dst), "r"(value));
}
__device__ __forceinline__ uint32_t ld_shared_32(uint32_t shared_src) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(shared_src));
  return v;
}
__device__ __forceinline__ uint2 ld_shared_64(uint32_t shared_src) {
  uint2 v;
  asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(shared_src));
  return v;
}
__device__ __forceinline__ void st_shared_64(uint32_t shared_dst, float a, float b) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(shared_dst), "f"(a), "f"(b));
}
__device__ __forceinline__ void st_shared_128(uint32_t shared_dst, uint4 value) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(shared_dst), "r"(value.x),
               "r"(value.y), "r"(value.z), "r"(value.w));
}
__device__ __forceinline__ uint4 ld_shared_128(uint32_t shared_src) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(shared_src));
  return v;
}
__device__ __forceinline__ void st_global_128(void* global_dst, uint4 value) {
  *static_cast<uint4*>(global_dst) = value;
}

// Adds (a, b) to the two floats at `address` (8-byte aligned, global memory) atomically: one
// vector reduction on sm_90 and newer, two scalar ones before.
__device__ __forceinline__ void atomic_add_f32x2(float* address, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(address), make_float2(a, b));
#else
  atomicAdd(address, a);
  atomicAdd(address + 1, b);
#endif
}

// Programmatic dependent launch (sm_90 and newer; no-ops before, and when the dependent
// grid was launched without the programmatic-serialization attribute). The primary grid
// lets its dependent grid start launching (its CTAs can be scheduled before the primary ends);
// the dependent grid waits until its primaries have completed and their writes are visible.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_primary_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Bulk asynchronous reduction (sm_90 and newer; the callers compile it only there): adds
// `bytes` (a multiple of 16) of fp32 values at shared address `src` to global `dst` (both
// 16-byte aligned), element by element atomically, through the async proxy. The thread's
// earlier shared-memory writes must be made visible to that proxy first (fence_proxy_async),
// and the source may be rewritten only after bulk_wait_read.
__device__ __forceinline__ void fence_proxy_async_shared() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, uint32_t src, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
               "r"(src), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#else
  __trap();  // no bulk reductions before sm_90: a caller outside an sm_90 path is a bug
#endif
}
// Waits until this thread's bulk operations have read their shared-memory source...
__device__ __forceinline__ void bulk_wait_read() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
#endif
}
// ... and until they have completed (before the thread exits).
__device__ __forceinline__ void bulk_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#endif
}

// A flag in global memory that orders work across CTAs (the deterministic backward's turns):
// read with acquire, written with release, at GPU scope. Between them and the bulk
// operations that the flag orders, fence_proxy_async_global: those run in the async proxy.
__device__ __forceinline__ int ld_acquire_gpu(const int* flag) {
  int value;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(value) : "l"(flag) : "memory");
  return value;
}
__device__ __forceinline__ void st_release_gpu(int* flag, int value) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(flag), "r"(value) : "memory");
}
__device__ __forceinline__ void fence_proxy_async_global() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
#endif
}

// Warpgroup MMA (wgmma, sm_90a; the instructions themselves are in wgmma.cuh). A shared-memory
// operand is described by a 64-bit descriptor: its start address, the byte offsets between
// its 8-row (K-major) or 64-column (MN-major) groups, and the swizzle. Only the 128-byte
// swizzle is used: rows of 128 bytes (64 16-bit values) in 1024-byte atoms of 8 rows, the
// 16-byte chunk c of row r stored at chunk position c ^ (r % 8), atoms 1024-byte aligned.
//   K-major (A and B of S = Q K^T): leading offset unused (16), stride offset 1024 (the
//     next 8 rows); stepping 16 k values within a 128-byte row adds 32 bytes to the start.
//   MN-major (B of O = P V, V stored [key][dim]): leading offset = the bytes between two
//     64-column panels, stride offset 1024 (the next 8 keys).
// The descriptor is kept as its two 32-bit words: stepping through an operand (a k step, a
// stage, 16 rows) moves only the start address, in the low word's low 14 bits, and shared
// addresses stay below 256 KiB, so the step is one 32-bit add with no carry into the high
// word. As one 64-bit value every step was a 64-bit add and its moves before each wgmma:
// the TMA forward's main loop (bf16, head dim 128) ran 586 instructions a block and consumer
// thread, 523 with the words in uniform registers. The backward kernels convert to uint64_t
// at once and step that: with the words their TMA kernel spilled 60-68 bytes at head dim 128.
struct WgmmaDescriptor {
  uint32_t low, high;
  // `units` of 16 bytes further on (any integer type: the 64-bit add through the conversion
  // below would be ambiguous with it otherwise).
  template <typename Units>
  __device__ __forceinline__ WgmmaDescriptor operator+(Units units) const {
    return {low + static_cast<uint32_t>(units), high};
  }
  __device__ __forceinline__ operator uint64_t() const { return uint64_t{high} << 32 | low; }
};
__device__ __forceinline__ WgmmaDescriptor wgmma_descriptor(uint32_t shared_start, uint32_t leading_bytes,
                                                            uint32_t stride_bytes) {
  return {((shared_start & 0x3FFFF) >> 4) | ((leading_bytes & 0x3FFFF) >> 4) << 16,
          ((stride_bytes & 0x3FFFF) >> 4) | 1u << 30};
}
// Orders this thread's earlier register writes (accumulators, A fragments) before the
// warpgroup's next wgmma reads them; commit closes a group of wgmmas; wait blocks until at
// most kPending groups are still running (their accumulators are then safe to read).
__device__ __forceinline__ void wgmma_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
#endif
}

// The compiler sees a wgmma's accumulators as written when the instruction is issued, not
// when wgmma_wait returns: these empty statements (never reordered against the other volatile
// ones) mark every register as rewritten at this point, so that no read of it moves above the
// wait and no write below the wgmma that reads it.
template <int N>
__device__ __forceinline__ void wgmma_hold(float (&registers)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(registers[i])::"memory");
}
template <int M, int N>
__device__ __forceinline__ void wgmma_hold(uint32_t (&registers)[M][N]) {
#pragma unroll
  for (int i = 0; i < M; ++i)
#pragma unroll
    for (int j = 0; j < N; ++j) asm volatile("" : "+r"(registers[i][j])::"memory");
}

// D (16x8, fp32) += A (16x16, row-major) * B (16x8, column-major). Fragments per lane
// (g = lane / 4, c = 2 (lane % 4)): a0 = A[g][c..c+1], a1 = A[g+8][c..], a2 = A[g][c+8..],
// a3 = A[g+8][c+8..]; b0 = B[c..c+1][g], b1 = B[c+8..c+9][g]; d0,d1 = D[g][c..c+1],
// d2,d3 = D[g+8][c..c+1].
template <typename Element>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4],
                                                  uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats rounded to one 32-bit register of two 16-bit values (the first in the low half).
template <typename Element>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// Four floats rounded to e4m3 (to nearest, saturating at +-448: what FP8 inputs hold) in one
// 32-bit register, the first in the lowest byte: an A fragment register of an FP8 wgmma.
__device__ __forceinline__ uint32_t pack4_e4m3(float b0, float b1, float b2, float b3) {
  uint32_t packed;
  asm("{\n.reg .b16 lo, hi;\n"
      "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n"  // the second source lands in the low byte
      "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
      "mov.b32 %0, {lo, hi};\n}\n"
      : "=r"(packed)
      : "f"(b0), "f"(b1), "f"(b2), "f"(b3));
  return packed;
}
// 2^x with the hardware approximation (relative error ~2^-22); 2^-inf = 0, NaN stays NaN.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 1 / x and log2 x with the hardware approximations (MUFU.RCP, MUFU.LG2: about 1 ulp, and an
// absolute error near 2^-22 for log2), where the result is rounded to 16 bits afterwards (out)
// or need not be correctly rounded (lse); subnormal inputs are flushed to zero (1 / 0 = inf,
// log2 0 = -inf).
__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float log2_approx(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 1 / d for d in [1, 2]: a quartic (relative error 9.3e-4, fitted to be minimax in relative
// terms on 1 / (1 + e), e = d - 1 in [0, 1]) and one Newton step (error squared: 8.7e-7). Seven
// FMA-pipe instructions; MUFU.RCP would be one, but the MUFU unit (16 operations per clock and
// SM) already carries the softmax's exponentials, and with the tanh's exponential it is what
// binds. (The polynomial is in d rather than e so that e dies once d is formed: in e, ptxas
// kept both alive and the hdim-128 general kernel spilled.)
__device__ __forceinline__ float reciprocal_1_to_2(float d) {
  const float r = fmaf(fmaf(fmaf(fmaf(0.1270040484419091f, d, -0.9857981104426772f), d, 3.021782623037056f), d,
                            -4.56887439644864f),
                       d, 3.404954992710325f);
  return fmaf(r, fmaf(-d, r, 1.0f), r);
}

// tanh(x) for x = s * scale, scale >= 0, given s and k = -2 log2(e) scale <= 0 (a negative
// scale: tanh(x) = tanh(-s |scale|)): tanh |x| = 2 / (1 + e) - 1 with e = 2^(k |s|) in (0, 1],
// and the sign copied from s. One MUFU operation (the
// exponential) and nine other instructions; e only shrinks towards 0 (where tanh rounds to 1),
// so nothing needs clamping; NaN stays NaN. Absolute error about 2e-6. (It replaced a form of
// about 16 instructions, a clamp and three Newton steps from a bit-pattern guess: 1.05-1.11x
// for softcap calls on an H100, where about 1.3x was predicted from the instruction count; the
// loop's code size bound them more, see ScoreVariant in sm90/forward_ws_kernel.cuh and
// docs/PERFORMANCE.md.)
__device__ __forceinline__ float tanh_of_scaled(float s, float k) {
  const float r = reciprocal_1_to_2(1.0f + exp2_approx(fabsf(s) * k));
  return copysignf(fmaf(2.0f, r, -1.0f), s);
}

// tanh x for the softcap of the kernels that need tanh alone (the backward, for the
// derivative 1 - tanh^2).
__device__ __forceinline__ float tanh_for_softcap(float x) { return tanh_of_scaled(x, -2.8853900817779268f); }

}  // namespace flashattn::detail::cuda::ptx

// How fast can a kv cache be streamed at all? Read-only kernels over the decode benchmark's
// cache layout (bf16, head dim 128, 8 kv heads interleaved in each row; K and V separate),
// with the split kernel's grid (split, kv head, batch) and split rule, each copy schedule
// with no attention arithmetic or with a stand-in for it, so that the read rate of a schedule
// can be told apart from the cost of the work between the copies. A diagnostic for issue 7
// (cuDNN's decode kernel reads the cache faster than our split kernel), not part of the
// library or of the build:
//   nvcc -O3 -std=c++17 -arch=sm_90a -I src dev/gpu_stream_read.cu -o stream_read
//   ./stream_read            TB/s (K + V bytes / median of 100 calls, each timed by events,
//                            so a launch gap of 1-2 us is included) per schedule and shape,
//                            in two rounds
//   ./stream_read profile [SEQLEN]   batch 8 x 32k (or SEQLEN) only, four calls per schedule,
//                            for Nsight Compute: `ncu --clock-control none --metrics
//                            gpu__time_duration.sum ./stream_read profile` gives kernel
//                            durations comparable with `scripts/gpu.sh profile`'s decode
//                            profiles.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda/common/ptx.cuh"

namespace ptx = flashattn::detail::cuda::ptx;

namespace {

constexpr int kHeadDim = 128;
constexpr int kRowBytes = kHeadDim * 2;  // one kv head's row
constexpr int kThreads = 128;
constexpr int kThreadsPerRow = 8;  // 128 bytes per pass, two column passes per row
constexpr int kRowsPerPass = kThreads / kThreadsPerRow;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

struct Problem {
  const __nv_bfloat16* k;
  const __nv_bfloat16* v;
  int seqlen, heads_k, splits;
  uint32_t* sink;  // keeps the reads alive
};

// The CTA's rows [lo, hi) of (batch, kv head) and its first K/V element.
struct Slice {
  int64_t lo, hi;
  const char* k;
  const char* v;
  int64_t row_stride;  // bytes
};
__device__ Slice slice_of(const Problem& p) {
  const int split = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int64_t per = (p.seqlen + p.splits - 1) / p.splits;
  Slice s;
  s.lo = int64_t{split} * per < p.seqlen ? int64_t{split} * per : p.seqlen;
  s.hi = s.lo + per < p.seqlen ? s.lo + per : p.seqlen;
  s.row_stride = int64_t{p.heads_k} * kRowBytes;
  const int64_t base = (int64_t{b} * p.seqlen) * s.row_stride + int64_t{hk} * kRowBytes;
  s.k = reinterpret_cast<const char*>(p.k) + base;
  s.v = reinterpret_cast<const char*>(p.v) + base;
  return s;
}

// Shared rows are padded to 272 bytes (conflict-free ldmatrix), as the split kernel's are.
constexpr int kPitch = kRowBytes + 16;

// Copies rows [r0, r0 + kRows) of the slice by cp.async into shared tiles (rows from s.hi on
// zero-filled): kTpr threads per row, 16 bytes each. A thread's copies go row pass by row
// pass, each pass's columns in turn (kColumnsOuter: column pass by column pass). kPair: each
// chunk of the first tensor is followed by the same chunk of the second, as the split
// kernel issues K and V.
template <int kRows, int kHint, bool kPair, int kTpr = kThreadsPerRow, bool kColumnsOuter = false>
__device__ __forceinline__ void copy_rows(const Slice& s, int64_t r0, const char* src, uint32_t dst,
                                          const char* src2 = nullptr, uint32_t dst2 = 0) {
  constexpr int kRpp = kThreads / kTpr, kPasses = kRows / kRpp, kColumns = kRowBytes / (16 * kTpr);
  const int row = threadIdx.x / kTpr, chunk = threadIdx.x % kTpr;
#pragma unroll
  for (int i = 0; i < kPasses * kColumns; ++i) {
    const int pass = kColumnsOuter ? i % kPasses : i / kColumns;
    const int c = kColumnsOuter ? i / kPasses : i % kColumns;
    const int r = row + pass * kRpp;
    const bool ok = r0 + r < s.hi;
    const int64_t at = (r0 + r) * s.row_stride + (c * kTpr + chunk) * 16;
    const uint32_t off = r * kPitch + (c * kTpr + chunk) * 16;
    ptx::cp_async_16<kHint>(dst + off, ok ? src + at : src, ok);
    if (kPair) ptx::cp_async_16<kHint>(dst2 + off, ok ? src2 + at : src2, ok);
  }
}

// Fixed-latency work per block, standing in for the softmax and MMAs: kSpin dependent FMAs.
template <int kSpin>
__device__ __forceinline__ float spin(float x) {
#pragma unroll 16
  for (int i = 0; i < kSpin; ++i) x = fmaf(x, 0.999f, 0.5f);
  return x;
}

// Work per block standing in for the split kernel's: each warp's 16 keys of the block
// through Q K^T (8 ldmatrix, two chains of 8 MMAs), exp2 and P V (8 transposed ldmatrix, 16
// MMAs into accumulators kept for the whole loop), as kvcache_kernel.cuh does at head dim 128.
struct MmaWork {
  uint32_t q[8][4];
  float o[16][4] = {};
  uint32_t pf[4] = {};
  bool softmax = false;            // the full online softmax (else exp2 only)
  int64_t key0 = 0, lane_lo = 0, lane_hi = 0;  // the block's first key, this lane's visible keys
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f}, scale_o[2] = {1.0f, 1.0f};
  __device__ MmaWork() {
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
#pragma unroll
      for (int i = 0; i < 4; ++i) q[kk][i] = 0x3c003c00u ^ (threadIdx.x * 7 + kk + i);
  }
  // k_tile, v_tile: shared addresses of the block's K and V rows (kPitch bytes apart); the
  // warp takes rows first_row + 16 warp .. + 15.
  template <int kPitch>
  __device__ __forceinline__ void scores(uint32_t k_tile, int first_row) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const uint32_t k_base = k_tile + (first_row + warp * 16 + lane % 8 + (lane / 16) * 8) * kPitch + ((lane / 8) % 2) * 16;
    float s[2][4] = {};
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
      uint32_t kf[4];
      ptx::ldmatrix_x4(kf, k_base + kk * 32);
      ptx::mma_16816<__nv_bfloat16>(s[0], q[kk], kf[0], kf[1]);
      ptx::mma_16816<__nv_bfloat16>(s[1], q[kk], kf[2], kf[3]);
    }
    if (softmax) {
      // The split kernel's online softmax: scores to base 2, a mask test on 64-bit key
      // positions, row maxima over the quad, the rescale factor, exp2 and the row sums.
      const int64_t j0 = key0 + warp * 16;
      const bool sees_all = j0 >= lane_lo && j0 + 16 <= lane_hi;
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float x = s[t][2 * rr + e] * 0.12f;
            if (!sees_all && (j0 + t * 8 + e < lane_lo || j0 + t * 8 + e >= lane_hi)) x = -INFINITY;
            s[t][2 * rr + e] = x;
          }
        float m = fmaxf(fmaxf(s[0][2 * rr], s[0][2 * rr + 1]), fmaxf(s[1][2 * rr], s[1][2 * rr + 1]));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
        const float new_max = fmaxf(row_max[rr], m);
        const float base = new_max == -INFINITY ? 0.0f : new_max;
        scale_o[rr] = row_max[rr] == new_max ? 1.0f : ptx::exp2_approx(row_max[rr] - base);
        row_max[rr] = new_max;
        float sum = 0.0f;
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float pe = ptx::exp2_approx(s[t][2 * rr + e] - base);
            s[t][2 * rr + e] = pe;
            sum += pe;
          }
        row_sum[rr] = row_sum[rr] * scale_o[rr] + sum;
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) pf[i] = ptx::pack2<__nv_bfloat16>(s[i / 2][2 * (i % 2)], s[i / 2][2 * (i % 2) + 1]);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i)
        pf[i] = ptx::pack2<__nv_bfloat16>(ptx::exp2_approx(s[i / 2][2 * (i % 2)] * 1e-3f),
                                          ptx::exp2_approx(s[i / 2][2 * (i % 2) + 1] * 1e-3f));
    }
  }
  template <int kPitch>
  __device__ __forceinline__ void pv(uint32_t v_tile, int first_row) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const uint32_t v_base = v_tile + (first_row + warp * 16 + lane % 8 + ((lane / 8) % 2) * 8) * kPitch + (lane / 16) * 16;
    if (softmax && __any_sync(0xffffffffu, scale_o[0] != 1.0f || scale_o[1] != 1.0f)) {
#pragma unroll
      for (int t = 0; t < 16; ++t) {
        o[t][0] *= scale_o[0];
        o[t][1] *= scale_o[0];
        o[t][2] *= scale_o[1];
        o[t][3] *= scale_o[1];
      }
    }
#pragma unroll
    for (int t = 0; t < 16; t += 2) {
      uint32_t vf[4];
      ptx::ldmatrix_x4_trans(vf, v_base + t * 16);
      ptx::mma_16816<__nv_bfloat16>(o[t], pf, vf[0], vf[1]);
      ptx::mma_16816<__nv_bfloat16>(o[t + 1], pf, vf[2], vf[3]);
    }
  }
  template <int kPitch>
  __device__ __forceinline__ void block(uint32_t k_tile, uint32_t v_tile) {
    scores<kPitch>(k_tile, 0);
    pv<kPitch>(v_tile, 0);
  }
  __device__ float sum() const {
    float x = 0;
#pragma unroll
    for (int t = 0; t < 16; ++t) x += o[t][0] + o[t][1] + o[t][2] + o[t][3];
    return x + row_sum[0] + row_sum[1];
  }
};

// Our split kernel's schedule: kStages stages of kBlock rows of K and V, kStages - 1 blocks in
// flight, one barrier per block and the next block issued after it (kEarly: a barrier for the
// stage's reuse, the next block issued, then the wait for this one and a second barrier, so
// that the issue does not wait for the block to land). kMma: 0 no work, 1 the MMAs and exp2,
// 2 with the online softmax. kKThenV: a block's K copies all before its V copies, instead of
// alternating per chunk. Shared rows are padded to 272 bytes (conflict-free ldmatrix), as the
// kernel's are.
template <int kBlock, int kStages, int kSpin, int kHint, int kMma = 0, bool kEarly = false, bool kKThenV = false>
__global__ void __launch_bounds__(kThreads) staged(Problem p) {
  extern __shared__ __align__(128) char smem[];
  const uint32_t base = ptx::shared_address(smem);
  constexpr uint32_t kTile = kBlock * kPitch;
  const Slice s = slice_of(p);
  const int n_blocks = static_cast<int>((s.hi - s.lo + kBlock - 1) / kBlock);
  const auto load = [&](int n, int stage) {
    const int64_t r0 = s.lo + int64_t{n} * kBlock;
    const uint32_t k_tile = base + stage * 2 * kTile, v_tile = k_tile + kTile;
    if (kKThenV) {
      copy_rows<kBlock, kHint, false>(s, r0, s.k, k_tile);
      copy_rows<kBlock, kHint, false>(s, r0, s.v, v_tile);
    } else {
      copy_rows<kBlock, kHint, true>(s, r0, s.k, k_tile, s.v, v_tile);
    }
  };

  for (int n = 0; n < kStages - 1; ++n) {
    if (n < n_blocks) load(n, n);
    ptx::cp_async_commit();
  }
  uint32_t acc = 0;
  float x = threadIdx.x;
  MmaWork work;
  work.softmax = kMma == 2;
  work.lane_lo = s.lo + (threadIdx.x % 7);  // runtime values, so that the test stays
  work.lane_hi = s.hi;
  for (int n = 0; n < n_blocks; ++n) {
    work.key0 = s.lo + int64_t{n} * kBlock;
    if constexpr (kEarly) {
      __syncthreads();
      if (n + kStages - 1 < n_blocks) load(n + kStages - 1, (n + kStages - 1) % kStages);
      ptx::cp_async_commit();
      ptx::cp_async_wait<kStages - 1>();
      __syncthreads();
    } else {
      ptx::cp_async_wait<kStages - 2>();
      __syncthreads();
      if (n + kStages - 1 < n_blocks) load(n + kStages - 1, (n + kStages - 1) % kStages);
      ptx::cp_async_commit();
    }
    const uint32_t stage = base + (n % kStages) * 2 * kTile;
    if constexpr (kMma) {
      work.block<kPitch>(stage, stage + kTile);
    } else {
      acc ^= ptx::ld_shared_128(stage + threadIdx.x * 16).x ^ ptx::ld_shared_128(stage + kTile + threadIdx.x * 16).y;
    }
    x = spin<kSpin>(x);
  }
  if (acc == 0x12345678u || x + work.sum() == 1.2345f) p.sink[0] = acc;
}

// cuDNN's schedule (its decode kernel at head dim 128): one K and one V buffer of kBlock rows;
// wait K(n), issue V(n), work, wait V(n), issue K(n + 1), work: one tile in flight at a time.
template <int kBlock, int kSpin, int kHint = 0, bool kMma = false, int kTpr = kThreadsPerRow>
__global__ void __launch_bounds__(kThreads) single_buffered(Problem p) {
  extern __shared__ __align__(128) char smem[];
  const uint32_t base = ptx::shared_address(smem);
  constexpr uint32_t kTile = kBlock * kPitch;
  const Slice s = slice_of(p);
  const int n_blocks = static_cast<int>((s.hi - s.lo + kBlock - 1) / kBlock);
  const auto load = [&](const char* src, int n, uint32_t dst) {
    copy_rows<kBlock, kHint, false, kTpr>(s, s.lo + int64_t{n} * kBlock, src, dst);
    ptx::cp_async_commit();
  };
  if (n_blocks > 0) load(s.k, 0, base);
  uint32_t acc = 0;
  float x = threadIdx.x;
  MmaWork work;
  for (int n = 0; n < n_blocks; ++n) {
    ptx::cp_async_wait<0>();
    __syncthreads();
    load(s.v, n, base + kTile);
    if constexpr (kMma) {
#pragma unroll
      for (int g = 0; g < kBlock / 64; ++g) work.scores<kPitch>(base, 64 * g);
    } else {
      acc ^= ptx::ld_shared_128(base + threadIdx.x * 16).x;
    }
    x = spin<kSpin / 2>(x);
    ptx::cp_async_wait<0>();
    __syncthreads();
    if (n + 1 < n_blocks) load(s.k, n + 1, base);
    if constexpr (kMma) {
#pragma unroll
      for (int g = 0; g < kBlock / 64; ++g) work.pv<kPitch>(base + kTile, 64 * g);
    } else {
      acc ^= ptx::ld_shared_128(base + kTile + threadIdx.x * 16).y;
    }
    x = spin<kSpin / 2>(x);
  }
  if (acc == 0x12345678u || x + work.sum() == 1.2345f) p.sink[0] = acc;
}

// A pipeline of single tiles: K(0), V(0), K(1), V(1), ... each kBlock rows, kStages tile
// buffers, kStages - 1 tiles in flight: cuDNN's one-stream-at-a-time order, multi-buffered.
template <int kBlock, int kStages, bool kMma = false, bool kColumnsOuter = false>
__global__ void __launch_bounds__(kThreads) tile_pipeline(Problem p) {
  extern __shared__ __align__(128) char smem[];
  const uint32_t base = ptx::shared_address(smem);
  constexpr uint32_t kTile = kBlock * kPitch;
  const Slice s = slice_of(p);
  const int n_tiles = 2 * static_cast<int>((s.hi - s.lo + kBlock - 1) / kBlock);
  const auto load = [&](int t) {
    copy_rows<kBlock, 0, false, kThreadsPerRow, kColumnsOuter>(s, s.lo + int64_t{t / 2} * kBlock,
                                                               t % 2 == 0 ? s.k : s.v, base + (t % kStages) * kTile);
  };

  for (int t = 0; t < kStages - 1; ++t) {
    if (t < n_tiles) load(t);
    ptx::cp_async_commit();
  }
  uint32_t acc = 0;
  MmaWork work;
  for (int t = 0; t < n_tiles; ++t) {
    ptx::cp_async_wait<kStages - 2>();
    __syncthreads();
    if (t + kStages - 1 < n_tiles) load(t + kStages - 1);
    ptx::cp_async_commit();
    const uint32_t tile = base + (t % kStages) * kTile;
    if constexpr (kMma) {
#pragma unroll
      for (int g = 0; g < kBlock / 64; ++g) {
        if (t % 2 == 0) work.scores<kPitch>(tile, 64 * g);
        else work.pv<kPitch>(tile, 64 * g);
      }
    } else {
      acc ^= ptx::ld_shared_128(tile + threadIdx.x * 16).x;
    }
  }
  if (acc == 0x12345678u || work.sum() == 1.2345f) p.sink[0] = acc;
}

// The byte offset of this thread's first 16-byte chunk in row pass `r0` of the slice (8
// threads per row, as in copy_rows); a row past the slice reads the slice's first row instead,
// so that the register and per-thread cp.async kernels below load the same bytes.
__device__ __forceinline__ int64_t own_chunk(const Slice& s, int64_t r0) {
  const int64_t r = r0 + threadIdx.x / kThreadsPerRow;
  return (r < s.hi ? r : s.lo) * s.row_stride + (threadIdx.x % kThreadsPerRow) * 16;
}

// Loads into registers (ld.global.nc, 16 bytes, kUnroll rows of K and V per thread in flight),
// no shared memory at all.
template <int kUnroll>
__global__ void __launch_bounds__(kThreads) registers(Problem p) {
  const Slice s = slice_of(p);
  uint32_t acc = 0;
  constexpr int kRows = kUnroll * kRowsPerPass;
  for (int64_t r0 = s.lo; r0 < s.hi; r0 += kRows) {
    uint4 kv[kUnroll][4];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t at = own_chunk(s, r0 + u * kRowsPerPass);
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        kv[u][2 * c] = __ldg(reinterpret_cast<const uint4*>(s.k + at + c * 128));
        kv[u][2 * c + 1] = __ldg(reinterpret_cast<const uint4*>(s.v + at + c * 128));
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc ^= kv[u][i].x ^ kv[u][i].y ^ kv[u][i].z ^ kv[u][i].w;
  }
  if (acc == 0x12345678u) p.sink[0] = acc;
}

// The same loads as `registers`, by cp.async into the thread's own shared slots (no barrier:
// each thread reads back only what it copied): the copy instruction apart, the same bytes in
// flight per thread and the same occupancy.
template <int kUnroll, int kHint>
__global__ void __launch_bounds__(kThreads) cp_async_flat(Problem p) {
  extern __shared__ __align__(128) char smem[];
  const Slice s = slice_of(p);
  const uint32_t mine = ptx::shared_address(smem) + threadIdx.x * kUnroll * 4 * 16;
  uint32_t acc = 0;
  constexpr int kRows = kUnroll * kRowsPerPass;
  for (int64_t r0 = s.lo; r0 < s.hi; r0 += kRows) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t at = own_chunk(s, r0 + u * kRowsPerPass);
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        ptx::cp_async_16<kHint>(mine + (u * 4 + 2 * c) * 16, s.k + at + c * 128, true);
        ptx::cp_async_16<kHint>(mine + (u * 4 + 2 * c + 1) * 16, s.v + at + c * 128, true);
      }
    }
    ptx::cp_async_commit();
    ptx::cp_async_wait<0>();
#pragma unroll
    for (int i = 0; i < kUnroll * 4; ++i) {
      const uint4 x = ptx::ld_shared_128(mine + i * 16);
      acc ^= x.x ^ x.y ^ x.z ^ x.w;
    }
  }
  if (acc == 0x12345678u) p.sink[0] = acc;
}

struct Shape {
  int batch, seqlen;
};

size_t buffer_bytes = 0;  // of K and of V
int calls = 100;          // timed per schedule and shape

template <typename Kernel>
double time_tbps(Kernel kernel, const Problem& base, const Shape& shape, int shared_bytes,
                 int* splits_used, int* ctas_per_sm) {
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes),
        "shared memory opt-in");
  int per_sm = 0, sms = 0, dev = 0;
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, shared_bytes), "occupancy");
  check(cudaGetDevice(&dev), "device");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "SMs");
  Problem p = base;
  p.seqlen = shape.seqlen;
  // The library's split rule (kvcache_configs.cuh, choose_splits) with 64-key blocks.
  const int64_t ctas = int64_t{shape.batch} * p.heads_k, wave = int64_t{sms} * per_sm;
  int64_t splits = 1;
  if (ctas * 5 < wave * 4) splits = std::min<int64_t>(std::max<int64_t>(1, wave / ctas), shape.seqlen / 256);
  p.splits = static_cast<int>(splits);
  *splits_used = p.splits;
  *ctas_per_sm = per_sm;
  const dim3 grid(p.splits, p.heads_k, shape.batch);
  // Consecutive calls read different copies of the cache where it is small enough to have
  // copies (1 x 8k: 33.5 MB, which L2 could otherwise keep between calls).
  const size_t shape_bytes = size_t(shape.batch) * shape.seqlen * p.heads_k * kRowBytes;
  const size_t copies = std::max<size_t>(1, buffer_bytes / shape_bytes);
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "event");
  check(cudaEventCreate(&stop), "event");
  std::vector<float> ms;
  for (int i = 0; i < calls + 3; ++i) {
    Problem call = p;
    const size_t offset = (i % copies) * shape_bytes;
    call.k = reinterpret_cast<const __nv_bfloat16*>(reinterpret_cast<const char*>(p.k) + offset);
    call.v = reinterpret_cast<const __nv_bfloat16*>(reinterpret_cast<const char*>(p.v) + offset);
    check(cudaEventRecord(start), "record");
    kernel<<<grid, kThreads, shared_bytes>>>(call);
    check(cudaEventRecord(stop), "record");
    check(cudaEventSynchronize(stop), "sync");
    float t = 0;
    check(cudaEventElapsedTime(&t, start, stop), "elapsed");
    if (i >= 3 || calls == 1) ms.push_back(t);
  }
  check(cudaGetLastError(), "launch");
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  const double bytes = 2.0 * shape.batch * double(shape.seqlen) * p.heads_k * kRowBytes;
  return bytes / (ms[ms.size() / 2] * 1e-3) / 1e12;
}

}  // namespace

// `stream_read profile [SEQLEN]`: batch 8 with a 32k (or SEQLEN) cache only, one call per schedule and no warm-up, for
// Nsight Compute (`ncu --clock-control none --section SpeedOfLight ./stream_read profile`),
// whose durations compare with the decode profiles of `scripts/gpu.sh profile`.
int main(int argc, char** argv) {
  const int heads_k = 8;
  const bool profile = argc > 1 && std::string(argv[1]) == "profile";
  calls = profile ? 1 : 100;
  const int profile_seqlen = argc > 2 ? std::atoi(argv[2]) : 32768;
  const std::vector<Shape> shapes = profile ? std::vector<Shape>{{8, profile_seqlen}}
                                            : std::vector<Shape>{{1, 8192}, {1, 131072}, {8, 32768}, {64, 4096}};
  size_t bytes = 0;
  for (const Shape& s : shapes) bytes = std::max(bytes, size_t(s.batch) * s.seqlen * heads_k * kRowBytes);
  buffer_bytes = bytes;
  Problem base{};
  void *k = nullptr, *v = nullptr;
  check(cudaMalloc(&k, bytes), "malloc K");
  check(cudaMalloc(&v, bytes), "malloc V");
  check(cudaMemset(k, 1, bytes), "memset");
  check(cudaMemset(v, 2, bytes), "memset");
  check(cudaMalloc(&base.sink, 64), "malloc sink");
  base.k = static_cast<const __nv_bfloat16*>(k);
  base.v = static_cast<const __nv_bfloat16*>(v);
  base.heads_k = heads_k;

  const auto run = [&](const char* name, auto kernel, int shared_bytes) {
    std::printf("%-42s", name);
    for (const Shape& s : shapes) {
      int splits = 0, per_sm = 0;
      const double tbps = time_tbps(kernel, base, s, shared_bytes, &splits, &per_sm);
      std::printf(" | %.2f (%d sp, %d/SM)%*s", tbps, splits, per_sm, splits < 10 ? 3 : splits < 100 ? 2 : 1, "");
    }
    std::printf("\n");
    std::fflush(stdout);
  };
  std::printf("%-42s", "schedule (TB/s; splits, CTAs per SM)");
  for (const Shape& s : shapes) std::printf(" | %-21s", (std::to_string(s.batch) + " x " + std::to_string(s.seqlen / 1024) + "k").c_str());
  std::printf("\n");
  constexpr int kOurs = 108800;  // the split kernel's shared memory: two CTAs per SM
  // Two rounds, so that a drift of the card (clocks, temperature) shows as a difference
  // between them; a second of reads first, so that the memory clock has settled.
  for (int i = 0; i < (profile ? 0 : 3); ++i) run("warm-up", staged<64, 3, 0, 256>, kOurs);
  for (int round = 1; round <= (profile ? 1 : 2); ++round) {
    std::printf("round %d\n", round);
    // The split kernel's copy schedule (kvcache_kernel.cuh at head dim 128: 64-key blocks of K
    // and V, 3 stages, two CTAs per SM, the L2 prefetch hint), then with single changes.
    run("staged 64/3, L2 256B (ours)", staged<64, 3, 0, 256>, kOurs);
    run("staged 64/3, no hint", staged<64, 3, 0, 0>, kOurs);
    run("staged 64/3, no hint, K then V", staged<64, 3, 0, 0, 0, false, true>, kOurs);
    run("staged 64/3, L2 256B, MMA work", staged<64, 3, 0, 256, 1>, kOurs);
    run("staged 64/3, L2 256B, MMA + softmax", staged<64, 3, 0, 256, 2>, kOurs);
    run("staged 64/3, L2 256B, MMA, early issue", staged<64, 3, 0, 256, 1, true>, kOurs);
    run("staged 64/3, no hint, spin 256", staged<64, 3, 256, 0>, kOurs);
    run("staged 64/3, no hint, spin 512", staged<64, 3, 512, 0>, kOurs);
    run("staged 64/2 (3/SM)", staged<64, 2, 0, 256>, 2 * 2 * 64 * 272);
    run("staged 64/4 (1/SM)", staged<64, 4, 0, 256>, 4 * 2 * 64 * 272);
    run("staged 32/3, no hint (4/SM)", staged<32, 3, 0, 0>, 3 * 2 * 32 * 272);
    run("staged 16/2, L2 256B (12/SM)", staged<16, 2, 0, 256>, 2 * 2 * 16 * 272);
    // cuDNN's schedule (its decode kernel's shared memory: two CTAs per SM) and variants.
    run("single-buffered 128 (cuDNN's)", single_buffered<128, 0>, 86336);
    run("single-buffered 128, 16 threads/row", single_buffered<128, 0, 0, false, 16>, 86336);
    run("single-buffered 128, L2 256B", single_buffered<128, 0, 256>, 86336);
    run("single-buffered 128, MMA work", single_buffered<128, 0, 0, true>, 86336);
    run("single-buffered 64", single_buffered<64, 0>, 86336);
    run("tiles 128 x 3 (K, V alternate)", tile_pipeline<128, 3>, kOurs);
    run("tiles 128 x 3, columns outer", tile_pipeline<128, 3, false, true>, kOurs);
    // Loads into registers, and the same per-thread loads by cp.async.
    run("registers, 2 rows (12/SM)", registers<2>, 0);
    run("registers, 4 rows (2/SM)", registers<4>, kOurs);
    run("registers, 8 rows (4/SM)", registers<8>, 50000);
    run("cp.async flat, 2 rows (13/SM)", cp_async_flat<2, 0>, 128 * 2 * 64);
  }
  return 0;
}

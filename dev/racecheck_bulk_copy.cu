// Scratch: does compute-sanitizer racecheck model 1-D bulk copies (cp.async.bulk) completing on
// an mbarrier? The TMA backward reads its lse and D rows, which land that way, with plain shared
// loads, and racecheck reports hazards between those loads and the copies. Three kernels with
// the same handoff, run under racecheck one by one (argv[1] = 0, 1, 2):
//   0 one shot: a copy, the consumers wait on the full barrier, then read (read after write)
//   1 a two-stage ring: consumers read, meet at a named barrier, one thread frees the stage
//     (the backward's pattern: write after read across the ring)
//   2 the same ring with every consumer thread arriving on the empty barrier
// Each checks the sums it read against the host's, so a real race shows as a wrong value too.
// Build: nvcc -arch=sm_90a -O2 -o /tmp/rc dev/racecheck_bulk_copy.cu
#include <cstdio>
#include <cstdint>
#include <vector>

constexpr int kRow = 64;  // floats per copy (256 bytes, as the backward's per-stage stats)
constexpr int kSteps = 16;

__device__ uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ void mbar_init(uint64_t* b, uint32_t n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(b)), "r"(n) : "memory");
}
__device__ void mbar_arrive(uint64_t* b) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}" ::"r"(smem_addr(b)) : "memory");
}
__device__ void mbar_expect(uint64_t* b, uint32_t bytes) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}" ::"r"(smem_addr(b)),
               "r"(bytes)
               : "memory");
}
__device__ void mbar_wait(uint64_t* b, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nretry:\nmbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n@!done bra retry;\n}" ::"r"(
          smem_addr(b)),
      "r"(parity)
      : "memory");
}
__device__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* full) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(smem_addr(full))
               : "memory");
}

__global__ void one_shot(const float* src, float* out) {
  __shared__ alignas(128) float row[kRow];
  __shared__ uint64_t full;
  if (threadIdx.x == 0) {
    mbar_init(&full, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    mbar_expect(&full, sizeof(row));
    bulk_copy(row, src, sizeof(row), &full);
  }
  mbar_wait(&full, 0);
  out[threadIdx.x] = row[threadIdx.x % kRow];
}

// Warp 0's lane 0 produces; warps 1-4 (128 threads) consume.
template <bool kEveryThreadArrives>
__global__ void ring(const float* src, float* out) {
  __shared__ alignas(128) float rows[2][kRow];
  __shared__ uint64_t full[2], empty[2];
  if (threadIdx.x == 0) {
    for (int s = 0; s < 2; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], kEveryThreadArrives ? 128 : 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    if (threadIdx.x == 0)
      for (int it = 0; it < kSteps; ++it) {
        const int s = it % 2;
        mbar_wait(&empty[s], ((it / 2) & 1) ^ 1);
        mbar_expect(&full[s], sizeof(rows[s]));
        bulk_copy(rows[s], src + it * kRow, sizeof(rows[s]), &full[s]);
      }
    return;
  }
  const int c = threadIdx.x - 32;
  float sum = 0;
  for (int it = 0; it < kSteps; ++it) {
    const int s = it % 2;
    mbar_wait(&full[s], (it / 2) & 1);
    sum += rows[s][c % kRow];
    if (kEveryThreadArrives) {
      mbar_arrive(&empty[s]);
    } else {
      asm volatile("bar.sync 1, 128;" ::: "memory");
      if (c == 0) mbar_arrive(&empty[s]);
    }
  }
  out[c] = sum;
}

int main(int argc, char** argv) {
  const int which = argc > 1 ? atoi(argv[1]) : 0;
  std::vector<float> host(kSteps * kRow);
  for (size_t i = 0; i < host.size(); ++i) host[i] = float(i % 97);
  float *src, *out;
  cudaMalloc(&src, host.size() * 4);
  cudaMalloc(&out, 128 * 4);
  cudaMemcpy(src, host.data(), host.size() * 4, cudaMemcpyHostToDevice);
  if (which == 0) one_shot<<<1, 128>>>(src, out);
  if (which == 1) ring<false><<<1, 160>>>(src, out);
  if (which == 2) ring<true><<<1, 160>>>(src, out);
  std::vector<float> got(128);
  const cudaError_t err = cudaMemcpy(got.data(), out, 128 * 4, cudaMemcpyDeviceToHost);
  int wrong = 0;
  for (int c = 0; c < 128; ++c) {
    float want = 0;
    if (which == 0) want = host[c % kRow];
    else
      for (int it = 0; it < kSteps; ++it) want += host[it * kRow + c % kRow];
    wrong += got[c] != want;
  }
  std::printf("kernel %d: %s, %d of 128 sums wrong\n", which, cudaGetErrorString(err), wrong);
  return err != cudaSuccess || wrong;
}

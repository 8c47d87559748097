// The synchronisation a warp-specialised sm90 kernel is built from (sm_90a; the callers
// compile it only there): mbarriers in shared memory (cuda::ptx from CCCL), TMA tile loads
// that complete on them, named barriers between warpgroups, and the register reallocation
// between producer and consumer warpgroups.
//
// An mbarrier here guards one buffer and alternates between two phases: the side that waits
// passes the parity of the phase it waits for (0, 1, 0, ...: the number of times it has used
// the buffer, mod 2). A "full" barrier completes when its one producer arrival is in and the
// TMA bytes it announced have landed; an "empty" barrier when every consumer that reads the
// buffer has arrived.
#pragma once

#include <cuda/ptx>

#include <cstdint>

namespace flashattn::detail::cuda::sm90 {

struct Mbarrier {
  uint64_t* word;

  __device__ void init(uint32_t arrivals) const { ::cuda::ptx::mbarrier_init(word, arrivals); }
  __device__ void arrive() const {
    ::cuda::ptx::mbarrier_arrive(::cuda::ptx::sem_release, ::cuda::ptx::scope_cta, ::cuda::ptx::space_shared, word);
  }
  // The producer's arrival on a full barrier: `bytes` more are to land through TMA.
  __device__ void arrive_expect_bytes(uint32_t bytes) const {
    ::cuda::ptx::mbarrier_arrive_expect_tx(::cuda::ptx::sem_release, ::cuda::ptx::scope_cta,
                                           ::cuda::ptx::space_shared, word, bytes);
  }
  // The retry loop is inside the asm: a loop the compiler sees would be a divergent path
  // to it, and ptxas then serialises the wgmmas that follow (C7520).
  __device__ void wait(uint32_t parity) const {
    asm volatile(
        "{\n.reg .pred done;\n"
        "retry:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra retry;\n}\n" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(word))),
        "r"(parity)
        : "memory");
  }
};

// Position in a ring: buffer `stage`, used for the `use`-th time; a full barrier's waiters pass
// parity use & 1, the producer waiting for the buffer to be empty the opposite one (a fresh
// barrier counts as having completed the phase before its first).
struct RingSlot {
  int stage;
  uint32_t parity;
};
template <int kStages>
__device__ __forceinline__ RingSlot ring_slot(int iteration) {
  return {iteration % kStages, static_cast<uint32_t>((iteration / kStages) & 1)};
}

// Makes the barriers' initialisation visible to the async proxy (the TMA unit) before any
// copy completes on them; the CTA-wide barrier after it makes it visible to the other threads.
__device__ __forceinline__ void fence_barrier_init() {
  ::cuda::ptx::fence_mbarrier_init(::cuda::ptx::sem_release, ::cuda::ptx::scope_cluster);
}

// One box of a 4-D tensor map (cuda/sm90/tensor_maps.hpp: column, row, head, batch) into
// shared memory at `dst`, completing on `full`. Issued by one thread.
__device__ __forceinline__ void tma_load(uint32_t dst, const void* map, int32_t col, int32_t row, int32_t head,
                                         int32_t batch, const Mbarrier& full) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
      "l"(map), "r"(col), "r"(row), "r"(head), "r"(batch),
      "r"(static_cast<uint32_t>(__cvta_generic_to_shared(full.word)))
      : "memory");
}
// `bytes` (a multiple of 16) from global memory at `src` into shared memory at `dst` (both
// 16-byte aligned) as one bulk copy, completing on `full`. Issued by one thread.
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, const Mbarrier& full) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(static_cast<uint32_t>(__cvta_generic_to_shared(full.word)))
      : "memory");
}
// One box from shared memory at `src` into a 4-D tensor map's tensor (the parts of the box
// outside the tensor are not written), as one bulk group (ptx::bulk_wait_read: when `src` may
// be rewritten). The issuing thread's and its warp's writes to `src` must be made visible to
// the async proxy first (ptx::fence_proxy_async_shared, then a barrier among the writers).
__device__ __forceinline__ void tma_store(const void* map, uint32_t src, int32_t col, int32_t row, int32_t head,
                                          int32_t batch) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n"
      "cp.async.bulk.commit_group;\n" ::"l"(map),
      "r"(col), "r"(row), "r"(head), "r"(batch), "r"(src)
      : "memory");
}
// Asks L2 to fetch the tensor map's descriptor before its first use.
__device__ __forceinline__ void prefetch_tensor_map(const void* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(map) : "memory");
}

// Named barriers (ids 1-15; 0 is __syncthreads): `threads` arrivals complete one. sync waits
// for the completion, arrive only counts.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Gives this warpgroup's registers back to the SM (dec) or takes more (inc), to kRegisters
// per thread; every thread of the warpgroup executes it.
template <int kRegisters>
__device__ __forceinline__ void release_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void claim_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

}  // namespace flashattn::detail::cuda::sm90

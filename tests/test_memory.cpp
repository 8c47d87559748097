// The engine's working memory must not grow with the sequence lengths (never Sq x Sk).
// This executable replaces the global allocation functions so that every heap byte the
// process allocates during a call is counted, whoever allocates it; RunInfo's own figure is
// then checked against that count.
#include <atomic>
#include <cstdlib>
#include <new>

#include "support.hpp"

namespace {

std::atomic<int64_t> live_bytes{0};
std::atomic<int64_t> peak_bytes{0};

// Each block is preceded by a header (at least 16 bytes, a multiple of the alignment):
// its first word is the block's size, its last word the header's own size.
void* allocate(size_t size, size_t align) {
  const size_t header = align > 16 ? align : 16;
  char* raw = static_cast<char*>(std::aligned_alloc(header, (size + 2 * header - 1) / header * header));
  if (raw == nullptr) throw std::bad_alloc();
  char* block = raw + header;
  *reinterpret_cast<size_t*>(raw) = size;
  *(reinterpret_cast<size_t*>(block) - 1) = header;
  const int64_t now = live_bytes.fetch_add(int64_t(size)) + int64_t(size);
  int64_t peak = peak_bytes.load();
  while (now > peak && !peak_bytes.compare_exchange_weak(peak, now)) {
  }
  return block;
}

void counted_free(void* p) {
  if (p == nullptr) return;
  char* raw = static_cast<char*>(p) - *(static_cast<size_t*>(p) - 1);
  live_bytes.fetch_sub(int64_t(*reinterpret_cast<size_t*>(raw)));
  std::free(raw);
}

}  // namespace

void* operator new(size_t size) { return allocate(size, 16); }
void* operator new[](size_t size) { return allocate(size, 16); }
void* operator new(size_t size, std::align_val_t a) { return allocate(size, size_t(a)); }
void* operator new[](size_t size, std::align_val_t a) { return allocate(size, size_t(a)); }
void operator delete(void* p) noexcept { counted_free(p); }
void operator delete[](void* p) noexcept { counted_free(p); }
void operator delete(void* p, size_t) noexcept { counted_free(p); }
void operator delete[](void* p, size_t) noexcept { counted_free(p); }
void operator delete(void* p, std::align_val_t) noexcept { counted_free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { counted_free(p); }
void operator delete(void* p, size_t, std::align_val_t) noexcept { counted_free(p); }
void operator delete[](void* p, size_t, std::align_val_t) noexcept { counted_free(p); }

namespace flashattn::testing {
namespace {

struct Measured {
  int64_t peak_extra_bytes;  // heap peak during the call, above what was live before it
  size_t reported_bytes;     // RunInfo::workspace_bytes
};

Measured measure_forward(int64_t seqlen_q, int64_t seqlen_k, DType dtype, bool causal) {
  const int64_t H = 8, D = 64;
  Buffer q(dtype, seqlen_q * H * D), k(dtype, seqlen_k * H * D), v(dtype, seqlen_k * H * D);
  q.fill_random();
  k.fill_random();
  v.fill_random();
  Buffer out(dtype, seqlen_q * H * D), lse(DType::Float32, H * seqlen_q);
  Options o;
  o.causal = causal;
  Execution e;
  e.num_threads = 2;  // fixed, so the figure does not depend on the machine
  const auto call = [&] {
    return forward(q.view({1, seqlen_q, H, D}), k.view({1, seqlen_k, H, D}),
                   v.view({1, seqlen_k, H, D}), out.view({1, seqlen_q, H, D}),
                   lse.view({1, H, seqlen_q}), o, e);
  };
  call();  // warm-up: the OpenMP runtime allocates its thread pool on first use
  const int64_t before = live_bytes.load();
  peak_bytes.store(before);
  const RunInfo info = call();
  return {peak_bytes.load() - before, info.workspace_bytes};
}

TEST(Memory, WorkingMemoryDoesNotGrowWithSequenceLength) {
  for (DType dt : {DType::Float32, DType::BFloat16}) {
    const Measured small = measure_forward(256, 256, dt, false);
    const Measured long_keys = measure_forward(256, 8192, dt, false);
    const Measured long_both = measure_forward(2048, 4096, dt, true);
    // The same fixed set of tiles per thread, whatever the lengths.
    EXPECT_EQ(small.peak_extra_bytes, long_keys.peak_extra_bytes);
    EXPECT_EQ(small.peak_extra_bytes, long_both.peak_extra_bytes);
    // RunInfo reports what was really allocated.
    EXPECT_EQ(size_t(long_both.peak_extra_bytes), long_both.reported_bytes);
    // 2 threads x (q and acc tiles of 256 rows, k and v tiles of 128 keys, a score tile, row
    // stats) ~ 450 KB at D = 64 (measured 2026-12-06), against 8 heads x 2048 x 4096 x 4 B =
    // 256 MiB for the score matrix.
    EXPECT_LT(long_both.peak_extra_bytes, 512 * 1024);
    EXPECT_GT(long_both.peak_extra_bytes, 0);
  }
}

Measured measure_backward(int64_t seqlen_q, int64_t seqlen_k, DType dtype, bool causal,
                          float dropout) {
  const int64_t H = 4, Hk = 2, D = 64;
  Buffer q(dtype, seqlen_q * H * D), k(dtype, seqlen_k * Hk * D), v(dtype, seqlen_k * Hk * D);
  Buffer out(dtype, seqlen_q * H * D), dout(dtype, seqlen_q * H * D), lse(DType::Float32, H * seqlen_q);
  Buffer dq(dtype, seqlen_q * H * D), dk(dtype, seqlen_k * Hk * D), dv(dtype, seqlen_k * Hk * D);
  q.fill_random();
  k.fill_random();
  v.fill_random();
  dout.fill_random();
  Options o;
  o.causal = causal;
  o.dropout_p = dropout;
  Execution e;
  e.num_threads = 2;
  const TensorView qv = q.view({1, seqlen_q, H, D}), kv = k.view({1, seqlen_k, Hk, D}),
                   vv = v.view({1, seqlen_k, Hk, D}), ov = out.view({1, seqlen_q, H, D}),
                   lv = lse.view({1, H, seqlen_q});
  forward(qv, kv, vv, ov, lv, o, e);  // also the warm-up
  const int64_t before = live_bytes.load();
  peak_bytes.store(before);
  const RunInfo info = backward(qv, kv, vv, ov, dout.view({1, seqlen_q, H, D}), lv,
                                dq.view({1, seqlen_q, H, D}), dk.view({1, seqlen_k, Hk, D}),
                                dv.view({1, seqlen_k, Hk, D}), o, e);
  return {peak_bytes.load() - before, info.workspace_bytes};
}

TEST(Memory, BackwardWorkingMemoryDoesNotGrowWithSequenceLength) {
  for (DType dt : {DType::Float32, DType::BFloat16}) {
    const Measured small = measure_backward(128, 128, dt, false, 0.0f);
    const Measured long_keys = measure_backward(128, 4096, dt, false, 0.1f);
    const Measured long_both = measure_backward(2048, 2048, dt, true, 0.0f);
    // A fixed set of tiles per thread, shared by both passes, whatever the lengths: no
    // Sq x Sk buffer, not even an O(Sq) one (D = rowsum(dO o O) is recomputed per tile).
    EXPECT_EQ(small.peak_extra_bytes, long_keys.peak_extra_bytes);
    EXPECT_EQ(small.peak_extra_bytes, long_both.peak_extra_bytes);
    EXPECT_EQ(size_t(long_both.peak_extra_bytes), long_both.reported_bytes);
    // 2 threads x the fused pass's tiles (two blocks of 128 keys per load of query rows) ~
    // 920 KB at D = 64 (measured 2026-12-06), against 4 heads x 2048 x 2048 x 4 B = 64 MiB for
    // one materialised P.
    EXPECT_LT(long_both.peak_extra_bytes, 1024 * 1024);
    EXPECT_GT(long_both.peak_extra_bytes, 0);
  }
}

TEST(Memory, AllocationCounterSeesAllocations) {
  // The counter itself works (so the equalities above cannot pass vacuously).
  const int64_t before = live_bytes.load();
  peak_bytes.store(before);
  { std::vector<float> big(1 << 20); big[0] = 1; }
  EXPECT_GE(peak_bytes.load() - before, int64_t(4) << 20);
}

}  // namespace
}  // namespace flashattn::testing

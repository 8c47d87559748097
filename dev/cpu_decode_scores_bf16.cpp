// dev: amx::decode_scores (the bf16 decode's VDPBF16PS scores, src/cpu/amx.cpp) alone on hot
// rows, one thread: ns per call of 4 query rows x 8 keys x head dim 128 (one head's call of
// the decode walk: 2 KiB of key rows, 1024 elements apart as in the decode bench), and the
// largest difference from the same sums in double. Built against the library's object files
// (a CPU-only Release build):
//   g++ -O2 -std=c++20 -fopenmp -Isrc -Iinclude dev/cpu_decode_scores_bf16.cpp BUILD/src/libflashattn.a -o /tmp/ks
//   /tmp/ks
// The values product of the same call: dev/cpu_decode_kernels.cpp 4 8 128 8 (its "pv").
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "cpu/amx.hpp"

using namespace flashattn::detail;

static bfloat16_t to_bf16(float f) {  // truncation: any bf16 values do
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t h = static_cast<uint16_t>(u >> 16);
  bfloat16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}
static float to_f32(bfloat16_t b) {
  uint16_t h;
  std::memcpy(&h, &b, 2);
  const uint32_t u = uint32_t{h} << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

int main() {
  if (!cpu::amx::available()) {
    std::printf("no AVX512-BF16 (or FLASHATTN_CPU_AMX=0): amx::decode_scores is not used\n");
    return 0;
  }
  const int R = 4, N = 8, D = 128, stride = 1024;
  std::vector<bfloat16_t> q(R * D), k(size_t{8} * N * stride);
  uint32_t x = 1;
  const auto rnd = [&x] {
    x = x * 1664525u + 1013904223u;
    return static_cast<float>((x >> 8) & 0xFFFF) / 65536.0f - 0.5f;
  };
  for (auto& v : q) v = to_bf16(rnd());
  for (auto& v : k) v = to_bf16(rnd());
  std::vector<float> s(R * 128);
  cpu::amx::decode_scores(q.data(), D, R, D, k.data(), stride, N, 0.5f, s.data(), 128);
  double err = 0;
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < N; ++j) {
      double ref = 0;
      for (int d = 0; d < D; ++d) ref += double{to_f32(q[r * D + d])} * to_f32(k[j * stride + d]);
      err = std::max(err, std::fabs(0.5 * ref - s[r * 128 + j]));
    }
  double best = 1e9;
  const int calls = 200000;
  for (int rep = 0; rep < 15; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int it = 0; it < calls; ++it) {  // 8 sets of keys, 128 KiB: all in L2, most in L1
      cpu::amx::decode_scores(q.data(), D, R, D, k.data() + (it & 7) * N * stride, stride, N, 0.5f,
                              s.data(), 128);
      asm volatile("" ::: "memory");
    }
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::printf("amx::decode_scores 4 rows x 8 keys x 128: %.1f ns per call (best of 15), max |diff| %.3g\n",
              best / calls * 1e9, err);
  return 0;
}

// dev: the decode products (src/cpu/kernels.hpp) alone on hot rows, one thread: GFLOP/s of
// decode_scores and decode_accumulate_pv at rows x keys x head dim, cache rows at the decode
// bench's stride (Hk x D elements apart), against the score_tile product (the forward's)
// on a staged tile. Built against the library's object files:
//   g++ -O2 -std=c++20 -fopenmp -Isrc dev/cpu_decode_kernels.cpp /tmp/bcpu_dec/src/libflashattn.a -o /tmp/dk
//   /tmp/dk [rows] [keys] [head_dim] [Hk]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cpu/kernels.hpp"

using namespace flashattn::detail;
using namespace flashattn::detail::cpu;

template <typename F>
double best_seconds(int reps, F&& f) {
  double best = 1e9;
  for (int t = 0; t < 7; ++t) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) f();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best / reps;
}

template <typename T>
void run(const char* name, int rows, int keys, int D, int Hk) {
  std::vector<T> k(static_cast<size_t>(keys) * Hk * D), v(k.size());
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = from_float<T>(float(i % 7) * 0.1f);
    v[i] = from_float<T>(float(i % 5) * 0.1f);
  }
  std::vector<float> q(static_cast<size_t>(rows) * D, 0.01f), s(static_cast<size_t>(rows) * kBlockK, 0.001f),
      acc(static_cast<size_t>(rows) * D, 0.0f);
  const double flops = 2.0 * rows * keys * D;
  const double ts = best_seconds(2000, [&] {
    decode_scores(q.data(), rows, D, k.data(), int64_t{Hk} * D, keys, s.data(), kBlockK);
  });
  const double tp = best_seconds(2000, [&] {
    decode_accumulate_pv(s.data(), kBlockK, rows, v.data(), int64_t{Hk} * D, keys, acc.data(), D, D);
  });
  std::printf("%s rows %d keys %d D %d: scores %.1f GFLOP/s, pv %.1f GFLOP/s\n", name, rows, keys, D,
              flops / ts / 1e9, flops / tp / 1e9);
}

int main(int argc, char** argv) {
  const int rows = argc > 1 ? atoi(argv[1]) : 4, keys = argc > 2 ? atoi(argv[2]) : 16;
  const int D = argc > 3 ? atoi(argv[3]) : 128, Hk = argc > 4 ? atoi(argv[4]) : 8;
  run<float>("fp32", rows, keys, D, Hk);
  run<bfloat16_t>("bf16", rows, keys, D, Hk);
  run<half_t>("fp16", rows, keys, D, Hk);
  std::vector<float> q(static_cast<size_t>(64) * D, 0.01f), kt(static_cast<size_t>(D) * kBlockK, 0.1f),
      s(static_cast<size_t>(64) * kBlockK);
  const double t = best_seconds(200, [&] { score_tile(q.data(), kt.data(), s.data(), 64, D); });
  std::printf("score_tile 64 x %d x %d (staged, the forward's): %.1f GFLOP/s\n", kBlockK, D,
              2.0 * 64 * kBlockK * D / t / 1e9);
  return 0;
}

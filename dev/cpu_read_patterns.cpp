// dev: how fast the threads read a (S, Hk, D) cache in the orders a decode kernel could walk
// it (issue 32): contiguous halves; per head (row_bytes every Hk * row_bytes); per head with a
// software prefetch some rows ahead; key chunks position by position (all heads of a row);
// key chunks in steps of n positions x heads, with and without prefetching steps ahead.
// Integer sums only, so that memory is all that counts. Best of 5, GB/s.
//   g++ -O3 -march=native -fopenmp dev/cpu_read_patterns.cpp -o /tmp/read_patterns
//   /tmp/read_patterns [S] [Hk] [row_bytes] [prefetch_rows]   (256: bf16 at D 128, 512: fp32)
// 2-core VM, 2 threads, 2026-12-06: contiguous 19-20, per head 5.5-5.9, per head with prefetch
// 8-10, position by position 20.5-21, steps of 4-16 positions 15-21 (noisy).
// 2-core AMD EPYC VM (Zen 4), 2 threads, 2026-12-07 09:03 UTC, S 32768, Hk 8, rows of 256 / 512
// bytes: contiguous 63 / 51, per head 27 / 28, position by position 67 / 58, the decode's steps
// of 16 positions x heads 39 / 38, with a prefetch 1-4 steps ahead 48-49 / 38-39. Here the
// decode's order (head by head within 16 positions) is what caps it near 0.6 of the read
// bandwidth; walking the cache position by position (every head of a row) reads 1.5-1.7x faster.
#include <omp.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>

int main(int argc, char** argv) {
  const int64_t S = argc > 1 ? atoll(argv[1]) : 65536, Hk = argc > 2 ? atoll(argv[2]) : 8;
  const int64_t row_bytes = argc > 3 ? atoll(argv[3]) : 256;  // one head's row
  const int64_t ahead = argc > 4 ? atoll(argv[4]) : 16;
  const int64_t words_per_row = row_bytes / 8, stride = Hk * words_per_row;
  std::vector<uint64_t> buf(static_cast<size_t>(S * stride));
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < (int64_t)buf.size(); ++i) buf[i] = i;
  const uint64_t* d = buf.data();
  const double bytes = buf.size() * 8.0;
  auto time = [&](const char* name, auto&& f) {
    double best = 1e9;
    uint64_t sink = 0;
    for (int r = 0; r < 5; ++r) {
      auto t0 = std::chrono::steady_clock::now();
      sink += f();
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::printf("%-40s %7.2f GB/s (%llu)\n", name, bytes / best / 1e9, (unsigned long long)(sink & 1));
  };
  time("contiguous, static halves", [&] {
    uint64_t s = 0;
#pragma omp parallel for schedule(static) reduction(+ : s)
    for (int64_t i = 0; i < (int64_t)buf.size(); ++i) s += d[i];
    return s;
  });
  time("per head, dynamic over heads", [&] {
    uint64_t s = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : s)
    for (int64_t h = 0; h < Hk; ++h)
      for (int64_t j = 0; j < S; ++j)
        for (int64_t w = 0; w < words_per_row; ++w) s += d[j * stride + h * words_per_row + w];
    return s;
  });
  time("per head + prefetch ahead", [&] {
    uint64_t s = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : s)
    for (int64_t h = 0; h < Hk; ++h)
      for (int64_t j = 0; j < S; ++j) {
        if (j + ahead < S)
          for (int64_t w = 0; w < words_per_row; w += 8)
            __builtin_prefetch(d + (j + ahead) * stride + h * words_per_row + w, 0, 3);
        for (int64_t w = 0; w < words_per_row; ++w) s += d[j * stride + h * words_per_row + w];
      }
    return s;
  });
  time("key chunks, all heads per row", [&] {
    uint64_t s = 0;
    const int64_t chunks = omp_get_max_threads() * 4;
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : s)
    for (int64_t c = 0; c < chunks; ++c)
      for (int64_t j = c * S / chunks; j < (c + 1) * S / chunks; ++j)
        for (int64_t w = 0; w < stride; ++w) s += d[j * stride + w];
    return s;
  });
  time("per head, key chunks (head x 4 chunks)", [&] {
    uint64_t s = 0;
    const int64_t chunks = 4;
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : s)
    for (int64_t it = 0; it < Hk * chunks; ++it) {
      const int64_t h = it / chunks, c = it % chunks;
      for (int64_t j = c * S / chunks; j < (c + 1) * S / chunks; ++j)
        for (int64_t w = 0; w < words_per_row; ++w) s += d[j * stride + h * words_per_row + w];
    }
    return s;
  });
  for (int64_t n : {4, 8, 16, 32, 128}) {
    char name[64];
    std::snprintf(name, sizeof name, "key chunks, sub-blocks of %lld rows x heads", (long long)n);
    time(name, [&] {
      uint64_t s = 0;
      const int64_t chunks = omp_get_max_threads() * 4;
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : s)
      for (int64_t c = 0; c < chunks; ++c)
        for (int64_t j0 = c * S / chunks; j0 < (c + 1) * S / chunks; j0 += n)
          for (int64_t h = 0; h < Hk; ++h)
            for (int64_t j = j0; j < std::min(j0 + n, (c + 1) * S / chunks); ++j)
              for (int64_t w = 0; w < words_per_row; ++w) s += d[j * stride + h * words_per_row + w];
      return s;
    });
  }
  for (int64_t n : {8, 16, 128})
    for (int64_t pf : {1, 2, 4}) {
      char name[80];
      std::snprintf(name, sizeof name, "sub-blocks of %lld rows, prefetch %lld blocks ahead", (long long)n, (long long)pf);
      time(name, [&] {
        uint64_t s = 0;
        const int64_t chunks = omp_get_max_threads() * 4;
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : s)
        for (int64_t c = 0; c < chunks; ++c) {
          const int64_t end = (c + 1) * S / chunks;
          for (int64_t j0 = c * S / chunks; j0 < end; j0 += n) {
            const int64_t p0 = j0 + pf * n, p1 = std::min(p0 + n, end);
            for (int64_t j = p0; j < p1; ++j)
              for (int64_t w = 0; w < stride; w += 8) __builtin_prefetch(d + j * stride + w, 0, 3);
            for (int64_t h = 0; h < Hk; ++h)
              for (int64_t j = j0; j < std::min(j0 + n, end); ++j)
                for (int64_t w = 0; w < words_per_row; ++w) s += d[j * stride + h * words_per_row + w];
          }
        }
        return s;
      });
    }
  return 0;
}

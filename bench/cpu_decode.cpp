// flashattn_bench_cpu_decode: decoding with a KV cache on the CPU backend.
//
// One query token per sequence against a dense bf16 cache (B, S, Hk, D), 32 query heads over
// 8 key/value heads, head dim 128 (the decode shape of bench/decode.py), for each cache
// length given: flashattn::forward_kvcache timed over --repeat calls after one warm-up
// (std::chrono::steady_clock; median and minimum), and the bytes of K and V read per second.
// Before timing, out is compared with attention computed here in double precision from the
// same bf16 values; the program fails (exit 1) past the bf16 tolerance.
//   flashattn_bench_cpu_decode [--batch B] [--repeat N] [--threads T] S [S ...]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/numeric.hpp"
#include "flashattn/flashattn.hpp"

using namespace flashattn;

namespace {

constexpr int64_t kHeads = 32, kHeadsK = 8, kHeadDim = 128;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// out[b][h][:] in double from the bf16 inputs: softmax(q k^T / sqrt(D)) v over all S keys.
double max_error(const std::vector<detail::bfloat16_t>& q, const std::vector<detail::bfloat16_t>& k,
                 const std::vector<detail::bfloat16_t>& v, const std::vector<detail::bfloat16_t>& out,
                 int64_t batch, int64_t s) {
  double worst = 0.0;
  const int64_t group = kHeads / kHeadsK;
  std::vector<double> p(static_cast<size_t>(s));
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < kHeads; ++h) {
      const int64_t hk = h / group;
      const auto* qr = &q[static_cast<size_t>((b * kHeads + h) * kHeadDim)];
      double top = -INFINITY;
      for (int64_t j = 0; j < s; ++j) {
        const auto* kr = &k[static_cast<size_t>(((b * s + j) * kHeadsK + hk) * kHeadDim)];
        double dot = 0.0;
        for (int64_t d = 0; d < kHeadDim; ++d) dot += detail::to_float(qr[d]) * detail::to_float(kr[d]);
        p[static_cast<size_t>(j)] = dot / std::sqrt(double(kHeadDim));
        top = std::max(top, p[static_cast<size_t>(j)]);
      }
      double sum = 0.0;
      for (double& x : p) sum += (x = std::exp(x - top));
      for (int64_t d = 0; d < kHeadDim; ++d) {
        double o = 0.0;
        for (int64_t j = 0; j < s; ++j)
          o += p[static_cast<size_t>(j)] *
               detail::to_float(v[static_cast<size_t>(((b * s + j) * kHeadsK + hk) * kHeadDim + d)]);
        const double got = detail::to_float(out[static_cast<size_t>((b * kHeads + h) * kHeadDim + d)]);
        worst = std::max(worst, std::abs(got - o / sum));
      }
    }
  return worst;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t batch = 1;
  int repeat = 10, threads = 0;
  std::vector<int64_t> lengths;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--batch" && i + 1 < argc) batch = std::atoll(argv[++i]);
    else if (a == "--repeat" && i + 1 < argc) repeat = std::atoi(argv[++i]);
    else if (a == "--threads" && i + 1 < argc) threads = std::atoi(argv[++i]);
    else if (!a.empty() && a[0] != '-') lengths.push_back(std::atoll(a.c_str()));
    else { std::fprintf(stderr, "usage: %s [--batch B] [--repeat N] [--threads T] S [S ...]\n", argv[0]); return 2; }
  }
  if (lengths.empty()) lengths = {8192, 32768};
  std::printf("| batch | cache len | threads (0: all) | splits | median ms | min ms | GB/s of K+V | max abs err |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  std::mt19937_64 rng(std::random_device{}());
  std::normal_distribution<float> normal;
  bool ok = true;
  for (int64_t s : lengths) {
    const auto fill = [&](int64_t n) {
      std::vector<detail::bfloat16_t> x(static_cast<size_t>(n));
      for (auto& e : x) e = detail::from_float<detail::bfloat16_t>(normal(rng));
      return x;
    };
    auto q = fill(batch * kHeads * kHeadDim);
    auto k = fill(batch * s * kHeadsK * kHeadDim), v = fill(batch * s * kHeadsK * kHeadDim);
    std::vector<detail::bfloat16_t> out(q.size());
    std::vector<int32_t> seqlens(static_cast<size_t>(batch), static_cast<int32_t>(s));
    KvCache cache;
    cache.k_cache = TensorView::contiguous(k.data(), DType::BFloat16, {batch, s, kHeadsK, kHeadDim});
    cache.v_cache = TensorView::contiguous(v.data(), DType::BFloat16, {batch, s, kHeadsK, kHeadDim});
    cache.cache_seqlens = TensorView::contiguous(seqlens.data(), DType::Int32, {batch});
    const TensorView qv = TensorView::contiguous(q.data(), DType::BFloat16, {batch, 1, kHeads, kHeadDim});
    const TensorView ov = TensorView::contiguous(out.data(), DType::BFloat16, {batch, 1, kHeads, kHeadDim});
    Execution exec;
    exec.backend = Backend::CPU;
    exec.num_threads = threads;
    RunInfo info = forward_kvcache(qv, cache, ov, std::nullopt, {}, exec);  // warm-up
    const double err = max_error(q, k, v, out, batch, s);
    ok = ok && err < 2e-2;  // bf16 output rounding (2^-8 relative) on values of order 1
    std::vector<double> times;
    for (int r = 0; r < repeat; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      info = forward_kvcache(qv, cache, ov, std::nullopt, {}, exec);
      times.push_back(seconds_since(t0));
    }
    std::sort(times.begin(), times.end());
    const double median = times[times.size() / 2];
    const double bytes = 2.0 * batch * s * kHeadsK * kHeadDim * 2;
    std::printf("| %lld | %lld | %d | %d | %.3f | %.3f | %.2f | %.2e |\n", (long long)batch,
                (long long)s, threads, info.num_splits, median * 1e3, times.front() * 1e3,
                bytes / median / 1e9, err);
  }
  if (!ok) std::printf("FAILED: out differs from the double-precision attention\n");
  return ok ? 0 : 1;
}

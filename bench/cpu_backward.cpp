// flashattn_bench_cpu_backward: the CPU engine's forward + backward (training step) times and
// working memory, against the memory standard attention needs for the same step.
//
// For each (head dim, causal, seqlen): one warm-up, then --repeat timed forward calls and
// backward calls on the same inputs (fresh random, bf16 by default); the table shows medians.
// Standard attention's backward keeps the Sq x Sk probabilities P of every (b, h) from the
// forward and builds dP (then dS in place) of the same size: at least 2 x B x H x Sq x Sk fp32
// beyond the caller's tensors, which is the figure it is compared with (not timed here: the
// forward benchmark, flashattn_bench_cpu, times a naive path). FLOP convention of the GPU
// benchmarks (bench/harness.py):
// fwd = 4 B H Sq Sk D (halved when causal), bwd = 2.5 x fwd.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "flashattn/flashattn.hpp"

namespace {

using flashattn::DType;

template <typename F>
double time_ms(F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> seqlens{512, 1024, 2048, 4096};
  std::vector<int64_t> head_dims{64, 128};
  int64_t batch = 1, heads = 8;
  int repeat = 3;
  float dropout = 0.0f;
  for (int a = 1; a + 1 < argc; a += 2) {
    const std::string opt = argv[a];
    const char* val = argv[a + 1];
    if (opt == "--repeat") repeat = std::atoi(val);
    else if (opt == "--heads") heads = std::atoll(val);
    else if (opt == "--batch") batch = std::atoll(val);
    else if (opt == "--dropout") dropout = std::strtof(val, nullptr);
    else if (opt == "--seqlen") seqlens = {std::atoll(val)};
    else if (opt == "--head-dim") head_dims = {std::atoll(val)};
    else {
      std::fprintf(stderr,
                   "usage: %s [--repeat N] [--heads H] [--batch B] [--dropout P] [--seqlen S] "
                   "[--head-dim D]\n",
                   argv[0]);
      return 2;
    }
  }
  std::printf("B=%lld H=%lld bf16 dropout=%g, median of %d calls after one warm-up\n\n",
              static_cast<long long>(batch), static_cast<long long>(heads), dropout, repeat);
  std::printf("| hdim | causal | seqlen | fwd ms | bwd ms | fwd+bwd GFLOP/s | flashattn bwd memory "
              "| standard attention bwd memory (P + dP, fp32) | ratio |\n");
  std::printf("|---:|:---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (int64_t D : head_dims)
    for (bool causal : {false, true})
      for (int64_t S : seqlens) {
        const size_t n = static_cast<size_t>(batch * S * heads * D);
        std::vector<uint16_t> q = bench::random_bf16(n, 1), k = bench::random_bf16(n, 2), v = bench::random_bf16(n, 3),
                              dout = bench::random_bf16(n, 4), out(n), dq(n), dk(n), dv(n);
        std::vector<float> lse(static_cast<size_t>(batch * heads * S));
        const auto view = [&](std::vector<uint16_t>& x) {
          return flashattn::TensorView::contiguous(x.data(), DType::BFloat16, {batch, S, heads, D});
        };
        const auto lse_view =
            flashattn::TensorView::contiguous(lse.data(), DType::Float32, {batch, heads, S});
        flashattn::Options o;
        o.causal = causal;
        o.dropout_p = dropout;
        size_t workspace = 0;
        const auto fwd = [&] {
          flashattn::forward(view(q), view(k), view(v), view(out), lse_view, o);
        };
        const auto bwd = [&] {
          workspace = flashattn::backward(view(q), view(k), view(v), view(out), view(dout),
                                          lse_view, view(dq), view(dk), view(dv), o)
                          .workspace_bytes;
        };
        fwd();
        bwd();
        std::vector<double> tf, tb;
        for (int r = 0; r < repeat; ++r) {
          tf.push_back(time_ms(fwd));
          tb.push_back(time_ms(bwd));
        }
        const double mf = bench::median(tf), mb = bench::median(tb);
        const double flops_fwd = 4.0 * batch * heads * S * S * D * (causal ? 0.5 : 1.0);
        const double gflops = 3.5 * flops_fwd / ((mf + mb) * 1e-3) / 1e9;
        const double standard = 2.0 * batch * heads * S * S * 4;
        std::printf("| %lld | %s | %lld | %.1f | %.1f | %.1f | %.0f KiB | %.0f MiB | %.0fx |\n",
                    static_cast<long long>(D), causal ? "yes" : "no", static_cast<long long>(S), mf,
                    mb, gflops, workspace / 1024.0, standard / 1048576.0, standard / workspace);
        std::fflush(stdout);
      }
  return 0;
}

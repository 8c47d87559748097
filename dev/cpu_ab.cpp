// dev/cpu_ab.cpp: A/B timing of CPU engine builds in one process. Each argument LIB is a
// libflashattn_c.so (dev/cpu_snapshot.sh builds them); they are dlopen'ed side by side
// (RTLD_LOCAL) and called in alternating rounds (the order rotates every round) on the same
// inputs, so that noise from other processes touches all of them alike. Prints the median
// GFLOP/s of each and the median ratio to the first, plus the max |difference| of outputs.
//   g++ -O2 -std=c++17 -Iinclude dev/cpu_ab.cpp -ldl -o /tmp/cpu_ab/ab
//   /tmp/cpu_ab/ab --seqlen 2048 --hdim 64 --threads 1 --mode fwd --rounds 9 A.so B.so
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "flashattn/flashattn.h"

struct Lib {
  std::string path;
  decltype(&fa_forward) forward;
  decltype(&fa_backward) backward;
  decltype(&fa_options_init) options_init;
  decltype(&fa_execution_init) execution_init;
  decltype(&fa_last_error) last_error;
};

static fa_tensor tensor(float* data, std::vector<int64_t> sizes) {
  fa_tensor t{};
  t.data = data;
  t.dtype = FA_FLOAT32;
  t.device_type = FA_DEVICE_CPU;
  t.ndim = static_cast<int32_t>(sizes.size());
  int64_t stride = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    t.sizes[i] = sizes[i];
    t.strides[i] = stride;
    stride *= sizes[i];
  }
  return t;
}

int main(int argc, char** argv) {
  int seqlen = 2048, hdim = 64, threads = 1, rounds = 7, heads = 8, batch = 1, causal = 0;
  std::string mode = "fwd";
  std::vector<Lib> libs;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&] { return std::string(argv[++i]); };
    if (a == "--seqlen") seqlen = std::stoi(next());
    else if (a == "--hdim") hdim = std::stoi(next());
    else if (a == "--threads") threads = std::stoi(next());
    else if (a == "--rounds") rounds = std::stoi(next());
    else if (a == "--heads") heads = std::stoi(next());
    else if (a == "--causal") causal = std::stoi(next());
    else if (a == "--mode") mode = next();
    else {
      void* h = dlopen(a.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (!h) { std::fprintf(stderr, "%s\n", dlerror()); return 1; }
      Lib l{a,
            reinterpret_cast<decltype(&fa_forward)>(dlsym(h, "fa_forward")),
            reinterpret_cast<decltype(&fa_backward)>(dlsym(h, "fa_backward")),
            reinterpret_cast<decltype(&fa_options_init)>(dlsym(h, "fa_options_init")),
            reinterpret_cast<decltype(&fa_execution_init)>(dlsym(h, "fa_execution_init")),
            reinterpret_cast<decltype(&fa_last_error)>(dlsym(h, "fa_last_error"))};
      libs.push_back(l);
    }
  }
  const bool bwd = mode == "fwdbwd";
  const int64_t n = int64_t{batch} * seqlen * heads * hdim;
  std::mt19937 rng(1);
  std::normal_distribution<float> dist;
  std::vector<float> q(n), k(n), v(n), dout(n);
  for (auto* x : {&q, &k, &v, &dout})
    for (auto& e : *x) e = dist(rng);
  const size_t L = libs.size();
  std::vector<std::vector<float>> out(L, std::vector<float>(n)), dq(L, std::vector<float>(n)),
      dk(L, std::vector<float>(n)), dv(L, std::vector<float>(n)),
      lse(L, std::vector<float>(int64_t{batch} * heads * seqlen));
  std::vector<std::vector<double>> times(L);
  auto call = [&](size_t i) {
    Lib& l = libs[i];
    fa_options o;
    l.options_init(&o);
    o.causal = causal;
    fa_execution e;
    l.execution_init(&e);
    e.backend = FA_BACKEND_CPU;
    e.num_threads = threads;
    fa_tensor tq = tensor(q.data(), {batch, seqlen, heads, hdim}), tk = tensor(k.data(), {batch, seqlen, heads, hdim}),
              tv = tensor(v.data(), {batch, seqlen, heads, hdim}), to = tensor(out[i].data(), {batch, seqlen, heads, hdim}),
              tl = tensor(lse[i].data(), {batch, heads, seqlen}), tdo = tensor(dout.data(), {batch, seqlen, heads, hdim}),
              tdq = tensor(dq[i].data(), {batch, seqlen, heads, hdim}), tdk = tensor(dk[i].data(), {batch, seqlen, heads, hdim}),
              tdv = tensor(dv[i].data(), {batch, seqlen, heads, hdim});
    auto t0 = std::chrono::steady_clock::now();
    if (l.forward(&tq, &tk, &tv, &to, &tl, &o, &e, nullptr) != FA_OK) {
      std::fprintf(stderr, "%s\n", l.last_error()); std::exit(1);
    }
    if (bwd && l.backward(&tq, &tk, &tv, &to, &tdo, &tl, &tdq, &tdk, &tdv, &o, &e, nullptr) != FA_OK) {
      std::fprintf(stderr, "%s\n", l.last_error()); std::exit(1);
    }
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  for (size_t i = 0; i < L; ++i) call(i);  // warm-up
  std::vector<std::vector<double>> ratios(L);
  for (int r = 0; r < rounds; ++r) {
    std::vector<double> t(L);
    for (size_t s = 0; s < L; ++s) {
      size_t i = (s + r) % L;
      t[i] = call(i);
      times[i].push_back(t[i]);
    }
    for (size_t i = 0; i < L; ++i) ratios[i].push_back(t[0] / t[i]);
  }
  double flops = 4.0 * batch * heads * double(seqlen) * seqlen * hdim * (causal ? 0.5 : 1.0) * (bwd ? 3.5 : 1.0);
  auto median = [](std::vector<double> x) { std::sort(x.begin(), x.end()); return x[x.size() / 2]; };
  auto maxdiff = [&](const std::vector<float>& a, const std::vector<float>& b) {
    double m = 0; for (size_t j = 0; j < a.size(); ++j) m = std::max(m, double(std::fabs(a[j] - b[j]))); return m; };
  std::printf("S=%d D=%d causal=%d threads=%d mode=%s rounds=%d\n", seqlen, hdim, causal, threads, mode.c_str(), rounds);
  for (size_t i = 0; i < L; ++i) {
    std::printf("  %-50s %7.2f GFLOP/s (median %.4f s, min %.4f)  x%.3f vs first (median of per-round ratios)",
                libs[i].path.c_str(), flops / median(times[i]) / 1e9, median(times[i]),
                *std::min_element(times[i].begin(), times[i].end()), median(ratios[i]));
    if (i > 0) {
      std::printf("  maxdiff out %.2e", maxdiff(out[0], out[i]));
      if (bwd) std::printf(" dq %.2e dk %.2e dv %.2e", maxdiff(dq[0], dq[i]), maxdiff(dk[0], dk[i]), maxdiff(dv[0], dv[i]));
    }
    std::printf("\n");
  }
}

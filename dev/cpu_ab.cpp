// dev/cpu_ab.cpp: A/B timing of CPU engine builds in one process. Each argument LIB is a
// libflashattn_c.so (dev/cpu_snapshot.sh builds them); they are dlopen'ed side by side
// (RTLD_LOCAL) and called in alternating rounds (the order rotates every round) on the same
// inputs, so that noise from other processes touches all of them alike. Prints the median
// GFLOP/s of each and the median ratio to the first, plus the max |difference| of outputs.
//   g++ -O2 -std=c++17 -Iinclude dev/cpu_ab.cpp -ldl -o /tmp/cpu_ab/ab
//   /tmp/cpu_ab/ab --seqlen 2048 --hdim 64 --threads 1 --mode fwd --rounds 9 A.so B.so
// --mode decode: fa_forward_kvcache, one query token, 32 query heads over 8 KV heads, head dim
// --hdim, a full dense cache of --seqlen positions (--batch, --dtype bf16|fp32), every call
// on the round's copy of K and V, copies that together pass 512 MiB (the round's first call
// finds its cache cold; the others find what is left of it in the last-level cache, a
// little where the cache is far beyond it); GB/s of K+V.
//   /tmp/cpu_ab/ab --mode decode --dtype bf16 --seqlen 32768 --hdim 128 --threads 2 A.so B.so
// In decode mode every call reads a copy of its own (no build finds what the one before it
// left in the last-level cache), and the outputs compared are those of one more call of each
// build on the same copy. A library given as NAME=VALUE,...@LIB has that environment set (and
// every other library's settings unset) before its first call: one build whose knobs are read
// once from the environment, copied under several names, is timed in several settings.
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
  decltype(&fa_forward_kvcache) forward_kvcache;
  decltype(&fa_kvcache_init) kvcache_init;
  std::vector<std::pair<std::string, std::string>> env;  // set before the build's first call
};

static std::string spec_name(const std::vector<std::pair<std::string, std::string>>& env) {
  std::string n;
  for (const auto& kv : env) n += (n.empty() ? "" : ",") + kv.first + "=" + kv.second;
  return n;
}

static fa_tensor raw_tensor(void* data, fa_dtype dtype, std::vector<int64_t> sizes) {
  fa_tensor t{};
  t.data = data;
  t.dtype = dtype;
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

// --mode decode (see the top).
static int decode_ab(std::vector<Lib>& libs, int seqlen, int hdim, int threads, int rounds,
                     int batch, const std::string& dtype) {
  const int64_t H = 32, Hk = 8;
  const bool bf16 = dtype == "bf16";
  const size_t elem = bf16 ? 2 : 4;
  const int64_t cache_elems = int64_t{batch} * seqlen * Hk * hdim;
  const size_t copies = std::max<size_t>(1, (512u << 20) / (2 * cache_elems * elem) + 1);
  std::mt19937 rng(1);
  std::uniform_int_distribution<uint32_t> bits;
  auto fill = [&](std::vector<uint32_t>& x) {
    for (auto& w : x) {
      // bf16 pairs or fp32 values of magnitude below 4: sign, exponent 120..128, mantissa
      const uint32_t r = bits(rng);
      const uint32_t f = (r & 0x807FFFFFu) | ((120u + (r >> 23) % 9) << 23);
      w = bf16 ? ((f >> 16) | (f & 0xFFFF0000u)) : f;
    }
  };
  std::vector<std::vector<uint32_t>> k(copies), v(copies);
  for (size_t c = 0; c < copies; ++c) {
    k[c].resize(cache_elems * elem / 4);
    v[c].resize(cache_elems * elem / 4);
    fill(k[c]);
    fill(v[c]);
  }
  std::vector<uint32_t> q(int64_t{batch} * H * hdim * elem / 4 + 1);
  fill(q);
  std::vector<int32_t> seqlens(batch, seqlen);
  const size_t L = libs.size();
  std::vector<std::vector<uint32_t>> out(L, std::vector<uint32_t>(q.size()));
  const fa_dtype dt = bf16 ? FA_BFLOAT16 : FA_FLOAT32;
  std::vector<std::vector<double>> times(L), ratios(L);
  auto call = [&](size_t i, size_t c) {
    Lib& l = libs[i];
    fa_execution e;
    l.execution_init(&e);
    e.backend = FA_BACKEND_CPU;
    e.num_threads = threads;
    fa_tensor tq = raw_tensor(q.data(), dt, {batch, 1, H, hdim}),
              to = raw_tensor(out[i].data(), dt, {batch, 1, H, hdim}),
              tk = raw_tensor(k[c].data(), dt, {batch, seqlen, Hk, hdim}),
              tv = raw_tensor(v[c].data(), dt, {batch, seqlen, Hk, hdim}),
              ts = raw_tensor(seqlens.data(), FA_INT32, {batch});
    fa_kvcache cache;
    l.kvcache_init(&cache);
    cache.k_cache = &tk;
    cache.v_cache = &tv;
    cache.cache_seqlens = &ts;
    const auto t0 = std::chrono::steady_clock::now();
    if (l.forward_kvcache(&tq, &cache, &to, nullptr, nullptr, &e, nullptr) != FA_OK) {
      std::fprintf(stderr, "%s\n", l.last_error());
      std::exit(1);
    }
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  for (size_t i = 0; i < L; ++i) {  // warm-up, each build with its environment (ENV@LIB)
    for (const auto& other : libs)  // none of another build's settings
      for (const auto& kv : other.env) unsetenv(kv.first.c_str());
    for (const auto& kv : libs[i].env) setenv(kv.first.c_str(), kv.second.c_str(), 1);
    call(i, 0);
  }
  for (int r = 0; r < rounds; ++r) {
    std::vector<double> t(L);
    for (size_t s = 0; s < L; ++s) {
      const size_t i = (s + r) % L;
      // Every call on a copy of its own (cold), every build on the same inputs over the rounds.
      t[i] = call(i, (static_cast<size_t>(r) * L + s + 1) % copies);
      times[i].push_back(t[i]);
    }
    for (size_t i = 0; i < L; ++i) ratios[i].push_back(t[0] / t[i]);
  }
  for (size_t i = 0; i < L; ++i) call(i, 0);  // the outputs compared: all of the same copy
  auto median = [](std::vector<double> x) { std::sort(x.begin(), x.end()); return x[x.size() / 2]; };
  const double bytes = 2.0 * cache_elems * elem;
  std::printf("decode %s B=%d S=%d D=%d threads=%d rounds=%d copies=%zu\n", dtype.c_str(), batch,
              seqlen, hdim, threads, rounds, copies);
  for (size_t i = 0; i < L; ++i)
    std::printf("  %-50s %7.2f GB/s (median %.4f s, min %.4f)  x%.3f vs first%s\n",
                libs[i].path.c_str(), bytes / median(times[i]) / 1e9, median(times[i]),
                *std::min_element(times[i].begin(), times[i].end()), median(ratios[i]),
                i > 0 && out[i] != out[0] ? "  (outputs differ in bits)" : "");
  return 0;
}

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
  std::string mode = "fwd", dtype = "bf16";
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
    else if (a == "--batch") batch = std::stoi(next());
    else if (a == "--dtype") dtype = next();
    else {
      // NAME=VALUE,NAME=VALUE@LIB: environment set before LIB's first call (a build that reads
      // knobs once); copies of one .so under other names load as builds of their own.
      std::vector<std::pair<std::string, std::string>> env;
      const size_t at = a.find('@');
      if (at != std::string::npos) {
        std::string spec = a.substr(0, at);
        a = a.substr(at + 1);
        size_t from = 0;
        while (from < spec.size()) {
          size_t comma = spec.find(',', from);
          if (comma == std::string::npos) comma = spec.size();
          const std::string kv = spec.substr(from, comma - from);
          const size_t eq = kv.find('=');
          if (eq != std::string::npos) env.emplace_back(kv.substr(0, eq), kv.substr(eq + 1));
          from = comma + 1;
        }
      }
      void* h = dlopen(a.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (!h) { std::fprintf(stderr, "%s\n", dlerror()); return 1; }
      Lib l{a,
            reinterpret_cast<decltype(&fa_forward)>(dlsym(h, "fa_forward")),
            reinterpret_cast<decltype(&fa_backward)>(dlsym(h, "fa_backward")),
            reinterpret_cast<decltype(&fa_options_init)>(dlsym(h, "fa_options_init")),
            reinterpret_cast<decltype(&fa_execution_init)>(dlsym(h, "fa_execution_init")),
            reinterpret_cast<decltype(&fa_last_error)>(dlsym(h, "fa_last_error")),
            reinterpret_cast<decltype(&fa_forward_kvcache)>(dlsym(h, "fa_forward_kvcache")),
            reinterpret_cast<decltype(&fa_kvcache_init)>(dlsym(h, "fa_kvcache_init")), env};
      if (!env.empty()) l.path = spec_name(env) + "@" + l.path;
      libs.push_back(l);
    }
  }
  if (mode == "decode") return decode_ab(libs, seqlen, hdim, threads, rounds, batch, dtype);
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

// flashattn_bench_cpu_decode: decoding with a KV cache on the CPU backend, against the
// machine's own memory read bandwidth measured in the same run with the same threads.
//
// One query token per sequence against a full cache (B, S, Hk, D) (or the same positions in
// pages of a shuffled block table, --page-size), 32 query heads over 8 key/value heads, head
// dim 128 (the decode shape of bench/decode.py), for every dtype x batch x cache length given:
// flashattn::forward_kvcache timed over --repeat calls after one warm-up
// (std::chrono::steady_clock; median and minimum), and the bytes of K and V read per second,
// B * S * Hk * D * 2 * sizeof(element) / time.
//
// Read bandwidth: every thread of the same team (--threads; 0 = OpenMP's default, the count
// is printed) sums its static share of a --bw-mib buffer of 64-bit words as 8 streams (first
// touched by the same threads), best of --bw-runs passes; measured before the first point and again after
// the last, and the best of both is the denominator of "fraction" (ours at the median time /
// read bandwidth). The same read is also measured just before and just after each point's
// timed calls, and "fraction of that" divides by the better of those two: this VM's memory
// switches between states (fp32 decoding 29 or 41 GB/s, the read 44 or 66, minutes apart), and
// a point and a read minutes apart may have seen different ones. The caches are cold:
// consecutive calls read different copies of K and V that together are at least --rotate-mib,
// so no call finds its cache in the last-level cache.
//
// Before timing, out is compared with attention computed here in double precision from the
// same stored values; the program fails (exit 1) past the dtype's tolerance.
//
//   flashattn_bench_cpu_decode [--batch 1,4,8] [--dtype bf16,fp32] [--threads T] [--repeat N]
//       [--page-size P] [--rotate-mib M] [--bw-mib M] [--bw-runs N] [--json FILE] [S ...]
//   (default cache lengths 4096 16384 32768)
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <numeric>
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

std::vector<int64_t> int_list(const std::string& text) {
  std::vector<int64_t> v;
  size_t at = 0;
  while (at < text.size()) {
    const size_t comma = text.find(',', at);
    const std::string part = text.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
    if (!part.empty()) v.push_back(std::atoll(part.c_str()));
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  return v;
}

std::vector<std::string> word_list(const std::string& text) {
  std::vector<std::string> v;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t comma = text.find(',', at);
    const std::string part = text.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
    if (!part.empty()) v.push_back(part);
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  return v;
}

// Bytes per second of a read of `words` 64-bit words by `threads` threads, each summing its
// static share; the best of `runs` passes.
double read_bandwidth(std::vector<uint64_t>& buffer, int threads, int runs) {
  const int64_t n = static_cast<int64_t>(buffer.size());
  uint64_t* data = buffer.data();
  double best = 0.0;
  volatile uint64_t sink = 0;
  for (int r = 0; r < runs; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    uint64_t sum = 0;
    // Each thread reads its share as 8 streams in lockstep: one sequential stream a thread
    // read 21-25 GB/s on the 2-core VM where fp32 decoding itself read 27, so it was no
    // ceiling; 8 streams read 27.5 (2026-12-06).
#pragma omp parallel num_threads(threads) reduction(+ : sum)
    {
      constexpr int kStreams = 8;
      const int t = omp_get_thread_num(), nt = omp_get_num_threads();
      const int64_t begin = n * t / nt, end = n * (t + 1) / nt;
      const int64_t len = (end - begin) / kStreams / 8 * 8;
      uint64_t part[kStreams] = {};
      for (int64_t i = 0; i < len; i += 8)
        for (int s = 0; s < kStreams; ++s) {
          const uint64_t* x = data + begin + s * len + i;
          part[s] += x[0] + x[1] + x[2] + x[3] + x[4] + x[5] + x[6] + x[7];
        }
      for (int64_t i = begin + kStreams * len; i < end; ++i) part[0] += data[i];
      for (int s = 0; s < kStreams; ++s) sum += part[s];
    }
    const double s = seconds_since(t0);
    sink = sink + sum;
    best = std::max(best, static_cast<double>(n) * sizeof(uint64_t) / s);
  }
  return best;
}

double load_average() {
  double one = -1.0;
  if (FILE* f = std::fopen("/proc/loadavg", "r")) {
    if (std::fscanf(f, "%lf", &one) != 1) one = -1.0;
    std::fclose(f);
  }
  return one;
}

// Uniform on [-sqrt(3), sqrt(3)) (unit variance), rounded to T: cheap enough for gigabytes.
template <typename T>
void fill_random(std::vector<T>& x, uint64_t seed) {
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
#pragma omp parallel for schedule(static) firstprivate(s)
  for (int64_t i = 0; i < static_cast<int64_t>(x.size()); ++i) {
    uint64_t z = s + static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull;  // splitmix64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float u = static_cast<float>(z >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    x[static_cast<size_t>(i)] = detail::from_float<T>((2.0f * u - 1.0f) * 1.7320508f);
  }
}

struct Layout {
  int64_t batch, seqlen, page_size;   // page_size 0: dense
  std::vector<int32_t> block_table;   // (batch, pages_per_seq)
  int64_t pages_per_seq() const { return page_size == 0 ? 0 : (seqlen + page_size - 1) / page_size; }
  int64_t elements() const {
    return (page_size == 0 ? batch * seqlen : batch * pages_per_seq() * page_size) * kHeadsK * kHeadDim;
  }
  // The element offset of (sequence b, position j, head 0, dim 0).
  int64_t row(int64_t b, int64_t j) const {
    if (page_size == 0) return (b * seqlen + j) * kHeadsK * kHeadDim;
    const int64_t page = block_table[static_cast<size_t>(b * pages_per_seq() + j / page_size)];
    return (page * page_size + j % page_size) * kHeadsK * kHeadDim;
  }
};

// max |out - softmax(q k^T / sqrt(D)) v| over every output element, the attention computed in
// double from the stored values.
template <typename T>
double max_error(const std::vector<T>& q, const std::vector<T>& k, const std::vector<T>& v,
                 const std::vector<T>& out, const Layout& at) {
  const int64_t group = kHeads / kHeadsK, s = at.seqlen;
  double worst = 0.0;
#pragma omp parallel for schedule(dynamic, 1) reduction(max : worst)
  for (int64_t bh = 0; bh < at.batch * kHeads; ++bh) {
    const int64_t b = bh / kHeads, h = bh % kHeads, hk = h / group;
    std::vector<double> p(static_cast<size_t>(s)), o(kHeadDim, 0.0);
    const T* qr = &q[static_cast<size_t>(bh * kHeadDim)];
    double top = -INFINITY;
    for (int64_t j = 0; j < s; ++j) {
      const T* kr = &k[static_cast<size_t>(at.row(b, j) + hk * kHeadDim)];
      double dot = 0.0;
      for (int64_t d = 0; d < kHeadDim; ++d)
        dot += double(detail::to_float(qr[d])) * double(detail::to_float(kr[d]));
      p[static_cast<size_t>(j)] = dot / std::sqrt(double(kHeadDim));
      top = std::max(top, p[static_cast<size_t>(j)]);
    }
    double sum = 0.0;
    for (int64_t j = 0; j < s; ++j) {
      const double e = std::exp(p[static_cast<size_t>(j)] - top);
      sum += e;
      const T* vr = &v[static_cast<size_t>(at.row(b, j) + hk * kHeadDim)];
      for (int64_t d = 0; d < kHeadDim; ++d) o[static_cast<size_t>(d)] += e * detail::to_float(vr[d]);
    }
    for (int64_t d = 0; d < kHeadDim; ++d) {
      const double got = detail::to_float(out[static_cast<size_t>(bh * kHeadDim + d)]);
      worst = std::max(worst, std::abs(got - o[static_cast<size_t>(d)] / sum));
    }
  }
  return worst;
}

struct BenchOptions {
  std::vector<int64_t> batches{1, 4, 8}, lengths;
  std::vector<std::string> dtypes{"bf16", "fp32"};
  int repeat = 10, threads = 0, bw_runs = 5;
  int64_t page_size = 0, rotate_mib = 1024, bw_mib = 1024;
  std::string json;
};

struct Row {
  std::string dtype;
  int64_t batch, seqlen, copies;
  int splits;
  double median_ms, min_ms, gbps, gbps_best, fraction, err;
  double bw_near, fraction_near;  // the better read bandwidth of those just before and after its calls
  bool ok;
};

template <typename T>
Row run_point(const BenchOptions& o, const std::string& dtype_name, DType dtype, int64_t batch,
              int64_t s, double bandwidth, uint64_t seed, const std::function<double()>& probe) {
  Layout at{batch, s, o.page_size, {}};
  if (o.page_size > 0) {  // every page of every sequence, in a shuffled order
    at.block_table.resize(static_cast<size_t>(batch * at.pages_per_seq()));
    std::iota(at.block_table.begin(), at.block_table.end(), 0);
    std::shuffle(at.block_table.begin(), at.block_table.end(), std::mt19937_64(seed));
  }
  const int64_t elements = at.elements();
  const double kv_bytes = 2.0 * static_cast<double>(elements) * sizeof(T);
  const int64_t copies =
      std::max<int64_t>(1, static_cast<int64_t>(std::ceil(o.rotate_mib * 1048576.0 / kv_bytes)));
  std::vector<std::vector<T>> k(static_cast<size_t>(copies)), v(static_cast<size_t>(copies));
  for (int64_t c = 0; c < copies; ++c) {
    k[static_cast<size_t>(c)].resize(static_cast<size_t>(elements));
    v[static_cast<size_t>(c)].resize(static_cast<size_t>(elements));
    fill_random(k[static_cast<size_t>(c)], seed + 3 * c + 1);
    fill_random(v[static_cast<size_t>(c)], seed + 3 * c + 2);
  }
  std::vector<T> q(static_cast<size_t>(batch * kHeads * kHeadDim)), out(q.size());
  fill_random(q, seed);
  std::vector<int32_t> seqlens(static_cast<size_t>(batch), static_cast<int32_t>(s));
  const int64_t cache_rows = o.page_size == 0 ? batch : batch * at.pages_per_seq();
  const int64_t cache_len = o.page_size == 0 ? s : o.page_size;
  const auto cache_of = [&](int64_t c) {
    KvCache cache;
    cache.k_cache = TensorView::contiguous(k[static_cast<size_t>(c)].data(), dtype,
                                           {cache_rows, cache_len, kHeadsK, kHeadDim});
    cache.v_cache = TensorView::contiguous(v[static_cast<size_t>(c)].data(), dtype,
                                           {cache_rows, cache_len, kHeadsK, kHeadDim});
    cache.cache_seqlens = TensorView::contiguous(seqlens.data(), DType::Int32, {batch});
    if (o.page_size > 0)
      cache.block_table = TensorView::contiguous(at.block_table.data(), DType::Int32,
                                                 {batch, at.pages_per_seq()});
    return cache;
  };
  const TensorView qv = TensorView::contiguous(q.data(), dtype, {batch, 1, kHeads, kHeadDim});
  const TensorView ov = TensorView::contiguous(out.data(), dtype, {batch, 1, kHeads, kHeadDim});
  Execution exec;
  exec.backend = Backend::CPU;
  exec.num_threads = o.threads;
  RunInfo info = forward_kvcache(qv, cache_of(0), ov, std::nullopt, {}, exec);  // warm-up
  Row row;
  row.err = max_error(q, k[0], v[0], out, at);
  // Output rounding (2^-8 relative for bf16, 2^-11 fp16) on values of order 1; fp32 sums.
  row.ok = row.err < (dtype == DType::Float32 ? 1e-4 : 2e-2);
  std::vector<double> times;
  const double bw_first = probe();
  for (int r = 0; r < o.repeat; ++r) {
    const KvCache cache = cache_of((r + 1) % copies);
    const auto t0 = std::chrono::steady_clock::now();
    info = forward_kvcache(qv, cache, ov, std::nullopt, {}, exec);
    times.push_back(seconds_since(t0));
  }
  row.bw_near = std::max(bw_first, probe());
  std::sort(times.begin(), times.end());
  const double bytes = 2.0 * batch * s * kHeadsK * kHeadDim * sizeof(T);  // what is read
  row.dtype = dtype_name;
  row.batch = batch;
  row.seqlen = s;
  row.copies = copies;
  row.splits = info.num_splits;
  row.median_ms = times[times.size() / 2] * 1e3;
  row.min_ms = times.front() * 1e3;
  row.gbps = bytes / (row.median_ms * 1e-3) / 1e9;
  row.gbps_best = bytes / (row.min_ms * 1e-3) / 1e9;
  row.fraction = row.gbps * 1e9 / bandwidth;
  row.fraction_near = row.gbps * 1e9 / row.bw_near;
  return row;
}

int usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s [--batch 1,4,8] [--dtype bf16,fp32,fp16] [--threads T] [--repeat N]\n"
               "          [--page-size P] [--rotate-mib M] [--bw-mib M] [--bw-runs N] [--json FILE] [S ...]\n",
               argv0);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  BenchOptions o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--batch" && has_value) o.batches = int_list(argv[++i]);
    else if (a == "--dtype" && has_value) o.dtypes = word_list(argv[++i]);
    else if (a == "--repeat" && has_value) o.repeat = std::max(1, std::atoi(argv[++i]));
    else if (a == "--threads" && has_value) o.threads = std::atoi(argv[++i]);
    else if (a == "--page-size" && has_value) o.page_size = std::atoll(argv[++i]);
    else if (a == "--rotate-mib" && has_value) o.rotate_mib = std::atoll(argv[++i]);
    else if (a == "--bw-mib" && has_value) o.bw_mib = std::max<int64_t>(1, std::atoll(argv[++i]));
    else if (a == "--bw-runs" && has_value) o.bw_runs = std::max(1, std::atoi(argv[++i]));
    else if (a == "--json" && has_value) o.json = argv[++i];
    else if (!a.empty() && a[0] != '-') {
      for (int64_t s : int_list(a)) o.lengths.push_back(s);
    } else return usage(argv[0]);
  }
  if (o.lengths.empty()) o.lengths = {4096, 16384, 32768};
  for (const std::string& d : o.dtypes)
    if (d != "bf16" && d != "fp32" && d != "fp16") return usage(argv[0]);
  const int threads = o.threads > 0 ? o.threads : omp_get_max_threads();
  o.threads = threads;  // the library gets the same count the bandwidth was measured with

  std::vector<uint64_t> buffer(static_cast<size_t>(o.bw_mib * 1048576 / sizeof(uint64_t)));
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < static_cast<int64_t>(buffer.size()); ++i) buffer[static_cast<size_t>(i)] = static_cast<uint64_t>(i);
  const double bw_before = read_bandwidth(buffer, threads, o.bw_runs);
  std::printf("threads: %d (OpenMP, for both the read bandwidth and forward_kvcache); cores online: %d\n",
              threads, omp_get_num_procs());
  std::printf("read bandwidth before: %.2f GB/s (sum of a %lld MiB buffer, best of %d); load average %.2f\n",
              bw_before / 1e9, static_cast<long long>(o.bw_mib), o.bw_runs, load_average());
  std::printf("shape: 1 query token, %lld query heads over %lld KV heads, head dim %lld, %s cache, full cache_seqlens\n\n",
              static_cast<long long>(kHeads), static_cast<long long>(kHeadsK), static_cast<long long>(kHeadDim),
              o.page_size == 0 ? "dense" : ("paged (page " + std::to_string(o.page_size) + ", shuffled)").c_str());
  std::fflush(stdout);
  const auto print_row = [](FILE* f, const Row& r) {
    std::fprintf(f, "| %s | %lld | %lld | %d | %.3f | %.3f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2e%s |\n",
                 r.dtype.c_str(), static_cast<long long>(r.batch), static_cast<long long>(r.seqlen),
                 r.splits, r.median_ms, r.min_ms, r.gbps, r.gbps_best, r.fraction, r.bw_near / 1e9,
                 r.fraction_near, r.err, r.ok ? "" : " FAILED");
    std::fflush(f);
  };
  const char* header =
      "| dtype | batch | cache len | splits | median ms | min ms | GB/s of K+V (median) | GB/s (min) | fraction of read bw | read bw next to it | fraction of that | max abs err |\n"
      "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  std::fprintf(stderr, "progress (fraction of the first bandwidth measurement):\n%s", header);
  std::vector<Row> rows;
  bool ok = true;
  uint64_t seed = 1;
  const auto probe = [&] { return read_bandwidth(buffer, threads, o.bw_runs); };
  for (const std::string& d : o.dtypes)
    for (int64_t batch : o.batches)
      for (int64_t s : o.lengths) {
        Row r = d == "bf16"   ? run_point<detail::bfloat16_t>(o, d, DType::BFloat16, batch, s, bw_before, seed, probe)
                : d == "fp16" ? run_point<detail::half_t>(o, d, DType::Float16, batch, s, bw_before, seed, probe)
                              : run_point<float>(o, d, DType::Float32, batch, s, bw_before, seed, probe);
        seed += 1000;
        ok = ok && r.ok;
        print_row(stderr, r);
        rows.push_back(r);
      }
  const double bw_after = read_bandwidth(buffer, threads, o.bw_runs);
  const double bw = std::max(bw_before, bw_after);
  std::printf("read bandwidth after: %.2f GB/s; load average %.2f\n", bw_after / 1e9, load_average());
  std::printf("fraction = GB/s of K+V at the median time / %.2f GB/s (the better of both); fraction of "
              "that = the same / the better of the read bandwidths measured just before and just after "
              "the point's timed calls\n\n%s", bw / 1e9, header);
  for (Row& r : rows) {
    r.fraction = r.gbps * 1e9 / bw;
    print_row(stdout, r);
  }
  if (!o.json.empty()) {
    std::ofstream f(o.json);
    f << "{\"meta\": {\"threads\": " << threads << ", \"cores_online\": " << omp_get_num_procs()
      << ", \"read_bandwidth_gbps\": " << bw / 1e9 << ", \"read_bandwidth_before_gbps\": " << bw_before / 1e9
      << ", \"read_bandwidth_after_gbps\": " << bw_after / 1e9 << ", \"bw_mib\": " << o.bw_mib
      << ", \"rotate_mib\": " << o.rotate_mib << ", \"page_size\": " << o.page_size
      << ", \"heads\": " << kHeads << ", \"heads_k\": " << kHeadsK << ", \"head_dim\": " << kHeadDim
      << "},\n \"rows\": [";
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      f << (i ? ",\n  " : "\n  ") << "{\"dtype\": \"" << r.dtype << "\", \"batch\": " << r.batch
        << ", \"seqlen\": " << r.seqlen << ", \"splits\": " << r.splits << ", \"copies\": " << r.copies
        << ", \"median_ms\": " << r.median_ms << ", \"min_ms\": " << r.min_ms << ", \"gbps\": " << r.gbps
        << ", \"gbps_min_time\": " << r.gbps_best << ", \"fraction_of_read_bw\": " << r.fraction
        << ", \"read_bw_near_gbps\": " << r.bw_near / 1e9 << ", \"fraction_of_read_bw_near\": " << r.fraction_near
        << ", \"max_abs_err\": " << r.err << ", \"ok\": " << (r.ok ? "true" : "false") << "}";
    }
    f << "\n]}\n";
  }
  if (!ok) std::printf("FAILED: out differs from the double-precision attention\n");
  return ok ? 0 : 1;
}

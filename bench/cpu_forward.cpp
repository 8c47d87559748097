// flashattn_bench_cpu: the CPU forward engine against naive standard attention.
//
// For every (head dim, causal, seqlen) of the grid, both paths run on the same random inputs
// (q, k, v of shape (B, S, H, D), Sq = Sk = S):
//   flashattn  flashattn::forward on the CPU backend; its extra memory is RunInfo::workspace_bytes.
//   naive      standard attention written here: S = scale * Q K^T for all (b, h) in one fp32
//              buffer of B*H*Sq*Sk floats, the causal mask (bottom-right aligned), a row-wise
//              softmax in place, then O = P V. Three passes over the whole S matrix, each one
//              OpenMP-parallel, with the same tile loops as the engine (64x64 score tiles from a
//              packed, transposed K; 64-key steps of P V from packed V rows; both register-
//              blocked 4 rows x 32 columns) and the same vectorisable exp. Its extra memory is
//              every buffer it allocates: S, packed K^T, packed V, an accumulator tile per
//              thread, and for fp16/bf16 an fp32 copy of Q.
// Each path gets one warm-up call, then --repeat timed calls (std::chrono::steady_clock);
// the table shows the median and the minimum. The naive buffers are allocated once per size
// and first touched by the warm-up call (as a caching allocator would hold them), so the
// naive times hold no page faults; the engine's times include its own (small) allocation.
// GFLOP/s use the convention fwd = 4*B*H*Sq*Sk*D, halved when causal, for both paths (the
// naive path computes the masked half anyway, as standard attention does).
// The program fails (exit 1) when the two outputs differ by more than the dtype's tolerance.
#include <omp.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <exception>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "common/numeric.hpp"
#include "cpu/exp_approx.hpp"
#include "cpu/kernels.hpp"
#include "flashattn/flashattn.hpp"

namespace {

using flashattn::detail::bfloat16_t;
using flashattn::detail::from_float;
using flashattn::detail::half_t;
using flashattn::detail::to_float;

// The naive path's own loop (the softmax over a whole row of S) is compiled for the same
// instruction sets as the engine's kernels (FA_CPU_DISPATCH, src/cpu/kernels.hpp).

constexpr int kTile = 64;  // rows and keys per tile, as in the engine
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---------------------------------------------------------------------------------------------
// Naive standard attention.

// S[i][0..cols) = scale * (q_i . kt) for i < rows, through the engine's own score kernel
// (cpu::score_tile: 4 rows x 32 keys register-blocked, per-processor instruction set). It
// wants contiguous rows, so Q rows are staged into `stage_q` and the 64-wide result tile
// `stage_s` is copied (scaled) into S: the only extra work the naive path does.
void naive_score_tile(const float* q, int64_t q_ld, const float* kt, float* s, int64_t s_ld,
                      int rows, int cols, int head_dim, float scale, float* stage_q,
                      float* stage_s) {
  for (int i = 0; i < rows; ++i)
    std::memcpy(stage_q + static_cast<int64_t>(i) * head_dim, q + i * q_ld,
                sizeof(float) * static_cast<size_t>(head_dim));
  flashattn::detail::cpu::score_tile(stage_q, kt, stage_s, rows, head_dim);
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < cols; ++j) s[i * s_ld + j] = scale * stage_s[i * kTile + j];
}

// Masks keys [visible_end, n) of one row of S, then turns the row into probabilities in place.
// A row that sees no key becomes all zeros (the engine's out = 0 for such rows).
FA_CPU_DISPATCH void naive_softmax_row(float* row, int64_t n, int64_t visible_end) {
  for (int64_t j = visible_end; j < n; ++j) row[j] = kNegInf;
  float max = kNegInf;
#pragma omp simd reduction(max : max)
  for (int64_t j = 0; j < n; ++j) max = row[j] > max ? row[j] : max;
  if (max == kNegInf) {
    for (int64_t j = 0; j < n; ++j) row[j] = 0.0f;
    return;
  }
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    const float p = flashattn::detail::cpu::exp_approx(row[j] - max);
    row[j] = p;
    sum += p;
  }
  const float inv = 1.0f / sum;
  for (int64_t j = 0; j < n; ++j) row[j] *= inv;
}

// acc[i][:] += sum_{j < cols} P[i][j] * v[j][:] for i < rows, through the engine's own P.V
// kernel (cpu::accumulate_pv), with the 64-wide slice of P staged into `stage_p`.
void naive_pv_tile(const float* p, int64_t p_ld, const float* v, float* acc, int rows,
                   int cols, int head_dim_v, float* stage_p) {
  for (int i = 0; i < rows; ++i)
    std::memcpy(stage_p + i * kTile, p + i * p_ld, sizeof(float) * static_cast<size_t>(cols));
  flashattn::detail::cpu::accumulate_pv(stage_p, v, acc, rows, cols, head_dim_v);
}

// 64-byte aligned fp32 buffer; counts what it allocates.
struct FloatBuffer {
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float[], Free> data;
  size_t bytes = 0;

  FloatBuffer() = default;
  explicit FloatBuffer(size_t floats) {
    bytes = (floats * sizeof(float) + 63) / 64 * 64;
    if (bytes == 0) return;
    data.reset(static_cast<float*>(std::aligned_alloc(64, bytes)));
    if (!data) throw std::bad_alloc();
  }
  float* get() const { return data.get(); }
};

struct Problem {
  int64_t batch, seqlen, heads, head_dim;
  bool causal;
  float scale;
};

// Everything the naive path allocates, sized once per problem.
struct NaiveBuffers {
  FloatBuffer s;    // B*H x Sq x Sk: the materialised scores, then probabilities
  FloatBuffer kt;   // B*H x (Sk/64 panels) x D x 64: K transposed and packed, zero-padded
  FloatBuffer v;    // B*H x Sk x D: V packed per head
  FloatBuffer q;    // B x Sq x H x D in fp32 (fp16/bf16 inputs only)
  FloatBuffer acc;  // threads x 64 x D: one output accumulator tile per thread
  FloatBuffer stage;  // threads x (64 x D + 64 x 64): tiles staged for the engine's kernels

  static size_t s_bytes(const Problem& p) {
    return static_cast<size_t>(p.batch * p.heads * p.seqlen * p.seqlen) * sizeof(float);
  }
  NaiveBuffers(const Problem& p, bool convert_q, int threads) {
    const int64_t bh = p.batch * p.heads, panels = (p.seqlen + kTile - 1) / kTile;
    s = FloatBuffer(static_cast<size_t>(bh * p.seqlen * p.seqlen));
    kt = FloatBuffer(static_cast<size_t>(bh * panels * p.head_dim * kTile));
    v = FloatBuffer(static_cast<size_t>(bh * p.seqlen * p.head_dim));
    if (convert_q) q = FloatBuffer(static_cast<size_t>(bh * p.seqlen * p.head_dim));
    acc = FloatBuffer(static_cast<size_t>(threads) * kTile * static_cast<size_t>(p.head_dim));
    stage = FloatBuffer(static_cast<size_t>(threads) * stage_floats(p));
  }
  static size_t stage_floats(const Problem& p) {
    return static_cast<size_t>(kTile * p.head_dim + kTile * kTile);
  }
  float* stage_of_thread(const Problem& p) const {
    return stage.get() + static_cast<size_t>(omp_get_thread_num()) * stage_floats(p);
  }
  size_t bytes() const { return s.bytes + kt.bytes + v.bytes + q.bytes + acc.bytes + stage.bytes; }
};

// Standard attention: pack K and V, S = scale Q K^T, mask + softmax, O = P V. Every phase
// covers all (b, h) before the next one starts: S is materialised in full.
template <typename T>
void naive_forward(const Problem& p, const T* q, const T* k, const T* v, T* out,
                   NaiveBuffers& buf, int threads) {
  const int64_t B = p.batch, S = p.seqlen, H = p.heads, D = p.head_dim;
  const int64_t panels = (S + kTile - 1) / kTile, row_ld = H * D;  // (B, S, H, D) layout
  const int64_t bh_count = B * H;

  // Phase 0: K -> transposed panels, V -> contiguous rows per head, converted to fp32.
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
  for (int64_t bh = 0; bh < bh_count; ++bh)
    for (int64_t panel = 0; panel < panels; ++panel) {
      const int64_t b = bh / H, h = bh % H;
      float* kt = buf.kt.get() + (bh * panels + panel) * D * kTile;
      for (int j = 0; j < kTile; ++j) {
        const int64_t key = panel * kTile + j;
        if (key < S) {
          const T* krow = k + (b * S + key) * row_ld + h * D;
          const T* vrow = v + (b * S + key) * row_ld + h * D;
          float* vdst = buf.v.get() + (bh * S + key) * D;
          for (int64_t d = 0; d < D; ++d) kt[d * kTile + j] = to_float(krow[d]);
          for (int64_t d = 0; d < D; ++d) vdst[d] = to_float(vrow[d]);
        } else {
          for (int64_t d = 0; d < D; ++d) kt[d * kTile + j] = 0.0f;
        }
      }
    }
  const float* q32 = nullptr;
  if constexpr (std::is_same_v<T, float>) {
    q32 = q;
  } else {
    const int64_t n = B * S * H * D;
    float* dst = buf.q.get();
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < n; ++i) dst[i] = to_float(q[i]);
    q32 = dst;
  }

  // Phase 1: S = scale * Q K^T, tile by tile, for every (b, h).
  const int64_t row_blocks = (S + kTile - 1) / kTile;
#pragma omp parallel for collapse(3) schedule(static) num_threads(threads)
  for (int64_t bh = 0; bh < bh_count; ++bh)
    for (int64_t ib = 0; ib < row_blocks; ++ib)
      for (int64_t panel = 0; panel < panels; ++panel) {
        const int64_t b = bh / H, h = bh % H, i0 = ib * kTile, j0 = panel * kTile;
        const int rows = static_cast<int>(std::min<int64_t>(kTile, S - i0));
        const int cols = static_cast<int>(std::min<int64_t>(kTile, S - j0));
        float* stage = buf.stage_of_thread(p);
        naive_score_tile(q32 + (b * S + i0) * row_ld + h * D, row_ld,
                         buf.kt.get() + (bh * panels + panel) * D * kTile,
                         buf.s.get() + (bh * S + i0) * S + j0, S, rows, cols,
                         static_cast<int>(D), p.scale, stage, stage + kTile * D);
      }

  // Phase 2: causal mask (key j visible to query i iff j <= i + Sk - Sq) and softmax per row.
  const int64_t seqlen_q = S, seqlen_k = S;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t row = 0; row < bh_count * seqlen_q; ++row) {
    const int64_t i = row % seqlen_q;
    const int64_t end =
        p.causal ? std::clamp<int64_t>(i + seqlen_k - seqlen_q + 1, 0, seqlen_k) : seqlen_k;
    naive_softmax_row(buf.s.get() + row * seqlen_k, seqlen_k, end);
  }

  // Phase 3: O = P V, 64 query rows at a time through a per-thread accumulator tile.
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
  for (int64_t bh = 0; bh < bh_count; ++bh)
    for (int64_t ib = 0; ib < row_blocks; ++ib) {
      const int64_t b = bh / H, h = bh % H, i0 = ib * kTile;
      const int rows = static_cast<int>(std::min<int64_t>(kTile, S - i0));
      float* acc = buf.acc.get() + static_cast<int64_t>(omp_get_thread_num()) * kTile * D;
      std::fill(acc, acc + rows * D, 0.0f);
      const float* prow = buf.s.get() + (bh * S + i0) * S;
      for (int64_t j0 = 0; j0 < S; j0 += kTile) {
        const int cols = static_cast<int>(std::min<int64_t>(kTile, S - j0));
        naive_pv_tile(prow + j0, S, buf.v.get() + (bh * S + j0) * D, acc, rows, cols,
                      static_cast<int>(D), buf.stage_of_thread(p));
      }
      for (int r = 0; r < rows; ++r) {
        T* o = out + (b * S + i0 + r) * row_ld + h * D;
        for (int64_t d = 0; d < D; ++d) o[d] = from_float<T>(acc[r * D + d]);
      }
    }
}

// ---------------------------------------------------------------------------------------------
// Inputs, timing, reporting.

// Deterministic inputs independent of the thread count: a hash of (seed, index) mapped to a
// uniform value of unit variance, so that scores scale * q.k have unit variance too.
uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

template <typename T>
std::vector<T> random_tensor(size_t n, uint64_t seed, int threads) {
  std::vector<T> t(n);
  const float half_width = std::sqrt(3.0f);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (size_t i = 0; i < n; ++i) {
    const uint64_t r = splitmix64(seed * 0x100000001b3ull + i);
    const float u = static_cast<float>(r >> 40) * 0x1p-24f;  // [0, 1)
    t[i] = from_float<T>((2.0f * u - 1.0f) * half_width);
  }
  return t;
}

struct Timing {
  std::vector<double> ms;
  double median() const {
    std::vector<double> s = ms;
    std::sort(s.begin(), s.end());
    const size_t n = s.size();
    return n % 2 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
  }
  double min() const { return *std::min_element(ms.begin(), ms.end()); }
};

template <typename F>
Timing time_calls(int repeat, F&& call) {
  call();  // warm-up
  Timing t;
  for (int r = 0; r < repeat; ++r) {
    const auto start = std::chrono::steady_clock::now();
    call();
    const auto stop = std::chrono::steady_clock::now();
    t.ms.push_back(std::chrono::duration<double, std::milli>(stop - start).count());
  }
  return t;
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", bytes, units[u]);
  return buf;
}

std::string format_number(const char* fmt, double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, x);
  return buf;
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) {
        size_t start = line.find_first_not_of(" \t", colon + 1);
        return start == std::string::npos ? "" : line.substr(start);
      }
    }
  return "unknown CPU";
}

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S UTC", &tm);
  return buf;
}

// The command line as typed, with arguments quoted where a shell would need it.
std::string command_line(int argc, char** argv) {
  std::string cmd;
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    const bool plain = !a.empty() && a.find_first_not_of(
                                         "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                         "0123456789-_=./,:+") == std::string::npos;
    if (!plain) {
      std::string q = "'";
      for (char c : a) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
      a = q + "'";
    }
    cmd += (i ? " " : "") + a;
  }
  return cmd;
}

struct Config {
  std::vector<int64_t> seqlens{512, 1024, 2048, 4096};
  std::vector<int64_t> head_dims{64, 128};
  int64_t heads = 16;
  int64_t batch = 1;
  std::string dtype = "fp32";
  int repeat = 5;
  int threads = 0;
  std::string json_path;
  double naive_max_gib = 4.0;
  bool no_causal = false, only_causal = false;
};

// The largest |flashattn - naive| that still counts as the same result: for fp32 the engine
// and the naive path differ only in summation order; fp16/bf16 outputs may also round to
// neighbouring values of the storage type (these bounds are a few ulp at |o| < 4).
double tolerance(flashattn::DType dtype) {
  switch (dtype) {
    case flashattn::DType::Float16:
      return 1e-2;
    case flashattn::DType::BFloat16:
      return 5e-2;
    default:
      return 1e-3;
  }
}

template <typename T>
nlohmann::json run_case(const Config& cfg, flashattn::DType dtype, int threads, int64_t D,
                        bool causal, int64_t S, double* worst_excess) {
  const Problem p{cfg.batch, S, cfg.heads, D, causal, 1.0f / std::sqrt(static_cast<float>(D))};
  const size_t n = static_cast<size_t>(p.batch * S * p.heads * D);
  const uint64_t seed = static_cast<uint64_t>(S * 1000 + D);
  std::vector<T> q = random_tensor<T>(n, 3 * seed + 0, threads);
  std::vector<T> k = random_tensor<T>(n, 3 * seed + 1, threads);
  std::vector<T> v = random_tensor<T>(n, 3 * seed + 2, threads);
  std::vector<T> out_fa(n), out_naive(n);

  double flops = 4.0 * static_cast<double>(p.batch * p.heads) * static_cast<double>(S) *
                 static_cast<double>(S) * static_cast<double>(D);
  if (causal) flops /= 2;

  using flashattn::TensorView;
  const auto view = [&](std::vector<T>& t) {
    return TensorView::contiguous(t.data(), dtype, {p.batch, S, p.heads, D});
  };
  const TensorView qv = view(q), kv = view(k), vv = view(v), ov = view(out_fa);
  flashattn::Options options;
  options.causal = causal;
  flashattn::Execution exec;
  exec.backend = flashattn::Backend::CPU;
  exec.num_threads = threads;
  size_t workspace = 0;
  const Timing fa = time_calls(cfg.repeat, [&] {
    workspace = flashattn::forward(qv, kv, vv, ov, std::nullopt, options, exec).workspace_bytes;
  });

  nlohmann::json r;
  r["head_dim"] = D;
  r["causal"] = causal;
  r["seqlen"] = S;
  r["batch"] = p.batch;
  r["heads"] = p.heads;
  r["dtype"] = flashattn::dtype_name(dtype);
  r["flop"] = flops;
  r["flashattn"] = {{"times_ms", fa.ms},
                    {"median_ms", fa.median()},
                    {"min_ms", fa.min()},
                    {"gflops", flops / (fa.median() * 1e6)},
                    {"extra_bytes", workspace}};

  const size_t s_bytes = NaiveBuffers::s_bytes(p);
  if (static_cast<double>(s_bytes) > cfg.naive_max_gib * 1073741824.0) {
    r["naive"] = {{"skipped", true}, {"s_matrix_bytes", s_bytes}};
    return r;
  }
  NaiveBuffers buf(p, !std::is_same_v<T, float>, threads);
  const Timing nv = time_calls(cfg.repeat, [&] {
    naive_forward<T>(p, q.data(), k.data(), v.data(), out_naive.data(), buf, threads);
  });
  double max_diff = 0.0;
  for (size_t i = 0; i < n; ++i) {
    const double d = std::fabs(static_cast<double>(to_float(out_fa[i])) -
                               static_cast<double>(to_float(out_naive[i])));
    if (!(d <= max_diff)) max_diff = d;  // NaN propagates
  }
  const double excess = std::isnan(max_diff) ? std::numeric_limits<double>::infinity()
                                             : max_diff - tolerance(dtype);
  *worst_excess = std::max(*worst_excess, excess);
  r["naive"] = {{"times_ms", nv.ms},
                {"median_ms", nv.median()},
                {"min_ms", nv.min()},
                {"gflops", flops / (nv.median() * 1e6)},
                {"extra_bytes", buf.bytes()},
                {"s_matrix_bytes", s_bytes}};
  r["speedup"] = nv.median() / fa.median();
  r["memory_ratio"] = static_cast<double>(buf.bytes()) / static_cast<double>(workspace);
  r["max_abs_diff"] = max_diff;
  r["tolerance"] = tolerance(dtype);
  return r;
}

std::string table_row(const nlohmann::json& r) {
  const auto& fa = r["flashattn"];
  const auto& nv = r["naive"];
  std::string row = "| " + std::to_string(r["head_dim"].get<int64_t>()) + " | " +
                    (r["causal"].get<bool>() ? "yes" : "no") + " | " +
                    std::to_string(r["seqlen"].get<int64_t>()) + " | " +
                    format_number("%.2f", fa["median_ms"]) + " / " + format_number("%.2f", fa["min_ms"]) +
                    " | ";
  const std::string fa_mem = format_bytes(fa["extra_bytes"].get<double>());
  if (nv.contains("skipped")) {
    const std::string need =
        "skipped: would need " + format_bytes(nv["s_matrix_bytes"].get<double>()) + " for S";
    return row + need + " | " + format_number("%.1f", fa["gflops"]) + " | - | - | " + fa_mem +
           " | - | - | - |";
  }
  return row + format_number("%.2f", nv["median_ms"]) + " / " + format_number("%.2f", nv["min_ms"]) + " | " +
         format_number("%.1f", fa["gflops"]) + " | " + format_number("%.1f", nv["gflops"]) + " | " +
         format_number("%.2fx", r["speedup"]) + " | " + fa_mem + " | " +
         format_bytes(nv["extra_bytes"].get<double>()) + " | " +
         format_number("%.0fx", r["memory_ratio"]) + " | " + format_number("%.1e", r["max_abs_diff"]) + " |";
}

}  // namespace

int main(int argc, char** argv) {
  Config cfg;
  CLI::App app{"flashattn CPU forward vs naive standard attention (materialised S matrix)"};
  app.add_option("--seqlens", cfg.seqlens, "sequence lengths (Sq = Sk)")
      ->delimiter(',')
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--head-dims", cfg.head_dims, "head dimensions (D = Dv; multiples of 8 up to 256)")
      ->delimiter(',')
      ->check(CLI::Range(8, 256))
      ->capture_default_str();
  app.add_option("--heads", cfg.heads, "heads")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--batch", cfg.batch, "batch size")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--dtype", cfg.dtype, "input/output type")
      ->check(CLI::IsMember({"fp32", "fp16", "bf16"}))
      ->capture_default_str();
  app.add_option("--repeat", cfg.repeat, "timed calls per path after one warm-up")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--threads", cfg.threads, "CPU threads for both paths (0: all)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--json", cfg.json_path, "write every result to this JSON file");
  app.add_option("--naive-max-gib", cfg.naive_max_gib,
                 "skip the naive path where its S matrix would exceed this many GiB")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  auto* no_causal = app.add_flag("--no-causal", cfg.no_causal, "only non-causal cases");
  app.add_flag("--only-causal", cfg.only_causal, "only causal cases")->excludes(no_causal);
  CLI11_PARSE(app, argc, argv);

  const flashattn::DType dtype = cfg.dtype == "fp16"   ? flashattn::DType::Float16
                                 : cfg.dtype == "bf16" ? flashattn::DType::BFloat16
                                                       : flashattn::DType::Float32;
  const int threads = cfg.threads > 0 ? cfg.threads : omp_get_max_threads();
  const std::string command = command_line(argc, argv), date = utc_now(), cpu = cpu_model();

  std::vector<bool> causal_modes;
  if (!cfg.only_causal) causal_modes.push_back(false);
  if (!cfg.no_causal) causal_modes.push_back(true);

  nlohmann::json results = nlohmann::json::array();
  double worst_excess = -std::numeric_limits<double>::infinity();
  for (int64_t D : cfg.head_dims)
    for (bool causal : causal_modes)
      for (int64_t S : cfg.seqlens) {
        std::fprintf(stderr, "hdim %lld causal %d seqlen %lld ...\n", static_cast<long long>(D),
                     causal ? 1 : 0, static_cast<long long>(S));
        nlohmann::json r;
        try {
          switch (dtype) {
            case flashattn::DType::Float16:
              r = run_case<half_t>(cfg, dtype, threads, D, causal, S, &worst_excess);
              break;
            case flashattn::DType::BFloat16:
              r = run_case<bfloat16_t>(cfg, dtype, threads, D, causal, S, &worst_excess);
              break;
            default:
              r = run_case<float>(cfg, dtype, threads, D, causal, S, &worst_excess);
              break;
          }
        } catch (const std::exception& e) {  // flashattn::Error for a shape it rejects
          std::fprintf(stderr, "error: hdim %lld seqlen %lld: %s\n", static_cast<long long>(D),
                       static_cast<long long>(S), e.what());
          return 1;
        }
        results.push_back(r);
      }

  std::printf("Machine: %s, %d threads | %s | %s, batch %lld, heads %lld | ms: median / min of "
              "%d after 1 warm-up\nCommand: `%s`\n\n",
              cpu.c_str(), threads, date.c_str(), cfg.dtype.c_str(),
              static_cast<long long>(cfg.batch), static_cast<long long>(cfg.heads), cfg.repeat,
              command.c_str());
  std::printf("| hdim | causal | seqlen | flashattn ms | naive ms | flashattn GFLOP/s | "
              "naive GFLOP/s | speedup | flashattn extra memory | naive extra memory | "
              "memory ratio | max abs diff |\n");
  std::printf("|---:|:---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const auto& r : results) std::printf("%s\n", table_row(r).c_str());

  if (!cfg.json_path.empty()) {
    nlohmann::json root = {{"machine", {{"cpu", cpu}, {"threads", threads}}},
                           {"date", date},
                           {"command", command},
                           {"flashattn_version", flashattn::version()},
                           {"repeat", cfg.repeat},
                           {"warmup", 1},
                           {"flop_convention", "4*B*H*Sq*Sk*D, halved when causal"},
                           {"results", results}};
    std::ofstream out(cfg.json_path);
    out << root.dump(2) << "\n";
    if (!out) {
      std::fprintf(stderr, "error: could not write %s\n", cfg.json_path.c_str());
      return 1;
    }
  }
  if (worst_excess > 0.0) {
    std::fprintf(stderr,
                 "error: flashattn and the naive path disagree beyond the %s tolerance (%.0e)\n",
                 cfg.dtype.c_str(), tolerance(dtype));
    return 1;
  }
  return 0;
}

// `flashattn run`: one forward problem on random inputs, timed, optionally checked against the
// float64 reference, and reported next to what standard (materialising) attention would cost.
//
// The steps, one function each: choose the backend -> resolve the defaults -> make the problem
// on the host (buffers, masks, varlen lengths) -> hand it to a Runner (the host buffers
// themselves, or copies on a GPU: runner.hpp) -> time the forward call -> check it -> count
// FLOPs and memory -> report.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <iostream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "commands.hpp"
#include "common/numeric.hpp"
#include "flashattn/flashattn.hpp"
#include "reference/reference.hpp"
#include "runner.hpp"

namespace flashattn::cli {
namespace {

using json = nlohmann::ordered_json;  // keys stay in the order written

// ----------------------------------------------------------------------------------------------
// Small helpers

__attribute__((format(printf, 1, 2))) std::string format(const char* pattern, ...) {
  char buf[256];
  va_list args;
  va_start(args, pattern);
  std::vsnprintf(buf, sizeof buf, pattern, args);
  va_end(args);
  return buf;
}

std::string human_bytes(double bytes) {
  static const char* const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int unit = 0;
  while (bytes >= 1024.0 && unit < 4) {
    bytes /= 1024.0;
    ++unit;
  }
  return unit == 0 ? format("%.0f B", bytes) : format("%.2f %s", bytes, units[unit]);
}

// 2010% / 24.6% / 0.00768%: whole numbers stay readable, tiny ones keep 3 significant digits.
std::string percent(double fraction) {
  const double p = 100.0 * fraction;
  return p >= 1.0 ? format("%.1f%%", p) : format("%.3g%%", p);
}

std::string join(const std::vector<int64_t>& values) {
  std::string s;
  for (int64_t v : values) {
    if (!s.empty()) s += ' ';
    s += std::to_string(v);
  }
  return "[" + s + "]";
}

DType dtype_of(const std::string& name) {
  if (name == "fp16") return DType::Float16;
  if (name == "bf16") return DType::BFloat16;
  return DType::Float32;  // the parser admits only fp32, fp16, bf16
}

// A row-major view of host memory (TensorView::contiguous wants an initializer_list).
TensorView contiguous_view(const void* data, DType dtype, const std::vector<int64_t>& sizes) {
  TensorView t;
  // The library takes every tensor as a mutable view; inputs are only read.
  t.data = const_cast<void*>(data);
  t.dtype = dtype;
  t.ndim = static_cast<int32_t>(sizes.size());
  int64_t stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.sizes[static_cast<size_t>(d)] = sizes[static_cast<size_t>(d)];
    t.strides[static_cast<size_t>(d)] = stride;
    stride *= sizes[static_cast<size_t>(d)];
  }
  return t;
}

// An owning, contiguous host tensor of a floating-point dtype.
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, std::vector<int64_t> sizes) : dtype_(dtype), sizes_(std::move(sizes)) {
    int64_t count = 1;
    for (int64_t s : sizes_) count *= s;
    bytes_.resize(static_cast<size_t>(count) * dtype_size(dtype_));
  }

  TensorView view() const { return contiguous_view(bytes_.data(), dtype_, sizes_); }

  // Standard normal values, rounded to the dtype.
  void fill_normal(std::mt19937_64& rng) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    fill([&] { return normal(rng); });
  }

  // NaN everywhere, so that an element the engine forgets to write cannot pass the check.
  void poison() {
    fill([] { return std::numeric_limits<float>::quiet_NaN(); });
  }

 private:
  template <typename Generate>
  void fill(Generate next) {
    switch (dtype_) {
      case DType::Float32:
        return fill_as<float>(next);
      case DType::Float16:
        return fill_as<detail::half_t>(next);
      case DType::BFloat16:
        return fill_as<detail::bfloat16_t>(next);
      case DType::Int32:
        break;
    }
    throw std::logic_error("HostTensor: not a floating-point dtype");
  }

  template <typename T, typename Generate>
  void fill_as(Generate& next) {
    T* p = reinterpret_cast<T*>(bytes_.data());
    const size_t n = bytes_.size() / sizeof(T);
    for (size_t i = 0; i < n; ++i) p[i] = detail::from_float<T>(next());
  }

  DType dtype_ = DType::Float32;
  std::vector<int64_t> sizes_;
  std::vector<unsigned char> bytes_;
};

// ----------------------------------------------------------------------------------------------
// The backend

// Where the run goes, and why (for the report).
struct Placement {
  Backend backend = Backend::CPU;    // CPU or CUDA, never Auto
  std::string reason;                // "requested", or why auto chose this backend
  std::optional<CudaDevice> device;  // the GPU of a cuda run (in a build with CUDA)
};

// --device N among the devices seen.
CudaDevice pick_device(const std::vector<CudaDevice>& devices, int32_t index) {
  for (const CudaDevice& d : devices)
    if (d.index == index) return d;
  throw std::invalid_argument("--device: expected a CUDA device index below " +
                              std::to_string(devices.size()) + " (the devices seen), given " +
                              std::to_string(index));
}

// cpu: the CPU. cuda: the GPU --device (in a build without CUDA the library refuses the call
// itself). auto: the GPU when this build has CUDA and sees a device, else the CPU; also the CPU
// for an explicit --dtype fp32, which only the cpu backend takes.
Placement place(const RunArgs& a) {
  if (a.backend == "cpu") return {Backend::CPU, "requested", std::nullopt};
  if (!cuda_compiled()) {
    if (a.backend == "cuda") return {Backend::CUDA, "requested", std::nullopt};
    return {Backend::CPU, "this build has no CUDA backend", std::nullopt};
  }
  std::string why;
  const std::vector<CudaDevice> devices = cuda_devices(&why);
  if (a.backend == "cuda") {
    if (devices.empty()) throw std::runtime_error("--backend cuda: no CUDA device (" + why + ")");
    return {Backend::CUDA, "requested", pick_device(devices, a.device)};
  }
  if (devices.empty()) return {Backend::CPU, "no CUDA device: " + why, std::nullopt};
  if (a.dtype == "fp32")
    return {Backend::CPU, "fp32 runs on the cpu only; the cuda backend takes fp16 and bf16",
            std::nullopt};
  const std::string seen =
      std::to_string(devices.size()) + " CUDA device" + (devices.size() == 1 ? "" : "s") + " seen";
  return {Backend::CUDA, seen, pick_device(devices, a.device)};
}

// ----------------------------------------------------------------------------------------------
// The problem

// RunArgs with every default filled in (the dtype's depends on the backend).
RunArgs resolve_defaults(RunArgs a, const Placement& placement) {
  if (!a.dtype) a.dtype = placement.backend == Backend::CUDA ? "bf16" : "fp32";
  if (!a.seqlen_k) a.seqlen_k = a.seqlen_q;
  if (!a.heads_k) a.heads_k = a.heads;
  if (!a.seed) {
    std::random_device device;
    a.seed = (static_cast<uint64_t>(device()) << 32) ^ device();
  }
  return a;
}

// Everything one forward call reads and writes. The views are built on demand from the owning
// buffers, so a Problem can be moved freely.
struct Problem {
  RunArgs args;  // defaults resolved
  DType dtype = DType::Float32;
  std::vector<int64_t> lengths_q, lengths_k;        // varlen only: per sequence
  std::vector<int32_t> cu_seqlens_q, cu_seqlens_k;  // varlen only
  HostTensor q, k, v, out, lse;
  std::vector<float> alibi_slopes;  // (H), empty without --alibi

  // The keys row i of a sequence sees are bounded by these (SPEC.md: causal means right = 0).
  int32_t left() const { return args.window_left; }
  int32_t right() const { return args.causal ? 0 : args.window_right; }

  Options options() const {
    Options o;
    o.softmax_scale = args.softmax_scale;
    o.causal = args.causal;
    o.window_left = args.window_left;
    o.window_right = args.window_right;
    o.softcap = args.softcap;
    if (args.alibi)
      o.alibi_slopes = contiguous_view(alibi_slopes.data(), DType::Float32, {args.heads});
    return o;
  }

  std::optional<Varlen> varlen() const {
    if (!args.varlen) return std::nullopt;
    Varlen v;
    const int64_t n = static_cast<int64_t>(cu_seqlens_q.size());
    v.cu_seqlens_q = contiguous_view(cu_seqlens_q.data(), DType::Int32, {n});
    v.cu_seqlens_k = contiguous_view(cu_seqlens_k.data(), DType::Int32, {n});
    v.max_seqlen_q = args.seqlen_q;
    v.max_seqlen_k = *args.seqlen_k;
    return v;
  }

  // The sequence shapes with their multiplicities: B x (Sq, Sk) for a dense batch (B is never
  // expanded: it may be huge with empty sequences), one entry per sequence for varlen.
  struct Shapes {
    int64_t seqlen_q, seqlen_k, count;
  };
  std::vector<Shapes> shapes() const {
    if (!args.varlen) return {{args.seqlen_q, *args.seqlen_k, args.batch}};
    std::vector<Shapes> result;
    for (size_t b = 0; b < lengths_q.size(); ++b) result.push_back({lengths_q[b], lengths_k[b], 1});
    return result;
  }

  // The views of the host buffers, as one forward call takes them.
  ForwardCall call() const {
    return {q.view(), k.view(), v.view(), out.view(), lse.view(), options(), varlen()};
  }
};

RunInfo forward(const ForwardCall& c, const Execution& execution) {
  if (c.varlen)
    return flashattn::forward_varlen(c.q, c.k, c.v, c.out, c.lse, *c.varlen, c.options, execution);
  return flashattn::forward(c.q, c.k, c.v, c.out, c.lse, c.options, execution);
}

// Varlen: B lengths drawn uniformly in [0, max], except that the first sequence gets exactly
// max, so that max_seqlen is reached and the longest case is always exercised. Query and key
// lengths are drawn independently (so some sequences may be empty on either side).
void draw_lengths(Problem& p, std::mt19937_64& rng) {
  const int64_t max_q = p.args.seqlen_q, max_k = *p.args.seqlen_k;
  std::uniform_int_distribution<int64_t> length_q(0, max_q), length_k(0, max_k);
  for (int64_t b = 0; b < p.args.batch; ++b) {
    const bool first = b == 0;
    p.lengths_q.push_back(first ? max_q : length_q(rng));
    p.lengths_k.push_back(first ? max_k : length_k(rng));
  }
}

// cu_seqlens are int32 prefix sums: refuse a ragged batch whose total does not fit.
std::vector<int32_t> prefix_sums(const std::vector<int64_t>& lengths, const char* what) {
  std::vector<int32_t> cu{0};
  int64_t total = 0;
  for (int64_t length : lengths) {
    total += length;
    if (total > std::numeric_limits<int32_t>::max())
      throw std::invalid_argument(std::string("--varlen: the total ") + what +
                                  " length exceeds the int32 range of cu_seqlens");
    cu.push_back(static_cast<int32_t>(total));
  }
  return cu;
}

int64_t sum(const std::vector<int64_t>& values) {
  int64_t s = 0;
  for (int64_t v : values) s += v;
  return s;
}

// The RNG draws, in order: varlen lengths (if any), then q, k, v. A seed replays a run exactly.
Problem make_problem(const RunArgs& args) {
  Problem p;
  p.args = args;
  p.dtype = dtype_of(*args.dtype);
  std::mt19937_64 rng(*args.seed);
  const int64_t B = args.batch, H = args.heads, Hk = *args.heads_k, D = args.head_dim;

  if (args.varlen) {
    draw_lengths(p, rng);
    p.cu_seqlens_q = prefix_sums(p.lengths_q, "query");
    p.cu_seqlens_k = prefix_sums(p.lengths_k, "key");
    const int64_t total_q = sum(p.lengths_q), total_k = sum(p.lengths_k);
    p.q = HostTensor(p.dtype, {total_q, H, D});
    p.k = HostTensor(p.dtype, {total_k, Hk, D});
    p.v = HostTensor(p.dtype, {total_k, Hk, D});
    p.out = HostTensor(p.dtype, {total_q, H, D});
    p.lse = HostTensor(DType::Float32, {H, total_q});
  } else {
    const int64_t Sq = args.seqlen_q, Sk = *args.seqlen_k;
    p.q = HostTensor(p.dtype, {B, Sq, H, D});
    p.k = HostTensor(p.dtype, {B, Sk, Hk, D});
    p.v = HostTensor(p.dtype, {B, Sk, Hk, D});
    p.out = HostTensor(p.dtype, {B, Sq, H, D});
    p.lse = HostTensor(DType::Float32, {B, H, Sq});
  }
  p.q.fill_normal(rng);
  p.k.fill_normal(rng);
  p.v.fill_normal(rng);

  // ALiBi slopes of the paper: a geometric sequence 2^(-8/H), 2^(-16/H), ..., 2^(-8).
  if (args.alibi)
    for (int64_t h = 0; h < H; ++h)
      p.alibi_slopes.push_back(
          std::exp2(-8.0f * static_cast<float>(h + 1) / static_cast<float>(H)));
  return p;
}

// ----------------------------------------------------------------------------------------------
// Where the calls run

// The CPU path: the library works on the problem's host buffers themselves.
class HostRunner final : public Runner {
 public:
  explicit HostRunner(Problem& problem) : problem_(problem), call_(problem.call()) {}

  const ForwardCall& call() const override { return call_; }
  const char* timer() const override { return "steady_clock"; }

  double time(const std::function<void()>& forward) override {
    problem_.out.poison();
    problem_.lse.poison();
    const auto start = std::chrono::steady_clock::now();
    forward();
    const auto stop = std::chrono::steady_clock::now();
    return std::chrono::duration<double, std::milli>(stop - start).count();
  }

 private:
  Problem& problem_;
  ForwardCall call_;
};

// The one place where this build's CUDA support matters: a run on a GPU works on copies of
// the problem's buffers there (device_runner.cpp); the outputs come back for --check.
std::unique_ptr<Runner> make_runner(Problem& problem, [[maybe_unused]] const Placement& placement) {
#ifdef FLASHATTN_CLI_CUDA
  if (placement.device) return make_device_runner(problem.call(), placement.device->index);
#endif
  return std::make_unique<HostRunner>(problem);
}

// ----------------------------------------------------------------------------------------------
// Timing

struct Timing {
  std::vector<double> ms;  // one per timed run, in order
  double median_ms = 0, min_ms = 0;
  RunInfo info;                // of the last run
  size_t workspace_bytes = 0;  // the largest any run reported
};

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

// One warm-up call (first touch of the buffers, thread pool start-up, kernel loading; a bad
// argument throws here, before anything is timed), then `repeat` timed calls. The runner
// poisons the outputs before every call, outside the timed region, so the last call's outputs
// are all its own; then it puts them in the host buffers.
Timing time_forward(Runner& runner, const Execution& execution, int repeat) {
  Timing t;
  const auto call = [&] {
    const double ms = runner.time([&] { t.info = forward(runner.call(), execution); });
    t.workspace_bytes = std::max(t.workspace_bytes, t.info.workspace_bytes);
    return ms;
  };
  call();
  for (int r = 0; r < repeat; ++r) t.ms.push_back(call());
  runner.finish();
  t.median_ms = median(t.ms);
  t.min_ms = *std::min_element(t.ms.begin(), t.ms.end());
  return t;
}

// ----------------------------------------------------------------------------------------------
// Accuracy

struct CheckResult {
  reference::Check out, lse;
  bool passed() const { return out.passed() && lse.passed(); }
};

// SPEC.md's rule: against the float64 oracle; fp16/bf16 errors are judged relative to a plain
// implementation computing in the input dtype on the same inputs.
CheckResult check_against_reference(const Problem& p) {
  const std::optional<Varlen> ragged = p.varlen();
  const Varlen* varlen = ragged ? &*ragged : nullptr;
  const Options options = p.options();
  const reference::Result exact =
      reference::forward(p.q.view(), p.k.view(), p.v.view(), options, varlen);
  reference::Result low_precision;
  if (p.dtype != DType::Float32)
    low_precision = reference::forward(p.q.view(), p.k.view(), p.v.view(), options, varlen,
                                       reference::Arithmetic::InputDType);
  CheckResult c;
  c.out = reference::check_forward(p.dtype, reference::gather(p.out.view()), exact.out,
                                   low_precision.out);
  c.lse = reference::check_forward(p.dtype, reference::gather(p.lse.view()), exact.lse,
                                   low_precision.lse);
  return c;
}

// ----------------------------------------------------------------------------------------------
// Work and memory

// Visible (query, key) pairs of one sequence under SPEC.md's mask: query i sits at key position
// d = i + Sk - Sq and sees keys [d - left, d + right] within [0, Sk) (a bound < 0 is unbounded).
// One key range per row: O(Sq), not O(Sq * Sk).
int64_t visible_pairs(int64_t seqlen_q, int64_t seqlen_k, int32_t left, int32_t right) {
  int64_t pairs = 0;
  for (int64_t i = 0; i < seqlen_q; ++i) {
    const int64_t d = i + seqlen_k - seqlen_q;
    const int64_t begin = left >= 0 ? std::max<int64_t>(d - left, 0) : 0;
    const int64_t end = right >= 0 ? std::min<int64_t>(d + right + 1, seqlen_k) : seqlen_k;
    pairs += std::max<int64_t>(end - begin, 0);
  }
  return pairs;
}

struct Costs {
  double flops = 0;             // 4 H D per visible pair: q k^T and P v, 2 FLOPs per multiply-add
  double flops_convention = 0;  // the usual 4 B H Sq Sk D, halved when causal
  uint64_t standard_bytes = 0;  // the fp32 score matrices a materialising implementation holds
};

Costs count_costs(const Problem& p) {
  const double H = static_cast<double>(p.args.heads), D = static_cast<double>(p.args.head_dim);
  Costs c;
  for (const Problem::Shapes& s : p.shapes()) {
    const double n = static_cast<double>(s.count);
    const double pairs =
        static_cast<double>(visible_pairs(s.seqlen_q, s.seqlen_k, p.left(), p.right()));
    const double all_pairs = static_cast<double>(s.seqlen_q) * static_cast<double>(s.seqlen_k);
    c.flops += n * 4.0 * H * D * pairs;
    c.flops_convention += n * 4.0 * H * D * all_pairs * (p.args.causal ? 0.5 : 1.0);
    c.standard_bytes +=
        static_cast<uint64_t>(s.count * p.args.heads * s.seqlen_q * s.seqlen_k) * sizeof(float);
  }
  return c;
}

// ----------------------------------------------------------------------------------------------
// Reporting

struct Outcome {
  const Problem& problem;
  const Placement& placement;
  const Runner& runner;
  const Timing& timing;
  const Costs& costs;
  const std::optional<CheckResult>& check;

  double gflops() const {
    return timing.median_ms > 0 ? costs.flops / (timing.median_ms * 1e-3) / 1e9 : 0.0;
  }
  // Engine memory as a fraction of standard attention's (null when the latter is zero).
  std::optional<double> memory_ratio() const {
    if (costs.standard_bytes == 0) return std::nullopt;
    return static_cast<double>(timing.workspace_bytes) / static_cast<double>(costs.standard_bytes);
  }
  // The scale the library uses when none is given.
  float softmax_scale() const {
    return problem.args.softmax_scale.value_or(
        1.0f / std::sqrt(static_cast<float>(problem.args.head_dim)));
  }
};

json to_json(const Outcome& o) {
  const RunArgs& a = o.problem.args;
  json j = {
      {"command", "run"},
      {"version", flashattn::version()},
      {"backend_requested", a.backend},
      {"backend", backend_name(o.timing.info.backend)},
      {"backend_reason", o.placement.reason},
      {"threads_requested", a.threads},
      {"threads_available", omp_get_max_threads()},
      {"dtype", *a.dtype},
      {"batch", a.batch},
      {"seqlen_q", a.seqlen_q},
      {"seqlen_k", *a.seqlen_k},
      {"heads", a.heads},
      {"heads_k", *a.heads_k},
      {"head_dim", a.head_dim},
      {"causal", a.causal},
      {"window_left", a.window_left},
      {"window_right", a.window_right},
      {"softcap", a.softcap},
      {"softmax_scale", o.softmax_scale()},
      {"alibi", a.alibi},
      {"varlen", a.varlen},
      {"seed", *a.seed},
      {"repeat", a.repeat},
      {"timer", o.runner.timer()},
      {"time_ms_median", o.timing.median_ms},
      {"time_ms_min", o.timing.min_ms},
      {"times_ms", o.timing.ms},
      {"flops", o.costs.flops},
      {"flops_convention", o.costs.flops_convention},
      {"gflops", o.gflops()},
      {"tflops", o.gflops() / 1e3},
      {"engine_peak_extra_bytes", o.timing.workspace_bytes},
      {"standard_attention_bytes", o.costs.standard_bytes},
      {"memory_ratio", o.memory_ratio() ? json(*o.memory_ratio()) : json(nullptr)},
  };
  if (const std::optional<CudaDevice>& d = o.placement.device) {
    j["device"] = {{"type", "cuda"},
                   {"index", d->index},
                   {"name", d->name},
                   {"compute_capability", d->compute_capability},
                   {"memory_bytes", d->memory_bytes}};
  }
  if (const std::optional<DeviceMemory> m = o.runner.device_memory()) {
    j["device_free_bytes_before"] = m->free_bytes_before;
    j["device_free_bytes_after"] = m->free_bytes_after;
  }
  if (a.varlen) {
    j["seqlens_q"] = o.problem.lengths_q;
    j["seqlens_k"] = o.problem.lengths_k;
    j["total_q"] = sum(o.problem.lengths_q);
    j["total_k"] = sum(o.problem.lengths_k);
  }
  if (o.check) {
    const CheckResult& c = *o.check;
    j["check"] = {{"out_max_abs_error", c.out.max_abs_error},
                  {"out_tolerance", c.out.tolerance},
                  {"lse_max_abs_error", c.lse.max_abs_error},
                  {"lse_tolerance", c.lse.tolerance},
                  {"passed", c.passed()}};
  }
  return j;
}

std::string describe_mask(const RunArgs& a) {
  std::vector<std::string> parts;
  if (a.causal) parts.push_back("causal");
  if (a.window_left >= 0 || a.window_right >= 0)
    parts.push_back(format("window (%d,%d)", a.window_left, a.window_right));
  if (a.softcap != 0.0f) parts.push_back(format("softcap %g", a.softcap));
  if (a.alibi) parts.push_back("alibi");
  if (a.softmax_scale) parts.push_back(format("scale %g", *a.softmax_scale));
  if (parts.empty()) return "no mask";
  std::string s;
  for (const std::string& part : parts) {
    if (!s.empty()) s += ", ";
    s += part;
  }
  return s;
}

std::string describe_check(const char* name, const reference::Check& c) {
  return format("%-4s max abs error %.3g, tolerance %.3g: %s", name, c.max_abs_error, c.tolerance,
                c.passed() ? "PASS" : "FAIL");
}

// "cpu (requested cpu), threads all (16)" or "auto -> cuda (1 CUDA device seen)".
std::string describe_backend(const Outcome& o) {
  const RunArgs& a = o.problem.args;
  const std::string ran = backend_name(o.timing.info.backend);
  std::string s = a.backend == "auto" ? "auto -> " + ran + " (" + o.placement.reason + ")"
                                      : ran + " (requested " + a.backend + ")";
  if (o.timing.info.backend == Backend::CPU)
    s += ", threads " +
         (a.threads > 0 ? std::to_string(a.threads) : format("all (%d)", omp_get_max_threads()));
  return s;
}

// "cuda:0 NVIDIA H200, compute capability 9.0, 139.80 GiB; free 139.10 GiB before and after
// the timed calls".
std::string describe_device(const CudaDevice& d, const std::optional<DeviceMemory>& memory) {
  std::string s =
      format("cuda:%d ", d.index) + d.name +
      format(", compute capability %d.%d, ", d.compute_capability / 10, d.compute_capability % 10) +
      human_bytes(static_cast<double>(d.memory_bytes));
  if (!memory) return s;
  const std::string before = human_bytes(static_cast<double>(memory->free_bytes_before));
  const std::string after = human_bytes(static_cast<double>(memory->free_bytes_after));
  return s + "; free " + before +
         (memory->free_bytes_before == memory->free_bytes_after
              ? " before and after the timed calls"
              : " before the timed calls, " + after + " after");
}

void print_text(const Outcome& o) {
  const RunArgs& a = o.problem.args;
  std::cout << "flashattn " << flashattn::version() << " run\n"
            << format("problem     B=%lld Sq=%lld Sk=%lld H=%lld Hk=%lld D=%lld %s%s, ",
                      static_cast<long long>(a.batch), static_cast<long long>(a.seqlen_q),
                      static_cast<long long>(*a.seqlen_k), static_cast<long long>(a.heads),
                      static_cast<long long>(*a.heads_k), static_cast<long long>(a.head_dim),
                      a.dtype->c_str(), a.varlen ? " varlen" : "")
            << describe_mask(a) << "\n";
  if (a.varlen)
    std::cout << "lengths     q " << join(o.problem.lengths_q) << "\n"
              << "            k " << join(o.problem.lengths_k) << "\n";
  std::cout << "seed        " << *a.seed << "\n"
            << "backend     " << describe_backend(o) << "\n";
  if (o.placement.device)
    std::cout << "device      " << describe_device(*o.placement.device, o.runner.device_memory())
              << "\n";
  std::cout << format("time        median %.3f ms, min %.3f ms over %d runs (after 1 warm-up%s)\n",
                      o.timing.median_ms, o.timing.min_ms, a.repeat,
                      o.placement.device ? "; CUDA events on the run's stream" : "")
            << format("throughput  %.2f GFLOP/s (%.4g GFLOP over the visible (query, key) pairs)\n",
                      o.gflops(), o.costs.flops / 1e9)
            << "memory      engine peak extra "
            << human_bytes(static_cast<double>(o.timing.workspace_bytes))
            << " vs standard attention "
            << human_bytes(static_cast<double>(o.costs.standard_bytes));
  if (o.memory_ratio()) std::cout << " (" << percent(*o.memory_ratio()) << ")";
  std::cout << "\n";
  if (o.check)
    std::cout << "check       " << describe_check("out", o.check->out) << "\n"
              << "            " << describe_check("lse", o.check->lse) << "\n"
              << "result      " << (o.check->passed() ? "PASS" : "FAIL") << "\n";
}

}  // namespace

int run_command(const RunArgs& given) {
  const Placement placement = place(given);
  Problem problem = make_problem(resolve_defaults(given, placement));
  const std::unique_ptr<Runner> runner = make_runner(problem, placement);
  Execution execution;
  execution.backend = placement.backend;
  execution.stream = runner->stream();
  execution.num_threads = problem.args.threads;

  const Timing timing = time_forward(*runner, execution, problem.args.repeat);
  std::optional<CheckResult> check;
  if (problem.args.check) check = check_against_reference(problem);
  const Costs costs = count_costs(problem);

  const Outcome outcome{problem, placement, *runner, timing, costs, check};
  if (problem.args.json)
    std::cout << to_json(outcome).dump(2) << "\n";
  else
    print_text(outcome);
  return check && !check->passed() ? 1 : 0;
}

}  // namespace flashattn::cli

// `flashattn run`: one forward problem on random inputs (with --backward also its backward
// pass), timed, optionally checked against the float64 reference, and reported next to what
// standard (materialising) attention would cost.
//
// The steps, one function each: choose the backend -> resolve the defaults -> make the problem
// on the host (buffers, masks, varlen lengths, dout) -> hand it to a Runner (the host buffers
// themselves, or copies on a GPU: runner.hpp) -> time the forward call -> time the backward
// call (training.cpp makes it) -> check them -> count FLOPs and memory -> report.
#include <omp.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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
#include "flashattn/flashattn.hpp"
#include "reference/reference.hpp"
#include "runner.hpp"
#include "training.hpp"

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
  const std::vector<int64_t>& sizes() const { return sizes_; }

  // Standard normal values, rounded to the dtype by reference::scatter: a chunk at a time,
  // so that a large tensor never has a float64 copy.
  void fill_normal(std::mt19937_64& rng) {
    constexpr int64_t kChunk = int64_t{1} << 16;
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const size_t element_bytes = dtype_size(dtype_);
    const int64_t count = static_cast<int64_t>(bytes_.size() / element_bytes);
    std::vector<double> values;
    for (int64_t begin = 0; begin < count; begin += kChunk) {
      values.resize(static_cast<size_t>(std::min(kChunk, count - begin)));
      for (double& x : values) x = normal(rng);
      reference::scatter(values, contiguous_view(bytes_.data() + begin * element_bytes, dtype_,
                                                 {static_cast<int64_t>(values.size())}));
    }
  }

  // NaN everywhere, so that an element the engine forgets to write cannot pass the check
  // (all-ones bytes are NaN in fp32, fp16 and bf16, as the GPU runner poisons too).
  void poison() { std::memset(bytes_.data(), 0xFF, bytes_.size()); }

 private:
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

// Everything one forward call (and with --backward, one backward call) reads and writes. The
// views are built on demand from the owning buffers, so a Problem can be moved freely.
struct Problem {
  RunArgs args;  // defaults resolved
  DType dtype = DType::Float32;
  std::vector<int64_t> lengths_q, lengths_k;        // varlen only: per sequence
  std::vector<int32_t> cu_seqlens_q, cu_seqlens_k;  // varlen only
  HostTensor q, k, v, out, lse;
  HostTensor dout, dq, dk, dv;      // --backward only
  std::vector<float> alibi_slopes;  // (H), empty without --alibi

  Options options() const {
    Options o;
    o.softmax_scale = args.softmax_scale;
    o.causal = args.causal;
    o.window_left = args.window_left;
    o.window_right = args.window_right;
    o.softcap = args.softcap;
    if (args.alibi)
      o.alibi_slopes = contiguous_view(alibi_slopes.data(), DType::Float32, {args.heads});
    // One seed for the inputs and the dropout mask: the printed seed replays both.
    o.dropout_p = args.dropout;
    o.dropout_seed = *args.seed;
    o.dropout_offset = 0;
    o.deterministic = args.deterministic;
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
  // The backward call's own views (with --backward).
  std::optional<BackwardCall> backward_call() const {
    if (!args.backward) return std::nullopt;
    return BackwardCall{dout.view(), dq.view(), dk.view(), dv.view()};
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

// The RNG draws, in order: varlen lengths (if any), then q, k, v, then dout (with --backward,
// so the inputs of a seed are the same with or without it). A seed replays a run exactly.
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
  if (args.backward) {
    p.dout = HostTensor(p.dtype, p.out.sizes());
    p.dout.fill_normal(rng);
    p.dq = HostTensor(p.dtype, p.q.sizes());
    p.dk = HostTensor(p.dtype, p.k.sizes());
    p.dv = HostTensor(p.dtype, p.v.sizes());
  }

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
  explicit HostRunner(Problem& problem)
      : problem_(problem), call_(problem.call()), backward_(problem.backward_call()) {}

  const ForwardCall& call() const override { return call_; }
  const BackwardCall* backward_call() const override {
    return backward_ ? &*backward_ : nullptr;
  }
  const char* timer() const override { return "steady_clock"; }

  double time(Pass pass, const std::function<void()>& call) override {
    if (pass == Pass::Forward) {
      problem_.out.poison();
      problem_.lse.poison();
    } else {
      problem_.dq.poison();
      problem_.dk.poison();
      problem_.dv.poison();
    }
    const auto start = std::chrono::steady_clock::now();
    call();
    const auto stop = std::chrono::steady_clock::now();
    return std::chrono::duration<double, std::milli>(stop - start).count();
  }

 private:
  Problem& problem_;
  ForwardCall call_;
  std::optional<BackwardCall> backward_;
};

// The one place where this build's CUDA support matters: a run on a GPU works on copies of
// the problem's buffers there (device_runner.cpp); the outputs come back for --check.
std::unique_ptr<Runner> make_runner(Problem& problem, [[maybe_unused]] const Placement& placement) {
#ifdef FLASHATTN_CLI_CUDA
  if (placement.device)
    return make_device_runner(problem.call(), problem.backward_call(), placement.device->index);
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
// poisons the pass's outputs before every call, outside the timed region, so the last call's
// outputs are all its own (runner.finish() then puts them in the host buffers).
Timing time_calls(Runner& runner, Pass pass, const std::function<RunInfo()>& library_call,
                  int repeat) {
  Timing t;
  const auto call = [&] {
    const double ms = runner.time(pass, [&] { t.info = library_call(); });
    t.workspace_bytes = std::max(t.workspace_bytes, t.info.workspace_bytes);
    return ms;
  };
  call();
  for (int r = 0; r < repeat; ++r) t.ms.push_back(call());
  t.median_ms = median(t.ms);
  t.min_ms = *std::min_element(t.ms.begin(), t.ms.end());
  return t;
}

// The forward, then (with --backward) the backward on the forward's last out and lse.
struct Timings {
  Timing forward;
  std::optional<Timing> backward;
};

Timings time_passes(Runner& runner, const Execution& execution, int repeat) {
  Timings t;
  t.forward = time_calls(
      runner, Pass::Forward, [&] { return forward(runner.call(), execution); }, repeat);
  if (const BackwardCall* grads = runner.backward_call())
    t.backward = time_calls(
        runner, Pass::Backward, [&] { return backward(runner.call(), *grads, execution); },
        repeat);
  runner.finish();
  return t;
}

// ----------------------------------------------------------------------------------------------
// Accuracy

struct CheckResult {
  reference::Check out, lse;
  std::optional<GradientCheck> gradients;  // with --backward
  bool passed() const {
    return out.passed() && lse.passed() && (!gradients || gradients->passed());
  }
};

// docs/SPEC.md's accuracy rule: against the float64 oracle; fp16/bf16 errors are judged relative to a plain
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
  if (const std::optional<BackwardCall> grads = p.backward_call())
    c.gradients = check_gradients(p.call(), *grads);
  return c;
}

// ----------------------------------------------------------------------------------------------
// Work and memory

// Visible (query, key) pairs of one sequence under the call's mask, as the library states it
// (flashattn::visible_keys). One key range per row: O(Sq), not O(Sq * Sk).
int64_t visible_pairs(int64_t seqlen_q, int64_t seqlen_k, const Options& options) {
  int64_t pairs = 0;
  for (int64_t i = 0; i < seqlen_q; ++i) {
    const KeyRange keys = visible_keys(i, seqlen_q, seqlen_k, options);
    pairs += std::max<int64_t>(keys.end - keys.begin, 0);
  }
  return pairs;
}

// The forward's counts. The backward's follow the usual convention: 2.5x the forward's FLOPs
// (5 matrix products the size of the forward's 2: S recomputed, dV, dP, dQ and dK), and a
// materialising backward holds at least P (kept from the forward) and dP: twice the forward's
// score matrices (fp32).
constexpr double kBackwardFlopsFactor = 2.5;
constexpr uint64_t kForwardBackwardMatrices = 2;  // P and dP

struct Costs {
  double flops = 0;             // 4 H D per visible pair: q k^T and P v, 2 FLOPs per multiply-add
  double flops_convention = 0;  // the usual 4 B H Sq Sk D, halved when causal
  uint64_t standard_bytes = 0;  // the fp32 score matrices a materialising implementation holds
};

Costs count_costs(const Problem& p) {
  const double H = static_cast<double>(p.args.heads), D = static_cast<double>(p.args.head_dim);
  const Options options = p.options();
  Costs c;
  for (const Problem::Shapes& s : p.shapes()) {
    const double n = static_cast<double>(s.count);
    const double pairs = static_cast<double>(visible_pairs(s.seqlen_q, s.seqlen_k, options));
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

double gflops_of(double flops, double ms) { return ms > 0 ? flops / (ms * 1e-3) / 1e9 : 0.0; }

// Engine memory as a fraction of standard attention's (null when the latter is zero).
std::optional<double> ratio_of(uint64_t engine_bytes, uint64_t standard_bytes) {
  if (standard_bytes == 0) return std::nullopt;
  return static_cast<double>(engine_bytes) / static_cast<double>(standard_bytes);
}

json or_null(const std::optional<double>& value) { return value ? json(*value) : json(nullptr); }

// A float option as the shortest decimal that reads back as it (0.1, not 0.10000000149011612).
double shortest(float value) {
  char text[32];
  const auto [end, error] = std::to_chars(text, text + sizeof text, value);
  return error == std::errc() ? std::strtod(std::string(text, end).c_str(), nullptr) : value;
}

struct Outcome {
  const Problem& problem;
  const Placement& placement;
  const Runner& runner;
  const Timing& timing;                   // the forward's
  const std::optional<Timing>& backward;  // with --backward
  const Costs& costs;
  const std::optional<CheckResult>& check;

  double gflops() const { return gflops_of(costs.flops, timing.median_ms); }
  std::optional<double> memory_ratio() const {
    return ratio_of(timing.workspace_bytes, costs.standard_bytes);
  }

  // With --backward only: the backward's figures and those of the whole step.
  double backward_flops() const { return kBackwardFlopsFactor * costs.flops; }
  double backward_gflops() const { return gflops_of(backward_flops(), backward->median_ms); }
  double total_median_ms() const { return timing.median_ms + backward->median_ms; }
  double total_min_ms() const { return timing.min_ms + backward->min_ms; }
  double total_gflops() const {
    return gflops_of(costs.flops + backward_flops(), total_median_ms());
  }
  // The engine's peak extra memory over both calls, against standard attention's forward +
  // backward need (its P and dP matrices).
  size_t engine_fwd_bwd_bytes() const {
    return std::max(timing.workspace_bytes, backward->workspace_bytes);
  }
  uint64_t standard_fwd_bwd_bytes() const {
    return kForwardBackwardMatrices * costs.standard_bytes;
  }
  std::optional<double> memory_fwd_bwd_ratio() const {
    return ratio_of(engine_fwd_bwd_bytes(), standard_fwd_bwd_bytes());
  }
  // RunInfo::deterministic of every call made (the forward's, and the backward's).
  bool deterministic() const {
    return timing.info.deterministic && (!backward || backward->info.deterministic);
  }
  // The scale the library uses when none is given.
  float softmax_scale() const {
    return problem.args.softmax_scale.value_or(
        1.0f / std::sqrt(static_cast<float>(problem.args.head_dim)));
  }
};

// --backward's timing and throughput (null without it). The top-level time, throughput and
// memory fields are the forward's.
json backward_json(const Outcome& o) {
  if (!o.backward) return nullptr;
  const Timing& t = *o.backward;
  return {{"time_ms_median", t.median_ms},
          {"time_ms_min", t.min_ms},
          {"times_ms", t.ms},
          {"flops", o.backward_flops()},
          {"flops_convention", kBackwardFlopsFactor * o.costs.flops_convention},
          {"flops_factor", kBackwardFlopsFactor},
          {"gflops", o.backward_gflops()},
          {"tflops", o.backward_gflops() / 1e3},
          {"workspace_bytes", t.workspace_bytes}};
}

// The whole training step (null without --backward): summed times, and memory against
// standard attention's forward + backward need.
json forward_backward_json(const Outcome& o) {
  if (!o.backward) return nullptr;
  return {{"time_ms_median", o.total_median_ms()},
          {"time_ms_min", o.total_min_ms()},
          {"flops", o.costs.flops + o.backward_flops()},
          {"flops_convention", (1.0 + kBackwardFlopsFactor) * o.costs.flops_convention},
          {"gflops", o.total_gflops()},
          {"tflops", o.total_gflops() / 1e3},
          {"engine_peak_extra_bytes", o.engine_fwd_bwd_bytes()},
          {"standard_attention_p_and_dp_bytes", o.standard_fwd_bwd_bytes()},
          {"memory_ratio", or_null(o.memory_fwd_bwd_ratio())}};
}

json check_json(const reference::Check& c) {
  return {{"max_abs_error", c.max_abs_error}, {"tolerance", c.tolerance}, {"passed", c.passed()}};
}

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
      {"dropout_p", shortest(a.dropout)},
      {"dropout_seed", *a.seed},  // the run's --seed
      {"dropout_offset", 0},
      {"deterministic_requested", a.deterministic},
      {"deterministic", o.deterministic()},  // RunInfo of every call made
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
      {"memory_ratio", or_null(o.memory_ratio())},
      {"backward", backward_json(o)},
      {"forward_backward", forward_backward_json(o)},
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
                  {"lse_tolerance", c.lse.tolerance}};
    if (c.gradients)
      j["check"]["gradients"] = {{"dq", check_json(c.gradients->dq)},
                                 {"dk", check_json(c.gradients->dk)},
                                 {"dv", check_json(c.gradients->dv)}};
    j["check"]["passed"] = c.passed();
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

// "training   backward; dropout 0.1 (seed 7, offset 0); deterministic: yes (requested: no)",
// when the run has any of them.
std::string describe_training(const Outcome& o) {
  const RunArgs& a = o.problem.args;
  const std::string dropout =
      a.dropout != 0.0f ? format("dropout %g (seed %llu, offset 0)", a.dropout,
                                 static_cast<unsigned long long>(*a.seed))
                        : "no dropout";
  return std::string(a.backward ? "forward + backward" : "forward only") + "; " + dropout +
         "; deterministic: " + (o.deterministic() ? "yes" : "no") +
         " (requested: " + (a.deterministic ? "yes" : "no") + ")";
}

// The forward's time, throughput and memory lines.
void print_forward_figures(const Outcome& o) {
  std::cout << format("time        median %.3f ms, min %.3f ms over %d runs (after 1 warm-up%s)\n",
                      o.timing.median_ms, o.timing.min_ms, o.problem.args.repeat,
                      o.placement.device ? "; CUDA events on the run's stream" : "")
            << format("throughput  %.2f GFLOP/s (%.4g GFLOP over the visible (query, key) pairs)\n",
                      o.gflops(), o.costs.flops / 1e9)
            << "memory      engine peak extra "
            << human_bytes(static_cast<double>(o.timing.workspace_bytes))
            << " vs standard attention "
            << human_bytes(static_cast<double>(o.costs.standard_bytes));
  if (o.memory_ratio()) std::cout << " (" << percent(*o.memory_ratio()) << ")";
  std::cout << "\n";
}

// With --backward: forward, backward and total time and throughput; memory over both calls.
void print_forward_backward_figures(const Outcome& o) {
  const Timing &f = o.timing, &b = *o.backward;
  std::cout << format("time        forward  median %.3f ms, min %.3f ms over %d runs (after 1 "
                      "warm-up%s)\n",
                      f.median_ms, f.min_ms, o.problem.args.repeat,
                      o.placement.device ? "; CUDA events on the run's stream" : "")
            << format("            backward median %.3f ms, min %.3f ms\n", b.median_ms, b.min_ms)
            << format("            total    median %.3f ms, min %.3f ms\n", o.total_median_ms(),
                      o.total_min_ms())
            << format("throughput  forward %.2f, backward %.2f, total %.2f GFLOP/s (forward: "
                      "%.4g GFLOP over the visible (query, key) pairs; backward: %gx that)\n",
                      o.gflops(), o.backward_gflops(), o.total_gflops(), o.costs.flops / 1e9,
                      kBackwardFlopsFactor)
            << "memory      engine peak extra (forward, backward) "
            << human_bytes(static_cast<double>(o.engine_fwd_bwd_bytes()))
            << " vs standard attention forward + backward (P and dP, fp32) "
            << human_bytes(static_cast<double>(o.standard_fwd_bwd_bytes()));
  if (o.memory_fwd_bwd_ratio()) std::cout << " (" << percent(*o.memory_fwd_bwd_ratio()) << ")";
  std::cout << "\n";
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
  if (a.backward || a.dropout != 0.0f || a.deterministic)
    std::cout << "training    " << describe_training(o) << "\n";
  std::cout << "seed        " << *a.seed << "\n"
            << "backend     " << describe_backend(o) << "\n";
  if (o.placement.device)
    std::cout << "device      " << describe_device(*o.placement.device, o.runner.device_memory())
              << "\n";
  if (o.backward)
    print_forward_backward_figures(o);
  else
    print_forward_figures(o);
  if (o.check) {
    std::cout << "check       " << describe_check("out", o.check->out) << "\n"
              << "            " << describe_check("lse", o.check->lse) << "\n";
    if (const std::optional<GradientCheck>& g = o.check->gradients)
      std::cout << "            " << describe_check("dq", g->dq) << "\n"
                << "            " << describe_check("dk", g->dk) << "\n"
                << "            " << describe_check("dv", g->dv) << "\n";
    std::cout << "result      " << (o.check->passed() ? "PASS" : "FAIL") << "\n";
  }
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

  const Timings timings = time_passes(*runner, execution, problem.args.repeat);
  std::optional<CheckResult> check;
  if (problem.args.check) check = check_against_reference(problem);
  const Costs costs = count_costs(problem);

  const Outcome outcome{problem,          placement, *runner, timings.forward,
                        timings.backward, costs,     check};
  if (problem.args.json)
    std::cout << to_json(outcome).dump(2) << "\n";
  else
    print_text(outcome);
  return check && !check->passed() ? 1 : 0;
}

}  // namespace flashattn::cli

// flashattn_bench_capi: the C ABI's calls (include/flashattn/flashattn.h) timed on CUDA, as a
// program in C or another language calls them: fa_forward, fa_backward and
// fa_forward_kvcache on device pointers, the CUDA backend, one non-blocking stream.
//
// For each shape, input sets of one size whose bytes together exceed --rotate-mib (the H200's
// L2 holds 60 MB) and calls rotating through them; two times per call, each the median over
// --repeat samples of about 2 ms of back-to-back calls, cudaEvent-timed:
//   eager   the calls launched one after the other (the host's launch included);
//   kernel  the same calls captured in one CUDA graph, a sample being one replay.
// Rates as bench/harness.py counts them: forward 4*B*H*S*S*D FLOPs (halved when causal),
// backward 2.5x that, decode the bytes of K and V read. Before timing, the first set's
// results are checked against double precision on the host: out rows of the forward and of
// the decode, dq rows of the backward (bf16 bound: 2^-6 of the largest reference value,
// at least 1); exit status 1 when one fails.
//   flashattn_bench_capi [--quick] [--json FILE] [--repeat N] [--rotate-mib M]
// Without a CUDA device (or a build without the CUDA backend) it prints why and exits 0.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bench_common.hpp"
#include "flashattn/flashattn.h"

namespace {

constexpr int64_t kTokens = 16384, kModelWidth = 2048;  // batch * seqlen, heads * hdim
constexpr int64_t kDecodeHeads = 32, kDecodeKvHeads = 8, kDecodeHdim = 128;
constexpr double kSampleMs = 2.0;
constexpr int kMaxCallsPerSample = 200, kMaxSets = 32;

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

void check_fa(fa_status s, const char* what) {
  if (s != FA_OK) throw std::runtime_error(std::string(what) + ": " + fa_last_error());
}

// A device buffer of bf16 (or other) elements, freed with its owner.
struct DeviceBuffer {
  void* data = nullptr;
  explicit DeviceBuffer(size_t bytes) { check_cuda(cudaMalloc(&data, bytes), "cudaMalloc"); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { cudaFree(data); }
};

fa_tensor view(void* data, fa_dtype dtype, std::vector<int64_t> sizes) {
  fa_tensor t{};
  t.data = data;
  t.dtype = dtype;
  t.device_type = FA_DEVICE_CUDA;
  t.device_index = 0;
  t.ndim = static_cast<int32_t>(sizes.size());
  int64_t stride = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    t.sizes[i] = sizes[static_cast<size_t>(i)];
    t.strides[i] = stride;
    stride *= sizes[static_cast<size_t>(i)];
  }
  return t;
}

// One set's tensors: each a bf16 buffer filled from the shared random pool at its own offset.
struct Tensors {
  std::vector<std::unique_ptr<DeviceBuffer>> buffers;
  void* add(size_t elements, size_t element_size, const std::vector<uint16_t>* pool, size_t offset) {
    buffers.push_back(std::make_unique<DeviceBuffer>(elements * element_size));
    void* p = buffers.back()->data;
    if (pool) {  // the pool rotated by offset, repeated as often as the tensor needs
      for (size_t done = 0; done < elements;) {
        const size_t from = (offset + done) % pool->size();
        const size_t n = std::min(elements - done, pool->size() - from);
        check_cuda(cudaMemcpy(static_cast<uint16_t*>(p) + done, pool->data() + from, n * 2,
                              cudaMemcpyHostToDevice), "upload");
        done += n;
      }
    }
    return p;
  }
};

std::vector<uint16_t> download(const void* p, size_t elements) {
  std::vector<uint16_t> h(elements);
  check_cuda(cudaMemcpy(h.data(), p, elements * 2, cudaMemcpyDeviceToHost), "download");
  return h;
}

// (B, S, H, D) contiguous: element (b, s, h, d).
struct Layout {
  int64_t batch, seqlen, heads, hdim;
  size_t at(int64_t b, int64_t s, int64_t h, int64_t d) const {
    return static_cast<size_t>(((b * seqlen + s) * heads + h) * hdim + d);
  }
  size_t elements() const { return static_cast<size_t>(batch * seqlen * heads * hdim); }
};

// Double-precision out row and dq row of query i of (b, h): keys j <= i + Sk - Sq when causal.
// dq needs only this row: dq_i = scale * sum_j P_ij (dO_i . v_j - dO_i . O_i) k_j.
struct RowReference {
  std::vector<double> out, dq;
};

RowReference reference_row(const std::vector<uint16_t>& q, const Layout& lq,
                           const std::vector<uint16_t>& k, const std::vector<uint16_t>& v,
                           const Layout& lk, int64_t b, int64_t h, int64_t i, bool causal,
                           const std::vector<uint16_t>* dout) {
  const int64_t d_ = lq.hdim, hk = h / (lq.heads / lk.heads);
  const int64_t last = causal ? std::min(lk.seqlen - 1, i + lk.seqlen - lq.seqlen) : lk.seqlen - 1;
  const double scale = 1.0 / std::sqrt(double(d_));
  std::vector<double> p(static_cast<size_t>(last + 1));
  double top = -INFINITY, sum = 0.0;
  for (int64_t j = 0; j <= last; ++j) {
    double dot = 0.0;
    for (int64_t d = 0; d < d_; ++d)
      dot += bench::bf16_value(q[lq.at(b, i, h, d)]) * bench::bf16_value(k[lk.at(b, j, hk, d)]);
    p[static_cast<size_t>(j)] = dot * scale;
    top = std::max(top, dot * scale);
  }
  for (double& x : p) sum += (x = std::exp(x - top));
  RowReference r{std::vector<double>(static_cast<size_t>(d_), 0.0), {}};
  for (int64_t j = 0; j <= last; ++j)
    for (int64_t d = 0; d < d_; ++d)
      r.out[static_cast<size_t>(d)] += p[static_cast<size_t>(j)] / sum * bench::bf16_value(v[lk.at(b, j, hk, d)]);
  if (!dout) return r;
  double delta = 0.0;
  for (int64_t d = 0; d < d_; ++d) delta += bench::bf16_value((*dout)[lq.at(b, i, h, d)]) * r.out[static_cast<size_t>(d)];
  r.dq.assign(static_cast<size_t>(d_), 0.0);
  for (int64_t j = 0; j <= last; ++j) {
    double dp = 0.0;
    for (int64_t d = 0; d < d_; ++d)
      dp += bench::bf16_value((*dout)[lq.at(b, i, h, d)]) * bench::bf16_value(v[lk.at(b, j, hk, d)]);
    const double ds = p[static_cast<size_t>(j)] / sum * (dp - delta);
    for (int64_t d = 0; d < d_; ++d)
      r.dq[static_cast<size_t>(d)] += scale * ds * bench::bf16_value(k[lk.at(b, j, hk, d)]);
  }
  return r;
}

// Max |got - ref| over the checked rows against the bound; got rows read from `got` (q's layout).
struct Check {
  double max_err = 0.0, scale = 1.0;
  bool finite = true;
  void add(const std::vector<uint16_t>& got, const Layout& l, int64_t b, int64_t i, int64_t h,
           const std::vector<double>& ref) {
    for (int64_t d = 0; d < l.hdim; ++d) {
      const double x = bench::bf16_value(got[l.at(b, i, h, d)]);
      finite = finite && std::isfinite(x);
      max_err = std::max(max_err, std::abs(x - ref[static_cast<size_t>(d)]));
      scale = std::max(scale, std::abs(ref[static_cast<size_t>(d)]));
    }
  }
  double bound() const { return std::ldexp(1.0, -6) * scale; }
  bool ok() const { return finite && max_err <= bound(); }
};

// Rows checked per (b, h): the first, the last and some between.
std::vector<int64_t> check_rows(int64_t seqlen) {
  std::vector<int64_t> rows;
  const int64_t n = std::min<int64_t>(seqlen, 8);
  for (int64_t r = 0; r < n; ++r) rows.push_back(n == 1 ? 0 : r * (seqlen - 1) / (n - 1));
  return rows;
}

struct Timing {
  double ms = 0.0;  // median per call
  int calls_per_sample = 0;
};

// Samples of calls_per_sample calls of `call(i)` (i the call's index in the rotation), events
// around each sample on the stream; all samples queued before one synchronisation.
Timing time_eager(cudaStream_t stream, const std::function<void(int)>& call, int calls, int samples) {
  std::vector<cudaEvent_t> events(2 * static_cast<size_t>(samples));
  for (auto& e : events) check_cuda(cudaEventCreate(&e), "cudaEventCreate");
  int index = 0;
  for (int s = 0; s < samples; ++s) {
    check_cuda(cudaEventRecord(events[2 * s], stream), "cudaEventRecord");
    for (int c = 0; c < calls; ++c) call(index++);
    check_cuda(cudaEventRecord(events[2 * s + 1], stream), "cudaEventRecord");
  }
  check_cuda(cudaEventSynchronize(events.back()), "cudaEventSynchronize");
  std::vector<double> ms;
  for (int s = 0; s < samples; ++s) {
    float t = 0.0f;
    check_cuda(cudaEventElapsedTime(&t, events[2 * s], events[2 * s + 1]), "cudaEventElapsedTime");
    ms.push_back(t / calls);
  }
  for (auto& e : events) cudaEventDestroy(e);
  return {bench::median(ms), calls};
}

int calls_for(double ms_per_call) {
  return std::max(1, std::min(kMaxCallsPerSample, static_cast<int>(std::ceil(kSampleMs / std::max(ms_per_call, 1e-4)))));
}

// Eager, then the same calls captured in a graph and replayed. The calls must not synchronise
// (the library's CUDA calls do not; the backward's workspace is stream-ordered).
std::pair<Timing, Timing> time_both(cudaStream_t stream, const std::function<void(int)>& call,
                                    int sets, int samples) {
  for (int i = 0; i < sets; ++i) call(i);  // warm-up, first-call setup
  check_cuda(cudaStreamSynchronize(stream), "warm-up");
  const Timing estimate = time_eager(stream, call, sets, 1);
  const Timing eager = time_eager(stream, call, calls_for(estimate.ms), samples);
  const int calls = calls_for(eager.ms);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  check_cuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "begin capture");
  try {
    for (int c = 0; c < calls; ++c) call(c);
  } catch (...) {  // end the capture, so that the stream can run the next shape
    cudaStreamEndCapture(stream, &graph);
    if (graph) cudaGraphDestroy(graph);
    throw;
  }
  check_cuda(cudaStreamEndCapture(stream, &graph), "end capture");
  check_cuda(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
  check_cuda(cudaGraphLaunch(exec, stream), "first replay");  // uploads the graph: not timed
  const Timing kernel = time_eager(stream, [&](int) { check_cuda(cudaGraphLaunch(exec, stream), "replay"); }, 1, samples);
  check_cuda(cudaStreamSynchronize(stream), "replays");
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return {eager, {kernel.ms / calls, calls}};
}

struct Options {
  bool quick = false;
  int repeat = 30;
  int64_t rotate_mib = 256;
  std::string json;
};

int set_count(size_t bytes_per_set, const Options& o) {
  return std::max<int>(2, std::min<int>(kMaxSets, static_cast<int>(o.rotate_mib * (1 << 20) / bytes_per_set) + 1));
}

struct Row {
  std::string workload, shape, unit;
  double amount = 0.0;  // FLOPs or bytes per call
  Timing eager, kernel;
  Check check;
  std::string error;
};

void print_row(const Row& r) {
  if (!r.error.empty()) {
    std::printf("| %s | %s | error: %s | | | | |\n", r.workload.c_str(), r.shape.c_str(), r.error.c_str());
    return;
  }
  const double e = r.amount / (r.eager.ms * 1e-3) / 1e12, k = r.amount / (r.kernel.ms * 1e-3) / 1e12;
  std::printf("| %s | %s | %.2f | %.2f | %.4f | %.4f | %s %.2e (bound %.2e) |\n", r.workload.c_str(),
              r.shape.c_str(), e, k, r.eager.ms, r.kernel.ms, r.check.ok() ? "ok" : "FAILED",
              r.check.max_err, r.check.bound());
}

// A JSON string's content: quotes, backslashes and control characters escaped.
std::string json_escaped(const std::string& s) {
  std::string out;
  for (const char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) out += ' ';
    else out += c;
  }
  return out;
}

std::string json_row(const Row& r) {
  char buf[1024];
  if (!r.error.empty()) {
    std::snprintf(buf, sizeof buf, "{\"workload\": \"%s\", \"shape\": \"%s\", \"error\": \"%s\"}",
                  r.workload.c_str(), r.shape.c_str(), json_escaped(r.error).c_str());
  } else {
    std::snprintf(buf, sizeof buf,
                  "{\"workload\": \"%s\", \"shape\": \"%s\", \"unit\": \"%s\", \"eager_ms\": %.6f, "
                  "\"kernel_ms\": %.6f, \"eager_rate\": %.4f, \"kernel_rate\": %.4f, "
                  "\"calls_per_sample\": [%d, %d], \"check_ok\": %s, \"max_abs_err\": %.3e}",
                  r.workload.c_str(), r.shape.c_str(), r.unit.c_str(), r.eager.ms, r.kernel.ms,
                  r.amount / (r.eager.ms * 1e-3) / 1e12, r.amount / (r.kernel.ms * 1e-3) / 1e12,
                  r.eager.calls_per_sample, r.kernel.calls_per_sample, r.check.ok() ? "true" : "false",
                  r.check.max_err);
  }
  return buf;
}

fa_execution cuda_execution(cudaStream_t stream) {
  fa_execution e;
  fa_execution_init(&e);
  e.backend = FA_BACKEND_CUDA;
  e.stream = stream;
  return e;
}

// Forward (and with backward, the backward on the forward's out and lse) of one grid shape.
Row dense(bool backward, int64_t seqlen, int64_t hdim, bool causal, const Options& o,
          const std::vector<uint16_t>& pool, cudaStream_t stream) {
  const Layout l{std::max<int64_t>(1, kTokens / seqlen), seqlen, std::max<int64_t>(1, kModelWidth / hdim), hdim};
  const size_t n = l.elements();
  const int tensors = backward ? 8 : 4;  // q k v out [dout dq dk dv]
  const int sets = set_count(tensors * n * 2, o);
  struct Set {
    fa_tensor q, k, v, out, lse, dout, dq, dk, dv;
  };
  Tensors memory;
  std::vector<Set> s(static_cast<size_t>(sets));
  for (int i = 0; i < sets; ++i) {
    Set& x = s[static_cast<size_t>(i)];
    const std::vector<int64_t> dims{l.batch, l.seqlen, l.heads, l.hdim};
    const size_t base = static_cast<size_t>(i) * 7919 * 4;
    x.q = view(memory.add(n, 2, &pool, base), FA_BFLOAT16, dims);
    x.k = view(memory.add(n, 2, &pool, base + 7919), FA_BFLOAT16, dims);
    x.v = view(memory.add(n, 2, &pool, base + 2 * 7919), FA_BFLOAT16, dims);
    x.out = view(memory.add(n, 2, nullptr, 0), FA_BFLOAT16, dims);
    x.lse = view(memory.add(static_cast<size_t>(l.batch * l.heads * l.seqlen), 4, nullptr, 0), FA_FLOAT32,
                 {l.batch, l.heads, l.seqlen});
    if (backward) {
      x.dout = view(memory.add(n, 2, &pool, base + 3 * 7919), FA_BFLOAT16, dims);
      x.dq = view(memory.add(n, 2, nullptr, 0), FA_BFLOAT16, dims);
      x.dk = view(memory.add(n, 2, nullptr, 0), FA_BFLOAT16, dims);
      x.dv = view(memory.add(n, 2, nullptr, 0), FA_BFLOAT16, dims);
    }
  }
  fa_options opts;
  fa_options_init(&opts);
  opts.causal = causal;
  const fa_execution exec = cuda_execution(stream);
  const auto forward = [&](int i) {
    const Set& x = s[static_cast<size_t>(i % sets)];
    check_fa(fa_forward(&x.q, &x.k, &x.v, &x.out, &x.lse, &opts, &exec, nullptr), "fa_forward");
  };
  const auto grad = [&](int i) {
    const Set& x = s[static_cast<size_t>(i % sets)];
    check_fa(fa_backward(&x.q, &x.k, &x.v, &x.out, &x.dout, &x.lse, &x.dq, &x.dk, &x.dv, &opts, &exec, nullptr),
             "fa_backward");
  };
  Row r{backward ? "backward" : "forward",
        "d" + std::to_string(hdim) + (causal ? " causal" : " full") + " s" + std::to_string(seqlen) + " b" +
            std::to_string(l.batch) + "h" + std::to_string(l.heads),
        "TFLOP/s", 0.0, {}, {}, {}, {}};
  const double fwd_flops = 4.0 * l.batch * l.heads * seqlen * seqlen * hdim / (causal ? 2 : 1);
  r.amount = backward ? 2.5 * fwd_flops : fwd_flops;
  for (int i = 0; i < sets; ++i) forward(i);  // every set's out and lse, for the backward
  if (backward) grad(0);
  check_cuda(cudaStreamSynchronize(stream), "first calls");
  const Set& x = s[0];
  const auto q = download(x.q.data, n), k = download(x.k.data, n), v = download(x.v.data, n);
  const auto got = download(backward ? x.dq.data : x.out.data, n);
  const auto dout = backward ? download(x.dout.data, n) : std::vector<uint16_t>{};
  for (int64_t b : {int64_t{0}, l.batch - 1})
    for (int64_t h : {int64_t{0}, l.heads - 1})
      for (int64_t i : check_rows(seqlen)) {
        const RowReference ref = reference_row(q, l, k, v, l, b, h, i, causal, backward ? &dout : nullptr);
        r.check.add(got, l, b, i, h, backward ? ref.dq : ref.out);
      }
  std::tie(r.eager, r.kernel) = time_both(stream, backward ? std::function<void(int)>(grad) : forward, sets, o.repeat);
  return r;
}

// One query token per sequence against a dense (B, S, Hk, D) cache.
Row decode(int64_t batch, int64_t seqlen, const Options& o, const std::vector<uint16_t>& pool,
           cudaStream_t stream) {
  const Layout lq{batch, 1, kDecodeHeads, kDecodeHdim}, lk{batch, seqlen, kDecodeKvHeads, kDecodeHdim};
  const size_t cache = lk.elements();
  const int sets = set_count(2 * cache * 2, o);
  struct Set {
    fa_tensor q, k, v, out, seqlens;
    fa_kvcache kv;
  };
  Tensors memory;
  std::vector<Set> s(static_cast<size_t>(sets));
  const std::vector<int32_t> lengths(static_cast<size_t>(batch), static_cast<int32_t>(seqlen));
  for (int i = 0; i < sets; ++i) {
    Set& x = s[static_cast<size_t>(i)];
    const size_t base = static_cast<size_t>(i) * 7919 * 3;
    x.q = view(memory.add(lq.elements(), 2, &pool, base), FA_BFLOAT16, {batch, 1, kDecodeHeads, kDecodeHdim});
    x.k = view(memory.add(cache, 2, &pool, base + 7919), FA_BFLOAT16, {batch, seqlen, kDecodeKvHeads, kDecodeHdim});
    x.v = view(memory.add(cache, 2, &pool, base + 2 * 7919), FA_BFLOAT16, {batch, seqlen, kDecodeKvHeads, kDecodeHdim});
    x.out = view(memory.add(lq.elements(), 2, nullptr, 0), FA_BFLOAT16, {batch, 1, kDecodeHeads, kDecodeHdim});
    void* len = memory.add(static_cast<size_t>(batch), 4, nullptr, 0);
    check_cuda(cudaMemcpy(len, lengths.data(), lengths.size() * 4, cudaMemcpyHostToDevice), "upload");
    x.seqlens = view(len, FA_INT32, {batch});
  }
  for (Set& x : s) {  // the pointers into s are stable now
    fa_kvcache_init(&x.kv);
    x.kv.k_cache = &x.k;
    x.kv.v_cache = &x.v;
    x.kv.cache_seqlens = &x.seqlens;
  }
  const fa_execution exec = cuda_execution(stream);
  const auto call = [&](int i) {
    const Set& x = s[static_cast<size_t>(i % sets)];
    check_fa(fa_forward_kvcache(&x.q, &x.kv, &x.out, nullptr, nullptr, &exec, nullptr), "fa_forward_kvcache");
  };
  Row r{"decode", std::to_string(batch) + "x" + std::to_string(seqlen), "TB/s",
        2.0 * cache * 2, {}, {}, {}, {}};
  call(0);
  check_cuda(cudaStreamSynchronize(stream), "first call");
  const auto q = download(s[0].q.data, lq.elements()), out = download(s[0].out.data, lq.elements());
  const auto k = download(s[0].k.data, cache), v = download(s[0].v.data, cache);
  for (int64_t b : {int64_t{0}, batch - 1})
    for (int64_t h : {int64_t{0}, kDecodeHeads - 1})
      r.check.add(out, lq, b, 0, h, reference_row(q, lq, k, v, lk, b, h, 0, false, nullptr).out);
  std::tie(r.eager, r.kernel) = time_both(stream, call, sets, o.repeat);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") o.quick = true;
    else if (a == "--json" && i + 1 < argc) o.json = argv[++i];
    else if (a == "--repeat" && i + 1 < argc) o.repeat = std::max(1, std::atoi(argv[++i]));
    else if (a == "--rotate-mib" && i + 1 < argc) o.rotate_mib = std::max(1, std::atoi(argv[++i]));
    else {
      std::fprintf(stderr, "usage: %s [--quick] [--json FILE] [--repeat N] [--rotate-mib M]\n", argv[0]);
      return 2;
    }
  }
  int devices = 0;
  const cudaError_t probe = cudaGetDeviceCount(&devices);
  if (probe != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: %s; nothing timed\n",
                probe != cudaSuccess ? cudaGetErrorString(probe) : "none found");
    return 0;
  }
  if (!fa_cuda_compiled()) {
    std::printf("no CUDA device: this build of the library has no CUDA backend; nothing timed\n");
    return 0;
  }
  if (o.quick) o.repeat = std::min(o.repeat, 10);
  cudaDeviceProp prop{};
  check_cuda(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  cudaStream_t stream = nullptr;
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  const std::vector<uint16_t> pool = bench::random_bf16(size_t{1} << 22, 1);
  const std::vector<int64_t> seqlens = o.quick ? std::vector<int64_t>{512, 2048} : std::vector<int64_t>{1024, 4096, 16384};
  const std::vector<int64_t> hdims = o.quick ? std::vector<int64_t>{64} : std::vector<int64_t>{64, 128, 256};
  const std::vector<std::pair<int64_t, int64_t>> caches =
      o.quick ? std::vector<std::pair<int64_t, int64_t>>{{1, 8192}}
              : std::vector<std::pair<int64_t, int64_t>>{{1, 8192}, {1, 131072}, {8, 32768}, {64, 4096}};
  struct Work {
    std::string workload, shape;
    std::function<Row()> run;
  };
  std::vector<Work> work;
  for (bool bwd : {false, true})
    for (int64_t d : hdims)
      for (bool causal : {false, true})
        for (int64_t sl : seqlens)
          work.push_back({bwd ? "backward" : "forward",
                          "d" + std::to_string(d) + (causal ? " causal s" : " full s") + std::to_string(sl),
                          [=, &o, &pool] { return dense(bwd, sl, d, causal, o, pool, stream); }});
  for (auto [b, sl] : caches)
    work.push_back({"decode", std::to_string(b) + "x" + std::to_string(sl),
                    [=, &o, &pool] { return decode(b, sl, o, pool, stream); }});

  std::printf("flashattn %s, C ABI, %s, bf16, median of %d samples per time\n\n", fa_version(), prop.name, o.repeat);
  std::printf("| call | shape | eager rate | kernel rate | eager ms | kernel ms | check |\n");
  std::printf("|---|---|---:|---:|---:|---:|---|\n");
  std::vector<std::string> json;
  bool ok = true;
  for (const Work& w : work) {
    Row r;
    try {
      r = w.run();
    } catch (const std::exception& e) {
      r.workload = w.workload;
      r.shape = w.shape;
      r.error = e.what();
      cudaStreamSynchronize(stream);
    }
    print_row(r);
    json.push_back(json_row(r));
    ok = ok && r.error.empty() && r.check.ok();
  }
  std::printf("\nrates: TFLOP/s for forward and backward, TB/s of K+V read for decode\n");
  if (!o.json.empty()) {
    FILE* f = std::fopen(o.json.c_str(), "w");
    if (!f) {
      std::fprintf(stderr, "cannot write %s\n", o.json.c_str());
      return 1;
    }
    std::fprintf(f, "{\"device\": \"%s\", \"flashattn\": \"%s\", \"rows\": [\n", prop.name, fa_version());
    for (size_t i = 0; i < json.size(); ++i) std::fprintf(f, "  %s%s\n", json[i].c_str(), i + 1 < json.size() ? "," : "");
    std::fprintf(f, "]}\n");
    std::fclose(f);
  }
  cudaStreamDestroy(stream);
  if (!ok) std::printf("FAILED: a check or a call failed\n");
  return ok ? 0 : 1;
}

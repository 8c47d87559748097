// Shared helpers for the tests: host buffers of any dtype, fresh random inputs, poisoned
// outputs, and one routine that runs a forward call on a backend and checks it against the
// float64 reference under docs/SPEC.md's accuracy rule.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "common/numeric.hpp"
#include "flashattn/flashattn.hpp"
#include "reference/reference.hpp"

#ifdef FLASHATTN_TEST_CUDA
#include <cuda_runtime_api.h>
#endif

namespace flashattn::testing {

// The forward suite is compiled once per backend (tests/CMakeLists.txt). The CUDA kernels
// take fp16/bf16 only, so there an fp32 case runs in fp16.
#ifdef FLASHATTN_TEST_CUDA
inline constexpr Backend kTestBackend = Backend::CUDA;
#else
inline constexpr Backend kTestBackend = Backend::CPU;
#endif
inline DType backend_dtype(DType d) {
  return kTestBackend == Backend::CUDA && d == DType::Float32 ? DType::Float16 : d;
}

// Inputs are random and fresh on every run; FLASHATTN_TEST_SEED=<n> replays a run.
inline uint64_t test_seed() {
  static const uint64_t seed = []() -> uint64_t {
    if (const char* s = std::getenv("FLASHATTN_TEST_SEED")) return std::strtoull(s, nullptr, 10);
    return (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
  }();
  return seed;
}

inline std::mt19937_64& rng() {
  static std::mt19937_64 generator(test_seed());
  return generator;
}

// An owning host buffer of `count` elements of `dtype`.
// Sets an environment variable for one test and restores it after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (old_)
      setenv(name_, old_->c_str(), 1);
    else
      unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

struct Buffer {
  DType dtype = DType::Float32;
  std::vector<unsigned char> bytes;

  Buffer() = default;
  Buffer(DType d, int64_t count) : dtype(d), bytes(static_cast<size_t>(count) * dtype_size(d)) {}

  void* data() { return bytes.data(); }
  int64_t count() const { return static_cast<int64_t>(bytes.size() / dtype_size(dtype)); }

  void set(int64_t i, float x) {
    switch (dtype) {
      case DType::Float32:
        reinterpret_cast<float*>(bytes.data())[i] = x;
        break;
      case DType::Float16:
        reinterpret_cast<detail::half_t*>(bytes.data())[i] = detail::to_half(x);
        break;
      case DType::BFloat16:
        reinterpret_cast<detail::bfloat16_t*>(bytes.data())[i] = detail::to_bfloat16(x);
        break;
      case DType::Float8E4M3:  // saturating at 448
        reinterpret_cast<detail::float8_e4m3_t*>(bytes.data())[i] = detail::to_float8_e4m3(x);
        break;
      case DType::Int32:
        reinterpret_cast<int32_t*>(bytes.data())[i] = static_cast<int32_t>(x);
        break;
    }
  }
  // Standard normal values (never all zero).
  void fill_random(float stddev = 1.0f) {
    std::normal_distribution<float> normal(0.0f, stddev);
    for (int64_t i = 0; i < count(); ++i) set(i, normal(rng()));
  }
  // NaN everywhere, so an element the backend forgets to write fails the comparison.
  void poison() {
    for (int64_t i = 0; i < count(); ++i) set(i, std::nanf(""));
  }

  TensorView view(std::initializer_list<int64_t> sizes) {
    return TensorView::contiguous(data(), dtype, sizes);
  }
  TensorView view(std::initializer_list<int64_t> sizes, std::initializer_list<int64_t> strides,
                  int64_t offset = 0) {
    return TensorView::strided(bytes.data() + offset * static_cast<int64_t>(dtype_size(dtype)),
                               dtype, sizes, strides);
  }
};

inline Buffer int32_buffer(const std::vector<int32_t>& values) {
  Buffer b(DType::Int32, static_cast<int64_t>(values.size()));
  std::memcpy(b.data(), values.data(), values.size() * sizeof(int32_t));
  return b;
}

// How q, k and v are laid out in memory (out is always contiguous).
enum class Layout {
  Contiguous,  // (B, S, H, D) row-major
  HeadMajor,   // stored (B, H, S, D), viewed as (B, S, H, D) through strides
  Packed,      // q, k, v are views into one (B, S, 3, H, D) buffer (needs Sq == Sk, H == Hk)
  Padded,      // row-major with 8 unused elements after every head vector
};

inline const char* layout_name(Layout l) {
  switch (l) {
    case Layout::Contiguous:
      return "contiguous";
    case Layout::HeadMajor:
      return "head-major";
    case Layout::Packed:
      return "packed-qkv";
    case Layout::Padded:
      return "padded";
  }
  return "?";
}

struct Case {
  int64_t batch = 1, seqlen_q = 1, seqlen_k = 1, heads = 1, heads_k = 1, head_dim = 64;
  DType dtype = backend_dtype(DType::Float32);
  bool causal = false;
  int32_t window_left = -1, window_right = -1;
  float softcap = 0.0f;
  std::optional<float> softmax_scale = std::nullopt;
  enum class Alibi { Off, PerHead, PerBatchHead } alibi = Alibi::Off;
  float alibi_scale = 1.0f;  // multiplies the slopes; negative ones favour distant keys
  Layout layout = Layout::Contiguous;
  bool with_lse = true;
  int32_t num_threads = 0;
  float dropout_p = 0.0f;  // > 0: options_of draws a fresh seed and offset

  std::string describe() const;
};

inline std::string Case::describe() const {
  std::string s = "B=" + std::to_string(batch) + " Sq=" + std::to_string(seqlen_q) +
                  " Sk=" + std::to_string(seqlen_k) + " H=" + std::to_string(heads) +
                  " Hk=" + std::to_string(heads_k) + " D=" + std::to_string(head_dim) + " " +
                  dtype_name(dtype) + (causal ? " causal" : "") + " window=(" +
                  std::to_string(window_left) + "," + std::to_string(window_right) + ")";
  if (softcap > 0) s += " softcap=" + std::to_string(softcap);
  if (softmax_scale) s += " scale=" + std::to_string(*softmax_scale);
  if (alibi == Alibi::PerHead) s += " alibi(H)";
  if (alibi == Alibi::PerBatchHead) s += " alibi(B,H)";
  if (alibi != Alibi::Off && alibi_scale != 1.0f) s += " alibi_scale=" + std::to_string(alibi_scale);
  if (dropout_p > 0) s += " dropout=" + std::to_string(dropout_p);
  s += std::string(" layout=") + layout_name(layout) + " seed=" + std::to_string(test_seed());
  return s;
}

// ALiBi slopes as in the ALiBi paper (2^(-8 (h+1) / H)), jittered per batch when (B, H).
inline std::vector<float> alibi_slopes(int64_t batch, int64_t heads, bool per_batch) {
  std::vector<float> s;
  std::uniform_real_distribution<float> jitter(0.5f, 1.5f);
  for (int64_t b = 0; b < (per_batch ? batch : 1); ++b)
    for (int64_t h = 0; h < heads; ++h)
      s.push_back(std::exp2(-8.0f * static_cast<float>(h + 1) / static_cast<float>(heads)) *
                  (per_batch ? jitter(rng()) : 1.0f));
  return s;
}

// The three input views of a case, in the buffer(s) its layout asks for.
struct Inputs {
  Buffer q_buf, k_buf, v_buf;  // with Layout::Packed, q_buf holds all three
  TensorView q, k, v;
};

inline Inputs make_inputs(const Case& c) {
  Inputs in;
  const int64_t B = c.batch, Sq = c.seqlen_q, Sk = c.seqlen_k, H = c.heads, Hk = c.heads_k,
                D = c.head_dim;
  switch (c.layout) {
    case Layout::Contiguous:
    case Layout::Padded: {
      const int64_t row = c.layout == Layout::Padded ? D + 8 : D;
      in.q_buf = Buffer(c.dtype, B * Sq * H * row);
      in.k_buf = Buffer(c.dtype, B * Sk * Hk * row);
      in.v_buf = Buffer(c.dtype, B * Sk * Hk * row);
      in.q = in.q_buf.view({B, Sq, H, D}, {Sq * H * row, H * row, row, 1});
      in.k = in.k_buf.view({B, Sk, Hk, D}, {Sk * Hk * row, Hk * row, row, 1});
      in.v = in.v_buf.view({B, Sk, Hk, D}, {Sk * Hk * row, Hk * row, row, 1});
      break;
    }
    case Layout::HeadMajor:
      in.q_buf = Buffer(c.dtype, B * Sq * H * D);
      in.k_buf = Buffer(c.dtype, B * Sk * Hk * D);
      in.v_buf = Buffer(c.dtype, B * Sk * Hk * D);
      in.q = in.q_buf.view({B, Sq, H, D}, {H * Sq * D, D, Sq * D, 1});
      in.k = in.k_buf.view({B, Sk, Hk, D}, {Hk * Sk * D, D, Sk * D, 1});
      in.v = in.v_buf.view({B, Sk, Hk, D}, {Hk * Sk * D, D, Sk * D, 1});
      break;
    case Layout::Packed: {
      EXPECT_EQ(Sq, Sk);
      EXPECT_EQ(H, Hk);
      in.q_buf = Buffer(c.dtype, B * Sq * 3 * H * D);
      const int64_t bs = Sq * 3 * H * D, rs = 3 * H * D;
      in.q = in.q_buf.view({B, Sq, H, D}, {bs, rs, D, 1}, 0);
      in.k = in.q_buf.view({B, Sq, H, D}, {bs, rs, D, 1}, H * D);
      in.v = in.q_buf.view({B, Sq, H, D}, {bs, rs, D, 1}, 2 * H * D);
      break;
    }
  }
  in.q_buf.fill_random();
  in.k_buf.fill_random();
  in.v_buf.fill_random();
  return in;
}

inline Options options_of(const Case& c, Buffer& slopes) {
  Options o;
  o.softmax_scale = c.softmax_scale;
  o.causal = c.causal;
  o.window_left = c.window_left;
  o.window_right = c.window_right;
  o.softcap = c.softcap;
  if (c.dropout_p > 0) {
    o.dropout_p = c.dropout_p;
    o.dropout_seed = rng()();
    o.dropout_offset = rng()() >> 16;
  }
  if (c.alibi != Case::Alibi::Off) {
    const bool per_batch = c.alibi == Case::Alibi::PerBatchHead;
    std::vector<float> s = alibi_slopes(c.batch, c.heads, per_batch);
    for (float& slope : s) slope *= c.alibi_scale;
    slopes = Buffer(DType::Float32, static_cast<int64_t>(s.size()));
    std::memcpy(slopes.data(), s.data(), s.size() * sizeof(float));
    o.alibi_slopes = per_batch ? slopes.view({c.batch, c.heads}) : slopes.view({c.heads});
  }
  return o;
}

// Paged copies of a varlen call's keys and values (Varlen::block_table): key j of sequence b
// (row cu_k[b] + j of the dense k/v) goes to row j % page_size of the sequence's page j /
// page_size, the pages in a random order among a few spare ones. Every page row that holds
// no key is NaN, and every block-table slot past a sequence's keys (seqused_k's, when given)
// holds an index outside [0, num_pages): a backend that reads either fails the comparison.
// `packed`: k and v interleaved in one (num_pages, page_size, 2, Hk, D) buffer (strided views);
// else two contiguous (num_pages, page_size, Hk, D) buffers.
struct PagedKeys {
  Buffer k_buf, v_buf, table_buf;
  TensorView k, v, block_table;
  int64_t num_pages = 0, max_pages = 0;
};

inline PagedKeys page_keys(const TensorView& k, const TensorView& v,
                           const std::vector<int32_t>& cu_k, const std::vector<int32_t>* used,
                           int64_t page_size, bool packed) {
  PagedKeys pk;
  const int64_t B = static_cast<int64_t>(cu_k.size()) - 1, Hk = k.size(1), D = k.size(2);
  const auto pages_for = [&](int64_t keys) { return (keys + page_size - 1) / page_size; };
  int64_t needed = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = pages_for(cu_k[size_t(b + 1)] - cu_k[size_t(b)]);
    needed += n;
    pk.max_pages = std::max(pk.max_pages, n + 1);  // one slot more than any sequence uses
  }
  pk.num_pages = needed + 3;
  std::vector<int32_t> order(static_cast<size_t>(pk.num_pages));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng());
  const int64_t page_elems = page_size * Hk * D;
  if (packed) {
    pk.k_buf = Buffer(k.dtype, pk.num_pages * 2 * page_elems);
    pk.k_buf.poison();
    const std::initializer_list<int64_t> strides{2 * page_elems, 2 * Hk * D, D, 1};
    pk.k = pk.k_buf.view({pk.num_pages, page_size, Hk, D}, strides);
    pk.v = pk.k_buf.view({pk.num_pages, page_size, Hk, D}, strides, Hk * D);
  } else {
    pk.k_buf = Buffer(k.dtype, pk.num_pages * page_elems);
    pk.v_buf = Buffer(k.dtype, pk.num_pages * page_elems);
    pk.k_buf.poison();
    pk.v_buf.poison();
    pk.k = pk.k_buf.view({pk.num_pages, page_size, Hk, D});
    pk.v = pk.v_buf.view({pk.num_pages, page_size, Hk, D});
  }
  std::vector<int32_t> table(static_cast<size_t>(B * pk.max_pages));
  const size_t elem = dtype_size(k.dtype);
  size_t next = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t keys = cu_k[size_t(b + 1)] - cu_k[size_t(b)];
    const int64_t read = used != nullptr ? (*used)[size_t(b)] : keys;
    for (int64_t slot = 0; slot < pk.max_pages; ++slot) {
      int32_t& entry = table[size_t(b * pk.max_pages + slot)];
      if (slot >= pages_for(keys)) {
        entry = slot % 2 ? static_cast<int32_t>(pk.num_pages + slot) : -1 - static_cast<int32_t>(slot);
        continue;
      }
      entry = order[next++];
      for (int64_t r = 0; r < page_size && slot * page_size + r < keys; ++r)
        for (int64_t h = 0; h < Hk; ++h)
          for (const auto& [dense, paged] : {std::pair{&k, &pk.k}, std::pair{&v, &pk.v}}) {
            const int64_t src = (cu_k[size_t(b)] + slot * page_size + r) * dense->stride(0) +
                                h * dense->stride(1);
            const int64_t dst = entry * paged->stride(0) + r * paged->stride(1) + h * paged->stride(2);
            std::memcpy(static_cast<char*>(paged->data) + dst * int64_t(elem),
                        static_cast<const char*>(dense->data) + src * int64_t(elem), size_t(D) * elem);
          }
      // Slots wholly past the keys that take part are never read: out of range too.
      if (slot * page_size >= read)
        entry = slot % 2 ? -1 - static_cast<int32_t>(slot) : static_cast<int32_t>(pk.num_pages + slot);
    }
  }
  pk.table_buf = int32_buffer(table);
  pk.block_table = pk.table_buf.view({B, pk.max_pages});
  return pk;
}

#ifdef FLASHATTN_TEST_CUDA
inline void cuda_check(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

// A device copy of the memory a host view spans (same strides, same gaps), on the current GPU.
class DeviceMirror {
 public:
  explicit DeviceMirror(const TensorView& host) : host_(host), view_(host) {
    int device = 0;
    cuda_check(cudaGetDevice(&device), "cudaGetDevice");
    view_.device = {DeviceType::CUDA, device};
    if (host.data == nullptr || host.numel() == 0) {
      view_.data = nullptr;
      return;
    }
    int64_t last = 0;
    for (int d = 0; d < host.ndim; ++d) last += (host.size(d) - 1) * host.stride(d);
    bytes_ = static_cast<size_t>(last + 1) * dtype_size(host.dtype);
    cuda_check(cudaMalloc(&device_, bytes_), "cudaMalloc");
    cuda_check(cudaMemcpy(device_, host.data, bytes_, cudaMemcpyHostToDevice), "upload");
    view_.data = device_;
  }
  DeviceMirror(const DeviceMirror&) = delete;
  DeviceMirror& operator=(const DeviceMirror&) = delete;
  ~DeviceMirror() { cudaFree(device_); }

  const TensorView& view() const { return view_; }
  void poison() {  // all-ones bytes are NaN in fp32, fp16 and bf16
    if (device_) cuda_check(cudaMemset(device_, 0xff, bytes_), "poison");
  }
  void download() {
    if (device_) cuda_check(cudaMemcpy(host_.data, device_, bytes_, cudaMemcpyDeviceToHost), "download");
  }

 private:
  TensorView host_, view_;
  void* device_ = nullptr;
  size_t bytes_ = 0;
};

// The tensors an Options and a Varlen point to (ALiBi slopes, cu_seqlens, seqused_k) mirrored
// to the GPU, and the Options and Varlen that point to the copies.
class DeviceArguments {
 public:
  DeviceArguments(const Options& options, const Varlen* varlen) : options_(options) {
    if (options.alibi_slopes) options_.alibi_slopes = slopes_.emplace(*options.alibi_slopes).view();
    if (varlen == nullptr) return;
    varlen_ = *varlen;
    varlen_->cu_seqlens_q = cu_q_.emplace(varlen->cu_seqlens_q).view();
    varlen_->cu_seqlens_k = cu_k_.emplace(varlen->cu_seqlens_k).view();
    if (varlen->seqused_k) varlen_->seqused_k = used_.emplace(*varlen->seqused_k).view();
  }
  const Options& options() const { return options_; }
  const Varlen* varlen() const { return varlen_ ? &*varlen_ : nullptr; }

 private:
  std::optional<DeviceMirror> slopes_, cu_q_, cu_k_, used_;
  Options options_;
  std::optional<Varlen> varlen_;
};

// Without a GPU every test of the CUDA suite reports itself skipped, with the reason.
class CudaEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    std::string why;
    if (cuda_devices(&why).empty()) GTEST_SKIP() << "no CUDA device: " << why;
  }
};
inline ::testing::Environment* const cuda_environment =
    ::testing::AddGlobalTestEnvironment(new CudaEnvironment);
#endif

// Runs forward (dense when varlen is null) on the suite's backend, with host views in and
// out: on CUDA every tensor is mirrored to the GPU, outputs poisoned there and copied back.
inline RunInfo forward_on_backend(const TensorView& q, const TensorView& k, const TensorView& v,
                                  const TensorView& out, const std::optional<TensorView>& lse,
                                  const Options& options, const Varlen* varlen = nullptr,
                                  Execution execution = {}) {
  execution.backend = kTestBackend;
#ifndef FLASHATTN_TEST_CUDA
  return varlen ? forward_varlen(q, k, v, out, lse, *varlen, options, execution)
                : forward(q, k, v, out, lse, options, execution);
#else
  DeviceMirror dq(q), dk(k), dv(v), dout(out);
  std::optional<DeviceMirror> dlse, dslopes, dcuq, dcuk, dused, dtable, dqd, dkd, dvd;
  Options device_options = options;
  if (options.alibi_slopes) device_options.alibi_slopes = dslopes.emplace(*options.alibi_slopes).view();
  if (options.q_descale) device_options.q_descale = dqd.emplace(*options.q_descale).view();
  if (options.k_descale) device_options.k_descale = dkd.emplace(*options.k_descale).view();
  if (options.v_descale) device_options.v_descale = dvd.emplace(*options.v_descale).view();
  std::optional<TensorView> lse_view;
  if (lse) lse_view = dlse.emplace(*lse).view();
  dout.poison();
  if (dlse) dlse->poison();
  RunInfo info;
  if (varlen) {
    Varlen dvarlen = *varlen;
    dvarlen.cu_seqlens_q = dcuq.emplace(varlen->cu_seqlens_q).view();
    dvarlen.cu_seqlens_k = dcuk.emplace(varlen->cu_seqlens_k).view();
    if (varlen->seqused_k) dvarlen.seqused_k = dused.emplace(*varlen->seqused_k).view();
    if (varlen->block_table) dvarlen.block_table = dtable.emplace(*varlen->block_table).view();
    info = forward_varlen(dq.view(), dk.view(), dv.view(), dout.view(), lse_view, dvarlen,
                          device_options, execution);
  } else {
    info = forward(dq.view(), dk.view(), dv.view(), dout.view(), lse_view, device_options,
                   execution);
  }
  cuda_check(cudaDeviceSynchronize(), "kernel");
  dout.download();
  if (dlse) dlse->download();
  return info;
#endif
}

// Runs backward (dense when varlen is null) on the suite's backend, with host views in and
// out: on CUDA every input is mirrored to the GPU, the gradients poisoned there (so an element
// the kernels forget to write comes back NaN) and copied back after the call.
inline RunInfo backward_on_backend(const TensorView& q, const TensorView& k, const TensorView& v,
                                   const TensorView& out, const TensorView& dout,
                                   const TensorView& lse, const TensorView& dq,
                                   const TensorView& dk, const TensorView& dv,
                                   const Options& options, const Varlen* varlen = nullptr,
                                   Execution execution = {}) {
  execution.backend = kTestBackend;
#ifndef FLASHATTN_TEST_CUDA
  return varlen ? backward_varlen(q, k, v, out, dout, lse, dq, dk, dv, *varlen, options, execution)
                : backward(q, k, v, out, dout, lse, dq, dk, dv, options, execution);
#else
  DeviceMirror mq(q), mk(k), mv(v), mout(out), mdout(dout), mlse(lse), mdq(dq), mdk(dk), mdv(dv);
  std::optional<DeviceMirror> mslopes, mcuq, mcuk, mused;
  Options device_options = options;
  if (options.alibi_slopes) device_options.alibi_slopes = mslopes.emplace(*options.alibi_slopes).view();
  mdq.poison();
  mdk.poison();
  mdv.poison();
  RunInfo info;
  if (varlen) {
    Varlen dvarlen = *varlen;
    dvarlen.cu_seqlens_q = mcuq.emplace(varlen->cu_seqlens_q).view();
    dvarlen.cu_seqlens_k = mcuk.emplace(varlen->cu_seqlens_k).view();
    if (varlen->seqused_k) dvarlen.seqused_k = mused.emplace(*varlen->seqused_k).view();
    info = backward_varlen(mq.view(), mk.view(), mv.view(), mout.view(), mdout.view(),
                           mlse.view(), mdq.view(), mdk.view(), mdv.view(), dvarlen,
                           device_options, execution);
  } else {
    info = backward(mq.view(), mk.view(), mv.view(), mout.view(), mdout.view(), mlse.view(),
                    mdq.view(), mdk.view(), mdv.view(), device_options, execution);
  }
  cuda_check(cudaDeviceSynchronize(), "kernel");
  mdq.download();
  mdk.download();
  mdv.download();
  return info;
#endif
}

// Checks a backend's out (and lse) against the oracle under the accuracy rule.
inline void expect_matches_reference(const TensorView& q, const TensorView& k, const TensorView& v,
                                     const Options& options, const Varlen* varlen,
                                     const TensorView& out, const TensorView* lse,
                                     const std::string& what) {
  using reference::Arithmetic;
  const reference::Result exact = reference::forward(q, k, v, options, varlen);
  reference::Result low;
  if (q.dtype != DType::Float32)
    low = reference::forward(q, k, v, options, varlen, Arithmetic::InputDType);
  const reference::Check out_check =
      reference::check_forward(q.dtype, reference::gather(out), exact.out, low.out);
  EXPECT_TRUE(out_check.passed()) << what << "\n  out: max abs error " << out_check.max_abs_error
                                  << " > tolerance " << out_check.tolerance;
  if (lse != nullptr) {
    const reference::Check lse_check =
        reference::check_forward(q.dtype, reference::gather(*lse), exact.lse, low.lse);
    EXPECT_TRUE(lse_check.passed()) << what << "\n  lse: max abs error "
                                    << lse_check.max_abs_error << " > tolerance "
                                    << lse_check.tolerance;
  }
}

// Runs one dense case on `backend` with fresh inputs and poisoned outputs, and checks it.
inline void run_dense_case(Case c) {
  c.dtype = backend_dtype(c.dtype);
  SCOPED_TRACE(c.describe());
  Inputs in = make_inputs(c);
  Buffer slopes;
  const Options options = options_of(c, slopes);
  Buffer out_buf(c.dtype, c.batch * c.seqlen_q * c.heads * c.head_dim);
  Buffer lse_buf(DType::Float32, c.batch * c.heads * c.seqlen_q);
  out_buf.poison();
  lse_buf.poison();
  const TensorView out = out_buf.view({c.batch, c.seqlen_q, c.heads, c.head_dim});
  const TensorView lse = lse_buf.view({c.batch, c.heads, c.seqlen_q});
  Execution exec;
  exec.num_threads = c.num_threads;
  const RunInfo info = forward_on_backend(
      in.q, in.k, in.v, out, c.with_lse ? std::optional<TensorView>(lse) : std::nullopt, options,
      nullptr, exec);
  EXPECT_EQ(info.backend, kTestBackend);
  expect_matches_reference(in.q, in.k, in.v, options, nullptr, out, c.with_lse ? &lse : nullptr,
                           c.describe());
}

}  // namespace flashattn::testing

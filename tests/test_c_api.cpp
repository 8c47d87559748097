// The C ABI (include/flashattn/flashattn.h): struct initialisers, status codes, the per-thread
// last-error message, and that fa_forward / fa_forward_varlen compute exactly what the C++ API
// computes on the same inputs. Every rejected call must leave its outputs (and fa_run_info)
// byte for byte as they were.
#include "flashattn/flashattn.h"

#include <array>
#include <cstring>
#include <functional>
#include <limits>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "support.hpp"

namespace flashattn::testing {
namespace {

// The C enums are the C++ ones, value for value.
static_assert(FA_MAX_DIMS == kMaxDims);
static_assert(FA_OK == 0);
static_assert(FA_ERROR_INVALID_ARGUMENT == static_cast<int>(ErrorCode::InvalidArgument));
static_assert(FA_ERROR_UNSUPPORTED == static_cast<int>(ErrorCode::Unsupported));
static_assert(FA_ERROR_BACKEND == static_cast<int>(ErrorCode::Backend));
static_assert(FA_ERROR_INTERNAL == static_cast<int>(ErrorCode::Internal));
static_assert(FA_FLOAT32 == static_cast<int>(DType::Float32));
static_assert(FA_FLOAT16 == static_cast<int>(DType::Float16));
static_assert(FA_BFLOAT16 == static_cast<int>(DType::BFloat16));
static_assert(FA_INT32 == static_cast<int>(DType::Int32));
static_assert(FA_DEVICE_CPU == static_cast<int>(DeviceType::CPU));
static_assert(FA_DEVICE_CUDA == static_cast<int>(DeviceType::CUDA));
static_assert(FA_BACKEND_AUTO == static_cast<int>(Backend::Auto));
static_assert(FA_BACKEND_CPU == static_cast<int>(Backend::CPU));
static_assert(FA_BACKEND_CUDA == static_cast<int>(Backend::CUDA));

constexpr unsigned char kSentinel = 0xA5;

fa_tensor to_c(const TensorView& t) {
  fa_tensor c;
  std::memset(&c, 0, sizeof c);
  c.data = t.data;
  c.dtype = static_cast<int32_t>(t.dtype);
  c.device_type = static_cast<int32_t>(t.device.type);
  c.device_index = t.device.index;
  c.ndim = t.ndim;
  for (int d = 0; d < t.ndim && d < kMaxDims; ++d) {
    c.sizes[d] = t.sizes[static_cast<size_t>(d)];
    c.strides[d] = t.strides[static_cast<size_t>(d)];
  }
  return c;
}

// The test's own mirror of the C -> C++ conversion, to call the C++ API with the same
// arguments (only for structs the C layer accepts).
TensorView to_cpp(const fa_tensor& c) {
  TensorView t;
  t.data = c.data;
  t.dtype = static_cast<DType>(c.dtype);
  t.device = {static_cast<DeviceType>(c.device_type), c.device_index};
  t.ndim = c.ndim;
  for (int d = 0; d < c.ndim && d < kMaxDims; ++d) {
    t.sizes[static_cast<size_t>(d)] = c.sizes[d];
    t.strides[static_cast<size_t>(d)] = c.strides[d];
  }
  return t;
}

Options to_cpp(const fa_options& o) {
  Options options;
  if (o.has_softmax_scale) options.softmax_scale = o.softmax_scale;
  options.causal = o.causal != 0;
  options.window_left = o.window_left;
  options.window_right = o.window_right;
  options.softcap = o.softcap;
  if (o.alibi_slopes != nullptr) options.alibi_slopes = to_cpp(*o.alibi_slopes);
  options.dropout_p = o.dropout_p;
  options.dropout_seed = o.dropout_seed;
  options.dropout_offset = o.dropout_offset;
  options.deterministic = o.deterministic != 0;
  return options;
}

Execution to_cpp(const fa_execution& e) {
  Execution execution;
  execution.backend = static_cast<Backend>(e.backend);
  execution.stream = e.stream;
  execution.num_threads = e.num_threads;
  return execution;
}

std::string last_error() { return fa_last_error(); }

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}

template <typename T>
std::vector<unsigned char> bytes_of(const T& value) {
  std::vector<unsigned char> b(sizeof(T));
  std::memcpy(b.data(), &value, sizeof(T));
  return b;
}

// ---------------------------------------------------------------------------------------------
// Initialisers.

TEST(CInit, OptionsDefaults) {
  fa_options o;
  std::memset(&o, 0xFF, sizeof o);
  fa_options_init(&o);
  EXPECT_EQ(o.struct_size, sizeof(fa_options));
  EXPECT_EQ(o.has_softmax_scale, 0);
  EXPECT_EQ(o.softmax_scale, 0.0f);
  EXPECT_EQ(o.causal, 0);
  EXPECT_EQ(o.window_left, -1);
  EXPECT_EQ(o.window_right, -1);
  EXPECT_EQ(o.softcap, 0.0f);
  EXPECT_EQ(o.alibi_slopes, nullptr);
  EXPECT_EQ(o.dropout_p, 0.0f);
  EXPECT_EQ(o.dropout_seed, 0u);
  EXPECT_EQ(o.dropout_offset, 0u);
  EXPECT_EQ(o.deterministic, 0);
}

TEST(CInit, ExecutionDefaults) {
  fa_execution e;
  std::memset(&e, 0xFF, sizeof e);
  fa_execution_init(&e);
  EXPECT_EQ(e.struct_size, sizeof(fa_execution));
  EXPECT_EQ(e.backend, FA_BACKEND_AUTO);
  EXPECT_EQ(e.stream, nullptr);
  EXPECT_EQ(e.num_threads, 0);
}

TEST(CInit, RunInfoDefaults) {
  fa_run_info info;
  std::memset(&info, 0xFF, sizeof info);
  fa_run_info_init(&info);
  EXPECT_EQ(info.struct_size, sizeof(fa_run_info));
  EXPECT_EQ(info.workspace_bytes, 0u);
  EXPECT_EQ(info.num_splits, 1);
}

TEST(CInit, KvCacheDefaults) {
  fa_kvcache c;
  std::memset(&c, 0xFF, sizeof c);
  fa_kvcache_init(&c);
  EXPECT_EQ(c.struct_size, sizeof(fa_kvcache));
  for (const fa_tensor* t : {c.k_cache, c.v_cache, c.cache_seqlens, c.k_new, c.v_new,
                             c.rotary_cos, c.rotary_sin, c.cache_batch_idx, c.cache_leftpad,
                             c.block_table})
    EXPECT_EQ(t, nullptr);
  EXPECT_EQ(c.rotary_interleaved, 0);
  EXPECT_EQ(c.num_splits, 0);
}

TEST(CInit, NullIsIgnored) {
  fa_options_init(nullptr);
  fa_execution_init(nullptr);
  fa_run_info_init(nullptr);
  fa_kvcache_init(nullptr);
}

TEST(CInfo, VersionAndCudaMatchCpp) {
  ASSERT_NE(fa_version(), nullptr);
  EXPECT_STREQ(fa_version(), version());
  EXPECT_FALSE(std::string(fa_version()).empty());
  EXPECT_EQ(fa_cuda_compiled() != 0, cuda_compiled());
}

// ---------------------------------------------------------------------------------------------
// A dense problem with C and C++ copies of the outputs: B=2, Sq=5, Sk=7, H=4, Hk=2, D=32.

struct DenseProblem {
  static constexpr int64_t B = 2, Sq = 5, Sk = 7, H = 4, Hk = 2, D = 32;
  DType dtype;
  Buffer q_buf, k_buf, v_buf, alibi_buf;
  Buffer out_c, lse_c, out_cpp, lse_cpp;  // C call and C++ call outputs
  TensorView q, k, v;
  fa_tensor cq, ck, cv, cout, clse, calibi;

  explicit DenseProblem(DType d = DType::Float32)
      : dtype(d),
        q_buf(d, B * Sq * H * D),
        k_buf(d, B * Sk * Hk * D),
        v_buf(d, B * Sk * Hk * D),
        alibi_buf(DType::Float32, B * H),
        out_c(d, B * Sq * H * D),
        lse_c(DType::Float32, B * H * Sq),
        out_cpp(d, B * Sq * H * D),
        lse_cpp(DType::Float32, B * H * Sq) {
    q_buf.fill_random();
    k_buf.fill_random();
    v_buf.fill_random();
    for (int64_t i = 0; i < alibi_buf.count(); ++i) alibi_buf.set(i, 0.1f * (1 + i % 5));
    for (Buffer* b : {&out_c, &lse_c, &out_cpp, &lse_cpp}) b->poison();
    // k is head-major, to show strides cross the ABI.
    q = q_buf.view({B, Sq, H, D});
    k = k_buf.view({B, Sk, Hk, D}, {Hk * Sk * D, D, Sk * D, 1});
    v = v_buf.view({B, Sk, Hk, D});
    cq = to_c(q);
    ck = to_c(k);
    cv = to_c(v);
    cout = to_c(out_c.view({B, Sq, H, D}));
    clse = to_c(lse_c.view({B, H, Sq}));
    calibi = to_c(alibi_buf.view({B, H}));
  }

  TensorView out_cpp_view() { return out_cpp.view({B, Sq, H, D}); }
  TensorView lse_cpp_view() { return lse_cpp.view({B, H, Sq}); }
};

// A varlen problem: query lengths (3, 0, 6), key lengths (5, 2, 4); H=4, Hk=1, D=16.
struct VarlenProblem {
  static constexpr int64_t total_q = 9, total_k = 11, H = 4, Hk = 1, D = 16;
  Buffer q_buf{DType::Float32, total_q * H * D}, k_buf{DType::Float32, total_k * Hk * D},
      v_buf{DType::Float32, total_k * Hk * D}, out_c{DType::Float32, total_q * H * D},
      lse_c{DType::Float32, H * total_q}, out_cpp{DType::Float32, total_q * H * D},
      lse_cpp{DType::Float32, H * total_q};
  Buffer cu_q = int32_buffer({0, 3, 3, 9}), cu_k = int32_buffer({0, 5, 7, 11}),
         seqused = int32_buffer({4, 2, 0});
  int64_t max_q = 6, max_k = 5;
  fa_tensor cq, ck, cv, cout, clse, ccu_q, ccu_k, cseqused;

  VarlenProblem() {
    q_buf.fill_random();
    k_buf.fill_random();
    v_buf.fill_random();
    for (Buffer* b : {&out_c, &lse_c, &out_cpp, &lse_cpp}) b->poison();
    cq = to_c(q_buf.view({total_q, H, D}));
    ck = to_c(k_buf.view({total_k, Hk, D}));
    cv = to_c(v_buf.view({total_k, Hk, D}));
    cout = to_c(out_c.view({total_q, H, D}));
    clse = to_c(lse_c.view({H, total_q}));
    ccu_q = to_c(cu_q.view({4}));
    ccu_k = to_c(cu_k.view({4}));
    cseqused = to_c(seqused.view({3}));
  }

  Varlen varlen(bool with_seqused) {
    Varlen v;
    v.cu_seqlens_q = cu_q.view({4});
    v.cu_seqlens_k = cu_k.view({4});
    v.max_seqlen_q = max_q;
    v.max_seqlen_k = max_k;
    if (with_seqused) v.seqused_k = seqused.view({3});
    return v;
  }
};

// ---------------------------------------------------------------------------------------------
// Valid calls: the C ABI gives exactly the C++ result.

TEST(CForward, BitIdenticalToCpp) {
  for (const DType dtype : {DType::Float32, DType::Float16, DType::BFloat16}) {
    for (const bool all_options : {false, true}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) +
                   (all_options ? " with scale, causal, window, softcap, alibi (B, H)"
                                : " default options"));
      DenseProblem p(dtype);
      fa_options o;
      fa_options_init(&o);
      fa_execution e;
      fa_execution_init(&e);
      e.num_threads = 2;
      if (all_options) {
        o.has_softmax_scale = 1;
        o.softmax_scale = 0.3f;
        o.causal = 1;
        o.window_left = 3;
        o.softcap = 20.0f;
        o.alibi_slopes = &p.calibi;
        e.backend = FA_BACKEND_CPU;
      }
      fa_run_info info;
      fa_run_info_init(&info);
      ASSERT_EQ(fa_forward(&p.cq, &p.ck, &p.cv, &p.cout, &p.clse, &o, &e, &info), FA_OK)
          << last_error();
      EXPECT_EQ(last_error(), "");
      EXPECT_EQ(info.struct_size, sizeof(fa_run_info));
      EXPECT_EQ(info.backend, FA_BACKEND_CPU);
      EXPECT_GT(info.workspace_bytes, 0u);

      const RunInfo cpp = forward(p.q, p.k, p.v, p.out_cpp_view(), p.lse_cpp_view(), to_cpp(o),
                                  to_cpp(e));
      EXPECT_EQ(info.workspace_bytes, cpp.workspace_bytes);
      EXPECT_TRUE(p.out_c.bytes == p.out_cpp.bytes) << "out differs between C and C++";
      EXPECT_TRUE(p.lse_c.bytes == p.lse_cpp.bytes) << "lse differs between C and C++";
      // And the result is right, not merely the same.
      const Options options = to_cpp(o);
      const TensorView out = p.out_c.view({p.B, p.Sq, p.H, p.D});
      const TensorView lse = p.lse_c.view({p.B, p.H, p.Sq});
      expect_matches_reference(p.q, p.k, p.v, options, nullptr, out, &lse, "C ABI dense");
    }
  }
}

// fa_backward and fa_backward_varlen give the C++ entry points' bytes, dropout included.
TEST(CBackward, BitIdenticalToCpp) {
  for (const DType dtype : {DType::Float32, DType::BFloat16}) {
    SCOPED_TRACE(dtype_name(dtype));
    DenseProblem p(dtype);
    fa_options o;
    fa_options_init(&o);
    o.causal = 1;
    o.softcap = 20.0f;
    o.alibi_slopes = &p.calibi;
    o.dropout_p = 0.25f;
    o.dropout_seed = 77;
    o.dropout_offset = 5;
    o.deterministic = 1;
    ASSERT_EQ(fa_forward(&p.cq, &p.ck, &p.cv, &p.cout, &p.clse, &o, nullptr, nullptr), FA_OK)
        << last_error();
    using P = DenseProblem;
    Buffer dout(dtype, P::B * P::Sq * P::H * P::D);
    dout.fill_random();
    Buffer grads[2][3];
    for (auto& set : grads) {
      set[0] = Buffer(dtype, P::B * P::Sq * P::H * P::D);
      set[1] = Buffer(dtype, P::B * P::Sk * P::Hk * P::D);
      set[2] = Buffer(dtype, P::B * P::Sk * P::Hk * P::D);
      for (Buffer& b : set) b.poison();
    }
    const TensorView out = p.out_c.view({P::B, P::Sq, P::H, P::D});
    const TensorView lse = p.lse_c.view({P::B, P::H, P::Sq});
    const TensorView dov = dout.view({P::B, P::Sq, P::H, P::D});
    const auto views = [&](Buffer* set) {
      return std::array<TensorView, 3>{set[0].view({P::B, P::Sq, P::H, P::D}),
                                       set[1].view({P::B, P::Sk, P::Hk, P::D}),
                                       set[2].view({P::B, P::Sk, P::Hk, P::D})};
    };
    const auto c_views = views(grads[0]), cpp_views = views(grads[1]);
    const fa_tensor cdout = to_c(dov), cdq = to_c(c_views[0]), cdk = to_c(c_views[1]),
                    cdv = to_c(c_views[2]);
    fa_run_info info;
    fa_run_info_init(&info);
    ASSERT_EQ(fa_backward(&p.cq, &p.ck, &p.cv, &p.cout, &cdout, &p.clse, &cdq, &cdk, &cdv, &o,
                          nullptr, &info),
              FA_OK)
        << last_error();
    EXPECT_EQ(info.deterministic, 1);
    EXPECT_EQ(info.backend, FA_BACKEND_CPU);
    backward(p.q, p.k, p.v, out, dov, lse, cpp_views[0], cpp_views[1], cpp_views[2], to_cpp(o));
    for (int g = 0; g < 3; ++g)
      EXPECT_TRUE(grads[0][g].bytes == grads[1][g].bytes) << "gradient " << g << " differs";
    // A missing lse is an error with a message, not a crash.
    EXPECT_EQ(fa_backward(&p.cq, &p.ck, &p.cv, &p.cout, &cdout, nullptr, &cdq, &cdk, &cdv, &o,
                          nullptr, nullptr),
              FA_ERROR_INVALID_ARGUMENT);
    EXPECT_EQ(last_error(), "lse: expected a tensor, given NULL");
    // The struct_size rule holds for the grown fa_options.
    fa_options old = o;
    old.struct_size = sizeof(fa_options) - sizeof(int32_t) - 4;
    EXPECT_EQ(fa_backward(&p.cq, &p.ck, &p.cv, &p.cout, &cdout, &p.clse, &cdq, &cdk, &cdv, &old,
                          nullptr, nullptr),
              FA_ERROR_INVALID_ARGUMENT);
    EXPECT_TRUE(starts_with(last_error(), "options: expected struct_size")) << last_error();
  }
}

TEST(CBackwardVarlen, MatchesCpp) {
  // Query lengths (3, 0, 6), key lengths (5, 2, 4); H = 4, Hk = 1, D = 16.
  const int64_t total_q = 9, total_k = 11, H = 4, Hk = 1, D = 16;
  Buffer q(DType::Float32, total_q * H * D), k(DType::Float32, total_k * Hk * D),
      v(DType::Float32, total_k * Hk * D), out(DType::Float32, total_q * H * D),
      lse(DType::Float32, H * total_q), dout(DType::Float32, total_q * H * D);
  for (Buffer* b : {&q, &k, &v, &dout}) b->fill_random();
  Buffer cuq = int32_buffer({0, 3, 3, 9}), cuk = int32_buffer({0, 5, 7, 11});
  Varlen varlen;
  varlen.cu_seqlens_q = cuq.view({4});
  varlen.cu_seqlens_k = cuk.view({4});
  varlen.max_seqlen_q = 6;
  varlen.max_seqlen_k = 5;
  Options o;
  o.causal = true;
  o.dropout_p = 0.5f;
  const TensorView qv = q.view({total_q, H, D}), kv = k.view({total_k, Hk, D}),
                   vv = v.view({total_k, Hk, D}), ov = out.view({total_q, H, D}),
                   lv = lse.view({H, total_q}), dov = dout.view({total_q, H, D});
  forward_varlen(qv, kv, vv, ov, lv, varlen, o);
  Buffer c_dq(DType::Float32, total_q * H * D), c_dk(DType::Float32, total_k * Hk * D),
      c_dv(DType::Float32, total_k * Hk * D);
  Buffer dq(DType::Float32, total_q * H * D), dk(DType::Float32, total_k * Hk * D),
      dv(DType::Float32, total_k * Hk * D);
  backward_varlen(qv, kv, vv, ov, dov, lv, dq.view({total_q, H, D}), dk.view({total_k, Hk, D}),
                  dv.view({total_k, Hk, D}), varlen, o);
  fa_options co;
  fa_options_init(&co);
  co.causal = 1;
  co.dropout_p = 0.5f;
  const fa_tensor cq = to_c(qv), ck = to_c(kv), cv = to_c(vv), cout = to_c(ov), clse = to_c(lv),
                  cdout = to_c(dov), cdq = to_c(c_dq.view({total_q, H, D})),
                  cdk = to_c(c_dk.view({total_k, Hk, D})), cdv = to_c(c_dv.view({total_k, Hk, D})),
                  ccuq = to_c(varlen.cu_seqlens_q), ccuk = to_c(varlen.cu_seqlens_k);
  ASSERT_EQ(fa_backward_varlen(&cq, &ck, &cv, &cout, &cdout, &clse, &cdq, &cdk, &cdv, &ccuq,
                               &ccuk, 6, 5, nullptr, &co, nullptr, nullptr),
            FA_OK)
      << last_error();
  EXPECT_TRUE(c_dq.bytes == dq.bytes);
  EXPECT_TRUE(c_dk.bytes == dk.bytes);
  EXPECT_TRUE(c_dv.bytes == dv.bytes);
}

TEST(CForward, NullOptionalArgumentsAccepted) {
  DenseProblem p;
  // lse, options, execution and info all NULL.
  ASSERT_EQ(fa_forward(&p.cq, &p.ck, &p.cv, &p.cout, nullptr, nullptr, nullptr, nullptr), FA_OK)
      << last_error();
  EXPECT_EQ(last_error(), "");
  forward(p.q, p.k, p.v, p.out_cpp_view(), std::nullopt);
  EXPECT_TRUE(p.out_c.bytes == p.out_cpp.bytes) << "out differs between C and C++";

  // Each NULL on its own, too.
  fa_options o;
  fa_options_init(&o);
  fa_execution e;
  fa_execution_init(&e);
  fa_run_info info;
  fa_run_info_init(&info);
  EXPECT_EQ(fa_forward(&p.cq, &p.ck, &p.cv, &p.cout, nullptr, &o, &e, &info), FA_OK);
  EXPECT_EQ(fa_forward(&p.cq, &p.ck, &p.cv, &p.cout, &p.clse, nullptr, &e, &info), FA_OK);
  EXPECT_EQ(fa_forward(&p.cq, &p.ck, &p.cv, &p.cout, &p.clse, &o, nullptr, &info), FA_OK);
  EXPECT_EQ(fa_forward(&p.cq, &p.ck, &p.cv, &p.cout, &p.clse, &o, &e, nullptr), FA_OK);
  forward(p.q, p.k, p.v, p.out_cpp_view(), p.lse_cpp_view());
  EXPECT_TRUE(p.out_c.bytes == p.out_cpp.bytes);
  EXPECT_TRUE(p.lse_c.bytes == p.lse_cpp.bytes);
}

// Entries of sizes/strides past ndim are not read.
TEST(CForward, EntriesPastNdimIgnored) {
  DenseProblem p;
  for (fa_tensor* t : {&p.cq, &p.ck, &p.cv, &p.cout}) {
    t->sizes[4] = t->sizes[5] = -123;
    t->strides[4] = t->strides[5] = -7;
  }
  p.clse.sizes[3] = -1;
  EXPECT_EQ(fa_forward(&p.cq, &p.ck, &p.cv, &p.cout, &p.clse, nullptr, nullptr, nullptr), FA_OK)
      << last_error();
}

TEST(CForwardVarlen, BitIdenticalToCpp) {
  for (const bool with_seqused : {false, true}) {
    SCOPED_TRACE(with_seqused ? "seqused_k = (4, 2, 0)" : "no seqused_k");
    VarlenProblem p;
    fa_run_info info;
    fa_run_info_init(&info);
    ASSERT_EQ(fa_forward_varlen(&p.cq, &p.ck, &p.cv, &p.cout, &p.clse, &p.ccu_q, &p.ccu_k,
                                p.max_q, p.max_k, with_seqused ? &p.cseqused : nullptr, nullptr,
                                nullptr, &info),
              FA_OK)
        << last_error();
    EXPECT_EQ(last_error(), "");
    EXPECT_EQ(info.backend, FA_BACKEND_CPU);
    EXPECT_GT(info.workspace_bytes, 0u);

    const Varlen varlen = p.varlen(with_seqused);
    const TensorView q = to_cpp(p.cq), k = to_cpp(p.ck), v = to_cpp(p.cv);
    const RunInfo cpp = forward_varlen(q, k, v, p.out_cpp.view({p.total_q, p.H, p.D}),
                                       p.lse_cpp.view({p.H, p.total_q}), varlen);
    EXPECT_EQ(info.workspace_bytes, cpp.workspace_bytes);
    EXPECT_TRUE(p.out_c.bytes == p.out_cpp.bytes) << "out differs between C and C++";
    EXPECT_TRUE(p.lse_c.bytes == p.lse_cpp.bytes) << "lse differs between C and C++";
    const TensorView lse = to_cpp(p.clse);
    expect_matches_reference(q, k, v, {}, &varlen, to_cpp(p.cout), &lse, "C ABI varlen");
  }
}

TEST(CForwardVarlen, NullOptionalArgumentsAccepted) {
  VarlenProblem p;
  EXPECT_EQ(fa_forward_varlen(&p.cq, &p.ck, &p.cv, &p.cout, nullptr, &p.ccu_q, &p.ccu_k, p.max_q,
                              p.max_k, nullptr, nullptr, nullptr, nullptr),
            FA_OK)
      << last_error();
}

// fa_forward_varlen_paged: the keys of VarlenProblem in pages of 3 rows (random order, NaN
// where no key is) give the C++ call's bytes and, on the CPU engine, which loads the same key
// tiles either way, the dense call's bytes; with block_table NULL it is fa_forward_varlen.
TEST(CForwardVarlenPaged, BitIdenticalToCppAndToTheDenseCall) {
  for (const bool with_seqused : {false, true}) {
    SCOPED_TRACE(with_seqused ? "seqused_k = (4, 2, 0)" : "no seqused_k");
    VarlenProblem p;
    const Varlen dense = p.varlen(with_seqused);
    const std::vector<int32_t> cu_k{0, 5, 7, 11}, used{4, 2, 0};
    const PagedKeys pages = page_keys(to_cpp(p.ck), to_cpp(p.cv), cu_k,
                                      with_seqused ? &used : nullptr, 3, with_seqused);
    const fa_tensor ck = to_c(pages.k), cv = to_c(pages.v), ctable = to_c(pages.block_table);
    fa_run_info info;
    fa_run_info_init(&info);
    ASSERT_EQ(fa_forward_varlen_paged(&p.cq, &ck, &cv, &p.cout, &p.clse, &p.ccu_q, &p.ccu_k,
                                      p.max_q, p.max_k, with_seqused ? &p.cseqused : nullptr,
                                      &ctable, nullptr, nullptr, &info),
              FA_OK)
        << last_error();
    EXPECT_EQ(info.backend, FA_BACKEND_CPU);

    Varlen paged = dense;
    paged.block_table = pages.block_table;
    const TensorView q = to_cpp(p.cq);
    const RunInfo cpp = forward_varlen(q, pages.k, pages.v, p.out_cpp.view({p.total_q, p.H, p.D}),
                                       p.lse_cpp.view({p.H, p.total_q}), paged);
    EXPECT_EQ(info.workspace_bytes, cpp.workspace_bytes);
    EXPECT_TRUE(p.out_c.bytes == p.out_cpp.bytes) << "out differs between C and C++";
    EXPECT_TRUE(p.lse_c.bytes == p.lse_cpp.bytes) << "lse differs between C and C++";

    ASSERT_EQ(fa_forward_varlen_paged(&p.cq, &p.ck, &p.cv, &p.cout, &p.clse, &p.ccu_q, &p.ccu_k,
                                      p.max_q, p.max_k, with_seqused ? &p.cseqused : nullptr,
                                      nullptr, nullptr, nullptr, nullptr),
              FA_OK)
        << last_error();
    EXPECT_TRUE(p.out_c.bytes == p.out_cpp.bytes) << "out differs between paged and dense";
    EXPECT_TRUE(p.lse_c.bytes == p.lse_cpp.bytes) << "lse differs between paged and dense";
    const TensorView lse = to_cpp(p.clse);
    expect_matches_reference(q, to_cpp(p.ck), to_cpp(p.cv), {}, &dense, to_cpp(p.cout), &lse,
                             "C ABI paged varlen");
  }
}

// A bad block table comes back as the C++ message; the backward has no block table to take.
TEST(CForwardVarlenPaged, BadBlockTableIsTheCppMessage) {
  VarlenProblem p;
  const std::vector<int32_t> cu_k{0, 5, 7, 11};
  PagedKeys pages = page_keys(to_cpp(p.ck), to_cpp(p.cv), cu_k, nullptr, 2, false);
  static_cast<int32_t*>(pages.block_table.data)[1] = static_cast<int32_t>(pages.num_pages);
  const fa_tensor ck = to_c(pages.k), cv = to_c(pages.v), ctable = to_c(pages.block_table);
  std::memset(p.out_c.data(), kSentinel, p.out_c.bytes.size());
  const std::vector<unsigned char> before = p.out_c.bytes;
  ASSERT_EQ(fa_forward_varlen_paged(&p.cq, &ck, &cv, &p.cout, &p.clse, &p.ccu_q, &p.ccu_k,
                                    p.max_q, p.max_k, nullptr, &ctable, nullptr, nullptr,
                                    nullptr),
            FA_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(starts_with(last_error(), "block_table: expected page indices in [0, num_pages = "))
      << last_error();
  EXPECT_TRUE(before == p.out_c.bytes);
  fa_tensor bad_rank = ctable;
  bad_rank.ndim = 9;
  EXPECT_EQ(fa_forward_varlen_paged(&p.cq, &ck, &cv, &p.cout, &p.clse, &p.ccu_q, &p.ccu_k,
                                    p.max_q, p.max_k, nullptr, &bad_rank, nullptr, nullptr,
                                    nullptr),
            FA_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(last_error(), "block_table: expected 0 to 6 dimensions, given 9 dimensions");
}

// ---------------------------------------------------------------------------------------------
// Rejected calls: one table of mutations of a valid C call.

struct CCall {
  DenseProblem p;
  VarlenProblem vp;
  bool varlen = false;
  const fa_tensor *q, *k, *v, *out, *lse;
  const fa_tensor *cu_q = nullptr, *cu_k = nullptr, *seqused = nullptr;
  int64_t max_q = 0, max_k = 0;
  fa_options options;
  fa_execution execution;
  fa_run_info info;
  const fa_options* options_ptr = &options;
  const fa_execution* execution_ptr = &execution;
  fa_run_info* info_ptr = &info;

  explicit CCall(bool is_varlen) : varlen(is_varlen) {
    fa_options_init(&options);
    fa_execution_init(&execution);
    fa_run_info_init(&info);
    if (varlen) {
      q = &vp.cq;
      k = &vp.ck;
      v = &vp.cv;
      out = &vp.cout;
      lse = &vp.clse;
      cu_q = &vp.ccu_q;
      cu_k = &vp.ccu_k;
      seqused = &vp.cseqused;
      max_q = vp.max_q;
      max_k = vp.max_k;
    } else {
      q = &p.cq;
      k = &p.ck;
      v = &p.cv;
      out = &p.cout;
      lse = &p.clse;
    }
  }

  // The tensors the test may mutate (the call's pointers go to these).
  fa_tensor& tq() { return varlen ? vp.cq : p.cq; }
  fa_tensor& tk() { return varlen ? vp.ck : p.ck; }
  fa_tensor& tv() { return varlen ? vp.cv : p.cv; }
  fa_tensor& tout() { return varlen ? vp.cout : p.cout; }
  fa_tensor& tlse() { return varlen ? vp.clse : p.clse; }

  fa_status run() {
    if (varlen)
      return fa_forward_varlen(q, k, v, out, lse, cu_q, cu_k, max_q, max_k, seqused,
                               options_ptr, execution_ptr, info_ptr);
    return fa_forward(q, k, v, out, lse, options_ptr, execution_ptr, info_ptr);
  }

  // The C++ message for the same arguments (only for calls the C layer itself accepts).
  std::string cpp_message() {
    const Options o = options_ptr ? to_cpp(*options_ptr) : Options{};
    const Execution e = execution_ptr ? to_cpp(*execution_ptr) : Execution{};
    const std::optional<TensorView> l =
        lse ? std::optional<TensorView>(to_cpp(*lse)) : std::nullopt;
    try {
      if (varlen) {
        Varlen vl;
        vl.cu_seqlens_q = to_cpp(*cu_q);
        vl.cu_seqlens_k = to_cpp(*cu_k);
        vl.max_seqlen_q = max_q;
        vl.max_seqlen_k = max_k;
        if (seqused) vl.seqused_k = to_cpp(*seqused);
        forward_varlen(to_cpp(*q), to_cpp(*k), to_cpp(*v), to_cpp(*out), l, vl, o, e);
      } else {
        forward(to_cpp(*q), to_cpp(*k), to_cpp(*v), to_cpp(*out), l, o, e);
      }
    } catch (const Error& err) {
      return err.what();
    }
    return "(the C++ call was accepted)";
  }

  Buffer& out_buf() { return varlen ? vp.out_c : p.out_c; }
  Buffer& lse_buf() { return varlen ? vp.lse_c : p.lse_c; }
};

struct CErrorCase {
  std::string name;
  bool varlen;
  std::function<void(CCall&)> mutate;
  fa_status status;
  std::string prefix;                 // the message starts with this ("<argument>: expected")
  std::vector<std::string> mentions;  // and contains each of these
  bool same_as_cpp;                   // and equals the C++ Error::what() for the same call
};

void PrintTo(const CErrorCase& c, std::ostream* os) { *os << c.name; }

constexpr bool kDense = false, kVarlen = true;
constexpr fa_status kInvalid = FA_ERROR_INVALID_ARGUMENT;

std::vector<CErrorCase> c_error_cases() {
  const std::string options_size = std::to_string(sizeof(fa_options));
  return {
      // ---- Rejected by the C layer itself.
      {"null_q", kDense, [](CCall& c) { c.q = nullptr; }, kInvalid, "q: expected a tensor",
       {"NULL"}, false},
      {"null_k", kDense, [](CCall& c) { c.k = nullptr; }, kInvalid, "k: expected a tensor",
       {"NULL"}, false},
      {"null_v", kDense, [](CCall& c) { c.v = nullptr; }, kInvalid, "v: expected a tensor",
       {"NULL"}, false},
      {"null_out", kDense, [](CCall& c) { c.out = nullptr; }, kInvalid,
       "out: expected a tensor", {"NULL"}, false},
      {"q_ndim_7", kDense, [](CCall& c) { c.tq().ndim = 7; }, kInvalid, "q: expected",
       {"0 to 6 dimensions", "7 dimensions"}, false},
      {"out_ndim_negative", kDense, [](CCall& c) { c.tout().ndim = -1; }, kInvalid,
       "out: expected", {"0 to 6 dimensions", "-1 dimensions"}, false},
      {"lse_ndim_100", kDense, [](CCall& c) { c.tlse().ndim = 100; }, kInvalid,
       "lse: expected", {"100 dimensions"}, false},
      {"alibi_ndim_7", kDense,
       [](CCall& c) {
         c.p.calibi.ndim = 7;
         c.options.alibi_slopes = &c.p.calibi;
       },
       kInvalid, "alibi_slopes: expected", {"0 to 6 dimensions"}, false},
      {"options_struct_size_short", kDense,
       [](CCall& c) { c.options.struct_size = sizeof(fa_options) - 8; }, kInvalid,
       "options: expected",
       {"struct_size " + options_size, "fa_options_init", std::to_string(sizeof(fa_options) - 8)},
       false},
      {"options_not_initialised", kDense, [](CCall& c) { c.options.struct_size = 0; }, kInvalid,
       "options: expected", {"fa_options_init", "given 0"}, false},
      {"execution_struct_size_long", kDense,
       [](CCall& c) { c.execution.struct_size = sizeof(fa_execution) + 8; }, kInvalid,
       "execution: expected", {"fa_execution_init"}, false},
      {"info_struct_size_wrong", kDense, [](CCall& c) { c.info.struct_size = 1; }, kInvalid,
       "info: expected", {"fa_run_info_init", "given 1"}, false},
      {"varlen_null_q", kVarlen, [](CCall& c) { c.q = nullptr; }, kInvalid,
       "q: expected a tensor", {"NULL"}, false},
      {"varlen_null_cu_seqlens_q", kVarlen, [](CCall& c) { c.cu_q = nullptr; }, kInvalid,
       "cu_seqlens_q: expected a tensor", {"NULL"}, false},
      {"varlen_null_cu_seqlens_k", kVarlen, [](CCall& c) { c.cu_k = nullptr; }, kInvalid,
       "cu_seqlens_k: expected a tensor", {"NULL"}, false},
      {"varlen_seqused_k_ndim_9", kVarlen, [](CCall& c) { c.vp.cseqused.ndim = 9; }, kInvalid,
       "seqused_k: expected", {"0 to 6 dimensions"}, false},
      {"varlen_info_struct_size_wrong", kVarlen, [](CCall& c) { c.info.struct_size = 0; },
       kInvalid, "info: expected", {"fa_run_info_init"}, false},
      {"varlen_options_struct_size_wrong", kVarlen,
       [](CCall& c) { c.options.struct_size = 3; }, kInvalid, "options: expected",
       {"fa_options_init"}, false},

      // ---- Rejected by the C++ validation behind it: the same message as C++.
      {"H4_not_a_multiple_of_Hk3", kDense,
       [](CCall& c) {
         c.tk().sizes[2] = 3;
         c.tv().sizes[2] = 3;
       },
       kInvalid, "k: expected", {"H = 4", "Hk = 3"}, true},
      {"q_dtype_code_42", kDense, [](CCall& c) { c.tq().dtype = 42; }, kInvalid, "q: expected",
       {"dtype code 42"}, true},
      {"k_device_type_9", kDense, [](CCall& c) { c.tk().device_type = 9; }, kInvalid,
       "k: expected", {"unknown device type 9"}, true},
      {"out_on_cuda", kDense, [](CCall& c) { c.tout().device_type = FA_DEVICE_CUDA; }, kInvalid,
       "out: expected", {"cuda:0"}, true},
      {"lse_fp16", kDense, [](CCall& c) { c.tlse().dtype = FA_FLOAT16; }, kInvalid,
       "lse: expected", {"dtype fp32", "dtype fp16"}, true},
      {"q_null_data", kDense, [](CCall& c) { c.tq().data = nullptr; }, kInvalid, "q: expected",
       {"non-null"}, true},
      {"head_dim_257", kDense,
       [](CCall& c) {
         for (fa_tensor* t : {&c.tq(), &c.tk(), &c.tv(), &c.tout()}) t->sizes[3] = 257;
       },
       kInvalid, "q: expected", {"D = 257"}, true},
      {"dropout_1", kDense, [](CCall& c) { c.options.dropout_p = 1.0f; }, kInvalid,
       "dropout_p: expected", {"[0, 1)"}, true},
      {"softmax_scale_nan", kDense,
       [](CCall& c) {
         c.options.has_softmax_scale = 1;
         c.options.softmax_scale = std::numeric_limits<float>::quiet_NaN();
       },
       kInvalid, "softmax_scale: expected", {"nan"}, true},
      {"softcap_negative", kDense, [](CCall& c) { c.options.softcap = -2.0f; }, kInvalid,
       "softcap: expected", {"-2"}, true},
      {"window_left_minus_2", kDense, [](CCall& c) { c.options.window_left = -2; }, kInvalid,
       "window_left: expected", {"-2"}, true},
      {"alibi_wrong_shape", kDense,
       [](CCall& c) {
         c.p.calibi.sizes[0] = 3;
         c.options.alibi_slopes = &c.p.calibi;
       },
       kInvalid, "alibi_slopes: expected", {"(3, 4)"}, true},
      // Host tensors: with CUDA built in, q is on the wrong device; without, no backend.
      {"backend_cuda", kDense, [](CCall& c) { c.execution.backend = FA_BACKEND_CUDA; },
       fa_cuda_compiled() ? FA_ERROR_INVALID_ARGUMENT : FA_ERROR_UNSUPPORTED,
       fa_cuda_compiled() ? "q: expected" : "backend: expected", {"cuda"}, true},
      {"backend_code_7", kDense, [](CCall& c) { c.execution.backend = 7; }, kInvalid,
       "backend: expected", {"backend code 7"}, true},
      {"num_threads_negative", kDense, [](CCall& c) { c.execution.num_threads = -4; }, kInvalid,
       "num_threads: expected", {"-4"}, true},
      {"options_null_but_execution_bad", kDense,
       [](CCall& c) {
         c.options_ptr = nullptr;
         c.execution.num_threads = -1;
       },
       kInvalid, "num_threads: expected", {"-1"}, true},
      {"varlen_max_seqlen_q_negative", kVarlen, [](CCall& c) { c.max_q = -1; }, kInvalid,
       "max_seqlen_q: expected", {"-1"}, true},
      {"varlen_max_seqlen_q_too_small", kVarlen, [](CCall& c) { c.max_q = 5; }, kInvalid,
       "max_seqlen_q: expected", {"5 while sequence 2 has 6"}, true},
      {"varlen_cu_seqlens_k_fp32", kVarlen, [](CCall& c) { c.vp.ccu_k.dtype = FA_FLOAT32; },
       kInvalid, "cu_seqlens_k: expected", {"dtype int32"}, true},
      {"varlen_seqused_k_too_long", kVarlen,
       [](CCall& c) { reinterpret_cast<int32_t*>(c.vp.seqused.data())[1] = 3; }, kInvalid,
       "seqused_k: expected", {"(2 for b = 1)"}, true},
      {"varlen_lse_transposed", kVarlen,
       [](CCall& c) {
         c.tlse().sizes[0] = VarlenProblem::total_q;
         c.tlse().sizes[1] = VarlenProblem::H;
         c.tlse().strides[0] = VarlenProblem::H;
       },
       kInvalid, "lse: expected", {"(H, total_q)"}, true},
      {"varlen_dropout_1_5", kVarlen, [](CCall& c) { c.options.dropout_p = 1.5f; },
       kInvalid, "dropout_p: expected", {"[0, 1)", "1.5"}, true},
  };
}

class CErrors : public ::testing::TestWithParam<CErrorCase> {};

TEST_P(CErrors, StatusMessageAndNothingWritten) {
  const CErrorCase& c = GetParam();
  SCOPED_TRACE("case " + c.name);
  CCall call(c.varlen);
  c.mutate(call);
  for (Buffer* b : {&call.out_buf(), &call.lse_buf()})
    std::memset(b->data(), kSentinel, b->bytes.size());
  const std::vector<unsigned char> out_before = call.out_buf().bytes;
  const std::vector<unsigned char> lse_before = call.lse_buf().bytes;
  const std::vector<unsigned char> info_before = bytes_of(call.info);

  const fa_status status = call.run();
  const std::string message = last_error();
  SCOPED_TRACE("fa_last_error() = \"" + message + "\"");
  EXPECT_EQ(status, c.status);
  EXPECT_TRUE(starts_with(message, c.prefix)) << "expected the prefix \"" << c.prefix << "\"";
  EXPECT_TRUE(message.find(", given ") != std::string::npos);
  for (const std::string& m : c.mentions)
    EXPECT_TRUE(message.find(m) != std::string::npos) << "does not mention \"" << m << "\"";
  if (c.same_as_cpp) {
    EXPECT_EQ(message, call.cpp_message());
  }
  EXPECT_TRUE(out_before == call.out_buf().bytes) << "out was written by a failed call";
  EXPECT_TRUE(lse_before == call.lse_buf().bytes) << "lse was written by a failed call";
  EXPECT_TRUE(info_before == bytes_of(call.info)) << "info was written by a failed call";
  // Asking again gives the same message.
  EXPECT_EQ(last_error(), message);
}

INSTANTIATE_TEST_SUITE_P(CAbi, CErrors, ::testing::ValuesIn(c_error_cases()),
                         [](const ::testing::TestParamInfo<CErrorCase>& info) {
                           return info.param.name;
                         });

// The H % Hk message word for word, against the C++ exception.
TEST(CErrorMessages, HeadGroupMessageIsCppWhat) {
  DenseProblem p;
  p.ck.sizes[2] = p.cv.sizes[2] = 3;
  ASSERT_EQ(fa_forward(&p.cq, &p.ck, &p.cv, &p.cout, &p.clse, nullptr, nullptr, nullptr),
            FA_ERROR_INVALID_ARGUMENT);
  std::string cpp;
  try {
    forward(p.q, to_cpp(p.ck), to_cpp(p.cv), p.out_cpp_view(), p.lse_cpp_view());
  } catch (const Error& e) {
    cpp = e.what();
    EXPECT_EQ(e.argument(), "k");
  }
  EXPECT_EQ(last_error(), cpp);
  EXPECT_EQ(last_error(),
            "k: expected a key/value head count Hk that divides the query head count H = 4, "
            "given Hk = 3");
}

TEST(CErrorMessages, NullQMessage) {
  DenseProblem p;
  EXPECT_EQ(fa_forward(nullptr, &p.ck, &p.cv, &p.cout, &p.clse, nullptr, nullptr, nullptr),
            FA_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(last_error(), "q: expected a tensor, given NULL");
}

// ---------------------------------------------------------------------------------------------
// The last error: cleared by success, one per thread.

TEST(CLastError, ClearedBySuccess) {
  DenseProblem p;
  ASSERT_EQ(fa_forward(nullptr, &p.ck, &p.cv, &p.cout, nullptr, nullptr, nullptr, nullptr),
            FA_ERROR_INVALID_ARGUMENT);
  ASSERT_NE(last_error(), "");
  ASSERT_EQ(fa_forward(&p.cq, &p.ck, &p.cv, &p.cout, nullptr, nullptr, nullptr, nullptr), FA_OK);
  EXPECT_STREQ(fa_last_error(), "");
  // Varlen success clears it too.
  VarlenProblem vp;
  ASSERT_EQ(fa_forward_varlen(&vp.cq, &vp.ck, &vp.cv, &vp.cout, nullptr, &vp.ccu_q, &vp.ccu_k,
                              -1, vp.max_k, nullptr, nullptr, nullptr, nullptr),
            FA_ERROR_INVALID_ARGUMENT);
  ASSERT_NE(last_error(), "");
  ASSERT_EQ(fa_forward_varlen(&vp.cq, &vp.ck, &vp.cv, &vp.cout, nullptr, &vp.ccu_q, &vp.ccu_k,
                              vp.max_q, vp.max_k, nullptr, nullptr, nullptr, nullptr),
            FA_OK);
  EXPECT_STREQ(fa_last_error(), "");
}

TEST(CLastError, ReplacedByTheNextError) {
  DenseProblem p;
  ASSERT_NE(fa_forward(nullptr, &p.ck, &p.cv, &p.cout, nullptr, nullptr, nullptr, nullptr),
            FA_OK);
  EXPECT_TRUE(starts_with(last_error(), "q: "));
  ASSERT_NE(fa_forward(&p.cq, &p.ck, &p.cv, nullptr, nullptr, nullptr, nullptr, nullptr), FA_OK);
  EXPECT_TRUE(starts_with(last_error(), "out: ")) << last_error();
}

TEST(CLastError, PerThread) {
  DenseProblem p;
  ASSERT_EQ(fa_forward(nullptr, &p.ck, &p.cv, &p.cout, nullptr, nullptr, nullptr, nullptr),
            FA_ERROR_INVALID_ARGUMENT);
  const std::string mine = last_error();
  ASSERT_EQ(mine, "q: expected a tensor, given NULL");

  std::string fresh, theirs, theirs_after_success;
  fa_status their_status = FA_OK, their_success = FA_ERROR_INTERNAL;
  std::thread other([&] {
    fresh = fa_last_error();  // a new thread has no error yet
    fa_options o;
    fa_options_init(&o);
    o.dropout_p = 1.5f;
    their_status = fa_forward(&p.cq, &p.ck, &p.cv, &p.cout, nullptr, &o, nullptr, nullptr);
    theirs = fa_last_error();
    their_success = fa_forward(&p.cq, &p.ck, &p.cv, &p.cout, nullptr, nullptr, nullptr, nullptr);
    theirs_after_success = fa_last_error();
  });
  other.join();
  EXPECT_EQ(fresh, "");
  EXPECT_EQ(their_status, FA_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(starts_with(theirs, "dropout_p: ")) << theirs;
  EXPECT_EQ(their_success, FA_OK);
  EXPECT_EQ(theirs_after_success, "");
  // Neither the other thread's error nor its success touched this thread's message.
  EXPECT_EQ(last_error(), mine);
}

// ---------------------------------------------------------------------------------------------
// fa_forward_kvcache.

// A KV-cache call, twice over (the C call and the C++ call each append into their own copy of
// the caches): B=2, Sq=2, H=4, Hk=2, D=32, fp16, paged cache of 6 pages of 16 positions with
// a shuffled block table, cache_seqlens (17, 30), S_new=3, interleaved rotary of dim 16,
// causal, num_splits 3.
struct KvProblem {
  static constexpr int64_t B = 2, Sq = 2, H = 4, Hk = 2, D = 32, Pages = 6, Ps = 16,
                           MaxPages = 3, Sn = 3, Sr = 48, Rd = 16;
  DType dtype = DType::Float16;
  Buffer q_buf, kc_c, vc_c, kc_cpp, vc_cpp, kn_buf, vn_buf, cos_buf, sin_buf, seqlens_buf,
      table_buf, out_c, lse_c, out_cpp, lse_cpp;
  fa_tensor cq, ckc, cvc, ckn, cvn, ccos, csin, cseqlens, ctable, cout, clse;
  fa_kvcache cache;

  KvProblem()
      : q_buf(dtype, B * Sq * H * D),
        kc_c(dtype, Pages * Ps * Hk * D),
        vc_c(dtype, Pages * Ps * Hk * D),
        kn_buf(dtype, B * Sn * Hk * D),
        vn_buf(dtype, B * Sn * Hk * D),
        cos_buf(dtype, Sr * Rd / 2),
        sin_buf(dtype, Sr * Rd / 2),
        seqlens_buf(int32_buffer({17, 30})),
        table_buf(int32_buffer({4, 0, 2, 5, 1, 3})),
        out_c(dtype, B * Sq * H * D),
        lse_c(DType::Float32, B * H * Sq),
        out_cpp(dtype, B * Sq * H * D),
        lse_cpp(DType::Float32, B * H * Sq) {
    for (Buffer* b : {&q_buf, &kc_c, &vc_c, &kn_buf, &vn_buf, &cos_buf, &sin_buf})
      b->fill_random();
    kc_cpp = kc_c;
    vc_cpp = vc_c;
    for (Buffer* b : {&out_c, &lse_c, &out_cpp, &lse_cpp}) b->poison();
    cq = to_c(q_buf.view({B, Sq, H, D}));
    ckc = to_c(kc_c.view({Pages, Ps, Hk, D}));
    cvc = to_c(vc_c.view({Pages, Ps, Hk, D}));
    ckn = to_c(kn_buf.view({B, Sn, Hk, D}));
    cvn = to_c(vn_buf.view({B, Sn, Hk, D}));
    ccos = to_c(cos_buf.view({Sr, Rd / 2}));
    csin = to_c(sin_buf.view({Sr, Rd / 2}));
    cseqlens = to_c(seqlens_buf.view({B}));
    ctable = to_c(table_buf.view({B, MaxPages}));
    cout = to_c(out_c.view({B, Sq, H, D}));
    clse = to_c(lse_c.view({B, H, Sq}));
    fa_kvcache_init(&cache);
    cache.k_cache = &ckc;
    cache.v_cache = &cvc;
    cache.cache_seqlens = &cseqlens;
    cache.k_new = &ckn;
    cache.v_new = &cvn;
    cache.rotary_cos = &ccos;
    cache.rotary_sin = &csin;
    cache.rotary_interleaved = 1;
    cache.block_table = &ctable;
    cache.num_splits = 3;
  }

  // The same call through the C++ API, on the second copy of the caches.
  RunInfo run_cpp(const Options& options, const Execution& execution) {
    KvCache c;
    c.k_cache = kc_cpp.view({Pages, Ps, Hk, D});
    c.v_cache = vc_cpp.view({Pages, Ps, Hk, D});
    c.cache_seqlens = to_cpp(cseqlens);
    c.k_new = to_cpp(ckn);
    c.v_new = to_cpp(cvn);
    c.rotary_cos = to_cpp(ccos);
    c.rotary_sin = to_cpp(csin);
    c.rotary_interleaved = true;
    c.block_table = to_cpp(ctable);
    c.num_splits = cache.num_splits;
    return forward_kvcache(to_cpp(cq), c, out_cpp.view({B, Sq, H, D}),
                           lse_cpp.view({B, H, Sq}), options, execution);
  }
};

TEST(CKvCache, BitIdenticalToCppAndReportsTheSplits) {
  for (const int32_t splits : {3, 0}) {
    SCOPED_TRACE("num_splits " + std::to_string(splits));
    KvProblem p;
    p.cache.num_splits = splits;
    fa_options o;
    fa_options_init(&o);
    o.causal = 1;
    fa_execution e;
    fa_execution_init(&e);
    e.num_threads = 2;
    fa_run_info info;
    fa_run_info_init(&info);
    ASSERT_EQ(fa_forward_kvcache(&p.cq, &p.cache, &p.cout, &p.clse, &o, &e, &info), FA_OK)
        << last_error();
    EXPECT_EQ(last_error(), "");
    EXPECT_EQ(info.backend, FA_BACKEND_CPU);
    EXPECT_GT(info.workspace_bytes, 0u);
    const RunInfo cpp = p.run_cpp(to_cpp(o), to_cpp(e));
    EXPECT_EQ(info.num_splits, cpp.num_splits);
    if (splits > 0) {
      EXPECT_EQ(info.num_splits, splits);
    }
    EXPECT_EQ(info.workspace_bytes, cpp.workspace_bytes);
    EXPECT_TRUE(p.out_c.bytes == p.out_cpp.bytes) << "out differs between C and C++";
    EXPECT_TRUE(p.lse_c.bytes == p.lse_cpp.bytes) << "lse differs between C and C++";
    EXPECT_TRUE(p.kc_c.bytes == p.kc_cpp.bytes) << "k_cache differs between C and C++";
    EXPECT_TRUE(p.vc_c.bytes == p.vc_cpp.bytes) << "v_cache differs between C and C++";
  }
}

// The other entry points report one split, whatever info held.
TEST(CKvCache, OtherCallsReportOneSplit) {
  DenseProblem p;
  fa_run_info info;
  fa_run_info_init(&info);
  info.num_splits = 77;
  ASSERT_EQ(fa_forward(&p.cq, &p.ck, &p.cv, &p.cout, &p.clse, nullptr, nullptr, &info), FA_OK);
  EXPECT_EQ(info.num_splits, 1);
}

// Rejected calls: a status, a message naming the argument, and nothing written (outputs,
// caches, info).
TEST(CKvCache, ErrorsNameTheArgumentAndWriteNothing) {
  struct Row {
    const char* name;
    std::function<void(KvProblem&, const fa_kvcache*&, fa_options&)> mutate;
    std::string prefix;
  };
  const Row rows[] = {
      {"null cache", [](KvProblem&, const fa_kvcache*& c, fa_options&) { c = nullptr; },
       "cache: expected a fa_kvcache"},
      {"cache struct_size", [](KvProblem& p, const fa_kvcache*&, fa_options&) {
         p.cache.struct_size = 8;
       },
       "cache: expected struct_size " + std::to_string(sizeof(fa_kvcache))},
      {"null k_cache", [](KvProblem& p, const fa_kvcache*&, fa_options&) {
         p.cache.k_cache = nullptr;
       },
       "k_cache: expected a tensor"},
      {"null cache_seqlens", [](KvProblem& p, const fa_kvcache*&, fa_options&) {
         p.cache.cache_seqlens = nullptr;
       },
       "cache_seqlens: expected a tensor"},
      {"block_table ndim 7", [](KvProblem& p, const fa_kvcache*&, fa_options&) {
         p.ctable.ndim = 7;
       },
       "block_table: expected 0 to 6 dimensions"},
      {"dropout (C++ rule)", [](KvProblem&, const fa_kvcache*&, fa_options& o) {
         o.dropout_p = 0.5f;
       },
       "dropout_p: expected 0"},
      // A paged cache: the block table is what is too small (upstream names it too).
      {"append past capacity (value rule)", [](KvProblem& p, const fa_kvcache*&, fa_options&) {
         reinterpret_cast<int32_t*>(p.seqlens_buf.data())[1] = 46;
       },
       "block_table: expected pages for every position: cache_seqlens[b] + S_new <= max_pages 3 x "
       "page_size 16 = 48"},
  };
  for (const Row& row : rows) {
    SCOPED_TRACE(row.name);
    KvProblem p;
    const fa_kvcache* cache = &p.cache;
    fa_options o;
    fa_options_init(&o);
    row.mutate(p, cache, o);
    for (Buffer* b : {&p.out_c, &p.lse_c}) std::memset(b->data(), kSentinel, b->bytes.size());
    const std::vector<unsigned char> out = p.out_c.bytes, lse = p.lse_c.bytes,
                                     kc = p.kc_c.bytes, vc = p.vc_c.bytes;
    fa_run_info info;
    fa_run_info_init(&info);
    const std::vector<unsigned char> info_before = bytes_of(info);
    EXPECT_EQ(fa_forward_kvcache(&p.cq, cache, &p.cout, &p.clse, &o, nullptr, &info),
              FA_ERROR_INVALID_ARGUMENT);
    EXPECT_TRUE(starts_with(last_error(), row.prefix)) << last_error();
    EXPECT_TRUE(out == p.out_c.bytes && lse == p.lse_c.bytes) << "an output was written";
    EXPECT_TRUE(kc == p.kc_c.bytes && vc == p.vc_c.bytes) << "a cache was written";
    EXPECT_TRUE(info_before == bytes_of(info)) << "info was written";
  }
}

}  // namespace
}  // namespace flashattn::testing

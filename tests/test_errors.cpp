// Argument validation of the C++ API (src/api/validate.cpp and the TensorView factories).
//
// Every rejected input gets one table row: a valid call (DenseCall / VarlenCall) plus one
// mutation. Each row checks the Error's code and argument name, the key facts in expected()
// and given(), the what() format "<argument>: expected <expected>, given <given>", and that
// the rejected call wrote nothing: every buffer the call can see (outputs filled with a
// sentinel byte pattern, inputs random) is compared byte for byte before and after.
//
// Nothing on a "CUDA device" is ever dereferenced before validation fails, so the views that
// claim to live on a GPU simply reuse host pointers.
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "support.hpp"

namespace flashattn::testing {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int64_t kBufferElements = 16384;  // every buffer, so that mutated shapes stay in bounds
constexpr unsigned char kSentinel = 0xA5;
constexpr ErrorCode kInvalid = ErrorCode::InvalidArgument;
constexpr ErrorCode kUnsupported = ErrorCode::Unsupported;
const Device kCuda0{DeviceType::CUDA, 0};
const Device kCuda1{DeviceType::CUDA, 1};

const char* code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::InvalidArgument:
      return "InvalidArgument";
    case ErrorCode::Unsupported:
      return "Unsupported";
    case ErrorCode::Backend:
      return "Backend";
    case ErrorCode::Internal:
      return "Internal";
  }
  return "unknown ErrorCode";
}

// A contiguous view of `sizes` over the same memory, dtype and device as `t`.
TensorView reshaped(const TensorView& t, std::initializer_list<int64_t> sizes) {
  return TensorView::contiguous(t.data, t.dtype, sizes, t.device);
}

TensorView restrided(const TensorView& t, std::initializer_list<int64_t> sizes,
                     std::initializer_list<int64_t> strides) {
  return TensorView::strided(t.data, t.dtype, sizes, strides, t.device);
}

// `t` moved to `data` (same shape), element offset `offset` into a buffer.
TensorView moved_to(TensorView t, Buffer& buffer, int64_t offset = 0) {
  t.data = buffer.bytes.data() + offset * static_cast<int64_t>(dtype_size(buffer.dtype));
  return t;
}

void fill_sentinel(Buffer& b) { std::memset(b.data(), kSentinel, b.bytes.size()); }

void write_int32(Buffer& b, const std::vector<int32_t>& values) {
  ASSERT_LE(static_cast<int64_t>(values.size()), b.count());
  std::memcpy(b.data(), values.data(), values.size() * sizeof(int32_t));
}

struct NamedBuffer {
  const char* name;
  Buffer* buffer;
};

// A valid dense call: B=2, Sq=3, Sk=5, H=6, Hk=2 (GQA groups of 3), D=16, fp32, with lse.
struct DenseCall {
  static constexpr int64_t B = 2, Sq = 3, Sk = 5, H = 6, Hk = 2, D = 16;
  Buffer q_buf{DType::Float32, kBufferElements}, k_buf{DType::Float32, kBufferElements},
      v_buf{DType::Float32, kBufferElements}, out_buf{DType::Float32, kBufferElements},
      lse_buf{DType::Float32, kBufferElements}, alibi_buf{DType::Float32, kBufferElements};
  TensorView q, k, v, out;
  std::optional<TensorView> lse;
  Options options;
  Execution execution;

  DenseCall() {
    q_buf.fill_random();
    k_buf.fill_random();
    v_buf.fill_random();
    for (int64_t i = 0; i < alibi_buf.count(); ++i) alibi_buf.set(i, 0.25f);
    fill_sentinel(out_buf);
    fill_sentinel(lse_buf);
    q = q_buf.view({B, Sq, H, D});
    k = k_buf.view({B, Sk, Hk, D});
    v = v_buf.view({B, Sk, Hk, D});
    out = out_buf.view({B, Sq, H, D});
    lse = lse_buf.view({B, H, Sq});
  }

  RunInfo run() const { return forward(q, k, v, out, lse, options, execution); }

  std::vector<NamedBuffer> buffers() {
    return {{"q", &q_buf},     {"k", &k_buf},     {"v", &v_buf},
            {"out", &out_buf}, {"lse", &lse_buf}, {"alibi_slopes", &alibi_buf}};
  }

  // Every tensor of the call on `device` (so that only the backend choice can be wrong).
  void all_on(Device device) {
    q.device = k.device = v.device = out.device = device;
    if (lse) lse->device = device;
    if (options.alibi_slopes) options.alibi_slopes->device = device;
  }

  // q, k, v and out with head dim `d` (so that only the head dim itself can be wrong).
  void set_head_dim(int64_t d) {
    q = reshaped(q, {B, Sq, H, d});
    k = reshaped(k, {B, Sk, Hk, d});
    v = reshaped(v, {B, Sk, Hk, d});
    out = reshaped(out, {B, Sq, H, d});
  }

  const char* describe() const { return "dense B=2 Sq=3 Sk=5 H=6 Hk=2 D=16 fp32"; }
};

// A valid varlen call: B=2, query lengths (3, 4) -> total_q 7, key lengths (4, 5) -> total_k 9,
// H=6, Hk=2, D=16, max_seqlen_q=4, max_seqlen_k=5, fp32, with lse (H, total_q).
struct VarlenCall {
  static constexpr int64_t B = 2, total_q = 7, total_k = 9, H = 6, Hk = 2, D = 16;
  Buffer q_buf{DType::Float32, kBufferElements}, k_buf{DType::Float32, kBufferElements},
      v_buf{DType::Float32, kBufferElements}, out_buf{DType::Float32, kBufferElements},
      lse_buf{DType::Float32, kBufferElements}, alibi_buf{DType::Float32, kBufferElements},
      cu_q_buf{DType::Int32, 16}, cu_k_buf{DType::Int32, 16}, seqused_buf{DType::Int32, 16};
  TensorView q, k, v, out;
  std::optional<TensorView> lse;
  Varlen varlen;
  Options options;
  Execution execution;

  VarlenCall() {
    q_buf.fill_random();
    k_buf.fill_random();
    v_buf.fill_random();
    for (int64_t i = 0; i < alibi_buf.count(); ++i) alibi_buf.set(i, 0.25f);
    fill_sentinel(out_buf);
    fill_sentinel(lse_buf);
    q = q_buf.view({total_q, H, D});
    k = k_buf.view({total_k, Hk, D});
    v = v_buf.view({total_k, Hk, D});
    out = out_buf.view({total_q, H, D});
    lse = lse_buf.view({H, total_q});
    set_cu_q({0, 3, 7});
    set_cu_k({0, 4, 9});
    varlen.max_seqlen_q = 4;
    varlen.max_seqlen_k = 5;
    write_int32(seqused_buf, {3, 5});  // used only where a test sets varlen.seqused_k
  }

  void set_cu_q(const std::vector<int32_t>& values) {
    write_int32(cu_q_buf, values);
    varlen.cu_seqlens_q = TensorView::contiguous(cu_q_buf.data(), DType::Int32,
                                                 {static_cast<int64_t>(values.size())});
  }
  void set_cu_k(const std::vector<int32_t>& values) {
    write_int32(cu_k_buf, values);
    varlen.cu_seqlens_k = TensorView::contiguous(cu_k_buf.data(), DType::Int32,
                                                 {static_cast<int64_t>(values.size())});
  }
  void set_seqused_k(const std::vector<int32_t>& values) {
    write_int32(seqused_buf, values);
    varlen.seqused_k = TensorView::contiguous(seqused_buf.data(), DType::Int32,
                                              {static_cast<int64_t>(values.size())});
  }

  RunInfo run() const { return forward_varlen(q, k, v, out, lse, varlen, options, execution); }

  std::vector<NamedBuffer> buffers() {
    return {{"q", &q_buf},
            {"k", &k_buf},
            {"v", &v_buf},
            {"out", &out_buf},
            {"lse", &lse_buf},
            {"alibi_slopes", &alibi_buf},
            {"cu_seqlens_q", &cu_q_buf},
            {"cu_seqlens_k", &cu_k_buf},
            {"seqused_k", &seqused_buf}};
  }

  void all_on(Device device) {
    q.device = k.device = v.device = out.device = device;
    if (lse) lse->device = device;
    if (options.alibi_slopes) options.alibi_slopes->device = device;
    varlen.cu_seqlens_q.device = varlen.cu_seqlens_k.device = device;
    if (varlen.seqused_k) varlen.seqused_k->device = device;
  }

  const char* describe() const {
    return "varlen B=2 q lengths (3,4) k lengths (4,5) H=6 Hk=2 D=16 fp32";
  }
};

// One rejected input: a mutation of a valid call and what the Error must say about it.
template <typename Call>
struct ErrorCase {
  std::string name;
  std::function<void(Call&)> mutate;
  ErrorCode code;
  std::string argument;               // Error::argument(), exactly
  std::vector<std::string> expected;  // each occurs in Error::expected()
  std::vector<std::string> given;     // each occurs in Error::given()
  std::string given_exact = {};       // when set, Error::given() is exactly this
};

template <typename Call>
void PrintTo(const ErrorCase<Call>& c, std::ostream* os) {
  *os << c.name;
}

std::string quoted(const std::string& s) { return "\"" + s + "\""; }

// Checks one caught Error against what the case asks for.
void expect_error(const Error& e, ErrorCode code, const std::string& argument,
                  const std::vector<std::string>& expected, const std::vector<std::string>& given,
                  const std::string& given_exact) {
  SCOPED_TRACE(std::string("what() = ") + quoted(e.what()));
  EXPECT_STREQ(code_name(e.code()), code_name(code));
  EXPECT_EQ(e.argument(), argument);
  EXPECT_FALSE(e.expected().empty());
  EXPECT_FALSE(e.given().empty());
  for (const std::string& s : expected)
    EXPECT_TRUE(e.expected().find(s) != std::string::npos)
        << "expected() = " << quoted(e.expected()) << " does not mention " << quoted(s);
  for (const std::string& s : given)
    EXPECT_TRUE(e.given().find(s) != std::string::npos)
        << "given() = " << quoted(e.given()) << " does not mention " << quoted(s);
  if (!given_exact.empty()) {
    EXPECT_EQ(e.given(), given_exact);
  }
  EXPECT_EQ(std::string(e.what()),
            e.argument() + ": expected " + e.expected() + ", given " + e.given());
}

// Runs the call, which must throw the case's Error and leave every buffer as it was.
template <typename Call>
void expect_rejected(Call& call, const ErrorCase<Call>& c) {
  const std::vector<NamedBuffer> buffers = call.buffers();
  std::vector<std::vector<unsigned char>> before;
  for (const NamedBuffer& b : buffers) before.push_back(b.buffer->bytes);
  try {
    call.run();
    ADD_FAILURE() << "the call was accepted; expected " << code_name(c.code) << " naming "
                  << quoted(c.argument);
  } catch (const Error& e) {
    expect_error(e, c.code, c.argument, c.expected, c.given, c.given_exact);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw a std::exception that is not flashattn::Error: " << e.what();
  }
  for (size_t i = 0; i < buffers.size(); ++i)
    EXPECT_TRUE(before[i] == buffers[i].buffer->bytes)
        << "the memory of " << buffers[i].name << " changed during a rejected call";
}

template <typename Call>
std::string case_name(const ::testing::TestParamInfo<ErrorCase<Call>>& info) {
  return info.param.name;
}

using Dense = DenseCall;
using DenseCase = ErrorCase<DenseCall>;
constexpr int64_t B = DenseCall::B, Sq = DenseCall::Sq, Sk = DenseCall::Sk, H = DenseCall::H,
                  Hk = DenseCall::Hk, D = DenseCall::D;

std::vector<DenseCase> dense_cases() {
  const int64_t big = int64_t{1} << 40;
  return {
      // ---- Rank of q, k, v, out.
      {"q_rank3", [](Dense& c) { c.q = reshaped(c.q, {B, Sq, H * D}); }, kInvalid, "q",
       {"4 dimensions"}, {"3 dimensions", "(2, 3, 96)"}},
      {"q_rank0", [](Dense& c) { c.q.ndim = 0; }, kInvalid, "q", {"4 dimensions"},
       {"0 dimensions"}},
      {"q_rank7", [](Dense& c) { c.q.ndim = 7; }, kInvalid, "q", {"4 dimensions"},
       {"7 dimensions"}},
      {"q_rank_negative", [](Dense& c) { c.q.ndim = -1; }, kInvalid, "q", {"4 dimensions"},
       {"-1 dimensions"}},
      {"k_rank5", [](Dense& c) { c.k = reshaped(c.k, {B, Sk, Hk, D, 1}); }, kInvalid, "k",
       {"4 dimensions"}, {"5 dimensions", "(2, 5, 2, 16, 1)"}},
      {"v_rank3", [](Dense& c) { c.v = reshaped(c.v, {B * Sk, Hk, D}); }, kInvalid, "v",
       {"4 dimensions"}, {"3 dimensions"}},
      {"out_rank3", [](Dense& c) { c.out = reshaped(c.out, {B * Sq, H, D}); }, kInvalid, "out",
       {"4 dimensions"}, {"3 dimensions", "(6, 6, 16)"}},

      // ---- Dtypes.
      {"q_int32",
       [](Dense& c) { c.q.dtype = c.k.dtype = c.v.dtype = c.out.dtype = DType::Int32; },
       kInvalid, "q", {"fp32, fp16 or bf16"}, {"dtype int32"}},
      {"q_unknown_dtype_code", [](Dense& c) { c.q.dtype = static_cast<DType>(9); }, kInvalid,
       "q", {"fp32, fp16, bf16, int32"}, {"dtype code 9"}},
      {"out_unknown_dtype_code", [](Dense& c) { c.out.dtype = static_cast<DType>(-1); },
       kInvalid, "out", {"fp32, fp16, bf16, int32"}, {"dtype code -1"}},
      {"k_fp16_while_q_fp32", [](Dense& c) { c.k.dtype = DType::Float16; }, kInvalid, "k",
       {"dtype fp32"}, {"dtype fp16"}},
      {"v_bf16_while_q_fp32", [](Dense& c) { c.v.dtype = DType::BFloat16; }, kInvalid, "v",
       {"dtype fp32"}, {"dtype bf16"}},
      {"out_fp16_while_q_fp32", [](Dense& c) { c.out.dtype = DType::Float16; }, kInvalid,
       "out", {"dtype fp32"}, {"dtype fp16"}},
      {"k_fp32_while_q_fp16",
       [](Dense& c) { c.q.dtype = c.v.dtype = c.out.dtype = DType::Float16; }, kInvalid, "k",
       {"dtype fp16"}, {"dtype fp32"}},
      {"v_int32", [](Dense& c) { c.v.dtype = DType::Int32; }, kInvalid, "v", {"dtype fp32"},
       {"dtype int32"}},

      // ---- Devices.
      {"q_unknown_device_type", [](Dense& c) { c.q.device.type = static_cast<DeviceType>(5); },
       kInvalid, "q", {"cpu or cuda"}, {"unknown device type 5"}},
      {"v_unknown_device_type", [](Dense& c) { c.v.device.type = static_cast<DeviceType>(-3); },
       kInvalid, "v", {"cpu or cuda"}, {"unknown device type -3"}},
      {"k_negative_device_index", [](Dense& c) { c.k.device.index = -1; }, kInvalid, "k",
       {"device index >= 0"}, {"-1"}},
      {"k_on_cuda_while_q_on_cpu", [](Dense& c) { c.k.device = kCuda0; }, kInvalid, "k",
       {"the device of q (cpu)"}, {}, "cuda:0"},
      {"v_on_cuda_while_q_on_cpu", [](Dense& c) { c.v.device = kCuda1; }, kInvalid, "v",
       {"the device of q (cpu)"}, {}, "cuda:1"},
      {"out_on_cuda_while_q_on_cpu", [](Dense& c) { c.out.device = kCuda0; }, kInvalid, "out",
       {"the device of q (cpu)"}, {}, "cuda:0"},
      {"k_on_other_cuda_device",
       [](Dense& c) {
         c.all_on(kCuda0);
         c.k.device = kCuda1;
       },
       kInvalid, "k", {"the device of q (cuda:0)"}, {}, "cuda:1"},
      {"lse_on_cuda_while_q_on_cpu", [](Dense& c) { c.lse->device = kCuda0; }, kInvalid, "lse",
       {"the device of q (cpu)"}, {}, "cuda:0"},

      // ---- Backend choice.
      {"cpu_backend_with_tensors_on_cuda",
       [](Dense& c) {
         c.all_on(kCuda0);
         c.execution.backend = Backend::CPU;
       },
       kInvalid, "q", {"host memory", "cpu backend"}, {"cuda:0"}},
      // With CUDA built in, auto picks it for GPU tensors and rejects fp32 (the base call's
      // dtype); without, the backend itself is unsupported.
      cuda_compiled()
          ? DenseCase{"auto_backend_with_tensors_on_cuda", [](Dense& c) { c.all_on(kCuda0); },
                      kUnsupported, "q", {"fp16 or bf16", "cuda backend"}, {}, "dtype fp32"}
          : DenseCase{"auto_backend_with_tensors_on_cuda", [](Dense& c) { c.all_on(kCuda0); },
                      kUnsupported, "backend", {"cpu or auto"}, {}, "cuda"},
      cuda_compiled()
          ? DenseCase{"cuda_backend", [](Dense& c) { c.execution.backend = Backend::CUDA; },
                      kInvalid, "q", {"GPU memory", "cuda backend"}, {}, "a tensor on cpu"}
          : DenseCase{"cuda_backend", [](Dense& c) { c.execution.backend = Backend::CUDA; },
                      kUnsupported, "backend", {"cpu or auto"}, {}, "cuda"},
      {"backend_code_7", [](Dense& c) { c.execution.backend = static_cast<Backend>(7); },
       kInvalid, "backend", {"auto, cpu or cuda"}, {}, "backend code 7"},
      {"backend_code_negative", [](Dense& c) { c.execution.backend = static_cast<Backend>(-1); },
       kInvalid, "backend", {"auto, cpu or cuda"}, {}, "backend code -1"},
      {"num_threads_negative", [](Dense& c) { c.execution.num_threads = -1; }, kInvalid,
       "num_threads", {"0 (all cores)", ">= 1"}, {}, "-1"},

      // ---- Sizes, strides, pointers, offsets.
      {"k_negative_size", [](Dense& c) { c.k.sizes[1] = -1; }, kInvalid, "k", {"sizes >= 0"},
       {"(2, -1, 2, 16)"}},
      {"out_negative_size", [](Dense& c) { c.out.sizes[0] = -2; }, kInvalid, "out",
       {"sizes >= 0"}, {"(-2, 3, 6, 16)"}},
      {"v_negative_stride", [](Dense& c) { c.v.strides[1] = -32; }, kInvalid, "v",
       {"strides >= 0"}, {"(160, -32, 16, 1)"}},
      {"q_last_dim_stride_2", [](Dense& c) { c.q.strides[3] = 2; }, kInvalid, "q",
       {"contiguous last dimension", "stride 1"}, {"(288, 96, 16, 2)"}},
      {"out_last_dim_stride_0", [](Dense& c) { c.out.strides[3] = 0; }, kInvalid, "out",
       {"contiguous last dimension"}, {"(288, 96, 16, 0)"}},
      {"k_null_data", [](Dense& c) { c.k.data = nullptr; }, kInvalid, "k", {"non-null"},
       {"null", "(2, 5, 2, 16)"}},
      {"out_null_data", [](Dense& c) { c.out.data = nullptr; }, kInvalid, "out", {"non-null"},
       {"null", "(2, 3, 6, 16)"}},
      {"q_extent_overflow",
       [big](Dense& c) { c.q = restrided(c.q, {big, Sq, H, D}, {big, H * D, D, 1}); }, kInvalid,
       "q", {"fit in 64 bits"}, {"1099511627776"}},
      {"v_extent_sum_overflow",
       [](Dense& c) {  // each span fits, their sum 2^62 + 2^62 does not
         c.v = restrided(c.v, {B, 3, Hk, D}, {int64_t{1} << 62, int64_t{1} << 61, D, 1});
       },
       kInvalid, "v", {"fit in 64 bits"}, {"4611686018427387904"}},

      // ---- Head dims and head counts.
      {"head_dim_12", [](Dense& c) { c.set_head_dim(12); }, kInvalid, "q",
       {"multiple of 8", "[8, 256]"}, {"D = 12"}},
      {"head_dim_4", [](Dense& c) { c.set_head_dim(4); }, kInvalid, "q", {"[8, 256]"},
       {"D = 4"}},
      {"head_dim_0", [](Dense& c) { c.set_head_dim(0); }, kInvalid, "q", {"[8, 256]"},
       {"D = 0"}},
      {"head_dim_264", [](Dense& c) { c.set_head_dim(264); }, kInvalid, "q", {"[8, 256]"},
       {"D = 264", "(2, 3, 6, 264)"}},
      {"no_query_heads",
       [](Dense& c) {
         c.q = reshaped(c.q, {B, Sq, 0, D});
         c.out = reshaped(c.out, {B, Sq, 0, D});
         c.lse.reset();
       },
       kInvalid, "q", {"at least one head"}, {"(2, 3, 0, 16)"}},
      {"no_key_heads",
       [](Dense& c) {
         c.k = reshaped(c.k, {B, Sk, 0, D});
         c.v = reshaped(c.v, {B, Sk, 0, D});
       },
       kInvalid, "k", {"at least one key/value head"}, {"(2, 5, 0, 16)"}},
      {"H6_not_a_multiple_of_Hk4",
       [](Dense& c) {
         c.k = reshaped(c.k, {B, Sk, 4, D});
         c.v = reshaped(c.v, {B, Sk, 4, D});
       },
       kInvalid, "k", {"divides", "H = 6"}, {}, "Hk = 4"},
      {"Hk_larger_than_H",
       [](Dense& c) {
         c.k = reshaped(c.k, {B, Sk, 12, D});
         c.v = reshaped(c.v, {B, Sk, 12, D});
       },
       kInvalid, "k", {"H = 6"}, {}, "Hk = 12"},
      {"batch_2_pow_31",  // batch and head counts index kernel grids: int32
       [](Dense& c) {
         const int64_t b = int64_t{1} << 31;
         c.q = reshaped(c.q, {b, 0, H, D});
         c.out = reshaped(c.out, {b, 0, H, D});
         c.k = restrided(c.k, {b, Sk, Hk, D}, {0, Hk * D, D, 1});
         c.v = restrided(c.v, {b, Sk, Hk, D}, {0, Hk * D, D, 1});
         c.lse.reset();
       },
       kInvalid, "q", {"B < 2^31"}, {}, "B = 2147483648"},
      {"heads_2_pow_31",
       [](Dense& c) {
         c.q = reshaped(c.q, {B, 0, int64_t{1} << 31, D});
         c.out = reshaped(c.out, {B, 0, int64_t{1} << 31, D});
         c.lse.reset();
       },
       kInvalid, "q", {"H < 2^31"}, {}, "H = 2147483648"},
      {"key_heads_2_pow_31",
       [](Dense& c) {
         c.k = reshaped(c.k, {B, 0, int64_t{1} << 31, D});
         c.v = reshaped(c.v, {B, 0, int64_t{1} << 31, D});
       },
       kInvalid, "k", {"Hk < 2^31"}, {}, "Hk = 2147483648"},

      // ---- Shapes of k, v, out.
      {"k_batch_3_while_q_batch_2",
       [](Dense& c) {
         c.k = reshaped(c.k, {3, Sk, Hk, D});
         c.v = reshaped(c.v, {3, Sk, Hk, D});
       },
       kInvalid, "k", {"B = 2"}, {"(3, 5, 2, 16)"}},
      {"k_head_dim_24", [](Dense& c) { c.k = reshaped(c.k, {B, Sk, Hk, 24}); }, kInvalid, "k",
       {"D = 16"}, {"(2, 5, 2, 24)"}},
      {"v_seqlen_4_while_k_seqlen_5", [](Dense& c) { c.v = reshaped(c.v, {B, 4, Hk, D}); },
       kInvalid, "v", {"(2, 5, 2, 16)", "(B, Sk, Hk, D)"}, {"(2, 4, 2, 16)"}},
      {"v_batch_1", [](Dense& c) { c.v = reshaped(c.v, {1, Sk, Hk, D}); }, kInvalid, "v",
       {"(2, 5, 2, 16)"}, {"(1, 5, 2, 16)"}},
      {"v_heads_1", [](Dense& c) { c.v = reshaped(c.v, {B, Sk, 1, D}); }, kInvalid, "v",
       {"(2, 5, 2, 16)"}, {"(2, 5, 1, 16)"}},
      {"v_head_dim_32", [](Dense& c) { c.v = reshaped(c.v, {B, Sk, Hk, 32}); }, kInvalid, "v",
       {"(2, 5, 2, 16)"}, {"(2, 5, 2, 32)"}},
      {"out_seqlen_5", [](Dense& c) { c.out = reshaped(c.out, {B, 5, H, D}); }, kInvalid, "out",
       {"(2, 3, 6, 16)", "(B, Sq, H, D)"}, {"(2, 5, 6, 16)"}},
      {"out_heads_Hk", [](Dense& c) { c.out = reshaped(c.out, {B, Sq, Hk, D}); }, kInvalid,
       "out", {"(2, 3, 6, 16)"}, {"(2, 3, 2, 16)"}},
      {"out_batch_1", [](Dense& c) { c.out = reshaped(c.out, {1, Sq, H, D}); }, kInvalid, "out",
       {"(2, 3, 6, 16)"}, {"(1, 3, 6, 16)"}},

      // ---- out must not overlap itself or the inputs.
      {"out_seq_stride_0",
       [](Dense& c) { c.out = restrided(c.out, {B, Sq, H, D}, {Sq * H * D, 0, D, 1}); },
       kInvalid, "out", {"no two elements share memory"}, {"(288, 0, 16, 1)"}},
      {"out_heads_half_overlapping",
       [](Dense& c) { c.out = restrided(c.out, {B, Sq, H, D}, {Sq * H * D, H * D, D / 2, 1}); },
       kInvalid, "out", {"no two elements share memory"}, {"(288, 96, 8, 1)"}},
      {"out_batch_stride_0",
       [](Dense& c) { c.out = restrided(c.out, {B, Sq, H, D}, {0, H * D, D, 1}); }, kInvalid,
       "out", {"no two elements share memory"}, {"(0, 96, 16, 1)"}},
      {"out_is_q", [](Dense& c) { c.out = moved_to(c.out, c.q_buf); }, kInvalid, "out",
       {"memory disjoint from q"}, {"overlapping q"}},
      {"out_starts_on_last_element_of_q",
       [](Dense& c) { c.out = moved_to(c.out, c.q_buf, B * Sq * H * D - 1); }, kInvalid, "out",
       {"memory disjoint from q"}, {"overlapping q"}},
      {"out_ends_on_first_element_of_k",
       [](Dense& c) {
         c.k = moved_to(c.k, c.out_buf, B * Sq * H * D - 1);
         c.v = moved_to(c.v, c.out_buf, B * Sq * H * D + B * Sk * Hk * D);
       },
       kInvalid, "out", {"memory disjoint from k"}, {"overlapping k"}},
      {"out_inside_v", [](Dense& c) { c.out = moved_to(c.out, c.v_buf, 3); }, kInvalid, "out",
       {"memory disjoint from v"}, {"overlapping v"}},

      // ---- lse.
      {"lse_rank2", [](Dense& c) { c.lse = reshaped(*c.lse, {B * H, Sq}); }, kInvalid, "lse",
       {"3 dimensions"}, {"2 dimensions"}},
      {"lse_fp16", [](Dense& c) { c.lse->dtype = DType::Float16; }, kInvalid, "lse",
       {"dtype fp32"}, {"dtype fp16"}},
      {"lse_int32", [](Dense& c) { c.lse->dtype = DType::Int32; }, kInvalid, "lse",
       {"dtype fp32"}, {"dtype int32"}},
      {"lse_shape_B_Sq_H", [](Dense& c) { c.lse = reshaped(*c.lse, {B, Sq, H}); }, kInvalid,
       "lse", {"(2, 6, 3)", "(B, H, Sq)"}, {"(2, 3, 6)"}},
      {"lse_shape_Sk", [](Dense& c) { c.lse = reshaped(*c.lse, {B, H, Sk}); }, kInvalid, "lse",
       {"(2, 6, 3)"}, {"(2, 6, 5)"}},
      {"lse_padded_batch_stride",
       [](Dense& c) { c.lse = restrided(*c.lse, {B, H, Sq}, {H * Sq + 1, Sq, 1}); }, kInvalid,
       "lse", {"contiguous (row-major)"}, {"(19, 3, 1)"}},
      {"lse_head_major",
       [](Dense& c) { c.lse = restrided(*c.lse, {B, H, Sq}, {H * Sq, 1, H}); }, kInvalid, "lse",
       {"contiguous"}, {"(18, 1, 6)"}},
      {"lse_null_data", [](Dense& c) { c.lse->data = nullptr; }, kInvalid, "lse", {"non-null"},
       {"null"}},
      {"lse_overlaps_out", [](Dense& c) { c.lse = moved_to(*c.lse, c.out_buf, 10); }, kInvalid,
       "lse", {"memory disjoint from out"}, {"overlapping out"}},
      {"lse_overlaps_q", [](Dense& c) { c.lse = moved_to(*c.lse, c.q_buf); }, kInvalid, "lse",
       {"memory disjoint from q"}, {"overlapping q"}},
      {"lse_overlaps_v", [](Dense& c) { c.lse = moved_to(*c.lse, c.v_buf, 100); }, kInvalid,
       "lse", {"memory disjoint from v"}, {"overlapping v"}},

      // ---- alibi_slopes.
      {"alibi_rank3",
       [](Dense& c) { c.options.alibi_slopes = c.alibi_buf.view({1, B, H}); }, kInvalid,
       "alibi_slopes", {"(H) or (B, H)"}, {"3 dimensions"}},
      {"alibi_rank0",
       [](Dense& c) {
         c.options.alibi_slopes = c.alibi_buf.view({H});
         c.options.alibi_slopes->ndim = 0;
       },
       kInvalid, "alibi_slopes", {"(H) or (B, H)"}, {"0 dimensions"}},
      {"alibi_H_5", [](Dense& c) { c.options.alibi_slopes = c.alibi_buf.view({5}); }, kInvalid,
       "alibi_slopes", {"(6)", "(H)"}, {"(5)"}},
      {"alibi_B3_H", [](Dense& c) { c.options.alibi_slopes = c.alibi_buf.view({3, H}); },
       kInvalid, "alibi_slopes", {"(2, 6)", "(B, H)"}, {"(3, 6)"}},
      {"alibi_H_B_transposed",
       [](Dense& c) { c.options.alibi_slopes = c.alibi_buf.view({H, B}); }, kInvalid,
       "alibi_slopes", {"(2, 6)"}, {"(6, 2)"}},
      {"alibi_fp16",
       [](Dense& c) {
         c.options.alibi_slopes = c.alibi_buf.view({H});
         c.options.alibi_slopes->dtype = DType::Float16;
       },
       kInvalid, "alibi_slopes", {"dtype fp32"}, {"dtype fp16"}},
      {"alibi_padded_rows",
       [](Dense& c) { c.options.alibi_slopes = c.alibi_buf.view({B, H}, {H + 2, 1}); },
       kInvalid, "alibi_slopes", {"contiguous (row-major)"}, {"(8, 1)"}},
      {"alibi_stride_2", [](Dense& c) { c.options.alibi_slopes = c.alibi_buf.view({H}, {2}); },
       kInvalid, "alibi_slopes", {"contiguous last dimension"}, {"(2)"}},
      {"alibi_on_cuda",
       [](Dense& c) {
         c.options.alibi_slopes = c.alibi_buf.view({H});
         c.options.alibi_slopes->device = kCuda0;
       },
       kInvalid, "alibi_slopes", {"the device of q (cpu)"}, {}, "cuda:0"},
      {"alibi_null_data",
       [](Dense& c) {
         c.options.alibi_slopes = c.alibi_buf.view({H});
         c.options.alibi_slopes->data = nullptr;
       },
       kInvalid, "alibi_slopes", {"non-null"}, {"null"}},

      // ---- Options.
      {"window_left_minus_2", [](Dense& c) { c.options.window_left = -2; }, kInvalid,
       "window_left", {"-1 (unbounded)", ">= 0"}, {}, "-2"},
      {"window_left_int_min",
       [](Dense& c) { c.options.window_left = std::numeric_limits<int32_t>::min(); }, kInvalid,
       "window_left", {"-1 (unbounded)"}, {}, "-2147483648"},
      {"window_right_minus_5", [](Dense& c) { c.options.window_right = -5; }, kInvalid,
       "window_right", {"-1 (unbounded)", ">= 0"}, {}, "-5"},
      {"window_right_minus_5_with_causal",
       [](Dense& c) {
         c.options.causal = true;
         c.options.window_right = -5;
       },
       kInvalid, "window_right", {"-1 (unbounded)"}, {}, "-5"},
      {"softcap_negative", [](Dense& c) { c.options.softcap = -1.0f; }, kInvalid, "softcap",
       {"finite", ">= 0"}, {}, "-1"},
      {"softcap_nan", [](Dense& c) { c.options.softcap = kNaN; }, kInvalid, "softcap",
       {"finite"}, {"nan"}},
      {"softcap_inf", [](Dense& c) { c.options.softcap = kInf; }, kInvalid, "softcap",
       {"finite"}, {"inf"}},
      {"softmax_scale_nan", [](Dense& c) { c.options.softmax_scale = kNaN; }, kInvalid,
       "softmax_scale", {"finite"}, {"nan"}},
      {"softmax_scale_inf", [](Dense& c) { c.options.softmax_scale = kInf; }, kInvalid,
       "softmax_scale", {"finite"}, {}, "inf"},
      {"softmax_scale_minus_inf", [](Dense& c) { c.options.softmax_scale = -kInf; }, kInvalid,
       "softmax_scale", {"finite"}, {}, "-inf"},
      {"dropout_p_1", [](Dense& c) { c.options.dropout_p = 1.0f; }, kInvalid, "dropout_p",
       {"[0, 1)"}, {}, "1"},
      {"dropout_p_minus_0_5", [](Dense& c) { c.options.dropout_p = -0.5f; }, kInvalid,
       "dropout_p", {"[0, 1)"}, {}, "-0.5"},
      {"dropout_p_nan", [](Dense& c) { c.options.dropout_p = kNaN; }, kInvalid, "dropout_p",
       {"[0, 1)"}, {"nan"}},
      {"dropout_p_inf", [](Dense& c) { c.options.dropout_p = kInf; }, kInvalid, "dropout_p",
       {"[0, 1)"}, {}, "inf"},
  };
}

class DenseErrors : public ::testing::TestWithParam<DenseCase> {};

TEST_P(DenseErrors, RejectedWithoutWriting) {
  const DenseCase& c = GetParam();
  SCOPED_TRACE("case " + c.name);
  DenseCall call;
  SCOPED_TRACE(call.describe());
  c.mutate(call);
  expect_rejected(call, c);
}

INSTANTIATE_TEST_SUITE_P(Validation, DenseErrors, ::testing::ValuesIn(dense_cases()),
                         case_name<DenseCall>);

using Var = VarlenCall;
using VarlenCase = ErrorCase<VarlenCall>;
constexpr int64_t Tq = VarlenCall::total_q, Tk = VarlenCall::total_k;

std::vector<VarlenCase> varlen_cases() {
  return {
      // ---- Ranks, dtypes and shapes in the varlen layout.
      {"q_rank4", [](Var& c) { c.q = reshaped(c.q, {1, Tq, H, D}); }, kInvalid, "q",
       {"3 dimensions"}, {"4 dimensions"}},
      {"out_rank4", [](Var& c) { c.out = reshaped(c.out, {1, Tq, H, D}); }, kInvalid, "out",
       {"3 dimensions"}, {"4 dimensions"}},
      {"k_fp16", [](Var& c) { c.k.dtype = DType::Float16; }, kInvalid, "k", {"dtype fp32"},
       {"dtype fp16"}},
      {"H6_not_a_multiple_of_Hk4",
       [](Var& c) {
         c.k = reshaped(c.k, {Tk, 4, D});
         c.v = reshaped(c.v, {Tk, 4, D});
       },
       kInvalid, "k", {"H = 6"}, {}, "Hk = 4"},
      {"k_head_dim_32", [](Var& c) { c.k = reshaped(c.k, {Tk, Hk, 32}); }, kInvalid, "k",
       {"D = 16"}, {"(9, 2, 32)"}},
      {"v_rows_8", [](Var& c) { c.v = reshaped(c.v, {8, Hk, D}); }, kInvalid, "v",
       {"(9, 2, 16)", "(total_k, Hk, D)"}, {"(8, 2, 16)"}},
      {"out_heads_Hk", [](Var& c) { c.out = reshaped(c.out, {Tq, Hk, D}); }, kInvalid, "out",
       {"(7, 6, 16)", "(total_q, H, D)"}, {"(7, 2, 16)"}},
      {"out_is_q", [](Var& c) { c.out = moved_to(c.out, c.q_buf); }, kInvalid, "out",
       {"memory disjoint from q"}, {"overlapping q"}},
      {"lse_transposed", [](Var& c) { c.lse = reshaped(*c.lse, {Tq, H}); }, kInvalid, "lse",
       {"(6, 7)", "(H, total_q)"}, {"(7, 6)"}},
      {"lse_dense_layout", [](Var& c) { c.lse = reshaped(*c.lse, {2, H, 4}); }, kInvalid, "lse",
       {"2 dimensions"}, {"3 dimensions"}},
      {"lse_overlaps_out", [](Var& c) { c.lse = moved_to(*c.lse, c.out_buf); }, kInvalid,
       "lse", {"memory disjoint from out"}, {"overlapping out"}},
      {"alibi_B3_H", [](Var& c) { c.options.alibi_slopes = c.alibi_buf.view({3, H}); },
       kInvalid, "alibi_slopes", {"(2, 6)", "(B, H)"}, {"(3, 6)"}},

      // ---- cu_seqlens structure.
      {"cu_seqlens_q_rank2",
       [](Var& c) { c.varlen.cu_seqlens_q = reshaped(c.varlen.cu_seqlens_q, {1, 3}); },
       kInvalid, "cu_seqlens_q", {"1 dimension"}, {"2 dimensions"}},
      {"cu_seqlens_q_no_entries",
       [](Var& c) { c.varlen.cu_seqlens_q = reshaped(c.varlen.cu_seqlens_q, {0}); }, kInvalid,
       "cu_seqlens_q", {"B + 1 >= 1"}, {"(0)"}},
      {"batch_2_pow_31",  // B = cu_seqlens_q entries - 1; the values are never read
       [](Var& c) {
         c.varlen.cu_seqlens_q = reshaped(c.varlen.cu_seqlens_q, {(int64_t{1} << 31) + 1});
       },
       kInvalid, "cu_seqlens_q", {"B < 2^31"}, {}, "B = 2147483648"},
      {"cu_seqlens_q_fp32", [](Var& c) { c.varlen.cu_seqlens_q.dtype = DType::Float32; },
       kInvalid, "cu_seqlens_q", {"dtype int32"}, {"dtype fp32"}},
      {"cu_seqlens_k_fp32", [](Var& c) { c.varlen.cu_seqlens_k.dtype = DType::Float32; },
       kInvalid, "cu_seqlens_k", {"dtype int32"}, {"dtype fp32"}},
      {"cu_seqlens_k_fp16", [](Var& c) { c.varlen.cu_seqlens_k.dtype = DType::Float16; },
       kInvalid, "cu_seqlens_k", {"dtype int32"}, {"dtype fp16"}},
      {"cu_seqlens_k_rank2",
       [](Var& c) { c.varlen.cu_seqlens_k = reshaped(c.varlen.cu_seqlens_k, {3, 1}); },
       kInvalid, "cu_seqlens_k", {"1 dimension"}, {"2 dimensions"}},
      {"cu_seqlens_k_4_entries_while_q_has_3", [](Var& c) { c.set_cu_k({0, 4, 9, 9}); },
       kInvalid, "cu_seqlens_k", {"(3)", "(B + 1)", "cu_seqlens_q"}, {"(4)"}},
      {"cu_seqlens_k_2_entries_while_q_has_3", [](Var& c) { c.set_cu_k({0, 9}); }, kInvalid,
       "cu_seqlens_k", {"(3)"}, {"(2)"}},
      {"cu_seqlens_q_null_data", [](Var& c) { c.varlen.cu_seqlens_q.data = nullptr; },
       kInvalid, "cu_seqlens_q", {"non-null"}, {"null"}},
      {"cu_seqlens_k_null_data", [](Var& c) { c.varlen.cu_seqlens_k.data = nullptr; },
       kInvalid, "cu_seqlens_k", {"non-null"}, {"null"}},
      {"cu_seqlens_q_stride_2",
       [](Var& c) { c.varlen.cu_seqlens_q = restrided(c.varlen.cu_seqlens_q, {3}, {2}); },
       kInvalid, "cu_seqlens_q", {"contiguous"}, {"(2)"}},
      {"cu_seqlens_q_on_cuda", [](Var& c) { c.varlen.cu_seqlens_q.device = kCuda0; },
       kInvalid, "cu_seqlens_q", {"the device of q (cpu)"}, {}, "cuda:0"},
      {"cu_seqlens_k_on_cuda", [](Var& c) { c.varlen.cu_seqlens_k.device = kCuda0; },
       kInvalid, "cu_seqlens_k", {"the device of q (cpu)"}, {}, "cuda:0"},

      // ---- cu_seqlens values.
      {"cu_seqlens_q_starts_at_1", [](Var& c) { c.set_cu_q({1, 3, 7}); }, kInvalid,
       "cu_seqlens_q", {"[0] == 0"}, {}, "cu_seqlens_q[0] = 1"},
      {"cu_seqlens_k_starts_at_minus_1", [](Var& c) { c.set_cu_k({-1, 4, 9}); }, kInvalid,
       "cu_seqlens_k", {"[0] == 0"}, {}, "cu_seqlens_k[0] = -1"},
      {"cu_seqlens_k_decreasing",
       [](Var& c) {
         c.set_cu_k({0, 5, 4});
         c.varlen.max_seqlen_k = 9;
       },
       kInvalid, "cu_seqlens_k", {"non-decreasing"}, {}, "cu_seqlens_k[2] = 4 < cu_seqlens_k[1] = 5"},
      {"cu_seqlens_q_decreasing",
       [](Var& c) {
         c.set_cu_q({0, 7, 3});
         c.varlen.max_seqlen_q = 7;
       },
       kInvalid, "cu_seqlens_q", {"non-decreasing"}, {"cu_seqlens_q[2] = 3"}},
      {"query_sequence_longer_than_max_seqlen_q", [](Var& c) { c.varlen.max_seqlen_q = 3; },
       kInvalid, "max_seqlen_q", {"every sequence length in cu_seqlens_q"}, {},
       "3 while sequence 1 has 4"},
      {"key_sequence_longer_than_max_seqlen_k", [](Var& c) { c.varlen.max_seqlen_k = 4; },
       kInvalid, "max_seqlen_k", {"every sequence length in cu_seqlens_k"}, {},
       "4 while sequence 1 has 5"},
      {"cu_seqlens_q_beyond_total_q",
       [](Var& c) {
         c.set_cu_q({0, 3, 8});
         c.varlen.max_seqlen_q = 5;
       },
       kInvalid, "cu_seqlens_q", {"<= the 7 rows"}, {}, "cu_seqlens_q[2] = 8"},
      {"cu_seqlens_k_beyond_total_k",
       [](Var& c) {
         c.set_cu_k({0, 4, 10});
         c.varlen.max_seqlen_k = 6;
       },
       kInvalid, "cu_seqlens_k", {"<= the 9 rows"}, {}, "cu_seqlens_k[2] = 10"},
      {"max_seqlen_q_negative", [](Var& c) { c.varlen.max_seqlen_q = -1; }, kInvalid,
       "max_seqlen_q", {"[0, 2^31)"}, {}, "-1"},
      {"max_seqlen_k_negative", [](Var& c) { c.varlen.max_seqlen_k = -7; }, kInvalid,
       "max_seqlen_k", {"[0, 2^31)"}, {}, "-7"},

      // ---- seqused_k.
      {"seqused_k_3_entries", [](Var& c) { c.set_seqused_k({3, 5, 1}); }, kInvalid,
       "seqused_k", {"(2)", "(B)"}, {"(3)"}},
      {"seqused_k_rank2",
       [](Var& c) {
         c.set_seqused_k({3, 5});
         c.varlen.seqused_k = reshaped(*c.varlen.seqused_k, {1, 2});
       },
       kInvalid, "seqused_k", {"1 dimension"}, {"2 dimensions"}},
      {"seqused_k_fp32",
       [](Var& c) {
         c.set_seqused_k({3, 5});
         c.varlen.seqused_k->dtype = DType::Float32;
       },
       kInvalid, "seqused_k", {"dtype int32"}, {"dtype fp32"}},
      {"seqused_k_on_cuda",
       [](Var& c) {
         c.set_seqused_k({3, 5});
         c.varlen.seqused_k->device = kCuda0;
       },
       kInvalid, "seqused_k", {"the device of q (cpu)"}, {}, "cuda:0"},
      {"seqused_k_null_data",
       [](Var& c) {
         c.set_seqused_k({3, 5});
         c.varlen.seqused_k->data = nullptr;
       },
       kInvalid, "seqused_k", {"non-null"}, {"null"}},
      {"seqused_k_longer_than_key_sequence", [](Var& c) { c.set_seqused_k({4, 6}); }, kInvalid,
       "seqused_k", {"(5 for b = 1)"}, {}, "6"},
      {"seqused_k_negative", [](Var& c) { c.set_seqused_k({-1, 2}); }, kInvalid, "seqused_k",
       {"0 <= seqused_k[b]", "(4 for b = 0)"}, {}, "-1"},

      // ---- Backend choice.
      {"cpu_backend_with_tensors_on_cuda",
       [](Var& c) {
         c.set_seqused_k({3, 5});
         c.all_on(kCuda0);
         c.execution.backend = Backend::CPU;
       },
       kInvalid, "q", {"host memory"}, {"cuda:0"}},
      cuda_compiled()
          ? VarlenCase{"cuda_backend", [](Var& c) { c.execution.backend = Backend::CUDA; },
                       kInvalid, "q", {"GPU memory"}, {}, "a tensor on cpu"}
          : VarlenCase{"cuda_backend", [](Var& c) { c.execution.backend = Backend::CUDA; },
                       kUnsupported, "backend", {"cpu or auto"}, {}, "cuda"},
      {"dropout_p_1_5", [](Var& c) { c.options.dropout_p = 1.5f; }, kInvalid, "dropout_p",
       {"[0, 1)"}, {}, "1.5"},
  };
}

class VarlenErrors : public ::testing::TestWithParam<VarlenCase> {};

TEST_P(VarlenErrors, RejectedWithoutWriting) {
  const VarlenCase& c = GetParam();
  SCOPED_TRACE("case " + c.name);
  VarlenCall call;
  SCOPED_TRACE(call.describe());
  c.mutate(call);
  expect_rejected(call, c);
}

INSTANTIATE_TEST_SUITE_P(Validation, VarlenErrors, ::testing::ValuesIn(varlen_cases()),
                         case_name<VarlenCall>);

// ---------------------------------------------------------------------------------------------
// The TensorView factories validate too.

TEST(TensorViewErrors, ContiguousWithSevenSizes) {
  try {
    TensorView::contiguous(nullptr, DType::Float32, {1, 1, 1, 1, 1, 1, 1});
    ADD_FAILURE() << "a 7-dimensional view was accepted";
  } catch (const Error& e) {
    expect_error(e, kInvalid, "sizes", {"at most 6 dimensions"}, {}, "7");
  }
}

TEST(TensorViewErrors, StridedWithFewerStridesThanSizes) {
  try {
    TensorView::strided(nullptr, DType::Float32, {2, 3, 4}, {12, 1});
    ADD_FAILURE() << "a view with 3 sizes and 2 strides was accepted";
  } catch (const Error& e) {
    expect_error(e, kInvalid, "strides", {"one stride per size (3)"}, {}, "2 strides");
  }
}

TEST(TensorViewErrors, StridedWithSevenSizes) {
  try {
    TensorView::strided(nullptr, DType::Float32, {1, 1, 1, 1, 1, 1, 1}, {1, 1, 1, 1, 1, 1, 1});
    ADD_FAILURE() << "a 7-dimensional view was accepted";
  } catch (const Error& e) {
    expect_error(e, kInvalid, "sizes", {"at most 6 dimensions"}, {}, "7");
  }
}

// ---------------------------------------------------------------------------------------------
// Success paths next to the boundaries: the valid base calls, values at the edge of each
// range, and empty batches and sequences.

template <typename Call>
RunInfo run_ok(const Call& call) {
  try {
    return call.run();
  } catch (const Error& e) {
    ADD_FAILURE() << "a valid call was rejected: " << e.what();
  }
  return {};
}

// True when every byte of [begin, end) of `b` still holds the sentinel.
bool sentinel_intact(const Buffer& b, size_t begin_byte, size_t end_byte) {
  for (size_t i = begin_byte; i < end_byte; ++i)
    if (b.bytes[i] != kSentinel) return false;
  return true;
}

TEST(ValidCalls, DenseBaseCallMatchesReference) {
  DenseCall call;
  SCOPED_TRACE(call.describe());
  const RunInfo info = run_ok(call);
  EXPECT_EQ(info.backend, Backend::CPU);
  EXPECT_GT(info.workspace_bytes, 0u);
  expect_matches_reference(call.q, call.k, call.v, call.options, nullptr, call.out, &*call.lse,
                           call.describe());
  // Nothing is written past the views.
  EXPECT_TRUE(sentinel_intact(call.out_buf, B * Sq * H * D * sizeof(float),
                              call.out_buf.bytes.size()));
  EXPECT_TRUE(sentinel_intact(call.lse_buf, B * H * Sq * sizeof(float),
                              call.lse_buf.bytes.size()));
}

TEST(ValidCalls, VarlenBaseCallMatchesReference) {
  for (bool with_seqused : {false, true}) {
    VarlenCall call;
    SCOPED_TRACE(std::string(call.describe()) + (with_seqused ? " seqused_k=(3,2)" : ""));
    if (with_seqused) call.set_seqused_k({3, 2});
    const RunInfo info = run_ok(call);
    EXPECT_EQ(info.backend, Backend::CPU);
    expect_matches_reference(call.q, call.k, call.v, call.options, &call.varlen, call.out,
                             &*call.lse, call.describe());
    EXPECT_TRUE(sentinel_intact(call.out_buf, Tq * H * D * sizeof(float),
                                call.out_buf.bytes.size()));
    EXPECT_TRUE(sentinel_intact(call.lse_buf, H * Tq * sizeof(float),
                                call.lse_buf.bytes.size()));
  }
}

struct ValidCase {
  std::string name;
  std::function<void(DenseCall&)> mutate;
};

void PrintTo(const ValidCase& c, std::ostream* os) { *os << c.name; }

std::vector<ValidCase> valid_cases() {
  return {
      {"head_dim_8", [](Dense& c) { c.set_head_dim(8); }},
      {"head_dim_256", [](Dense& c) { c.set_head_dim(256); }},
      {"head_dim_136", [](Dense& c) { c.set_head_dim(136); }},
      {"mqa_Hk_1",
       [](Dense& c) {
         c.k = reshaped(c.k, {B, Sk, 1, D});
         c.v = reshaped(c.v, {B, Sk, 1, D});
       }},
      {"mha_Hk_equals_H",
       [](Dense& c) {
         c.k = reshaped(c.k, {B, Sk, H, D});
         c.v = reshaped(c.v, {B, Sk, H, D});
       }},
      {"window_0_0",
       [](Dense& c) {
         c.options.window_left = 0;
         c.options.window_right = 0;
       }},
      {"causal_with_window_left_1",
       [](Dense& c) {
         c.options.causal = true;
         c.options.window_left = 1;
       }},
      {"softcap_large", [](Dense& c) { c.options.softcap = 1e30f; }},
      {"softcap_minus_zero", [](Dense& c) { c.options.softcap = -0.0f; }},
      {"softmax_scale_zero", [](Dense& c) { c.options.softmax_scale = 0.0f; }},
      {"softmax_scale_negative", [](Dense& c) { c.options.softmax_scale = -0.5f; }},
      {"dropout_p_zero_with_seed",
       [](Dense& c) {
         c.options.dropout_p = 0.0f;
         c.options.dropout_seed = 1234;
         c.options.dropout_offset = 99;
       }},
      {"num_threads_1", [](Dense& c) { c.execution.num_threads = 1; }},
      {"num_threads_more_than_work", [](Dense& c) { c.execution.num_threads = 64; }},
      {"backend_cpu_explicit", [](Dense& c) { c.execution.backend = Backend::CPU; }},
      {"no_lse", [](Dense& c) { c.lse.reset(); }},
      {"alibi_H", [](Dense& c) { c.options.alibi_slopes = c.alibi_buf.view({H}); }},
      {"alibi_B_H", [](Dense& c) { c.options.alibi_slopes = c.alibi_buf.view({B, H}); }},
      {"out_head_major",
       [](Dense& c) { c.out = restrided(c.out, {B, Sq, H, D}, {H * Sq * D, D, Sq * D, 1}); }},
      {"out_padded_rows",
       [](Dense& c) { c.out = restrided(c.out, {B, Sq, H, D}, {Sq * H * 24, H * 24, 24, 1}); }},
      {"out_right_after_q_in_one_allocation",
       [](Dense& c) { c.out = moved_to(c.out, c.q_buf, B * Sq * H * D); }},
      {"k_v_broadcast_over_batch",  // inputs may alias: batch stride 0
       [](Dense& c) {
         c.k = restrided(c.k, {B, Sk, Hk, D}, {0, Hk * D, D, 1});
         c.v = restrided(c.v, {B, Sk, Hk, D}, {0, Hk * D, D, 1});
       }},
      {"k_and_v_share_memory", [](Dense& c) { c.v = moved_to(c.v, c.k_buf); }},
      {"size_1_dims_with_any_stride",
       [](Dense& c) {
         c.k = restrided(c.k, {B, Sk, 1, D}, {Sk * D, D, 12345, 1});
         c.v = restrided(c.v, {B, Sk, 1, D}, {Sk * D, D, 0, 1});
       }},
  };
}

class ValidBoundaries : public ::testing::TestWithParam<ValidCase> {};

TEST_P(ValidBoundaries, AcceptedAndMatchesReference) {
  const ValidCase& c = GetParam();
  SCOPED_TRACE("case " + c.name);
  DenseCall call;
  c.mutate(call);
  run_ok(call);
  expect_matches_reference(call.q, call.k, call.v, call.options, nullptr, call.out,
                           call.lse ? &*call.lse : nullptr, c.name);
}

INSTANTIATE_TEST_SUITE_P(Validation, ValidBoundaries, ::testing::ValuesIn(valid_cases()),
                         [](const ::testing::TestParamInfo<ValidCase>& info) {
                           return info.param.name;
                         });

// ---- Backward: the forward's checks (tested above) plus dout, dq, dk, dv and overlaps.

// A valid backward call on DenseCall's problem; out and lse are now inputs (random), the
// gradients outputs (sentinel).
struct BackwardCall : DenseCall {
  Buffer dout_buf{DType::Float32, kBufferElements}, dq_buf{DType::Float32, kBufferElements},
      dk_buf{DType::Float32, kBufferElements}, dv_buf{DType::Float32, kBufferElements};
  TensorView dout, dq, dk, dv, lse_in;

  BackwardCall() {
    out_buf.fill_random();
    for (int64_t i = 0; i < lse_buf.count(); ++i) lse_buf.set(i, 1.0f);
    dout_buf.fill_random();
    for (Buffer* b : {&dq_buf, &dk_buf, &dv_buf}) fill_sentinel(*b);
    dout = dout_buf.view({B, Sq, H, D});
    dq = dq_buf.view({B, Sq, H, D});
    dk = dk_buf.view({B, Sk, Hk, D});
    dv = dv_buf.view({B, Sk, Hk, D});
    lse_in = *lse;
  }

  RunInfo run() const {
    return backward(q, k, v, out, dout, lse_in, dq, dk, dv, options, execution);
  }

  std::vector<NamedBuffer> buffers() {
    std::vector<NamedBuffer> b = DenseCall::buffers();
    for (NamedBuffer n : {NamedBuffer{"dout", &dout_buf}, NamedBuffer{"dq", &dq_buf},
                          NamedBuffer{"dk", &dk_buf}, NamedBuffer{"dv", &dv_buf}})
      b.push_back(n);
    return b;
  }
};

using Bwd = BackwardCall;
using BackwardCase = ErrorCase<BackwardCall>;

std::vector<BackwardCase> backward_cases() {
  return {
      {"q_rank3", [](Bwd& c) { c.q = reshaped(c.q, {B, Sq, H * D}); }, kInvalid, "q",
       {"4 dimensions"}, {"3 dimensions"}},
      {"lse_wrong_shape", [](Bwd& c) { c.lse_in = reshaped(c.lse_in, {B, H, Sq + 1}); },
       kInvalid, "lse", {"(2, 6, 3)"}, {"(2, 6, 4)"}},
      {"lse_fp16", [](Bwd& c) { c.lse_in.dtype = DType::Float16; }, kInvalid, "lse",
       {"dtype fp32"}, {"dtype fp16"}},
      {"lse_not_contiguous",
       [](Bwd& c) { c.lse_in = restrided(c.lse_in, {B, H, Sq}, {H * Sq * 2, Sq * 2, 1}); },
       kInvalid, "lse", {"contiguous"}, {}},
      {"dout_rank3", [](Bwd& c) { c.dout = reshaped(c.dout, {B * Sq, H, D}); }, kInvalid,
       "dout", {"4 dimensions"}, {"3 dimensions"}},
      {"dout_wrong_shape", [](Bwd& c) { c.dout = reshaped(c.dout, {B, Sq + 1, H, D}); },
       kInvalid, "dout", {"(2, 3, 6, 16)", "like out"}, {"(2, 4, 6, 16)"}},
      {"dout_fp16", [](Bwd& c) { c.dout.dtype = DType::Float16; }, kInvalid, "dout",
       {"dtype fp32"}, {"dtype fp16"}},
      {"dout_on_cuda", [](Bwd& c) { c.dout.device = kCuda0; }, kInvalid, "dout",
       {"the device of q (cpu)"}, {}, "cuda:0"},
      {"dq_wrong_heads", [](Bwd& c) { c.dq = reshaped(c.dq, {B, Sq, H - 1, D}); }, kInvalid,
       "dq", {"(2, 3, 6, 16)", "like q"}, {"(2, 3, 5, 16)"}},
      {"dk_wrong_length", [](Bwd& c) { c.dk = reshaped(c.dk, {B, Sk - 1, Hk, D}); }, kInvalid,
       "dk", {"(2, 5, 2, 16)", "like k"}, {"(2, 4, 2, 16)"}},
      {"dv_bf16", [](Bwd& c) { c.dv.dtype = DType::BFloat16; }, kInvalid, "dv", {"dtype fp32"},
       {"dtype bf16"}},
      {"dk_null_data", [](Bwd& c) { c.dk.data = nullptr; }, kInvalid, "dk", {"non-null"},
       {"null"}},
      {"dq_last_dim_strided",
       [](Bwd& c) { c.dq = restrided(c.dq, {B, Sq, H, D}, {Sq * H * D * 2, H * D * 2, D * 2, 2}); },
       kInvalid, "dq", {"contiguous last dimension"}, {}},
      {"dq_rows_share_memory",
       [](Bwd& c) { c.dq = restrided(c.dq, {B, Sq, H, D}, {Sq * H * D, 0, D, 1}); }, kInvalid,
       "dq", {"no two elements share memory"}, {}},
      {"dq_overlaps_q", [](Bwd& c) { c.dq = moved_to(c.dq, c.q_buf, 7); }, kInvalid, "dq",
       {"memory disjoint from q"}, {"overlapping q"}},
      {"dk_overlaps_dout", [](Bwd& c) { c.dk = moved_to(c.dk, c.dout_buf); }, kInvalid, "dk",
       {"memory disjoint from dout"}, {}},
      {"dv_overlaps_lse", [](Bwd& c) { c.dv = moved_to(c.dv, c.lse_buf); }, kInvalid, "dv",
       {"memory disjoint from lse"}, {}},
      {"dv_overlaps_out", [](Bwd& c) { c.dv = moved_to(c.dv, c.out_buf, 3); }, kInvalid, "dv",
       {"memory disjoint from out"}, {}},
      {"dv_overlaps_dk", [](Bwd& c) { c.dv = moved_to(c.dv, c.dk_buf, 16); }, kInvalid, "dv",
       {"memory disjoint from dk"}, {}},
      {"dq_overlaps_alibi",
       [](Bwd& c) {
         c.options.alibi_slopes = c.alibi_buf.view({H});
         c.dq = moved_to(c.dq, c.alibi_buf);
       },
       kInvalid, "dq", {"memory disjoint from alibi_slopes"}, {}},
      {"dropout_p_1", [](Bwd& c) { c.options.dropout_p = 1.0f; }, kInvalid, "dropout_p",
       {"[0, 1)"}, {}, "1"},
      cuda_compiled()
          ? BackwardCase{"cuda_backend", [](Bwd& c) { c.execution.backend = Backend::CUDA; },
                         kInvalid, "q", {"GPU memory"}, {}, "a tensor on cpu"}
          : BackwardCase{"cuda_backend", [](Bwd& c) { c.execution.backend = Backend::CUDA; },
                         kUnsupported, "backend", {"cpu or auto"}, {}, "cuda"},
  };
}

class BackwardErrors : public ::testing::TestWithParam<BackwardCase> {};

TEST_P(BackwardErrors, RejectedWithoutWriting) {
  const BackwardCase& c = GetParam();
  SCOPED_TRACE("case " + c.name);
  BackwardCall call;
  c.mutate(call);
  expect_rejected(call, c);
}

INSTANTIATE_TEST_SUITE_P(Validation, BackwardErrors, ::testing::ValuesIn(backward_cases()),
                         case_name<BackwardCall>);

TEST(BackwardErrors, ValidCallIsAccepted) {
  BackwardCall call;
  call.options.dropout_p = 0.3f;
  EXPECT_NO_THROW(call.run());
  const float* dq = reinterpret_cast<const float*>(call.dq_buf.data());
  for (int64_t i = 0; i < B * Sq * H * D; ++i) ASSERT_TRUE(std::isfinite(dq[i])) << i;
}

TEST(BackwardErrors, VarlenGradientShapes) {
  VarlenCall call;
  Buffer dout(DType::Float32, kBufferElements), dq(DType::Float32, kBufferElements),
      dk(DType::Float32, kBufferElements), dv(DType::Float32, kBufferElements);
  dout.fill_random();
  fill_sentinel(dk);
  const std::vector<unsigned char> before = dk.bytes;
  const auto run = [&](const TensorView& dk_view) {
    backward_varlen(call.q, call.k, call.v, call.out, dout.view({7, 6, 16}), *call.lse,
                    dq.view({7, 6, 16}), dk_view, dv.view({9, 2, 16}), call.varlen);
  };
  try {
    run(dk.view({8, 2, 16}));
    ADD_FAILURE() << "accepted a dk with 8 rows for total_k = 9";
  } catch (const Error& e) {
    expect_error(e, kInvalid, "dk", {"(9, 2, 16)", "like k"}, {"(8, 2, 16)"}, "");
  }
  EXPECT_TRUE(dk.bytes == before);
  EXPECT_NO_THROW(run(dk.view({9, 2, 16})));
}

TEST(EmptyCalls, BatchZeroWithNullPointers) {
  const TensorView q = TensorView::contiguous(nullptr, DType::Float32, {0, 3, 6, 16});
  const TensorView k = TensorView::contiguous(nullptr, DType::Float32, {0, 5, 2, 16});
  const TensorView out = TensorView::contiguous(nullptr, DType::Float32, {0, 3, 6, 16});
  const TensorView lse = TensorView::contiguous(nullptr, DType::Float32, {0, 6, 3});
  RunInfo info;
  EXPECT_NO_THROW(info = forward(q, k, k, out, lse));
  EXPECT_EQ(info.backend, Backend::CPU);
}

TEST(EmptyCalls, QueryLengthZeroWritesNothing) {
  DenseCall call;
  call.q = reshaped(call.q, {B, 0, H, D});
  call.out = reshaped(call.out, {B, 0, H, D});
  call.lse = reshaped(*call.lse, {B, H, 0});
  run_ok(call);
  EXPECT_TRUE(sentinel_intact(call.out_buf, 0, call.out_buf.bytes.size()));
  EXPECT_TRUE(sentinel_intact(call.lse_buf, 0, call.lse_buf.bytes.size()));
}

TEST(EmptyCalls, KeyLengthZeroGivesZeroOutAndMinusInfLse) {
  for (const bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "not causal");
    DenseCall call;
    call.options.causal = causal;
    call.k = TensorView::contiguous(nullptr, DType::Float32, {B, 0, Hk, D});
    call.v = TensorView::contiguous(nullptr, DType::Float32, {B, 0, Hk, D});
    run_ok(call);
    const float* out = reinterpret_cast<const float*>(call.out_buf.data());
    const float* lse = reinterpret_cast<const float*>(call.lse_buf.data());
    for (int64_t i = 0; i < B * Sq * H * D; ++i) ASSERT_EQ(out[i], 0.0f) << "out[" << i << "]";
    for (int64_t i = 0; i < B * H * Sq; ++i) ASSERT_EQ(lse[i], -kInf) << "lse[" << i << "]";
    EXPECT_TRUE(sentinel_intact(call.out_buf, B * Sq * H * D * sizeof(float),
                                call.out_buf.bytes.size()));
  }
}

TEST(EmptyCalls, VarlenBatchZero) {
  VarlenCall call;
  call.set_cu_q({0});
  call.set_cu_k({0});
  call.varlen.max_seqlen_q = call.varlen.max_seqlen_k = 0;
  call.q = TensorView::contiguous(nullptr, DType::Float32, {0, H, D});
  call.k = call.v = TensorView::contiguous(nullptr, DType::Float32, {0, Hk, D});
  call.out = TensorView::contiguous(nullptr, DType::Float32, {0, H, D});
  call.lse = TensorView::contiguous(nullptr, DType::Float32, {H, 0});
  run_ok(call);
}

// Varlen rows of a sequence with no keys (empty in cu_seqlens_k, or seqused_k = 0) get out = 0
// and lse = -inf; the other sequence still matches the reference.
TEST(EmptyCalls, VarlenSequencesWithoutKeys) {
  for (const bool via_seqused : {false, true}) {
    SCOPED_TRACE(via_seqused ? "seqused_k = (3, 0)" : "cu_seqlens_k = (0, 0, 5)");
    VarlenCall call;
    int64_t empty_row0 = 0, empty_rows = 3;  // rows of the key-less sequence in q/out
    if (via_seqused) {
      call.set_seqused_k({3, 0});
      empty_row0 = 3;
      empty_rows = 4;
    } else {
      call.set_cu_k({0, 0, 5});  // rows 5..8 of k/v are unused
    }
    run_ok(call);
    expect_matches_reference(call.q, call.k, call.v, call.options, &call.varlen, call.out,
                             &*call.lse, "varlen with a key-less sequence");
    const float* out = reinterpret_cast<const float*>(call.out_buf.data());
    const float* lse = reinterpret_cast<const float*>(call.lse_buf.data());
    for (int64_t i = empty_row0 * H * D; i < (empty_row0 + empty_rows) * H * D; ++i)
      ASSERT_EQ(out[i], 0.0f) << "out element " << i;
    for (int64_t h = 0; h < H; ++h)
      for (int64_t r = empty_row0; r < empty_row0 + empty_rows; ++r)
        ASSERT_EQ(lse[h * Tq + r], -kInf) << "lse[" << h << ", " << r << "]";
  }
}


// ---------------------------------------------------------------------------------------------
// Gaps in validation found while writing these tests (see the report to the lead). Disabled so
// that the suite stays green until the library is fixed; run them with
// --gtest_also_run_disabled_tests. Each is safe to run against the current library (it
// returns instead of crashing or hanging).

// TensorView::numel() wraps: 1 * 2^61 * 1 * 8 = 2^64 == 0 (mod 2^64), so check_view treats a
// view of 2^64 elements as empty and skips its null-pointer and 64-bit-offset checks (and
// check_no_self_overlap skips out). With the CPU backend this call then reads q through a null
// pointer (SIGSEGV); asking for the CUDA backend here makes the current library stop at the
// backend check instead, so the test fails cleanly until the wrap is caught.
TEST(Robustness, SizeProductOverflowIsRejected) {
  const int64_t rows = int64_t{1} << 61;
  // The contiguous() factory refuses to build strides that overflow ...
  EXPECT_THROW(TensorView::contiguous(nullptr, DType::Float32, {1, rows, 1, 8}), Error);
  // ... and a hand-made view whose element count wraps to 0 is not mistaken for an empty one.
  Buffer kv(DType::Float32, 8);
  kv.fill_random();
  const TensorView q = TensorView::strided(nullptr, DType::Float32, {1, rows, 1, 8}, {8, 8, 8, 1});
  const TensorView k = kv.view({1, 1, 1, 8});
  Buffer out_buf(DType::Float32, 8);
  const TensorView out = TensorView::strided(out_buf.data(), DType::Float32, {1, rows, 1, 8}, {8, 8, 8, 1});
  try {
    forward(q, k, k, out, std::nullopt, {});
    ADD_FAILURE() << "null tensors of 2^64 elements were accepted";
  } catch (const Error& e) {
    EXPECT_STREQ(code_name(e.code()), "InvalidArgument") << e.what();
    EXPECT_EQ(e.argument(), "q") << e.what();
  }
}

// An out/lse that overlaps any input (alibi_slopes here; cu_seqlens and seqused_k alike)
// would overwrite it while it is being read.
TEST(Robustness, OutputsOverlappingAlibiSlopesAreRejected) {
  for (const bool lse_overlaps : {false, true}) {
    SCOPED_TRACE(lse_overlaps ? "lse overlaps alibi_slopes" : "out overlaps alibi_slopes");
    DenseCall call;
    call.options.alibi_slopes =
        TensorView::contiguous(lse_overlaps ? call.lse_buf.data() : call.out_buf.data(),
                               DType::Float32, {H});
    for (int64_t h = 0; h < H; ++h)
      static_cast<float*>(call.options.alibi_slopes->data)[h] = 0.25f;
    try {
      call.run();
      ADD_FAILURE() << "an output overlapping alibi_slopes was accepted";
    } catch (const Error& e) {
      EXPECT_STREQ(code_name(e.code()), "InvalidArgument") << e.what();
      EXPECT_EQ(e.argument(), lse_overlaps ? "lse" : "out") << e.what();
      EXPECT_TRUE(e.expected().find("alibi_slopes") != std::string::npos) << e.what();
    }
  }
}

// max_seqlen_q beyond what int32 cu_seqlens can describe is rejected naming it (writing
// nothing); any bound up to that is computed.
TEST(Robustness, HugeMaxSeqlenQIsRejectedOrComputed) {
  VarlenCall call;
  call.varlen.max_seqlen_q = std::numeric_limits<int64_t>::max();
  call.out_buf.poison();
  call.lse_buf.poison();
  const std::vector<unsigned char> out_before = call.out_buf.bytes;
  try {
    call.run();
    expect_matches_reference(call.q, call.k, call.v, call.options, &call.varlen, call.out,
                             &*call.lse, "max_seqlen_q = INT64_MAX");
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "max_seqlen_q") << e.what();
    EXPECT_TRUE(out_before == call.out_buf.bytes);
  }
}

// ---- forward_kvcache ---------------------------------------------------------------------

// A valid KV-cache call: B=2, Sq=3, H=6, Hk=2, D=16, fp32; a dense cache of B_cache=3 rows of
// S_cache=12 positions with cache_seqlens (4, 6) and cache_leftpad (1, 0); k_new/v_new with
// S_new=2; rotary tables of 16 rows for rotary_dim 8; lse. make_paged() turns it into a paged
// cache of 8 pages of 4 positions with block_table ((0, 1, 2), (3, 4, 5)); use_batch_idx()
// adds cache_batch_idx (2, 0).
struct KvCall {
  static constexpr int64_t B = 2, Sq = 3, H = 6, Hk = 2, D = 16, Bc = 3, Sc = 12, Sn = 2,
                           Sr = 16, Rd = 8, Pages = 8, Ps = 4, MaxPages = 3;
  Buffer q_buf{DType::Float32, kBufferElements}, kc_buf{DType::Float32, kBufferElements},
      vc_buf{DType::Float32, kBufferElements}, kn_buf{DType::Float32, kBufferElements},
      vn_buf{DType::Float32, kBufferElements}, cos_buf{DType::Float32, kBufferElements},
      sin_buf{DType::Float32, kBufferElements}, out_buf{DType::Float32, kBufferElements},
      lse_buf{DType::Float32, kBufferElements}, alibi_buf{DType::Float32, kBufferElements},
      seqlens_buf{DType::Int32, 16}, leftpad_buf{DType::Int32, 16}, idx_buf{DType::Int32, 16},
      table_buf{DType::Int32, 16};
  TensorView q, out;
  std::optional<TensorView> lse;
  KvCache cache;
  Options options;
  Execution execution;

  KvCall() {
    for (Buffer* b : {&q_buf, &kc_buf, &vc_buf, &kn_buf, &vn_buf, &cos_buf, &sin_buf})
      b->fill_random();
    for (int64_t i = 0; i < alibi_buf.count(); ++i) alibi_buf.set(i, 0.25f);
    fill_sentinel(out_buf);
    fill_sentinel(lse_buf);
    q = q_buf.view({B, Sq, H, D});
    out = out_buf.view({B, Sq, H, D});
    lse = lse_buf.view({B, H, Sq});
    cache.k_cache = kc_buf.view({Bc, Sc, Hk, D});
    cache.v_cache = vc_buf.view({Bc, Sc, Hk, D});
    set_seqlens({4, 6});
    write_int32(leftpad_buf, {1, 0});
    cache.cache_leftpad = TensorView::contiguous(leftpad_buf.data(), DType::Int32, {B});
    cache.k_new = kn_buf.view({B, Sn, Hk, D});
    cache.v_new = vn_buf.view({B, Sn, Hk, D});
    cache.rotary_cos = cos_buf.view({Sr, Rd / 2});
    cache.rotary_sin = sin_buf.view({Sr, Rd / 2});
  }

  void set_seqlens(const std::vector<int32_t>& values) {
    write_int32(seqlens_buf, values);
    cache.cache_seqlens = TensorView::contiguous(seqlens_buf.data(), DType::Int32,
                                                 {static_cast<int64_t>(values.size())});
  }
  void set_leftpad(const std::vector<int32_t>& values) { write_int32(leftpad_buf, values); }
  void use_batch_idx(const std::vector<int32_t>& values = {2, 0}) {
    write_int32(idx_buf, values);
    cache.cache_batch_idx = TensorView::contiguous(idx_buf.data(), DType::Int32, {B});
  }
  void make_paged(const std::vector<int32_t>& table = {0, 1, 2, 3, 4, 5}) {
    cache.k_cache = kc_buf.view({Pages, Ps, Hk, D});
    cache.v_cache = vc_buf.view({Pages, Ps, Hk, D});
    write_int32(table_buf, table);
    cache.block_table = TensorView::contiguous(table_buf.data(), DType::Int32, {B, MaxPages});
  }

  RunInfo run() const { return forward_kvcache(q, cache, out, lse, options, execution); }

  std::vector<NamedBuffer> buffers() {
    return {{"q", &q_buf},          {"k_cache", &kc_buf},     {"v_cache", &vc_buf},
            {"k_new", &kn_buf},     {"v_new", &vn_buf},       {"rotary_cos", &cos_buf},
            {"rotary_sin", &sin_buf}, {"out", &out_buf},      {"lse", &lse_buf},
            {"alibi_slopes", &alibi_buf}, {"cache_seqlens", &seqlens_buf},
            {"cache_leftpad", &leftpad_buf}, {"cache_batch_idx", &idx_buf},
            {"block_table", &table_buf}};
  }

  void all_on(Device device) {
    q.device = out.device = cache.k_cache.device = cache.v_cache.device = device;
    cache.cache_seqlens.device = device;
    for (std::optional<TensorView>* t :
         {&lse, &cache.k_new, &cache.v_new, &cache.rotary_cos, &cache.rotary_sin,
          &cache.cache_batch_idx, &cache.cache_leftpad, &cache.block_table,
          &options.alibi_slopes})
      if (*t) (*t)->device = device;
  }

  // q, the caches, k_new/v_new and out with head dim d.
  void set_head_dim(int64_t d) {
    q = reshaped(q, {B, Sq, H, d});
    out = reshaped(out, {B, Sq, H, d});
    cache.k_cache = reshaped(cache.k_cache, {Bc, Sc, Hk, d});
    cache.v_cache = reshaped(cache.v_cache, {Bc, Sc, Hk, d});
    cache.k_new = reshaped(*cache.k_new, {B, Sn, Hk, d});
    cache.v_new = reshaped(*cache.v_new, {B, Sn, Hk, d});
  }

  const char* describe() const {
    return "kvcache B=2 Sq=3 H=6 Hk=2 D=16 fp32, cache (3, 12), seqlens (4, 6), leftpad (1, 0), "
           "S_new=2, rotary_dim 8";
  }
};

using Kv = KvCall;
using KvErrorCase = ErrorCase<KvCall>;

std::vector<KvErrorCase> kvcache_cases() {
  constexpr int64_t KB = KvCall::B, KSq = KvCall::Sq, KH = KvCall::H, KHk = KvCall::Hk,
                    KD = KvCall::D, Bc = KvCall::Bc, Sc = KvCall::Sc, Sn = KvCall::Sn;
  return {
      // ---- Options and execution.
      {"dropout", [](Kv& c) { c.options.dropout_p = 0.1f; }, kInvalid, "dropout_p",
       {"0", "inference"}, {}, "0.1"},
      {"dropout_p_1_still_a_probability_error", [](Kv& c) { c.options.dropout_p = 1.0f; },
       kInvalid, "dropout_p", {"[0, 1)"}, {}, "1"},
      {"window_left_minus_2", [](Kv& c) { c.options.window_left = -2; }, kInvalid,
       "window_left", {"-1 (unbounded)"}, {}, "-2"},
      {"num_splits_negative", [](Kv& c) { c.cache.num_splits = -1; }, kInvalid, "num_splits",
       {"0 (choose)", "[1, 1024]"}, {}, "-1"},
      {"num_splits_1025", [](Kv& c) { c.cache.num_splits = 1025; }, kInvalid, "num_splits",
       {"[1, 1024]"}, {}, "1025"},
      {"num_threads_negative", [](Kv& c) { c.execution.num_threads = -3; }, kInvalid,
       "num_threads", {">= 1"}, {}, "-3"},
      {"backend_code_7", [](Kv& c) { c.execution.backend = static_cast<Backend>(7); }, kInvalid,
       "backend", {"auto, cpu or cuda"}, {}, "backend code 7"},

      // ---- Ranks, dtypes, devices, strides of q, the caches and out.
      {"q_rank3", [=](Kv& c) { c.q = reshaped(c.q, {KB, KSq, KH * KD}); }, kInvalid, "q",
       {"4 dimensions"}, {"3 dimensions"}},
      {"k_cache_rank3", [=](Kv& c) { c.cache.k_cache = reshaped(c.cache.k_cache, {Bc * Sc, KHk, KD}); },
       kInvalid, "k_cache", {"4 dimensions"}, {"3 dimensions"}},
      {"v_cache_rank5",
       [=](Kv& c) { c.cache.v_cache = reshaped(c.cache.v_cache, {Bc, Sc, KHk, KD, 1}); }, kInvalid,
       "v_cache", {"4 dimensions"}, {"5 dimensions"}},
      {"out_rank3", [=](Kv& c) { c.out = reshaped(c.out, {KB * KSq, KH, KD}); }, kInvalid, "out",
       {"4 dimensions"}, {"3 dimensions"}},
      {"q_int32",
       [](Kv& c) {
         c.q.dtype = c.out.dtype = c.cache.k_cache.dtype = c.cache.v_cache.dtype = DType::Int32;
       },
       kInvalid, "q", {"fp32, fp16 or bf16"}, {"dtype int32"}},
      {"k_cache_fp16", [](Kv& c) { c.cache.k_cache.dtype = DType::Float16; }, kInvalid,
       "k_cache", {"dtype fp32"}, {"dtype fp16"}},
      {"v_cache_bf16", [](Kv& c) { c.cache.v_cache.dtype = DType::BFloat16; }, kInvalid,
       "v_cache", {"dtype fp32"}, {"dtype bf16"}},
      {"out_fp16", [](Kv& c) { c.out.dtype = DType::Float16; }, kInvalid, "out", {"dtype fp32"},
       {"dtype fp16"}},
      {"k_cache_on_cuda", [](Kv& c) { c.cache.k_cache.device = kCuda0; }, kInvalid, "k_cache",
       {"the device of q (cpu)"}, {}, "cuda:0"},
      {"v_cache_last_dim_stride_2", [](Kv& c) { c.cache.v_cache.strides[3] = 2; }, kInvalid,
       "v_cache", {"contiguous last dimension"}, {}},
      {"k_cache_null_data", [](Kv& c) { c.cache.k_cache.data = nullptr; }, kInvalid, "k_cache",
       {"non-null"}, {"null"}},

      // ---- Head dims, head counts, shapes.
      {"head_dim_12", [](Kv& c) { c.set_head_dim(12); }, kInvalid, "q", {"multiple of 8"},
       {"D = 12"}},
      {"head_dim_264", [](Kv& c) { c.set_head_dim(264); }, kInvalid, "q", {"[8, 256]"},
       {"D = 264"}},
      {"H6_not_a_multiple_of_Hk4",
       [=](Kv& c) {
         c.cache.k_cache = reshaped(c.cache.k_cache, {Bc, Sc, 4, KD});
         c.cache.v_cache = reshaped(c.cache.v_cache, {Bc, Sc, 4, KD});
       },
       kInvalid, "k_cache", {"divides", "H = 6"}, {}, "Hk = 4"},
      {"k_cache_head_dim_24",
       [=](Kv& c) { c.cache.k_cache = reshaped(c.cache.k_cache, {Bc, Sc, KHk, 24}); }, kInvalid,
       "k_cache", {"D = 16"}, {"(3, 12, 2, 24)"}},
      {"v_cache_shorter_than_k_cache",
       [=](Kv& c) { c.cache.v_cache = reshaped(c.cache.v_cache, {Bc, Sc - 1, KHk, KD}); },
       kInvalid, "v_cache", {"(3, 12, 2, 16)", "like k_cache"}, {"(3, 11, 2, 16)"}},
      {"out_heads_Hk", [=](Kv& c) { c.out = reshaped(c.out, {KB, KSq, KHk, KD}); }, kInvalid,
       "out", {"(2, 3, 6, 16)"}, {"(2, 3, 2, 16)"}},
      {"dense_cache_fewer_rows_than_B",
       [=](Kv& c) {
         c.cache.k_cache = reshaped(c.cache.k_cache, {1, Sc, KHk, KD});
         c.cache.v_cache = reshaped(c.cache.v_cache, {1, Sc, KHk, KD});
       },
       kInvalid, "k_cache", {"B = 2", "cache_batch_idx"}, {"(1, 12, 2, 16)"}},
      {"batch_idx_with_an_empty_cache",
       [=](Kv& c) {
         c.use_batch_idx();
         c.cache.k_cache = reshaped(c.cache.k_cache, {0, Sc, KHk, KD});
         c.cache.v_cache = reshaped(c.cache.v_cache, {0, Sc, KHk, KD});
       },
       kInvalid, "k_cache", {"at least one cache row"}, {"(0, 12, 2, 16)"}},

      // ---- Per-sequence int32 tensors.
      {"cache_seqlens_fp32", [](Kv& c) { c.cache.cache_seqlens.dtype = DType::Float32; },
       kInvalid, "cache_seqlens", {"dtype int32"}, {"dtype fp32"}},
      {"cache_seqlens_rank2",
       [=](Kv& c) { c.cache.cache_seqlens = reshaped(c.cache.cache_seqlens, {1, KB}); }, kInvalid,
       "cache_seqlens", {"1 dimension"}, {"2 dimensions"}},
      {"cache_seqlens_3_entries", [](Kv& c) { c.set_seqlens({4, 6, 1}); }, kInvalid,
       "cache_seqlens", {"(2)", "(B)"}, {"(3)"}},
      {"cache_seqlens_stride_2",
       [=](Kv& c) { c.cache.cache_seqlens = restrided(c.cache.cache_seqlens, {KB}, {2}); },
       kInvalid, "cache_seqlens", {"contiguous last dimension"}, {"(2)"}},
      {"cache_seqlens_on_cuda", [](Kv& c) { c.cache.cache_seqlens.device = kCuda0; }, kInvalid,
       "cache_seqlens", {"the device of q (cpu)"}, {}, "cuda:0"},
      {"cache_leftpad_int16_sized",
       [](Kv& c) { c.cache.cache_leftpad->dtype = DType::Float16; }, kInvalid, "cache_leftpad",
       {"dtype int32"}, {"dtype fp16"}},
      {"cache_leftpad_1_entry",
       [](Kv& c) { c.cache.cache_leftpad = reshaped(*c.cache.cache_leftpad, {1}); }, kInvalid,
       "cache_leftpad", {"(2)"}, {"(1)"}},
      {"cache_batch_idx_3_entries",
       [](Kv& c) {
         c.use_batch_idx();
         c.cache.cache_batch_idx = reshaped(*c.cache.cache_batch_idx, {3});
       },
       kInvalid, "cache_batch_idx", {"(2)"}, {"(3)"}},
      {"cache_batch_idx_fp32",
       [](Kv& c) {
         c.use_batch_idx();
         c.cache.cache_batch_idx->dtype = DType::Float32;
       },
       kInvalid, "cache_batch_idx", {"dtype int32"}, {"dtype fp32"}},

      // ---- Paged caches.
      {"block_table_with_cache_batch_idx",
       [](Kv& c) {
         c.make_paged();
         c.use_batch_idx();
       },
       kInvalid, "cache_batch_idx", {"paged", "block_table"}, {"cache_batch_idx", "block_table"}},
      {"block_table_rank1",
       [](Kv& c) {
         c.make_paged();
         c.cache.block_table = reshaped(*c.cache.block_table, {6});
       },
       kInvalid, "block_table", {"2 dimensions"}, {"1 dimension"}},
      {"block_table_fp32",
       [](Kv& c) {
         c.make_paged();
         c.cache.block_table->dtype = DType::Float32;
       },
       kInvalid, "block_table", {"dtype int32"}, {"dtype fp32"}},
      {"block_table_3_rows",
       [](Kv& c) {
         c.make_paged();
         c.cache.block_table = reshaped(*c.cache.block_table, {3, 2});
       },
       kInvalid, "block_table", {"B = 2", "max_pages"}, {"(3, 2)"}},
      {"block_table_columns_strided",
       [](Kv& c) {
         c.make_paged();
         c.cache.block_table = restrided(*c.cache.block_table, {2, 3}, {6, 2});
       },
       kInvalid, "block_table", {"contiguous last dimension"}, {"(6, 2)"}},
      {"block_table_on_cuda",
       [](Kv& c) {
         c.make_paged();
         c.cache.block_table->device = kCuda0;
       },
       kInvalid, "block_table", {"the device of q (cpu)"}, {}, "cuda:0"},
      {"page_size_0",
       [](Kv& c) {
         c.make_paged();
         c.cache.k_cache = reshaped(c.cache.k_cache, {8, 0, KvCall::Hk, KvCall::D});
         c.cache.v_cache = reshaped(c.cache.v_cache, {8, 0, KvCall::Hk, KvCall::D});
       },
       kInvalid, "k_cache", {"page size", "[1, 2^31)"}, {"(8, 0, 2, 16)"}},

      // ---- k_new / v_new.
      {"k_new_without_v_new", [](Kv& c) { c.cache.v_new.reset(); }, kInvalid, "v_new",
       {"k_new", "both or neither"}, {}, "none"},
      {"v_new_without_k_new", [](Kv& c) { c.cache.k_new.reset(); }, kInvalid, "k_new",
       {"v_new", "both or neither"}, {}, "none"},
      {"k_new_rank3",
       [=](Kv& c) { c.cache.k_new = reshaped(*c.cache.k_new, {KB * Sn, KHk, KD}); }, kInvalid,
       "k_new", {"4 dimensions"}, {"3 dimensions"}},
      {"k_new_fp16", [](Kv& c) { c.cache.k_new->dtype = DType::Float16; }, kInvalid, "k_new",
       {"dtype fp32"}, {"dtype fp16"}},
      {"v_new_on_cuda", [](Kv& c) { c.cache.v_new->device = kCuda1; }, kInvalid, "v_new",
       {"the device of q (cpu)"}, {}, "cuda:1"},
      {"k_new_batch_3", [=](Kv& c) { c.cache.k_new = reshaped(*c.cache.k_new, {3, Sn, KHk, KD}); },
       kInvalid, "k_new", {"(2, 2, 2, 16)", "(B, S_new, Hk, D)"}, {"(3, 2, 2, 16)"}},
      {"k_new_heads_H", [=](Kv& c) { c.cache.k_new = reshaped(*c.cache.k_new, {KB, Sn, KH, KD}); },
       kInvalid, "k_new", {"(2, 2, 2, 16)"}, {"(2, 2, 6, 16)"}},
      {"v_new_longer_than_k_new",
       [=](Kv& c) { c.cache.v_new = reshaped(*c.cache.v_new, {KB, Sn + 1, KHk, KD}); }, kInvalid,
       "v_new", {"(2, 2, 2, 16)", "like k_new"}, {"(2, 3, 2, 16)"}},

      // ---- Rotary tables.
      {"rotary_cos_without_sin", [](Kv& c) { c.cache.rotary_sin.reset(); }, kInvalid,
       "rotary_sin", {"rotary_cos", "both or neither"}, {}, "none"},
      {"rotary_sin_without_cos", [](Kv& c) { c.cache.rotary_cos.reset(); }, kInvalid,
       "rotary_cos", {"rotary_sin"}, {}, "none"},
      {"rotary_cos_rank1", [](Kv& c) { c.cache.rotary_cos = c.cos_buf.view({64}); }, kInvalid,
       "rotary_cos", {"2 dimensions"}, {"1 dimension"}},
      {"rotary_cos_fp16", [](Kv& c) { c.cache.rotary_cos->dtype = DType::Float16; }, kInvalid,
       "rotary_cos", {"dtype fp32"}, {"dtype fp16"}},
      {"rotary_sin_on_cuda", [](Kv& c) { c.cache.rotary_sin->device = kCuda0; }, kInvalid,
       "rotary_sin", {"the device of q (cpu)"}, {}, "cuda:0"},
      {"rotary_dim_18_past_D",
       [](Kv& c) {
         c.cache.rotary_cos = c.cos_buf.view({16, 9});
         c.cache.rotary_sin = c.sin_buf.view({16, 9});
       },
       kInvalid, "rotary_cos", {"rotary_dim <= D = 16"}, {"(16, 9)"}},
      {"rotary_dim_0",
       [](Kv& c) {
         c.cache.rotary_cos = c.cos_buf.view({16, 0});
         c.cache.rotary_sin = c.sin_buf.view({16, 0});
       },
       kInvalid, "rotary_cos", {"2 <= rotary_dim"}, {"(16, 0)"}},
      {"rotary_sin_narrower_than_cos",
       [](Kv& c) { c.cache.rotary_sin = c.sin_buf.view({16, 3}); }, kInvalid, "rotary_sin",
       {"(16, 4)", "like rotary_cos"}, {"(16, 3)"}},
      {"rotary_cos_strided_columns",
       [](Kv& c) { c.cache.rotary_cos = c.cos_buf.view({16, 4}, {8, 2}); }, kInvalid,
       "rotary_cos", {"contiguous last dimension"}, {"(8, 2)"}},

      // ---- lse and ALiBi.
      {"lse_fp16", [](Kv& c) { c.lse->dtype = DType::Float16; }, kInvalid, "lse",
       {"dtype fp32"}, {"dtype fp16"}},
      {"lse_shape_B_Sq_H", [=](Kv& c) { c.lse = reshaped(*c.lse, {KB, KSq, KH}); }, kInvalid,
       "lse", {"(2, 6, 3)", "(B, H, Sq)"}, {"(2, 3, 6)"}},
      {"lse_head_major", [=](Kv& c) { c.lse = restrided(*c.lse, {KB, KH, KSq}, {KH * KSq, 1, KH}); },
       kInvalid, "lse", {"contiguous"}, {"(18, 1, 6)"}},
      {"alibi_H_5", [](Kv& c) { c.options.alibi_slopes = c.alibi_buf.view({5}); }, kInvalid,
       "alibi_slopes", {"(6)", "(H)"}, {"(5)"}},

      // ---- What is written must not overlap what is read.
      {"out_overlaps_itself",
       [=](Kv& c) { c.out = restrided(c.out, {KB, KSq, KH, KD}, {KSq * KH * KD, 0, KD, 1}); },
       kInvalid, "out", {"no two elements share memory"}, {}},
      {"out_inside_k_cache", [](Kv& c) { c.out = moved_to(c.out, c.kc_buf, 5); }, kInvalid,
       "out", {"memory disjoint from k_cache"}, {"overlapping k_cache"}},
      {"out_over_block_table",
       [](Kv& c) {
         c.make_paged();
         c.out = moved_to(c.out, c.table_buf);
       },
       kInvalid, "out", {"memory disjoint from block_table"}, {"overlapping block_table"}},
      {"lse_over_cache_seqlens", [](Kv& c) { c.lse = moved_to(*c.lse, c.seqlens_buf); },
       kInvalid, "lse", {"memory disjoint from cache_seqlens"}, {"overlapping cache_seqlens"}},
      {"lse_overlaps_out", [](Kv& c) { c.lse = moved_to(*c.lse, c.out_buf, 7); }, kInvalid,
       "lse", {"memory disjoint from out"}, {"overlapping out"}},
      {"k_new_inside_k_cache",
       [](Kv& c) { c.cache.k_new = moved_to(*c.cache.k_new, c.kc_buf, 100); }, kInvalid,
       "k_cache", {"memory disjoint from k_new"}, {"overlapping k_new"}},
      {"q_inside_v_cache_while_appending", [](Kv& c) { c.q = moved_to(c.q, c.vc_buf); },
       kInvalid, "v_cache", {"memory disjoint from q"}, {"overlapping q"}},
      {"rotary_sin_inside_k_cache",
       [](Kv& c) { c.cache.rotary_sin = moved_to(*c.cache.rotary_sin, c.kc_buf, 16); }, kInvalid,
       "k_cache", {"memory disjoint from rotary_sin"}, {"overlapping rotary_sin"}},
      {"k_cache_overlaps_itself_while_appending",
       [=](Kv& c) {
         c.cache.k_cache = restrided(c.cache.k_cache, {Bc, Sc, KHk, KD}, {Sc * KHk * KD, 0, KD, 1});
       },
       kInvalid, "k_cache", {"no two elements share memory"}, {}},

      // ---- Backend.
      {"cpu_backend_with_tensors_on_cuda",
       [](Kv& c) {
         c.all_on(kCuda0);
         c.execution.backend = Backend::CPU;
       },
       kInvalid, "q", {"host memory", "cpu backend"}, {"cuda:0"}},
      cuda_compiled()
          ? KvErrorCase{"cuda_backend", [](Kv& c) { c.execution.backend = Backend::CUDA; },
                        kInvalid, "q", {"GPU memory", "cuda backend"}, {}, "a tensor on cpu"}
          : KvErrorCase{"cuda_backend", [](Kv& c) { c.execution.backend = Backend::CUDA; },
                        kUnsupported, "backend", {"cpu or auto"}, {}, "cuda"},

      // ---- Values of the int32 tensors (host memory: the CPU backend checks them).
      {"cache_seqlens_negative", [](Kv& c) { c.set_seqlens({-1, 6}); }, kInvalid,
       "cache_seqlens", {">= 0"}, {}, "cache_seqlens[0] = -1"},
      {"append_past_capacity", [](Kv& c) { c.set_seqlens({4, 11}); }, kInvalid, "cache_seqlens",
       {"cache_seqlens[b] + S_new <= the cache capacity 12", "S_cache"}, {},
       "cache_seqlens[1] = 11 with S_new = 2"},
      {"paged_append_past_capacity",
       [](Kv& c) {
         c.make_paged();
         c.set_seqlens({11, 6});
       },
       kInvalid, "cache_seqlens", {"capacity 12", "max_pages 3 x page_size 4"}, {},
       "cache_seqlens[0] = 11 with S_new = 2"},
      {"cache_leftpad_negative", [](Kv& c) { c.set_leftpad({-1, 0}); }, kInvalid,
       "cache_leftpad", {"0 <= cache_leftpad[b] <= cache_seqlens[b] (= 4 for b = 0)"}, {},
       "cache_leftpad[0] = -1"},
      {"cache_leftpad_past_cache_seqlens", [](Kv& c) { c.set_leftpad({1, 7}); }, kInvalid,
       "cache_leftpad", {"(= 6 for b = 1)"}, {}, "cache_leftpad[1] = 7"},
      {"cache_batch_idx_3_of_3_rows", [](Kv& c) { c.use_batch_idx({3, 0}); }, kInvalid,
       "cache_batch_idx", {"[0, B_cache = 3)"}, {}, "cache_batch_idx[0] = 3"},
      {"cache_batch_idx_negative", [](Kv& c) { c.use_batch_idx({0, -1}); }, kInvalid,
       "cache_batch_idx", {"[0, B_cache = 3)"}, {}, "cache_batch_idx[1] = -1"},
      {"cache_batch_idx_repeated_while_appending", [](Kv& c) { c.use_batch_idx({1, 1}); },
       kInvalid, "cache_batch_idx", {"distinct", "k_new"}, {}, "sequences 0 and 1 both use cache row 1"},
      {"block_table_page_8_of_8",
       [](Kv& c) { c.make_paged({0, 1, 2, 3, 8, 5}); }, kInvalid, "block_table",
       {"[0, num_pages = 8)"}, {"block_table[1][1] = 8"}},
      {"block_table_negative_page", [](Kv& c) { c.make_paged({-2, 1, 2, 3, 4, 5}); }, kInvalid,
       "block_table", {"[0, num_pages = 8)"}, {"block_table[0][0] = -2"}},
      {"block_table_two_sequences_append_to_one_row",
       [](Kv& c) {
         c.make_paged({0, 1, 2, 3, 1, 5});
         c.set_seqlens({4, 4});
       },
       kInvalid, "block_table", {"no two appended positions share a row"}, {},
       "sequences 0 and 1 write row 0 of page 1"},
      {"rotary_table_too_short", [](Kv& c) {
         c.cache.rotary_cos = c.cos_buf.view({7, 4});
         c.cache.rotary_sin = c.sin_buf.view({7, 4});
       },
       kInvalid, "rotary_cos", {"at least 8 rows", "positions up to 7"}, {"(7, 4)"}},
      {"rotary_table_too_short_for_causal_queries",  // q rows rotate at 6 + t, t < 3
       [](Kv& c) {
         c.options.causal = true;
         c.cache.rotary_cos = c.cos_buf.view({8, 4});
         c.cache.rotary_sin = c.sin_buf.view({8, 4});
       },
       kInvalid, "rotary_cos", {"at least 9 rows"}, {"(8, 4)"}},
  };
}

class KvCacheErrors : public ::testing::TestWithParam<KvErrorCase> {};

TEST_P(KvCacheErrors, RejectedWithoutWriting) {
  const KvErrorCase& c = GetParam();
  SCOPED_TRACE("case " + c.name);
  KvCall call;
  SCOPED_TRACE(call.describe());
  c.mutate(call);
  expect_rejected(call, c);
}

INSTANTIATE_TEST_SUITE_P(Validation, KvCacheErrors, ::testing::ValuesIn(kvcache_cases()),
                         case_name<KvCall>);

// The base call and its variants are valid; so are the things the rules deliberately allow.
TEST(KvCacheValidCalls, BaseCallAndVariantsAreAccepted) {
  const std::vector<std::pair<const char*, std::function<void(KvCall&)>>> variants = {
      {"base", [](KvCall&) {}},
      {"paged", [](KvCall& c) { c.make_paged(); }},
      {"cache_batch_idx", [](KvCall& c) { c.use_batch_idx(); }},
      // Pages past what a sequence uses are never read: any value.
      {"garbage in unused block-table slots",
       [](KvCall& c) {
         c.make_paged({0, 1, -7, 3, 4, 99});
         c.set_seqlens({3, 4});
       }},
      // Without an append the caches are only read: shared rows and pages, q inside a cache.
      {"repeated cache_batch_idx without k_new",
       [](KvCall& c) {
         c.use_batch_idx({1, 1});
         c.cache.k_new.reset();
         c.cache.v_new.reset();
       }},
      {"shared pages without k_new",
       [](KvCall& c) {
         c.make_paged({0, 1, 2, 0, 1, 2});
         c.cache.k_new.reset();
         c.cache.v_new.reset();
       }},
      {"q inside k_cache without k_new",
       [](KvCall& c) {
         c.q = moved_to(c.q, c.kc_buf, 2000);
         c.cache.k_new.reset();
         c.cache.v_new.reset();
       }},
      // k and v interleaved in one buffer: distinct elements, overlapping byte ranges.
      {"packed (k, v) cache",
       [](KvCall& c) {
         const int64_t s1 = 2 * KvCall::Hk * KvCall::D;
         c.cache.k_cache = c.kc_buf.view({KvCall::Bc, KvCall::Sc, KvCall::Hk, KvCall::D},
                                         {KvCall::Sc * s1, s1, KvCall::D, 1}, 0);
         c.cache.v_cache = c.kc_buf.view({KvCall::Bc, KvCall::Sc, KvCall::Hk, KvCall::D},
                                         {KvCall::Sc * s1, s1, KvCall::D, 1}, KvCall::Hk * KvCall::D);
       }},
      {"rotary table exactly long enough", [](KvCall& c) {
         c.cache.rotary_cos = c.cos_buf.view({8, 4});
         c.cache.rotary_sin = c.sin_buf.view({8, 4});
       }},
      {"num_splits 1024", [](KvCall& c) { c.cache.num_splits = 1024; }},
      {"sequence filled to capacity without k_new",
       [](KvCall& c) {
         c.set_seqlens({12, 0});
         c.set_leftpad({12, 0});
         c.cache.k_new.reset();
         c.cache.v_new.reset();
       }},
  };
  for (const auto& [name, mutate] : variants) {
    SCOPED_TRACE(name);
    KvCall call;
    mutate(call);
    RunInfo info;
    EXPECT_NO_THROW(info = call.run());
    EXPECT_EQ(info.backend, Backend::CPU);
    EXPECT_GE(info.num_splits, 1);
  }
}

}  // namespace
}  // namespace flashattn::testing

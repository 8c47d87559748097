// What the argument-validation tests (test_errors_*.cpp, one file per call) share: the valid
// base calls that each case mutates and the checks every rejected call must pass.
//
// Every rejected input gets one table row: a valid call (DenseCall / VarlenCall, or a call
// built on them) plus one mutation. Each row checks the Error's code and argument name, the
// key facts in expected() and given(), the what() format
// "<argument>: expected <expected>, given <given>", and that the rejected call wrote nothing:
// every buffer the call can see (outputs filled with a sentinel byte pattern, inputs random)
// is compared byte for byte before and after.
//
// Nothing on a "CUDA device" is ever dereferenced before validation fails, so the views that
// claim to live on a GPU simply reuse host pointers.
#pragma once

#include <cstring>
#include <functional>
#include <initializer_list>
#include <limits>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "support.hpp"

namespace flashattn::testing {

inline constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
inline constexpr float kInf = std::numeric_limits<float>::infinity();
// Every buffer has this many elements, so that mutated shapes stay in bounds.
inline constexpr int64_t kBufferElements = 16384;
inline constexpr unsigned char kSentinel = 0xA5;
inline constexpr ErrorCode kInvalid = ErrorCode::InvalidArgument;
inline constexpr ErrorCode kUnsupported = ErrorCode::Unsupported;
inline const Device kCuda0{DeviceType::CUDA, 0};
inline const Device kCuda1{DeviceType::CUDA, 1};

inline const char* code_name(ErrorCode code) {
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
inline TensorView reshaped(const TensorView& t, std::initializer_list<int64_t> sizes) {
  return TensorView::contiguous(t.data, t.dtype, sizes, t.device);
}

inline TensorView restrided(const TensorView& t, std::initializer_list<int64_t> sizes,
                            std::initializer_list<int64_t> strides) {
  return TensorView::strided(t.data, t.dtype, sizes, strides, t.device);
}

// `t` moved to `data` (same shape), element offset `offset` into a buffer.
inline TensorView moved_to(TensorView t, Buffer& buffer, int64_t offset = 0) {
  t.data = buffer.bytes.data() + offset * static_cast<int64_t>(dtype_size(buffer.dtype));
  return t;
}

inline void fill_sentinel(Buffer& b) { std::memset(b.data(), kSentinel, b.bytes.size()); }

inline void write_int32(Buffer& b, const std::vector<int32_t>& values) {
  ASSERT_LE(static_cast<int64_t>(values.size()), b.count());
  std::memcpy(b.data(), values.data(), values.size() * sizeof(int32_t));
}

// How every call's buffers start: inputs random, ALiBi slopes 0.25 (read only where a case
// sets options.alibi_slopes), outputs the sentinel, so that any write shows.
inline void start_buffers(std::initializer_list<Buffer*> inputs, Buffer& alibi,
                          std::initializer_list<Buffer*> outputs) {
  for (Buffer* b : inputs) b->fill_random();
  for (int64_t i = 0; i < alibi.count(); ++i) alibi.set(i, 0.25f);
  for (Buffer* b : outputs) fill_sentinel(*b);
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
    start_buffers({&q_buf, &k_buf, &v_buf}, alibi_buf, {&out_buf, &lse_buf});
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
    start_buffers({&q_buf, &k_buf, &v_buf}, alibi_buf, {&out_buf, &lse_buf});
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

// A valid paged varlen call: VarlenCall's sequences with k/v paged, 6 pages of 2 rows
// ((num_pages, page_size, Hk, D) = (6, 2, 2, 16)) and block_table ((5, 0, 99), (2, 4, 1)):
// sequence 0's 4 keys in pages 5 and 0 (its slot 2 holds none, so 99 is never read),
// sequence 1's 5 in pages 2, 4 and 1.
struct PagedVarlenCall : VarlenCall {
  static constexpr int64_t kPages = 6, kPageSize = 2, kMaxPages = 3;
  Buffer table_buf{DType::Int32, 16};

  PagedVarlenCall() {
    k = k_buf.view({kPages, kPageSize, Hk, D});
    v = v_buf.view({kPages, kPageSize, Hk, D});
    set_table({5, 0, 99, 2, 4, 1}, kMaxPages);
  }
  void set_table(const std::vector<int32_t>& values, int64_t max_pages) {
    write_int32(table_buf, values);
    varlen.block_table = TensorView::contiguous(
        table_buf.data(), DType::Int32, {static_cast<int64_t>(values.size()) / max_pages, max_pages});
  }

  std::vector<NamedBuffer> buffers() {
    std::vector<NamedBuffer> all = VarlenCall::buffers();
    all.push_back({"block_table", &table_buf});
    return all;
  }
  void all_on(Device device) {
    VarlenCall::all_on(device);
    varlen.block_table->device = device;
  }
  const char* describe() const {
    return "paged varlen B=2 q lengths (3,4) k lengths (4,5) in 6 pages of 2, block_table "
           "((5,0,99),(2,4,1)), H=6 Hk=2 D=16 fp32";
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

inline std::string quoted(const std::string& s) { return "\"" + s + "\""; }

// Checks one caught Error against what the case asks for.
inline void expect_error(const Error& e, ErrorCode code, const std::string& argument,
                         const std::vector<std::string>& expected,
                         const std::vector<std::string>& given, const std::string& given_exact) {
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

// One row's test: a fresh valid Call with the row's mutation, which must throw the row's Error
// and leave every buffer as it was.
template <typename Call>
void expect_rejected(const ErrorCase<Call>& c) {
  SCOPED_TRACE("case " + c.name);
  Call call;
  SCOPED_TRACE(call.describe());
  c.mutate(call);
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

// A call that must be accepted: its RunInfo, or a test failure naming the Error.
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
inline bool sentinel_intact(const Buffer& b, size_t begin_byte, size_t end_byte) {
  for (size_t i = begin_byte; i < end_byte; ++i)
    if (b.bytes[i] != kSentinel) return false;
  return true;
}

}  // namespace flashattn::testing

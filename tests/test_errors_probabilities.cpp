// Argument validation of flashattn::attention_probabilities and its varlen form
// (src/api/validate.cpp, validate_probabilities): the rows probs adds to the forward's rules and
// the forward's rules it shares (error_cases.hpp says what each row checks), accepted calls
// that write every element of probs and nothing between its rows, and the C ABI.
#include <cstring>
#include <string>
#include <vector>

#include "error_cases.hpp"
#include "flashattn/flashattn.h"

namespace flashattn::testing {
namespace {

// DenseCall / VarlenCall's q, k and options with a probs output instead of v, out and lse.
struct DenseProbabilitiesCall : DenseCall {
  Buffer probs_buf{DType::Float32, kBufferElements};
  TensorView probs;
  DenseProbabilitiesCall() {
    fill_sentinel(probs_buf);
    probs = probs_buf.view({B, H, Sq, Sk});
  }
  RunInfo run() const { return attention_probabilities(q, k, probs, options, execution); }
  std::vector<NamedBuffer> buffers() {
    std::vector<NamedBuffer> b = DenseCall::buffers();
    b.push_back({"probs", &probs_buf});
    return b;
  }
};

struct VarlenProbabilitiesCall : VarlenCall {
  static constexpr int64_t max_q = 4, max_k = 5;
  Buffer probs_buf{DType::Float32, kBufferElements};
  TensorView probs;
  VarlenProbabilitiesCall() {
    fill_sentinel(probs_buf);
    probs = probs_buf.view({B, H, max_q, max_k});
  }
  RunInfo run() const {
    return attention_probabilities_varlen(q, k, probs, varlen, options, execution);
  }
  std::vector<NamedBuffer> buffers() {
    std::vector<NamedBuffer> b = VarlenCall::buffers();
    b.push_back({"probs", &probs_buf});
    return b;
  }
};

using Dense = DenseProbabilitiesCall;
using Var = VarlenProbabilitiesCall;
constexpr int64_t B = Dense::B, Sq = Dense::Sq, Sk = Dense::Sk, H = Dense::H, Hk = Dense::Hk,
                  D = Dense::D;

std::vector<ErrorCase<Dense>> dense_cases() {
  return {
      {"probs_rank3", [](Dense& c) { c.probs = reshaped(c.probs, {B * H, Sq, Sk}); }, kInvalid,
       "probs", {"4 dimensions"}, {"3 dimensions"}},
      {"probs_fp16", [](Dense& c) { c.probs.dtype = DType::Float16; }, kInvalid, "probs",
       {"dtype fp32"}, {"dtype fp16"}},
      {"probs_Sq_Sk_swapped", [](Dense& c) { c.probs = reshaped(c.probs, {B, H, Sk, Sq}); },
       kInvalid, "probs", {"(2, 6, 3, 5)", "(B, H, Sq, Sk)"}, {"(2, 6, 5, 3)"}},
      {"probs_heads_Hk", [](Dense& c) { c.probs = reshaped(c.probs, {B, Hk, Sq, Sk}); },
       kInvalid, "probs", {"(2, 6, 3, 5)"}, {"(2, 2, 3, 5)"}},
      {"probs_rows_share_memory",
       [](Dense& c) { c.probs = restrided(c.probs, {B, H, Sq, Sk}, {H * Sq * Sk, Sq * Sk, 0, 1}); },
       kInvalid, "probs", {"no two elements share memory"}, {"(90, 15, 0, 1)"}},
      {"probs_strided_last",
       [](Dense& c) {
         c.probs = restrided(c.probs, {B, H, Sq, Sk}, {2 * H * Sq * Sk, 2 * Sq * Sk, 2 * Sk, 2});
       },
       kInvalid, "probs", {"contiguous last dimension"}, {"strides"}},
      {"probs_is_q", [](Dense& c) { c.probs = moved_to(c.probs, c.q_buf); }, kInvalid, "probs",
       {"memory disjoint from q"}, {"overlapping q"}},
      {"probs_overlaps_k", [](Dense& c) { c.probs = moved_to(c.probs, c.k_buf, 7); }, kInvalid,
       "probs", {"memory disjoint from k"}, {"overlapping k"}},
      {"probs_overlaps_alibi",
       [](Dense& c) {
         c.options.alibi_slopes = c.alibi_buf.view({H});
         c.probs = moved_to(c.probs, c.alibi_buf);
       },
       kInvalid, "probs", {"memory disjoint from alibi_slopes"}, {"overlapping alibi_slopes"}},
      {"probs_on_another_device", [](Dense& c) { c.probs.device = kCuda0; }, kInvalid, "probs",
       {"the device of q (cpu)"}, {"cuda:0"}},
      {"probs_null", [](Dense& c) { c.probs.data = nullptr; }, kInvalid, "probs",
       {"non-null"}, {"null"}},
      {"k_fp16", [](Dense& c) { c.k.dtype = DType::Float16; }, kInvalid, "k", {"dtype fp32"},
       {"dtype fp16"}},
      {"q_int32", [](Dense& c) { c.q.dtype = DType::Int32; }, kInvalid, "q", {"fp32, fp16"},
       {"int32"}},
      {"k_batch_3", [](Dense& c) { c.k = reshaped(c.k, {3, Sk, Hk, D}); }, kInvalid, "k",
       {"batch size B = 2"}, {"(3, 5, 2, 16)"}},
      {"H6_not_a_multiple_of_Hk4", [](Dense& c) { c.k = reshaped(c.k, {B, Sk, 4, D}); },
       kInvalid, "k", {"H = 6"}, {}, "Hk = 4"},
      // Past the largest head dim (any D in [1, 256] is valid); refused before any memory
      // of the larger shape is touched.
      {"head_dim_257",
       [](Dense& c) {
         c.q = reshaped(c.q, {B, Sq, H, 257});
         c.k = reshaped(c.k, {B, Sk, Hk, 257});
       },
       kInvalid, "q", {"[1, 256]"}, {"D = 257"}},
      {"k_head_dim_24", [](Dense& c) { c.k = reshaped(c.k, {B, Sk, Hk, 24}); }, kInvalid, "k",
       {"D = 16"}, {"(2, 5, 2, 24)"}},
      {"alibi_H3", [](Dense& c) { c.options.alibi_slopes = c.alibi_buf.view({3}); }, kInvalid,
       "alibi_slopes", {"(6)"}, {"(3)"}},
      {"dropout_1", [](Dense& c) { c.options.dropout_p = 1.0f; }, kInvalid, "dropout_p",
       {"[0, 1)"}, {"1"}},
      {"softcap_negative", [](Dense& c) { c.options.softcap = -1.0f; }, kInvalid, "softcap",
       {">= 0"}, {"-1"}},
      {"window_left_minus_2", [](Dense& c) { c.options.window_left = -2; }, kInvalid,
       "window_left", {"-1"}, {"-2"}},
      {"num_threads_negative", [](Dense& c) { c.execution.num_threads = -1; }, kInvalid,
       "num_threads", {"0"}, {"-1"}},
  };
}

std::vector<ErrorCase<Var>> varlen_cases() {
  return {
      {"probs_total_q_rows",
       [](Var& c) { c.probs = reshaped(c.probs, {Var::B, Var::H, Var::total_q, Var::max_k}); },
       kInvalid, "probs", {"(2, 6, 4, 5)", "(B, H, max_seqlen_q, max_seqlen_k)"},
       {"(2, 6, 7, 5)"}},
      {"probs_varlen_rank3",
       [](Var& c) { c.probs = reshaped(c.probs, {Var::H, Var::total_q, Var::max_k}); },
       kInvalid, "probs", {"4 dimensions"}, {"3 dimensions"}},
      {"q_rank4", [](Var& c) { c.q = reshaped(c.q, {1, Var::total_q, Var::H, Var::D}); },
       kInvalid, "q", {"3 dimensions"}, {"4 dimensions"}},
      {"cu_seqlens_q_from_1", [](Var& c) { c.set_cu_q({1, 3, 7}); }, kInvalid, "cu_seqlens_q",
       {"== 0"}, {"= 1"}},
      {"cu_seqlens_k_batch_3", [](Var& c) { c.set_cu_k({0, 4, 9, 9}); }, kInvalid,
       "cu_seqlens_k", {"(3)"}, {"(4)"}},
      {"max_seqlen_q_below_a_length", [](Var& c) { c.varlen.max_seqlen_q = 3; }, kInvalid,
       "max_seqlen_q", {"every sequence length"}, {"3"}},
      {"seqused_k_past_its_sequence", [](Var& c) { c.set_seqused_k({5, 5}); }, kInvalid,
       "seqused_k", {"(4 for b = 0)"}, {"5"}},
      {"probs_overlaps_cu_seqlens_k",
       [](Var& c) { c.probs = moved_to(c.probs, c.cu_k_buf); }, kInvalid, "probs",
       {"memory disjoint from cu_seqlens_k"}, {"overlapping cu_seqlens_k"}},
  };
}

class DenseProbabilitiesErrors : public ::testing::TestWithParam<ErrorCase<Dense>> {};
TEST_P(DenseProbabilitiesErrors, RejectedBeforeAnythingIsWritten) { expect_rejected(GetParam()); }
INSTANTIATE_TEST_SUITE_P(Cases, DenseProbabilitiesErrors, ::testing::ValuesIn(dense_cases()),
                         case_name<Dense>);

class VarlenProbabilitiesErrors : public ::testing::TestWithParam<ErrorCase<Var>> {};
TEST_P(VarlenProbabilitiesErrors, RejectedBeforeAnythingIsWritten) {
  expect_rejected(GetParam());
}
INSTANTIATE_TEST_SUITE_P(Cases, VarlenProbabilitiesErrors, ::testing::ValuesIn(varlen_cases()),
                         case_name<Var>);

// Accepted calls write every element of probs (no sentinel byte survives), and nothing in the
// gaps of a strided view (rows padded by 3 floats, heads by 7 more).
TEST(AcceptedProbabilities, EveryElementWrittenAndNoGapTouched) {
  Dense dense;
  dense.options.dropout_p = 0.3f;
  run_ok(dense);
  for (int64_t n = 0; n < B * H * Sq * Sk; ++n)
    EXPECT_FALSE(sentinel_intact(dense.probs_buf, size_t(n) * 4, size_t(n + 1) * 4)) << n;

  Var var;
  var.options.causal = true;
  constexpr int64_t row = Var::max_k + 3, head = Var::max_q * row + 7;
  var.probs = restrided(var.probs, {Var::B, Var::H, Var::max_q, Var::max_k},
                        {Var::H * head, head, row, 1});
  run_ok(var);
  for (int64_t n = 0; n < Var::B * Var::H * head; ++n) {
    const bool inside = n % head < Var::max_q * row && n % head % row < Var::max_k;
    EXPECT_EQ(sentinel_intact(var.probs_buf, size_t(n) * 4, size_t(n + 1) * 4), !inside) << n;
  }
  // The padding rows of sequence 0 (3 of max_seqlen_q = 4 rows) are 0, like its padding keys.
  const float* p = reinterpret_cast<const float*>(var.probs_buf.bytes.data());
  for (int64_t j = 0; j < Var::max_k; ++j) EXPECT_EQ(p[3 * row + j], 0.0f) << j;
  EXPECT_EQ(p[4], 0.0f);  // sequence 0 has 4 keys: column 4 lies past it
}

// The C ABI: a rejected call's status and message, and an accepted one's result equal to the
// C++ API's, bit for bit.
TEST(ProbabilitiesCApi, StatusMessageAndResult) {
  Var call;
  call.options.dropout_p = 0.4f;
  call.options.dropout_seed = 99;
  call.options.window_left = 2;
  run_ok(call);
  const std::vector<unsigned char> expected = call.probs_buf.bytes;
  fill_sentinel(call.probs_buf);

  const auto tensor = [](const TensorView& t) {
    fa_tensor f{};
    f.data = t.data;
    f.dtype = static_cast<int32_t>(t.dtype);
    f.device_type = static_cast<int32_t>(t.device.type);
    f.ndim = t.ndim;
    for (int d = 0; d < t.ndim; ++d) {
      f.sizes[d] = t.sizes[size_t(d)];
      f.strides[d] = t.strides[size_t(d)];
    }
    return f;
  };
  const fa_tensor q = tensor(call.q), k = tensor(call.k), probs = tensor(call.probs),
                  cu_q = tensor(call.varlen.cu_seqlens_q), cu_k = tensor(call.varlen.cu_seqlens_k);
  fa_options o;
  fa_options_init(&o);
  o.dropout_p = 0.4f;
  o.dropout_seed = 99;
  o.window_left = 2;
  ASSERT_EQ(fa_attention_probabilities_varlen(&q, &k, &probs, &cu_q, &cu_k, Var::max_q,
                                              Var::max_k, nullptr, &o, nullptr, nullptr),
            FA_OK)
      << fa_last_error();
  EXPECT_TRUE(call.probs_buf.bytes == expected);

  fa_tensor wrong = probs;
  wrong.dtype = FA_FLOAT16;
  EXPECT_EQ(fa_attention_probabilities_varlen(&q, &k, &wrong, &cu_q, &cu_k, Var::max_q,
                                              Var::max_k, nullptr, &o, nullptr, nullptr),
            FA_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(fa_last_error()).rfind("probs: expected dtype fp32", 0), 0u)
      << fa_last_error();
  const fa_tensor dense_probs = tensor(call.probs);
  EXPECT_EQ(fa_attention_probabilities(&q, &k, &dense_probs, &o, nullptr, nullptr),
            FA_ERROR_INVALID_ARGUMENT);  // varlen views in a dense call: q has 3 dimensions
  EXPECT_EQ(std::string(fa_last_error()).rfind("q: expected 4 dimensions", 0), 0u)
      << fa_last_error();
}

}  // namespace
}  // namespace flashattn::testing

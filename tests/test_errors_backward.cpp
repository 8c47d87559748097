// Argument validation of flashattn::backward and backward_varlen (src/api/validate.cpp): the
// forward's checks apply to the backward's shared arguments (tested in test_errors_forward.cpp);
// these rows cover what the backward adds: dout, lse as an input, dq, dk, dv and their
// overlaps (error_cases.hpp says what each row checks).
#include <cmath>
#include <cstdint>
#include <vector>

#include "error_cases.hpp"

namespace flashattn::testing {
namespace {

constexpr int64_t B = DenseCall::B, Sq = DenseCall::Sq, Sk = DenseCall::Sk, H = DenseCall::H,
                  Hk = DenseCall::Hk, D = DenseCall::D;

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

TEST_P(BackwardErrors, RejectedWithoutWriting) { expect_rejected(GetParam()); }

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

}  // namespace
}  // namespace flashattn::testing

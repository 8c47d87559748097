// A backend's backward against the float64 reference backward (docs/SPEC.md's 3x rule for
// gradients), over the forward suite's grid kinds: masks x softcap x ALiBi x dtype on odd
// geometries, dropout, head dims (multiples of 8 and not), Sq != Sk both ways, Sk = 0, fully
// masked rows, GQA 1/2/8, ragged batches with empty sequences; plus (CPU) determinism across
// runs and thread counts.
// Compiled once per backend: test_backward_cpu, and test_backward_cuda (FLASHATTN_TEST_CUDA,
// label gpu), where the inputs' forward still runs on the CPU engine (reference-checked) and
// its out and lse are mirrored to the GPU with every other tensor (backward_on_backend); the
// CUDA backend takes fp16/bf16 only, so fp32 cases run in fp16 there (backend_dtype), and
// every other case alternates between the default and the deterministic mode.
#include <cmath>
#include <limits>

#include "sweep.hpp"

namespace flashattn::testing {
namespace {

// Odd lengths (1, 97, 113), Sq > Sk and Sq < Sk, GQA 1/2/8, head dims off powers of two;
// smaller than the forward's so that the float64 backward keeps the suite fast.
constexpr Geometry kGeometries[] = {
    {2, 97, 113, 4, 2, 40}, {1, 113, 97, 8, 1, 64}, {3, 1, 97, 2, 2, 24},
    {2, 97, 1, 8, 8, 8},    {1, 130, 64, 6, 3, 96}, {1, 64, 150, 4, 2, 136},
    {1, 70, 70, 2, 2, 256}, {1, 65, 63, 8, 1, 200}, {2, 129, 129, 3, 3, 48},
};

// One backward call with fresh inputs: forward on the CPU engine (checked against the
// reference, dropout included), then backward on the suite's backend with poisoned gradients,
// each checked by the 3x rule.
void run_backward_case(Case c, float dropout_p, bool deterministic = false, Execution exec = {}) {
  c.dtype = backend_dtype(c.dtype);
  SCOPED_TRACE(c.describe() + " dropout=" + std::to_string(dropout_p) +
               (deterministic ? " deterministic" : ""));
  Inputs in = make_inputs(c);
  Buffer slopes;
  Options o = options_of(c, slopes);
  o.dropout_p = dropout_p;
  o.deterministic = deterministic;
  o.dropout_seed = rng()();
  o.dropout_offset = rng()() >> 20;
  const int64_t B = c.batch, Sq = c.seqlen_q, Sk = c.seqlen_k, H = c.heads, Hk = c.heads_k,
                D = c.head_dim;
  Buffer out(c.dtype, B * Sq * H * D), lse(DType::Float32, B * H * Sq), dout(c.dtype, B * Sq * H * D);
  Buffer dq(c.dtype, B * Sq * H * D), dk(c.dtype, B * Sk * Hk * D), dv(c.dtype, B * Sk * Hk * D);
  out.poison();
  lse.poison();
  dout.fill_random();
  dq.poison();
  dk.poison();
  dv.poison();
  const TensorView out_v = out.view({B, Sq, H, D}), lse_v = lse.view({B, H, Sq}),
                   dout_v = dout.view({B, Sq, H, D}), dq_v = dq.view({B, Sq, H, D}),
                   dk_v = dk.view({B, Sk, Hk, D}), dv_v = dv.view({B, Sk, Hk, D});
  Execution cpu = exec;
  cpu.backend = Backend::CPU;
  forward(in.q, in.k, in.v, out_v, lse_v, o, cpu);
  expect_matches_reference(in.q, in.k, in.v, o, nullptr, out_v, &lse_v, "forward");
  const RunInfo info =
      backward_on_backend(in.q, in.k, in.v, out_v, dout_v, lse_v, dq_v, dk_v, dv_v, o, nullptr, exec);
  EXPECT_EQ(info.backend, kTestBackend);
  EXPECT_EQ(info.deterministic, kTestBackend == Backend::CPU || deterministic);

  using reference::Arithmetic;
  const reference::Gradients exact = reference::backward(in.q, in.k, in.v, dout_v, o);
  reference::Gradients low;
  if (c.dtype != DType::Float32)
    low = reference::backward(in.q, in.k, in.v, dout_v, o, nullptr, Arithmetic::InputDType);
  using reference::Gradient;
  const struct {
    const char* name;
    Gradient which;
    const TensorView& actual;
    const std::vector<double>& exact;
    const std::vector<double>& low;
  } grads[] = {{"dq", Gradient::dQ, dq_v, exact.dq, low.dq},
               {"dk", Gradient::dK, dk_v, exact.dk, low.dk},
               {"dv", Gradient::dV, dv_v, exact.dv, low.dv}};
  for (const auto& g : grads) {
    const reference::Check check =
        reference::check_backward(c.dtype, reference::gather(g.actual), g.exact, g.low,
                                  reference::largest_magnitude(exact),
                                  reference::floor_scale(g.which, o, D));
    EXPECT_TRUE(check.passed()) << g.name << ": max abs error " << check.max_abs_error
                                << " > tolerance " << check.tolerance;
  }
}

class BackwardGrid : public ::testing::TestWithParam<int> {};

// Every combination of mask x softcap x ALiBi x dtype, each on a different geometry and
// layout; every fourth one with dropout, every other one in deterministic mode.
TEST_P(BackwardGrid, MatchesReference) {
  const int n = GetParam();
  run_backward_case(grid_case(n, kGeometries), n % 4 == 1 ? 0.17f : 0.0f, n % 2 == 0);
}

INSTANTIATE_TEST_SUITE_P(AllCombinations, BackwardGrid,
                         ::testing::Range(0, int(feature_grid().size())),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return grid_name(info.param) + (info.param % 4 == 1 ? "_dropout" : "");
                         });

class BackwardHeadDims : public ::testing::TestWithParam<int> {};

TEST_P(BackwardHeadDims, MatchesReference) {
  const int d = GetParam();
  Case c{.seqlen_q = 67, .seqlen_k = 93, .heads = 4, .heads_k = 2, .head_dim = d,
         .dtype = kDtypes[size_t(d / 8) % 3], .causal = (d / 8) % 2 == 0};
  run_backward_case(c, (d / 8) % 3 == 1 ? 0.3f : 0.0f, (d / 8) % 4 >= 2);
}

INSTANTIATE_TEST_SUITE_P(Some, BackwardHeadDims,
                         ::testing::Values(8, 16, 24, 56, 72, 88, 120, 128, 152, 184, 232, 256));

// Head dims that are not multiples of 8 (on CUDA: zero-padded copies of q, k, v, out and
// dout in, of dq, dk and dv back, cuda/head_dim_padding.hpp): every dtype and memory layout,
// masks, GQA, softcap, ALiBi, dropout and both modes; the plain calls among them take the
// Hopper kernels of the padded head dim's bucket.
class BackwardOddHeadDims : public ::testing::TestWithParam<int> {};

TEST_P(BackwardOddHeadDims, MatchesReference) {
  const int d = GetParam();
  int n = 0;
  for (DType dt : kDtypes)
    for (Layout layout : {Layout::Contiguous, Layout::HeadMajor, Layout::Padded, Layout::Packed}) {
      const bool packed = layout == Layout::Packed;
      Case c{.batch = 1 + n % 2, .seqlen_q = packed ? 70 : 67, .seqlen_k = packed ? 70 : 93,
             .heads = 4, .heads_k = packed ? 4 : 2 - n % 2, .head_dim = d, .dtype = dt,
             .causal = n % 2 == 0, .window_left = n % 6 == 4 ? 19 : -1,
             .softcap = n % 3 == 1 ? 2.5f : 0.0f,
             .alibi = n % 4 == 3 ? Case::Alibi::PerHead : Case::Alibi::Off, .layout = layout};
      run_backward_case(c, n % 5 == 2 ? 0.2f : 0.0f, n % 4 == 1);
      ++n;
    }
}

INSTANTIATE_TEST_SUITE_P(NotMultiplesOf8, BackwardOddHeadDims,
                         ::testing::Values(1, 5, 59, 111, 250));

// Plain calls (no softcap, ALiBi or dropout; the default mode) at head dims in each bucket
// that the Hopper backward kernels take (64, 128 and 256, padded or whole), every mask, both
// 16-bit dtypes (fp32 on the CPU stands in for one), GQA 2 and 4, several key and query
// blocks, and the memory layouts: on an H100/H200 these are the sm90 kernels' calls.
class BackwardPlainCalls : public ::testing::TestWithParam<int> {};

TEST_P(BackwardPlainCalls, MatchesReference) {
  const int d = GetParam();
  const Layout layouts[] = {Layout::Contiguous, Layout::HeadMajor, Layout::Padded};
  int n = 0;
  for (const Mask& m : kMasks)
    for (DType dt : {DType::Float16, DType::BFloat16}) {
      Case c{.batch = 1 + n % 2, .seqlen_q = 150 + n % 3, .seqlen_k = 201 - 2 * (n % 4), .heads = 4,
             .heads_k = n % 3 == 0 ? 1 : 2, .head_dim = d, .dtype = dt, .causal = m.causal,
             .window_left = m.left, .window_right = m.right, .layout = layouts[n % 3]};
      run_backward_case(c, 0.0f);
      ++n;
    }
}

INSTANTIATE_TEST_SUITE_P(HopperBuckets, BackwardPlainCalls, ::testing::Values(40, 64, 104, 128, 232, 256));

// Softcap, ALiBi and dropout (alone and together) in the default mode at head dims in the
// buckets the Hopper TMA backward takes (64 and 128, padded or whole), every mask, both 16-bit
// dtypes, GQA, several key and query blocks, negative and positive slopes: on an H100/H200
// these are its general variant's calls.
class BackwardHopperGeneralCalls : public ::testing::TestWithParam<int> {};

TEST_P(BackwardHopperGeneralCalls, MatchesReference) {
  const int d = GetParam();
  const Layout layouts[] = {Layout::Contiguous, Layout::HeadMajor, Layout::Padded};
  int n = 0;
  for (const Mask& m : kMasks)
    for (DType dt : {DType::Float16, DType::BFloat16}) {
      const int features = n % 4;  // 0: softcap, 1: ALiBi, 2: both, 3: neither (dropout alone)
      Case c{.batch = 1 + n % 2, .seqlen_q = 150 + n % 3, .seqlen_k = 201 - 2 * (n % 4), .heads = 4,
             .heads_k = n % 3 == 0 ? 1 : 2, .head_dim = d, .dtype = dt, .causal = m.causal,
             .window_left = m.left, .window_right = m.right,
             .softcap = features == 0 || features == 2 ? 3.5f : 0.0f,
             .alibi = features == 1 || features == 2 ? Case::Alibi::PerHead : Case::Alibi::Off,
             .alibi_scale = n % 5 == 1 ? -1.0f : 1.0f, .layout = layouts[n % 3]};
      run_backward_case(c, features == 3 || n % 5 == 2 ? 0.17f : 0.0f);
      ++n;
    }
}

INSTANTIATE_TEST_SUITE_P(HopperBuckets, BackwardHopperGeneralCalls, ::testing::Values(40, 64, 104, 128));

TEST(BackwardLong, CausalBf16AcrossTiles) {
  Case c{.seqlen_q = 300, .seqlen_k = 333, .heads = 2, .heads_k = 1, .head_dim = 64,
         .dtype = DType::BFloat16, .causal = true};
  run_backward_case(c, 0.1f);
  run_backward_case(c, 0.1f, true);
  c.dtype = DType::Float32;
  c.window_left = 50;
  run_backward_case(c, 0.0f);
}

// As many key blocks (128 keys at head dim 128 on CUDA) as key/value heads, and as many
// query blocks (64 rows) as query heads, 3 each: the CUDA grids then have the same shape
// whichever layout the launch asked for, and the kernels must still cover every (head, block)
// once (cuda/common/tile_order.cuh). Masked and not, both modes.
TEST(BackwardEdgeCases, AsManyBlocksAsHeads) {
  for (const bool causal : {false, true}) {
    Case c{.seqlen_q = 3 * 64 - 5, .seqlen_k = 3 * 128 - 5, .heads = 3, .heads_k = 3,
           .head_dim = 128, .dtype = DType::BFloat16, .causal = causal};
    run_backward_case(c, 0.0f, false);
    run_backward_case(c, 0.0f, true);
  }
}

TEST(BackwardEdgeCases, NoKeysGiveZeroQueryGradients) {
  for (DType dt : kDtypes) {
    Case c{.batch = 2, .seqlen_q = 5, .seqlen_k = 0, .heads = 4, .heads_k = 2, .head_dim = 16,
           .dtype = dt};
    run_backward_case(c, 0.0f);  // the reference's dq is all 0, so poisoned rows would fail
    run_backward_case(c, 0.0f, true);
  }
}

TEST(BackwardEdgeCases, FullyMaskedRowsAndUnseenKeysGiveZeroGradients) {
  // Sq = 5, Sk = 2, causal: rows 0..2 see no key. Sq = 2, Sk = 9, window (0, 0): keys 0..6
  // are seen by no row.
  for (auto [sq, sk, left] : {std::tuple{5, 2, -1}, std::tuple{2, 9, 0}}) {
    Case c{.seqlen_q = sq, .seqlen_k = sk, .heads = 2, .head_dim = 8, .causal = true,
           .window_left = left};
    run_backward_case(c, 0.0f);
    run_backward_case(c, 0.5f, true);
  }
}

TEST(BackwardEdgeCases, EmptyQueryGivesZeroKeyGradients) {
  Case c{.seqlen_q = 0, .seqlen_k = 9};
  run_backward_case(c, 0.0f);
  run_backward_case(c, 0.0f, true);
  c.batch = 0;
  run_backward_case(c, 0.0f);
}

TEST(BackwardEdgeCases, CustomScalesAndLargeSoftcapScores) {
  for (int64_t d : {16, 64})  // 64: the Hopper TMA kernel's general variant
    for (float scale : {0.5f, -0.3f, 0.0f, 3.0f}) {
      Case c{.seqlen_q = 33, .seqlen_k = 71, .heads = 2, .head_dim = d, .dtype = DType::BFloat16,
             .softcap = 1.5f, .softmax_scale = scale};
      run_backward_case(c, 0.0f, scale < 0.0f);
    }
}

// Where dS cancels (one visible key: dS = P (dP - D) with D taken from the rounded out, which
// dropout's 1/(1 - p) = 10 takes far from the exact P V), dq = scale dS K and dk = scale dS^T Q
// carry dS's error times the softmax scale, and the rule's floor grows with it
// (reference::floor_scale). Found by fuzzing: bf16, Sq = Sk = 1, H = 4, Hk = 2, D = 16,
// causal, scale 2.0 (8x the default), softcap 30, dropout 0.9 gave dq an error of 0.213
// against a floor of 0.153 that did not scale. 300 rounds of fresh inputs (most (b, h) drop
// their one key) from a fixed seed, on which the unscaled floor fails 43 checks (38 to 67 with
// the run seeds 1-3) and the scaled one none (nor in 10800 rounds from run seeds 1-40). Fixed,
// because the error's tail is the same multiple of the floor at every scale: at the default
// scale this call failed the floor in 1 of 12000 rounds, so fresh seeds would make the test
// flaky. The generator is restored after. CPU only: measured on the CPU engine.
TEST(BackwardEdgeCases, CancellationFloorGrowsWithTheSoftmaxScale) {
  if (kTestBackend != Backend::CPU) GTEST_SKIP() << "measured on the CPU engine";
  const std::mt19937_64 saved = rng();
  rng().seed(34);
  SCOPED_TRACE("inputs from rng().seed(34), not the run's seed");
  Case c{.heads = 4, .heads_k = 2, .head_dim = 16, .dtype = DType::BFloat16, .causal = true,
         .softcap = 30.0f, .softmax_scale = 2.0f};
  for (int n = 0; n < 300; ++n) run_backward_case(c, 0.9f, n % 2 == 1);
  rng() = saved;
}

// Negative slopes raise the scores of distant keys without bound, and a query count that is
// not a multiple of any tile height leaves rows past the sequence in the last tile: those
// must add nothing (a kernel that let their probabilities overflow would turn dK/dV to NaN).
TEST(BackwardEdgeCases, NegativeAlibiSlopesWithAPartialLastTile) {
  for (DType dt : {DType::Float16, DType::BFloat16}) {
    for (int64_t sk : {100, 130}) {
      Case c{.seqlen_q = 100, .seqlen_k = sk, .heads = 2, .head_dim = 64, .dtype = dt,
             .alibi = Case::Alibi::PerHead, .alibi_scale = -4.0f};
      run_backward_case(c, 0.0f);
      run_backward_case(c, 0.0f, true);
    }
  }
}

// Each gradient element is written by exactly one work item that sums in a fixed order
// (docs/ARCHITECTURE.md), so the result cannot depend on the run or the thread count.
TEST(BackwardDeterminism, RepeatedRunsAndThreadCountsAreBitwiseEqual) {
  if (kTestBackend != Backend::CPU)
    GTEST_SKIP() << "CPU thread counts; the CUDA suite has CudaBackward.DeterministicModeIsBitwiseReproducible";
  Case c{.batch = 2, .seqlen_q = 150, .seqlen_k = 190, .heads = 4, .heads_k = 2, .head_dim = 64,
         .dtype = DType::BFloat16, .causal = true};
  Inputs in = make_inputs(c);
  Options o;
  o.causal = true;
  o.dropout_p = 0.2f;
  o.dropout_seed = 7;
  Buffer out(c.dtype, 2 * 150 * 4 * 64), lse(DType::Float32, 2 * 4 * 150),
      dout(c.dtype, 2 * 150 * 4 * 64);
  dout.fill_random();
  forward(in.q, in.k, in.v, out.view({2, 150, 4, 64}), lse.view({2, 4, 150}), o);
  std::vector<unsigned char> first[3];
  for (int threads : {1, 2, 3, 7, 0, 0}) {
    Buffer dq(c.dtype, 2 * 150 * 4 * 64), dk(c.dtype, 2 * 190 * 2 * 64), dv(c.dtype, 2 * 190 * 2 * 64);
    dq.poison();
    dk.poison();
    dv.poison();
    Execution e;
    e.num_threads = threads;
    o.deterministic = threads % 2 == 1;  // the CPU is deterministic either way
    backward(in.q, in.k, in.v, out.view({2, 150, 4, 64}), dout.view({2, 150, 4, 64}),
             lse.view({2, 4, 150}), dq.view({2, 150, 4, 64}), dk.view({2, 190, 2, 64}),
             dv.view({2, 190, 2, 64}), o, e);
    Buffer* grads[] = {&dq, &dk, &dv};
    for (int g = 0; g < 3; ++g) {
      if (first[g].empty())
        first[g] = grads[g]->bytes;
      else
        EXPECT_EQ(grads[g]->bytes, first[g]) << "gradient " << g << ", " << threads << " threads";
    }
  }
}

// --- Ragged batches -----------------------------------------------------------------------

class BackwardVarlen : public ::testing::TestWithParam<int> {};

// At head dims whose buckets take different kernels (on an H100/H200: the sm80 kernel at 32,
// the TMA kernel at 64 and 128 for every feature, the cp.async sm90 kernel at 256 for the
// plain calls).
TEST_P(BackwardVarlen, EmptySequencesSequsedAndEveryFeature) {
  const std::vector<int32_t> lens_q{0, 37, 1, 64, 100, 5, 0};
  const std::vector<int32_t> lens_k{3, 0, 77, 64, 99, 0, 0};
  const int64_t B = int64_t(lens_q.size()), H = 4, D = GetParam();
  std::vector<int32_t> cu_q{0}, cu_k{0};
  for (int32_t n : lens_q) cu_q.push_back(cu_q.back() + n);
  for (int32_t n : lens_k) cu_k.push_back(cu_k.back() + n);
  const int64_t total_q = cu_q.back(), total_k = cu_k.back();
  int n = 0;
  for (DType dt : kDtypes)
    for (const Mask& m : kMasks) {
      const int64_t Hk = n % 2 ? 1 : 4;
      SCOPED_TRACE(std::string("varlen ") + dtype_name(dt) + " mask=" + m.name + " case " +
                   std::to_string(n) + " seed=" + std::to_string(test_seed()) +
                   (n % 4 == 3 ? " deterministic" : ""));
      Buffer q(dt, total_q * H * D), k(dt, total_k * Hk * D), v(dt, total_k * Hk * D);
      q.fill_random();
      k.fill_random();
      v.fill_random();
      Buffer out(dt, total_q * H * D), lse(DType::Float32, H * total_q), dout(dt, total_q * H * D);
      Buffer dq(dt, total_q * H * D), dk(dt, total_k * Hk * D), dv(dt, total_k * Hk * D);
      dout.fill_random();
      dq.poison();
      dk.poison();
      dv.poison();
      Buffer cuq = int32_buffer(cu_q), cuk = int32_buffer(cu_k);
      std::vector<int32_t> used;
      for (int32_t len : lens_k) used.push_back(std::uniform_int_distribution<int32_t>(0, len)(rng()));
      Buffer used_buf = int32_buffer(used);
      Varlen varlen;
      varlen.cu_seqlens_q = cuq.view({B + 1});
      varlen.cu_seqlens_k = cuk.view({B + 1});
      varlen.max_seqlen_q = 100 + (n % 4 == 0 ? 17 : 0);
      varlen.max_seqlen_k = 99 + (n % 4 == 0 ? 17 : 0);
      if (n % 2 == 1) {
        varlen.seqused_k = used_buf.view({B});
        // The keys seqused_k leaves out hold NaN: nothing may read them (a kernel whose tiles
        // reach past a sequence must zero or mask those rows, as 0 x NaN is NaN).
        for (int64_t b = 0; b < B; ++b)
          for (int64_t row = cu_k[b] + used[b]; row < cu_k[b + 1]; ++row)
            for (int64_t i = row * Hk * D; i < (row + 1) * Hk * D; ++i) {
              k.set(i, std::nanf(""));
              v.set(i, std::nanf(""));
            }
      }
      Case shape;
      shape.batch = B;
      shape.heads = H;
      shape.causal = m.causal;
      shape.window_left = m.left;
      shape.window_right = m.right;
      shape.softcap = n % 3 == 1 ? 2.5f : 0.0f;
      shape.alibi = static_cast<Case::Alibi>(n % 3);
      Buffer slopes;
      Options o = options_of(shape, slopes);
      o.dropout_p = n % 3 == 2 ? 0.25f : 0.0f;
      o.dropout_seed = 99 + n;
      o.deterministic = n % 4 == 3;
      const TensorView qv = q.view({total_q, H, D}), kv = k.view({total_k, Hk, D}),
                       vv = v.view({total_k, Hk, D}), ov = out.view({total_q, H, D}),
                       lv = lse.view({H, total_q}), dov = dout.view({total_q, H, D}),
                       dqv = dq.view({total_q, H, D}), dkv = dk.view({total_k, Hk, D}),
                       dvv = dv.view({total_k, Hk, D});
      Execution cpu;
      cpu.backend = Backend::CPU;
      forward_varlen(qv, kv, vv, ov, lv, varlen, o, cpu);
      expect_matches_reference(qv, kv, vv, o, &varlen, ov, &lv, "varlen forward");
      backward_on_backend(qv, kv, vv, ov, dov, lv, dqv, dkv, dvv, o, &varlen);
      const reference::Gradients exact = reference::backward(qv, kv, vv, dov, o, &varlen);
      reference::Gradients low;
      if (dt != DType::Float32)
        low = reference::backward(qv, kv, vv, dov, o, &varlen, reference::Arithmetic::InputDType);
      const double largest = reference::largest_magnitude(exact);
      using reference::Gradient;
      const reference::Check cq =
          reference::check_backward(dt, reference::gather(dqv), exact.dq, low.dq, largest,
                                    reference::floor_scale(Gradient::dQ, o, D));
      const reference::Check ck =
          reference::check_backward(dt, reference::gather(dkv), exact.dk, low.dk, largest,
                                    reference::floor_scale(Gradient::dK, o, D));
      const reference::Check cv =
          reference::check_backward(dt, reference::gather(dvv), exact.dv, low.dv, largest);
      EXPECT_TRUE(cq.passed()) << "dq " << cq.max_abs_error << " > " << cq.tolerance;
      EXPECT_TRUE(ck.passed()) << "dk " << ck.max_abs_error << " > " << ck.tolerance;
      EXPECT_TRUE(cv.passed()) << "dv " << cv.max_abs_error << " > " << cv.tolerance;
      ++n;
    }
}

INSTANTIATE_TEST_SUITE_P(HeadDims, BackwardVarlen, ::testing::Values(32, 64, 128, 256));
INSTANTIATE_TEST_SUITE_P(HeadDimsNotMultiplesOf8, BackwardVarlen, ::testing::Values(5, 111, 250));

}  // namespace
}  // namespace flashattn::testing

// The float64 oracle itself, against facts that follow from docs/SPEC.md without running it:
// with q = 0 every visible score is equal (or pure ALiBi), so the output is a known average.
#include <cmath>
#include <stdexcept>
#include <utility>
#include <vector>

#include "support.hpp"

namespace flashattn::testing {
namespace {

struct Dense {
  Buffer q, k, v;
  TensorView qv, kv, vv;
  Dense(int64_t B, int64_t Sq, int64_t Sk, int64_t H, int64_t Hk, int64_t D)
      : q(DType::Float32, B * Sq * H * D), k(DType::Float32, B * Sk * Hk * D),
        v(DType::Float32, B * Sk * Hk * D) {
    k.fill_random();
    v.fill_random();  // q stays zero
    qv = q.view({B, Sq, H, D});
    kv = k.view({B, Sk, Hk, D});
    vv = v.view({B, Sk, Hk, D});
  }
  float v_at(int64_t b, int64_t j, int64_t hk, int64_t d, int64_t Sk, int64_t Hk, int64_t D) {
    return reinterpret_cast<float*>(v.data())[((b * Sk + j) * Hk + hk) * D + d];
  }
};

TEST(Reference, ZeroQueryAveragesTheVisibleValues) {
  const int64_t B = 2, Sq = 5, Sk = 7, H = 4, Hk = 2, D = 8;
  for (auto [causal, left, right] : {std::tuple{false, -1, -1}, std::tuple{true, -1, 0},
                                     std::tuple{true, 2, 0}, std::tuple{false, 1, 3},
                                     std::tuple{false, 0, 0}}) {
    Dense in(B, Sq, Sk, H, Hk, D);
    Options o;
    o.causal = causal;
    o.window_left = left;
    o.window_right = right;
    o.softcap = 3.0f;  // tanh(0) = 0: no effect on equal scores
    const reference::Result r = reference::forward(in.qv, in.kv, in.vv, o);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < Sq; ++i)
        for (int64_t h = 0; h < H; ++h) {
          const int64_t diag = i + Sk - Sq, hk = h / (H / Hk);
          const int64_t lo = left >= 0 ? std::max<int64_t>(0, diag - left) : 0;
          const int64_t hi = (causal || right >= 0) ? std::min<int64_t>(Sk - 1, diag + (causal ? 0 : right)) : Sk - 1;
          const int64_t count = std::max<int64_t>(0, hi - lo + 1);
          const double lse = r.lse[size_t((b * H + h) * Sq + i)];
          if (count == 0) {
            EXPECT_EQ(lse, -INFINITY);
          } else {
            EXPECT_NEAR(lse, std::log(double(count)), 1e-12);
          }
          for (int64_t d = 0; d < D; ++d) {
            double mean = 0;
            for (int64_t j = lo; j <= hi; ++j) mean += in.v_at(b, j, hk, d, Sk, Hk, D);
            if (count) mean /= double(count);
            EXPECT_NEAR(r.out[size_t(((b * Sq + i) * H + h) * D + d)], mean, 1e-12);
          }
        }
  }
}

TEST(Reference, ZeroQueryWithAlibiIsASoftmaxOfDistances) {
  const int64_t Sq = 3, Sk = 6, D = 8;
  Dense in(1, Sq, Sk, 1, 1, D);
  Buffer slopes(DType::Float32, 1);
  slopes.set(0, 0.7f);
  Options o;
  o.alibi_slopes = slopes.view({1});
  const reference::Result r = reference::forward(in.qv, in.kv, in.vv, o);
  for (int64_t i = 0; i < Sq; ++i) {
    std::vector<double> w(Sk);
    double sum = 0;
    for (int64_t j = 0; j < Sk; ++j) sum += w[size_t(j)] = std::exp(-0.7 * std::abs(double(i + Sk - Sq - j)));
    EXPECT_NEAR(r.lse[size_t(i)], std::log(sum), 1e-6);
    for (int64_t d = 0; d < D; ++d) {
      double expected = 0;
      for (int64_t j = 0; j < Sk; ++j) expected += w[size_t(j)] / sum * in.v_at(0, j, 0, d, Sk, 1, D);
      EXPECT_NEAR(r.out[size_t(i * D + d)], expected, 1e-6);  // slope is a float: 1e-6
    }
  }
}

TEST(Reference, OneKeyWithSoftcapAndScale) {
  // Sq = 1, Sk = 2, D = 8: scores s_j = c tanh(scale q.k_j / c), computed here by hand.
  Buffer q(DType::Float32, 8), k(DType::Float32, 16), v(DType::Float32, 16);
  for (int d = 0; d < 8; ++d) {
    q.set(d, 1.0f);
    k.set(d, 0.5f);
    k.set(8 + d, -0.25f);
    v.set(d, float(d));
    v.set(8 + d, 10.0f);
  }
  Options o;
  o.softmax_scale = 0.75f;
  o.softcap = 2.0f;
  const reference::Result r =
      reference::forward(q.view({1, 1, 1, 8}), k.view({1, 2, 1, 8}), v.view({1, 2, 1, 8}), o);
  const double s0 = 2.0 * std::tanh(0.75 * 4.0 / 2.0), s1 = 2.0 * std::tanh(0.75 * -2.0 / 2.0);
  const double p0 = std::exp(s0) / (std::exp(s0) + std::exp(s1));
  for (int d = 0; d < 8; ++d) EXPECT_NEAR(r.out[size_t(d)], p0 * d + (1 - p0) * 10.0, 1e-12);
  EXPECT_NEAR(r.lse[0], std::log(std::exp(s0) + std::exp(s1)), 1e-12);
}

TEST(Reference, LowPrecisionArithmeticIsCloseButNotExact) {
  Case c;
  c.batch = 1; c.seqlen_q = 33; c.seqlen_k = 65; c.heads = 2; c.heads_k = 1; c.head_dim = 64;
  for (DType dt : {DType::Float16, DType::BFloat16}) {
    c.dtype = dt;
    Inputs in = make_inputs(c);
    const auto exact = reference::forward(in.q, in.k, in.v, {});
    const auto low = reference::forward(in.q, in.k, in.v, {}, nullptr,
                                        reference::Arithmetic::InputDType);
    const double err = reference::max_abs_error(low.out, exact.out);
    EXPECT_GT(err, 0.0);
    EXPECT_LT(err, dt == DType::Float16 ? 5e-3 : 5e-2);
  }
}

TEST(Reference, GatherReadsStridedViewsInLogicalOrder) {
  Buffer b(DType::Float32, 24);
  for (int n = 0; n < 24; ++n) b.set(n, float(n));
  // A (2, 3) view with strides (1, 8): element (i, j) is b[i + 8 j].
  const std::vector<double> g = reference::gather(b.view({2, 3}, {1, 8}, 4));
  EXPECT_EQ(g, (std::vector<double>{4, 12, 20, 5, 13, 21}));
}

// scatter() is gather()'s inverse: it writes a strided view in logical order, nothing else,
// and rounds to the dtype to nearest even. 1 + step/2 lies halfway between 1 (even mantissa)
// and 1 + step, 1 + 3 step/2 between 1 + step and 1 + 2 step (even): down, then up.
TEST(Reference, ScatterWritesInLogicalOrderRoundingToNearestEven) {
  Buffer b(DType::Float32, 24);  // zeros
  reference::scatter({4, 12, 20, 5, 13, 21}, b.view({2, 3}, {1, 8}, 4));
  for (int n = 0; n < 24; ++n) {
    const bool written = n == 4 || n == 12 || n == 20 || n == 5 || n == 13 || n == 21;
    EXPECT_EQ(reinterpret_cast<const float*>(b.bytes.data())[n], written ? float(n) : 0.0f) << n;
  }
  for (const auto& [dtype, step] : {std::pair{DType::Float16, 0x1p-10},
                                    std::pair{DType::BFloat16, 0x1p-7}}) {
    SCOPED_TRACE(dtype_name(dtype));
    Buffer h(dtype, 4);
    reference::scatter({1 + step / 2, 1 + 1.5 * step, -2.5, NAN}, h.view({4}));
    const std::vector<double> g = reference::gather(h.view({4}));
    EXPECT_EQ(g[0], 1.0);
    EXPECT_EQ(g[1], 1 + 2 * step);
    EXPECT_EQ(g[2], -2.5);
    EXPECT_TRUE(std::isnan(g[3]));
  }
  EXPECT_THROW(reference::scatter({1.0}, b.view({2})), std::invalid_argument);
}

TEST(Reference, AccuracyRuleCatchesNanMismatches) {
  const std::vector<double> exact{1.0, NAN, -INFINITY};
  EXPECT_EQ(reference::max_abs_error({1.0, NAN, -INFINITY}, exact), 0.0);
  EXPECT_EQ(reference::max_abs_error({1.0, 0.0, -INFINITY}, exact), INFINITY);
  EXPECT_EQ(reference::max_abs_error({NAN, NAN, -INFINITY}, exact), INFINITY);
  EXPECT_EQ(reference::max_abs_error({1.0, NAN, 0.0}, exact), INFINITY);
  const auto c = reference::check_forward(DType::Float32, {1.0 + 2e-5}, {2.0}, {});
  EXPECT_FALSE(c.passed());  // 2e-5 > 1e-5 * 2
}

// The one-ulp floor of a gradient (check_backward) grows for dq and dk with |scale| sqrt(D),
// the softmax scale over its default: dq = scale dS K and dk = scale dS^T Q. It stays at 1 for
// dv, at and below the default scale, for a default (unset) scale and for a scale that is not
// finite.
TEST(Reference, BackwardFloorScalesWithTheSoftmaxScale) {
  using reference::Gradient;
  Options o;
  EXPECT_EQ(reference::floor_scale(Gradient::dQ, o, 16), 1.0);
  o.softmax_scale = 2.0f;
  EXPECT_DOUBLE_EQ(reference::floor_scale(Gradient::dQ, o, 16), 8.0);
  EXPECT_DOUBLE_EQ(reference::floor_scale(Gradient::dK, o, 16), 8.0);
  EXPECT_EQ(reference::floor_scale(Gradient::dV, o, 16), 1.0);
  o.softmax_scale = -2.0f;
  EXPECT_DOUBLE_EQ(reference::floor_scale(Gradient::dK, o, 16), 8.0);
  o.softmax_scale = 0.25f;  // the default at D = 16
  EXPECT_EQ(reference::floor_scale(Gradient::dQ, o, 16), 1.0);
  o.softmax_scale = 0.1f;
  EXPECT_EQ(reference::floor_scale(Gradient::dQ, o, 16), 1.0);
  o.softmax_scale = NAN;
  EXPECT_EQ(reference::floor_scale(Gradient::dQ, o, 16), 1.0);
  o.softmax_scale = INFINITY;
  EXPECT_EQ(reference::floor_scale(Gradient::dQ, o, 16), 1.0);
  // bf16: the floor is 3x the low-precision error plus 2^-7 x the call's largest gradient x
  // the factor (the low-precision implementation exact here).
  const std::vector<double> exact{0.0}, low{0.0};
  const auto at_default = reference::check_backward(DType::BFloat16, {0.2}, exact, low, 20.0);
  EXPECT_DOUBLE_EQ(at_default.tolerance, 20.0 * 0x1p-7);
  EXPECT_FALSE(at_default.passed());
  const auto scaled = reference::check_backward(DType::BFloat16, {0.2}, exact, low, 20.0, 8.0);
  EXPECT_DOUBLE_EQ(scaled.tolerance, 8 * 20.0 * 0x1p-7);
  EXPECT_TRUE(scaled.passed());
  // fp32's rule is relative and has no such floor.
  EXPECT_EQ(reference::check_backward(DType::Float32, {0.0}, exact, {}, 20.0, 8.0).tolerance,
            1e-5 * 20.0);
}

}  // namespace
}  // namespace flashattn::testing

namespace flashattn::testing {
namespace {

// The reference backward against central finite differences of the reference forward, both in
// float64, for L = sum(dout * out), on a small problem with every feature at once (causal
// window, softcap, ALiBi, dropout, GQA). Inputs are fp32, perturbed in place; the step taken
// is the fp32 difference actually stored.
TEST(Reference, BackwardMatchesFiniteDifferences) {
  const int64_t B = 2, Sq = 5, Sk = 7, H = 4, Hk = 2, D = 8;
  Buffer q(DType::Float32, B * Sq * H * D), k(DType::Float32, B * Sk * Hk * D),
      v(DType::Float32, B * Sk * Hk * D), dout(DType::Float32, B * Sq * H * D);
  q.fill_random();
  k.fill_random();
  v.fill_random();
  dout.fill_random();
  Buffer slopes(DType::Float32, H);
  for (int64_t h = 0; h < H; ++h) slopes.set(h, 0.3f * float(h + 1));
  for (const float dropout : {0.0f, 0.3f}) {
    Options o;
    o.causal = true;
    o.window_left = 3;
    o.softcap = 2.0f;
    o.alibi_slopes = slopes.view({H});
    o.dropout_p = dropout;
    o.dropout_seed = 5;
    const TensorView qv = q.view({B, Sq, H, D}), kv = k.view({B, Sk, Hk, D}),
                     vv = v.view({B, Sk, Hk, D}), dov = dout.view({B, Sq, H, D});
    const std::vector<double> w = reference::gather(dov);
    const auto loss = [&] {
      const reference::Result r = reference::forward(qv, kv, vv, o);
      double l = 0;
      for (size_t n = 0; n < w.size(); ++n) l += w[n] * r.out[n];
      return l;
    };
    const reference::Gradients g = reference::backward(qv, kv, vv, dov, o);
    const struct {
      const char* name;
      Buffer* input;
      const std::vector<double>* grad;
    } inputs[] = {{"q", &q, &g.dq}, {"k", &k, &g.dk}, {"v", &v, &g.dv}};
    for (const auto& in : inputs) {
      float* x = reinterpret_cast<float*>(in.input->data());
      double largest = 0, worst = 0;
      for (int64_t n = 0; n < in.input->count(); ++n) {
        const float x0 = x[n];
        x[n] = x0 + 1e-3f;
        const double up = loss(), x_up = x[n];
        x[n] = x0 - 1e-3f;
        const double down = loss(), x_down = x[n];
        x[n] = x0;
        const double numeric = (up - down) / (x_up - x_down);
        largest = std::max(largest, std::abs(numeric));
        worst = std::max(worst, std::abs(numeric - (*in.grad)[size_t(n)]));
      }
      EXPECT_GT(largest, 0.1) << in.name;  // not vacuous
      EXPECT_LT(worst, 1e-5 * std::max(1.0, largest))
          << in.name << " dropout " << dropout << ": finite differences differ by " << worst;
    }
  }
}

}  // namespace
}  // namespace flashattn::testing

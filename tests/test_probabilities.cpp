// attention_probabilities (the testing aid behind Python's return_attn_probs) against the
// float64 reference, and against the forward and backward it describes: from the returned
// probabilities, the lse and each row's max, out and dv are recomputed (|S| exp(max - lse),
// kept where the sign is clear, times 1/(1 - p)) and must match what the forward and the
// backward wrote with the same seed and offset. Dense and ragged batches, every mask, softcap,
// ALiBi, GQA, odd sizes, every memory layout. Compiled once per backend: test_probabilities_cpu
// and test_probabilities_cuda (FLASHATTN_TEST_CUDA, label gpu).
#include <cmath>
#include <numeric>

#include "sweep.hpp"

namespace flashattn::testing {
namespace {

// The probabilities are computed in fp32 from the same inputs the reference reads exactly, so
// whatever the input dtype they are within fp32 rounding of the definition (a few ulp of
// scores of magnitude < 20 where exp(s - max) is not negligible).
constexpr double kTolerance = 2e-5;

// attention_probabilities on the suite's backend with host views in and out: on CUDA the
// inputs are mirrored to the GPU, probs poisoned there and copied back after the call.
RunInfo probabilities_on_backend(const TensorView& q, const TensorView& k,
                                 const TensorView& probs, const Options& options,
                                 const Varlen* varlen) {
  Execution execution;
  execution.backend = kTestBackend;
#ifndef FLASHATTN_TEST_CUDA
  return varlen ? attention_probabilities_varlen(q, k, probs, *varlen, options, execution)
                : attention_probabilities(q, k, probs, options, execution);
#else
  DeviceMirror mq(q), mk(k), mprobs(probs);
  const DeviceArguments device(options, varlen);
  mprobs.poison();
  const RunInfo info =
      varlen ? attention_probabilities_varlen(mq.view(), mk.view(), mprobs.view(),
                                              *device.varlen(), device.options(), execution)
             : attention_probabilities(mq.view(), mk.view(), mprobs.view(), device.options(),
                                       execution);
  cuda_check(cudaDeviceSynchronize(), "kernel");
  mprobs.download();
  return info;
#endif
}

// Where sequence b lives in the gathered (contiguous) tensors of a call: q/out/dout rows
// (total_q, H, D), k/v/dv rows (total_k, Hk, D), lse (B, H, Sq) dense or (H, total_q) varlen,
// probs (B, H, rows, cols).
struct Addressing {
  int64_t B = 0, H = 0, Hk = 0, D = 0, rows = 0, cols = 0, total_q = 0, total_k = 0;
  bool varlen = false;
  std::vector<int64_t> q0, k0, seqlen_q, seqlen_k;  // per sequence (seqlen_k: the keys used)

  int64_t lse_index(int64_t b, int64_t h, int64_t i) const {
    return varlen ? h * total_q + q0[size_t(b)] + i : (b * H + h) * rows + i;
  }
  int64_t probs_row(int64_t b, int64_t h, int64_t i) const {
    return ((b * H + h) * rows + i) * cols;
  }
};

Addressing dense_addressing(int64_t B, int64_t Sq, int64_t Sk, int64_t H, int64_t Hk, int64_t D) {
  Addressing l{B, H, Hk, D, Sq, Sk, B * Sq, B * Sk, false, {}, {}, {}, {}};
  for (int64_t b = 0; b < B; ++b) {
    l.q0.push_back(b * Sq);
    l.k0.push_back(b * Sk);
    l.seqlen_q.push_back(Sq);
    l.seqlen_k.push_back(Sk);
  }
  return l;
}

// What the probabilities say the forward's out and the backward's dv are:
//   P_ij = |S_ij| exp(max_i - lse_i) / (1 - p) where the sign of S_ij is clear, else 0,
//   out_i = sum_j P_ij v_j,   dv_j = sum over the group's heads and rows i of P_ij dout_i.
struct FromProbabilities {
  std::vector<double> out, dv;
};

FromProbabilities recompute(const Addressing& l, const std::vector<double>& probs,
                            const std::vector<double>& row_max, const std::vector<double>& lse,
                            const std::vector<double>& v, const std::vector<double>& dout,
                            float dropout_p) {
  FromProbabilities r;
  r.out.assign(size_t(l.total_q * l.H * l.D), 0.0);
  r.dv.assign(size_t(l.total_k * l.Hk * l.D), 0.0);
  const double keep_scale = 1.0 / (1.0 - double(dropout_p));
  for (int64_t b = 0; b < l.B; ++b)
    for (int64_t h = 0; h < l.H; ++h) {
      const int64_t hk = h / (l.H / l.Hk);
      for (int64_t i = 0; i < l.seqlen_q[size_t(b)]; ++i) {
        const double m = row_max[size_t((b * l.H + h) * l.rows + i)];
        if (m == -INFINITY) continue;  // the row sees no key
        const double norm = std::exp(m - lse[size_t(l.lse_index(b, h, i))]) * keep_scale;
        const int64_t qi = (l.q0[size_t(b)] + i) * l.H + h;
        for (int64_t j = 0; j < l.seqlen_k[size_t(b)]; ++j) {
          const double s = probs[size_t(l.probs_row(b, h, i) + j)];
          if (std::signbit(s)) continue;  // dropped
          const double p = s * norm;
          const int64_t kj = (l.k0[size_t(b)] + j) * l.Hk + hk;
          for (int64_t d = 0; d < l.D; ++d) {
            r.out[size_t(qi * l.D + d)] += p * v[size_t(kj * l.D + d)];
            r.dv[size_t(kj * l.D + d)] += p * dout[size_t(qi * l.D + d)];
          }
        }
      }
    }
  return r;
}

// One call's tensors (host views) and options: the forward, the backward with a random dout,
// and the probabilities, each on the suite's backend with poisoned outputs.
struct Call {
  TensorView q, k, v, out, lse, dout, dq, dk, dv, probs;
  Options options;
  const Varlen* varlen = nullptr;
};

void run_and_check(const Call& c, const Addressing& l, const std::string& what) {
  SCOPED_TRACE(what);
  forward_on_backend(c.q, c.k, c.v, c.out, c.lse, c.options, c.varlen);
  backward_on_backend(c.q, c.k, c.v, c.out, c.dout, c.lse, c.dq, c.dk, c.dv, c.options, c.varlen);
  probabilities_on_backend(c.q, c.k, c.probs, c.options, c.varlen);

  // Every element against the definition: the value, and the sign bit (set exactly where a
  // visible element is dropped; +0 where masked or outside a sequence).
  const reference::Probabilities exact =
      reference::attention_probabilities(c.q, c.k, c.options, c.varlen);
  const std::vector<double> got = reference::gather(c.probs);
  ASSERT_EQ(got.size(), exact.probs.size());
  int64_t wrong_sign = 0, first_wrong = -1, dropped = 0, visible = 0;
  double worst = 0;
  for (size_t n = 0; n < got.size(); ++n) {
    if (std::isnan(got[n]) || std::signbit(got[n]) != std::signbit(exact.probs[n])) {
      if (wrong_sign++ == 0) first_wrong = int64_t(n);
    }
    worst = std::max(worst, std::abs(got[n] - exact.probs[n]));
    dropped += std::signbit(exact.probs[n]);
    visible += exact.probs[n] != 0.0;
  }
  EXPECT_EQ(wrong_sign, 0) << "first at flat index " << first_wrong << ": got "
                           << (first_wrong >= 0 ? got[size_t(first_wrong)] : 0.0) << ", expected "
                           << (first_wrong >= 0 ? exact.probs[size_t(first_wrong)] : 0.0);
  EXPECT_LE(worst, kTolerance) << "probs: max abs error";
  if (c.options.dropout_p == 0.0f) {
    EXPECT_EQ(dropped, 0);
  }
  // The max of a row's visible scores gives exp(0): exactly 1.
  for (int64_t row = 0; row < l.B * l.H * l.rows; ++row) {
    if (exact.row_max[size_t(row)] == -INFINITY) continue;
    double largest = 0;
    for (int64_t j = 0; j < l.cols; ++j)
      largest = std::max(largest, std::abs(got[size_t(row * l.cols + j)]));
    EXPECT_EQ(largest, 1.0) << "row " << row << " of (B, H, rows)";
  }

  // out and dv from the probabilities, with the forward's lse, against what the forward and
  // the backward wrote: the accuracy rule (docs/SPEC.md) with the recomputed values as the
  // exact ones.
  const FromProbabilities r = recompute(l, got, exact.row_max, reference::gather(c.lse),
                                        reference::gather(c.v), reference::gather(c.dout),
                                        c.options.dropout_p);
  using reference::Arithmetic;
  const DType dtype = c.q.dtype;
  std::vector<double> low_out, low_dv;
  if (dtype != DType::Float32) {
    const Arithmetic low = Arithmetic::InputDType;
    low_out = reference::forward(c.q, c.k, c.v, c.options, c.varlen, low).out;
    low_dv = reference::backward(c.q, c.k, c.v, c.dout, c.options, c.varlen, low).dv;
  }
  const reference::Check out_check =
      reference::check_forward(dtype, reference::gather(c.out), r.out, low_out);
  EXPECT_TRUE(out_check.passed()) << "out from the probabilities: max abs error "
                                  << out_check.max_abs_error << " > " << out_check.tolerance;
  double magnitude = 1;
  for (double x : r.dv) magnitude = std::max(magnitude, std::abs(x));
  const reference::Check dv_check =
      reference::check_backward(dtype, reference::gather(c.dv), r.dv, low_dv, magnitude);
  EXPECT_TRUE(dv_check.passed()) << "dv from the probabilities: max abs error "
                                 << dv_check.max_abs_error << " > " << dv_check.tolerance;
  EXPECT_GT(visible, 0);
  if (c.options.dropout_p > 0.0f && visible > 200) {
    EXPECT_GT(dropped, 0);
  }
}

void run_dense(Case c) {
  c.dtype = backend_dtype(c.dtype);
  Inputs in = make_inputs(c);
  Buffer slopes;
  const int64_t B = c.batch, Sq = c.seqlen_q, Sk = c.seqlen_k, H = c.heads, Hk = c.heads_k,
                D = c.head_dim;
  Buffer out(c.dtype, B * Sq * H * D), lse(DType::Float32, B * H * Sq),
      dout(c.dtype, B * Sq * H * D), dq(c.dtype, B * Sq * H * D), dk(c.dtype, B * Sk * Hk * D),
      dv(c.dtype, B * Sk * Hk * D), probs(DType::Float32, B * H * Sq * Sk);
  dout.fill_random();
  for (Buffer* b : {&out, &lse, &dq, &dk, &dv, &probs}) b->poison();
  Call call{in.q, in.k, in.v, out.view({B, Sq, H, D}), lse.view({B, H, Sq}),
            dout.view({B, Sq, H, D}), dq.view({B, Sq, H, D}), dk.view({B, Sk, Hk, D}),
            dv.view({B, Sk, Hk, D}), probs.view({B, H, Sq, Sk}), options_of(c, slopes), nullptr};
  run_and_check(call, dense_addressing(B, Sq, Sk, H, Hk, D), c.describe());
}

// Every mask x dtype, with and without dropout, softcap and ALiBi on some, on odd geometries
// (GQA 1, 2, 3 and 8; single query rows and keys; Sq > Sk so that causal rows see nothing)
// and every memory layout.
TEST(Probabilities, DenseMatchTheReferenceTheForwardAndTheBackward) {
  const Geometry geometries[] = {{2, 97, 113, 4, 2, 40}, {1, 130, 61, 6, 3, 64},
                                 {1, 33, 150, 2, 1, 256}, {3, 17, 17, 2, 2, 8},
                                 {2, 1, 70, 8, 1, 24},    {1, 70, 1, 2, 2, 32}};
  const Layout layouts[] = {Layout::Contiguous, Layout::HeadMajor, Layout::Padded};
  int n = 0;
  for (const Mask& m : kMasks)
    for (DType dt : kDtypes) {
      const Geometry g = geometries[n % 6];
      Case c{.batch = g.batch, .seqlen_q = g.seqlen_q, .seqlen_k = g.seqlen_k, .heads = g.heads,
             .heads_k = g.heads_k, .head_dim = g.head_dim, .dtype = dt, .causal = m.causal,
             .window_left = m.left, .window_right = m.right,
             .softcap = n % 5 == 2 ? 2.5f : 0.0f, .alibi = static_cast<Case::Alibi>(n % 3),
             .layout = layouts[n % 3], .dropout_p = n % 3 == 0 ? 0.0f : n % 3 == 1 ? 0.17f : 0.6f};
      run_dense(c);
      ++n;
    }
}

TEST(Probabilities, PackedQkvAndNegativeScale) {
  Case c{.batch = 2, .seqlen_q = 65, .seqlen_k = 65, .heads = 3, .heads_k = 3, .head_dim = 48,
         .causal = true, .softmax_scale = -0.3f, .layout = Layout::Packed, .dropout_p = 0.3f};
  run_dense(c);
}

void run_varlen(const std::vector<int32_t>& lens_q, const std::vector<int32_t>& lens_k,
                bool seqused, int64_t extra_max, const Case& shape) {
  const int64_t B = int64_t(lens_q.size()), H = shape.heads, Hk = shape.heads_k,
                D = shape.head_dim;
  const DType dt = backend_dtype(shape.dtype);
  std::vector<int32_t> cu_q{0}, cu_k{0}, used;
  for (int32_t n : lens_q) cu_q.push_back(cu_q.back() + n);
  for (int32_t n : lens_k) cu_k.push_back(cu_k.back() + n);
  for (int32_t n : lens_k) used.push_back(std::uniform_int_distribution<int32_t>(0, n)(rng()));
  Addressing l{B, H, Hk, D,
               *std::max_element(lens_q.begin(), lens_q.end()) + extra_max,
               *std::max_element(lens_k.begin(), lens_k.end()) + extra_max,
               cu_q.back(), cu_k.back(), true, {}, {}, {}, {}};
  for (int64_t b = 0; b < B; ++b) {
    l.q0.push_back(cu_q[size_t(b)]);
    l.k0.push_back(cu_k[size_t(b)]);
    l.seqlen_q.push_back(lens_q[size_t(b)]);
    l.seqlen_k.push_back(seqused ? used[size_t(b)] : lens_k[size_t(b)]);
  }
  Buffer q(dt, l.total_q * H * D), k(dt, l.total_k * Hk * D), v(dt, l.total_k * Hk * D),
      out(dt, l.total_q * H * D), lse(DType::Float32, H * l.total_q), dout(dt, l.total_q * H * D),
      dq(dt, l.total_q * H * D), dk(dt, l.total_k * Hk * D), dv(dt, l.total_k * Hk * D),
      probs(DType::Float32, B * H * l.rows * l.cols);
  for (Buffer* b : {&q, &k, &v, &dout}) b->fill_random();
  for (Buffer* b : {&out, &lse, &dq, &dk, &dv, &probs}) b->poison();
  Buffer cuq = int32_buffer(cu_q), cuk = int32_buffer(cu_k), used_buf = int32_buffer(used);
  Varlen varlen;
  varlen.cu_seqlens_q = cuq.view({B + 1});
  varlen.cu_seqlens_k = cuk.view({B + 1});
  varlen.max_seqlen_q = l.rows;
  varlen.max_seqlen_k = l.cols;
  if (seqused) varlen.seqused_k = used_buf.view({B});
  Case c = shape;
  c.batch = B;
  Buffer slopes;
  const Call call{q.view({l.total_q, H, D}),  k.view({l.total_k, Hk, D}),
                  v.view({l.total_k, Hk, D}), out.view({l.total_q, H, D}),
                  lse.view({H, l.total_q}),   dout.view({l.total_q, H, D}),
                  dq.view({l.total_q, H, D}), dk.view({l.total_k, Hk, D}),
                  dv.view({l.total_k, Hk, D}), probs.view({B, H, l.rows, l.cols}),
                  options_of(c, slopes),      &varlen};
  run_and_check(call, l,
                std::string("varlen ") + dtype_name(dt) + (seqused ? " seqused_k" : "") +
                    " extra_max=" + std::to_string(extra_max) + " " + c.describe());
}

// Empty sequences, Sq > Sk and Sq < Sk, keys cut by seqused_k, max_seqlen beyond the longest
// sequence (rows and columns past every sequence must come back 0), every mask.
TEST(Probabilities, VarlenMatchTheReferenceTheForwardAndTheBackward) {
  const std::vector<int32_t> lens_q{0, 37, 1, 64, 70, 5, 0};
  const std::vector<int32_t> lens_k{3, 0, 77, 64, 69, 0, 0};
  int n = 0;
  for (const Mask& m : kMasks)
    for (DType dt : kDtypes) {
      Case shape{.heads = 4, .heads_k = n % 2 ? 1 : 4, .head_dim = n % 4 == 3 ? 72 : 32,
                 .dtype = dt, .causal = m.causal, .window_left = m.left,
                 .window_right = m.right, .softcap = n % 3 == 1 ? 2.5f : 0.0f,
                 .alibi = static_cast<Case::Alibi>(n % 3), .dropout_p = n % 2 ? 0.23f : 0.5f};
      run_varlen(lens_q, lens_k, n % 2 == 1, n % 4 == 0 ? 17 : 0, shape);
      ++n;
    }
}

// The fraction of visible elements whose sign says "dropped" is p, within 5 binomial
// standard deviations (what upstream's dropout tests read off S_dmask >= 0).
TEST(Probabilities, DropFractionIsDropoutP) {
  const int64_t B = 2, S = 256, H = 2, D = 32;
  for (float p : {0.1f, 0.5f}) {
    Case c{.batch = B, .seqlen_q = S, .seqlen_k = S, .heads = H, .heads_k = H, .head_dim = D,
           .dtype = backend_dtype(DType::Float16), .causal = true, .dropout_p = p};
    Inputs in = make_inputs(c);
    Buffer slopes, probs(DType::Float32, B * H * S * S);
    probs.poison();
    probabilities_on_backend(in.q, in.k, probs.view({B, H, S, S}), options_of(c, slopes), nullptr);
    const float* x = reinterpret_cast<const float*>(probs.bytes.data());
    int64_t dropped = 0, visible = 0;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < S; ++i)
          for (int64_t j = 0; j <= i; ++j) {  // causal, Sq = Sk: the keys row i sees
            dropped += std::signbit(x[((b * H + h) * S + i) * S + j]);
            ++visible;
          }
    const double mean = double(visible) * p, sigma = std::sqrt(double(visible) * p * (1 - p));
    EXPECT_LE(std::abs(double(dropped) - mean), 5 * sigma)
        << "p = " << p << ": " << dropped << " of " << visible << " dropped";
  }
}

}  // namespace
}  // namespace flashattn::testing

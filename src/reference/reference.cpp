#include "reference/reference.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/numeric.hpp"
#include "common/philox.hpp"

namespace flashattn::reference {
namespace {

using detail::bfloat16_t;
using detail::float8_e4m3_t;
using detail::half_t;

double element(const TensorView& t, int64_t offset) {
  switch (t.dtype) {
    case DType::Float32:
      return static_cast<const float*>(t.data)[offset];
    case DType::Float16:
      return detail::to_float(static_cast<const half_t*>(t.data)[offset]);
    case DType::BFloat16:
      return detail::to_float(static_cast<const bfloat16_t*>(t.data)[offset]);
    case DType::Float8E4M3:
      return detail::to_float(static_cast<const float8_e4m3_t*>(t.data)[offset]);
    case DType::Int32:
      return static_cast<const int32_t*>(t.data)[offset];
  }
  throw std::logic_error("reference: unknown dtype");
}

// Rounds to the storage dtype (InputDType arithmetic) or not at all (Float64).
double round_to(DType dtype, Arithmetic arithmetic, double x) {
  if (arithmetic == Arithmetic::Float64) return x;
  const float f = static_cast<float>(x);
  switch (dtype) {
    case DType::Float16:
      return detail::round_through<half_t>(f);
    case DType::BFloat16:
      return detail::round_through<bfloat16_t>(f);
    case DType::Float8E4M3:
      return detail::round_through<float8_e4m3_t>(f);
    default:
      return f;
  }
}

}  // namespace

namespace {

// Calls visit(n, offset) for the n-th element of `t` in row-major logical order, at element
// offset `offset` from t.data.
template <typename Visit>
void for_each_element(const TensorView& t, Visit visit) {
  const size_t count = static_cast<size_t>(t.numel());
  std::vector<int64_t> index(static_cast<size_t>(t.ndim), 0);
  for (size_t n = 0; n < count; ++n) {
    int64_t offset = 0;
    for (int d = 0; d < t.ndim; ++d) offset += index[static_cast<size_t>(d)] * t.stride(d);
    visit(n, offset);
    for (int d = t.ndim - 1; d >= 0; --d) {  // odometer increment, last dim fastest
      if (++index[static_cast<size_t>(d)] < t.size(d)) break;
      index[static_cast<size_t>(d)] = 0;
    }
  }
}

void store(const TensorView& t, int64_t offset, double x) {
  const float f = static_cast<float>(x);
  switch (t.dtype) {
    case DType::Float32:
      static_cast<float*>(t.data)[offset] = f;
      return;
    case DType::Float16:
      static_cast<half_t*>(t.data)[offset] = detail::to_half(f);
      return;
    case DType::BFloat16:
      static_cast<bfloat16_t*>(t.data)[offset] = detail::to_bfloat16(f);
      return;
    case DType::Float8E4M3:  // saturating at 448 (common/numeric.hpp)
      static_cast<float8_e4m3_t*>(t.data)[offset] = detail::to_float8_e4m3(f);
      return;
    case DType::Int32:  // exact integers only: a cast of anything else is undefined
      if (!(x == std::floor(x) && x >= double(INT32_MIN) && x <= double(INT32_MAX)))
        throw std::invalid_argument("reference::scatter: an int32 view takes integers in "
                                    "int32's range, given " + std::to_string(x));
      static_cast<int32_t*>(t.data)[offset] = static_cast<int32_t>(x);
      return;
  }
  throw std::logic_error("reference: unknown dtype");
}

}  // namespace

std::vector<double> gather(const TensorView& t) {
  std::vector<double> values(static_cast<size_t>(t.numel()));
  for_each_element(t, [&](size_t n, int64_t offset) { values[n] = element(t, offset); });
  return values;
}

void scatter(const std::vector<double>& values, const TensorView& t) {
  if (static_cast<int64_t>(values.size()) != t.numel())
    throw std::invalid_argument("reference::scatter: " + std::to_string(values.size()) +
                                " values for a view of " + std::to_string(t.numel()) +
                                " elements");
  for_each_element(t, [&](size_t n, int64_t offset) { store(t, offset, values[n]); });
}

namespace {

// One call's geometry, and where sequence b lives.
struct Problem {
  const TensorView &q, &k, &v;
  const Options& options;
  const Varlen* varlen;
  Arithmetic arithmetic;
  bool ragged;
  int r;  // first dim after the batch dim
  int64_t B, H, D, Hk, Dv, rows_q, rows_k;
  double scale, cap;
  int64_t left, right;
  std::optional<detail::DropoutRng> dropout;

  Problem(const TensorView& q_, const TensorView& k_, const TensorView& v_, const Options& o,
          const Varlen* vl, Arithmetic a)
      : q(q_), k(k_), v(v_), options(o), varlen(vl), arithmetic(a), ragged(vl != nullptr),
        r(ragged ? 0 : 1) {
    B = ragged ? varlen->cu_seqlens_q.size(0) - 1 : q.size(0);
    H = q.size(r + 1);
    D = q.size(r + 2);
    Hk = k.size(r + 1);
    Dv = v.size(r + 2);
    rows_q = q.size(r);
    rows_k = k.size(r);
    scale = options.softmax_scale ? *options.softmax_scale : 1.0 / std::sqrt(double(D));
    cap = options.softcap;
    left = options.window_left;
    right = options.causal ? 0 : options.window_right;
    if (options.dropout_p > 0)
      dropout = detail::make_dropout_rng(options.dropout_seed, options.dropout_offset,
                                         options.dropout_p);
    if (options.positions) {
      query0 = options.positions->query;
      key0 = options.positions->key;
    }
  }

  // InputDType arithmetic rounds scores and probabilities to the input dtype and the output
  // to out's. FP8 inputs (docs/SPEC.md, "FP8 inputs"): scores in fp32, out in bf16, and the
  // probabilities that multiply V in e4m3, taken as FA3's kernel takes them: exp(s - max),
  // at most 1, rounded, then divided by the unrounded sum.
  bool fp8() const { return q.dtype == DType::Float8E4M3; }
  double rnd(double x) const { return round_to(fp8() ? DType::Float32 : q.dtype, arithmetic, x); }
  double rnd_out(double x) const { return round_to(fp8() ? DType::BFloat16 : q.dtype, arithmetic, x); }

  // The descale factor of row `row` of sequence b, key/value head hk (1 without descales).
  double descale(const std::optional<TensorView>& factors, int64_t b, int64_t hk,
                 int64_t row) const {
    if (!factors) return 1.0;
    const TensorView& f = *factors;
    const int64_t block = f.ndim == 3 ? row / kFp8ScaleBlockRows : 0;
    return element(f, b * f.stride(0) + hk * f.stride(1) + (f.ndim == 3 ? block * f.stride(2) : 0));
  }

  // Positions (SPEC.md): query row i is token query0 + i and key j token key0 + j; ALiBi
  // measures between those tokens when positions are given, from the call's bottom-right
  // diagonal otherwise.
  int64_t query0 = 0, key0 = 0;
  int64_t alibi_distance(int64_t i, int64_t j, int64_t Sq, int64_t Sk) const {
    return options.positions ? (query0 + i) - (key0 + j) : i + Sk - Sq - j;
  }

  struct Sequence {
    int64_t q0 = 0, k0 = 0, Sq = 0, Sk = 0;
  };
  Sequence sequence(int64_t b) const {
    Sequence s{0, 0, rows_q, rows_k};
    if (ragged) {
      const auto* cq = static_cast<const int32_t*>(varlen->cu_seqlens_q.data);
      const auto* ck = static_cast<const int32_t*>(varlen->cu_seqlens_k.data);
      s.q0 = cq[b];
      s.k0 = ck[b];
      s.Sq = cq[b + 1] - cq[b];
      s.Sk = ck[b + 1] - ck[b];
      if (varlen->seqused_k) s.Sk = static_cast<const int32_t*>(varlen->seqused_k->data)[b];
    }
    return s;
  }

  // A (rows, width) double matrix of one head of t (read once; the loops would otherwise
  // decode every element Sk or Sq times).
  // FP8 inputs are dequantised with `factors` of key/value head hk: value times factor, exact.
  std::vector<double> load(const TensorView& t, int64_t b, int64_t head, int64_t row0,
                           int64_t rows, int64_t width,
                           const std::optional<TensorView>& factors, int64_t hk) const {
    std::vector<double> m(static_cast<size_t>(rows * width));
    const int64_t base = (ragged ? 0 : b * t.stride(0)) + head * t.stride(r + 1);
    for (int64_t i = 0; i < rows; ++i) {
      const double factor = descale(factors, b, hk, i);
      for (int64_t d = 0; d < width; ++d)
        m[size_t(i * width + d)] = element(t, base + (row0 + i) * t.stride(r) + d * t.stride(r + 2)) * factor;
    }
    return m;
  }

  // Flat index of (row, head) in a contiguous (rows, heads, width) layout of q or k.
  int64_t row_index(int64_t b, int64_t row, int64_t Srows) const {
    return ragged ? row : b * Srows + row;
  }
};

// Steps 1-6 of SPEC.md for one (b, h): the scores S, the softmax P (undropped, 0 where not
// visible), the dropout multipliers M, each row's max over its visible scores and its lse,
// and tanh(r / cap) for the softcap's derivative.
struct Head {
  int64_t Sq = 0, Sk = 0;
  std::vector<double> Q, K, V;
  std::vector<double> S, P, M, tanh;
  std::vector<char> visible;
  std::vector<double> max, lse;

  Head(const Problem& pr, int64_t b, int64_t h) {
    const Problem::Sequence seq = pr.sequence(b);
    Sq = seq.Sq;
    Sk = seq.Sk;
    const int64_t hk = h / (pr.H / pr.Hk);
    Q = pr.load(pr.q, b, h, seq.q0, Sq, pr.D, pr.options.q_descale, hk);
    K = pr.load(pr.k, b, hk, seq.k0, Sk, pr.D, pr.options.k_descale, hk);
    V = pr.load(pr.v, b, hk, seq.k0, Sk, pr.Dv, pr.options.v_descale, hk);
    double slope = 0;
    if (pr.options.alibi_slopes) {
      const auto* s = static_cast<const float*>(pr.options.alibi_slopes->data);
      slope = pr.options.alibi_slopes->ndim == 2 ? s[b * pr.H + h] : s[h];
    }
    const size_t n = static_cast<size_t>(Sq * Sk);
    S.assign(n, 0.0);
    P.assign(n, 0.0);
    M.assign(n, 1.0);
    tanh.assign(n, 0.0);
    visible.assign(n, 0);
    lse.assign(static_cast<size_t>(Sq), -std::numeric_limits<double>::infinity());
    max.assign(static_cast<size_t>(Sq), -std::numeric_limits<double>::infinity());
    for (int64_t i = 0; i < Sq; ++i) {
      for (int64_t j = 0; j < Sk; ++j) {
        const size_t ij = size_t(i * Sk + j);
        double dot = 0;
        for (int64_t d = 0; d < pr.D; ++d) dot += Q[size_t(i * pr.D + d)] * K[size_t(j * pr.D + d)];
        double s = pr.rnd(pr.scale * pr.rnd(dot));
        if (pr.cap > 0) {
          tanh[ij] = std::tanh(s / pr.cap);
          s = pr.rnd(pr.cap * tanh[ij]);
        }
        if (pr.options.alibi_slopes) s = pr.rnd(s - slope * std::abs(double(pr.alibi_distance(i, j, Sq, Sk))));
        const int64_t diag = i + Sk - Sq;
        visible[ij] = (pr.left < 0 || j >= diag - pr.left) && (pr.right < 0 || j <= diag + pr.right);
        S[ij] = s;
        if (pr.dropout)
          M[ij] = pr.dropout->keep(uint32_t(b), uint32_t(h), uint32_t(i + pr.query0),
                                   uint32_t(j + pr.key0))
                      ? 1.0 / (1.0 - double(pr.options.dropout_p))
                      : 0.0;
      }
    }
    // Step 5: softmax over the visible keys (a row that sees none keeps P = 0, lse = -inf).
    for (int64_t i = 0; i < Sq; ++i) {
      double mx = -std::numeric_limits<double>::infinity();
      bool any = false, nan = false;
      for (int64_t j = 0; j < Sk; ++j) {
        if (!visible[size_t(i * Sk + j)]) continue;
        const double s = S[size_t(i * Sk + j)];
        any = true;
        if (std::isnan(s)) nan = true;
        mx = std::max(mx, s);
      }
      if (!any) continue;
      if (nan) mx = std::numeric_limits<double>::quiet_NaN();
      max[size_t(i)] = mx;
      double sum = 0;
      for (int64_t j = 0; j < Sk; ++j)
        if (visible[size_t(i * Sk + j)]) sum += std::exp(S[size_t(i * Sk + j)] - mx);
      lse[size_t(i)] = mx + std::log(sum);
      for (int64_t j = 0; j < Sk; ++j)
        if (visible[size_t(i * Sk + j)])
          P[size_t(i * Sk + j)] =
              pr.fp8() ? round_to(DType::Float8E4M3, pr.arithmetic,
                                  std::exp(S[size_t(i * Sk + j)] - mx)) / sum
                       : pr.rnd(std::exp(S[size_t(i * Sk + j)] - mx) / sum);
    }
  }

  // Step 6: the probability that multiplies v_j (0 where masked or dropped).
  double dropped(const Problem& pr, size_t ij) const {
    return M[ij] == 1.0 ? P[ij] : pr.rnd(P[ij] * M[ij]);
  }

  // Step 7 for row i: out_i = sum over visible j of (P o M)_ij v_j.
  void output_row(const Problem& pr, int64_t i, double* o) const {
    std::vector<double> acc(static_cast<size_t>(pr.Dv), 0.0);
    for (int64_t j = 0; j < Sk; ++j) {
      const size_t ij = size_t(i * Sk + j);
      if (!visible[ij]) continue;
      const double p = dropped(pr, ij);
      for (int64_t d = 0; d < pr.Dv; ++d) acc[size_t(d)] += p * V[size_t(j * pr.Dv + d)];
    }
    for (int64_t d = 0; d < pr.Dv; ++d) o[d] = pr.rnd_out(acc[size_t(d)]);
  }
};

}  // namespace

Result forward(const TensorView& q, const TensorView& k, const TensorView& v,
               const Options& options, const Varlen* varlen, Arithmetic arithmetic) {
  const Problem pr(q, k, v, options, varlen, arithmetic);
  const int64_t B = pr.B, H = pr.H, Dv = pr.Dv, rows_q = pr.rows_q;
  Result result;
  result.out.assign(static_cast<size_t>((pr.ragged ? rows_q : B * rows_q) * H * Dv), 0.0);
  result.lse.assign(static_cast<size_t>((pr.ragged ? rows_q : B * rows_q) * H), 0.0);

#pragma omp parallel for collapse(2) schedule(dynamic, 1)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const Head head(pr, b, h);
      const int64_t q0 = pr.sequence(b).q0, Sq = head.Sq;
      for (int64_t i = 0; i < Sq; ++i) {
        const int64_t row = pr.row_index(b, q0 + i, Sq);  // row in the out layout
        result.lse[size_t(pr.ragged ? h * rows_q + q0 + i : (b * H + h) * Sq + i)] =
            head.lse[size_t(i)];
        head.output_row(pr, i, &result.out[size_t((row * H + h) * Dv)]);
      }
    }
  }
  return result;
}

Gradients backward(const TensorView& q, const TensorView& k, const TensorView& v,
                   const TensorView& dout, const Options& options, const Varlen* varlen,
                   Arithmetic arithmetic) {
  const Problem pr(q, k, v, options, varlen, arithmetic);
  const int64_t B = pr.B, H = pr.H, Hk = pr.Hk, D = pr.D, Dv = pr.Dv;
  const int64_t batch_rows_q = pr.ragged ? pr.rows_q : B * pr.rows_q;
  const int64_t batch_rows_k = pr.ragged ? pr.rows_k : B * pr.rows_k;
  Gradients g;
  g.dq.assign(static_cast<size_t>(batch_rows_q * H * D), 0.0);
  g.dk.assign(static_cast<size_t>(batch_rows_k * Hk * D), 0.0);
  g.dv.assign(static_cast<size_t>(batch_rows_k * Hk * Dv), 0.0);

  // Parallel over (b, key/value head): the query heads of a group add into the same dk/dv.
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t hk = 0; hk < Hk; ++hk) {
      const Problem::Sequence seq = pr.sequence(b);
      std::vector<double> dK(static_cast<size_t>(seq.Sk * D), 0.0),
          dV(static_cast<size_t>(seq.Sk * Dv), 0.0);
      for (int64_t h = hk * (H / Hk); h < (hk + 1) * (H / Hk); ++h) {
        const Head head(pr, b, h);
        const int64_t Sq = head.Sq, Sk = head.Sk;
        const std::vector<double> dO = pr.load(dout, b, h, seq.q0, Sq, Dv, std::nullopt, hk);
        std::vector<double> O(static_cast<size_t>(Dv));
        for (int64_t i = 0; i < Sq; ++i) {
          if (std::isinf(head.lse[size_t(i)])) continue;  // no visible key: zero gradients
          const double* dOi = &dO[size_t(i * Dv)];
          head.output_row(pr, i, O.data());
          double Di = 0;  // D_i = rowsum(dO o O)
          for (int64_t d = 0; d < Dv; ++d) Di += dOi[d] * O[size_t(d)];
          Di = pr.rnd(Di);
          std::vector<double> dQi(static_cast<size_t>(D), 0.0);
          for (int64_t j = 0; j < Sk; ++j) {
            const size_t ij = size_t(i * Sk + j);
            if (!head.visible[ij]) continue;
            const double pd = head.dropped(pr, ij);
            for (int64_t d = 0; d < Dv; ++d) dV[size_t(j * Dv + d)] += pd * dOi[d];
            double dp = 0;
            for (int64_t d = 0; d < Dv; ++d) dp += dOi[d] * head.V[size_t(j * Dv + d)];
            dp = pr.rnd(pr.rnd(dp) * head.M[ij]);
            double ds = pr.rnd(head.P[ij] * (dp - Di));
            if (pr.cap > 0) ds = pr.rnd(ds * (1.0 - head.tanh[ij] * head.tanh[ij]));
            for (int64_t d = 0; d < D; ++d) {
              dQi[size_t(d)] += ds * head.K[size_t(j * D + d)];
              dK[size_t(j * D + d)] += ds * head.Q[size_t(i * D + d)];
            }
          }
          double* dq = &g.dq[size_t((pr.row_index(b, seq.q0 + i, Sq) * H + h) * D)];
          for (int64_t d = 0; d < D; ++d) dq[d] = pr.rnd(pr.scale * dQi[size_t(d)]);
        }
      }
      for (int64_t j = 0; j < seq.Sk; ++j) {
        const int64_t row = pr.row_index(b, seq.k0 + j, pr.rows_k);
        for (int64_t d = 0; d < D; ++d)
          g.dk[size_t((row * Hk + hk) * D + d)] = pr.rnd(pr.scale * dK[size_t(j * D + d)]);
        for (int64_t d = 0; d < Dv; ++d)
          g.dv[size_t((row * Hk + hk) * Dv + d)] = pr.rnd(dV[size_t(j * Dv + d)]);
      }
    }
  }
  return g;
}

std::vector<uint8_t> dropout_mask(const Options& options, int64_t b, int64_t h, int64_t seqlen_q,
                                  int64_t seqlen_k) {
  std::vector<uint8_t> mask(static_cast<size_t>(seqlen_q * seqlen_k), 1);
  if (options.dropout_p <= 0) return mask;
  const detail::DropoutRng rng =
      detail::make_dropout_rng(options.dropout_seed, options.dropout_offset, options.dropout_p);
  for (int64_t i = 0; i < seqlen_q; ++i)
    for (int64_t j = 0; j < seqlen_k; ++j)
      mask[size_t(i * seqlen_k + j)] =
          rng.keep(uint32_t(b), uint32_t(h),
                   uint32_t(i + (options.positions ? options.positions->query : 0)),
                   uint32_t(j + (options.positions ? options.positions->key : 0)));
  return mask;
}

std::vector<double> dropped_probabilities(const TensorView& q, const TensorView& k,
                                          const TensorView& v, const Options& options) {
  const Problem pr(q, k, v, options, nullptr, Arithmetic::Float64);
  const int64_t Sq = pr.rows_q, Sk = pr.rows_k;
  std::vector<double> probs(static_cast<size_t>(pr.B * pr.H * Sq * Sk), 0.0);
  for (int64_t b = 0; b < pr.B; ++b)
    for (int64_t h = 0; h < pr.H; ++h) {
      const Head head(pr, b, h);
      for (int64_t ij = 0; ij < Sq * Sk; ++ij)
        if (head.visible[size_t(ij)])
          probs[size_t((b * pr.H + h) * Sq * Sk + ij)] = head.dropped(pr, size_t(ij));
    }
  return probs;
}

Probabilities attention_probabilities(const TensorView& q, const TensorView& k,
                                      const Options& options, const Varlen* varlen) {
  // k stands in for v, which the probabilities do not involve.
  const Problem pr(q, k, k, options, varlen, Arithmetic::Float64);
  const int64_t rows = varlen ? varlen->max_seqlen_q : pr.rows_q;
  const int64_t cols = varlen ? varlen->max_seqlen_k : pr.rows_k;
  Probabilities out;
  out.probs.assign(static_cast<size_t>(pr.B * pr.H * rows * cols), 0.0);
  out.row_max.assign(static_cast<size_t>(pr.B * pr.H * rows),
                     -std::numeric_limits<double>::infinity());
  for (int64_t b = 0; b < pr.B; ++b)
    for (int64_t h = 0; h < pr.H; ++h) {
      const Head head(pr, b, h);
      const int64_t bh = b * pr.H + h;
      for (int64_t i = 0; i < head.Sq; ++i) {
        out.row_max[size_t(bh * rows + i)] = head.max[size_t(i)];
        for (int64_t j = 0; j < head.Sk; ++j) {
          const size_t ij = size_t(i * head.Sk + j);
          if (!head.visible[ij]) continue;
          const double x = std::exp(head.S[ij] - head.max[size_t(i)]);
          out.probs[size_t((bh * rows + i) * cols + j)] = head.M[ij] == 0.0 ? -x : x;
        }
      }
    }
  return out;
}

double max_abs_error(const std::vector<double>& actual, const std::vector<double>& exact) {
  if (actual.size() != exact.size()) return std::numeric_limits<double>::infinity();
  double worst = 0;
  for (size_t n = 0; n < actual.size(); ++n) {
    const double a = actual[n], e = exact[n];
    if (std::isnan(e) || std::isnan(a)) {
      if (std::isnan(e) != std::isnan(a)) return std::numeric_limits<double>::infinity();
      continue;
    }
    if (std::isinf(e) || std::isinf(a)) {
      if (a != e) return std::numeric_limits<double>::infinity();
      continue;
    }
    worst = std::max(worst, std::abs(a - e));
  }
  return worst;
}

namespace {

Check check(DType dtype, const std::vector<double>& actual, const std::vector<double>& exact,
            const std::vector<double>& low_precision, double low_precision_factor,
            double magnitude = 1) {
  Check c;
  c.max_abs_error = max_abs_error(actual, exact);
  if (dtype == DType::Float32) {
    double largest = std::max(1.0, magnitude);
    for (double e : exact)
      if (std::isfinite(e)) largest = std::max(largest, std::abs(e));
    c.tolerance = 1e-5 * largest;
  } else {
    // The floor covers outputs so small that the low-precision error is itself ~0.
    const double floor = dtype == DType::Float16 ? 1e-4 : 5e-4;
    c.tolerance = low_precision_factor * max_abs_error(low_precision, exact) + floor;
  }
  return c;
}

}  // namespace

Check check_forward(DType dtype, const std::vector<double>& actual,
                    const std::vector<double>& exact, const std::vector<double>& low_precision) {
  return check(dtype, actual, exact, low_precision, 2);
}

Check check_forward_dequantised(const std::vector<double>& actual,
                                const std::vector<double>& exact) {
  Check c;
  c.max_abs_error = max_abs_error(actual, exact);
  double largest = 1e-30;
  for (double e : exact)
    if (std::isfinite(e)) largest = std::max(largest, std::abs(e));
  c.tolerance = (0x1p-8 + 1e-5) * largest;
  return c;
}

Check check_backward(DType dtype, const std::vector<double>& actual,
                     const std::vector<double>& exact, const std::vector<double>& low_precision,
                     double call_magnitude, double floor_scale) {
  Check c = check(dtype, actual, exact, low_precision, 3, call_magnitude);
  // A gradient can cancel to exactly 0 (one visible key: dS = P (dP - D), with D taken from
  // the stored, rounded output, as every flash backward does). The plain low-precision
  // implementation rounds dP and D to the same value and is exact by luck, so its error says
  // nothing there; the floor is then one unit in the last place of the call's largest
  // gradient, at the default softmax scale. dq and dk get dS's error multiplied by the scale,
  // so their floor grows with it (floor_scale, from reference::floor_scale).
  if (dtype != DType::Float32) {
    const double epsilon = dtype == DType::Float16 ? 0x1p-10 : 0x1p-7;
    const double factor = std::isfinite(floor_scale) ? std::max(1.0, floor_scale) : 1.0;
    c.tolerance = std::max(c.tolerance, 3 * max_abs_error(low_precision, exact) +
                                            epsilon * call_magnitude * factor);
  }
  return c;
}

double floor_scale(Gradient which, const Options& options, int64_t head_dim) {
  if (which == Gradient::dV || !options.softmax_scale || head_dim <= 0) return 1;
  const double ratio = std::abs(double(*options.softmax_scale)) * std::sqrt(double(head_dim));
  return std::isfinite(ratio) ? std::max(1.0, ratio) : 1.0;
}

double largest_magnitude(const Gradients& g) {
  double largest = 0;
  for (const std::vector<double>* grad : {&g.dq, &g.dk, &g.dv})
    for (double e : *grad)
      if (std::isfinite(e)) largest = std::max(largest, std::abs(e));
  return largest;
}

}  // namespace flashattn::reference

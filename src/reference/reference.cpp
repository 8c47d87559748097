#include "reference/reference.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>

#include "common/numeric.hpp"

namespace flashattn::reference {
namespace {

using detail::bfloat16_t;
using detail::half_t;

double element(const TensorView& t, int64_t offset) {
  switch (t.dtype) {
    case DType::Float32:
      return static_cast<const float*>(t.data)[offset];
    case DType::Float16:
      return detail::to_float(static_cast<const half_t*>(t.data)[offset]);
    case DType::BFloat16:
      return detail::to_float(static_cast<const bfloat16_t*>(t.data)[offset]);
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
    default:
      return f;
  }
}

}  // namespace

std::vector<double> gather(const TensorView& t) {
  std::vector<double> values(static_cast<size_t>(t.numel()));
  std::vector<int64_t> index(static_cast<size_t>(t.ndim), 0);
  for (size_t n = 0; n < values.size(); ++n) {
    int64_t offset = 0;
    for (int d = 0; d < t.ndim; ++d) offset += index[static_cast<size_t>(d)] * t.stride(d);
    values[n] = element(t, offset);
    for (int d = t.ndim - 1; d >= 0; --d) {  // odometer increment, last dim fastest
      if (++index[static_cast<size_t>(d)] < t.size(d)) break;
      index[static_cast<size_t>(d)] = 0;
    }
  }
  return values;
}

Result forward(const TensorView& q, const TensorView& k, const TensorView& v,
               const Options& options, const Varlen* varlen, Arithmetic arithmetic) {
  const bool ragged = varlen != nullptr;
  const int r = ragged ? 0 : 1;  // first dim after the batch dim
  const int64_t B = ragged ? varlen->cu_seqlens_q.size(0) - 1 : q.size(0);
  const int64_t H = q.size(r + 1), D = q.size(r + 2), Hk = k.size(r + 1), Dv = v.size(r + 2);
  const int64_t rows_q = q.size(r);
  const double scale = options.softmax_scale ? *options.softmax_scale : 1.0 / std::sqrt(double(D));
  const double cap = options.softcap;
  const int64_t left = options.window_left;
  const int64_t right = options.causal ? 0 : options.window_right;
  const DType dtype = q.dtype;
  const auto rnd = [&](double x) { return round_to(dtype, arithmetic, x); };

  Result result;
  result.out.assign(static_cast<size_t>((ragged ? rows_q : B * rows_q) * H * Dv), 0.0);
  result.lse.assign(static_cast<size_t>((ragged ? rows_q : B * rows_q) * H), 0.0);

#pragma omp parallel for collapse(2) schedule(dynamic, 1)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      // Where sequence b lives, and its lengths.
      int64_t q0 = 0, k0 = 0, Sq = rows_q, Sk = k.size(r);
      if (ragged) {
        const auto* cq = static_cast<const int32_t*>(varlen->cu_seqlens_q.data);
        const auto* ck = static_cast<const int32_t*>(varlen->cu_seqlens_k.data);
        q0 = cq[b];
        k0 = ck[b];
        Sq = cq[b + 1] - cq[b];
        Sk = ck[b + 1] - ck[b];
        if (varlen->seqused_k) Sk = static_cast<const int32_t*>(varlen->seqused_k->data)[b];
      }
      const int64_t hk = h / (H / Hk);
      // This (b, h)'s rows of q, k and v as double matrices (read once; the loops below
      // would otherwise decode every element Sk or Sq times).
      const auto load = [&](const TensorView& t, int64_t head, int64_t row0, int64_t rows,
                            int64_t width) {
        std::vector<double> m(static_cast<size_t>(rows * width));
        const int64_t base = (ragged ? 0 : b * t.stride(0)) + head * t.stride(r + 1);
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t d = 0; d < width; ++d)
            m[size_t(i * width + d)] = element(t, base + (row0 + i) * t.stride(r) + d);
        return m;
      };
      const std::vector<double> Q = load(q, h, q0, Sq, D), K = load(k, hk, k0, Sk, D),
                                V = load(v, hk, k0, Sk, Dv);
      double slope = 0;
      if (options.alibi_slopes) {
        const auto* s = static_cast<const float*>(options.alibi_slopes->data);
        slope = options.alibi_slopes->ndim == 2 ? s[b * H + h] : s[h];
      }

      // Steps 1-4 of SPEC.md: the full Sq x Sk score matrix of this (b, h).
      std::vector<double> S(static_cast<size_t>(Sq * Sk));
      std::vector<char> visible(static_cast<size_t>(Sq * Sk));
      for (int64_t i = 0; i < Sq; ++i) {
        for (int64_t j = 0; j < Sk; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += Q[size_t(i * D + d)] * K[size_t(j * D + d)];
          double s = rnd(scale * rnd(dot));
          if (cap > 0) s = rnd(cap * std::tanh(s / cap));
          if (options.alibi_slopes) s = rnd(s - slope * std::abs(double(i + Sk - Sq - j)));
          const int64_t diag = i + Sk - Sq;
          const bool seen = (left < 0 || j >= diag - left) && (right < 0 || j <= diag + right);
          S[size_t(i * Sk + j)] = s;
          visible[size_t(i * Sk + j)] = seen;
        }
      }
      // Steps 5 and 7: softmax over the visible keys, then the weighted sum of values.
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
        const int64_t row = ragged ? q0 + i : b * Sq + i;  // row in the out layout
        double* o = &result.out[size_t((row * H + h) * Dv)];
        double& lse = result.lse[size_t(ragged ? h * rows_q + q0 + i : (b * H + h) * Sq + i)];
        if (!any) {  // no visible key: out = 0, lse = -inf
          lse = -std::numeric_limits<double>::infinity();
          continue;
        }
        if (nan) mx = std::numeric_limits<double>::quiet_NaN();
        double sum = 0;
        for (int64_t j = 0; j < Sk; ++j)
          if (visible[size_t(i * Sk + j)]) sum += std::exp(S[size_t(i * Sk + j)] - mx);
        lse = mx + std::log(sum);
        std::vector<double> acc(static_cast<size_t>(Dv), 0.0);
        for (int64_t j = 0; j < Sk; ++j) {
          if (!visible[size_t(i * Sk + j)]) continue;
          const double p = rnd(std::exp(S[size_t(i * Sk + j)] - mx) / sum);
          for (int64_t d = 0; d < Dv; ++d) acc[size_t(d)] += p * V[size_t(j * Dv + d)];
        }
        for (int64_t d = 0; d < Dv; ++d) o[d] = rnd(acc[size_t(d)]);
      }
    }
  }
  return result;
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

Check check_forward(DType dtype, const std::vector<double>& actual,
                    const std::vector<double>& exact, const std::vector<double>& low_precision) {
  Check c;
  c.max_abs_error = max_abs_error(actual, exact);
  if (dtype == DType::Float32) {
    double largest = 1;
    for (double e : exact)
      if (std::isfinite(e)) largest = std::max(largest, std::abs(e));
    c.tolerance = 1e-5 * largest;
  } else {
    // The floor covers outputs so small that the low-precision error is itself ~0.
    const double floor = dtype == DType::Float16 ? 1e-4 : 5e-4;
    c.tolerance = 2 * max_abs_error(low_precision, exact) + floor;
  }
  return c;
}

}  // namespace flashattn::reference

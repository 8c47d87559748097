// The float64 oracle: implements every step of SPEC.md literally, materialising the scores of
// each (batch, head). Tests and `flashattn run --check` use it; it is never a backend.
//
// It deliberately shares no code with the engines (not even the masking rule), so that a
// mistake there cannot hide by being made twice. Inputs are read through the same strided
// views the engines get, and converted exactly to double.
#pragma once

#include <optional>
#include <vector>

#include "flashattn/flashattn.hpp"

namespace flashattn::reference {

enum class Arithmetic {
  Float64,     // exact: the oracle
  InputDType,  // a plain low-precision implementation: scores, probabilities and output
               // rounded to the input dtype at each step (what SPEC's tolerance rule compares to)
};

struct Result {
  std::vector<double> out;  // dense (B, Sq, H, Dv), varlen (total_q, H, Dv); contiguous
  std::vector<double> lse;  // dense (B, H, Sq), varlen (H, total_q); contiguous
};

// Host tensors only. `varlen` null means a dense batch.
Result forward(const TensorView& q, const TensorView& k, const TensorView& v,
               const Options& options, const Varlen* varlen = nullptr,
               Arithmetic arithmetic = Arithmetic::Float64);

// The elements of a host view in row-major logical order, as double.
std::vector<double> gather(const TensorView& t);

// The accuracy rule of SPEC.md for one output: the largest absolute error of `actual` against
// the oracle, and the tolerance it must stay within. NaN/Inf must match the oracle exactly
// (an unmatched one makes the error infinite).
struct Check {
  double max_abs_error = 0;
  double tolerance = 0;
  bool passed() const { return max_abs_error <= tolerance; }
};

double max_abs_error(const std::vector<double>& actual, const std::vector<double>& exact);

// fp32: within 1e-5 relative to the largest exact magnitude (at least 1).
// fp16/bf16: within 2x (forward) the error of the InputDType implementation, plus a floor.
Check check_forward(DType dtype, const std::vector<double>& actual,
                    const std::vector<double>& exact, const std::vector<double>& low_precision);

}  // namespace flashattn::reference

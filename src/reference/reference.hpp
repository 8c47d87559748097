// The float64 oracle: implements every step of SPEC.md literally, materialising the scores of
// each (batch, head). Tests and `flashattn run --check` use it; it is never a backend.
//
// It deliberately shares no code with the engines (not even the masking rule), so that a
// mistake there cannot hide by being made twice. Inputs are read through the same strided
// views the engines get, and converted exactly to double.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "flashattn/flashattn.hpp"

namespace flashattn::reference {

enum class Arithmetic {
  Float64,     // exact: the oracle
  InputDType,  // a plain low-precision implementation: scores, probabilities and output
               // rounded to the input dtype at each step (what SPEC's tolerance rule compares to);
               // for fp8 e4m3 inputs, scores in fp32, exp(s - max) in e4m3 (as the GPU kernel
               // rounds P for the P V product) and out in bf16 (docs/SPEC.md, "FP8 inputs")
};

struct Result {
  std::vector<double> out;  // dense (B, Sq, H, Dv), varlen (total_q, H, Dv); contiguous
  std::vector<double> lse;  // dense (B, H, Sq), varlen (H, total_q); contiguous; of the
                            // undropped softmax, as FlashAttention returns it
};

// Host tensors only. `varlen` null means a dense batch. FP8 e4m3 inputs are decoded exactly
// and multiplied by options.q_descale/k_descale/v_descale (docs/SPEC.md, "FP8 inputs"). Dropout (options.dropout_p > 0) uses
// the library's own keep bits (common/philox.hpp): the mask is an input of the math, not
// something the oracle could check, and the generator is checked on its own (known answers).
Result forward(const TensorView& q, const TensorView& k, const TensorView& v,
               const Options& options, const Varlen* varlen = nullptr,
               Arithmetic arithmetic = Arithmetic::Float64);

// The gradients of L = sum(dout * out) with respect to q, k and v, from the explicit formulas
// with P materialised: dV = (P o M)^T dO, dP = (dO V^T) o M, D = rowsum(dO o O),
// dS = P o (dP - D), times softcap's derivative 1 - tanh^2, dQ = scale dS K, dK = scale dS^T Q
// (M: dropout's 0 or 1/(1-p) multipliers). dk/dv sum over the query heads of a group; rows
// that see no key, and keys that no row sees, get 0. Layouts as q, k and v, contiguous.
struct Gradients {
  std::vector<double> dq, dk, dv;
};
Gradients backward(const TensorView& q, const TensorView& k, const TensorView& v,
                   const TensorView& dout, const Options& options,
                   const Varlen* varlen = nullptr, Arithmetic arithmetic = Arithmetic::Float64);

// Test hooks. The keep bits of one (b, h) of a call, row-major (Sq, Sk), 1 = kept (all 1
// without dropout). And the dropped probabilities P o M of a dense call, (B, H, Sq, Sk): what
// multiplies V, 0 where masked or dropped.
std::vector<uint8_t> dropout_mask(const Options& options, int64_t b, int64_t h, int64_t seqlen_q,
                                  int64_t seqlen_k);
std::vector<double> dropped_probabilities(const TensorView& q, const TensorView& k,
                                          const TensorView& v, const Options& options);

// What attention_probabilities (flashattn.hpp) must write, computed from the definition: for
// each (b, h) a (rows, cols) matrix, rows x cols = Sq x Sk dense and max_seqlen_q x
// max_seqlen_k varlen, exp(s_ij - max_i) where query i sees key j (negated where dropout
// drops it), 0 elsewhere; and max_i itself, (B, H, rows), -inf for rows that see no key or
// lie past their sequence. Both contiguous.
struct Probabilities {
  std::vector<double> probs, row_max;
};
Probabilities attention_probabilities(const TensorView& q, const TensorView& k,
                                      const Options& options, const Varlen* varlen = nullptr);

// The elements of a host view in row-major logical order, as double.
std::vector<double> gather(const TensorView& t);
// The inverse, for tools that make inputs: writes `values` (one per element of the host view,
// in gather's order) into the view, each rounded to float and then to the view's dtype
// (nearest even); an int32 view takes integers in its range. Throws std::invalid_argument when
// the counts differ or an int32 value is not such an integer.
void scatter(const std::vector<double>& values, const TensorView& t);

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
// fp8 e4m3 inputs (bf16 out): like bf16, against the InputDType implementation that rounds P
// to e4m3 (the kernels' rule).
Check check_forward(DType dtype, const std::vector<double>& actual,
                    const std::vector<double>& exact, const std::vector<double>& low_precision);
// The CPU engine's rule for fp8 e4m3 inputs, which it dequantises exactly and computes in fp32:
// within one bf16 rounding of out plus fp32's error, (2^-8 + 1e-5) times the largest exact
// magnitude.
Check check_forward_dequantised(const std::vector<double>& actual,
                                const std::vector<double>& exact);
// The same for a gradient: fp32 within 1e-5 relative, fp16/bf16 within 3x the InputDType
// implementation's error plus a floor (the larger of the forward's floor and one unit in the
// last place of `call_magnitude` times `floor_scale`: see reference.cpp for the cancellation
// that needs it, and floor_scale below for the factor). For fp32, "relative" is to the largest
// exact element of this gradient or `call_magnitude`, the largest of all three gradients of
// the call: they share the loss's scale, and one of them can be exactly 0 by cancellation
// alone (with a diagonal mask P = 1, so dS = dP - D = 0 up to fp32 rounding of two long dot
// products).
Check check_backward(DType dtype, const std::vector<double>& actual,
                     const std::vector<double>& exact, const std::vector<double>& low_precision,
                     double call_magnitude = 1, double floor_scale = 1);

// The factor check_backward's one-unit-in-the-last-place floor takes for one gradient of a
// call with these options and q's head dim D. The floor stands for dS's error where it
// cancels (reference.cpp); dQ = scale dS K and dK = scale dS^T Q carry that error times the
// softmax scale, and softcap's derivative 1 - tanh^2 <= 1 (ALiBi's bias has none) only
// shrinks it, so for dq and dk the factor is |scale| / (1/sqrt(D)) = |scale| sqrt(D): 1 at the
// default scale (the floor is unchanged there), never below 1 (the floor still covers a
// low-precision error that is 0 by luck at any scale), and 1 for a scale that is not finite
// (its gradients are NaN/Inf, matched exactly). dV = (P o M)^T dO does not involve dS or the
// scale: always 1.
enum class Gradient { dQ, dK, dV };
double floor_scale(Gradient which, const Options& options, int64_t head_dim);
// The largest finite magnitude of any of the gradients (call_magnitude above).
double largest_magnitude(const Gradients& g);

}  // namespace flashattn::reference

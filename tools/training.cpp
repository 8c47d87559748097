// See training.hpp.
#include "training.hpp"

#include <optional>
#include <vector>

namespace flashattn::cli {

RunInfo backward(const ForwardCall& f, const BackwardCall& b, const Execution& execution) {
  if (f.varlen)
    return flashattn::backward_varlen(f.q, f.k, f.v, f.out, b.dout, f.lse, b.dq, b.dk, b.dv,
                                      *f.varlen, f.options, execution);
  return flashattn::backward(f.q, f.k, f.v, f.out, b.dout, f.lse, b.dq, b.dk, b.dv, f.options,
                             execution);
}

GradientCheck check_gradients(const ForwardCall& f, const BackwardCall& b) {
  const Varlen* varlen = f.varlen ? &*f.varlen : nullptr;
  const DType dtype = f.q.dtype;
  const reference::Gradients exact =
      reference::backward(f.q, f.k, f.v, b.dout, f.options, varlen);
  reference::Gradients low_precision;  // empty for fp32: its rule is relative to the oracle
  if (dtype != DType::Float32)
    low_precision = reference::backward(f.q, f.k, f.v, b.dout, f.options, varlen,
                                        reference::Arithmetic::InputDType);
  const double largest = reference::largest_magnitude(exact);
  const int64_t head_dim = f.q.sizes[f.q.ndim - 1];
  const auto check = [&](const TensorView& actual, const std::vector<double>& exact_grad,
                         const std::vector<double>& low_grad, reference::Gradient which) {
    return reference::check_backward(dtype, reference::gather(actual), exact_grad, low_grad,
                                     largest, reference::floor_scale(which, f.options, head_dim));
  };
  GradientCheck c;
  c.dq = check(b.dq, exact.dq, low_precision.dq, reference::Gradient::dQ);
  c.dk = check(b.dk, exact.dk, low_precision.dk, reference::Gradient::dK);
  c.dv = check(b.dv, exact.dv, low_precision.dv, reference::Gradient::dV);
  return c;
}

}  // namespace flashattn::cli

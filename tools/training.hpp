// The training steps of `flashattn run --backward`: the library's backward call (dense or
// varlen, like the forward it follows) and the accuracy check of its gradients. run.cpp makes
// the problem, times the calls and reports; this is what it calls for the backward pass.
#pragma once

#include "flashattn/flashattn.hpp"
#include "reference/reference.hpp"
#include "runner.hpp"

namespace flashattn::cli {

// flashattn::backward, or backward_varlen when the forward was ragged, with the forward's
// views, options and varlen lengths (the same views the forward got: host or device).
RunInfo backward(const ForwardCall& forward, const BackwardCall& backward,
                 const Execution& execution);

// docs/SPEC.md's accuracy rule for the gradients, on host views: dq, dk and dv against reference::backward
// (float64, the same dropout keep bits); fp16/bf16 within 3x the error of the plain
// low-precision implementation plus a floor, fp32 within 1e-5 relative to the call's largest
// gradient.
struct GradientCheck {
  reference::Check dq, dk, dv;
  bool passed() const { return dq.passed() && dk.passed() && dv.passed(); }
};
GradientCheck check_gradients(const ForwardCall& host, const BackwardCall& host_backward);

}  // namespace flashattn::cli

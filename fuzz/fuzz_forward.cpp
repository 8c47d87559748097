// libFuzzer target for fa_forward on the CPU backend (issue 34). The fuzzer's bytes decide
// the shapes, dtypes, strides (contiguous, head-major, padded, or anything: negative, zero,
// overlapping), null and misaligned pointers, the lse tensor and the options; every buffer
// is allocated to cover exactly the elements its sizes and strides claim, so that
// AddressSanitizer sees any access outside them. Then:
//   - a rejected call must leave out and lse byte for byte as they were and set a message;
//   - an accepted call must match the float64 reference (SPEC.md's accuracy rule), and must
//     not have been given an output that overlaps itself or an input (SPEC.md: rejected).
// Any breach aborts, which libFuzzer reports with the input that caused it.
#include <cstdint>
#include <cstring>
#include <vector>

#include "fuzz_common.hpp"

namespace {

using fuzz::Buffer;
using fuzz::Bytes;
using fuzz::fail;
using fuzz::pick_dtype;

fuzz::Stats stats;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::target_name = "fuzz_forward";
  Bytes in(data, size);
  // Small shapes (the reference materialises the scores), with some of them invalid.
  const int64_t B = in.between(0, 3), Sq = in.between(0, 19), Sk = in.between(0, 19);
  const int64_t H = in.between(1, 6), Hk = in.flag(4) ? in.between(0, 6) : H / std::max<int64_t>(1, in.between(1, 3));
  const int64_t D = in.flag(8) ? in.between(0, 300) : in.between(1, 40);
  const int64_t Dv = in.flag(8) ? in.between(0, 40) : D;
  const int32_t dtype = pick_dtype(in);
  const auto dims = [&](int64_t s, int64_t h, int64_t d) {
    std::vector<int64_t> sizes = {B, s, h, d};
    if (in.flag(32)) sizes.pop_back();        // a 3-D tensor
    if (in.flag(32)) sizes.push_back(2);      // a 5-D one
    return sizes;
  };
  const int layout = static_cast<int>(in.below(8) < 5 ? 0 : in.below(4));
  Buffer q(in, in.flag(16) ? pick_dtype(in) : dtype, dims(Sq, H, D), layout, true);
  Buffer k(in, in.flag(16) ? pick_dtype(in) : dtype, dims(Sk, Hk, D), layout, true);
  Buffer v(in, in.flag(16) ? pick_dtype(in) : dtype, dims(Sk, Hk, Dv), layout, true);
  Buffer out(in, in.flag(16) ? pick_dtype(in) : dtype, dims(Sq, H, Dv), in.flag(4) ? 3 : 0, true);
  const bool with_lse = !in.flag(4);
  Buffer lse(in, in.flag(16) ? pick_dtype(in) : FA_FLOAT32, {B, H, in.flag(16) ? Sq + 1 : Sq}, in.flag(8) ? 3 : 0, false);
  q.fill_random(in);
  k.fill_random(in);
  v.fill_random(in);

  fa_options options;
  fa_options_init(&options);
  options.causal = in.flag();
  options.window_left = in.flag(3) ? in.between(-3, 8) : -1;
  options.window_right = in.flag(3) ? in.between(-3, 8) : -1;
  const float scales[] = {0.3f, -0.7f, 0.0f, INFINITY, NAN};
  if (in.flag(4)) {
    options.has_softmax_scale = 1;
    options.softmax_scale = scales[in.below(5)];
  }
  const float caps[] = {0.0f, 0.5f, 30.0f, -1.0f, NAN};
  options.softcap = in.flag(3) ? caps[in.below(5)] : 0.0f;
  const float drops[] = {0.0f, 0.25f, 0.9f, 1.0f, -0.5f};
  options.dropout_p = in.flag(4) ? drops[in.below(5)] : 0.0f;
  options.dropout_seed = in.below(1000);
  Buffer slopes(in, FA_FLOAT32, in.flag() ? std::vector<int64_t>{H} : std::vector<int64_t>{B, H + in.between(-1, 1)}, 0, false);
  slopes.fill_slopes();
  if (in.flag(4)) options.alibi_slopes = &slopes.t;
  fa_execution execution;
  fa_execution_init(&execution);
  execution.backend = FA_BACKEND_CPU;
  execution.num_threads = static_cast<int32_t>(in.between(0, 2));
  fa_run_info info;
  fa_run_info_init(&info);

  const fa_status status = fa_forward(&q.t, &k.t, &v.t, &out.t, with_lse ? &lse.t : nullptr, &options,
                                      &execution, &info);
  ++stats.calls;
  if (status != FA_OK) {
    if (!out.untouched() || !lse.untouched()) fail("a rejected call wrote its outputs");
    if (std::strlen(fa_last_error()) == 0) fail("a rejected call set no message");
    return 0;
  }
  ++stats.accepted;
  // Accepted: the contract's preconditions held...
  for (const Buffer* o : {&out, with_lse ? &lse : nullptr}) {
    if (o == nullptr) continue;
    if (o->self_overlapping()) fail("an output whose elements share memory was accepted");
    for (const Buffer* i : {&q, &k, &v})
      if (o->overlaps(*i)) fail("an output overlapping an input was accepted");
  }
  if (out.overlaps(lse) && with_lse) fail("out overlapping lse was accepted");
  // ... and the answer is the reference's.
  const flashattn::Options o = fuzz::reference_options(options, &slopes);
  const flashattn::reference::Result exact = flashattn::reference::forward(q.view(), k.view(), v.view(), o);
  std::vector<double> low;
  if (q.t.dtype != FA_FLOAT32)
    low = flashattn::reference::forward(q.view(), k.view(), v.view(), o, nullptr,
                                        flashattn::reference::Arithmetic::InputDType).out;
  fuzz::expect_output(q.t.dtype, flashattn::reference::gather(out.view()), exact.out, low, "out");
  if (with_lse) fuzz::expect_lse(flashattn::reference::gather(lse.view()), exact.lse);
  return 0;
}

// libFuzzer target for fa_forward on the CPU backend (issue 34). The fuzzer's bytes decide
// the shapes, dtypes, strides (contiguous, head-major, padded, or anything: negative, zero,
// overlapping), null and misaligned pointers, the lse tensor and the options; every buffer
// is allocated to cover exactly the elements its sizes and strides claim, so that
// AddressSanitizer sees any access outside them. Then:
//   - a rejected call must leave out and lse byte for byte as they were and set a message;
//   - an accepted call must match the float64 reference (SPEC.md's accuracy rule), and must
//     not have been given an output that overlaps itself or an input (SPEC.md: rejected).
// Any breach aborts, which libFuzzer reports with the input that caused it.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "flashattn/flashattn.h"
#include "flashattn/flashattn.hpp"
#include "reference/reference.hpp"

namespace {

// The fuzzer's bytes as a stream of small choices; past the end every choice is 0.
class Bytes {
 public:
  Bytes(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  uint32_t below(uint32_t n) { return n == 0 ? 0 : next() % n; }
  int32_t between(int32_t lo, int32_t hi) { return lo + static_cast<int32_t>(below(static_cast<uint32_t>(hi - lo + 1))); }
  bool flag(uint32_t one_in = 2) { return below(one_in) == 0; }

 private:
  uint32_t next() {
    uint32_t v = 0;
    for (int i = 0; i < 2; ++i) v = v << 8 | (at_ < size_ ? data_[at_++] : 0);
    return v;
  }
  const uint8_t* data_;
  size_t size_, at_ = 0;
};

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "fuzz_forward: %s (last error: %s)\n", what, fa_last_error());
  std::abort();
}

constexpr uint8_t kPoison = 0xA5;

size_t element_size(int32_t dtype) {
  switch (dtype) {
    case FA_FLOAT32: case FA_INT32: return 4;
    case FA_FLOAT16: case FA_BFLOAT16: return 2;
    default: return 1;  // an invalid dtype still gets a buffer
  }
}

// A host tensor whose storage covers exactly the elements its sizes and strides address.
struct Buffer {
  std::vector<uint8_t> storage;
  fa_tensor t{};
  int64_t lo = 0, hi = -1;  // the byte range [lo, hi] of the elements, relative to t.data

  // sizes in row-major order; strides by `layout`: 0 contiguous, 1 the first two dimensions'
  // roles swapped (head-major), 2 rows padded, 3 every stride from the bytes.
  Buffer(Bytes& in, int32_t dtype, std::vector<int64_t> sizes, int layout, bool allow_misaligned) {
    t.dtype = dtype;
    t.device_type = FA_DEVICE_CPU;
    t.ndim = static_cast<int32_t>(sizes.size());
    int64_t stride = 1;
    std::vector<int64_t> strides(sizes.size());
    for (int d = t.ndim - 1; d >= 0; --d) {
      strides[static_cast<size_t>(d)] = stride;
      stride *= std::max<int64_t>(1, sizes[static_cast<size_t>(d)]) + (layout == 2 && d == t.ndim - 1 ? 3 : 0);
    }
    if (layout == 1 && t.ndim >= 3) std::swap(strides[1], strides[2]);
    if (layout == 3)
      for (auto& s : strides) s = in.between(-9, 70);
    for (int d = 0; d < t.ndim; ++d) {
      t.sizes[d] = sizes[static_cast<size_t>(d)];
      t.strides[d] = strides[static_cast<size_t>(d)];
    }
    const int64_t elem = static_cast<int64_t>(element_size(dtype));
    int64_t min_e = 0, max_e = 0;
    bool empty = false;
    for (int d = 0; d < t.ndim; ++d) {
      if (t.sizes[d] <= 0) empty = true;
      const int64_t reach = (t.sizes[d] - 1) * t.strides[d];
      (reach < 0 ? min_e : max_e) += reach;
    }
    const bool misaligned = allow_misaligned && in.flag(16);
    const int64_t bytes = empty ? 0 : (max_e - min_e + 1) * elem;
    storage.assign(static_cast<size_t>(bytes + (misaligned ? 1 : 0)), kPoison);
    if (!empty) {
      lo = min_e * elem;
      hi = max_e * elem + elem - 1;
    }
    t.data = storage.empty() ? nullptr : storage.data() + (misaligned ? 1 : 0) - min_e * elem;
    if (in.flag(64)) t.data = nullptr;  // a null pointer now and then
  }
  void fill_random(Bytes& in) {
    // Finite values; where strides overlap, the last write wins (the reference reads the same).
    const uint32_t seed = in.below(65536);
    uint32_t state = seed * 2654435761u + 1;
    for (size_t i = 0; i < storage.size(); ++i) storage[i] = static_cast<uint8_t>((state = state * 1664525u + 1013904223u) >> 24);
    // Bit patterns of random bytes are often NaN or huge: give floats moderate values.
    if (t.dtype == FA_FLOAT32)
      for (size_t i = 0; i + 3 < storage.size(); i += 4) {
        const float v = static_cast<float>(static_cast<int>(storage[i]) - 128) / 64.0f;
        std::memcpy(&storage[i], &v, 4);
      }
    if (t.dtype == FA_FLOAT16 || t.dtype == FA_BFLOAT16)
      for (size_t i = 1; i < storage.size(); i += 2) storage[i] = static_cast<uint8_t>((t.dtype == FA_FLOAT16 ? 0x38 : 0x3F) + (storage[i] & 1) * 0x80);
  }
  bool overlaps(const Buffer& other) const {
    if (hi < lo || other.hi < other.lo || t.data == nullptr || other.t.data == nullptr) return false;
    const auto a = reinterpret_cast<intptr_t>(t.data), b = reinterpret_cast<intptr_t>(other.t.data);
    return a + lo <= b + other.hi && b + other.lo <= a + hi;
  }
  // Whether two elements share memory (strides that alias within the tensor).
  bool self_overlapping() const {
    std::vector<uint8_t> seen(storage.size(), 0);
    if (t.data == nullptr || hi < lo) return false;
    const int64_t elem = static_cast<int64_t>(element_size(t.dtype));
    int64_t index[FA_MAX_DIMS] = {};
    for (;;) {
      int64_t offset = 0;
      for (int d = 0; d < t.ndim; ++d) offset += index[d] * t.strides[d];
      const int64_t byte = reinterpret_cast<const uint8_t*>(t.data) - storage.data() + offset * elem;
      for (int64_t b = 0; b < elem; ++b)
        if (seen[static_cast<size_t>(byte + b)]++) return true;
      int d = t.ndim - 1;
      while (d >= 0 && ++index[d] == t.sizes[d]) index[d--] = 0;
      if (d < 0) return false;
    }
  }
  bool untouched() const {
    for (uint8_t b : storage)
      if (b != kPoison) return false;
    return true;
  }
  flashattn::TensorView view() const {
    flashattn::TensorView v;
    v.data = t.data;
    v.dtype = static_cast<flashattn::DType>(t.dtype);
    v.ndim = t.ndim;
    for (int d = 0; d < t.ndim; ++d) {
      v.sizes[static_cast<size_t>(d)] = t.sizes[d];
      v.strides[static_cast<size_t>(d)] = t.strides[d];
    }
    return v;
  }
};

// FUZZ_STATS=1: how many calls were accepted (and checked against the reference), printed
// at exit, to see that the inputs reach the engine and not only the validation.
struct Stats {
  long calls = 0, accepted = 0;
  ~Stats() {
    if (std::getenv("FUZZ_STATS") != nullptr)
      std::fprintf(stderr, "fuzz_forward: %ld of %ld calls accepted and checked\n", accepted, calls);
  }
} stats;

int32_t pick_dtype(Bytes& in) {
  const int32_t dtypes[] = {FA_FLOAT32, FA_FLOAT32, FA_FLOAT16, FA_BFLOAT16, FA_INT32, 7};
  return dtypes[in.below(6)];
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
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
  for (size_t i = 0; i + 3 < slopes.storage.size(); i += 4) {
    const float s = 0.125f * static_cast<float>(i / 4 % 5);
    std::memcpy(&slopes.storage[i], &s, 4);
  }
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
  flashattn::Options o;
  o.softmax_scale = options.has_softmax_scale ? std::optional<float>(options.softmax_scale) : std::nullopt;
  o.causal = options.causal != 0;
  o.window_left = options.window_left;
  o.window_right = options.window_right;
  o.softcap = options.softcap;
  o.dropout_p = options.dropout_p;
  o.dropout_seed = options.dropout_seed;
  o.dropout_offset = options.dropout_offset;
  if (options.alibi_slopes != nullptr) o.alibi_slopes = slopes.view();
  const flashattn::reference::Result exact = flashattn::reference::forward(q.view(), k.view(), v.view(), o);
  const auto dt = static_cast<flashattn::DType>(q.t.dtype);
  std::vector<double> low;
  if (dt != flashattn::DType::Float32)
    low = flashattn::reference::forward(q.view(), k.view(), v.view(), o, nullptr,
                                        flashattn::reference::Arithmetic::InputDType).out;
  const flashattn::reference::Check check =
      flashattn::reference::check_forward(dt, flashattn::reference::gather(out.view()), exact.out, low);
  if (!check.passed()) {
    std::fprintf(stderr, "out: max abs error %g > tolerance %g\n", check.max_abs_error, check.tolerance);
    fail("an accepted call's out differs from the reference");
  }
  if (with_lse) {
    const std::vector<double> got = flashattn::reference::gather(lse.view());
    for (size_t i = 0; i < got.size(); ++i) {
      const double e = exact.lse[i];
      const bool same = (std::isnan(e) && std::isnan(got[i])) || got[i] == e ||
                        std::abs(got[i] - e) <= 1e-3 * std::max(1.0, std::abs(e));
      if (!same) fail("an accepted call's lse differs from the reference");
    }
  }
  return 0;
}

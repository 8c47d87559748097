// What every libFuzzer target of the C ABI shares (issue 34): the byte-stream chooser, failure
// reporting, host buffers that cover exactly what their views claim (so AddressSanitizer sees
// any access outside them) and start poisoned (so a write shows), int32 index tensors, the
// options as the reference takes them, and the float64 reference comparisons under
// docs/SPEC.md's accuracy rule. Header-only: each target is one translation unit.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <vector>

#include "flashattn/flashattn.h"
#include "flashattn/flashattn.hpp"
#include "reference/reference.hpp"

namespace fuzz {

// The target's name, for messages ("fuzz_forward"); each target sets it once.
inline const char* target_name = "fuzz";

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

// A breach of the contract: abort, which libFuzzer reports with the input that caused it.
[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "%s: %s (last error: %s)\n", target_name, what, fa_last_error());
  std::abort();
}

constexpr uint8_t kPoison = 0xA5;

inline size_t element_size(int32_t dtype) {
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

  Buffer() = default;
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
  // Never copied: a copy's t.data would point into the original. A move keeps the vector's
  // heap block, so t.data stays valid (but pointers to the moved-from fa_tensor do not).
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&&) = default;
  Buffer& operator=(Buffer&&) = default;

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
  // Element e (row-major logical order) of the view, as an element offset from t.data.
  int64_t offset_of(int64_t e) const {
    int64_t offset = 0;
    for (int d = t.ndim - 1; d >= 0; --d) {
      const int64_t n = std::max<int64_t>(1, t.sizes[d]);
      offset += e % n * t.strides[d];
      e /= n;
    }
    return offset;
  }
  int64_t numel() const {
    int64_t n = 1;
    for (int d = 0; d < t.ndim; ++d) n *= std::max<int64_t>(0, t.sizes[d]);
    return n;
  }
  // Writes raw 32-bit values in logical order, whatever the dtype says (an index tensor given
  // as fp32 still holds the integers' bits); a buffer too narrow for them takes nothing. Where
  // strides alias, the last write wins: read the values back with int32_values().
  void write_int32(const std::vector<int32_t>& values) {
    if (t.data == nullptr || element_size(t.dtype) != 4 || hi < lo) return;
    const int64_t n = std::min<int64_t>(numel(), static_cast<int64_t>(values.size()));
    for (int64_t e = 0; e < n; ++e)
      std::memcpy(static_cast<uint8_t*>(t.data) + offset_of(e) * 4, &values[static_cast<size_t>(e)], 4);
  }
  std::vector<int32_t> int32_values() const {
    std::vector<int32_t> values(static_cast<size_t>(numel()));
    for (size_t e = 0; e < values.size(); ++e)
      std::memcpy(&values[e], static_cast<const uint8_t*>(t.data) + offset_of(static_cast<int64_t>(e)) * 4, 4);
    return values;
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
  // Whether element e (logical order) still holds the poison.
  bool element_untouched(int64_t e) const {
    const size_t elem = element_size(t.dtype);
    const uint8_t* at = static_cast<const uint8_t*>(t.data) + offset_of(e) * static_cast<int64_t>(elem);
    for (size_t i = 0; i < elem; ++i)
      if (at[i] != kPoison) return false;
    return true;
  }
  // Whether every byte of the storage that is no element's (between the rows of a strided
  // view, or a misaligned view's first byte) still holds the poison.
  bool untouched_outside_elements() const {
    if (t.data == nullptr) return untouched();
    std::vector<uint8_t> mine(storage.size(), 0);
    const size_t elem = element_size(t.dtype);
    const auto base = static_cast<const uint8_t*>(t.data) - storage.data();
    for (int64_t e = 0; e < numel(); ++e)
      for (size_t b = 0; b < elem; ++b) mine[static_cast<size_t>(base + offset_of(e) * static_cast<int64_t>(elem)) + b] = 1;
    for (size_t b = 0; b < mine.size(); ++b)
      if (!mine[b] && storage[b] != kPoison) return false;
    return true;
  }
  // Element e (logical order) set to NaN, for rows a call must not read (fp32, fp16 and bf16;
  // any other dtype is left as it is).
  void write_nan(int64_t e) {
    uint8_t* at = static_cast<uint8_t*>(t.data) + offset_of(e) * static_cast<int64_t>(element_size(t.dtype));
    if (t.dtype == FA_FLOAT32) {
      const uint32_t nan = 0x7FC00000u;
      std::memcpy(at, &nan, 4);
    } else if (t.dtype == FA_FLOAT16 || t.dtype == FA_BFLOAT16) {
      const uint16_t nan = t.dtype == FA_FLOAT16 ? 0x7E00 : 0x7FC0;
      std::memcpy(at, &nan, 2);
    }
  }
  // ALiBi slopes 0, 0.125, .., 0.5, repeating: small enough that no score underflows.
  void fill_slopes() {
    for (size_t i = 0; i + 3 < storage.size(); i += 4) {
      const float s = 0.125f * static_cast<float>(i / 4 % 5);
      std::memcpy(&storage[i], &s, 4);
    }
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

// A contiguous host tensor of `dtype` holding `values` (rounded as reference::scatter rounds:
// to float, then to the dtype), for the reference's inputs that the harness builds itself.
struct Dense {
  std::vector<uint8_t> storage;
  flashattn::TensorView v;
  Dense(int32_t dtype, const std::vector<int64_t>& sizes, const std::vector<double>& values) {
    int64_t n = 1;
    for (int64_t s : sizes) n *= s;
    storage.assign(static_cast<size_t>(std::max<int64_t>(n, 1)) * element_size(dtype), 0);
    v.data = storage.data();
    v.dtype = static_cast<flashattn::DType>(dtype);
    v.ndim = static_cast<int>(sizes.size());
    int64_t stride = 1;
    for (int d = v.ndim - 1; d >= 0; --d) {
      v.sizes[static_cast<size_t>(d)] = sizes[static_cast<size_t>(d)];
      v.strides[static_cast<size_t>(d)] = stride;
      stride *= std::max<int64_t>(1, sizes[static_cast<size_t>(d)]);
    }
    flashattn::reference::scatter(values, v);
  }
  Dense(const Dense&) = delete;
  Dense& operator=(const Dense&) = delete;
};

// FUZZ_STATS=1: how many calls were accepted (and checked against the reference), printed
// at exit, to see that the inputs reach the engine and not only the validation.
struct Stats {
  long calls = 0, accepted = 0;
  ~Stats() {
    if (std::getenv("FUZZ_STATS") != nullptr)
      std::fprintf(stderr, "%s: %ld of %ld calls accepted and checked\n", target_name, accepted, calls);
  }
};

inline int32_t pick_dtype(Bytes& in) {
  const int32_t dtypes[] = {FA_FLOAT32, FA_FLOAT32, FA_FLOAT16, FA_BFLOAT16, FA_INT32, 7};
  return dtypes[in.below(6)];
}

// An index tensor: int32 (n), contiguous, holding `values`; one time in `one_in` each, another
// dtype, a length one off, strides from the bytes; and Buffer's null and misaligned pointers.
inline Buffer index_tensor(Bytes& in, const std::vector<int32_t>& values, int64_t n, uint32_t one_in) {
  const int32_t dtype = in.flag(one_in) ? pick_dtype(in) : FA_INT32;
  const int64_t size = in.flag(one_in) ? n + in.between(-1, 1) : n;
  const int layout = in.flag(one_in) ? 3 : 0;
  Buffer b(in, dtype, {size}, layout, true);
  b.write_int32(values);
  return b;
}

// One time in `one_in`, damages one entry of the values an index tensor is meant to hold:
// anything near [0, range], one less or one more than meant (a prefix sum that decreases or
// passes the total, a negative length, one past a bound), two entries swapped, or an extreme.
inline void damage(Bytes& in, std::vector<int32_t>& v, int32_t range, uint32_t one_in) {
  if (v.empty() || !in.flag(one_in)) return;
  const size_t at = in.below(static_cast<uint32_t>(v.size()));
  switch (in.below(5)) {
    case 0: v[at] = in.between(-3, range + 3); break;
    case 1: v[at] -= 1; break;
    case 2: v[at] += 1; break;
    case 3: std::swap(v[at], v[in.below(static_cast<uint32_t>(v.size()))]); break;
    default: v[at] = in.flag() ? INT32_MIN : INT32_MAX; break;
  }
}

// The float dtypes a call accepts (fp32 twice as often), and now and then any dtype.
inline int32_t pick_float_dtype(Bytes& in) {
  const int32_t dtypes[] = {FA_FLOAT32, FA_FLOAT32, FA_FLOAT16, FA_BFLOAT16};
  return in.flag(16) ? pick_dtype(in) : dtypes[in.below(4)];
}

// The C options as the reference takes them (alibi_slopes: the buffer options points at).
inline flashattn::Options reference_options(const fa_options& options, const Buffer* slopes) {
  flashattn::Options o;
  o.softmax_scale = options.has_softmax_scale ? std::optional<float>(options.softmax_scale) : std::nullopt;
  o.causal = options.causal != 0;
  o.window_left = options.window_left;
  o.window_right = options.window_right;
  o.softcap = options.softcap;
  o.dropout_p = options.dropout_p;
  o.dropout_seed = options.dropout_seed;
  o.dropout_offset = options.dropout_offset;
  if (options.alibi_slopes != nullptr && slopes != nullptr) o.alibi_slopes = slopes->view();
  return o;
}

// An output against the float64 reference (`low`: the InputDType reference, fp16/bf16 only).
inline void expect_output(int32_t dtype, const std::vector<double>& got, const std::vector<double>& exact,
                          const std::vector<double>& low, const char* what) {
  const flashattn::reference::Check check =
      flashattn::reference::check_forward(static_cast<flashattn::DType>(dtype), got, exact, low);
  if (!check.passed()) {
    std::fprintf(stderr, "%s: max abs error %g > tolerance %g\n", what, check.max_abs_error, check.tolerance);
    fail("an accepted call's output differs from the reference");
  }
}

// lse, computed in fp32 whatever the dtype: 1e-3 relative (at least 1e-3 absolute), and NaN
// and infinities exactly where the reference has them.
inline void expect_lse(const std::vector<double>& got, const std::vector<double>& exact) {
  if (got.size() != exact.size()) fail("lse: the reference has another element count");
  for (size_t i = 0; i < got.size(); ++i) {
    const double e = exact[i];
    const bool same = (std::isnan(e) && std::isnan(got[i])) || got[i] == e ||
                      std::abs(got[i] - e) <= 1e-3 * std::max(1.0, std::abs(e));
    if (!same) {
      std::fprintf(stderr, "lse[%zu]: %g, reference %g\n", i, got[i], e);
      fail("an accepted call's lse differs from the reference");
    }
  }
}

}  // namespace fuzz

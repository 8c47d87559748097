#include "api/validate.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda/devices.hpp"

namespace flashattn::detail {
namespace {

std::string shape_string(const TensorView& t) {
  std::string s = "(";
  for (int i = 0; i < t.ndim; ++i) {
    if (i) s += ", ";
    s += std::to_string(t.sizes[static_cast<size_t>(i)]);
  }
  return s + ")";
}

std::string strides_string(const TensorView& t) {
  std::string s = "(";
  for (int i = 0; i < t.ndim; ++i) {
    if (i) s += ", ";
    s += std::to_string(t.strides[static_cast<size_t>(i)]);
  }
  return s + ")";
}

std::string shape_string(std::initializer_list<int64_t> sizes) {
  std::string s = "(";
  bool first = true;
  for (int64_t x : sizes) {
    if (!first) s += ", ";
    s += std::to_string(x);
    first = false;
  }
  return s + ")";
}

std::string dimensions_string(int n) {
  return std::to_string(n) + (n == 1 ? " dimension" : " dimensions");
}

std::string device_string(Device d) {
  switch (d.type) {
    case DeviceType::CPU:
      return d.index == 0 ? "cpu" : "cpu:" + std::to_string(d.index);
    case DeviceType::CUDA:
      return "cuda:" + std::to_string(d.index);
  }
  return "unknown device type " + std::to_string(static_cast<int>(d.type));
}

std::string number_string(double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

[[noreturn]] void fail(const std::string& argument, const std::string& expected,
                       const std::string& given) {
  throw Error(ErrorCode::InvalidArgument, argument, expected, given);
}

[[noreturn]] void unsupported(const std::string& argument, const std::string& expected,
                              const std::string& given) {
  throw Error(ErrorCode::Unsupported, argument, expected, given);
}

bool is_known_dtype(DType d) {
  return d == DType::Float32 || d == DType::Float16 || d == DType::BFloat16 || d == DType::Int32;
}

// [lowest, highest] element offsets a view can touch; false when it touches nothing.
struct Extent {
  int64_t lo = 0, hi = 0;
  bool empty = true;
};

// Structural checks every tensor argument gets: known dtype and device, rank, sizes,
// strides, a non-null pointer when it has elements, and offsets that fit in 64 bits.
Extent check_view(const std::string& name, const TensorView& t, int ndim) {
  if (t.ndim != ndim) {
    std::string given = dimensions_string(t.ndim);
    if (t.ndim > 0 && t.ndim <= kMaxDims) given.append(" ").append(shape_string(t));
    fail(name, dimensions_string(ndim), given);
  }
  if (!is_known_dtype(t.dtype))
    fail(name, "a dtype among fp32, fp16, bf16, int32",
         "dtype code " + std::to_string(static_cast<int>(t.dtype)));
  if (t.device.type != DeviceType::CPU && t.device.type != DeviceType::CUDA)
    fail(name, "device type cpu or cuda", device_string(t.device));
  if (t.device.index < 0)
    fail(name, "a device index >= 0", std::to_string(t.device.index));
  if (t.device.type == DeviceType::CPU && t.device.index != 0)
    fail(name, "device index 0 for host memory", device_string(t.device));
  for (int i = 0; i < ndim; ++i) {
    if (t.sizes[static_cast<size_t>(i)] < 0)
      fail(name, "sizes >= 0", shape_string(t));
    if (t.strides[static_cast<size_t>(i)] < 0)
      fail(name, "strides >= 0", "strides " + strides_string(t));
  }
  const size_t last = static_cast<size_t>(ndim - 1);
  if (t.sizes[last] > 1 && t.strides[last] != 1)
    fail(name, "a contiguous last dimension (stride 1)", "strides " + strides_string(t));

  // The element count must be computed without wrapping: a product that wraps to 0 would
  // make a huge tensor look empty and skip the checks below.
  int64_t count = 1;
  for (int i = 0; i < ndim; ++i)
    if (__builtin_mul_overflow(count, t.sizes[static_cast<size_t>(i)], &count))
      count = -1;  // sticky: only a later size of 0 can make it empty again
  bool empty = false;
  for (int i = 0; i < ndim; ++i) empty = empty || t.sizes[static_cast<size_t>(i)] == 0;
  Extent e;
  if (empty) return e;
  if (count < 0)
    fail(name, "an element count that fits in 64 bits", "shape " + shape_string(t));
  if (t.data == nullptr) fail(name, "a non-null data pointer", "null with shape " + shape_string(t));
  int64_t hi = 0;
  for (int i = 0; i < ndim; ++i) {
    int64_t span = 0;
    if (__builtin_mul_overflow(t.sizes[static_cast<size_t>(i)] - 1,
                               t.strides[static_cast<size_t>(i)], &span) ||
        __builtin_add_overflow(hi, span, &hi))
      fail(name, "element offsets that fit in 64 bits",
           "shape " + shape_string(t) + " with strides " + strides_string(t));
  }
  int64_t end_byte = 0;
  if (__builtin_add_overflow(hi, 1, &end_byte) ||
      __builtin_mul_overflow(end_byte, static_cast<int64_t>(dtype_size(t.dtype)), &end_byte))
    fail(name, "a byte extent that fits in 64 bits",
         "shape " + shape_string(t) + " with strides " + strides_string(t));
  e.lo = 0;
  e.hi = hi;
  e.empty = false;
  return e;
}

// Distinct elements of an output must not share memory, or one write would clobber another.
void check_no_self_overlap(const std::string& name, const TensorView& t) {
  if (t.numel() == 0) return;  // nothing is written, whatever the strides
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of dims with size > 1
  for (int i = 0; i < t.ndim; ++i)
    if (t.sizes[static_cast<size_t>(i)] > 1)
      dims.emplace_back(t.strides[static_cast<size_t>(i)], t.sizes[static_cast<size_t>(i)]);
  std::sort(dims.begin(), dims.end());
  int64_t covered = 1;  // elements spanned by the faster dims so far
  for (auto [stride, size] : dims) {
    if (stride < covered)
      fail(name, "strides under which no two elements share memory",
           "shape " + shape_string(t) + " with strides " + strides_string(t));
    covered = stride * size;
  }
}

struct Range {
  const char* begin;
  const char* end;  // one past the last byte
};

Range byte_range(const TensorView& t, const Extent& e) {
  const char* base = static_cast<const char*>(t.data);
  const size_t elem = dtype_size(t.dtype);
  return {base + e.lo * static_cast<int64_t>(elem), base + (e.hi + 1) * static_cast<int64_t>(elem)};
}

// An output that overlaps an input would change the input while it is still being read.
void check_disjoint(const std::string& out_name, const TensorView& out, const Extent& out_extent,
                    const std::string& in_name, const TensorView& in, const Extent& in_extent) {
  if (out_extent.empty || in_extent.empty || out.device.type != in.device.type) return;
  const Range a = byte_range(out, out_extent), b = byte_range(in, in_extent);
  if (a.begin < b.end && b.begin < a.end)
    fail(out_name, "memory disjoint from " + in_name,
         "a view overlapping " + in_name + "'s memory");
}

const char* name_of(const TensorView& t, const TensorView& q, const TensorView& k,
                    const TensorView& v) {
  return &t == &q ? "q" : &t == &k ? "k" : &t == &v ? "v" : "out";
}

// 16-byte rows: the base pointer and every stride but the last a multiple of 16 bytes.
void check_rows_aligned(const std::string& name, const TensorView& t) {
  const int64_t elems_per_16_bytes = 16 / static_cast<int64_t>(dtype_size(t.dtype));
  bool aligned = reinterpret_cast<uintptr_t>(t.data) % 16 == 0;
  for (int d = 0; d + 1 < t.ndim; ++d)
    aligned = aligned && (t.sizes[static_cast<size_t>(d)] <= 1 ||
                          t.strides[static_cast<size_t>(d)] % elems_per_16_bytes == 0);
  if (!aligned)
    fail(name,
         "16-byte aligned rows for the cuda backend (a 16-byte aligned pointer and strides that "
         "are multiples of " + std::to_string(elems_per_16_bytes) + " elements)",
         "strides " + strides_string(t) + (reinterpret_cast<uintptr_t>(t.data) % 16
                                                ? " with a pointer misaligned by " +
                                                      std::to_string(reinterpret_cast<uintptr_t>(t.data) % 16) +
                                                      " bytes"
                                                : std::string()));
}

void check_pointer_location(const std::string& name, const TensorView& t) {
  if (t.data == nullptr || t.numel() == 0) return;
  const cuda::PointerLocation where = cuda::locate(t.data);
  if (where.kind == cuda::PointerLocation::Unknown) return;
  if (t.device.type == DeviceType::CPU && where.kind == cuda::PointerLocation::Device)
    fail(name, "host memory, as its device (cpu) says",
         "a pointer to memory on cuda:" + std::to_string(where.device));
  if (t.device.type == DeviceType::CUDA) {
    if (where.kind == cuda::PointerLocation::Host)
      fail(name, "memory on " + device_string(t.device) + ", as its device says",
           "a pointer to host memory");
    if (where.kind == cuda::PointerLocation::Device && where.device != t.device.index)
      fail(name, "memory on " + device_string(t.device) + ", as its device says",
           "a pointer to memory on cuda:" + std::to_string(where.device));
  }
}

void check_dtype(const std::string& name, const TensorView& t, DType expected) {
  if (t.dtype != expected)
    fail(name, std::string("dtype ") + dtype_name(expected),
         std::string("dtype ") + dtype_name(t.dtype));
}

void check_same_device(const std::string& name, const TensorView& t, const TensorView& q) {
  if (t.device.type != q.device.type || t.device.index != q.device.index)
    fail(name, "the device of q (" + device_string(q.device) + ")", device_string(t.device));
}

void check_shape(const std::string& name, const TensorView& t,
                 std::initializer_list<int64_t> expected, const std::string& layout) {
  size_t i = 0;
  for (int64_t size : expected) {
    if (t.sizes[i] != size)
      fail(name, "shape " + shape_string(expected) + " " + layout, "shape " + shape_string(t));
    ++i;
  }
}

bool is_row_major(const TensorView& t) {
  int64_t expected = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    const size_t d = static_cast<size_t>(i);
    if (t.sizes[d] > 1 && t.strides[d] != expected) return false;
    expected *= t.sizes[d];
  }
  return true;
}

void check_contiguous(const std::string& name, const TensorView& t) {
  if (!is_row_major(t))
    fail(name, "a contiguous (row-major) tensor",
         "shape " + shape_string(t) + " with strides " + strides_string(t));
}

void check_options(const Options& o) {
  if (o.softmax_scale && !std::isfinite(*o.softmax_scale))
    fail("softmax_scale", "a finite number", number_string(*o.softmax_scale));
  if (!std::isfinite(o.softcap) || o.softcap < 0)
    fail("softcap", "a finite number >= 0 (0 turns it off)", number_string(o.softcap));
  if (o.window_left < -1)
    fail("window_left", "-1 (unbounded) or a key count >= 0", std::to_string(o.window_left));
  if (o.window_right < -1)
    fail("window_right", "-1 (unbounded) or a key count >= 0", std::to_string(o.window_right));
  if (!(o.dropout_p >= 0.0f && o.dropout_p < 1.0f))
    fail("dropout_p", "a probability in [0, 1)", number_string(o.dropout_p));
}

// Reads a host int32 vector (cu_seqlens, seqused_k); device tensors are checked by the backend.
const int32_t* host_int32(const TensorView& t) {
  return t.device.type == DeviceType::CPU ? static_cast<const int32_t*>(t.data) : nullptr;
}

// Checks cu_seqlens (and seqused_k) values against the rows and max_seqlen they describe.
void check_cu_seqlens(const std::string& name, const TensorView& cu, int64_t total_rows,
                      int64_t max_seqlen, const std::string& max_name) {
  const int32_t* c = host_int32(cu);
  if (c == nullptr) return;
  const int64_t n = cu.sizes[0];
  if (c[0] != 0) fail(name, "cu_seqlens[0] == 0", name + "[0] = " + std::to_string(c[0]));
  for (int64_t b = 0; b + 1 < n; ++b) {
    const int64_t len = static_cast<int64_t>(c[b + 1]) - c[b];
    if (len < 0)
      fail(name, "non-decreasing prefix sums",
           name + "[" + std::to_string(b + 1) + "] = " + std::to_string(c[b + 1]) + " < " +
               name + "[" + std::to_string(b) + "] = " + std::to_string(c[b]));
    if (len > max_seqlen)
      fail(max_name, "at least every sequence length in " + name,
           std::to_string(max_seqlen) + " while sequence " + std::to_string(b) + " has " +
               std::to_string(len));
  }
  if (c[n - 1] > total_rows)
    fail(name, "a last entry <= the " + std::to_string(total_rows) + " rows of the tensor",
         name + "[" + std::to_string(n - 1) + "] = " + std::to_string(c[n - 1]));
}

// The (batch, row, head) strides of a dense (B, S, H, D) or varlen (total, H, D) tensor; a
// varlen batch has no batch stride (rows are found through cu_seqlens).
void row_strides(const TensorView& t, bool is_varlen, int64_t& batch_stride,
                 int64_t& row_stride, int64_t& head_stride) {
  const size_t r = is_varlen ? 0 : 1;
  batch_stride = is_varlen ? 0 : t.strides[0];
  row_stride = t.strides[r];
  head_stride = t.strides[r + 1];
}

constexpr int64_t kInt32Max = 2147483647;  // batch and head counts index kernels' grids

// An input a call reads, for the overlap checks against what it writes.
struct Input {
  const char* name;
  const TensorView* view;
  Extent extent;
};

void check_execution(const Execution& execution) {
  if (execution.num_threads < 0)
    fail("num_threads", "0 (all cores) or a thread count >= 1",
         std::to_string(execution.num_threads));
  if (execution.backend != Backend::Auto && execution.backend != Backend::CPU &&
      execution.backend != Backend::CUDA)
    fail("backend", "auto, cpu or cuda",
         "backend code " + std::to_string(static_cast<int>(execution.backend)));
}

void check_head_dim(const TensorView& q, int64_t head_dim) {
  if (head_dim < 8 || head_dim > 256 || head_dim % 8 != 0)
    fail("q", "a head dim D that is a multiple of 8 in [8, 256]",
         "D = " + std::to_string(head_dim) + " in shape " + shape_string(q));
}

// B, H and Hk: int32-sized, at least one head of each kind, Hk dividing H.
void check_counts(const char* batch_name, int64_t batch, const TensorView& q, int64_t heads,
                  const char* k_name, const TensorView& k, int64_t heads_k) {
  if (batch > kInt32Max)
    fail(batch_name, "a batch size B < 2^31", "B = " + std::to_string(batch));
  if (heads > kInt32Max) fail("q", "a head count H < 2^31", "H = " + std::to_string(heads));
  if (heads_k > kInt32Max)
    fail(k_name, "a head count Hk < 2^31", "Hk = " + std::to_string(heads_k));
  if (heads < 1) fail("q", "at least one head", "shape " + shape_string(q));
  if (heads_k < 1) fail(k_name, "at least one key/value head", "shape " + shape_string(k));
  if (heads % heads_k != 0)
    fail(k_name,
         "a key/value head count Hk that divides the query head count H = " +
             std::to_string(heads),
         "Hk = " + std::to_string(heads_k));
}

// lse of a dense batch: fp32 (B, H, Sq), contiguous, on q's device.
Extent check_dense_lse(const TensorView& lse, const TensorView& q, int64_t batch, int64_t heads,
                       int64_t rows_q) {
  const Extent extent = check_view("lse", lse, 3);
  check_dtype("lse", lse, DType::Float32);
  check_same_device("lse", lse, q);
  check_shape("lse", lse, {batch, heads, rows_q}, "= (B, H, Sq)");
  check_contiguous("lse", lse);
  return extent;
}

Input check_alibi(const TensorView& a, const TensorView& q, int64_t batch, int64_t heads) {
  if (a.ndim != 1 && a.ndim != 2)
    fail("alibi_slopes", "shape (H) or (B, H)", std::to_string(a.ndim) + " dimensions");
  const Input input{"alibi_slopes", &a, check_view("alibi_slopes", a, a.ndim)};
  check_dtype("alibi_slopes", a, DType::Float32);
  check_same_device("alibi_slopes", a, q);
  if (a.ndim == 1)
    check_shape("alibi_slopes", a, {heads}, "= (H)");
  else
    check_shape("alibi_slopes", a, {batch, heads}, "= (B, H)");
  check_contiguous("alibi_slopes", a);
  return input;
}

// Auto picks cuda for tensors on a GPU, else cpu; the backend must then suit q.
Backend resolve_backend(const Execution& execution, const TensorView& q) {
  Backend backend = execution.backend;
  if (backend == Backend::Auto)
    backend = q.device.type == DeviceType::CUDA ? Backend::CUDA : Backend::CPU;
  if (backend == Backend::CPU && q.device.type != DeviceType::CPU)
    fail("q", "a tensor in host memory for the cpu backend", "a tensor on " +
                                                               device_string(q.device));
  if (backend == Backend::CUDA) {
    if (!cuda_compiled())
      unsupported("backend", "cpu or auto (this build has no CUDA backend)", "cuda");
    if (q.device.type != DeviceType::CUDA)
      fail("q", "a tensor in GPU memory for the cuda backend", "a tensor on " +
                                                                 device_string(q.device));
    if (q.dtype != DType::Float16 && q.dtype != DType::BFloat16)
      unsupported("q", "dtype fp16 or bf16 for the cuda backend",
                  std::string("dtype ") + dtype_name(q.dtype));
  }
  return backend;
}

// The options' part of the params (p.head_dim and p.heads already set), defaults resolved:
// scale 1/sqrt(D), causal folded into window_right = 0.
void fill_options(ForwardParams& p, const Options& options, const Execution& execution) {
  p.softmax_scale = options.softmax_scale ? *options.softmax_scale
                                          : 1.0f / std::sqrt(static_cast<float>(p.head_dim));
  p.softcap = options.softcap;
  p.window_left = options.window_left;
  p.window_right = options.causal ? 0 : options.window_right;
  if (options.alibi_slopes) {
    p.alibi_slopes = static_cast<const float*>(options.alibi_slopes->data);
    p.alibi_batch_stride = options.alibi_slopes->ndim == 2 ? p.heads : 0;
  }
  p.dropout_p = options.dropout_p;
  p.dropout_seed = options.dropout_seed;
  p.dropout_offset = options.dropout_offset;
  p.num_threads = execution.num_threads;
  p.stream = execution.stream;
}

// The fields every forward-like call fills alike once validated: pointers, dtype, shape.
void fill_tensors(ForwardParams& p, const TensorView& q, const TensorView& k, const TensorView& v,
                  const TensorView& out, const std::optional<TensorView>& lse, int64_t batch,
                  int64_t heads, int64_t heads_k, int64_t head_dim) {
  p.q = q.data;
  p.k = k.data;
  p.v = v.data;
  p.out = out.data;
  p.device = q.device.index;  // every tensor's, checked beforehand (check_same_device)
  p.lse = lse ? static_cast<float*>(lse->data) : nullptr;
  p.dtype = q.dtype;
  p.batch = static_cast<int32_t>(batch);
  p.heads = static_cast<int32_t>(heads);
  p.heads_k = static_cast<int32_t>(heads_k);
  p.head_dim = static_cast<int32_t>(head_dim);
  p.head_dim_v = static_cast<int32_t>(head_dim);
}

ValidatedForward validate_call(const TensorView& q, const TensorView& k, const TensorView& v,
                               const TensorView& out, const std::optional<TensorView>& lse,
                               const Varlen* varlen, const Options& options,
                               const Execution& execution) {
  check_options(options);
  check_execution(execution);

  const bool is_varlen = varlen != nullptr;
  const int rank = is_varlen ? 3 : 4;
  const std::string q_layout = is_varlen ? "= (total_q, H, D)" : "= (B, Sq, H, D)";
  const Extent q_extent = check_view("q", q, rank);
  const Extent k_extent = check_view("k", k, rank);
  const Extent v_extent = check_view("v", v, rank);
  const Extent out_extent = check_view("out", out, rank);

  // Dtypes and devices.
  if (q.dtype != DType::Float32 && q.dtype != DType::Float16 && q.dtype != DType::BFloat16)
    fail("q", "dtype fp32, fp16 or bf16", std::string("dtype ") + dtype_name(q.dtype));
  check_dtype("k", k, q.dtype);
  check_dtype("v", v, q.dtype);
  check_dtype("out", out, q.dtype);
  check_same_device("k", k, q);
  check_same_device("v", v, q);
  check_same_device("out", out, q);

  if (is_varlen) {  // B comes from cu_seqlens_q, so check its structure first
    check_view("cu_seqlens_q", varlen->cu_seqlens_q, 1);
    if (varlen->cu_seqlens_q.sizes[0] < 1)
      fail("cu_seqlens_q", "B + 1 >= 1 entries", "shape " + shape_string(varlen->cu_seqlens_q));
  }

  // Shapes.
  const int r = is_varlen ? 0 : 1;  // index of the first dim after the batch dim
  const int64_t batch = is_varlen ? varlen->cu_seqlens_q.sizes[0] - 1 : q.sizes[0];
  const int64_t rows_q = q.sizes[static_cast<size_t>(r)];
  const int64_t rows_k = k.sizes[static_cast<size_t>(r)];
  const int64_t heads = q.sizes[static_cast<size_t>(r + 1)];
  const int64_t head_dim = q.sizes[static_cast<size_t>(r + 2)];
  const int64_t heads_k = k.sizes[static_cast<size_t>(r + 1)];
  if (!is_varlen && k.sizes[0] != batch)
    fail("k", "batch size B = " + std::to_string(batch) + " like q", "shape " + shape_string(k));
  check_head_dim(q, head_dim);
  check_counts(is_varlen ? "cu_seqlens_q" : "q", batch, q, heads, "k", k, heads_k);
  if (k.sizes[static_cast<size_t>(r + 2)] != head_dim)
    fail("k", "head dim D = " + std::to_string(head_dim) + " like q", "shape " + shape_string(k));
  if (is_varlen) {
    check_shape("v", v, {rows_k, heads_k, head_dim}, "= (total_k, Hk, D) like k");
    check_shape("out", out, {rows_q, heads, head_dim}, "= (total_q, H, D) like q");
  } else {
    check_shape("v", v, {batch, rows_k, heads_k, head_dim}, "= (B, Sk, Hk, D) like k");
    check_shape("out", out, {batch, rows_q, heads, head_dim}, "= (B, Sq, H, D) like q");
  }
  check_no_self_overlap("out", out);

  // Every input a call reads, for the overlap check at the end.
  std::vector<Input> inputs{{"q", &q, q_extent}, {"k", &k, k_extent}, {"v", &v, v_extent}};

  Extent lse_extent;
  if (lse) {
    if (is_varlen) {
      lse_extent = check_view("lse", *lse, 2);
      check_dtype("lse", *lse, DType::Float32);
      check_same_device("lse", *lse, q);
      check_shape("lse", *lse, {heads, rows_q}, "= (H, total_q)");
      check_contiguous("lse", *lse);
    } else {
      lse_extent = check_dense_lse(*lse, q, batch, heads, rows_q);
    }
  }

  if (options.alibi_slopes) inputs.push_back(check_alibi(*options.alibi_slopes, q, batch, heads));

  if (is_varlen) {
    const TensorView& cq = varlen->cu_seqlens_q;
    const TensorView& ck = varlen->cu_seqlens_k;
    inputs.push_back({"cu_seqlens_q", &cq, check_view("cu_seqlens_q", cq, 1)});
    inputs.push_back({"cu_seqlens_k", &ck, check_view("cu_seqlens_k", ck, 1)});
    check_dtype("cu_seqlens_q", cq, DType::Int32);
    check_dtype("cu_seqlens_k", ck, DType::Int32);
    check_same_device("cu_seqlens_q", cq, q);
    check_same_device("cu_seqlens_k", ck, q);
    check_shape("cu_seqlens_k", ck, {batch + 1}, "= (B + 1) like cu_seqlens_q");
    check_contiguous("cu_seqlens_q", cq);
    check_contiguous("cu_seqlens_k", ck);
    // Lengths come from int32 prefix sums, so a larger bound is meaningless (and would
    // size a GPU grid absurdly).
    if (varlen->max_seqlen_q < 0 || varlen->max_seqlen_q > kInt32Max)
      fail("max_seqlen_q", "a length in [0, 2^31)", std::to_string(varlen->max_seqlen_q));
    if (varlen->max_seqlen_k < 0 || varlen->max_seqlen_k > kInt32Max)
      fail("max_seqlen_k", "a length in [0, 2^31)", std::to_string(varlen->max_seqlen_k));
    check_cu_seqlens("cu_seqlens_q", cq, rows_q, varlen->max_seqlen_q, "max_seqlen_q");
    check_cu_seqlens("cu_seqlens_k", ck, rows_k, varlen->max_seqlen_k, "max_seqlen_k");
    if (varlen->seqused_k) {
      const TensorView& su = *varlen->seqused_k;
      inputs.push_back({"seqused_k", &su, check_view("seqused_k", su, 1)});
      check_dtype("seqused_k", su, DType::Int32);
      check_same_device("seqused_k", su, q);
      check_shape("seqused_k", su, {batch}, "= (B)");
      check_contiguous("seqused_k", su);
      const int32_t* used = host_int32(su);
      const int32_t* ckv = host_int32(ck);
      for (int64_t b = 0; used != nullptr && ckv != nullptr && b < batch; ++b) {
        const int64_t len = static_cast<int64_t>(ckv[b + 1]) - ckv[b];
        if (used[b] < 0 || used[b] > len)
          fail("seqused_k",
               "0 <= seqused_k[b] <= the key length of sequence b (" + std::to_string(len) +
                   " for b = " + std::to_string(b) + ")",
               std::to_string(used[b]));
      }
    }
  }

  // Outputs must not overlap an input (or each other): a write would change what is read.
  for (const Input& in : inputs) {
    check_disjoint("out", out, out_extent, in.name, *in.view, in.extent);
    if (lse) check_disjoint("lse", *lse, lse_extent, in.name, *in.view, in.extent);
  }
  if (lse) check_disjoint("lse", *lse, lse_extent, "out", out, out_extent);

  const Backend backend = resolve_backend(execution, q);
  if (backend == Backend::CUDA)  // the kernels copy rows in 16-byte chunks
    for (const TensorView* t : {&q, &k, &v, &out}) check_rows_aligned(name_of(*t, q, k, v), *t);
  // Each pointer must really live where its view says (when the CUDA runtime can tell):
  // a host pointer handed to a kernel, or a GPU pointer to the CPU engine, would fault.
  for (const Input& in : inputs) check_pointer_location(in.name, *in.view);
  check_pointer_location("out", out);
  if (lse) check_pointer_location("lse", *lse);

  ValidatedForward result;
  result.backend = backend;
  ForwardParams& p = result.params;
  fill_tensors(p, q, k, v, out, lse, batch, heads, heads_k, head_dim);
  p.seqlen_q = is_varlen ? varlen->max_seqlen_q : rows_q;
  p.seqlen_k = is_varlen ? varlen->max_seqlen_k : rows_k;
  const auto strides_of = [&](const TensorView& t, int64_t& batch_stride, int64_t& row_stride,
                              int64_t& head_stride) {
    row_strides(t, is_varlen, batch_stride, row_stride, head_stride);
  };
  strides_of(q, p.q_batch_stride, p.q_row_stride, p.q_head_stride);
  strides_of(k, p.k_batch_stride, p.k_row_stride, p.k_head_stride);
  strides_of(v, p.v_batch_stride, p.v_row_stride, p.v_head_stride);
  strides_of(out, p.out_batch_stride, p.out_row_stride, p.out_head_stride);
  if (is_varlen) {
    p.lse_batch_stride = 0;
    p.lse_head_stride = rows_q;
    p.cu_seqlens_q = static_cast<const int32_t*>(varlen->cu_seqlens_q.data);
    p.cu_seqlens_k = static_cast<const int32_t*>(varlen->cu_seqlens_k.data);
    p.seqused_k =
        varlen->seqused_k ? static_cast<const int32_t*>(varlen->seqused_k->data) : nullptr;
  } else {
    p.lse_batch_stride = heads * rows_q;
    p.lse_head_stride = rows_q;
  }
  fill_options(p, options, execution);
  return result;
}

// The number of key chunks a KV-cache call may ask for: far more than any machine has
// threads or SMs to fill, and a bound on the partial results' workspace.
constexpr int32_t kMaxSplits = 1024;

std::string at(const std::string& name, int64_t b, int64_t value) {
  return name + "[" + std::to_string(b) + "] = " + std::to_string(value);
}

// The integer arguments of a KV-cache call, when they are in host memory (the CPU backend
// reads them; CUDA kernels trust them): every position a sequence reads or writes must exist,
// no two sequences may write one cache row, and rotary tables must reach every rotated position.
void check_kvcache_values(const KvCache& cache, int64_t batch, int64_t rows_q, int64_t seqlen_new,
                          int64_t capacity, bool rotary_per_row) {
  const int32_t* seqlens = host_int32(cache.cache_seqlens);
  if (seqlens == nullptr || batch == 0) return;
  const int32_t* leftpad = cache.cache_leftpad ? host_int32(*cache.cache_leftpad) : nullptr;
  const int32_t* batch_idx = cache.cache_batch_idx ? host_int32(*cache.cache_batch_idx) : nullptr;
  const int32_t* table = cache.block_table ? host_int32(*cache.block_table) : nullptr;
  const int64_t cache_rows = cache.k_cache.sizes[0];  // sequence rows, or pages when paged
  const int64_t page_size = cache.k_cache.sizes[1];
  const std::string capacity_text =
      std::to_string(capacity) +
      (table ? " (max_pages " + std::to_string(cache.block_table->sizes[1]) + " x page_size " +
                   std::to_string(page_size) + ")"
             : " (S_cache)");
  // (cache row written, sequence): two equal rows are two appended positions in one place.
  std::vector<std::pair<int64_t, int64_t>> written;
  int64_t rotary_rows = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t filled = seqlens[b];
    if (filled < 0) fail("cache_seqlens", "entries >= 0", at("cache_seqlens", b, filled));
    const int64_t begin = leftpad ? leftpad[b] : 0;
    if (begin < 0 || begin > filled)
      fail("cache_leftpad",
           "0 <= cache_leftpad[b] <= cache_seqlens[b] (= " + std::to_string(filled) +
               " for b = " + std::to_string(b) + ")",
           at("cache_leftpad", b, begin));
    const int64_t end = filled + seqlen_new;
    if (end > capacity)
      fail("cache_seqlens",
           "cache_seqlens[b] + S_new <= the cache capacity " + capacity_text,
           at("cache_seqlens", b, filled) + " with S_new = " + std::to_string(seqlen_new));
    if (batch_idx != nullptr) {
      const int64_t row = batch_idx[b];
      if (row < 0 || row >= cache_rows)
        fail("cache_batch_idx", "entries in [0, B_cache = " + std::to_string(cache_rows) + ")",
             at("cache_batch_idx", b, row));
      if (seqlen_new > 0) written.emplace_back(row, b);
    }
    if (table != nullptr) {
      const int32_t* pages = table + b * cache.block_table->strides[0];
      for (int64_t slot = begin / page_size; begin < end && slot <= (end - 1) / page_size; ++slot)
        if (pages[slot] < 0 || pages[slot] >= cache_rows)
          fail("block_table",
               "page indices in [0, num_pages = " + std::to_string(cache_rows) +
                   ") for every page a sequence uses",
               "block_table[" + std::to_string(b) + "][" + std::to_string(slot) +
                   "] = " + std::to_string(pages[slot]) + " (positions " +
                   std::to_string(begin) + " .. " + std::to_string(end - 1) + " are used)");
      for (int64_t pos = filled; pos < end; ++pos)
        written.emplace_back(pages[pos / page_size] * page_size + pos % page_size, b);
    }
    if (seqlen_new > 0) rotary_rows = std::max(rotary_rows, end);
    if (rows_q > 0) rotary_rows = std::max(rotary_rows, filled + (rotary_per_row ? rows_q : 1));
  }
  std::sort(written.begin(), written.end());
  for (size_t n = 1; n < written.size(); ++n) {
    if (written[n].first != written[n - 1].first) continue;
    const std::string pair =
        written[n].second == written[n - 1].second
            ? "sequence " + std::to_string(written[n].second) + " twice"
            : "sequences " + std::to_string(written[n - 1].second) + " and " +
                  std::to_string(written[n].second);
    if (table != nullptr)
      fail("block_table",
           "pages where no two appended positions share a row (k_new is written in place)",
           pair + " write row " + std::to_string(written[n].first % page_size) + " of page " +
               std::to_string(written[n].first / page_size));
    fail("cache_batch_idx",
         "distinct entries when k_new is given (it is appended in place)",
         pair + " both use cache row " + std::to_string(written[n].first));
  }
  if (cache.rotary_cos && cache.rotary_cos->sizes[0] < rotary_rows)
    fail("rotary_cos",
         "at least " + std::to_string(rotary_rows) + " rows (positions up to " +
             std::to_string(rotary_rows - 1) + " are rotated)",
         "shape " + shape_string(*cache.rotary_cos));
}

}  // namespace

ValidatedKvCache validate_kvcache(const TensorView& q, const KvCache& cache,
                                  const TensorView& out, const std::optional<TensorView>& lse,
                                  const Options& options, const Execution& execution) {
  check_options(options);
  if (options.dropout_p != 0.0f)
    fail("dropout_p", "0 (forward_kvcache is inference only)", number_string(options.dropout_p));
  if (cache.num_splits < 0 || cache.num_splits > kMaxSplits)
    fail("num_splits",
         "0 (choose) or a key chunk count in [1, " + std::to_string(kMaxSplits) + "]",
         std::to_string(cache.num_splits));
  check_execution(execution);

  const TensorView& kc = cache.k_cache;
  const TensorView& vc = cache.v_cache;
  const Extent q_extent = check_view("q", q, 4);
  const Extent kc_extent = check_view("k_cache", kc, 4);
  const Extent vc_extent = check_view("v_cache", vc, 4);
  const Extent out_extent = check_view("out", out, 4);
  if (q.dtype != DType::Float32 && q.dtype != DType::Float16 && q.dtype != DType::BFloat16)
    fail("q", "dtype fp32, fp16 or bf16", std::string("dtype ") + dtype_name(q.dtype));
  check_dtype("k_cache", kc, q.dtype);
  check_dtype("v_cache", vc, q.dtype);
  check_dtype("out", out, q.dtype);
  check_same_device("k_cache", kc, q);
  check_same_device("v_cache", vc, q);
  check_same_device("out", out, q);

  const int64_t batch = q.sizes[0], rows_q = q.sizes[1], heads = q.sizes[2],
                head_dim = q.sizes[3], heads_k = kc.sizes[2];
  check_head_dim(q, head_dim);
  check_counts("q", batch, q, heads, "k_cache", kc, heads_k);
  if (kc.sizes[3] != head_dim)
    fail("k_cache", "head dim D = " + std::to_string(head_dim) + " like q",
         "shape " + shape_string(kc));
  check_shape("v_cache", vc, {kc.sizes[0], kc.sizes[1], heads_k, head_dim}, "like k_cache");
  check_shape("out", out, {batch, rows_q, heads, head_dim}, "= (B, Sq, H, D) like q");
  check_no_self_overlap("out", out);

  std::vector<Input> inputs{{"q", &q, q_extent}, {"k_cache", &kc, kc_extent},
                            {"v_cache", &vc, vc_extent}};
  const auto per_sequence = [&](const char* name, const TensorView& t) {
    inputs.push_back({name, &t, check_view(name, t, 1)});
    check_dtype(name, t, DType::Int32);
    check_same_device(name, t, q);
    check_shape(name, t, {batch}, "= (B)");
  };
  per_sequence("cache_seqlens", cache.cache_seqlens);
  if (cache.cache_batch_idx) per_sequence("cache_batch_idx", *cache.cache_batch_idx);
  if (cache.cache_leftpad) per_sequence("cache_leftpad", *cache.cache_leftpad);

  // Dense (B_cache, S_cache, Hk, D) or paged (num_pages, page_size, Hk, D).
  int64_t capacity = kc.sizes[1];
  if (cache.block_table) {
    const TensorView& bt = *cache.block_table;
    if (cache.cache_batch_idx)
      fail("cache_batch_idx", "no cache_batch_idx with a paged cache (block_table picks the pages)",
           "both cache_batch_idx and block_table");
    inputs.push_back({"block_table", &bt, check_view("block_table", bt, 2)});
    check_dtype("block_table", bt, DType::Int32);
    check_same_device("block_table", bt, q);
    if (bt.sizes[0] != batch)
      fail("block_table", "shape (B = " + std::to_string(batch) + ", max_pages)",
           "shape " + shape_string(bt));
    if (kc.sizes[1] < 1 || kc.sizes[1] > kInt32Max)
      fail("k_cache", "a page size (dim 1) in [1, 2^31) for a paged cache",
           "shape " + shape_string(kc));
    if (__builtin_mul_overflow(bt.sizes[1], kc.sizes[1], &capacity))
      fail("block_table", "max_pages * page_size that fits in 64 bits",
           "shape " + shape_string(bt) + " with page_size " + std::to_string(kc.sizes[1]));
  } else if (cache.cache_batch_idx ? batch > 0 && kc.sizes[0] < 1 : kc.sizes[0] < batch) {
    fail("k_cache",
         cache.cache_batch_idx
             ? std::string("at least one cache row (dim 0) for cache_batch_idx to pick")
             : "at least B = " + std::to_string(batch) +
                   " cache rows (dim 0), or cache_batch_idx to pick them",
         "shape " + shape_string(kc));
  }

  // Appended keys and values: both or neither, (B, S_new, Hk, D) in q's dtype.
  int64_t seqlen_new = 0;
  if (cache.k_new.has_value() != cache.v_new.has_value())
    fail(cache.k_new ? "v_new" : "k_new",
         std::string("a tensor, since ") + (cache.k_new ? "k_new" : "v_new") +
             " is given (both or neither)",
         "none");
  if (cache.k_new) {
    const TensorView& kn = *cache.k_new;
    const TensorView& vn = *cache.v_new;
    inputs.push_back({"k_new", &kn, check_view("k_new", kn, 4)});
    inputs.push_back({"v_new", &vn, check_view("v_new", vn, 4)});
    check_dtype("k_new", kn, q.dtype);
    check_dtype("v_new", vn, q.dtype);
    check_same_device("k_new", kn, q);
    check_same_device("v_new", vn, q);
    seqlen_new = kn.sizes[1];
    check_shape("k_new", kn, {batch, seqlen_new, heads_k, head_dim}, "= (B, S_new, Hk, D)");
    check_shape("v_new", vn, {batch, seqlen_new, heads_k, head_dim}, "= (B, S_new, Hk, D) like k_new");
    if (seqlen_new > kInt32Max)
      fail("k_new", "S_new < 2^31 new positions", "shape " + shape_string(kn));
  }

  // Rotary tables: both or neither, (S_rotary, rotary_dim / 2), 2 <= rotary_dim <= D.
  if (cache.rotary_cos.has_value() != cache.rotary_sin.has_value())
    fail(cache.rotary_cos ? "rotary_sin" : "rotary_cos",
         std::string("a tensor, since ") + (cache.rotary_cos ? "rotary_cos" : "rotary_sin") +
             " is given (both or neither)",
         "none");
  if (cache.rotary_cos) {
    const TensorView& cos = *cache.rotary_cos;
    const TensorView& sin = *cache.rotary_sin;
    inputs.push_back({"rotary_cos", &cos, check_view("rotary_cos", cos, 2)});
    inputs.push_back({"rotary_sin", &sin, check_view("rotary_sin", sin, 2)});
    check_dtype("rotary_cos", cos, q.dtype);
    check_dtype("rotary_sin", sin, q.dtype);
    check_same_device("rotary_cos", cos, q);
    check_same_device("rotary_sin", sin, q);
    if (cos.sizes[1] < 1 || 2 * cos.sizes[1] > head_dim)
      fail("rotary_cos",
           "shape (S_rotary, rotary_dim / 2) with 2 <= rotary_dim <= D = " +
               std::to_string(head_dim),
           "shape " + shape_string(cos));
    check_shape("rotary_sin", sin, {cos.sizes[0], cos.sizes[1]}, "like rotary_cos");
  }

  Extent lse_extent;
  if (lse) lse_extent = check_dense_lse(*lse, q, batch, heads, rows_q);
  if (options.alibi_slopes) inputs.push_back(check_alibi(*options.alibi_slopes, q, batch, heads));

  // What the call writes must not overlap what it reads: out and lse, and the caches when
  // k_new is appended (a packed (.., 2, Hk, D) cache, k and v interleaved, is fine: the two
  // caches are read and written at distinct elements).
  for (const Input& in : inputs) {
    check_disjoint("out", out, out_extent, in.name, *in.view, in.extent);
    if (lse) check_disjoint("lse", *lse, lse_extent, in.name, *in.view, in.extent);
  }
  if (lse) check_disjoint("lse", *lse, lse_extent, "out", out, out_extent);
  if (seqlen_new > 0 && batch > 0) {
    check_no_self_overlap("k_cache", kc);
    check_no_self_overlap("v_cache", vc);
    for (const Input& in : inputs) {
      if (in.view == &kc || in.view == &vc) continue;
      check_disjoint("k_cache", kc, kc_extent, in.name, *in.view, in.extent);
      check_disjoint("v_cache", vc, vc_extent, in.name, *in.view, in.extent);
    }
  }

  const Backend backend = resolve_backend(execution, q);
  if (backend == Backend::CUDA) {  // the kernels copy rows in 16-byte chunks
    check_rows_aligned("q", q);
    check_rows_aligned("k_cache", kc);
    check_rows_aligned("v_cache", vc);
    check_rows_aligned("out", out);
    if (cache.k_new) {
      check_rows_aligned("k_new", *cache.k_new);
      check_rows_aligned("v_new", *cache.v_new);
    }
  }
  for (const Input& in : inputs) check_pointer_location(in.name, *in.view);
  check_pointer_location("out", out);
  if (lse) check_pointer_location("lse", *lse);

  ValidatedKvCache result;
  result.backend = backend;
  KvCacheParams& kp = result.params;
  ForwardParams& p = kp.attn;
  fill_tensors(p, q, kc, vc, out, lse, batch, heads, heads_k, head_dim);
  p.seqlen_q = rows_q;
  p.seqlen_k = capacity;
  row_strides(q, false, p.q_batch_stride, p.q_row_stride, p.q_head_stride);
  row_strides(kc, false, p.k_batch_stride, p.k_row_stride, p.k_head_stride);
  row_strides(vc, false, p.v_batch_stride, p.v_row_stride, p.v_head_stride);
  row_strides(out, false, p.out_batch_stride, p.out_row_stride, p.out_head_stride);
  p.lse_batch_stride = heads * rows_q;
  p.lse_head_stride = rows_q;
  fill_options(p, options, execution);

  const auto int32_data = [](const std::optional<TensorView>& t) {
    return t ? static_cast<const int32_t*>(t->data) : nullptr;
  };
  kp.cache_seqlens = static_cast<const int32_t*>(cache.cache_seqlens.data);
  kp.cache_batch_idx = int32_data(cache.cache_batch_idx);
  kp.cache_leftpad = int32_data(cache.cache_leftpad);
  kp.block_table = int32_data(cache.block_table);
  if (cache.block_table) {
    kp.block_table_batch_stride = cache.block_table->strides[0];
    kp.page_size = static_cast<int32_t>(kc.sizes[1]);
  }
  if (cache.k_new) {
    kp.k_new = cache.k_new->data;
    kp.v_new = cache.v_new->data;
    kp.seqlen_new = seqlen_new;
    row_strides(*cache.k_new, false, kp.k_new_batch_stride, kp.k_new_row_stride,
                kp.k_new_head_stride);
    row_strides(*cache.v_new, false, kp.v_new_batch_stride, kp.v_new_row_stride,
                kp.v_new_head_stride);
  }
  if (cache.rotary_cos) {
    kp.rotary_cos = cache.rotary_cos->data;
    kp.rotary_sin = cache.rotary_sin->data;
    kp.rotary_cos_row_stride = cache.rotary_cos->strides[0];
    kp.rotary_sin_row_stride = cache.rotary_sin->strides[0];
    kp.rotary_seqlen = cache.rotary_cos->sizes[0];
    kp.rotary_dim = static_cast<int32_t>(2 * cache.rotary_cos->sizes[1]);
    kp.rotary_interleaved = cache.rotary_interleaved;
  }
  kp.num_splits = cache.num_splits;

  // Last, so that a call with a bad value fails after every structural check; host values
  // only (the CPU backend), and only now that every pointer is known to be readable.
  check_kvcache_values(cache, batch, rows_q, seqlen_new, capacity, kp.rotary_q_per_row());
  return result;
}

ValidatedForward validate_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                                  const TensorView& out, const std::optional<TensorView>& lse,
                                  const Varlen* varlen, const Options& options,
                                  const Execution& execution) {
  return validate_call(q, k, v, out, lse, varlen, options, execution);
}

ValidatedBackward validate_backward(const TensorView& q, const TensorView& k,
                                    const TensorView& v, const TensorView& out,
                                    const TensorView& dout, const TensorView& lse,
                                    const TensorView& dq, const TensorView& dk,
                                    const TensorView& dv, const Varlen* varlen,
                                    const Options& options, const Execution& execution) {
  // The forward's own checks cover q, k, v, out, lse, the options and the backend.
  const ValidatedForward forward =
      validate_call(q, k, v, out, lse, varlen, options, execution);

  const bool is_varlen = varlen != nullptr;
  const int rank = is_varlen ? 3 : 4;
  struct Gradient {
    const char* name;
    const TensorView* view;
    const TensorView* like;
    const char* like_name;
    Extent extent;
  };
  Gradient grads[] = {{"dq", &dq, &q, "q", {}}, {"dk", &dk, &k, "k", {}}, {"dv", &dv, &v, "v", {}}};
  const Extent dout_extent = check_view("dout", dout, rank);
  for (Gradient& g : grads) g.extent = check_view(g.name, *g.view, rank);
  const auto check_like = [](const char* name, const TensorView& t, const TensorView& like,
                             const char* like_name) {
    check_dtype(name, t, like.dtype);
    check_same_device(name, t, like);
    for (int d = 0; d < t.ndim; ++d)
      if (t.sizes[static_cast<size_t>(d)] != like.sizes[static_cast<size_t>(d)])
        fail(name, "shape " + shape_string(like) + " like " + like_name,
             "shape " + shape_string(t));
  };
  check_like("dout", dout, out, "out");
  for (const Gradient& g : grads) {
    check_like(g.name, *g.view, *g.like, g.like_name);
    check_no_self_overlap(g.name, *g.view);
  }

  // The gradients are written while every input is still being read.
  std::vector<std::pair<const char*, const TensorView*>> inputs{
      {"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}, {"dout", &dout}, {"lse", &lse}};
  if (options.alibi_slopes) inputs.emplace_back("alibi_slopes", &*options.alibi_slopes);
  if (is_varlen) {
    inputs.emplace_back("cu_seqlens_q", &varlen->cu_seqlens_q);
    inputs.emplace_back("cu_seqlens_k", &varlen->cu_seqlens_k);
    if (varlen->seqused_k) inputs.emplace_back("seqused_k", &*varlen->seqused_k);
  }
  for (size_t n = 0; n < std::size(grads); ++n) {
    const Gradient& g = grads[n];
    for (const auto& [name, view] : inputs)
      check_disjoint(g.name, *g.view, g.extent, name, *view,
                     view == &dout ? dout_extent : check_view(name, *view, view->ndim));
    for (size_t m = 0; m < n; ++m)
      check_disjoint(g.name, *g.view, g.extent, grads[m].name, *grads[m].view, grads[m].extent);
  }
  if (forward.backend == Backend::CUDA) {
    // The kernels read dout and write the gradients in 16-byte (dq) and 4-byte chunks.
    check_rows_aligned("dout", dout);
    for (const Gradient& g : grads) check_rows_aligned(g.name, *g.view);
  }
  check_pointer_location("dout", dout);
  for (const Gradient& g : grads) check_pointer_location(g.name, *g.view);

  ValidatedBackward result;
  result.backend = forward.backend;
  BackwardParams& p = result.params;
  p.fwd = forward.params;
  p.dout = dout.data;
  p.dq = dq.data;
  p.dk = dk.data;
  p.dv = dv.data;
  row_strides(dout, is_varlen, p.dout_batch_stride, p.dout_row_stride, p.dout_head_stride);
  row_strides(dq, is_varlen, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride);
  row_strides(dk, is_varlen, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride);
  row_strides(dv, is_varlen, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride);
  p.deterministic = options.deterministic;
  return result;
}

}  // namespace flashattn::detail

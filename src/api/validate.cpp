// Argument checking (api/validate.hpp): structural helpers first, then each tensor argument
// declared as a TensorSpec, the rules every attention call shares, and the four validations.
#include "api/validate.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "api/params.hpp"
#include "common/knobs.hpp"
#include "cuda/devices.hpp"
#include "cuda/head_dim_padding.hpp"

namespace flashattn::detail {
namespace {

// "(a, b, c)"
std::string list_string(const int64_t* values, int64_t count) {
  std::string s = "(";
  for (int64_t i = 0; i < count; ++i) s.append(i ? ", " : "").append(std::to_string(values[i]));
  return s + ")";
}

std::string shape_string(const TensorView& t) { return list_string(t.sizes.data(), t.ndim); }

std::string strides_string(const TensorView& t) { return list_string(t.strides.data(), t.ndim); }

std::string shape_string(const std::vector<int64_t>& sizes) {
  return list_string(sizes.data(), static_cast<int64_t>(sizes.size()));
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
  return d == DType::Float32 || d == DType::Float16 || d == DType::BFloat16 || d == DType::Int32 ||
         d == DType::Float8E4M3;
}

// [lowest, highest] element offsets a view can touch; false when it touches nothing.
struct Extent {
  int64_t lo = 0, hi = 0;
  bool empty = true;
};

// Structural checks every tensor argument gets: known dtype and device, rank, sizes,
// strides, a non-null pointer when it has elements, and offsets that fit in 64 bits.
// seqlen_dim >= 0: the view may have that dimension contiguous instead of its last (fp8 v
// given (d, seqlen)-major, docs/SPEC.md "FP8 inputs").
Extent check_view(const std::string& name, const TensorView& t, int ndim, int seqlen_dim = -1) {
  if (t.ndim != ndim) {
    std::string given = dimensions_string(t.ndim);
    if (t.ndim > 0 && t.ndim <= kMaxDims) given.append(" ").append(shape_string(t));
    fail(name, dimensions_string(ndim), given);
  }
  if (!is_known_dtype(t.dtype))
    fail(name, "a dtype among fp32, fp16, bf16, int32, fp8_e4m3",
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
  if (t.sizes[last] > 1 && t.strides[last] != 1) {
    if (seqlen_dim < 0)
      fail(name, "a contiguous last dimension (stride 1)", "strides " + strides_string(t));
    const size_t rows = static_cast<size_t>(seqlen_dim);
    if (t.sizes[rows] > 1 && t.strides[rows] != 1)
      fail(name,
           "a contiguous last dimension (stride 1), or a contiguous sequence dimension " +
               std::to_string(seqlen_dim) + " ((d, seqlen)-major fp8 values)",
           "strides " + strides_string(t));
  }

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

// Whether a view that passed check_view is (d, seqlen)-major: its last dimension not
// contiguous (fp8 values only, check_view's alternative).
bool is_seqlen_major(const TensorView& t) {
  const size_t last = static_cast<size_t>(t.ndim - 1);
  return t.ndim >= 3 && t.sizes[last] > 1 && t.strides[last] != 1;
}

// The rows the CUDA backend needs. A call whose head dim is a multiple of 8 runs on the
// caller's tensors, which the kernels copy in 16-byte chunks: 16-byte rows, the base pointer
// and every stride but the last a multiple of 16 bytes. Any other head dim runs on padded
// copies whose rows are read and written one element at a time
// (cuda/head_dim_padding.hpp): then only an element-aligned pointer.
void check_rows_aligned(const std::string& name, const TensorView& t, int64_t head_dim,
                        DType call_dtype) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(t.data);
  // FP8 calls are never padded: the Hopper kernel's TMA boxes fill the columns past the head
  // dim with zeros instead, and need 16-byte rows of every tensor.
  if (cuda::pads_head_dim(head_dim) && call_dtype != DType::Float8E4M3) {
    const size_t elem = dtype_size(t.dtype);
    if (address % elem != 0)
      fail(name,
           "an element-aligned pointer (a multiple of " + std::to_string(elem) +
               " bytes) for the cuda backend",
           "a pointer misaligned by " + std::to_string(address % elem) + " bytes");
    return;
  }
  const int64_t elems_per_16_bytes = 16 / static_cast<int64_t>(dtype_size(t.dtype));
  // fp8 values given (d, seqlen)-major (check_view) have their sequence dimension (the third
  // from the end) contiguous: their head-dim columns are what the kernel loads.
  const bool seqlen_major = is_seqlen_major(t);
  const int contiguous_dim = seqlen_major ? t.ndim - 3 : t.ndim - 1;
  bool aligned = address % 16 == 0;
  for (int d = 0; d < t.ndim; ++d)
    aligned = aligned && (d == contiguous_dim || t.sizes[static_cast<size_t>(d)] <= 1 ||
                          t.strides[static_cast<size_t>(d)] % elems_per_16_bytes == 0);
  if (!aligned)
    fail(name,
         std::string(seqlen_major ? "16-byte aligned columns" : "16-byte aligned rows") +
             " for the cuda backend (a 16-byte aligned pointer and strides that "
             "are multiples of " + std::to_string(elems_per_16_bytes) + " elements)",
         "strides " + strides_string(t) +
             (address % 16 ? " with a pointer misaligned by " + std::to_string(address % 16) +
                                 " bytes"
                           : std::string()));
}

// An element-aligned pointer (check_pointer below), alone: for the host index tensors whose
// values are read before check_pointer runs.
void check_element_aligned(const std::string& name, const TensorView& t) {
  if (t.data == nullptr || t.numel() == 0) return;
  const size_t elem = dtype_size(t.dtype);
  const uintptr_t address = reinterpret_cast<uintptr_t>(t.data);
  if (address % elem != 0)
    fail(name, "an element-aligned pointer (a multiple of " + std::to_string(elem) + " bytes)",
         "a pointer misaligned by " + std::to_string(address % elem) + " bytes");
}

// Every pointer the engines will dereference, on every backend: element-aligned (they read and
// write the elements as their type), and, where the CUDA runtime can tell, in the memory its
// view's device names (a host pointer handed to a kernel, or a GPU pointer to the CPU engine,
// would fault).
void check_pointer(const Execution& execution, const std::string& name, const TensorView& t) {
  if (t.data == nullptr || t.numel() == 0) return;
  check_element_aligned(name, t);
  if (execution.trust_devices) return;
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

void check_same_device(const std::string& name, const TensorView& t, const TensorView& q) {
  if (t.device.type != q.device.type || t.device.index != q.device.index)
    fail(name, "the device of q (" + device_string(q.device) + ")", device_string(t.device));
}

void check_shape(const std::string& name, const TensorView& t,
                 const std::vector<int64_t>& expected, const std::string& layout) {
  size_t i = 0;
  for (int64_t size : expected) {
    if (t.sizes[i] != size)
      fail(name, "shape " + shape_string(expected) + " " + layout, "shape " + shape_string(t));
    ++i;
  }
}

bool is_row_major(const TensorView& t) {
  // A tensor without elements has no layout to get wrong, whatever strides its maker chose
  // (torch gives an empty (3, 4, 0) lse the strides (4, 1, 1)).
  if (t.numel() == 0) return true;
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

// Positions (Options::positions): tokens count from 0, and every token index of a call (its
// rows and keys moved by the positions) stays below 2^31, where dropout's Philox counter
// holds it. longest_q / longest_k: the most rows and keys a sequence of the call can have.
void check_positions(const Options& o, int64_t longest_q, int64_t longest_k) {
  if (!o.positions) return;
  constexpr int64_t kTokens = int64_t{1} << 31;
  const struct {
    const char* name;
    int64_t first, count;
  } sides[] = {{"positions.query", o.positions->query, longest_q},
               {"positions.key", o.positions->key, longest_k}};
  for (const auto& side : sides) {
    if (side.first < 0)
      fail(side.name, "a token position >= 0", std::to_string(side.first));
    if (side.first > kTokens - side.count)
      fail(side.name,
           "a position + " + std::to_string(side.count) + " (the call's longest sequence) <= 2^31",
           std::to_string(side.first));
  }
}

// Reads a host int32 vector (cu_seqlens, seqused_k); device tensors are checked by the backend.
const int32_t* host_int32(const TensorView& t) {
  return t.device.type == DeviceType::CPU ? static_cast<const int32_t*>(t.data) : nullptr;
}

// Paged keys: cu_seqlens_k gives the lengths, and bounds no tensor's rows.
constexpr int64_t kNoRowBound = -1;

// Checks cu_seqlens values against the rows (total_rows, unless kNoRowBound) and max_seqlen
// they describe.
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
  if (total_rows != kNoRowBound && c[n - 1] > total_rows)
    fail(name, "a last entry <= the " + std::to_string(total_rows) + " rows of the tensor",
         name + "[" + std::to_string(n - 1) + "] = " + std::to_string(c[n - 1]));
}

constexpr int64_t kInt32Max = 2147483647;  // batch and head counts index kernels' grids

// A checked tensor argument and the memory it spans, for the overlap checks between what a
// call reads and what it writes.
struct Argument {
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
  if (head_dim < 1 || head_dim > 256)
    fail("q", "a head dim D in [1, 256]",
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
    // FP8 (the forward only: the other calls refuse it with their dtypes) runs on the Hopper
    // kernel, which takes head dims up to 256; the GPU's kind is checked where it runs.
    if (q.dtype != DType::Float16 && q.dtype != DType::BFloat16 && q.dtype != DType::Float8E4M3)
      unsupported("q", "dtype fp16 or bf16 (a forward: fp8_e4m3 too) for the cuda backend",
                  std::string("dtype ") + dtype_name(q.dtype));
  }
  return backend;
}

// The number of key chunks a KV-cache call may ask for: far more than any machine has
// threads or SMs to fill, and a bound on the partial results' workspace.
constexpr int32_t kMaxSplits = 1024;

std::string at(const std::string& name, int64_t b, int64_t value) {
  return name + "[" + std::to_string(b) + "] = " + std::to_string(value);
}

// A host block table's pages that hold positions [begin, end) of sequence b: each must be
// in [0, num_pages) (on CUDA the kernels read the table and guard the indices instead).
void check_pages_used(const int32_t* table, const TensorView& table_view, int64_t b,
                      int64_t begin, int64_t end, int64_t page_size, int64_t num_pages) {
  const int32_t* pages = table + b * table_view.strides[0];
  for (int64_t slot = begin / page_size; begin < end && slot <= (end - 1) / page_size; ++slot)
    if (pages[slot] < 0 || pages[slot] >= num_pages)
      fail("block_table",
           "page indices in [0, num_pages = " + std::to_string(num_pages) +
               ") for every page a sequence uses",
           "block_table[" + std::to_string(b) + "][" + std::to_string(slot) +
               "] = " + std::to_string(pages[slot]) + " (positions " + std::to_string(begin) +
               " .. " + std::to_string(end - 1) + " are used)");
}

// The values of a KV-cache call's int32 tensors that the validator can read (null where it
// cannot): every tensor in host memory (the CPU backend); on CUDA, for a paged cache,
// cache_seqlens copied to the host on the call's stream, as upstream FlashAttention does there
// (one synchronisation; the dense case is left to the kernels' guards, as a synchronisation
// per decoding step would cost more than the check gives), except while the stream is
// captured into a CUDA graph, where the kernels' guards apply (common/kvcache.hpp).
struct KvCacheValues {
  const int32_t* seqlens = nullptr;
  const int32_t* leftpad = nullptr;
  const int32_t* batch_idx = nullptr;
  const int32_t* table = nullptr;
  std::vector<int32_t> copied_seqlens;
};

KvCacheValues readable_kvcache_values(const KvCache& cache, Backend backend,
                                      const Execution& execution) {
  KvCacheValues values;
  values.seqlens = host_int32(cache.cache_seqlens);
  if (cache.cache_leftpad) values.leftpad = host_int32(*cache.cache_leftpad);
  if (cache.cache_batch_idx) values.batch_idx = host_int32(*cache.cache_batch_idx);
  if (cache.block_table) values.table = host_int32(*cache.block_table);
  if (values.seqlens == nullptr && cache.block_table && backend == Backend::CUDA) {
    const TensorView& t = cache.cache_seqlens;
    values.copied_seqlens.resize(static_cast<size_t>(t.numel()));
    if (cuda::copy_int32_to_host("cache_seqlens", static_cast<const int32_t*>(t.data), t.numel(),
                                 t.device.index, execution.stream, values.copied_seqlens.data()))
      values.seqlens = values.copied_seqlens.data();
  }
  return values;
}

// The integer arguments' values, where they can be read (KvCacheValues): every position a
// sequence reads or writes must exist, no two sequences may write one cache row, and rotary
// tables must reach every rotated position. The kernels' guard (kv_sequence_in_range,
// kv_page_in_range) is the same rule for the values no one checked.
void check_kvcache_values(const KvCache& cache, const KvCacheValues& values, int64_t batch,
                          int64_t rows_q, int64_t seqlen_new, int64_t capacity,
                          bool rotary_per_row) {
  const int32_t* seqlens = values.seqlens;
  if (seqlens == nullptr || batch == 0) return;
  const int32_t* leftpad = values.leftpad;
  const int32_t* batch_idx = values.batch_idx;
  const int32_t* table = values.table;
  const int64_t cache_rows = cache.k_cache.sizes[0];  // sequence rows, or pages when paged
  const int64_t page_size = cache.k_cache.sizes[1];
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
    // Paged, the block table is what is too small (upstream's wording: it names block_table).
    if (end > capacity && cache.block_table)
      fail("block_table",
           "pages for every position: cache_seqlens[b] + S_new <= max_pages " +
               std::to_string(cache.block_table->sizes[1]) + " x page_size " +
               std::to_string(page_size) + " = " + std::to_string(capacity),
           at("cache_seqlens", b, filled) + " with S_new = " + std::to_string(seqlen_new));
    if (end > capacity)
      fail("cache_seqlens",
           "cache_seqlens[b] + S_new <= the cache capacity " + std::to_string(capacity) +
               " (S_cache)",
           at("cache_seqlens", b, filled) + " with S_new = " + std::to_string(seqlen_new));
    if (batch_idx != nullptr) {
      const int64_t row = batch_idx[b];
      if (row < 0 || row >= cache_rows)
        fail("cache_batch_idx", "entries in [0, B_cache = " + std::to_string(cache_rows) + ")",
             at("cache_batch_idx", b, row));
      if (seqlen_new > 0) written.emplace_back(row, b);
    }
    if (table != nullptr) {
      check_pages_used(table, *cache.block_table, b, begin, end, page_size, cache_rows);
      const int32_t* pages = table + b * cache.block_table->strides[0];
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

// An argument's sizes, as an expected shape for another.
std::vector<int64_t> sizes_of(const TensorView& t) {
  return {t.sizes.begin(), t.sizes.begin() + std::max(0, std::min(t.ndim, kMaxDims))};
}

const TensorView* given(const std::optional<TensorView>& t) { return t ? &*t : nullptr; }

std::string dtype_list(const std::vector<DType>& dtypes) {
  std::string s;
  for (size_t i = 0; i < dtypes.size(); ++i)
    s.append(i == 0 ? "" : i + 1 == dtypes.size() ? " or " : ", ").append(dtype_name(dtypes[i]));
  return s;
}

// One tensor argument as a call declares it; expect() checks it.
struct TensorSpec {
  const char* name;
  const TensorView* view;  // null: an optional argument that was not given (nothing to check)
  int rank;
  std::vector<DType> dtypes = {};   // the dtypes it may have; empty: any
  bool on_q_device = true;          // on the device of q (every argument but q itself)
  std::vector<int64_t> shape = {};  // the sizes it must have; empty: checked by the call
  std::string layout = {};          // how the message names that shape, e.g. "= (B)"
  bool contiguous = false;          // row-major as a whole, not only in its last dimension
  int seqlen_dim = -1;              // >= 0: check_view's (d, seqlen)-major alternative
};

const std::vector<DType> kInt32{DType::Int32};
const std::vector<DType> kFloat32{DType::Float32};

// Checks a group of arguments phase by phase: every view's structure (check_view), then every
// dtype, device, shape and contiguity, so that an argument's structure is known to be sound
// before any is compared with another. Returns the given ones with their extents, in order.
std::vector<Argument> expect(const TensorView& q, std::initializer_list<TensorSpec> specs) {
  std::vector<Argument> checked;
  for (const TensorSpec& s : specs)
    if (s.view) checked.push_back({s.name, s.view, check_view(s.name, *s.view, s.rank, s.seqlen_dim)});
  for (const TensorSpec& s : specs)
    if (s.view && !s.dtypes.empty() &&
        std::find(s.dtypes.begin(), s.dtypes.end(), s.view->dtype) == s.dtypes.end())
      fail(s.name, "dtype " + dtype_list(s.dtypes),
           std::string("dtype ") + dtype_name(s.view->dtype));
  for (const TensorSpec& s : specs)
    if (s.view && s.on_q_device) check_same_device(s.name, *s.view, q);
  for (const TensorSpec& s : specs)
    if (s.view && !s.shape.empty()) check_shape(s.name, *s.view, s.shape, s.layout);
  for (const TensorSpec& s : specs)
    if (s.view && s.contiguous) check_contiguous(s.name, *s.view);
  return checked;
}

void append(std::vector<Argument>& to, const std::vector<Argument>& more) {
  to.insert(to.end(), more.begin(), more.end());
}

// ---- The rules every attention call shares: the forward's, reused by the backward and the
// kv-cache call (whose k and v are the caches).

const std::vector<DType> kAttentionDTypes{DType::Float32, DType::Float16, DType::BFloat16};
// The forward's q, k and v may also be fp8 e4m3 (docs/SPEC.md, "FP8 inputs").
const std::vector<DType> kForwardDTypes{DType::Float32, DType::Float16, DType::BFloat16,
                                        DType::Float8E4M3};

// The dtype of out for inputs of `input`: the same, but bf16 for fp8 inputs (as FA3's).
DType out_dtype_of(DType input) {
  return input == DType::Float8E4M3 ? DType::BFloat16 : input;
}

// q, k, v and out: rank (k and v: kv_rank), q's dtype (one of q_dtypes) and device, shared
// by k and v (or, with fp8_kv, fp8 e4m3 k and v: a KV cache's), and out's dtype
// out_dtype_of(q's); v_seqlen_dim >= 0: v may be (d, seqlen)-major (check_view). Returns q,
// k, v and out with their extents.
std::vector<Argument> expect_attention_tensors(const TensorView& q, const char* k_name,
                                               const TensorView& k, const char* v_name,
                                               const TensorView& v, const TensorView& out,
                                               int rank, int kv_rank,
                                               const std::vector<DType>& q_dtypes = kAttentionDTypes,
                                               bool fp8_kv = false, int v_seqlen_dim = -1) {
  std::vector<DType> k_dtypes{q.dtype};
  if (fp8_kv && q.dtype != DType::Float8E4M3) k_dtypes.push_back(DType::Float8E4M3);
  // v's dtype is k's (checked after k's, so that k's is one of k_dtypes by then).
  const std::vector<DType> like_k{k.dtype};
  return expect(q, {{.name = "q", .view = &q, .rank = rank, .dtypes = q_dtypes,
                     .on_q_device = false},
                    {.name = k_name, .view = &k, .rank = kv_rank, .dtypes = k_dtypes},
                    {.name = v_name, .view = &v, .rank = kv_rank, .dtypes = like_k,
                     .seqlen_dim = v_seqlen_dim},
                    {.name = "out", .view = &out, .rank = rank, .dtypes = {out_dtype_of(q.dtype)}}});
}

// The dimensions of q (B, Sq, H, D) or (total_q, H, D) and k (B, Sk, Hk, D), (total_k, Hk, D)
// or paged (num_pages, page_size, Hk, D), their ranks checked; a varlen batch size comes from
// cu_seqlens_q.
ValidatedCall dimensions(const TensorView& q, const TensorView& k, int64_t batch) {
  const size_t r = q.ndim == 4 ? 1 : 0;   // the first dim after the batch dim
  const size_t rk = k.ndim == 4 ? 1 : 0;  // the same for k (paged: the rows of a page)
  ValidatedCall call;
  call.batch = batch;
  call.rows_q = q.sizes[r];
  call.rows_k = k.sizes[rk];
  call.heads = q.sizes[r + 1];
  call.head_dim = q.sizes[r + 2];
  call.heads_k = k.sizes[rk + 1];
  return call;
}

// A block table of pages (varlen keys or a KV cache), int32 (B, max_pages) on q's device with
// a contiguous last dimension, over `pages` (num_pages, page_size, Hk, D) with page_size in
// [1, 2^31). The positions a sequence can have (max_pages * page_size) go to *capacity.
std::vector<Argument> expect_block_table(const TensorView& q, const TensorView& table,
                                         int64_t batch, const char* pages_name,
                                         const TensorView& pages, const char* pages_what,
                                         int64_t* capacity) {
  std::vector<Argument> checked =
      expect(q, {{.name = "block_table", .view = &table, .rank = 2, .dtypes = kInt32}});
  if (table.sizes[0] != batch)
    fail("block_table", "shape (B = " + std::to_string(batch) + ", max_pages)",
         "shape " + shape_string(table));
  if (pages.sizes[1] < 1 || pages.sizes[1] > kInt32Max)
    fail(pages_name, std::string("a page size (dim 1) in [1, 2^31) for ") + pages_what,
         "shape " + shape_string(pages));
  if (__builtin_mul_overflow(table.sizes[1], pages.sizes[1], capacity))
    fail("block_table", "max_pages * page_size that fits in 64 bits",
         "shape " + shape_string(table) + " with page_size " + std::to_string(pages.sizes[1]));
  return checked;
}

// The dimensions of a dense or varlen call's q and k (their ranks checked): B is q's batch
// size, which k's must equal (dense), or the entries of cu_seqlens_q less one (varlen, whose
// structure is checked first).
ValidatedCall batch_dimensions(const TensorView& q, const TensorView& k, const Varlen* varlen) {
  if (varlen != nullptr) {
    check_view("cu_seqlens_q", varlen->cu_seqlens_q, 1);
    if (varlen->cu_seqlens_q.sizes[0] < 1)
      fail("cu_seqlens_q", "B + 1 >= 1 entries", "shape " + shape_string(varlen->cu_seqlens_q));
    return dimensions(q, k, varlen->cu_seqlens_q.sizes[0] - 1);
  }
  ValidatedCall call = dimensions(q, k, q.sizes[0]);
  if (k.sizes[0] != call.batch)
    fail("k", "batch size B = " + std::to_string(call.batch) + " like q",
         "shape " + shape_string(k));
  return call;
}

// The head dim, the batch and head counts, and k's head dim like q's.
void check_query_key_shapes(const ValidatedCall& call, const TensorView& q,
                            const char* batch_name, const char* k_name, const TensorView& k) {
  check_head_dim(q, call.head_dim);
  check_counts(batch_name, call.batch, q, call.heads, k_name, k, call.heads_k);
  if (k.sizes[static_cast<size_t>(k.ndim - 1)] != call.head_dim)
    fail(k_name, "head dim D = " + std::to_string(call.head_dim) + " like q",
         "shape " + shape_string(k));
}

// check_query_key_shapes, then v shaped like k and out like q (out's elements distinct).
void check_attention_shapes(const ValidatedCall& call, const TensorView& q,
                            const char* batch_name, const char* k_name, const TensorView& k,
                            const char* v_name, const TensorView& v, const std::string& v_layout,
                            const TensorView& out, const std::string& out_layout) {
  check_query_key_shapes(call, q, batch_name, k_name, k);
  check_shape(v_name, v, sizes_of(k), v_layout);
  check_shape("out", out, sizes_of(q), out_layout);
  check_no_self_overlap("out", out);
}

// lse, when wanted: fp32, contiguous, on q's device, (B, H, Sq) or (H, total_q).
Extent expect_lse(const std::optional<TensorView>& lse, const TensorView& q,
                  std::vector<int64_t> shape, const char* layout) {
  if (!lse) return {};
  const int rank = static_cast<int>(shape.size());
  return expect(q, {{.name = "lse", .view = &*lse, .rank = rank, .dtypes = kFloat32,
                     .shape = std::move(shape), .layout = layout, .contiguous = true}})
      .front()
      .extent;
}

// The ALiBi slopes, when given: fp32 (H) or (B, H), contiguous, on q's device.
std::vector<Argument> expect_alibi(const Options& options, const TensorView& q, int64_t batch,
                                   int64_t heads) {
  if (!options.alibi_slopes) return {};
  const TensorView& a = *options.alibi_slopes;
  if (a.ndim != 1 && a.ndim != 2)
    fail("alibi_slopes", "shape (H) or (B, H)", std::to_string(a.ndim) + " dimensions");
  const bool per_batch = a.ndim == 2;
  return expect(q, {{.name = "alibi_slopes", .view = &a, .rank = a.ndim, .dtypes = kFloat32,
                     .shape = per_batch ? std::vector<int64_t>{batch, heads}
                                        : std::vector<int64_t>{heads},
                     .layout = per_batch ? "= (B, H)" : "= (H)",
                     .contiguous = true}});
}

// FP8 inputs' descales (docs/SPEC.md, "FP8 inputs"): given only for fp8 e4m3 q, k, v; each fp32,
// contiguous, on q's device, (B, Hk) or (B, Hk, ceil(S / kFp8ScaleBlockRows)) with S the
// rows of its tensor's longest sequence (Sq or Sk dense; max_seqlen_q/k varlen). And no
// dropout with fp8 inputs: they have no backward, so no training.
std::vector<Argument> expect_descales(const Options& options, const TensorView& q,
                                      const ValidatedCall& call, const Varlen* varlen) {
  const bool fp8 = q.dtype == DType::Float8E4M3;
  if (fp8 && options.dropout_p != 0.0f)
    fail("dropout_p", "0 for fp8_e4m3 inputs (forward only: no backward, no training)",
         number_string(options.dropout_p));
  const int64_t seqlen_q = varlen != nullptr ? varlen->max_seqlen_q : call.rows_q;
  const int64_t seqlen_k = varlen != nullptr ? varlen->max_seqlen_k : call.rows_k;
  const auto layout = [](const char* seqlen) {
    return "= (B, Hk) or (B, Hk, ceil(" + std::string(seqlen) + " / " +
           std::to_string(kFp8ScaleBlockRows) + "))";
  };
  const struct {
    const char* name;
    const std::optional<TensorView>& factors;
    int64_t seqlen;
    std::string per_block_layout;
  } descales[] = {{"q_descale", options.q_descale, seqlen_q, layout("Sq")},
                  {"k_descale", options.k_descale, seqlen_k, layout("Sk")},
                  {"v_descale", options.v_descale, seqlen_k, layout("Sk")}};
  std::vector<Argument> checked;
  for (const auto& d : descales) {
    if (!d.factors) continue;
    const TensorView& t = *d.factors;
    if (!fp8)
      fail(d.name, "none: descales go with fp8_e4m3 inputs",
           std::string("a descale for q of dtype ") + dtype_name(q.dtype));
    if (t.ndim != 2 && t.ndim != 3)
      fail(d.name, std::string("shape ") + d.per_block_layout, dimensions_string(t.ndim));
    const int64_t blocks = (d.seqlen + kFp8ScaleBlockRows - 1) / kFp8ScaleBlockRows;
    append(checked, expect(q, {{.name = d.name, .view = &t, .rank = t.ndim, .dtypes = kFloat32,
                                .shape = t.ndim == 2
                                             ? std::vector<int64_t>{call.batch, call.heads_k}
                                             : std::vector<int64_t>{call.batch, call.heads_k,
                                                                    blocks},
                                .layout = d.per_block_layout,
                                .contiguous = true}}));
  }
  return checked;
}

// An FP8 KV cache's descales (docs/SPEC.md, "Decoding with a KV cache"): k_descale and
// v_descale only with fp8 e4m3 caches, each fp32, contiguous, on q's device, (B, Hk): one
// factor per sequence and key/value head. q is never fp8 here, so never q_descale.
std::vector<Argument> expect_cache_descales(const Options& options, const TensorView& q,
                                            const TensorView& k_cache, const ValidatedCall& call) {
  if (options.q_descale)
    fail("q_descale", "none: forward_kvcache takes q in fp32, fp16 or bf16 (only its caches may "
         "be fp8_e4m3)", "a q_descale");
  const bool fp8 = k_cache.dtype == DType::Float8E4M3;
  const std::pair<const char*, const std::optional<TensorView>*> descales[] = {
      {"k_descale", &options.k_descale}, {"v_descale", &options.v_descale}};
  std::vector<Argument> checked;
  for (const auto& [name, factors] : descales) {
    if (!*factors) continue;
    if (!fp8)
      fail(name, "none: descales go with fp8_e4m3 caches",
           std::string("a descale for caches of dtype ") + dtype_name(k_cache.dtype));
    if ((*factors)->ndim != 2)
      fail(name, "shape (B, Hk) = (" + std::to_string(call.batch) + ", " +
                     std::to_string(call.heads_k) +
                     "): one factor per sequence and key/value head (caches take no "
                     "per-block factors)",
           dimensions_string((*factors)->ndim));
    append(checked, expect(q, {{.name = name, .view = &**factors, .rank = 2, .dtypes = kFloat32,
                                .shape = {call.batch, call.heads_k},
                                .layout = "= (B, Hk): one factor per sequence and key/value head",
                                .contiguous = true}}));
  }
  return checked;
}

// Outputs must not overlap an input (or each other): a write would change what is read.
void check_outputs_disjoint(const std::vector<Argument>& inputs, const Argument& out,
                            const std::optional<TensorView>& lse, const Extent& lse_extent) {
  for (const Argument& in : inputs) {
    check_disjoint("out", *out.view, out.extent, in.name, *in.view, in.extent);
    if (lse) check_disjoint("lse", *lse, lse_extent, in.name, *in.view, in.extent);
  }
  if (lse) check_disjoint("lse", *lse, lse_extent, "out", *out.view, out.extent);
}

// The backend, then the memory it needs: the rows the CUDA backend copies (check_rows_aligned;
// rows_dtype: the call's dtype there, fp8 e4m3 where anything is, which is never padded),
// and every pointer element-aligned and where its view says (check_pointer).
Backend check_backend_memory(const Execution& execution, const TensorView& q, int64_t head_dim,
                             const std::vector<Argument>& copied_by_rows,
                             const std::vector<Argument>& inputs, const Argument& out,
                             const std::optional<TensorView>& lse,
                             std::optional<DType> rows_dtype = std::nullopt) {
  const Backend backend = resolve_backend(execution, q);
  if (backend == Backend::CUDA)
    for (const Argument& t : copied_by_rows)
      check_rows_aligned(t.name, *t.view, head_dim, rows_dtype.value_or(q.dtype));
  for (const Argument& in : inputs) check_pointer(execution, in.name, *in.view);
  check_pointer(execution, "out", *out.view);
  if (lse) check_pointer(execution, "lse", *lse);
  return backend;
}

// cu_seqlens_q/k, max_seqlen_q/k and seqused_k of a varlen call: structure, then values.
std::vector<Argument> expect_varlen(const Varlen& varlen, const TensorView& q, int64_t batch,
                                    int64_t rows_q, int64_t rows_k) {
  const TensorView& cq = varlen.cu_seqlens_q;
  const TensorView& ck = varlen.cu_seqlens_k;
  std::vector<Argument> checked =
      expect(q, {{.name = "cu_seqlens_q", .view = &cq, .rank = 1, .dtypes = kInt32,
                  .contiguous = true},
                 {.name = "cu_seqlens_k", .view = &ck, .rank = 1, .dtypes = kInt32,
                  .shape = {batch + 1}, .layout = "= (B + 1) like cu_seqlens_q",
                  .contiguous = true}});
  // Lengths come from int32 prefix sums, so a larger bound is meaningless (and would
  // size a GPU grid absurdly).
  if (varlen.max_seqlen_q < 0 || varlen.max_seqlen_q > kInt32Max)
    fail("max_seqlen_q", "a length in [0, 2^31)", std::to_string(varlen.max_seqlen_q));
  if (varlen.max_seqlen_k < 0 || varlen.max_seqlen_k > kInt32Max)
    fail("max_seqlen_k", "a length in [0, 2^31)", std::to_string(varlen.max_seqlen_k));
  // The values are read here, before check_backend_memory checks every pointer: a misaligned
  // one must be refused first, not read (an int32 load off its alignment is undefined).
  check_element_aligned("cu_seqlens_q", cq);
  check_element_aligned("cu_seqlens_k", ck);
  check_cu_seqlens("cu_seqlens_q", cq, rows_q, varlen.max_seqlen_q, "max_seqlen_q");
  check_cu_seqlens("cu_seqlens_k", ck, rows_k, varlen.max_seqlen_k, "max_seqlen_k");
  if (!varlen.seqused_k) return checked;
  const TensorView& su = *varlen.seqused_k;
  append(checked, expect(q, {{.name = "seqused_k", .view = &su, .rank = 1, .dtypes = kInt32,
                              .shape = {batch}, .layout = "= (B)", .contiguous = true}}));
  check_element_aligned("seqused_k", su);
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
  return checked;
}

// The key lengths of a paged varlen call against its pages, when the values are in host
// memory (the CPU backend; CUDA kernels clamp the lengths and guard the page indices): each
// sequence's keys (seqused_k[b], else its cu_seqlens_k length) fit in max_pages * page_size
// positions, and every page that holds one of them exists.
void check_paged_lengths(const Varlen& varlen, int64_t batch, const TensorView& k,
                         int64_t capacity) {
  const TensorView& table = *varlen.block_table;
  const int32_t* cu = host_int32(varlen.cu_seqlens_k);
  const int32_t* pages = host_int32(table);
  // A host table with no entries (max_pages = 0) may have a null pointer: its capacity, 0, is
  // still checked (fuzz_varlen found one accepted for sequences with keys); only device memory
  // goes unread. Its pages are looked up only for a sequence with keys.
  if (cu == nullptr || table.device.type != DeviceType::CPU) return;
  const int32_t* used = varlen.seqused_k ? host_int32(*varlen.seqused_k) : nullptr;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t keys = used != nullptr ? used[b] : static_cast<int64_t>(cu[b + 1]) - cu[b];
    if (keys > capacity)
      fail("block_table",
           "room for every sequence's keys in max_pages * page_size = " +
               std::to_string(capacity) + " positions (max_pages " +
               std::to_string(table.sizes[1]) + " x page_size " + std::to_string(k.sizes[1]) +
               ")",
           "sequence " + std::to_string(b) + " with " + std::to_string(keys) + " keys" +
               (used != nullptr ? " (seqused_k)" : " (cu_seqlens_k)"));
    if (keys > 0) check_pages_used(pages, table, b, 0, keys, k.sizes[1], k.sizes[0]);
  }
}

// Both of a pair of optional arguments or neither.
void check_both_or_neither(const char* first, bool has_first, const char* second,
                           bool has_second) {
  if (has_first != has_second)
    fail(has_first ? second : first,
         std::string("a tensor, since ") + (has_first ? first : second) +
             " is given (both or neither)",
         "none");
}

}  // namespace

ValidatedCall validate_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                               const TensorView& out, const std::optional<TensorView>& lse,
                               const Varlen* varlen, const Options& options,
                               const Execution& execution) {
  check_options(options);
  check_execution(execution);

  const bool is_varlen = varlen != nullptr;
  const bool paged = is_varlen && varlen->block_table.has_value();
  const int rank = is_varlen ? 3 : 4;
  // fp8 values may come (d, seqlen)-major, dense or varlen: their sequence dimension
  // contiguous instead of the head dim (docs/SPEC.md, "FP8 inputs").
  const int v_seqlen_dim = q.dtype == DType::Float8E4M3 && !paged ? rank - 3 : -1;
  std::vector<Argument> inputs = expect_attention_tensors(q, "k", k, "v", v, out, rank, paged ? 4 : rank,
                                                          kForwardDTypes, false, v_seqlen_dim);
  const Argument out_checked = inputs.back();
  inputs.pop_back();
  const std::vector<Argument> copied_by_rows{inputs[0], inputs[1], inputs[2], out_checked};

  ValidatedCall call = batch_dimensions(q, k, varlen);
  check_attention_shapes(call, q, is_varlen ? "cu_seqlens_q" : "q", "k", k, "v", v,
                         paged       ? "= (num_pages, page_size, Hk, D) like k"
                         : is_varlen ? "= (total_k, Hk, D) like k"
                                     : "= (B, Sk, Hk, D) like k",
                         out, is_varlen ? "= (total_q, H, D) like q" : "= (B, Sq, H, D) like q");
  check_positions(options, call.rows_q, call.rows_k);

  const Extent lse_extent =
      is_varlen ? expect_lse(lse, q, {call.heads, call.rows_q}, "= (H, total_q)")
                : expect_lse(lse, q, {call.batch, call.heads, call.rows_q}, "= (B, H, Sq)");
  append(inputs, expect_alibi(options, q, call.batch, call.heads));
  append(inputs, expect_descales(options, q, call, varlen));
  if (is_varlen)
    append(inputs, expect_varlen(*varlen, q, call.batch, call.rows_q,
                                 paged ? kNoRowBound : call.rows_k));
  if (paged)  // the rows a sequence can have: its pages' (max_pages * page_size)
    append(inputs, expect_block_table(q, *varlen->block_table, call.batch, "k", k,
                                      "paged keys and values", &call.rows_k));

  check_outputs_disjoint(inputs, out_checked, lse, lse_extent);
  call.backend = check_backend_memory(execution, q, call.head_dim, copied_by_rows, inputs,
                                      out_checked, lse);
  // The Hopper kernel loads (d, seqlen)-major values by TMA boxes whose rows start at a
  // sequence's key offset, which TMA needs at a 16-byte multiple in the contiguous dimension:
  // cu_seqlens_k gives no such promise (and lives on the GPU), so varlen calls keep v
  // row-major there.
  if (call.backend == Backend::CUDA && is_varlen && is_seqlen_major(v))
    unsupported("v", "a contiguous last dimension for varlen calls on the cuda backend ((d, seqlen)-major "
                "values: dense calls only there)",
                "strides " + strides_string(v));
  // Last, as in validate_kvcache: the values, after every structural check (host only).
  if (paged) check_paged_lengths(*varlen, call.batch, k, call.rows_k);
  return call;
}

ValidatedCall validate_kvcache(const TensorView& q, const KvCache& cache, const TensorView& out,
                               const std::optional<TensorView>& lse, const Options& options,
                               const Execution& execution) {
  check_options(options);
  if (options.dropout_p != 0.0f)
    fail("dropout_p", "0 (forward_kvcache is inference only)", number_string(options.dropout_p));
  if (options.positions)
    unsupported("positions", "none for forward_kvcache (the cache gives the positions)",
                "positions");
  if (cache.num_splits < 0 || cache.num_splits > kMaxSplits)
    fail("num_splits",
         "0 (choose) or a key chunk count in [1, " + std::to_string(kMaxSplits) + "]",
         std::to_string(cache.num_splits));
  check_execution(execution);

  const TensorView& kc = cache.k_cache;
  const TensorView& vc = cache.v_cache;
  std::vector<Argument> inputs =
      expect_attention_tensors(q, "k_cache", kc, "v_cache", vc, out, 4, 4, kAttentionDTypes,
                               /*fp8_kv=*/true);
  const Argument out_checked = inputs.back();
  inputs.pop_back();
  const Argument kc_checked = inputs[1], vc_checked = inputs[2];
  std::vector<Argument> copied_by_rows{inputs[0], kc_checked, vc_checked, out_checked};

  ValidatedCall call = dimensions(q, kc, q.sizes[0]);
  const int64_t batch = call.batch;
  check_attention_shapes(call, q, "q", "k_cache", kc, "v_cache", vc, "like k_cache", out,
                         "= (B, Sq, H, D) like q");

  const std::pair<const char*, const TensorView*> per_sequence[] = {
      {"cache_seqlens", &cache.cache_seqlens},
      {"cache_batch_idx", given(cache.cache_batch_idx)},
      {"cache_leftpad", given(cache.cache_leftpad)}};
  for (const auto& [name, t] : per_sequence)
    append(inputs, expect(q, {{.name = name, .view = t, .rank = 1, .dtypes = kInt32,
                               .shape = {batch}, .layout = "= (B)"}}));

  // Dense (B_cache, S_cache, Hk, D) or paged (num_pages, page_size, Hk, D).
  int64_t capacity = kc.sizes[1];
  if (cache.block_table) {
    const TensorView& bt = *cache.block_table;
    if (cache.cache_batch_idx)
      fail("cache_batch_idx", "no cache_batch_idx with a paged cache (block_table picks the pages)",
           "both cache_batch_idx and block_table");
    append(inputs, expect_block_table(q, bt, batch, "k_cache", kc, "a paged cache", &capacity));
  } else if (cache.cache_batch_idx ? batch > 0 && kc.sizes[0] < 1 : kc.sizes[0] < batch) {
    fail("k_cache",
         cache.cache_batch_idx
             ? std::string("at least one cache row (dim 0) for cache_batch_idx to pick")
             : "at least B = " + std::to_string(batch) +
                   " cache rows (dim 0), or cache_batch_idx to pick them",
         "shape " + shape_string(kc));
  }
  call.rows_k = capacity;

  // Appended keys and values: both or neither, (B, S_new, Hk, D) in q's dtype.
  check_both_or_neither("k_new", cache.k_new.has_value(), "v_new", cache.v_new.has_value());
  const int64_t seqlen_new = cache.k_new ? cache.k_new->sizes[1] : 0;
  if (cache.k_new) {
    const std::vector<DType> like_q{q.dtype};
    const std::vector<int64_t> shape{batch, seqlen_new, call.heads_k, call.head_dim};
    const std::vector<Argument> appended =
        expect(q, {{.name = "k_new", .view = &*cache.k_new, .rank = 4, .dtypes = like_q,
                    .shape = shape, .layout = "= (B, S_new, Hk, D)"},
                   {.name = "v_new", .view = &*cache.v_new, .rank = 4, .dtypes = like_q,
                    .shape = shape, .layout = "= (B, S_new, Hk, D) like k_new"}});
    if (seqlen_new > kInt32Max)
      fail("k_new", "S_new < 2^31 new positions", "shape " + shape_string(*cache.k_new));
    append(inputs, appended);
    append(copied_by_rows, appended);
  }

  // Rotary tables: both or neither, (S_rotary, rotary_dim / 2), 2 <= rotary_dim <= D.
  check_both_or_neither("rotary_cos", cache.rotary_cos.has_value(), "rotary_sin",
                        cache.rotary_sin.has_value());
  if (cache.rotary_cos) {
    const TensorView& cos = *cache.rotary_cos;
    const TensorView& sin = *cache.rotary_sin;
    const std::vector<DType> like_q{q.dtype};
    append(inputs, expect(q, {{.name = "rotary_cos", .view = &cos, .rank = 2, .dtypes = like_q},
                              {.name = "rotary_sin", .view = &sin, .rank = 2, .dtypes = like_q}}));
    if (cos.sizes[1] < 1 || 2 * cos.sizes[1] > call.head_dim)
      fail("rotary_cos",
           "shape (S_rotary, rotary_dim / 2) with 2 <= rotary_dim <= D = " +
               std::to_string(call.head_dim),
           "shape " + shape_string(cos));
    check_shape("rotary_sin", sin, {cos.sizes[0], cos.sizes[1]}, "like rotary_cos");
  }

  const Extent lse_extent =
      expect_lse(lse, q, {batch, call.heads, call.rows_q}, "= (B, H, Sq)");
  append(inputs, expect_alibi(options, q, batch, call.heads));
  append(inputs, expect_cache_descales(options, q, kc, call));
  // fp8 caches on CUDA: the decode kernel reads 16-byte rows of e4m3 (never padded).
  const bool fp8_caches = kc.dtype == DType::Float8E4M3;
  if (fp8_caches && resolve_backend(execution, q) == Backend::CUDA) {
    if (call.head_dim % 16 != 0)
      unsupported("k_cache",
                  "a head dim D that is a multiple of 16 for fp8_e4m3 caches on the cuda backend "
                  "(rows of whole 16-byte chunks)",
                  "D = " + std::to_string(call.head_dim));
  }

  // What the call writes must not overlap what it reads: out and lse, and the caches when
  // k_new is appended (a packed (.., 2, Hk, D) cache, k and v interleaved, is fine: the two
  // caches are read and written at distinct elements).
  check_outputs_disjoint(inputs, out_checked, lse, lse_extent);
  if (seqlen_new > 0 && batch > 0) {
    check_no_self_overlap("k_cache", kc);
    check_no_self_overlap("v_cache", vc);
    for (const Argument& in : inputs) {
      if (in.view == &kc || in.view == &vc) continue;
      check_disjoint("k_cache", kc, kc_checked.extent, in.name, *in.view, in.extent);
      check_disjoint("v_cache", vc, vc_checked.extent, in.name, *in.view, in.extent);
    }
  }
  call.backend = check_backend_memory(execution, q, call.head_dim, copied_by_rows, inputs,
                                      out_checked, lse,
                                      fp8_caches ? std::optional(DType::Float8E4M3) : std::nullopt);

  // Last, so that a call with a bad value fails after every structural check, and only now
  // that every pointer is known to be readable (KvCacheValues: which values can be read).
  const bool rotary_q_per_row =
      kvcache_rotary_q_per_row(options.window_left, window_right_of(options));
  check_kvcache_values(cache, readable_kvcache_values(cache, call.backend, execution), batch,
                       call.rows_q, seqlen_new, capacity, rotary_q_per_row);
  return call;
}

ValidatedCall validate_probabilities(const TensorView& q, const TensorView& k,
                                     const TensorView& probs, const Varlen* varlen,
                                     const Options& options, const Execution& execution) {
  // A testing aid over unpaged keys (upstream's S_dmask): paged ones would need their own
  // kernel.
  if (varlen != nullptr && varlen->block_table)
    unsupported("block_table", "none for attention_probabilities (unpaged keys only)",
                "a block table");
  check_options(options);
  check_execution(execution);

  const bool is_varlen = varlen != nullptr;
  const int rank = is_varlen ? 3 : 4;
  std::vector<Argument> inputs =
      expect(q, {{.name = "q", .view = &q, .rank = rank,
                  .dtypes = {DType::Float32, DType::Float16, DType::BFloat16},
                  .on_q_device = false},
                 {.name = "k", .view = &k, .rank = rank, .dtypes = {q.dtype}}});
  const Extent probs_extent =
      expect(q, {{.name = "probs", .view = &probs, .rank = 4, .dtypes = kFloat32}})
          .front()
          .extent;
  ValidatedCall call = batch_dimensions(q, k, varlen);
  check_query_key_shapes(call, q, is_varlen ? "cu_seqlens_q" : "q", "k", k);
  check_positions(options, call.rows_q, call.rows_k);
  append(inputs, expect_alibi(options, q, call.batch, call.heads));
  if (is_varlen)
    append(inputs, expect_varlen(*varlen, q, call.batch, call.rows_q, call.rows_k));

  // One row per query position and one column per key position of the longest sequence.
  check_shape("probs", probs,
              {call.batch, call.heads, is_varlen ? varlen->max_seqlen_q : call.rows_q,
               is_varlen ? varlen->max_seqlen_k : call.rows_k},
              is_varlen ? "= (B, H, max_seqlen_q, max_seqlen_k)" : "= (B, H, Sq, Sk)");
  check_no_self_overlap("probs", probs);
  for (const Argument& in : inputs)
    check_disjoint("probs", probs, probs_extent, in.name, *in.view, in.extent);

  // The CUDA kernel reads and writes element by element: no 16-byte rows needed.
  call.backend = resolve_backend(execution, q);
  for (const Argument& in : inputs) check_pointer(execution, in.name, *in.view);
  check_pointer(execution, "probs", probs);
  return call;
}

ValidatedCall validate_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                                const TensorView& out, const TensorView& dout,
                                const TensorView& lse, const TensorView& dq,
                                const TensorView& dk, const TensorView& dv, const Varlen* varlen,
                                const Options& options, const Execution& execution) {
  // Upstream FlashAttention has no paged backward either: refused before anything else, so
  // that the message says so rather than something about the paged shapes.
  if (varlen != nullptr && varlen->block_table)
    unsupported("block_table", "none for a backward (paged keys and values are forward only)",
                "a block table");
  // FP8 inputs are forward only (no FP8 backward, as in FlashAttention-3).
  if (q.dtype == DType::Float8E4M3)
    unsupported("q", "dtype fp32, fp16 or bf16 for a backward (fp8_e4m3 inputs are forward only)",
                "dtype fp8_e4m3");
  // The forward's own checks cover q, k, v, out, lse, the options and the backend.
  const ValidatedCall call = validate_forward(q, k, v, out, lse, varlen, options, execution);

  // dout like out and the gradients like what they differentiate: their structure first,
  // then each one's dtype, device and shape (the gradients' elements distinct).
  const int rank = varlen != nullptr ? 3 : 4;
  struct Like {
    const char* name;
    const TensorView* view;
    const TensorView* like;
    const char* like_name;
  };
  const Like likes[] = {{"dout", &dout, &out, "out"}, {"dq", &dq, &q, "q"},
                        {"dk", &dk, &k, "k"}, {"dv", &dv, &v, "v"}};
  const std::vector<Argument> checked =
      expect(q, {{.name = "dout", .view = &dout, .rank = rank, .on_q_device = false},
                 {.name = "dq", .view = &dq, .rank = rank, .on_q_device = false},
                 {.name = "dk", .view = &dk, .rank = rank, .on_q_device = false},
                 {.name = "dv", .view = &dv, .rank = rank, .on_q_device = false}});
  for (const Like& l : likes) {
    expect(q, {{.name = l.name, .view = l.view, .rank = rank, .dtypes = {l.like->dtype},
                .shape = sizes_of(*l.like), .layout = std::string("like ") + l.like_name}});
    if (l.view != &dout) check_no_self_overlap(l.name, *l.view);
  }
  const Argument& dout_checked = checked[0];
  const std::vector<Argument> grads(checked.begin() + 1, checked.end());

  // The gradients are written while every input is still being read.
  std::vector<std::pair<const char*, const TensorView*>> inputs{
      {"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}, {"dout", &dout}, {"lse", &lse}};
  if (options.alibi_slopes) inputs.emplace_back("alibi_slopes", &*options.alibi_slopes);
  if (varlen != nullptr) {
    inputs.emplace_back("cu_seqlens_q", &varlen->cu_seqlens_q);
    inputs.emplace_back("cu_seqlens_k", &varlen->cu_seqlens_k);
    if (varlen->seqused_k) inputs.emplace_back("seqused_k", &*varlen->seqused_k);
  }
  for (size_t n = 0; n < grads.size(); ++n) {
    const Argument& g = grads[n];
    for (const auto& [name, view] : inputs)
      check_disjoint(g.name, *g.view, g.extent, name, *view,
                     view == &dout ? dout_checked.extent : check_view(name, *view, view->ndim));
    for (size_t m = 0; m < n; ++m)
      check_disjoint(g.name, *g.view, g.extent, grads[m].name, *grads[m].view, grads[m].extent);
  }
  if (call.backend == Backend::CUDA) {
    // The kernels read dout and write the gradients in 16-byte (dq) and 4-byte chunks.
    for (const Argument& t : checked) check_rows_aligned(t.name, *t.view, call.head_dim, q.dtype);
  }
  for (const Argument& t : checked) check_pointer(execution, t.name, *t.view);
  return call;
}

}  // namespace flashattn::detail

// flashattn._C: a thin nanobind layer over the C ABI (include/flashattn/flashattn.h).
//
// One function per C ABI entry point. A tensor argument is either
//   - anything nanobind accepts as an ndarray (DLPack `__dlpack__`, NumPy's buffer protocol), or
//   - a raw descriptor tuple (data_ptr, dtype, device_type, device_index, sizes, strides) with
//     fa_dtype / fa_device_type codes and strides in elements.
// The PyTorch layer passes raw descriptors: no DLPack round trip per call, and, on CUDA, no
// implicit stream synchronisation (torch's __dlpack__ would record events, which CUDA-graph
// capture forbids). Nothing here allocates or copies a tensor: views go through as views.
//
// Errors: the C ABI status and fa_last_error() become ValueError (invalid argument),
// TypeError (a dtype that is wrong for the argument), NotImplementedError (valid but not
// available in this build or backend) and RuntimeError (backend or internal failure). An
// invalid block_table (a paged cache too small for cache_seqlens + S_new among them) raises
// BlockTableError, both a ValueError and a RuntimeError: upstream FlashAttention raises
// RuntimeError there, and code written for it catches that.
#include <flashattn/flashattn.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

namespace nb = nanobind;

namespace {

using Array = nb::ndarray<nb::ro>;

// One tensor argument: the fa_tensor view, and the ndarray that keeps a DLPack producer's
// buffer alive for the duration of the call.
struct Arg {
  fa_tensor view{};
  std::optional<Array> array;
  const fa_tensor* ptr() const { return &view; }
};

[[noreturn]] void type_error(const std::string& message) { throw nb::type_error(message.c_str()); }

// flashattn._C.BlockTableError(ValueError, RuntimeError), created with the module.
PyObject* block_table_error = nullptr;
[[noreturn]] void value_error(const std::string& message) { throw nb::value_error(message.c_str()); }

int32_t dtype_from_dlpack(const nb::dlpack::dtype& d, const char* name) {
  using code = nb::dlpack::dtype_code;
  if (d.lanes == 1) {
    if (d.code == static_cast<uint8_t>(code::Float) && d.bits == 32) return FA_FLOAT32;
    if (d.code == static_cast<uint8_t>(code::Float) && d.bits == 16) return FA_FLOAT16;
    if (d.code == static_cast<uint8_t>(code::Bfloat) && d.bits == 16) return FA_BFLOAT16;
    // NumPy has no bfloat16 of its own: the Python layer passes ml_dtypes.bfloat16 arrays
    // as uint16 views of the same bits.
    if (d.code == static_cast<uint8_t>(code::UInt) && d.bits == 16) return FA_BFLOAT16;
    if (d.code == static_cast<uint8_t>(code::Int) && d.bits == 32) return FA_INT32;
    if (d.code == static_cast<uint8_t>(code::Float8_E4M3FN) && d.bits == 8) return FA_FLOAT8_E4M3;
  }
  type_error(std::string(name) + ": expected dtype fp32, fp16, bf16, float8_e4m3fn (int32 "
             "for sequence offsets), given DLPack dtype code " + std::to_string(d.code) + " with " +
             std::to_string(d.bits) + " bits");
}

Arg from_raw(const nb::tuple& t, const char* name) {
  if (t.size() != 6)
    value_error(std::string(name) + ": expected a descriptor (data_ptr, dtype, device_type, "
                "device_index, sizes, strides), given a tuple of " + std::to_string(t.size()));
  Arg a;
  a.view.data = reinterpret_cast<void*>(nb::cast<uintptr_t>(t[0]));
  a.view.dtype = nb::cast<int32_t>(t[1]);
  a.view.device_type = nb::cast<int32_t>(t[2]);
  a.view.device_index = nb::cast<int32_t>(t[3]);
  nb::sequence sizes = nb::cast<nb::sequence>(t[4]);
  nb::sequence strides = nb::cast<nb::sequence>(t[5]);
  const size_t ndim = nb::len(sizes);
  if (ndim > FA_MAX_DIMS || nb::len(strides) != ndim)
    value_error(std::string(name) + ": expected at most " + std::to_string(FA_MAX_DIMS) +
                " dimensions with one stride each, given " + std::to_string(ndim) + " sizes and " +
                std::to_string(nb::len(strides)) + " strides");
  a.view.ndim = static_cast<int32_t>(ndim);
  for (size_t i = 0; i < ndim; ++i) {
    a.view.sizes[i] = nb::cast<int64_t>(sizes[i]);
    a.view.strides[i] = nb::cast<int64_t>(strides[i]);
  }
  return a;
}

Arg from_array(nb::handle h, const char* name) {
  Array array;
  if (!nb::try_cast<Array>(h, array))
    type_error(std::string(name) + ": expected an array with __dlpack__ (or the buffer "
               "protocol) or a raw tensor descriptor, given " +
               nb::cast<std::string>(nb::str(h.type())));
  Arg a;
  a.view.data = const_cast<void*>(array.data());
  a.view.dtype = dtype_from_dlpack(array.dtype(), name);
  const int32_t device = array.device_type();
  if (device == nb::device::cpu::value) {
    a.view.device_type = FA_DEVICE_CPU;
  } else if (device == nb::device::cuda::value || device == nb::device::cuda_managed::value) {
    a.view.device_type = FA_DEVICE_CUDA;
  } else {
    type_error(std::string(name) + ": expected a CPU or CUDA array, given DLPack device type " +
               std::to_string(device));
  }
  a.view.device_index = array.device_id();
  if (array.ndim() > FA_MAX_DIMS)
    value_error(std::string(name) + ": expected at most " + std::to_string(FA_MAX_DIMS) +
                " dimensions, given " + std::to_string(array.ndim()));
  a.view.ndim = static_cast<int32_t>(array.ndim());
  for (size_t i = 0; i < array.ndim(); ++i) {
    a.view.sizes[i] = static_cast<int64_t>(array.shape(i));
    a.view.strides[i] = array.stride(i);
  }
  if (array.size() == 0) {
    // Producers report arbitrary (often zero) strides for empty arrays; an empty array has
    // no layout, so describe it as row-major for the library's stride checks.
    int64_t stride = 1;
    for (int i = a.view.ndim - 1; i >= 0; --i) {
      a.view.strides[i] = stride;
      stride *= a.view.sizes[i] > 0 ? a.view.sizes[i] : 1;
    }
  }
  a.array = std::move(array);
  return a;
}

Arg tensor(nb::handle h, const char* name) {
  if (nb::isinstance<nb::tuple>(h)) return from_raw(nb::borrow<nb::tuple>(h), name);
  return from_array(h, name);
}

std::optional<Arg> optional_tensor(nb::handle h, const char* name) {
  if (h.is_none()) return std::nullopt;
  return tensor(h, name);
}

const fa_tensor* ptr(const std::optional<Arg>& a) { return a ? a->ptr() : nullptr; }

// Turns a failed status into the Python exception that fits it, with the library's message.
void check(fa_status status, const std::string& message) {
  switch (status) {
    case FA_OK:
      return;
    case FA_ERROR_INVALID_ARGUMENT:
      // Messages read "<argument>: expected <expected>, given <given>"; a dtype expectation
      // is a type problem.
      if (message.find(": expected dtype") != std::string::npos ||
          message.find(": expected a dtype") != std::string::npos)
        type_error(message);
      if (message.rfind("block_table: ", 0) == 0) {
        PyErr_SetString(block_table_error, message.c_str());
        throw nb::python_error();
      }
      value_error(message);
    case FA_ERROR_UNSUPPORTED:
      PyErr_SetString(PyExc_NotImplementedError, message.c_str());
      throw nb::python_error();
    default:
      PyErr_SetString(PyExc_RuntimeError, message.c_str());
      throw nb::python_error();
  }
}

// The options every entry point shares, as Python passes them (keyword arguments).
struct Call {
  fa_options options{};
  fa_execution execution{};
  std::optional<Arg> alibi;
  std::optional<Arg> q_descale, k_descale, v_descale;

  Call(std::optional<float> softmax_scale, bool causal, int window_left, int window_right,
       float softcap, nb::handle alibi_slopes, float dropout_p, uint64_t seed, uint64_t offset,
       bool deterministic, nb::handle positions, int backend, uintptr_t stream, int num_threads, bool trust_devices) {
    fa_options_init(&options);
    fa_execution_init(&execution);
    options.has_softmax_scale = softmax_scale.has_value();
    options.softmax_scale = softmax_scale.value_or(0.0f);
    options.causal = causal;
    options.window_left = window_left;
    options.window_right = window_right;
    options.softcap = softcap;
    alibi = optional_tensor(alibi_slopes, "alibi_slopes");
    options.alibi_slopes = ptr(alibi);
    options.dropout_p = dropout_p;
    options.dropout_seed = seed;
    options.dropout_offset = offset;
    options.deterministic = deterministic;
    if (!positions.is_none()) {  // (query, key): Options::positions
      const auto [query, key] = nb::cast<std::pair<int64_t, int64_t>>(positions);
      options.has_positions = 1;
      options.query_position = query;
      options.key_position = key;
    }
    execution.backend = backend;
    execution.stream = reinterpret_cast<void*>(stream);
    execution.num_threads = num_threads;
    execution.trust_devices = trust_devices;
  }

  // FP8 (e4m3) inputs' or caches' descales: fp32 tensors or None.
  void set_descales(nb::handle q, nb::handle k, nb::handle v) {
    q_descale = optional_tensor(q, "q_descale");
    k_descale = optional_tensor(k, "k_descale");
    v_descale = optional_tensor(v, "v_descale");
    options.q_descale = ptr(q_descale);
    options.k_descale = ptr(k_descale);
    options.v_descale = ptr(v_descale);
  }
};

#define FA_DESCALE_ARGS                                                                  \
  nb::arg("q_descale").none() = nb::none(), nb::arg("k_descale").none() = nb::none(), \
      nb::arg("v_descale").none() = nb::none()

// Runs one C ABI call without the GIL (the CPU engine is multithreaded and may take long)
// and raises on failure. The thread-local error message is read on the same thread.
template <class F>
fa_run_info run_info(F&& call) {
  fa_status status;
  std::string message;
  fa_run_info info;
  fa_run_info_init(&info);
  {
    nb::gil_scoped_release release;
    status = call(&info);
    if (status != FA_OK) message = fa_last_error();
  }
  check(status, message);
  return info;
}

// The same, returning the fa_backend code that ran.
template <class F>
int run(F&& call) {
  return run_info(std::forward<F>(call)).backend;
}

#define FA_COMMON_ARGS                                                                      \
  nb::kw_only(), nb::arg("softmax_scale").none() = nb::none(), nb::arg("causal") = false,   \
      nb::arg("window_left") = -1, nb::arg("window_right") = -1, nb::arg("softcap") = 0.0f, \
      nb::arg("alibi_slopes").none() = nb::none(), nb::arg("dropout_p") = 0.0f,             \
      nb::arg("seed") = 0, nb::arg("offset") = 0, nb::arg("deterministic") = false,         \
      nb::arg("positions").none() = nb::none(),                                             \
      nb::arg("backend") = 0, nb::arg("stream") = 0, nb::arg("num_threads") = 0,            \
      nb::arg("trust_devices") = false

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "flashattn's C ABI (include/flashattn/flashattn.h), one function per entry point. "
            "Low level: outputs are caller-allocated; use flashattn.flash_attn_func and friends.";
  // The C ABI's codes (flashattn.h's enums, the one place they are defined): fa_backend, and
  // the fa_dtype and fa_device_type of a raw descriptor (what torch_ops.py builds).
  m.attr("BACKEND_AUTO") = static_cast<int>(FA_BACKEND_AUTO);
  m.attr("BACKEND_CPU") = static_cast<int>(FA_BACKEND_CPU);
  m.attr("BACKEND_CUDA") = static_cast<int>(FA_BACKEND_CUDA);
  m.attr("DTYPE_FLOAT32") = static_cast<int>(FA_FLOAT32);
  m.attr("DTYPE_FLOAT16") = static_cast<int>(FA_FLOAT16);
  m.attr("DTYPE_BFLOAT16") = static_cast<int>(FA_BFLOAT16);
  m.attr("DTYPE_INT32") = static_cast<int>(FA_INT32);
  m.attr("DTYPE_FLOAT8_E4M3") = static_cast<int>(FA_FLOAT8_E4M3);
  m.attr("FP8_SCALE_BLOCK_ROWS") = static_cast<int>(FA_FP8_SCALE_BLOCK_ROWS);
  m.attr("DEVICE_CPU") = static_cast<int>(FA_DEVICE_CPU);
  m.attr("DEVICE_CUDA") = static_cast<int>(FA_DEVICE_CUDA);
  // DLPack's device codes as from_array reads them (for _array.py's choice of array module).
  m.attr("DLPACK_DEVICE_CPU") = static_cast<int>(nb::device::cpu::value);
  m.attr("DLPACK_DEVICE_CUDA") = static_cast<int>(nb::device::cuda::value);

  {
    PyObject* bases = PyTuple_Pack(2, PyExc_ValueError, PyExc_RuntimeError);
    block_table_error = PyErr_NewExceptionWithDoc(
        "flashattn._C.BlockTableError",
        "An invalid block_table, such as a paged cache too small for cache_seqlens + S_new: a "
        "ValueError like every argument error, and a RuntimeError as upstream FlashAttention "
        "raises.",
        bases, nullptr);
    Py_XDECREF(bases);
    if (block_table_error == nullptr) throw nb::python_error();
    m.attr("BlockTableError") = nb::handle(block_table_error);
  }

  m.def("version", [] { return std::string(fa_version()); });
  m.def("cuda_compiled", [] { return fa_cuda_compiled() != 0; });

  m.def(
      "forward",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse,
         std::optional<float> softmax_scale, bool causal, int window_left, int window_right,
         float softcap, nb::handle alibi_slopes, float dropout_p, uint64_t seed, uint64_t offset,
         bool deterministic, nb::handle positions, int backend, uintptr_t stream, int num_threads, bool trust_devices,
         nb::handle q_descale, nb::handle k_descale, nb::handle v_descale) {
        Call c(softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
               dropout_p, seed, offset, deterministic, positions, backend, stream, num_threads, trust_devices);
        c.set_descales(q_descale, k_descale, v_descale);
        Arg tq = tensor(q, "q"), tk = tensor(k, "k"), tv = tensor(v, "v"),
            tout = tensor(out, "out");
        std::optional<Arg> tlse = optional_tensor(lse, "lse");
        return run([&](fa_run_info* info) {
          return fa_forward(tq.ptr(), tk.ptr(), tv.ptr(), tout.ptr(), ptr(tlse), &c.options,
                            &c.execution, info);
        });
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"), nb::arg("lse").none(),
      FA_COMMON_ARGS, FA_DESCALE_ARGS,
      "fa_forward: writes out (B, Sq, H, Dv) and lse (B, H, Sq) fp32 (may be None). "
      "Returns the fa_backend code that ran.");

  m.def(
      "forward_varlen",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse,
         nb::handle cu_seqlens_q, nb::handle cu_seqlens_k, int64_t max_seqlen_q,
         int64_t max_seqlen_k, nb::handle seqused_k, nb::handle block_table,
         std::optional<float> softmax_scale, bool causal, int window_left, int window_right,
         float softcap, nb::handle alibi_slopes, float dropout_p, uint64_t seed, uint64_t offset,
         bool deterministic, nb::handle positions, int backend, uintptr_t stream, int num_threads, bool trust_devices,
         nb::handle q_descale, nb::handle k_descale, nb::handle v_descale) {
        Call c(softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
               dropout_p, seed, offset, deterministic, positions, backend, stream, num_threads, trust_devices);
        c.set_descales(q_descale, k_descale, v_descale);
        Arg tq = tensor(q, "q"), tk = tensor(k, "k"), tv = tensor(v, "v"),
            tout = tensor(out, "out"), tcq = tensor(cu_seqlens_q, "cu_seqlens_q"),
            tck = tensor(cu_seqlens_k, "cu_seqlens_k");
        std::optional<Arg> tlse = optional_tensor(lse, "lse"),
                           tsk = optional_tensor(seqused_k, "seqused_k"),
                           ttable = optional_tensor(block_table, "block_table");
        return run([&](fa_run_info* info) {
          return fa_forward_varlen_paged(tq.ptr(), tk.ptr(), tv.ptr(), tout.ptr(), ptr(tlse),
                                         tcq.ptr(), tck.ptr(), max_seqlen_q, max_seqlen_k,
                                         ptr(tsk), ptr(ttable), &c.options, &c.execution, info);
        });
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"), nb::arg("lse").none(),
      nb::arg("cu_seqlens_q"), nb::arg("cu_seqlens_k"), nb::arg("max_seqlen_q"),
      nb::arg("max_seqlen_k"), nb::arg("seqused_k").none() = nb::none(),
      nb::arg("block_table").none() = nb::none(), FA_COMMON_ARGS, FA_DESCALE_ARGS,
      "fa_forward_varlen_paged (fa_forward_varlen without block_table): q (total_q, H, D), "
      "k/v (total_k, Hk, D) or, with block_table int32 (B, max_pages), paged "
      "(num_pages, page_size, Hk, D); out (total_q, H, Dv), lse (H, total_q) fp32.");

  m.def(
      "backward",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle dout,
         nb::handle lse, nb::handle dq, nb::handle dk, nb::handle dv,
         std::optional<float> softmax_scale, bool causal, int window_left, int window_right,
         float softcap, nb::handle alibi_slopes, float dropout_p, uint64_t seed, uint64_t offset,
         bool deterministic, nb::handle positions, int backend, uintptr_t stream, int num_threads, bool trust_devices) {
        Call c(softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
               dropout_p, seed, offset, deterministic, positions, backend, stream, num_threads, trust_devices);
        Arg tq = tensor(q, "q"), tk = tensor(k, "k"), tv = tensor(v, "v"),
            tout = tensor(out, "out"), tdout = tensor(dout, "dout"), tlse = tensor(lse, "lse"),
            tdq = tensor(dq, "dq"), tdk = tensor(dk, "dk"), tdv = tensor(dv, "dv");
        return run([&](fa_run_info* info) {
          return fa_backward(tq.ptr(), tk.ptr(), tv.ptr(), tout.ptr(), tdout.ptr(), tlse.ptr(),
                             tdq.ptr(), tdk.ptr(), tdv.ptr(), &c.options, &c.execution, info);
        });
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"), nb::arg("dout"), nb::arg("lse"),
      nb::arg("dq"), nb::arg("dk"), nb::arg("dv"), FA_COMMON_ARGS,
      "fa_backward: writes dq, dk, dv (the shapes and dtype of q, k, v).");

  m.def(
      "backward_varlen",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle dout,
         nb::handle lse, nb::handle dq, nb::handle dk, nb::handle dv, nb::handle cu_seqlens_q,
         nb::handle cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
         nb::handle seqused_k, std::optional<float> softmax_scale, bool causal, int window_left,
         int window_right, float softcap, nb::handle alibi_slopes, float dropout_p,
         uint64_t seed, uint64_t offset, bool deterministic, nb::handle positions, int backend, uintptr_t stream,
         int num_threads, bool trust_devices) {
        Call c(softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
               dropout_p, seed, offset, deterministic, positions, backend, stream, num_threads, trust_devices);
        Arg tq = tensor(q, "q"), tk = tensor(k, "k"), tv = tensor(v, "v"),
            tout = tensor(out, "out"), tdout = tensor(dout, "dout"), tlse = tensor(lse, "lse"),
            tdq = tensor(dq, "dq"), tdk = tensor(dk, "dk"), tdv = tensor(dv, "dv"),
            tcq = tensor(cu_seqlens_q, "cu_seqlens_q"), tck = tensor(cu_seqlens_k, "cu_seqlens_k");
        std::optional<Arg> tsk = optional_tensor(seqused_k, "seqused_k");
        return run([&](fa_run_info* info) {
          return fa_backward_varlen(tq.ptr(), tk.ptr(), tv.ptr(), tout.ptr(), tdout.ptr(),
                                    tlse.ptr(), tdq.ptr(), tdk.ptr(), tdv.ptr(), tcq.ptr(),
                                    tck.ptr(), max_seqlen_q, max_seqlen_k, ptr(tsk), &c.options,
                                    &c.execution, info);
        });
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"), nb::arg("dout"), nb::arg("lse"),
      nb::arg("dq"), nb::arg("dk"), nb::arg("dv"), nb::arg("cu_seqlens_q"),
      nb::arg("cu_seqlens_k"), nb::arg("max_seqlen_q"), nb::arg("max_seqlen_k"),
      nb::arg("seqused_k").none() = nb::none(), FA_COMMON_ARGS,
      "fa_backward_varlen: lse (H, total_q) fp32 is required.");

  m.def(
      "attention_probabilities",
      [](nb::handle q, nb::handle k, nb::handle probs, std::optional<float> softmax_scale,
         bool causal, int window_left, int window_right, float softcap, nb::handle alibi_slopes,
         float dropout_p, uint64_t seed, uint64_t offset, bool deterministic, nb::handle positions, int backend,
         uintptr_t stream, int num_threads, bool trust_devices) {
        Call c(softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
               dropout_p, seed, offset, deterministic, positions, backend, stream, num_threads, trust_devices);
        Arg tq = tensor(q, "q"), tk = tensor(k, "k"), tprobs = tensor(probs, "probs");
        return run([&](fa_run_info* info) {
          return fa_attention_probabilities(tq.ptr(), tk.ptr(), tprobs.ptr(), &c.options,
                                            &c.execution, info);
        });
      },
      nb::arg("q"), nb::arg("k"), nb::arg("probs"), FA_COMMON_ARGS,
      "fa_attention_probabilities (testing aid): writes probs (B, H, Sq, Sk) fp32, "
      "exp(s - row max) where visible, 0 elsewhere, negated where dropout drops.");

  m.def(
      "attention_probabilities_varlen",
      [](nb::handle q, nb::handle k, nb::handle probs, nb::handle cu_seqlens_q,
         nb::handle cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
         nb::handle seqused_k, std::optional<float> softmax_scale, bool causal, int window_left,
         int window_right, float softcap, nb::handle alibi_slopes, float dropout_p,
         uint64_t seed, uint64_t offset, bool deterministic, nb::handle positions, int backend, uintptr_t stream,
         int num_threads, bool trust_devices) {
        Call c(softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
               dropout_p, seed, offset, deterministic, positions, backend, stream, num_threads, trust_devices);
        Arg tq = tensor(q, "q"), tk = tensor(k, "k"), tprobs = tensor(probs, "probs"),
            tcq = tensor(cu_seqlens_q, "cu_seqlens_q"), tck = tensor(cu_seqlens_k, "cu_seqlens_k");
        std::optional<Arg> tsk = optional_tensor(seqused_k, "seqused_k");
        return run([&](fa_run_info* info) {
          return fa_attention_probabilities_varlen(tq.ptr(), tk.ptr(), tprobs.ptr(), tcq.ptr(),
                                                   tck.ptr(), max_seqlen_q, max_seqlen_k,
                                                   ptr(tsk), &c.options, &c.execution, info);
        });
      },
      nb::arg("q"), nb::arg("k"), nb::arg("probs"), nb::arg("cu_seqlens_q"),
      nb::arg("cu_seqlens_k"), nb::arg("max_seqlen_q"), nb::arg("max_seqlen_k"),
      nb::arg("seqused_k").none() = nb::none(), FA_COMMON_ARGS,
      "fa_attention_probabilities_varlen: probs (B, H, max_seqlen_q, max_seqlen_k) fp32.");

  m.def(
      "forward_kvcache",
      [](nb::handle q, nb::handle k_cache, nb::handle v_cache, nb::handle cache_seqlens,
         nb::handle out, nb::handle lse, nb::handle k_new, nb::handle v_new,
         nb::handle rotary_cos, nb::handle rotary_sin, bool rotary_interleaved,
         nb::handle cache_batch_idx, nb::handle cache_leftpad, nb::handle block_table,
         int num_splits, std::optional<float> softmax_scale, bool causal, int window_left,
         int window_right, float softcap, nb::handle alibi_slopes, float dropout_p,
         uint64_t seed, uint64_t offset, bool deterministic, nb::handle positions, int backend, uintptr_t stream,
         int num_threads, bool trust_devices, nb::handle q_descale, nb::handle k_descale,
         nb::handle v_descale) {
        Call c(softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
               dropout_p, seed, offset, deterministic, positions, backend, stream, num_threads, trust_devices);
        c.set_descales(q_descale, k_descale, v_descale);
        Arg tq = tensor(q, "q"), tout = tensor(out, "out"), tkc = tensor(k_cache, "k_cache"),
            tvc = tensor(v_cache, "v_cache"), tsl = tensor(cache_seqlens, "cache_seqlens");
        std::optional<Arg> tlse = optional_tensor(lse, "lse"), tk = optional_tensor(k_new, "k"),
                           tv = optional_tensor(v_new, "v"),
                           tcos = optional_tensor(rotary_cos, "rotary_cos"),
                           tsin = optional_tensor(rotary_sin, "rotary_sin"),
                           tidx = optional_tensor(cache_batch_idx, "cache_batch_idx"),
                           tpad = optional_tensor(cache_leftpad, "cache_leftpad"),
                           ttable = optional_tensor(block_table, "block_table");
        fa_kvcache cache;
        fa_kvcache_init(&cache);
        cache.k_cache = tkc.ptr();
        cache.v_cache = tvc.ptr();
        cache.cache_seqlens = tsl.ptr();
        cache.k_new = ptr(tk);
        cache.v_new = ptr(tv);
        cache.rotary_cos = ptr(tcos);
        cache.rotary_sin = ptr(tsin);
        cache.rotary_interleaved = rotary_interleaved;
        cache.cache_batch_idx = ptr(tidx);
        cache.cache_leftpad = ptr(tpad);
        cache.block_table = ptr(ttable);
        cache.num_splits = num_splits;
        const fa_run_info info = run_info([&](fa_run_info* i) {
          return fa_forward_kvcache(tq.ptr(), &cache, tout.ptr(), ptr(tlse), &c.options,
                                    &c.execution, i);
        });
        return nb::make_tuple(info.backend, info.num_splits);
      },
      nb::arg("q"), nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("cache_seqlens"),
      nb::arg("out"), nb::arg("lse").none(), nb::arg("k").none() = nb::none(),
      nb::arg("v").none() = nb::none(), nb::arg("rotary_cos").none() = nb::none(),
      nb::arg("rotary_sin").none() = nb::none(), nb::arg("rotary_interleaved") = true,
      nb::arg("cache_batch_idx").none() = nb::none(),
      nb::arg("cache_leftpad").none() = nb::none(), nb::arg("block_table").none() = nb::none(),
      nb::arg("num_splits") = 0, FA_COMMON_ARGS, FA_DESCALE_ARGS,
      "fa_forward_kvcache: appends k/v (B, S_new, Hk, D) into k_cache/v_cache in place at "
      "cache_seqlens (int32 (B)), then writes out (B, Sq, H, D) and lse (B, H, Sq) fp32 (may be "
      "None); fp8 e4m3 caches take k_descale/v_descale (B, Hk) fp32. Returns (the fa_backend "
      "code that ran, the number of key splits it merged).");
}

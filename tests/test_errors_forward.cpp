// Argument validation of flashattn::forward (src/api/validate.cpp) and of the TensorView
// factories: one rejected-call row per wrong input (error_cases.hpp says what each row
// checks), then the accepted calls next to each boundary and the empty ones.
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "error_cases.hpp"

namespace flashattn::testing {
namespace {

using Dense = DenseCall;
using DenseCase = ErrorCase<DenseCall>;
constexpr int64_t B = DenseCall::B, Sq = DenseCall::Sq, Sk = DenseCall::Sk, H = DenseCall::H,
                  Hk = DenseCall::Hk, D = DenseCall::D;

std::vector<DenseCase> dense_cases() {
  const int64_t big = int64_t{1} << 40;
  return {
      // ---- Rank of q, k, v, out.
      {"q_rank3", [](Dense& c) { c.q = reshaped(c.q, {B, Sq, H * D}); }, kInvalid, "q",
       {"4 dimensions"}, {"3 dimensions", "(2, 3, 96)"}},
      {"q_rank0", [](Dense& c) { c.q.ndim = 0; }, kInvalid, "q", {"4 dimensions"},
       {"0 dimensions"}},
      {"q_rank7", [](Dense& c) { c.q.ndim = 7; }, kInvalid, "q", {"4 dimensions"},
       {"7 dimensions"}},
      {"q_rank_negative", [](Dense& c) { c.q.ndim = -1; }, kInvalid, "q", {"4 dimensions"},
       {"-1 dimensions"}},
      {"k_rank5", [](Dense& c) { c.k = reshaped(c.k, {B, Sk, Hk, D, 1}); }, kInvalid, "k",
       {"4 dimensions"}, {"5 dimensions", "(2, 5, 2, 16, 1)"}},
      {"v_rank3", [](Dense& c) { c.v = reshaped(c.v, {B * Sk, Hk, D}); }, kInvalid, "v",
       {"4 dimensions"}, {"3 dimensions"}},
      {"out_rank3", [](Dense& c) { c.out = reshaped(c.out, {B * Sq, H, D}); }, kInvalid, "out",
       {"4 dimensions"}, {"3 dimensions", "(6, 6, 16)"}},

      // ---- Dtypes.
      {"q_int32",
       [](Dense& c) { c.q.dtype = c.k.dtype = c.v.dtype = c.out.dtype = DType::Int32; },
       kInvalid, "q", {"fp32, fp16, bf16 or fp8_e4m3"}, {"dtype int32"}},
      {"q_unknown_dtype_code", [](Dense& c) { c.q.dtype = static_cast<DType>(9); }, kInvalid,
       "q", {"fp32, fp16, bf16, int32"}, {"dtype code 9"}},
      {"out_unknown_dtype_code", [](Dense& c) { c.out.dtype = static_cast<DType>(-1); },
       kInvalid, "out", {"fp32, fp16, bf16, int32"}, {"dtype code -1"}},
      {"k_fp16_while_q_fp32", [](Dense& c) { c.k.dtype = DType::Float16; }, kInvalid, "k",
       {"dtype fp32"}, {"dtype fp16"}},
      {"v_bf16_while_q_fp32", [](Dense& c) { c.v.dtype = DType::BFloat16; }, kInvalid, "v",
       {"dtype fp32"}, {"dtype bf16"}},
      {"out_fp16_while_q_fp32", [](Dense& c) { c.out.dtype = DType::Float16; }, kInvalid,
       "out", {"dtype fp32"}, {"dtype fp16"}},
      {"k_fp32_while_q_fp16",
       [](Dense& c) { c.q.dtype = c.v.dtype = c.out.dtype = DType::Float16; }, kInvalid, "k",
       {"dtype fp16"}, {"dtype fp32"}},
      {"v_int32", [](Dense& c) { c.v.dtype = DType::Int32; }, kInvalid, "v", {"dtype fp32"},
       {"dtype int32"}},

      // ---- Devices.
      {"q_unknown_device_type", [](Dense& c) { c.q.device.type = static_cast<DeviceType>(5); },
       kInvalid, "q", {"cpu or cuda"}, {"unknown device type 5"}},
      {"v_unknown_device_type", [](Dense& c) { c.v.device.type = static_cast<DeviceType>(-3); },
       kInvalid, "v", {"cpu or cuda"}, {"unknown device type -3"}},
      {"k_negative_device_index", [](Dense& c) { c.k.device.index = -1; }, kInvalid, "k",
       {"device index >= 0"}, {"-1"}},
      {"k_on_cuda_while_q_on_cpu", [](Dense& c) { c.k.device = kCuda0; }, kInvalid, "k",
       {"the device of q (cpu)"}, {}, "cuda:0"},
      {"v_on_cuda_while_q_on_cpu", [](Dense& c) { c.v.device = kCuda1; }, kInvalid, "v",
       {"the device of q (cpu)"}, {}, "cuda:1"},
      {"out_on_cuda_while_q_on_cpu", [](Dense& c) { c.out.device = kCuda0; }, kInvalid, "out",
       {"the device of q (cpu)"}, {}, "cuda:0"},
      {"k_on_other_cuda_device",
       [](Dense& c) {
         c.all_on(kCuda0);
         c.k.device = kCuda1;
       },
       kInvalid, "k", {"the device of q (cuda:0)"}, {}, "cuda:1"},
      {"lse_on_cuda_while_q_on_cpu", [](Dense& c) { c.lse->device = kCuda0; }, kInvalid, "lse",
       {"the device of q (cpu)"}, {}, "cuda:0"},

      // ---- Backend choice.
      {"cpu_backend_with_tensors_on_cuda",
       [](Dense& c) {
         c.all_on(kCuda0);
         c.execution.backend = Backend::CPU;
       },
       kInvalid, "q", {"host memory", "cpu backend"}, {"cuda:0"}},
      // With CUDA built in, auto picks it for GPU tensors and rejects fp32 (the base call's
      // dtype); without, the backend itself is unsupported.
      cuda_compiled()
          ? DenseCase{"auto_backend_with_tensors_on_cuda", [](Dense& c) { c.all_on(kCuda0); },
                      kUnsupported, "q", {"fp16 or bf16", "cuda backend"}, {}, "dtype fp32"}
          : DenseCase{"auto_backend_with_tensors_on_cuda", [](Dense& c) { c.all_on(kCuda0); },
                      kUnsupported, "backend", {"cpu or auto"}, {}, "cuda"},
      cuda_compiled()
          ? DenseCase{"cuda_backend", [](Dense& c) { c.execution.backend = Backend::CUDA; },
                      kInvalid, "q", {"GPU memory", "cuda backend"}, {}, "a tensor on cpu"}
          : DenseCase{"cuda_backend", [](Dense& c) { c.execution.backend = Backend::CUDA; },
                      kUnsupported, "backend", {"cpu or auto"}, {}, "cuda"},
      {"backend_code_7", [](Dense& c) { c.execution.backend = static_cast<Backend>(7); },
       kInvalid, "backend", {"auto, cpu or cuda"}, {}, "backend code 7"},
      {"backend_code_negative", [](Dense& c) { c.execution.backend = static_cast<Backend>(-1); },
       kInvalid, "backend", {"auto, cpu or cuda"}, {}, "backend code -1"},
      {"num_threads_negative", [](Dense& c) { c.execution.num_threads = -1; }, kInvalid,
       "num_threads", {"0 (all cores)", ">= 1"}, {}, "-1"},

      // ---- Sizes, strides, pointers, offsets.
      {"k_negative_size", [](Dense& c) { c.k.sizes[1] = -1; }, kInvalid, "k", {"sizes >= 0"},
       {"(2, -1, 2, 16)"}},
      {"out_negative_size", [](Dense& c) { c.out.sizes[0] = -2; }, kInvalid, "out",
       {"sizes >= 0"}, {"(-2, 3, 6, 16)"}},
      {"v_negative_stride", [](Dense& c) { c.v.strides[1] = -32; }, kInvalid, "v",
       {"strides >= 0"}, {"(160, -32, 16, 1)"}},
      {"q_last_dim_stride_2", [](Dense& c) { c.q.strides[3] = 2; }, kInvalid, "q",
       {"contiguous last dimension", "stride 1"}, {"(288, 96, 16, 2)"}},
      {"out_last_dim_stride_0", [](Dense& c) { c.out.strides[3] = 0; }, kInvalid, "out",
       {"contiguous last dimension"}, {"(288, 96, 16, 0)"}},
      {"k_null_data", [](Dense& c) { c.k.data = nullptr; }, kInvalid, "k", {"non-null"},
       {"null", "(2, 5, 2, 16)"}},
      {"out_null_data", [](Dense& c) { c.out.data = nullptr; }, kInvalid, "out", {"non-null"},
       {"null", "(2, 3, 6, 16)"}},
      // The engines read and write elements as their type, on every backend (found by
      // fuzz/fuzz_forward.cpp: the CPU engine read a float one byte off its alignment).
      {"q_misaligned_by_one_byte", [](Dense& c) { c.q.data = static_cast<char*>(c.q.data) + 1; },
       kInvalid, "q", {"element-aligned pointer", "a multiple of 4 bytes"}, {}, "a pointer misaligned by 1 bytes"},
      {"lse_misaligned_by_two_bytes",
       [](Dense& c) { c.lse->data = static_cast<char*>(c.lse->data) + 2; }, kInvalid, "lse",
       {"a multiple of 4 bytes"}, {}, "a pointer misaligned by 2 bytes"},
      {"q_extent_overflow",
       [big](Dense& c) { c.q = restrided(c.q, {big, Sq, H, D}, {big, H * D, D, 1}); }, kInvalid,
       "q", {"fit in 64 bits"}, {"1099511627776"}},
      {"v_extent_sum_overflow",
       [](Dense& c) {  // each span fits, their sum 2^62 + 2^62 does not
         c.v = restrided(c.v, {B, 3, Hk, D}, {int64_t{1} << 62, int64_t{1} << 61, D, 1});
       },
       kInvalid, "v", {"fit in 64 bits"}, {"4611686018427387904"}},

      // ---- Head dims and head counts.
      {"head_dim_0", [](Dense& c) { c.set_head_dim(0); }, kInvalid, "q", {"[1, 256]"},
       {"D = 0"}},
      {"head_dim_257", [](Dense& c) { c.set_head_dim(257); }, kInvalid, "q", {"[1, 256]"},
       {"D = 257", "(2, 3, 6, 257)"}},
      {"head_dim_264", [](Dense& c) { c.set_head_dim(264); }, kInvalid, "q", {"[1, 256]"},
       {"D = 264", "(2, 3, 6, 264)"}},
      {"no_query_heads",
       [](Dense& c) {
         c.q = reshaped(c.q, {B, Sq, 0, D});
         c.out = reshaped(c.out, {B, Sq, 0, D});
         c.lse.reset();
       },
       kInvalid, "q", {"at least one head"}, {"(2, 3, 0, 16)"}},
      {"no_key_heads",
       [](Dense& c) {
         c.k = reshaped(c.k, {B, Sk, 0, D});
         c.v = reshaped(c.v, {B, Sk, 0, D});
       },
       kInvalid, "k", {"at least one key/value head"}, {"(2, 5, 0, 16)"}},
      {"H6_not_a_multiple_of_Hk4",
       [](Dense& c) {
         c.k = reshaped(c.k, {B, Sk, 4, D});
         c.v = reshaped(c.v, {B, Sk, 4, D});
       },
       kInvalid, "k", {"divides", "H = 6"}, {}, "Hk = 4"},
      {"Hk_larger_than_H",
       [](Dense& c) {
         c.k = reshaped(c.k, {B, Sk, 12, D});
         c.v = reshaped(c.v, {B, Sk, 12, D});
       },
       kInvalid, "k", {"H = 6"}, {}, "Hk = 12"},
      {"batch_2_pow_31",  // batch and head counts index kernel grids: int32
       [](Dense& c) {
         const int64_t b = int64_t{1} << 31;
         c.q = reshaped(c.q, {b, 0, H, D});
         c.out = reshaped(c.out, {b, 0, H, D});
         c.k = restrided(c.k, {b, Sk, Hk, D}, {0, Hk * D, D, 1});
         c.v = restrided(c.v, {b, Sk, Hk, D}, {0, Hk * D, D, 1});
         c.lse.reset();
       },
       kInvalid, "q", {"B < 2^31"}, {}, "B = 2147483648"},
      {"heads_2_pow_31",
       [](Dense& c) {
         c.q = reshaped(c.q, {B, 0, int64_t{1} << 31, D});
         c.out = reshaped(c.out, {B, 0, int64_t{1} << 31, D});
         c.lse.reset();
       },
       kInvalid, "q", {"H < 2^31"}, {}, "H = 2147483648"},
      {"key_heads_2_pow_31",
       [](Dense& c) {
         c.k = reshaped(c.k, {B, 0, int64_t{1} << 31, D});
         c.v = reshaped(c.v, {B, 0, int64_t{1} << 31, D});
       },
       kInvalid, "k", {"Hk < 2^31"}, {}, "Hk = 2147483648"},

      // ---- Shapes of k, v, out.
      {"k_batch_3_while_q_batch_2",
       [](Dense& c) {
         c.k = reshaped(c.k, {3, Sk, Hk, D});
         c.v = reshaped(c.v, {3, Sk, Hk, D});
       },
       kInvalid, "k", {"B = 2"}, {"(3, 5, 2, 16)"}},
      {"k_head_dim_24", [](Dense& c) { c.k = reshaped(c.k, {B, Sk, Hk, 24}); }, kInvalid, "k",
       {"D = 16"}, {"(2, 5, 2, 24)"}},
      {"v_seqlen_4_while_k_seqlen_5", [](Dense& c) { c.v = reshaped(c.v, {B, 4, Hk, D}); },
       kInvalid, "v", {"(2, 5, 2, 16)", "(B, Sk, Hk, D)"}, {"(2, 4, 2, 16)"}},
      {"v_batch_1", [](Dense& c) { c.v = reshaped(c.v, {1, Sk, Hk, D}); }, kInvalid, "v",
       {"(2, 5, 2, 16)"}, {"(1, 5, 2, 16)"}},
      {"v_heads_1", [](Dense& c) { c.v = reshaped(c.v, {B, Sk, 1, D}); }, kInvalid, "v",
       {"(2, 5, 2, 16)"}, {"(2, 5, 1, 16)"}},
      {"v_head_dim_32", [](Dense& c) { c.v = reshaped(c.v, {B, Sk, Hk, 32}); }, kInvalid, "v",
       {"(2, 5, 2, 16)"}, {"(2, 5, 2, 32)"}},
      {"out_seqlen_5", [](Dense& c) { c.out = reshaped(c.out, {B, 5, H, D}); }, kInvalid, "out",
       {"(2, 3, 6, 16)", "(B, Sq, H, D)"}, {"(2, 5, 6, 16)"}},
      {"out_heads_Hk", [](Dense& c) { c.out = reshaped(c.out, {B, Sq, Hk, D}); }, kInvalid,
       "out", {"(2, 3, 6, 16)"}, {"(2, 3, 2, 16)"}},
      {"out_batch_1", [](Dense& c) { c.out = reshaped(c.out, {1, Sq, H, D}); }, kInvalid, "out",
       {"(2, 3, 6, 16)"}, {"(1, 3, 6, 16)"}},

      // ---- out must not overlap itself or the inputs.
      {"out_seq_stride_0",
       [](Dense& c) { c.out = restrided(c.out, {B, Sq, H, D}, {Sq * H * D, 0, D, 1}); },
       kInvalid, "out", {"no two elements share memory"}, {"(288, 0, 16, 1)"}},
      {"out_heads_half_overlapping",
       [](Dense& c) { c.out = restrided(c.out, {B, Sq, H, D}, {Sq * H * D, H * D, D / 2, 1}); },
       kInvalid, "out", {"no two elements share memory"}, {"(288, 96, 8, 1)"}},
      {"out_batch_stride_0",
       [](Dense& c) { c.out = restrided(c.out, {B, Sq, H, D}, {0, H * D, D, 1}); }, kInvalid,
       "out", {"no two elements share memory"}, {"(0, 96, 16, 1)"}},
      {"out_is_q", [](Dense& c) { c.out = moved_to(c.out, c.q_buf); }, kInvalid, "out",
       {"memory disjoint from q"}, {"overlapping q"}},
      {"out_starts_on_last_element_of_q",
       [](Dense& c) { c.out = moved_to(c.out, c.q_buf, B * Sq * H * D - 1); }, kInvalid, "out",
       {"memory disjoint from q"}, {"overlapping q"}},
      {"out_ends_on_first_element_of_k",
       [](Dense& c) {
         c.k = moved_to(c.k, c.out_buf, B * Sq * H * D - 1);
         c.v = moved_to(c.v, c.out_buf, B * Sq * H * D + B * Sk * Hk * D);
       },
       kInvalid, "out", {"memory disjoint from k"}, {"overlapping k"}},
      {"out_inside_v", [](Dense& c) { c.out = moved_to(c.out, c.v_buf, 3); }, kInvalid, "out",
       {"memory disjoint from v"}, {"overlapping v"}},

      // ---- lse.
      {"lse_rank2", [](Dense& c) { c.lse = reshaped(*c.lse, {B * H, Sq}); }, kInvalid, "lse",
       {"3 dimensions"}, {"2 dimensions"}},
      {"lse_fp16", [](Dense& c) { c.lse->dtype = DType::Float16; }, kInvalid, "lse",
       {"dtype fp32"}, {"dtype fp16"}},
      {"lse_int32", [](Dense& c) { c.lse->dtype = DType::Int32; }, kInvalid, "lse",
       {"dtype fp32"}, {"dtype int32"}},
      {"lse_shape_B_Sq_H", [](Dense& c) { c.lse = reshaped(*c.lse, {B, Sq, H}); }, kInvalid,
       "lse", {"(2, 6, 3)", "(B, H, Sq)"}, {"(2, 3, 6)"}},
      {"lse_shape_Sk", [](Dense& c) { c.lse = reshaped(*c.lse, {B, H, Sk}); }, kInvalid, "lse",
       {"(2, 6, 3)"}, {"(2, 6, 5)"}},
      {"lse_padded_batch_stride",
       [](Dense& c) { c.lse = restrided(*c.lse, {B, H, Sq}, {H * Sq + 1, Sq, 1}); }, kInvalid,
       "lse", {"contiguous (row-major)"}, {"(19, 3, 1)"}},
      {"lse_head_major",
       [](Dense& c) { c.lse = restrided(*c.lse, {B, H, Sq}, {H * Sq, 1, H}); }, kInvalid, "lse",
       {"contiguous"}, {"(18, 1, 6)"}},
      {"lse_null_data", [](Dense& c) { c.lse->data = nullptr; }, kInvalid, "lse", {"non-null"},
       {"null"}},
      {"lse_overlaps_out", [](Dense& c) { c.lse = moved_to(*c.lse, c.out_buf, 10); }, kInvalid,
       "lse", {"memory disjoint from out"}, {"overlapping out"}},
      {"lse_overlaps_q", [](Dense& c) { c.lse = moved_to(*c.lse, c.q_buf); }, kInvalid, "lse",
       {"memory disjoint from q"}, {"overlapping q"}},
      {"lse_overlaps_v", [](Dense& c) { c.lse = moved_to(*c.lse, c.v_buf, 100); }, kInvalid,
       "lse", {"memory disjoint from v"}, {"overlapping v"}},

      // ---- alibi_slopes.
      {"alibi_rank3",
       [](Dense& c) { c.options.alibi_slopes = c.alibi_buf.view({1, B, H}); }, kInvalid,
       "alibi_slopes", {"(H) or (B, H)"}, {"3 dimensions"}},
      {"alibi_rank0",
       [](Dense& c) {
         c.options.alibi_slopes = c.alibi_buf.view({H});
         c.options.alibi_slopes->ndim = 0;
       },
       kInvalid, "alibi_slopes", {"(H) or (B, H)"}, {"0 dimensions"}},
      {"alibi_H_5", [](Dense& c) { c.options.alibi_slopes = c.alibi_buf.view({5}); }, kInvalid,
       "alibi_slopes", {"(6)", "(H)"}, {"(5)"}},
      {"alibi_B3_H", [](Dense& c) { c.options.alibi_slopes = c.alibi_buf.view({3, H}); },
       kInvalid, "alibi_slopes", {"(2, 6)", "(B, H)"}, {"(3, 6)"}},
      {"alibi_H_B_transposed",
       [](Dense& c) { c.options.alibi_slopes = c.alibi_buf.view({H, B}); }, kInvalid,
       "alibi_slopes", {"(2, 6)"}, {"(6, 2)"}},
      {"alibi_fp16",
       [](Dense& c) {
         c.options.alibi_slopes = c.alibi_buf.view({H});
         c.options.alibi_slopes->dtype = DType::Float16;
       },
       kInvalid, "alibi_slopes", {"dtype fp32"}, {"dtype fp16"}},
      {"alibi_padded_rows",
       [](Dense& c) { c.options.alibi_slopes = c.alibi_buf.view({B, H}, {H + 2, 1}); },
       kInvalid, "alibi_slopes", {"contiguous (row-major)"}, {"(8, 1)"}},
      {"alibi_stride_2", [](Dense& c) { c.options.alibi_slopes = c.alibi_buf.view({H}, {2}); },
       kInvalid, "alibi_slopes", {"contiguous last dimension"}, {"(2)"}},
      {"alibi_on_cuda",
       [](Dense& c) {
         c.options.alibi_slopes = c.alibi_buf.view({H});
         c.options.alibi_slopes->device = kCuda0;
       },
       kInvalid, "alibi_slopes", {"the device of q (cpu)"}, {}, "cuda:0"},
      {"alibi_null_data",
       [](Dense& c) {
         c.options.alibi_slopes = c.alibi_buf.view({H});
         c.options.alibi_slopes->data = nullptr;
       },
       kInvalid, "alibi_slopes", {"non-null"}, {"null"}},

      // ---- Options.
      {"window_left_minus_2", [](Dense& c) { c.options.window_left = -2; }, kInvalid,
       "window_left", {"-1 (unbounded)", ">= 0"}, {}, "-2"},
      {"window_left_int_min",
       [](Dense& c) { c.options.window_left = std::numeric_limits<int32_t>::min(); }, kInvalid,
       "window_left", {"-1 (unbounded)"}, {}, "-2147483648"},
      {"window_right_minus_5", [](Dense& c) { c.options.window_right = -5; }, kInvalid,
       "window_right", {"-1 (unbounded)", ">= 0"}, {}, "-5"},
      {"window_right_minus_5_with_causal",
       [](Dense& c) {
         c.options.causal = true;
         c.options.window_right = -5;
       },
       kInvalid, "window_right", {"-1 (unbounded)"}, {}, "-5"},
      {"softcap_negative", [](Dense& c) { c.options.softcap = -1.0f; }, kInvalid, "softcap",
       {"finite", ">= 0"}, {}, "-1"},
      {"softcap_nan", [](Dense& c) { c.options.softcap = kNaN; }, kInvalid, "softcap",
       {"finite"}, {"nan"}},
      {"softcap_inf", [](Dense& c) { c.options.softcap = kInf; }, kInvalid, "softcap",
       {"finite"}, {"inf"}},
      {"softmax_scale_nan", [](Dense& c) { c.options.softmax_scale = kNaN; }, kInvalid,
       "softmax_scale", {"finite"}, {"nan"}},
      {"softmax_scale_inf", [](Dense& c) { c.options.softmax_scale = kInf; }, kInvalid,
       "softmax_scale", {"finite"}, {}, "inf"},
      {"softmax_scale_minus_inf", [](Dense& c) { c.options.softmax_scale = -kInf; }, kInvalid,
       "softmax_scale", {"finite"}, {}, "-inf"},
      {"dropout_p_1", [](Dense& c) { c.options.dropout_p = 1.0f; }, kInvalid, "dropout_p",
       {"[0, 1)"}, {}, "1"},
      {"dropout_p_minus_0_5", [](Dense& c) { c.options.dropout_p = -0.5f; }, kInvalid,
       "dropout_p", {"[0, 1)"}, {}, "-0.5"},
      {"dropout_p_nan", [](Dense& c) { c.options.dropout_p = kNaN; }, kInvalid, "dropout_p",
       {"[0, 1)"}, {"nan"}},
      {"dropout_p_inf", [](Dense& c) { c.options.dropout_p = kInf; }, kInvalid, "dropout_p",
       {"[0, 1)"}, {}, "inf"},
      // Positions: tokens count from 0, and each moved row or key index stays below 2^31
      // (dropout's Philox counter): Sq = 3 rows fit from 2^31 - 3, not from 2^31 - 2.
      {"positions_query_negative",
       [](Dense& c) { c.options.positions = Options::Positions{-1, 0}; }, kInvalid,
       "positions.query", {">= 0"}, {}, "-1"},
      {"positions_key_negative",
       [](Dense& c) { c.options.positions = Options::Positions{0, -7}; }, kInvalid,
       "positions.key", {">= 0"}, {}, "-7"},
      {"positions_query_past_2_31",
       [](Dense& c) { c.options.positions = Options::Positions{(int64_t{1} << 31) - 2, 0}; },
       kInvalid, "positions.query", {"+ 3", "<= 2^31"}, {}, "2147483646"},
      {"positions_key_past_2_31",
       [](Dense& c) { c.options.positions = Options::Positions{0, int64_t{1} << 40}; },
       kInvalid, "positions.key", {"+ 5", "<= 2^31"}, {}, "1099511627776"},
  };
}

class DenseErrors : public ::testing::TestWithParam<DenseCase> {};

TEST_P(DenseErrors, RejectedWithoutWriting) { expect_rejected(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Validation, DenseErrors, ::testing::ValuesIn(dense_cases()),
                         case_name<DenseCall>);

// ---------------------------------------------------------------------------------------------
// The TensorView factories validate too.

TEST(TensorViewErrors, ContiguousWithSevenSizes) {
  try {
    TensorView::contiguous(nullptr, DType::Float32, {1, 1, 1, 1, 1, 1, 1});
    ADD_FAILURE() << "a 7-dimensional view was accepted";
  } catch (const Error& e) {
    expect_error(e, kInvalid, "sizes", {"at most 6 dimensions"}, {}, "7");
  }
}

TEST(TensorViewErrors, StridedWithFewerStridesThanSizes) {
  try {
    TensorView::strided(nullptr, DType::Float32, {2, 3, 4}, {12, 1});
    ADD_FAILURE() << "a view with 3 sizes and 2 strides was accepted";
  } catch (const Error& e) {
    expect_error(e, kInvalid, "strides", {"one stride per size (3)"}, {}, "2 strides");
  }
}

TEST(TensorViewErrors, StridedWithSevenSizes) {
  try {
    TensorView::strided(nullptr, DType::Float32, {1, 1, 1, 1, 1, 1, 1}, {1, 1, 1, 1, 1, 1, 1});
    ADD_FAILURE() << "a 7-dimensional view was accepted";
  } catch (const Error& e) {
    expect_error(e, kInvalid, "sizes", {"at most 6 dimensions"}, {}, "7");
  }
}

// ---------------------------------------------------------------------------------------------
// Success paths next to the boundaries: the valid base call, values at the edge of each
// range, and empty batches and sequences.

TEST(ValidCalls, DenseBaseCallMatchesReference) {
  DenseCall call;
  SCOPED_TRACE(call.describe());
  const RunInfo info = run_ok(call);
  EXPECT_EQ(info.backend, Backend::CPU);
  EXPECT_GT(info.workspace_bytes, 0u);
  expect_matches_reference(call.q, call.k, call.v, call.options, nullptr, call.out, &*call.lse,
                           call.describe());
  // Nothing is written past the views.
  EXPECT_TRUE(sentinel_intact(call.out_buf, B * Sq * H * D * sizeof(float),
                              call.out_buf.bytes.size()));
  EXPECT_TRUE(sentinel_intact(call.lse_buf, B * H * Sq * sizeof(float),
                              call.lse_buf.bytes.size()));
}

struct ValidCase {
  std::string name;
  std::function<void(DenseCall&)> mutate;
};

void PrintTo(const ValidCase& c, std::ostream* os) { *os << c.name; }

std::vector<ValidCase> valid_cases() {
  return {
      {"head_dim_8", [](Dense& c) { c.set_head_dim(8); }},
      {"head_dim_256", [](Dense& c) { c.set_head_dim(256); }},
      {"head_dim_136", [](Dense& c) { c.set_head_dim(136); }},
      // Any head dim in [1, 256]: those that are not multiples of 8 as well.
      {"head_dim_1", [](Dense& c) { c.set_head_dim(1); }},
      {"head_dim_12", [](Dense& c) { c.set_head_dim(12); }},
      {"head_dim_251", [](Dense& c) { c.set_head_dim(251); }},
      {"mqa_Hk_1",
       [](Dense& c) {
         c.k = reshaped(c.k, {B, Sk, 1, D});
         c.v = reshaped(c.v, {B, Sk, 1, D});
       }},
      {"mha_Hk_equals_H",
       [](Dense& c) {
         c.k = reshaped(c.k, {B, Sk, H, D});
         c.v = reshaped(c.v, {B, Sk, H, D});
       }},
      {"window_0_0",
       [](Dense& c) {
         c.options.window_left = 0;
         c.options.window_right = 0;
       }},
      {"causal_with_window_left_1",
       [](Dense& c) {
         c.options.causal = true;
         c.options.window_left = 1;
       }},
      {"softcap_large", [](Dense& c) { c.options.softcap = 1e30f; }},
      {"softcap_minus_zero", [](Dense& c) { c.options.softcap = -0.0f; }},
      {"softmax_scale_zero", [](Dense& c) { c.options.softmax_scale = 0.0f; }},
      {"softmax_scale_negative", [](Dense& c) { c.options.softmax_scale = -0.5f; }},
      {"dropout_p_zero_with_seed",
       [](Dense& c) {
         c.options.dropout_p = 0.0f;
         c.options.dropout_seed = 1234;
         c.options.dropout_offset = 99;
       }},
      {"num_threads_1", [](Dense& c) { c.execution.num_threads = 1; }},
      {"num_threads_more_than_work", [](Dense& c) { c.execution.num_threads = 64; }},
      {"backend_cpu_explicit", [](Dense& c) { c.execution.backend = Backend::CPU; }},
      {"no_lse", [](Dense& c) { c.lse.reset(); }},
      {"alibi_H", [](Dense& c) { c.options.alibi_slopes = c.alibi_buf.view({H}); }},
      {"alibi_B_H", [](Dense& c) { c.options.alibi_slopes = c.alibi_buf.view({B, H}); }},
      {"out_head_major",
       [](Dense& c) { c.out = restrided(c.out, {B, Sq, H, D}, {H * Sq * D, D, Sq * D, 1}); }},
      {"out_padded_rows",
       [](Dense& c) { c.out = restrided(c.out, {B, Sq, H, D}, {Sq * H * 24, H * 24, 24, 1}); }},
      {"out_right_after_q_in_one_allocation",
       [](Dense& c) { c.out = moved_to(c.out, c.q_buf, B * Sq * H * D); }},
      {"k_v_broadcast_over_batch",  // inputs may alias: batch stride 0
       [](Dense& c) {
         c.k = restrided(c.k, {B, Sk, Hk, D}, {0, Hk * D, D, 1});
         c.v = restrided(c.v, {B, Sk, Hk, D}, {0, Hk * D, D, 1});
       }},
      {"k_and_v_share_memory", [](Dense& c) { c.v = moved_to(c.v, c.k_buf); }},
      {"size_1_dims_with_any_stride",
       [](Dense& c) {
         c.k = restrided(c.k, {B, Sk, 1, D}, {Sk * D, D, 12345, 1});
         c.v = restrided(c.v, {B, Sk, 1, D}, {Sk * D, D, 0, 1});
       }},
  };
}

class ValidBoundaries : public ::testing::TestWithParam<ValidCase> {};

TEST_P(ValidBoundaries, AcceptedAndMatchesReference) {
  const ValidCase& c = GetParam();
  SCOPED_TRACE("case " + c.name);
  DenseCall call;
  c.mutate(call);
  run_ok(call);
  expect_matches_reference(call.q, call.k, call.v, call.options, nullptr, call.out,
                           call.lse ? &*call.lse : nullptr, c.name);
}

INSTANTIATE_TEST_SUITE_P(Validation, ValidBoundaries, ::testing::ValuesIn(valid_cases()),
                         [](const ::testing::TestParamInfo<ValidCase>& info) {
                           return info.param.name;
                         });

TEST(EmptyCalls, BatchZeroWithNullPointers) {
  const TensorView q = TensorView::contiguous(nullptr, DType::Float32, {0, 3, 6, 16});
  const TensorView k = TensorView::contiguous(nullptr, DType::Float32, {0, 5, 2, 16});
  const TensorView out = TensorView::contiguous(nullptr, DType::Float32, {0, 3, 6, 16});
  const TensorView lse = TensorView::contiguous(nullptr, DType::Float32, {0, 6, 3});
  RunInfo info;
  EXPECT_NO_THROW(info = forward(q, k, k, out, lse));
  EXPECT_EQ(info.backend, Backend::CPU);
}

TEST(EmptyCalls, QueryLengthZeroWritesNothing) {
  DenseCall call;
  call.q = reshaped(call.q, {B, 0, H, D});
  call.out = reshaped(call.out, {B, 0, H, D});
  call.lse = reshaped(*call.lse, {B, H, 0});
  run_ok(call);
  EXPECT_TRUE(sentinel_intact(call.out_buf, 0, call.out_buf.bytes.size()));
  EXPECT_TRUE(sentinel_intact(call.lse_buf, 0, call.lse_buf.bytes.size()));
}

TEST(EmptyCalls, KeyLengthZeroGivesZeroOutAndMinusInfLse) {
  for (const bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "not causal");
    DenseCall call;
    call.options.causal = causal;
    call.k = TensorView::contiguous(nullptr, DType::Float32, {B, 0, Hk, D});
    call.v = TensorView::contiguous(nullptr, DType::Float32, {B, 0, Hk, D});
    run_ok(call);
    const float* out = reinterpret_cast<const float*>(call.out_buf.data());
    const float* lse = reinterpret_cast<const float*>(call.lse_buf.data());
    for (int64_t i = 0; i < B * Sq * H * D; ++i) ASSERT_EQ(out[i], 0.0f) << "out[" << i << "]";
    for (int64_t i = 0; i < B * H * Sq; ++i) ASSERT_EQ(lse[i], -kInf) << "lse[" << i << "]";
    EXPECT_TRUE(sentinel_intact(call.out_buf, B * Sq * H * D * sizeof(float),
                                call.out_buf.bytes.size()));
  }
}

// ---------------------------------------------------------------------------------------------
// Sizes at the edge of 64 bits and outputs over an optional input: rejected naming the
// argument, never misread.

// 1 * 2^61 * 1 * 8 elements is 2^64, which wraps to 0 in 64 bits: a view of that many elements
// must not pass as an empty one (whose null pointer and offsets would then go unchecked).
TEST(Robustness, SizeProductOverflowIsRejected) {
  const int64_t rows = int64_t{1} << 61;
  // The contiguous() factory refuses to build strides that overflow ...
  EXPECT_THROW(TensorView::contiguous(nullptr, DType::Float32, {1, rows, 1, 8}), Error);
  // ... and a hand-made view whose element count wraps to 0 is not mistaken for an empty one.
  Buffer kv(DType::Float32, 8);
  kv.fill_random();
  const TensorView q = TensorView::strided(nullptr, DType::Float32, {1, rows, 1, 8}, {8, 8, 8, 1});
  const TensorView k = kv.view({1, 1, 1, 8});
  Buffer out_buf(DType::Float32, 8);
  const TensorView out = TensorView::strided(out_buf.data(), DType::Float32, {1, rows, 1, 8}, {8, 8, 8, 1});
  try {
    forward(q, k, k, out, std::nullopt, {});
    ADD_FAILURE() << "null tensors of 2^64 elements were accepted";
  } catch (const Error& e) {
    EXPECT_STREQ(code_name(e.code()), "InvalidArgument") << e.what();
    EXPECT_EQ(e.argument(), "q") << e.what();
  }
}

// An out/lse that overlaps any input (alibi_slopes here; cu_seqlens and seqused_k alike)
// would overwrite it while it is being read.
TEST(Robustness, OutputsOverlappingAlibiSlopesAreRejected) {
  for (const bool lse_overlaps : {false, true}) {
    SCOPED_TRACE(lse_overlaps ? "lse overlaps alibi_slopes" : "out overlaps alibi_slopes");
    DenseCall call;
    call.options.alibi_slopes =
        TensorView::contiguous(lse_overlaps ? call.lse_buf.data() : call.out_buf.data(),
                               DType::Float32, {H});
    for (int64_t h = 0; h < H; ++h)
      static_cast<float*>(call.options.alibi_slopes->data)[h] = 0.25f;
    try {
      call.run();
      ADD_FAILURE() << "an output overlapping alibi_slopes was accepted";
    } catch (const Error& e) {
      EXPECT_STREQ(code_name(e.code()), "InvalidArgument") << e.what();
      EXPECT_EQ(e.argument(), lse_overlaps ? "lse" : "out") << e.what();
      EXPECT_TRUE(e.expected().find("alibi_slopes") != std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace flashattn::testing

// Argument validation of flashattn::forward_kvcache (src/api/validate.cpp): one rejected-call
// row per wrong input of the cache, its integer tensors, rotary tables and appends
// (error_cases.hpp says what each row checks), then the variants the rules deliberately allow.
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "error_cases.hpp"

namespace flashattn::testing {
namespace {

// A valid KV-cache call: B=2, Sq=3, H=6, Hk=2, D=16, fp32; a dense cache of B_cache=3 rows of
// S_cache=12 positions with cache_seqlens (4, 6) and cache_leftpad (1, 0); k_new/v_new with
// S_new=2; rotary tables of 16 rows for rotary_dim 8; lse. make_paged() turns it into a paged
// cache of 8 pages of 4 positions with block_table ((0, 1, 2), (3, 4, 5)); use_batch_idx()
// adds cache_batch_idx (2, 0).
struct KvCall {
  static constexpr int64_t B = 2, Sq = 3, H = 6, Hk = 2, D = 16, Bc = 3, Sc = 12, Sn = 2,
                           Sr = 16, Rd = 8, Pages = 8, Ps = 4, MaxPages = 3;
  Buffer q_buf{DType::Float32, kBufferElements}, kc_buf{DType::Float32, kBufferElements},
      vc_buf{DType::Float32, kBufferElements}, kn_buf{DType::Float32, kBufferElements},
      vn_buf{DType::Float32, kBufferElements}, cos_buf{DType::Float32, kBufferElements},
      sin_buf{DType::Float32, kBufferElements}, out_buf{DType::Float32, kBufferElements},
      lse_buf{DType::Float32, kBufferElements}, alibi_buf{DType::Float32, kBufferElements},
      seqlens_buf{DType::Int32, 16}, leftpad_buf{DType::Int32, 16}, idx_buf{DType::Int32, 16},
      table_buf{DType::Int32, 16}, descale_buf{DType::Float32, 16};
  TensorView q, out;
  std::optional<TensorView> lse;
  KvCache cache;
  Options options;
  Execution execution;

  KvCall() {
    start_buffers({&q_buf, &kc_buf, &vc_buf, &kn_buf, &vn_buf, &cos_buf, &sin_buf}, alibi_buf,
                  {&out_buf, &lse_buf});
    q = q_buf.view({B, Sq, H, D});
    out = out_buf.view({B, Sq, H, D});
    lse = lse_buf.view({B, H, Sq});
    cache.k_cache = kc_buf.view({Bc, Sc, Hk, D});
    cache.v_cache = vc_buf.view({Bc, Sc, Hk, D});
    set_seqlens({4, 6});
    write_int32(leftpad_buf, {1, 0});
    cache.cache_leftpad = TensorView::contiguous(leftpad_buf.data(), DType::Int32, {B});
    cache.k_new = kn_buf.view({B, Sn, Hk, D});
    cache.v_new = vn_buf.view({B, Sn, Hk, D});
    cache.rotary_cos = cos_buf.view({Sr, Rd / 2});
    cache.rotary_sin = sin_buf.view({Sr, Rd / 2});
  }

  void set_seqlens(const std::vector<int32_t>& values) {
    write_int32(seqlens_buf, values);
    cache.cache_seqlens = TensorView::contiguous(seqlens_buf.data(), DType::Int32,
                                                 {static_cast<int64_t>(values.size())});
  }
  void set_leftpad(const std::vector<int32_t>& values) { write_int32(leftpad_buf, values); }
  void use_batch_idx(const std::vector<int32_t>& values = {2, 0}) {
    write_int32(idx_buf, values);
    cache.cache_batch_idx = TensorView::contiguous(idx_buf.data(), DType::Int32, {B});
  }
  void make_paged(const std::vector<int32_t>& table = {0, 1, 2, 3, 4, 5}) {
    cache.k_cache = kc_buf.view({Pages, Ps, Hk, D});
    cache.v_cache = vc_buf.view({Pages, Ps, Hk, D});
    write_int32(table_buf, table);
    cache.block_table = TensorView::contiguous(table_buf.data(), DType::Int32, {B, MaxPages});
  }

  RunInfo run() const { return forward_kvcache(q, cache, out, lse, options, execution); }

  // fp8 e4m3 caches (over the same bytes) with k_descale (B, Hk) and v_descale (Hk, B)
  // laid side by side in descale_buf; q stays fp32.
  void use_fp8_caches() {
    cache.k_cache.dtype = cache.v_cache.dtype = DType::Float8E4M3;
    options.k_descale = descale_buf.view({B, Hk});
    options.v_descale = descale_buf.view({B, Hk}, {Hk, 1}, B * Hk);
  }

  std::vector<NamedBuffer> buffers() {
    return {{"q", &q_buf},          {"k_cache", &kc_buf},     {"v_cache", &vc_buf},
            {"k_new", &kn_buf},     {"v_new", &vn_buf},       {"rotary_cos", &cos_buf},
            {"rotary_sin", &sin_buf}, {"out", &out_buf},      {"lse", &lse_buf},
            {"alibi_slopes", &alibi_buf}, {"cache_seqlens", &seqlens_buf},
            {"cache_leftpad", &leftpad_buf}, {"cache_batch_idx", &idx_buf},
            {"block_table", &table_buf}, {"descales", &descale_buf}};
  }

  void all_on(Device device) {
    q.device = out.device = cache.k_cache.device = cache.v_cache.device = device;
    cache.cache_seqlens.device = device;
    for (std::optional<TensorView>* t :
         {&lse, &cache.k_new, &cache.v_new, &cache.rotary_cos, &cache.rotary_sin,
          &cache.cache_batch_idx, &cache.cache_leftpad, &cache.block_table,
          &options.alibi_slopes})
      if (*t) (*t)->device = device;
  }

  // q, the caches, k_new/v_new and out with head dim d.
  void set_head_dim(int64_t d) {
    q = reshaped(q, {B, Sq, H, d});
    out = reshaped(out, {B, Sq, H, d});
    cache.k_cache = reshaped(cache.k_cache, {Bc, Sc, Hk, d});
    cache.v_cache = reshaped(cache.v_cache, {Bc, Sc, Hk, d});
    cache.k_new = reshaped(*cache.k_new, {B, Sn, Hk, d});
    cache.v_new = reshaped(*cache.v_new, {B, Sn, Hk, d});
  }

  const char* describe() const {
    return "kvcache B=2 Sq=3 H=6 Hk=2 D=16 fp32, cache (3, 12), seqlens (4, 6), leftpad (1, 0), "
           "S_new=2, rotary_dim 8";
  }
};

using Kv = KvCall;
using KvErrorCase = ErrorCase<KvCall>;

std::vector<KvErrorCase> kvcache_cases() {
  constexpr int64_t KB = KvCall::B, KSq = KvCall::Sq, KH = KvCall::H, KHk = KvCall::Hk,
                    KD = KvCall::D, Bc = KvCall::Bc, Sc = KvCall::Sc, Sn = KvCall::Sn;
  return {
      // ---- Options and execution.
      {"dropout", [](Kv& c) { c.options.dropout_p = 0.1f; }, kInvalid, "dropout_p",
       {"0", "inference"}, {}, "0.1"},
      {"dropout_p_1_still_a_probability_error", [](Kv& c) { c.options.dropout_p = 1.0f; },
       kInvalid, "dropout_p", {"[0, 1)"}, {}, "1"},
      {"positions", [](Kv& c) { c.options.positions = Options::Positions{4, 0}; },
       kUnsupported, "positions", {"none", "forward_kvcache"}, {}, "positions"},
      {"window_left_minus_2", [](Kv& c) { c.options.window_left = -2; }, kInvalid,
       "window_left", {"-1 (unbounded)"}, {}, "-2"},
      {"num_splits_negative", [](Kv& c) { c.cache.num_splits = -1; }, kInvalid, "num_splits",
       {"0 (choose)", "[1, 1024]"}, {}, "-1"},
      {"num_splits_1025", [](Kv& c) { c.cache.num_splits = 1025; }, kInvalid, "num_splits",
       {"[1, 1024]"}, {}, "1025"},
      {"num_threads_negative", [](Kv& c) { c.execution.num_threads = -3; }, kInvalid,
       "num_threads", {">= 1"}, {}, "-3"},
      {"backend_code_7", [](Kv& c) { c.execution.backend = static_cast<Backend>(7); }, kInvalid,
       "backend", {"auto, cpu or cuda"}, {}, "backend code 7"},

      // ---- Ranks, dtypes, devices, strides of q, the caches and out.
      {"q_rank3", [=](Kv& c) { c.q = reshaped(c.q, {KB, KSq, KH * KD}); }, kInvalid, "q",
       {"4 dimensions"}, {"3 dimensions"}},
      {"k_cache_rank3", [=](Kv& c) { c.cache.k_cache = reshaped(c.cache.k_cache, {Bc * Sc, KHk, KD}); },
       kInvalid, "k_cache", {"4 dimensions"}, {"3 dimensions"}},
      {"v_cache_rank5",
       [=](Kv& c) { c.cache.v_cache = reshaped(c.cache.v_cache, {Bc, Sc, KHk, KD, 1}); }, kInvalid,
       "v_cache", {"4 dimensions"}, {"5 dimensions"}},
      {"out_rank3", [=](Kv& c) { c.out = reshaped(c.out, {KB * KSq, KH, KD}); }, kInvalid, "out",
       {"4 dimensions"}, {"3 dimensions"}},
      {"q_int32",
       [](Kv& c) {
         c.q.dtype = c.out.dtype = c.cache.k_cache.dtype = c.cache.v_cache.dtype = DType::Int32;
       },
       kInvalid, "q", {"fp32, fp16 or bf16"}, {"dtype int32"}},
      {"k_cache_fp16", [](Kv& c) { c.cache.k_cache.dtype = DType::Float16; }, kInvalid,
       "k_cache", {"dtype fp32"}, {"dtype fp16"}},
      {"v_cache_bf16", [](Kv& c) { c.cache.v_cache.dtype = DType::BFloat16; }, kInvalid,
       "v_cache", {"dtype fp32"}, {"dtype bf16"}},
      {"out_fp16", [](Kv& c) { c.out.dtype = DType::Float16; }, kInvalid, "out", {"dtype fp32"},
       {"dtype fp16"}},
      {"k_cache_on_cuda", [](Kv& c) { c.cache.k_cache.device = kCuda0; }, kInvalid, "k_cache",
       {"the device of q (cpu)"}, {}, "cuda:0"},
      {"v_cache_last_dim_stride_2", [](Kv& c) { c.cache.v_cache.strides[3] = 2; }, kInvalid,
       "v_cache", {"contiguous last dimension"}, {}},
      {"k_cache_null_data", [](Kv& c) { c.cache.k_cache.data = nullptr; }, kInvalid, "k_cache",
       {"non-null"}, {"null"}},

      // ---- Head dims, head counts, shapes.
      {"head_dim_0", [](Kv& c) { c.set_head_dim(0); }, kInvalid, "q", {"[1, 256]"},
       {"D = 0"}},
      {"head_dim_264", [](Kv& c) { c.set_head_dim(264); }, kInvalid, "q", {"[1, 256]"},
       {"D = 264"}},
      {"H6_not_a_multiple_of_Hk4",
       [=](Kv& c) {
         c.cache.k_cache = reshaped(c.cache.k_cache, {Bc, Sc, 4, KD});
         c.cache.v_cache = reshaped(c.cache.v_cache, {Bc, Sc, 4, KD});
       },
       kInvalid, "k_cache", {"divides", "H = 6"}, {}, "Hk = 4"},
      {"k_cache_head_dim_24",
       [=](Kv& c) { c.cache.k_cache = reshaped(c.cache.k_cache, {Bc, Sc, KHk, 24}); }, kInvalid,
       "k_cache", {"D = 16"}, {"(3, 12, 2, 24)"}},
      {"v_cache_shorter_than_k_cache",
       [=](Kv& c) { c.cache.v_cache = reshaped(c.cache.v_cache, {Bc, Sc - 1, KHk, KD}); },
       kInvalid, "v_cache", {"(3, 12, 2, 16)", "like k_cache"}, {"(3, 11, 2, 16)"}},
      {"out_heads_Hk", [=](Kv& c) { c.out = reshaped(c.out, {KB, KSq, KHk, KD}); }, kInvalid,
       "out", {"(2, 3, 6, 16)"}, {"(2, 3, 2, 16)"}},
      {"dense_cache_fewer_rows_than_B",
       [=](Kv& c) {
         c.cache.k_cache = reshaped(c.cache.k_cache, {1, Sc, KHk, KD});
         c.cache.v_cache = reshaped(c.cache.v_cache, {1, Sc, KHk, KD});
       },
       kInvalid, "k_cache", {"B = 2", "cache_batch_idx"}, {"(1, 12, 2, 16)"}},
      {"batch_idx_with_an_empty_cache",
       [=](Kv& c) {
         c.use_batch_idx();
         c.cache.k_cache = reshaped(c.cache.k_cache, {0, Sc, KHk, KD});
         c.cache.v_cache = reshaped(c.cache.v_cache, {0, Sc, KHk, KD});
       },
       kInvalid, "k_cache", {"at least one cache row"}, {"(0, 12, 2, 16)"}},

      // ---- Per-sequence int32 tensors.
      {"cache_seqlens_fp32", [](Kv& c) { c.cache.cache_seqlens.dtype = DType::Float32; },
       kInvalid, "cache_seqlens", {"dtype int32"}, {"dtype fp32"}},
      {"cache_seqlens_rank2",
       [=](Kv& c) { c.cache.cache_seqlens = reshaped(c.cache.cache_seqlens, {1, KB}); }, kInvalid,
       "cache_seqlens", {"1 dimension"}, {"2 dimensions"}},
      {"cache_seqlens_3_entries", [](Kv& c) { c.set_seqlens({4, 6, 1}); }, kInvalid,
       "cache_seqlens", {"(2)", "(B)"}, {"(3)"}},
      {"cache_seqlens_stride_2",
       [=](Kv& c) { c.cache.cache_seqlens = restrided(c.cache.cache_seqlens, {KB}, {2}); },
       kInvalid, "cache_seqlens", {"contiguous last dimension"}, {"(2)"}},
      {"cache_seqlens_on_cuda", [](Kv& c) { c.cache.cache_seqlens.device = kCuda0; }, kInvalid,
       "cache_seqlens", {"the device of q (cpu)"}, {}, "cuda:0"},
      {"cache_leftpad_int16_sized",
       [](Kv& c) { c.cache.cache_leftpad->dtype = DType::Float16; }, kInvalid, "cache_leftpad",
       {"dtype int32"}, {"dtype fp16"}},
      {"cache_leftpad_1_entry",
       [](Kv& c) { c.cache.cache_leftpad = reshaped(*c.cache.cache_leftpad, {1}); }, kInvalid,
       "cache_leftpad", {"(2)"}, {"(1)"}},
      {"cache_batch_idx_3_entries",
       [](Kv& c) {
         c.use_batch_idx();
         c.cache.cache_batch_idx = reshaped(*c.cache.cache_batch_idx, {3});
       },
       kInvalid, "cache_batch_idx", {"(2)"}, {"(3)"}},
      {"cache_batch_idx_fp32",
       [](Kv& c) {
         c.use_batch_idx();
         c.cache.cache_batch_idx->dtype = DType::Float32;
       },
       kInvalid, "cache_batch_idx", {"dtype int32"}, {"dtype fp32"}},

      // ---- Paged caches.
      {"block_table_with_cache_batch_idx",
       [](Kv& c) {
         c.make_paged();
         c.use_batch_idx();
       },
       kInvalid, "cache_batch_idx", {"paged", "block_table"}, {"cache_batch_idx", "block_table"}},
      {"block_table_rank1",
       [](Kv& c) {
         c.make_paged();
         c.cache.block_table = reshaped(*c.cache.block_table, {6});
       },
       kInvalid, "block_table", {"2 dimensions"}, {"1 dimension"}},
      {"block_table_fp32",
       [](Kv& c) {
         c.make_paged();
         c.cache.block_table->dtype = DType::Float32;
       },
       kInvalid, "block_table", {"dtype int32"}, {"dtype fp32"}},
      {"block_table_3_rows",
       [](Kv& c) {
         c.make_paged();
         c.cache.block_table = reshaped(*c.cache.block_table, {3, 2});
       },
       kInvalid, "block_table", {"B = 2", "max_pages"}, {"(3, 2)"}},
      {"block_table_columns_strided",
       [](Kv& c) {
         c.make_paged();
         c.cache.block_table = restrided(*c.cache.block_table, {2, 3}, {6, 2});
       },
       kInvalid, "block_table", {"contiguous last dimension"}, {"(6, 2)"}},
      {"block_table_on_cuda",
       [](Kv& c) {
         c.make_paged();
         c.cache.block_table->device = kCuda0;
       },
       kInvalid, "block_table", {"the device of q (cpu)"}, {}, "cuda:0"},
      {"page_size_0",
       [](Kv& c) {
         c.make_paged();
         c.cache.k_cache = reshaped(c.cache.k_cache, {8, 0, KvCall::Hk, KvCall::D});
         c.cache.v_cache = reshaped(c.cache.v_cache, {8, 0, KvCall::Hk, KvCall::D});
       },
       kInvalid, "k_cache", {"page size", "[1, 2^31)"}, {"(8, 0, 2, 16)"}},

      // ---- k_new / v_new.
      {"k_new_without_v_new", [](Kv& c) { c.cache.v_new.reset(); }, kInvalid, "v_new",
       {"k_new", "both or neither"}, {}, "none"},
      {"v_new_without_k_new", [](Kv& c) { c.cache.k_new.reset(); }, kInvalid, "k_new",
       {"v_new", "both or neither"}, {}, "none"},
      {"k_new_rank3",
       [=](Kv& c) { c.cache.k_new = reshaped(*c.cache.k_new, {KB * Sn, KHk, KD}); }, kInvalid,
       "k_new", {"4 dimensions"}, {"3 dimensions"}},
      {"k_new_fp16", [](Kv& c) { c.cache.k_new->dtype = DType::Float16; }, kInvalid, "k_new",
       {"dtype fp32"}, {"dtype fp16"}},
      {"v_new_on_cuda", [](Kv& c) { c.cache.v_new->device = kCuda1; }, kInvalid, "v_new",
       {"the device of q (cpu)"}, {}, "cuda:1"},
      {"k_new_batch_3", [=](Kv& c) { c.cache.k_new = reshaped(*c.cache.k_new, {3, Sn, KHk, KD}); },
       kInvalid, "k_new", {"(2, 2, 2, 16)", "(B, S_new, Hk, D)"}, {"(3, 2, 2, 16)"}},
      {"k_new_heads_H", [=](Kv& c) { c.cache.k_new = reshaped(*c.cache.k_new, {KB, Sn, KH, KD}); },
       kInvalid, "k_new", {"(2, 2, 2, 16)"}, {"(2, 2, 6, 16)"}},
      {"v_new_longer_than_k_new",
       [=](Kv& c) { c.cache.v_new = reshaped(*c.cache.v_new, {KB, Sn + 1, KHk, KD}); }, kInvalid,
       "v_new", {"(2, 2, 2, 16)", "like k_new"}, {"(2, 3, 2, 16)"}},

      // ---- Rotary tables.
      {"rotary_cos_without_sin", [](Kv& c) { c.cache.rotary_sin.reset(); }, kInvalid,
       "rotary_sin", {"rotary_cos", "both or neither"}, {}, "none"},
      {"rotary_sin_without_cos", [](Kv& c) { c.cache.rotary_cos.reset(); }, kInvalid,
       "rotary_cos", {"rotary_sin"}, {}, "none"},
      {"rotary_cos_rank1", [](Kv& c) { c.cache.rotary_cos = c.cos_buf.view({64}); }, kInvalid,
       "rotary_cos", {"2 dimensions"}, {"1 dimension"}},
      {"rotary_cos_fp16", [](Kv& c) { c.cache.rotary_cos->dtype = DType::Float16; }, kInvalid,
       "rotary_cos", {"dtype fp32"}, {"dtype fp16"}},
      {"rotary_sin_on_cuda", [](Kv& c) { c.cache.rotary_sin->device = kCuda0; }, kInvalid,
       "rotary_sin", {"the device of q (cpu)"}, {}, "cuda:0"},
      {"rotary_dim_18_past_D",
       [](Kv& c) {
         c.cache.rotary_cos = c.cos_buf.view({16, 9});
         c.cache.rotary_sin = c.sin_buf.view({16, 9});
       },
       kInvalid, "rotary_cos", {"rotary_dim <= D = 16"}, {"(16, 9)"}},
      {"rotary_dim_0",
       [](Kv& c) {
         c.cache.rotary_cos = c.cos_buf.view({16, 0});
         c.cache.rotary_sin = c.sin_buf.view({16, 0});
       },
       kInvalid, "rotary_cos", {"2 <= rotary_dim"}, {"(16, 0)"}},
      {"rotary_sin_narrower_than_cos",
       [](Kv& c) { c.cache.rotary_sin = c.sin_buf.view({16, 3}); }, kInvalid, "rotary_sin",
       {"(16, 4)", "like rotary_cos"}, {"(16, 3)"}},
      {"rotary_cos_strided_columns",
       [](Kv& c) { c.cache.rotary_cos = c.cos_buf.view({16, 4}, {8, 2}); }, kInvalid,
       "rotary_cos", {"contiguous last dimension"}, {"(8, 2)"}},

      // ---- lse and ALiBi.
      {"lse_fp16", [](Kv& c) { c.lse->dtype = DType::Float16; }, kInvalid, "lse",
       {"dtype fp32"}, {"dtype fp16"}},
      {"lse_shape_B_Sq_H", [=](Kv& c) { c.lse = reshaped(*c.lse, {KB, KSq, KH}); }, kInvalid,
       "lse", {"(2, 6, 3)", "(B, H, Sq)"}, {"(2, 3, 6)"}},
      {"lse_head_major", [=](Kv& c) { c.lse = restrided(*c.lse, {KB, KH, KSq}, {KH * KSq, 1, KH}); },
       kInvalid, "lse", {"contiguous"}, {"(18, 1, 6)"}},
      {"alibi_H_5", [](Kv& c) { c.options.alibi_slopes = c.alibi_buf.view({5}); }, kInvalid,
       "alibi_slopes", {"(6)", "(H)"}, {"(5)"}},

      // ---- FP8 caches and their descales.
      {"k_descale_with_fp32_caches",
       [](Kv& c) { c.options.k_descale = c.descale_buf.view({KvCall::B, KvCall::Hk}); }, kInvalid,
       "k_descale", {"none", "fp8_e4m3 caches"}, {"caches of dtype fp32"}},
      {"q_descale_in_kvcache",
       [](Kv& c) {
         c.use_fp8_caches();
         c.options.q_descale = c.descale_buf.view({KvCall::B, KvCall::Hk});
       },
       kInvalid, "q_descale", {"none", "only its caches"}, {}},
      {"fp8_k_cache_fp32_v_cache", [](Kv& c) { c.cache.k_cache.dtype = DType::Float8E4M3; },
       kInvalid, "v_cache", {"dtype fp8_e4m3"}, {}, "dtype fp32"},
      {"fp16_caches_for_fp32_q",
       [](Kv& c) { c.cache.k_cache.dtype = c.cache.v_cache.dtype = DType::Float16; }, kInvalid,
       "k_cache", {"fp32", "fp8_e4m3"}, {}, "dtype fp16"},
      {"fp8_cache_per_block_descale",
       [](Kv& c) {
         c.use_fp8_caches();
         c.options.v_descale = c.descale_buf.view({KvCall::B, KvCall::Hk, 1});
       },
       kInvalid, "v_descale", {"(B, Hk) = (2, 2)", "no per-block"}, {"3 dimensions"}},
      {"fp8_cache_descale_B_H",
       [](Kv& c) {
         c.use_fp8_caches();
         c.options.k_descale = c.descale_buf.view({KvCall::B, 3});
       },
       kInvalid, "k_descale", {"(2, 2)", "(B, Hk)"}, {"(2, 3)"}},
      {"fp8_cache_descale_fp16",
       [](Kv& c) {
         c.use_fp8_caches();
         c.options.k_descale->dtype = DType::Float16;
       },
       kInvalid, "k_descale", {"dtype fp32"}, {"dtype fp16"}},
      {"fp8_cache_descale_transposed",
       [](Kv& c) {
         c.use_fp8_caches();
         c.options.k_descale = c.descale_buf.view({KvCall::B, KvCall::Hk}, {1, KvCall::B});
       },
       kInvalid, "k_descale", {"contiguous"}, {}},

      // ---- What is written must not overlap what is read.
      {"out_overlaps_itself",
       [=](Kv& c) { c.out = restrided(c.out, {KB, KSq, KH, KD}, {KSq * KH * KD, 0, KD, 1}); },
       kInvalid, "out", {"no two elements share memory"}, {}},
      {"out_inside_k_cache", [](Kv& c) { c.out = moved_to(c.out, c.kc_buf, 5); }, kInvalid,
       "out", {"memory disjoint from k_cache"}, {"overlapping k_cache"}},
      {"out_over_block_table",
       [](Kv& c) {
         c.make_paged();
         c.out = moved_to(c.out, c.table_buf);
       },
       kInvalid, "out", {"memory disjoint from block_table"}, {"overlapping block_table"}},
      {"lse_over_cache_seqlens", [](Kv& c) { c.lse = moved_to(*c.lse, c.seqlens_buf); },
       kInvalid, "lse", {"memory disjoint from cache_seqlens"}, {"overlapping cache_seqlens"}},
      {"lse_overlaps_out", [](Kv& c) { c.lse = moved_to(*c.lse, c.out_buf, 7); }, kInvalid,
       "lse", {"memory disjoint from out"}, {"overlapping out"}},
      {"k_new_inside_k_cache",
       [](Kv& c) { c.cache.k_new = moved_to(*c.cache.k_new, c.kc_buf, 100); }, kInvalid,
       "k_cache", {"memory disjoint from k_new"}, {"overlapping k_new"}},
      {"q_inside_v_cache_while_appending", [](Kv& c) { c.q = moved_to(c.q, c.vc_buf); },
       kInvalid, "v_cache", {"memory disjoint from q"}, {"overlapping q"}},
      {"rotary_sin_inside_k_cache",
       [](Kv& c) { c.cache.rotary_sin = moved_to(*c.cache.rotary_sin, c.kc_buf, 16); }, kInvalid,
       "k_cache", {"memory disjoint from rotary_sin"}, {"overlapping rotary_sin"}},
      {"k_cache_overlaps_itself_while_appending",
       [=](Kv& c) {
         c.cache.k_cache = restrided(c.cache.k_cache, {Bc, Sc, KHk, KD}, {Sc * KHk * KD, 0, KD, 1});
       },
       kInvalid, "k_cache", {"no two elements share memory"}, {}},

      // ---- Backend.
      {"cpu_backend_with_tensors_on_cuda",
       [](Kv& c) {
         c.all_on(kCuda0);
         c.execution.backend = Backend::CPU;
       },
       kInvalid, "q", {"host memory", "cpu backend"}, {"cuda:0"}},
      cuda_compiled()
          ? KvErrorCase{"cuda_backend", [](Kv& c) { c.execution.backend = Backend::CUDA; },
                        kInvalid, "q", {"GPU memory", "cuda backend"}, {}, "a tensor on cpu"}
          : KvErrorCase{"cuda_backend", [](Kv& c) { c.execution.backend = Backend::CUDA; },
                        kUnsupported, "backend", {"cpu or auto"}, {}, "cuda"},

      // ---- Values of the int32 tensors (host memory: the CPU backend checks them).
      {"cache_seqlens_negative", [](Kv& c) { c.set_seqlens({-1, 6}); }, kInvalid,
       "cache_seqlens", {">= 0"}, {}, "cache_seqlens[0] = -1"},
      {"append_past_capacity", [](Kv& c) { c.set_seqlens({4, 11}); }, kInvalid, "cache_seqlens",
       {"cache_seqlens[b] + S_new <= the cache capacity 12", "S_cache"}, {},
       "cache_seqlens[1] = 11 with S_new = 2"},
      {"paged_append_past_capacity",
       [](Kv& c) {
         c.make_paged();
         c.set_seqlens({11, 6});
       },
       kInvalid, "block_table",
       {"cache_seqlens[b] + S_new <= max_pages 3 x page_size 4 = 12"}, {},
       "cache_seqlens[0] = 11 with S_new = 2"},
      {"paged_filled_past_capacity_without_append",  // the refusal does not need k_new
       [](Kv& c) {
         c.make_paged();
         c.set_seqlens({4, 13});
         c.cache.k_new.reset();
         c.cache.v_new.reset();
       },
       kInvalid, "block_table", {"max_pages 3 x page_size 4 = 12"}, {},
       "cache_seqlens[1] = 13 with S_new = 0"},
      {"cache_leftpad_negative", [](Kv& c) { c.set_leftpad({-1, 0}); }, kInvalid,
       "cache_leftpad", {"0 <= cache_leftpad[b] <= cache_seqlens[b] (= 4 for b = 0)"}, {},
       "cache_leftpad[0] = -1"},
      {"cache_leftpad_past_cache_seqlens", [](Kv& c) { c.set_leftpad({1, 7}); }, kInvalid,
       "cache_leftpad", {"(= 6 for b = 1)"}, {}, "cache_leftpad[1] = 7"},
      {"cache_batch_idx_3_of_3_rows", [](Kv& c) { c.use_batch_idx({3, 0}); }, kInvalid,
       "cache_batch_idx", {"[0, B_cache = 3)"}, {}, "cache_batch_idx[0] = 3"},
      {"cache_batch_idx_negative", [](Kv& c) { c.use_batch_idx({0, -1}); }, kInvalid,
       "cache_batch_idx", {"[0, B_cache = 3)"}, {}, "cache_batch_idx[1] = -1"},
      {"cache_batch_idx_repeated_while_appending", [](Kv& c) { c.use_batch_idx({1, 1}); },
       kInvalid, "cache_batch_idx", {"distinct", "k_new"}, {}, "sequences 0 and 1 both use cache row 1"},
      {"block_table_page_8_of_8",
       [](Kv& c) { c.make_paged({0, 1, 2, 3, 8, 5}); }, kInvalid, "block_table",
       {"[0, num_pages = 8)"}, {"block_table[1][1] = 8"}},
      {"block_table_negative_page", [](Kv& c) { c.make_paged({-2, 1, 2, 3, 4, 5}); }, kInvalid,
       "block_table", {"[0, num_pages = 8)"}, {"block_table[0][0] = -2"}},
      {"block_table_two_sequences_append_to_one_row",
       [](Kv& c) {
         c.make_paged({0, 1, 2, 3, 1, 5});
         c.set_seqlens({4, 4});
       },
       kInvalid, "block_table", {"no two appended positions share a row"}, {},
       "sequences 0 and 1 write row 0 of page 1"},
      {"rotary_table_too_short", [](Kv& c) {
         c.cache.rotary_cos = c.cos_buf.view({7, 4});
         c.cache.rotary_sin = c.sin_buf.view({7, 4});
       },
       kInvalid, "rotary_cos", {"at least 8 rows", "positions up to 7"}, {"(7, 4)"}},
      {"rotary_table_too_short_for_causal_queries",  // q rows rotate at 6 + t, t < 3
       [](Kv& c) {
         c.options.causal = true;
         c.cache.rotary_cos = c.cos_buf.view({8, 4});
         c.cache.rotary_sin = c.sin_buf.view({8, 4});
       },
       kInvalid, "rotary_cos", {"at least 9 rows"}, {"(8, 4)"}},
  };
}

class KvCacheErrors : public ::testing::TestWithParam<KvErrorCase> {};

TEST_P(KvCacheErrors, RejectedWithoutWriting) { expect_rejected(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Validation, KvCacheErrors, ::testing::ValuesIn(kvcache_cases()),
                         case_name<KvCall>);

// The base call and its variants are valid; so are the things the rules deliberately allow.
TEST(KvCacheValidCalls, BaseCallAndVariantsAreAccepted) {
  const std::vector<std::pair<const char*, std::function<void(KvCall&)>>> variants = {
      {"base", [](KvCall&) {}},
      {"paged", [](KvCall& c) { c.make_paged(); }},
      {"cache_batch_idx", [](KvCall& c) { c.use_batch_idx(); }},
      {"fp8 caches", [](KvCall& c) { c.use_fp8_caches(); }},
      {"fp8 paged caches without descales",
       [](KvCall& c) {
         c.make_paged();
         c.use_fp8_caches();
         c.options.k_descale.reset();
         c.options.v_descale.reset();
       }},
      // Pages past what a sequence uses are never read: any value.
      {"garbage in unused block-table slots",
       [](KvCall& c) {
         c.make_paged({0, 1, -7, 3, 4, 99});
         c.set_seqlens({3, 4});
       }},
      // Without an append the caches are only read: shared rows and pages, q inside a cache.
      {"repeated cache_batch_idx without k_new",
       [](KvCall& c) {
         c.use_batch_idx({1, 1});
         c.cache.k_new.reset();
         c.cache.v_new.reset();
       }},
      {"shared pages without k_new",
       [](KvCall& c) {
         c.make_paged({0, 1, 2, 0, 1, 2});
         c.cache.k_new.reset();
         c.cache.v_new.reset();
       }},
      {"q inside k_cache without k_new",
       [](KvCall& c) {
         c.q = moved_to(c.q, c.kc_buf, 2000);
         c.cache.k_new.reset();
         c.cache.v_new.reset();
       }},
      // k and v interleaved in one buffer: distinct elements, overlapping byte ranges.
      {"packed (k, v) cache",
       [](KvCall& c) {
         const int64_t s1 = 2 * KvCall::Hk * KvCall::D;
         c.cache.k_cache = c.kc_buf.view({KvCall::Bc, KvCall::Sc, KvCall::Hk, KvCall::D},
                                         {KvCall::Sc * s1, s1, KvCall::D, 1}, 0);
         c.cache.v_cache = c.kc_buf.view({KvCall::Bc, KvCall::Sc, KvCall::Hk, KvCall::D},
                                         {KvCall::Sc * s1, s1, KvCall::D, 1}, KvCall::Hk * KvCall::D);
       }},
      {"rotary table exactly long enough", [](KvCall& c) {
         c.cache.rotary_cos = c.cos_buf.view({8, 4});
         c.cache.rotary_sin = c.sin_buf.view({8, 4});
       }},
      {"num_splits 1024", [](KvCall& c) { c.cache.num_splits = 1024; }},
      {"sequence filled to capacity without k_new",
       [](KvCall& c) {
         c.set_seqlens({12, 0});
         c.set_leftpad({12, 0});
         c.cache.k_new.reset();
         c.cache.v_new.reset();
       }},
  };
  for (const auto& [name, mutate] : variants) {
    SCOPED_TRACE(name);
    KvCall call;
    mutate(call);
    RunInfo info;
    EXPECT_NO_THROW(info = call.run());
    EXPECT_EQ(info.backend, Backend::CPU);
    EXPECT_GE(info.num_splits, 1);
  }
}

}  // namespace
}  // namespace flashattn::testing

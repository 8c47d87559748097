// Argument validation of flashattn::forward_varlen (src/api/validate.cpp): the rows that the
// ragged layout adds to the dense forward's (cu_seqlens, seqused_k, max_seqlen; error_cases.hpp
// says what each row checks), then accepted calls and batches with empty sequences.
#include <cmath>
#include <cstdint>
#include <limits>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "error_cases.hpp"

namespace flashattn::testing {
namespace {

using Var = VarlenCall;
using VarlenCase = ErrorCase<VarlenCall>;
constexpr int64_t H = VarlenCall::H, Hk = VarlenCall::Hk, D = VarlenCall::D,
                  Tq = VarlenCall::total_q, Tk = VarlenCall::total_k;

std::vector<VarlenCase> varlen_cases() {
  return {
      // ---- Ranks, dtypes and shapes in the varlen layout.
      {"q_rank4", [](Var& c) { c.q = reshaped(c.q, {1, Tq, H, D}); }, kInvalid, "q",
       {"3 dimensions"}, {"4 dimensions"}},
      {"out_rank4", [](Var& c) { c.out = reshaped(c.out, {1, Tq, H, D}); }, kInvalid, "out",
       {"3 dimensions"}, {"4 dimensions"}},
      {"k_fp16", [](Var& c) { c.k.dtype = DType::Float16; }, kInvalid, "k", {"dtype fp32"},
       {"dtype fp16"}},
      {"H6_not_a_multiple_of_Hk4",
       [](Var& c) {
         c.k = reshaped(c.k, {Tk, 4, D});
         c.v = reshaped(c.v, {Tk, 4, D});
       },
       kInvalid, "k", {"H = 6"}, {}, "Hk = 4"},
      {"k_head_dim_32", [](Var& c) { c.k = reshaped(c.k, {Tk, Hk, 32}); }, kInvalid, "k",
       {"D = 16"}, {"(9, 2, 32)"}},
      {"v_rows_8", [](Var& c) { c.v = reshaped(c.v, {8, Hk, D}); }, kInvalid, "v",
       {"(9, 2, 16)", "(total_k, Hk, D)"}, {"(8, 2, 16)"}},
      {"out_heads_Hk", [](Var& c) { c.out = reshaped(c.out, {Tq, Hk, D}); }, kInvalid, "out",
       {"(7, 6, 16)", "(total_q, H, D)"}, {"(7, 2, 16)"}},
      {"out_is_q", [](Var& c) { c.out = moved_to(c.out, c.q_buf); }, kInvalid, "out",
       {"memory disjoint from q"}, {"overlapping q"}},
      {"lse_transposed", [](Var& c) { c.lse = reshaped(*c.lse, {Tq, H}); }, kInvalid, "lse",
       {"(6, 7)", "(H, total_q)"}, {"(7, 6)"}},
      {"lse_dense_layout", [](Var& c) { c.lse = reshaped(*c.lse, {2, H, 4}); }, kInvalid, "lse",
       {"2 dimensions"}, {"3 dimensions"}},
      {"lse_overlaps_out", [](Var& c) { c.lse = moved_to(*c.lse, c.out_buf); }, kInvalid,
       "lse", {"memory disjoint from out"}, {"overlapping out"}},
      {"alibi_B3_H", [](Var& c) { c.options.alibi_slopes = c.alibi_buf.view({3, H}); },
       kInvalid, "alibi_slopes", {"(2, 6)", "(B, H)"}, {"(3, 6)"}},

      // ---- cu_seqlens structure.
      {"cu_seqlens_q_rank2",
       [](Var& c) { c.varlen.cu_seqlens_q = reshaped(c.varlen.cu_seqlens_q, {1, 3}); },
       kInvalid, "cu_seqlens_q", {"1 dimension"}, {"2 dimensions"}},
      {"cu_seqlens_q_no_entries",
       [](Var& c) { c.varlen.cu_seqlens_q = reshaped(c.varlen.cu_seqlens_q, {0}); }, kInvalid,
       "cu_seqlens_q", {"B + 1 >= 1"}, {"(0)"}},
      {"batch_2_pow_31",  // B = cu_seqlens_q entries - 1; the values are never read
       [](Var& c) {
         c.varlen.cu_seqlens_q = reshaped(c.varlen.cu_seqlens_q, {(int64_t{1} << 31) + 1});
       },
       kInvalid, "cu_seqlens_q", {"B < 2^31"}, {}, "B = 2147483648"},
      {"cu_seqlens_q_fp32", [](Var& c) { c.varlen.cu_seqlens_q.dtype = DType::Float32; },
       kInvalid, "cu_seqlens_q", {"dtype int32"}, {"dtype fp32"}},
      {"cu_seqlens_k_fp32", [](Var& c) { c.varlen.cu_seqlens_k.dtype = DType::Float32; },
       kInvalid, "cu_seqlens_k", {"dtype int32"}, {"dtype fp32"}},
      {"cu_seqlens_k_fp16", [](Var& c) { c.varlen.cu_seqlens_k.dtype = DType::Float16; },
       kInvalid, "cu_seqlens_k", {"dtype int32"}, {"dtype fp16"}},
      {"cu_seqlens_k_rank2",
       [](Var& c) { c.varlen.cu_seqlens_k = reshaped(c.varlen.cu_seqlens_k, {3, 1}); },
       kInvalid, "cu_seqlens_k", {"1 dimension"}, {"2 dimensions"}},
      {"cu_seqlens_k_4_entries_while_q_has_3", [](Var& c) { c.set_cu_k({0, 4, 9, 9}); },
       kInvalid, "cu_seqlens_k", {"(3)", "(B + 1)", "cu_seqlens_q"}, {"(4)"}},
      {"cu_seqlens_k_2_entries_while_q_has_3", [](Var& c) { c.set_cu_k({0, 9}); }, kInvalid,
       "cu_seqlens_k", {"(3)"}, {"(2)"}},
      {"cu_seqlens_q_null_data", [](Var& c) { c.varlen.cu_seqlens_q.data = nullptr; },
       kInvalid, "cu_seqlens_q", {"non-null"}, {"null"}},
      {"cu_seqlens_k_null_data", [](Var& c) { c.varlen.cu_seqlens_k.data = nullptr; },
       kInvalid, "cu_seqlens_k", {"non-null"}, {"null"}},
      {"cu_seqlens_q_stride_2",
       [](Var& c) { c.varlen.cu_seqlens_q = restrided(c.varlen.cu_seqlens_q, {3}, {2}); },
       kInvalid, "cu_seqlens_q", {"contiguous"}, {"(2)"}},
      // Misaligned index tensors are refused before their values are read (fuzz_varlen found
      // the validator loading cu_seqlens through a pointer one byte off: undefined behaviour).
      {"cu_seqlens_q_misaligned_by_one_byte",
       [](Var& c) { c.varlen.cu_seqlens_q.data = static_cast<char*>(c.varlen.cu_seqlens_q.data) + 1; },
       kInvalid, "cu_seqlens_q", {"element-aligned pointer", "a multiple of 4 bytes"}, {},
       "a pointer misaligned by 1 bytes"},
      {"cu_seqlens_k_misaligned_by_two_bytes",
       [](Var& c) { c.varlen.cu_seqlens_k.data = static_cast<char*>(c.varlen.cu_seqlens_k.data) + 2; },
       kInvalid, "cu_seqlens_k", {"element-aligned pointer", "a multiple of 4 bytes"}, {},
       "a pointer misaligned by 2 bytes"},
      {"seqused_k_misaligned_by_three_bytes",
       [](Var& c) {
         c.set_seqused_k({3, 5});
         c.varlen.seqused_k->data = static_cast<char*>(c.varlen.seqused_k->data) + 3;
       },
       kInvalid, "seqused_k", {"element-aligned pointer", "a multiple of 4 bytes"}, {},
       "a pointer misaligned by 3 bytes"},
      {"cu_seqlens_q_on_cuda", [](Var& c) { c.varlen.cu_seqlens_q.device = kCuda0; },
       kInvalid, "cu_seqlens_q", {"the device of q (cpu)"}, {}, "cuda:0"},
      {"cu_seqlens_k_on_cuda", [](Var& c) { c.varlen.cu_seqlens_k.device = kCuda0; },
       kInvalid, "cu_seqlens_k", {"the device of q (cpu)"}, {}, "cuda:0"},

      // ---- cu_seqlens values.
      {"cu_seqlens_q_starts_at_1", [](Var& c) { c.set_cu_q({1, 3, 7}); }, kInvalid,
       "cu_seqlens_q", {"[0] == 0"}, {}, "cu_seqlens_q[0] = 1"},
      {"cu_seqlens_k_starts_at_minus_1", [](Var& c) { c.set_cu_k({-1, 4, 9}); }, kInvalid,
       "cu_seqlens_k", {"[0] == 0"}, {}, "cu_seqlens_k[0] = -1"},
      {"cu_seqlens_k_decreasing",
       [](Var& c) {
         c.set_cu_k({0, 5, 4});
         c.varlen.max_seqlen_k = 9;
       },
       kInvalid, "cu_seqlens_k", {"non-decreasing"}, {}, "cu_seqlens_k[2] = 4 < cu_seqlens_k[1] = 5"},
      {"cu_seqlens_q_decreasing",
       [](Var& c) {
         c.set_cu_q({0, 7, 3});
         c.varlen.max_seqlen_q = 7;
       },
       kInvalid, "cu_seqlens_q", {"non-decreasing"}, {"cu_seqlens_q[2] = 3"}},
      {"query_sequence_longer_than_max_seqlen_q", [](Var& c) { c.varlen.max_seqlen_q = 3; },
       kInvalid, "max_seqlen_q", {"every sequence length in cu_seqlens_q"}, {},
       "3 while sequence 1 has 4"},
      {"key_sequence_longer_than_max_seqlen_k", [](Var& c) { c.varlen.max_seqlen_k = 4; },
       kInvalid, "max_seqlen_k", {"every sequence length in cu_seqlens_k"}, {},
       "4 while sequence 1 has 5"},
      {"cu_seqlens_q_beyond_total_q",
       [](Var& c) {
         c.set_cu_q({0, 3, 8});
         c.varlen.max_seqlen_q = 5;
       },
       kInvalid, "cu_seqlens_q", {"<= the 7 rows"}, {}, "cu_seqlens_q[2] = 8"},
      {"cu_seqlens_k_beyond_total_k",
       [](Var& c) {
         c.set_cu_k({0, 4, 10});
         c.varlen.max_seqlen_k = 6;
       },
       kInvalid, "cu_seqlens_k", {"<= the 9 rows"}, {}, "cu_seqlens_k[2] = 10"},
      {"max_seqlen_q_negative", [](Var& c) { c.varlen.max_seqlen_q = -1; }, kInvalid,
       "max_seqlen_q", {"[0, 2^31)"}, {}, "-1"},
      {"max_seqlen_k_negative", [](Var& c) { c.varlen.max_seqlen_k = -7; }, kInvalid,
       "max_seqlen_k", {"[0, 2^31)"}, {}, "-7"},

      // ---- seqused_k.
      {"seqused_k_3_entries", [](Var& c) { c.set_seqused_k({3, 5, 1}); }, kInvalid,
       "seqused_k", {"(2)", "(B)"}, {"(3)"}},
      {"seqused_k_rank2",
       [](Var& c) {
         c.set_seqused_k({3, 5});
         c.varlen.seqused_k = reshaped(*c.varlen.seqused_k, {1, 2});
       },
       kInvalid, "seqused_k", {"1 dimension"}, {"2 dimensions"}},
      {"seqused_k_fp32",
       [](Var& c) {
         c.set_seqused_k({3, 5});
         c.varlen.seqused_k->dtype = DType::Float32;
       },
       kInvalid, "seqused_k", {"dtype int32"}, {"dtype fp32"}},
      {"seqused_k_on_cuda",
       [](Var& c) {
         c.set_seqused_k({3, 5});
         c.varlen.seqused_k->device = kCuda0;
       },
       kInvalid, "seqused_k", {"the device of q (cpu)"}, {}, "cuda:0"},
      {"seqused_k_null_data",
       [](Var& c) {
         c.set_seqused_k({3, 5});
         c.varlen.seqused_k->data = nullptr;
       },
       kInvalid, "seqused_k", {"non-null"}, {"null"}},
      {"seqused_k_longer_than_key_sequence", [](Var& c) { c.set_seqused_k({4, 6}); }, kInvalid,
       "seqused_k", {"(5 for b = 1)"}, {}, "6"},
      {"seqused_k_negative", [](Var& c) { c.set_seqused_k({-1, 2}); }, kInvalid, "seqused_k",
       {"0 <= seqused_k[b]", "(4 for b = 0)"}, {}, "-1"},

      // ---- Backend choice.
      {"cpu_backend_with_tensors_on_cuda",
       [](Var& c) {
         c.set_seqused_k({3, 5});
         c.all_on(kCuda0);
         c.execution.backend = Backend::CPU;
       },
       kInvalid, "q", {"host memory"}, {"cuda:0"}},
      cuda_compiled()
          ? VarlenCase{"cuda_backend", [](Var& c) { c.execution.backend = Backend::CUDA; },
                       kInvalid, "q", {"GPU memory"}, {}, "a tensor on cpu"}
          : VarlenCase{"cuda_backend", [](Var& c) { c.execution.backend = Backend::CUDA; },
                       kUnsupported, "backend", {"cpu or auto"}, {}, "cuda"},
      {"dropout_p_1_5", [](Var& c) { c.options.dropout_p = 1.5f; }, kInvalid, "dropout_p",
       {"[0, 1)"}, {}, "1.5"},
  };
}

using Paged = PagedVarlenCall;
using PagedCase = ErrorCase<PagedVarlenCall>;
constexpr int64_t kPages = Paged::kPages, kPageSize = Paged::kPageSize;

// Every paged argument of a varlen call (Varlen::block_table, k and v as pages).
std::vector<PagedCase> paged_cases() {
  return {
      // ---- block_table structure.
      {"block_table_rank1",
       [](Paged& c) { c.varlen.block_table = reshaped(*c.varlen.block_table, {6}); }, kInvalid,
       "block_table", {"2 dimensions"}, {"1 dimension"}},
      {"block_table_rank3",
       [](Paged& c) { c.varlen.block_table = reshaped(*c.varlen.block_table, {2, 3, 1}); },
       kInvalid, "block_table", {"2 dimensions"}, {"3 dimensions"}},
      {"block_table_fp32", [](Paged& c) { c.varlen.block_table->dtype = DType::Float32; },
       kInvalid, "block_table", {"dtype int32"}, {"dtype fp32"}},
      {"block_table_fp16", [](Paged& c) { c.varlen.block_table->dtype = DType::Float16; },
       kInvalid, "block_table", {"dtype int32"}, {"dtype fp16"}},
      {"block_table_3_rows",
       [](Paged& c) { c.varlen.block_table = reshaped(*c.varlen.block_table, {3, 2}); },
       kInvalid, "block_table", {"B = 2", "max_pages"}, {"(3, 2)"}},
      {"block_table_1_row",
       [](Paged& c) { c.varlen.block_table = reshaped(*c.varlen.block_table, {1, 6}); },
       kInvalid, "block_table", {"B = 2", "max_pages"}, {"(1, 6)"}},
      {"block_table_columns_strided",
       [](Paged& c) { c.varlen.block_table = restrided(*c.varlen.block_table, {2, 3}, {6, 2}); },
       kInvalid, "block_table", {"contiguous last dimension"}, {"(6, 2)"}},
      {"block_table_negative_stride",
       [](Paged& c) { c.varlen.block_table = restrided(*c.varlen.block_table, {2, 3}, {-3, 1}); },
       kInvalid, "block_table", {"strides >= 0"}, {"(-3, 1)"}},
      {"block_table_on_cuda", [](Paged& c) { c.varlen.block_table->device = kCuda0; },
       kInvalid, "block_table", {"the device of q (cpu)"}, {}, "cuda:0"},
      {"block_table_null_data", [](Paged& c) { c.varlen.block_table->data = nullptr; },
       kInvalid, "block_table", {"non-null"}, {"null"}},
      {"block_table_max_pages_times_page_size_overflows",
       [](Paged& c) {
         c.k = c.v = restrided(c.k, {kPages, kPageSize << 29, Hk, D}, {0, 0, D, 1});
         c.varlen.block_table = restrided(*c.varlen.block_table, {2, int64_t{1} << 35}, {0, 1});
       },
       kInvalid, "block_table", {"fits in 64 bits"}, {"page_size 1073741824"}},

      // ---- k and v as pages.
      {"k_rank3", [](Paged& c) { c.k = reshaped(c.k, {kPages * kPageSize, Hk, D}); }, kInvalid,
       "k", {"4 dimensions"}, {"3 dimensions"}},
      {"v_rank3", [](Paged& c) { c.v = reshaped(c.v, {kPages * kPageSize, Hk, D}); }, kInvalid,
       "v", {"4 dimensions"}, {"3 dimensions"}},
      {"v_5_pages", [](Paged& c) { c.v = reshaped(c.v, {5, kPageSize, Hk, D}); }, kInvalid, "v",
       {"(6, 2, 2, 16)", "(num_pages, page_size, Hk, D)"}, {"(5, 2, 2, 16)"}},
      {"v_page_size_3", [](Paged& c) { c.v = reshaped(c.v, {kPages, 3, Hk, D}); }, kInvalid,
       "v", {"(6, 2, 2, 16)"}, {"(6, 3, 2, 16)"}},
      {"k_page_size_0",
       [](Paged& c) { c.k = c.v = reshaped(c.k, {kPages, 0, Hk, D}); }, kInvalid, "k",
       {"page size", "[1, 2^31)", "paged keys and values"}, {"(6, 0, 2, 16)"}},
      {"k_head_dim_32",
       [](Paged& c) { c.k = c.v = reshaped(c.k, {kPages, kPageSize, Hk, 32}); }, kInvalid, "k",
       {"D = 16"}, {"(6, 2, 2, 32)"}},
      {"H6_not_a_multiple_of_Hk4",
       [](Paged& c) { c.k = c.v = reshaped(c.k, {kPages, kPageSize, 4, D}); }, kInvalid, "k",
       {"H = 6"}, {}, "Hk = 4"},
      {"k_fp16", [](Paged& c) { c.k.dtype = DType::Float16; }, kInvalid, "k", {"dtype fp32"},
       {"dtype fp16"}},
      {"v_row_stride_not_contiguous",
       [](Paged& c) { c.v = restrided(c.v, {kPages, kPageSize, Hk, D}, {64, 32, 16, 2}); },
       kInvalid, "v", {"contiguous last dimension"}, {"(64, 32, 16, 2)"}},
      {"k_on_cuda", [](Paged& c) { c.k.device = kCuda0; }, kInvalid, "k",
       {"the device of q (cpu)"}, {}, "cuda:0"},

      // ---- What the call writes against the pages and the table.
      {"out_over_the_pages", [](Paged& c) { c.out = moved_to(c.out, c.k_buf); }, kInvalid,
       "out", {"memory disjoint from k"}, {"overlapping k"}},
      {"out_over_block_table",  // the table moved into out's memory
       [](Paged& c) {
         const int32_t table[] = {5, 0, 99, 2, 4, 1};
         std::memcpy(c.out_buf.data(), table, sizeof table);
         c.varlen.block_table->data = c.out_buf.data();
       },
       kInvalid, "out", {"memory disjoint from block_table"}, {"overlapping block_table"}},
      {"lse_over_the_pages", [](Paged& c) { c.lse = moved_to(*c.lse, c.v_buf); }, kInvalid,
       "lse", {"memory disjoint from v"}, {"overlapping v"}},

      // ---- Values (host memory: the CPU backend reads them).
      {"page_index_past_the_pages", [](Paged& c) { c.set_table({5, 0, 99, 2, 6, 1}, 3); },
       kInvalid, "block_table", {"[0, num_pages = 6)", "every page a sequence uses"},
       {"block_table[1][1] = 6", "positions 0 .. 4"}},
      {"page_index_negative", [](Paged& c) { c.set_table({-1, 0, 99, 2, 4, 1}, 3); }, kInvalid,
       "block_table", {"[0, num_pages = 6)"}, {"block_table[0][0] = -1"}},
      {"keys_beyond_the_pages", [](Paged& c) { c.set_table({5, 0, 2, 4}, 2); }, kInvalid,
       "block_table", {"max_pages * page_size = 4", "max_pages 2 x page_size 2"},
       {"sequence 1 with 5 keys", "cu_seqlens_k"}},
      {"keys_with_an_empty_block_table",  // (B, 0) with a null pointer: fuzz_varlen found it accepted
       [](Paged& c) { c.varlen.block_table = TensorView::contiguous(nullptr, DType::Int32, {2, 0}); },
       kInvalid, "block_table", {"max_pages * page_size = 0", "max_pages 0 x page_size 2"},
       {"sequence 0 with 4 keys", "cu_seqlens_k"}},
      {"seqused_keys_beyond_the_pages",
       [](Paged& c) {
         c.set_table({5, 0, 2, 4}, 2);
         c.set_cu_k({0, 4, 10});
         c.varlen.max_seqlen_k = 6;
         c.set_seqused_k({4, 5});
       },
       kInvalid, "block_table", {"= 4 positions"}, {"sequence 1 with 5 keys (seqused_k)"}},
      {"cu_seqlens_k_decreasing",
       [](Paged& c) {
         c.set_cu_k({0, 5, 4});
         c.varlen.max_seqlen_k = 9;
       },
       kInvalid, "cu_seqlens_k", {"non-decreasing"}, {}, "cu_seqlens_k[2] = 4 < cu_seqlens_k[1] = 5"},
      {"key_sequence_longer_than_max_seqlen_k", [](Paged& c) { c.varlen.max_seqlen_k = 4; },
       kInvalid, "max_seqlen_k", {"every sequence length in cu_seqlens_k"}, {},
       "4 while sequence 1 has 5"},
      {"seqused_k_longer_than_key_sequence", [](Paged& c) { c.set_seqused_k({4, 6}); },
       kInvalid, "seqused_k", {"(5 for b = 1)"}, {}, "6"},

      // ---- Backend choice.
      {"cpu_backend_with_tensors_on_cuda",
       [](Paged& c) {
         c.all_on(kCuda0);
         c.execution.backend = Backend::CPU;
       },
       kInvalid, "q", {"host memory"}, {"cuda:0"}},
  };
}

class PagedVarlenErrors : public ::testing::TestWithParam<PagedCase> {};

TEST_P(PagedVarlenErrors, RejectedWithoutWriting) { expect_rejected(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Validation, PagedVarlenErrors, ::testing::ValuesIn(paged_cases()),
                         case_name<PagedVarlenCall>);

// The keys of a paged call as the dense (total_k, Hk, D) tensors the reference reads.
struct DenseKeys {
  Buffer k_buf{DType::Float32, VarlenCall::total_k * Hk * D};
  Buffer v_buf{DType::Float32, VarlenCall::total_k * Hk * D};
  TensorView k, v;
  explicit DenseKeys(const PagedVarlenCall& c) {
    const auto* table = static_cast<const int32_t*>(c.varlen.block_table->data);
    const auto* cu = static_cast<const int32_t*>(c.varlen.cu_seqlens_k.data);
    const auto* used =
        c.varlen.seqused_k ? static_cast<const int32_t*>(c.varlen.seqused_k->data) : nullptr;
    const int64_t max_pages = c.varlen.block_table->sizes[1];
    // Only the keys the call reads: past seqused_k the table may hold any value (-1 here).
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t j = 0; j < (used ? used[b] : cu[b + 1] - cu[b]); ++j) {
        const int64_t page = table[b * max_pages + j / kPageSize], row = j % kPageSize;
        for (const auto& [dense, paged] : {std::pair{&k_buf, &c.k}, std::pair{&v_buf, &c.v}})
          std::memcpy(static_cast<float*>(dense->data()) + (cu[b] + j) * Hk * D,
                      static_cast<const float*>(paged->data) + page * paged->strides[0] +
                          row * paged->strides[1],
                      Hk * D * sizeof(float));
      }
    k = k_buf.view({VarlenCall::total_k, Hk, D});
    v = v_buf.view({VarlenCall::total_k, Hk, D});
  }
};

// Accepted paged calls: the base call, a table with one column more than needed (its
// entries are never read, so any value goes), and seqused_k that leaves a sequence's last
// page unused (its index is not checked either). Each matches the reference over the same
// keys gathered dense, and writes nothing past out and lse.
TEST(ValidCalls, PagedVarlenMatchesReference) {
  for (int variant = 0; variant < 3; ++variant) {
    PagedVarlenCall call;
    if (variant == 1) call.set_table({5, 0, -4, 7, 2, 4, 1, 1 << 30}, 4);
    if (variant == 2) {
      call.set_seqused_k({3, 2});
      call.set_table({5, 0, 99, 2, -1, -1}, 3);  // sequence 1 reads 2 keys: page 2 only
    }
    SCOPED_TRACE(std::string(call.describe()) + " variant " + std::to_string(variant));
    const RunInfo info = run_ok(call);
    EXPECT_EQ(info.backend, Backend::CPU);
    const DenseKeys dense(call);
    Varlen dense_varlen = call.varlen;
    dense_varlen.block_table.reset();
    expect_matches_reference(call.q, dense.k, dense.v, call.options, &dense_varlen, call.out,
                             &*call.lse, call.describe());
    EXPECT_TRUE(sentinel_intact(call.out_buf, Tq * H * D * sizeof(float),
                                call.out_buf.bytes.size()));
    EXPECT_TRUE(sentinel_intact(call.lse_buf, H * Tq * sizeof(float),
                                call.lse_buf.bytes.size()));
  }
}

// Upstream FlashAttention has no paged backward, nor has this one: refused naming
// block_table, whatever the other arguments, before anything is written.
TEST(PagedVarlenErrors, BackwardIsUnsupported) {
  PagedVarlenCall call;
  Buffer dout(DType::Float32, kBufferElements), dq(DType::Float32, kBufferElements),
      dk(DType::Float32, kBufferElements), dv(DType::Float32, kBufferElements);
  fill_sentinel(dq);
  fill_sentinel(dk);
  fill_sentinel(dv);
  const std::vector<unsigned char> before = dq.bytes;
  try {
    backward_varlen(call.q, call.k, call.v, call.out, dout.view({Tq, H, D}), *call.lse,
                    dq.view({Tq, H, D}), dk.view({kPages, kPageSize, Hk, D}),
                    dv.view({kPages, kPageSize, Hk, D}), call.varlen);
    ADD_FAILURE() << "a paged backward was accepted";
  } catch (const Error& e) {
    expect_error(e, kUnsupported, "block_table", {"forward only"}, {"a block table"}, "");
  }
  EXPECT_TRUE(dq.bytes == before && dk.bytes == before && dv.bytes == before);
}

class VarlenErrors : public ::testing::TestWithParam<VarlenCase> {};

TEST_P(VarlenErrors, RejectedWithoutWriting) { expect_rejected(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Validation, VarlenErrors, ::testing::ValuesIn(varlen_cases()),
                         case_name<VarlenCall>);

TEST(ValidCalls, VarlenBaseCallMatchesReference) {
  for (bool with_seqused : {false, true}) {
    VarlenCall call;
    SCOPED_TRACE(std::string(call.describe()) + (with_seqused ? " seqused_k=(3,2)" : ""));
    if (with_seqused) call.set_seqused_k({3, 2});
    const RunInfo info = run_ok(call);
    EXPECT_EQ(info.backend, Backend::CPU);
    expect_matches_reference(call.q, call.k, call.v, call.options, &call.varlen, call.out,
                             &*call.lse, call.describe());
    EXPECT_TRUE(sentinel_intact(call.out_buf, Tq * H * D * sizeof(float),
                                call.out_buf.bytes.size()));
    EXPECT_TRUE(sentinel_intact(call.lse_buf, H * Tq * sizeof(float),
                                call.lse_buf.bytes.size()));
  }
}

TEST(EmptyCalls, VarlenBatchZero) {
  VarlenCall call;
  call.set_cu_q({0});
  call.set_cu_k({0});
  call.varlen.max_seqlen_q = call.varlen.max_seqlen_k = 0;
  call.q = TensorView::contiguous(nullptr, DType::Float32, {0, H, D});
  call.k = call.v = TensorView::contiguous(nullptr, DType::Float32, {0, Hk, D});
  call.out = TensorView::contiguous(nullptr, DType::Float32, {0, H, D});
  call.lse = TensorView::contiguous(nullptr, DType::Float32, {H, 0});
  run_ok(call);
}

// Varlen rows of a sequence with no keys (empty in cu_seqlens_k, or seqused_k = 0) get out = 0
// and lse = -inf; the other sequence still matches the reference.
TEST(EmptyCalls, VarlenSequencesWithoutKeys) {
  for (const bool via_seqused : {false, true}) {
    SCOPED_TRACE(via_seqused ? "seqused_k = (3, 0)" : "cu_seqlens_k = (0, 0, 5)");
    VarlenCall call;
    int64_t empty_row0 = 0, empty_rows = 3;  // rows of the key-less sequence in q/out
    if (via_seqused) {
      call.set_seqused_k({3, 0});
      empty_row0 = 3;
      empty_rows = 4;
    } else {
      call.set_cu_k({0, 0, 5});  // rows 5..8 of k/v are unused
    }
    run_ok(call);
    expect_matches_reference(call.q, call.k, call.v, call.options, &call.varlen, call.out,
                             &*call.lse, "varlen with a key-less sequence");
    const float* out = reinterpret_cast<const float*>(call.out_buf.data());
    const float* lse = reinterpret_cast<const float*>(call.lse_buf.data());
    for (int64_t i = empty_row0 * H * D; i < (empty_row0 + empty_rows) * H * D; ++i)
      ASSERT_EQ(out[i], 0.0f) << "out element " << i;
    for (int64_t h = 0; h < H; ++h)
      for (int64_t r = empty_row0; r < empty_row0 + empty_rows; ++r)
        ASSERT_EQ(lse[h * Tq + r], -kInf) << "lse[" << h << ", " << r << "]";
  }
}

// max_seqlen_q beyond what int32 cu_seqlens can describe is rejected naming it (writing
// nothing); any bound up to that is computed.
TEST(Robustness, HugeMaxSeqlenQIsRejectedOrComputed) {
  VarlenCall call;
  call.varlen.max_seqlen_q = std::numeric_limits<int64_t>::max();
  call.out_buf.poison();
  call.lse_buf.poison();
  const std::vector<unsigned char> out_before = call.out_buf.bytes;
  try {
    call.run();
    expect_matches_reference(call.q, call.k, call.v, call.options, &call.varlen, call.out,
                             &*call.lse, "max_seqlen_q = INT64_MAX");
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "max_seqlen_q") << e.what();
    EXPECT_TRUE(out_before == call.out_buf.bytes);
  }
}

}  // namespace
}  // namespace flashattn::testing

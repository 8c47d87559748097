// A backend against the float64 reference: a property sweep over shapes, dtypes, head dims,
// GQA ratios, masks, softcap, ALiBi, memory layouts and ragged batches. Compiled once per
// backend: test_forward_cpu, and test_forward_cuda (FLASHATTN_TEST_CUDA, label gpu).
#include <array>
#include <cmath>
#include <limits>
#include <numeric>
#include <tuple>

#include "sweep.hpp"

namespace flashattn::testing {
namespace {

// Shapes the feature grid cycles through: odd lengths, Sq > Sk and Sq < Sk, single rows and
// keys, GQA ratios 1, 2 and 8, head dims that are not powers of two.
constexpr Geometry kGeometries[] = {
    {2, 97, 113, 4, 2, 40},  {1, 113, 97, 8, 1, 64},  {3, 1, 97, 2, 2, 24},
    {2, 97, 1, 8, 8, 8},     {1, 200, 64, 6, 3, 96},  {1, 64, 200, 16, 2, 136},
    {2, 130, 130, 2, 2, 256}, {1, 65, 63, 8, 1, 200}, {2, 129, 129, 3, 3, 48},
};

class FeatureGrid : public ::testing::TestWithParam<int> {};

// Every combination of mask x softcap x ALiBi x dtype, each on a different geometry and
// memory layout so that the grid also walks through shapes.
TEST_P(FeatureGrid, MatchesReference) {
  const int n = GetParam();
  Case c = grid_case(n, kGeometries);
  c.with_lse = n % 5 != 0;
  run_dense_case(c);
}

INSTANTIATE_TEST_SUITE_P(AllCombinations, FeatureGrid,
                         ::testing::Range(0, int(feature_grid().size())),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return grid_name(info.param);
                         });
}  // namespace
}  // namespace flashattn::testing

namespace flashattn::testing {
namespace {

class HeadDims : public ::testing::TestWithParam<int> {};

// Every head dim the contract allows: multiples of 8 from 8 to 256.
TEST_P(HeadDims, MatchesReference) {
  const int d = GetParam();
  Case c{.batch = 1, .seqlen_q = 67, .seqlen_k = 129, .heads = 4, .heads_k = 2, .head_dim = d,
         .dtype = kDtypes[size_t(d / 8) % 3], .causal = (d / 8) % 2 == 0};
  run_dense_case(c);
}

INSTANTIATE_TEST_SUITE_P(MultiplesOf8, HeadDims, ::testing::Range(8, 257, 8));

// Head dims that are not multiples of 8, which the CUDA backend runs on zero-padded copies
// (cuda/head_dim_padding.hpp): every dtype and memory layout (packed and padded views have
// rows that are not 16-byte aligned), masks, GQA, softcap, ALiBi, with and without lse. The
// default scale must be 1/sqrt(D) of the caller's D, not of the padded one.
class OddHeadDims : public ::testing::TestWithParam<int> {};

TEST_P(OddHeadDims, MatchesReference) {
  const int d = GetParam();
  int n = 0;
  for (DType dt : kDtypes)
    for (Layout layout : {Layout::Contiguous, Layout::HeadMajor, Layout::Padded, Layout::Packed}) {
      const bool packed = layout == Layout::Packed;
      Case c{.batch = 1 + n % 2, .seqlen_q = packed ? 77 : 67, .seqlen_k = packed ? 77 : 129,
             .heads = 4, .heads_k = packed ? 4 : 2 - n % 2, .head_dim = d, .dtype = dt,
             .causal = n % 2 == 0, .window_left = n % 6 == 4 ? 19 : -1,
             .softcap = n % 3 == 1 ? 2.5f : 0.0f,
             .alibi = n % 4 == 3 ? Case::Alibi::PerHead : Case::Alibi::Off, .layout = layout,
             .with_lse = n % 5 != 4};
      run_dense_case(c);
      ++n;
    }
}

INSTANTIATE_TEST_SUITE_P(NotMultiplesOf8, OddHeadDims, ::testing::Values(1, 5, 59, 111, 250));

// The long lengths of the sweep: 1023 and 1025 straddle the 64-row/64-key tiles.
struct LongCase {
  const char* name;
  int64_t seqlen_q, seqlen_k, heads, heads_k, head_dim;
  DType dtype;
  Mask mask;
  float softcap;
  Case::Alibi alibi;
};
const LongCase kLongCases[] = {
    {"causal_bf16_1023x1025", 1023, 1025, 2, 1, 64, DType::BFloat16, kMasks[1], 0, Case::Alibi::Off},
    {"band_alibi_fp16_1025x1023", 1025, 1023, 2, 2, 32, DType::Float16, kMasks[3], 0, Case::Alibi::PerHead},
    {"full_fp32_1025", 1025, 1025, 1, 1, 128, DType::Float32, kMasks[0], 0, Case::Alibi::Off},
    {"decode_fp32_1x1025", 1, 1025, 8, 1, 64, DType::Float32, kMasks[1], 0, Case::Alibi::Off},
    {"sliding_softcap_bf16_1025x97", 1025, 97, 2, 1, 80, DType::BFloat16, kMasks[2], 5, Case::Alibi::Off},
    {"full_fp16_97x1023", 97, 1023, 8, 2, 112, DType::Float16, kMasks[0], 0, Case::Alibi::PerHead},
};

class LongSequences : public ::testing::TestWithParam<LongCase> {};

TEST_P(LongSequences, MatchesReference) {
  const LongCase& l = GetParam();
  Case c{.seqlen_q = l.seqlen_q, .seqlen_k = l.seqlen_k, .heads = l.heads, .heads_k = l.heads_k,
         .head_dim = l.head_dim, .dtype = l.dtype, .causal = l.mask.causal,
         .window_left = l.mask.left, .window_right = l.mask.right, .softcap = l.softcap,
         .alibi = l.alibi};
  run_dense_case(c);
}

INSTANTIATE_TEST_SUITE_P(Lengths, LongSequences, ::testing::ValuesIn(kLongCases),
                         [](const ::testing::TestParamInfo<LongCase>& info) {
                           return std::string(info.param.name);
                         });

TEST(EdgeCases, NoKeysGiveZeroOutputAndMinusInfinityLse) {
  for (DType dt : kDtypes) {
    Case c{.batch = 2, .seqlen_q = 5, .seqlen_k = 0, .heads = 4, .heads_k = 2, .head_dim = 16,
           .dtype = dt};
    run_dense_case(c);
  }
}

#ifdef FLASHATTN_TEST_CUDA
// More tiles than the GPU has SMs (256 to 512 here), so that a CTA of the persistent sm90
// TMA forward takes several tiles in a row: its producer loads the next tile's Q and K(0)
// while the consumers finish this one (Q released after the tile's last S, or after its
// output left Q's buffer at head dim 256), and the rings' phases carry across tiles. Every
// head-dim bucket, the masks under which the grid stays persistent (short causal sequences),
// GQA, lengths that end every tile in a partial block, and the general variant (softcap,
// ALiBi, dropout) whose scores depend on the tile's coordinates.
TEST(EdgeCases, ConsecutiveTilesOfAPersistentGrid) {
  int n = 0;
  for (int64_t d : {64, 128, 192, 256})
    for (const Mask& mask : {kMasks[0], kMasks[1], kMasks[2]}) {
      Case c{.batch = 8, .seqlen_q = 201, .seqlen_k = 233, .heads = 16, .heads_k = 4, .head_dim = d,
             .dtype = n % 2 ? DType::Float16 : DType::BFloat16, .causal = mask.causal,
             .window_left = mask.left, .window_right = mask.right,
             .softcap = n % 4 == 1 ? 3.0f : 0.0f,
             .alibi = n % 4 == 2 ? Case::Alibi::PerHead : Case::Alibi::Off,
             .with_lse = n % 3 != 2, .dropout_p = n % 4 == 3 ? 0.17f : 0.0f};
      run_dense_case(c);
      ++n;
    }
}

// More query blocks than a CUDA grid's y extent (65535): the kernels then take the blocks
// from x and the heads from y (cuda/common/tile_order.cuh). 65536 128-row blocks and a
// partial one, so every row-block size up to 128 overflows y; GQA 2/1 checks the head mapping.
TEST(EdgeCases, MoreQueryBlocksThanTheGridsYExtent) {
  Case c{.seqlen_q = 65536LL * 128 + 77,
         .seqlen_k = 24,
         .heads = 2,
         .heads_k = 1,
         .head_dim = 8,  // the reference's cost: it runs over all 8.4 M rows
         .dtype = DType::BFloat16};
  run_dense_case(c);
}
#endif

// As many query blocks as heads (3 x 3 at head dim 64, 128-row blocks on CUDA): the CUDA
// grid then has the same shape whichever layout the launch asked for, and the kernel must
// still cover every (head, block) once (cuda/common/tile_order.cuh). Masked and not.
TEST(EdgeCases, AsManyQueryBlocksAsHeads) {
  for (const bool causal : {false, true}) {
    Case c{.batch = 2, .seqlen_q = 3 * 128 - 5, .seqlen_k = 3 * 128 - 5, .heads = 3, .heads_k = 3,
           .head_dim = 64, .dtype = DType::BFloat16, .causal = causal};
    run_dense_case(c);
  }
}

#ifndef FLASHATTN_TEST_CUDA
// FLASHATTN_CPU_AMX takes 0, 1 or nothing: anything else is an error naming it, before out is
// written (and not inside the worker threads, where it could not leave).
TEST(EdgeCases, BadCpuAmxSettingIsAnErrorBeforeAnythingIsWritten) {
  ScopedEnv bad("FLASHATTN_CPU_AMX", "on");
  Case c{.seqlen_q = 33, .seqlen_k = 40, .heads = 2, .head_dim = 64, .dtype = DType::BFloat16};
  Inputs in = make_inputs(c);
  Buffer out(c.dtype, 33 * 2 * 64), lse(DType::Float32, 2 * 33);
  out.poison();
  lse.poison();
  const Buffer out_before = out, lse_before = lse;
  try {
    forward_on_backend(in.q, in.k, in.v, out.view({1, 33, 2, 64}), lse.view({1, 2, 33}), Options{});
    ADD_FAILURE() << "FLASHATTN_CPU_AMX=on was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
    EXPECT_EQ(e.argument(), "FLASHATTN_CPU_AMX") << e.what();
  }
  EXPECT_EQ(out.bytes, out_before.bytes);
  EXPECT_EQ(lse.bytes, lse_before.bytes);
}
#endif

TEST(EdgeCases, FullyMaskedRowsGiveZeroOutputAndMinusInfinityLse) {
  // Sq = 5, Sk = 2, causal: rows 0..2 see no key (docs/SPEC.md's example).
  Case c{.seqlen_q = 5, .seqlen_k = 2, .heads = 2, .head_dim = 8, .causal = true};
  run_dense_case(c);
  Inputs in = make_inputs(c);
  Buffer out(c.dtype, 5 * 2 * 8), lse(DType::Float32, 2 * 5);
  out.poison();
  lse.poison();
  Options o;
  o.causal = true;
  forward_on_backend(in.q, in.k, in.v, out.view({1, 5, 2, 8}), lse.view({1, 2, 5}), o);
  const std::vector<double> o_data = reference::gather(out.view({1, 5, 2, 8}));
  const auto* l_data = static_cast<const float*>(lse.data());
  for (int i = 0; i < 3; ++i)
    for (int h = 0; h < 2; ++h) {
      EXPECT_EQ(l_data[h * 5 + i], -std::numeric_limits<float>::infinity());
      for (int d = 0; d < 8; ++d) EXPECT_EQ(o_data[size_t((i * 2 + h) * 8 + d)], 0.0);
    }
}

TEST(EdgeCases, EmptyQueryAndEmptyBatchAreNoOps) {
  Case c{.seqlen_q = 0, .seqlen_k = 9};
  run_dense_case(c);
  c.batch = 0;
  run_dense_case(c);
}

TEST(EdgeCases, WindowsWiderThanTheSequenceEqualNoWindow) {
  for (auto [left, right] : {std::pair{5000, 5000}, std::pair{5000, -1}, std::pair{-1, 4000}}) {
    Case c{.seqlen_q = 70, .seqlen_k = 90, .heads = 2, .head_dim = 32, .window_left = left,
           .window_right = right};
    run_dense_case(c);
  }
}

// With a softcap too: tanh(s scale / cap) of a negative scale (the GPU sweep found the CUDA
// kernels' tanh taking the scale's magnitude for granted), at head dims of every CUDA kernel.
TEST(EdgeCases, CustomAndNegativeSoftmaxScales) {
  for (int64_t d : {16, 64, 128})
    for (float softcap : {0.0f, 1.5f})
      for (float scale : {0.5f, -0.3f, 0.0f, 3.0f}) {
        Case c{.seqlen_q = 33, .seqlen_k = 71, .heads = 2, .head_dim = d, .dtype = DType::BFloat16,
               .softcap = softcap, .softmax_scale = scale};
        run_dense_case(c);
      }
}

TEST(EdgeCases, StridedOutputView) {
  // out viewed as (B, Sq, H, D) over head-major storage (B, H, Sq, D).
  Case c{.batch = 2, .seqlen_q = 45, .seqlen_k = 77, .heads = 3, .heads_k = 1, .head_dim = 24,
         .dtype = DType::Float16, .causal = true};
  Inputs in = make_inputs(c);
  Buffer out(c.dtype, 2 * 3 * 45 * 24), lse(DType::Float32, 2 * 3 * 45);
  out.poison();
  lse.poison();
  const TensorView out_view = out.view({2, 45, 3, 24}, {3 * 45 * 24, 24, 45 * 24, 1});
  const TensorView lse_view = lse.view({2, 3, 45});
  Options o;
  o.causal = true;
  forward_on_backend(in.q, in.k, in.v, out_view, lse_view, o);
  expect_matches_reference(in.q, in.k, in.v, o, nullptr, out_view, &lse_view, c.describe());
}

TEST(EdgeCases, NanInOneQueryRowPoisonsOnlyThatRow) {
  Case c{.seqlen_q = 70, .seqlen_k = 80, .heads = 2, .head_dim = 16};
  Inputs in = make_inputs(c);
  in.q_buf.set((13 * 2 + 1) * 16 + 5, std::nanf(""));  // row 13, head 1
  Buffer out(c.dtype, 70 * 2 * 16), lse(DType::Float32, 2 * 70);
  out.poison();
  lse.poison();
  const TensorView out_view = out.view({1, 70, 2, 16}), lse_view = lse.view({1, 2, 70});
  forward_on_backend(in.q, in.k, in.v, out_view, lse_view, {});
  // The reference has NaN in exactly that row; the comparison demands NaN where it has NaN
  // and a finite, accurate value everywhere else.
  expect_matches_reference(in.q, in.k, in.v, {}, nullptr, out_view, &lse_view, "nan row");
  EXPECT_TRUE(std::isnan(static_cast<float*>(lse.data())[70 + 13]));
  EXPECT_FALSE(std::isnan(static_cast<float*>(lse.data())[13]));
}

// Each work item is computed by one thread (CPU) or one CTA (CUDA) in a fixed order, so the
// result is bitwise the same on every run and for every CPU thread count.
// The same bits for every thread count: under a causal mask or a right window the CPU
// engine takes fewer query rows per work item where threads would go without (rows_per_item:
// here 256, 128 and 64 rows across the counts), which must not change any row's result.
TEST(Determinism, RepeatedRunsAreBitwiseEqual) {
  const Case cases[] = {
      {.batch = 2, .seqlen_q = 150, .seqlen_k = 190, .heads = 4, .heads_k = 2, .head_dim = 64,
       .dtype = DType::BFloat16, .causal = true},
      {.batch = 1, .seqlen_q = 700, .seqlen_k = 700, .heads = 2, .heads_k = 1, .head_dim = 40,
       .dtype = backend_dtype(DType::Float32), .causal = true},
      {.batch = 1, .seqlen_q = 300, .seqlen_k = 500, .heads = 2, .heads_k = 2, .head_dim = 64,
       .dtype = DType::Float16, .window_right = 30}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.describe());
    Inputs in = make_inputs(c);
    const int64_t elements = c.batch * c.seqlen_q * c.heads * c.head_dim;
    std::vector<unsigned char> first, first_lse;
    for (int threads : {1, 2, 3, 7, 0, 0}) {
      Buffer out(c.dtype, elements), lse(DType::Float32, c.batch * c.heads * c.seqlen_q);
      out.poison();
      lse.poison();
      Execution e;
      e.num_threads = threads;
      Options o;
      o.causal = c.causal;
      o.window_right = c.window_right;
      forward_on_backend(in.q, in.k, in.v, out.view({c.batch, c.seqlen_q, c.heads, c.head_dim}),
                         lse.view({c.batch, c.heads, c.seqlen_q}), o, nullptr, e);
      if (first.empty()) {
        first = out.bytes;
        first_lse = lse.bytes;
      } else {
        EXPECT_EQ(out.bytes, first) << threads << " threads";
        EXPECT_EQ(lse.bytes, first_lse) << threads << " threads";
      }
    }
  }
}

// --- Dropout ------------------------------------------------------------------------------

// Every mask x dtype with dropout on odd geometries (windows make the first visible key of a
// block arbitrary, so a lane's two columns can straddle two Philox groups), some with softcap
// and ALiBi, head dims from 8 to 256 (59 among them): the keep bits must be the reference's (docs/SPEC.md,
// "Dropout"), so a wrong bit shows as an output error far beyond the tolerance.
TEST(Dropout, EveryMaskAndDtypeMatchesTheReference) {
  const Geometry geometries[] = {{2, 97, 113, 4, 2, 40}, {1, 130, 61, 6, 3, 64},
                                 {1, 33, 150, 2, 1, 256}, {3, 17, 17, 2, 2, 8},
                                 {2, 45, 70, 4, 1, 59}};
  int n = 0;
  for (const Mask& m : kMasks)
    for (DType dt : kDtypes) {
      const Geometry g = geometries[size_t(n) % std::size(geometries)];
      Case c{.batch = g.batch, .seqlen_q = g.seqlen_q, .seqlen_k = g.seqlen_k, .heads = g.heads,
             .heads_k = g.heads_k, .head_dim = g.head_dim, .dtype = dt, .causal = m.causal,
             .window_left = m.left, .window_right = m.right, .softcap = n % 5 == 2 ? 2.5f : 0.0f,
             .alibi = n % 7 == 3 ? Case::Alibi::PerHead : Case::Alibi::Off,
             .dropout_p = n % 2 ? 0.17f : 0.6f};
      run_dense_case(c);
      ++n;
    }
}

// --- Ragged batches -----------------------------------------------------------------------

struct VarlenCase {
  std::vector<int32_t> lens_q, lens_k;
  int64_t heads = 4, heads_k = 2, head_dim = 32;
  DType dtype = backend_dtype(DType::Float32);
  Mask mask = kMasks[0];
  float softcap = 0;
  Case::Alibi alibi = Case::Alibi::Off;
  bool seqused = false;
  int64_t extra_max = 0;  // max_seqlen beyond the longest sequence (allowed)
  float dropout_p = 0;
  int64_t extra_rows = 0;  // rows past cu_seqlens[B] in every tensor: never read nor written
  int64_t page_size = 0;      // > 0: the backend gets the keys paged (page_keys), the
  bool packed_pages = false;  // reference the same keys dense
  // NaN in every row of q, k and v that no sequence reads (past seqused_k, past
  // cu_seqlens[B]): a kernel that lets one into a result fails. Dense keys only.
  bool nan_unread_rows = false;
};

void run_varlen_case(const VarlenCase& vc) {
  const int64_t B = int64_t(vc.lens_q.size()), H = vc.heads, Hk = vc.heads_k, D = vc.head_dim;
  std::vector<int32_t> cu_q{0}, cu_k{0};
  for (int32_t n : vc.lens_q) cu_q.push_back(cu_q.back() + n);
  for (int32_t n : vc.lens_k) cu_k.push_back(cu_k.back() + n);
  const int64_t total_q = cu_q.back(), total_k = cu_k.back();
  const int64_t rows_q = total_q + vc.extra_rows, rows_k = total_k + vc.extra_rows;
  Buffer q(vc.dtype, rows_q * H * D), k(vc.dtype, rows_k * Hk * D), v(vc.dtype, rows_k * Hk * D);
  q.fill_random();
  k.fill_random();
  v.fill_random();
  Buffer out(vc.dtype, rows_q * H * D), lse(DType::Float32, H * rows_q);
  out.poison();
  lse.poison();
  Buffer cuq = int32_buffer(cu_q), cuk = int32_buffer(cu_k);
  std::vector<int32_t> used;
  for (int32_t n : vc.lens_k)
    used.push_back(std::uniform_int_distribution<int32_t>(0, n)(rng()));
  Buffer used_buf = int32_buffer(used);
  if (vc.nan_unread_rows) {
    const auto poison_rows = [](Buffer& t, int64_t begin, int64_t end, int64_t row_elements) {
      for (int64_t i = begin * row_elements; i < end * row_elements; ++i) t.set(i, std::nanf(""));
    };
    for (int64_t b = 0; b < B; ++b) {
      const int64_t read_end = cu_k[size_t(b)] + (vc.seqused ? used[size_t(b)] : vc.lens_k[size_t(b)]);
      poison_rows(k, read_end, cu_k[size_t(b) + 1], Hk * D);
      poison_rows(v, read_end, cu_k[size_t(b) + 1], Hk * D);
    }
    poison_rows(k, total_k, rows_k, Hk * D);
    poison_rows(v, total_k, rows_k, Hk * D);
    poison_rows(q, total_q, rows_q, H * D);
  }

  Varlen varlen;
  varlen.cu_seqlens_q = cuq.view({B + 1});
  varlen.cu_seqlens_k = cuk.view({B + 1});
  varlen.max_seqlen_q = *std::max_element(vc.lens_q.begin(), vc.lens_q.end()) + vc.extra_max;
  varlen.max_seqlen_k = *std::max_element(vc.lens_k.begin(), vc.lens_k.end()) + vc.extra_max;
  if (vc.seqused) varlen.seqused_k = used_buf.view({B});

  Case shape;  // for options_of and the description
  shape.batch = B;
  shape.heads = H;
  shape.causal = vc.mask.causal;
  shape.window_left = vc.mask.left;
  shape.window_right = vc.mask.right;
  shape.softcap = vc.softcap;
  shape.alibi = vc.alibi;
  shape.dropout_p = vc.dropout_p;
  Buffer slopes;
  const Options o = options_of(shape, slopes);
  // The rows of the sequences against the reference; the extra rows still poisoned.
  const TensorView qv = q.view({total_q, H, D}), kv = k.view({total_k, Hk, D}),
                   vv = v.view({total_k, Hk, D}), ov = out.view({total_q, H, D}),
                   lv = lse.view({H, total_q}, {rows_q, 1});
  std::string what = std::string("varlen ") + dtype_name(vc.dtype) + " D=" + std::to_string(D) +
                     " Hk=" + std::to_string(Hk) + " mask=" + vc.mask.name +
                     (vc.seqused ? " seqused_k" : "") + (vc.dropout_p > 0 ? " dropout" : "") +
                     (vc.softcap > 0 ? " softcap" : "") +
                     (vc.alibi != Case::Alibi::Off ? " alibi" : "") + " seed=" +
                     std::to_string(test_seed());
  // The backend sees the whole tensors (extra rows included); paged, the same keys in pages.
  const TensorView q_all = q.view({rows_q, H, D}), out_all_view = out.view({rows_q, H, D}),
                   lse_all_view = lse.view({H, rows_q});
  if (vc.page_size > 0) {
    const PagedKeys pages =
        page_keys(kv, vv, cu_k, vc.seqused ? &used : nullptr, vc.page_size, vc.packed_pages);
    Varlen paged = varlen;
    paged.block_table = pages.block_table;
    what += " paged: page_size=" + std::to_string(vc.page_size) +
            (vc.packed_pages ? " packed" : "") + " num_pages=" + std::to_string(pages.num_pages);
    forward_on_backend(q_all, pages.k, pages.v, out_all_view, lse_all_view, o, &paged);
  } else {
    forward_on_backend(q_all, k.view({rows_k, Hk, D}), v.view({rows_k, Hk, D}), out_all_view,
                       lse_all_view, o, &varlen);
  }
  expect_matches_reference(qv, kv, vv, o, &varlen, ov, &lv, what);
  if (vc.extra_rows == 0) return;
  const std::vector<double> out_all = reference::gather(out.view({rows_q, H, D}));
  const std::vector<double> lse_all = reference::gather(lse.view({H, rows_q}));
  int64_t written = 0;
  for (int64_t r = total_q; r < rows_q; ++r)
    for (int64_t h = 0; h < H; ++h) {
      written += !std::isnan(lse_all[size_t(h * rows_q + r)]);
      for (int64_t d = 0; d < D; ++d) written += !std::isnan(out_all[size_t((r * H + h) * D + d)]);
    }
  EXPECT_EQ(written, 0) << what << ": elements of out or lse past cu_seqlens_q[B] were written";
}

TEST(Varlen, EmptySequencesAndEveryFeature) {
  const std::vector<int32_t> lens_q{0, 37, 1, 64, 130, 5, 0};
  const std::vector<int32_t> lens_k{3, 0, 77, 64, 129, 0, 0};
  int n = 0;
  for (DType dt : kDtypes)
    for (const Mask& m : kMasks) {
      VarlenCase vc;
      vc.lens_q = lens_q;
      vc.lens_k = lens_k;
      vc.dtype = dt;
      vc.mask = m;
      vc.softcap = n % 3 == 1 ? 2.5f : 0.0f;
      vc.alibi = static_cast<Case::Alibi>(n % 3);
      vc.seqused = n % 2 == 1;
      vc.extra_max = n % 4 == 0 ? 17 : 0;
      vc.heads_k = n % 2 ? 1 : 4;
      vc.dropout_p = n % 4 == 1 ? 0.23f : 0.0f;
      run_varlen_case(vc);
      ++n;
    }
}

// Ragged batches at head dims that are not multiples of 8, some with tensors longer than
// cu_seqlens[B]: the rows past it must stay unwritten by the CUDA backend's padded copies as
// by the kernels.
TEST(Varlen, HeadDimsNotMultiplesOf8) {
  int n = 0;
  for (int64_t d : {1, 5, 111, 250})
    for (DType dt : kDtypes) {
      VarlenCase vc;
      vc.lens_q = {0, 37, 1, 64, 5};
      vc.lens_k = {3, 0, 77, 64, 2};
      vc.head_dim = d;
      vc.dtype = dt;
      vc.mask = kMasks[size_t(n) % std::size(kMasks)];
      vc.softcap = n % 3 == 1 ? 2.5f : 0.0f;
      vc.alibi = static_cast<Case::Alibi>(n % 3);
      vc.seqused = n % 2 == 1;
      vc.extra_max = n % 4 == 0 ? 9 : 0;
      vc.heads_k = n % 2 ? 1 : 4;
      vc.dropout_p = n % 4 == 1 ? 0.23f : 0.0f;
      vc.extra_rows = n % 3 == 0 ? 0 : 3;
      run_varlen_case(vc);
      ++n;
    }
}

// The same batch with paged keys and values (Varlen::block_table): page sizes 1 (every key in
// a page of its own), 3 (pages straddle every block), 16 and 256 (longer than most
// sequences), pages in a random order, every feature, GQA and MQA, contiguous and packed pages.
TEST(Varlen, PagedEveryPageSizeAndFeature) {
  const std::vector<int32_t> lens_q{0, 37, 1, 64, 130, 5, 0};
  const std::vector<int32_t> lens_k{3, 0, 77, 64, 129, 0, 0};
  int n = 0;
  for (const int64_t page_size : {1, 3, 16, 256})
    for (const Mask& m : kMasks) {
      VarlenCase vc;
      vc.lens_q = lens_q;
      vc.lens_k = lens_k;
      vc.dtype = kDtypes[size_t(n) % 3];
      vc.mask = m;
      vc.softcap = n % 3 == 1 ? 2.5f : 0.0f;
      vc.alibi = static_cast<Case::Alibi>(n % 3);
      vc.seqused = n % 2 == 1;
      vc.extra_max = n % 4 == 0 ? 17 : 0;
      vc.heads_k = n % 2 ? 1 : 4;
      vc.dropout_p = n % 5 == 1 ? 0.23f : 0.0f;
      vc.page_size = page_size;
      vc.packed_pages = n % 4 == 3;
      run_varlen_case(vc);
      ++n;
    }
}

// Every head-dim bucket of the kernels (each has its own paged variant on CUDA), odd head
// dims, and page sizes: odd and a multiple of 8 (the sm80 kernel on CUDA), a divisor of the
// key blocks, and a multiple of 64 past them (the Hopper kernel's boxes of 64 rows, three a page).
TEST(Varlen, PagedEveryHeadDimBucket) {
  int n = 0;
  // 5 and 59 run on the CUDA backend's padded copies of the page pool.
  for (const int64_t d : {24, 64, 72, 128, 136, 192, 224, 256, 5, 59}) {
    VarlenCase vc;
    vc.lens_q = {45, 1, 90};
    vc.lens_k = {150, 33, 90};
    vc.heads = 4;
    vc.heads_k = 2;
    vc.head_dim = d;
    vc.dtype = n % 2 ? DType::BFloat16 : DType::Float16;
    vc.mask = kMasks[size_t(n) % 4];
    vc.seqused = n % 3 == 2;
    vc.page_size = std::array<int64_t, 4>{64, 7, 24, 192}[size_t(n) % 4];
    vc.packed_pages = n % 3 == 1;
    run_varlen_case(vc);
    ++n;
  }
}

// Many key blocks per query block (the kernels' tables of pages for blocks n + 1 and n + 2),
// at the head dims of the double-buffered (64, 128) and single-buffered (256) CUDA kernels.
TEST(Varlen, PagedLongSequences) {
  for (const auto& [d, page_size, mask] : {std::tuple{64, int64_t{16}, kMasks[1]},
                                           std::tuple{128, int64_t{256}, kMasks[0]},
                                           std::tuple{128, int64_t{320}, kMasks[1]},
                                           std::tuple{256, int64_t{5}, kMasks[2]}}) {
    VarlenCase vc;
    vc.lens_q = {700, 1, 129};
    vc.lens_k = {1025, 900, 640};
    vc.heads = 2;
    vc.heads_k = 1;
    vc.head_dim = d;
    vc.dtype = DType::BFloat16;
    vc.mask = mask;
    vc.page_size = page_size;
    run_varlen_case(vc);
  }
}

// Rows no sequence reads hold NaN: the unused keys past seqused_k and the rows past
// cu_seqlens[B]. Sequences end inside key blocks and inside a warp's 16 query rows (the CUDA
// TMA kernel reads whole blocks of the packed tensor and stores whole warps' rows where
// they lie inside the sequence), at every head-dim bucket, masks and GQA.
TEST(Varlen, RowsNoSequenceReadsNeverReachTheResult) {
  int n = 0;
  for (int64_t d : {40, 64, 128, 136, 256})
    for (const Mask& m : {kMasks[0], kMasks[1]}) {
      VarlenCase vc;
      vc.lens_q = {37, 130, 1, 200};
      vc.lens_k = {150, 77, 129, 300};
      vc.heads = 4;
      vc.heads_k = n % 2 ? 1 : 2;
      vc.head_dim = d;
      vc.dtype = n % 2 ? DType::BFloat16 : backend_dtype(DType::Float32);
      vc.mask = m;
      vc.seqused = n % 3 != 2;
      vc.extra_rows = 70;
      vc.softcap = n % 4 == 3 ? 2.5f : 0.0f;
      vc.nan_unread_rows = true;
      run_varlen_case(vc);
      ++n;
    }
}

TEST(Varlen, LongRaggedSequences) {
  VarlenCase vc;
  vc.lens_q = {1023, 1, 300, 1025};
  vc.lens_k = {1025, 700, 0, 1023};
  vc.heads = 2;
  vc.heads_k = 1;
  vc.head_dim = 64;
  vc.dtype = DType::BFloat16;
  vc.mask = kMasks[1];
  run_varlen_case(vc);
}

}  // namespace
}  // namespace flashattn::testing

// The masking rule of src/common/mask.hpp (and flashattn::visible_keys, which states it for
// callers) against docs/SPEC.md's literal statement and examples.
#include "common/mask.hpp"
#include "common/params.hpp"

#include <string>

#include "support.hpp"

namespace flashattn::detail {
namespace {

// docs/SPEC.md, "The score of query i and key j", step 4, verbatim: key j is visible to query i iff j >= d - left (left >= 0) and
// j <= d + right (right >= 0), d = i + Sk - Sq.
bool literal_visible(int64_t i, int64_t j, int64_t sq, int64_t sk, int left, int right) {
  const int64_t d = i + sk - sq;
  return (left < 0 || j >= d - left) && (right < 0 || j <= d + right);
}

std::string pattern(int64_t sq, int64_t sk, int left, int right) {
  std::string rows;
  for (int64_t i = 0; i < sq; ++i) {
    if (i) rows += " / ";
    const KeyRange r = visible_keys(i, sq, sk, left, right);
    for (int64_t j = 0; j < sk; ++j) rows += (j >= r.begin && j < r.end) ? '1' : '0';
  }
  return rows;
}

TEST(Mask, SpecExamples) {
  EXPECT_EQ(pattern(2, 5, -1, 0), "11110 / 11111");                // causal, Sq < Sk
  EXPECT_EQ(pattern(5, 2, -1, 0), "00 / 00 / 00 / 10 / 11");       // causal, Sq > Sk
  EXPECT_EQ(pattern(4, 4, 1, 0), "1000 / 1100 / 0110 / 0011");     // sliding window causal
  EXPECT_EQ(pattern(3, 3, 0, 1), "110 / 011 / 001");               // right-only window
  EXPECT_EQ(pattern(2, 3, -1, -1), "111 / 111");                   // no mask
}

TEST(Mask, RangeMatchesLiteralRuleEverywhere) {
  for (int64_t sq : {0, 1, 2, 3, 7, 16})
    for (int64_t sk : {0, 1, 2, 5, 16})
      for (int left : {-1, 0, 1, 3, 40})
        for (int right : {-1, 0, 1, 2, 40})
          for (int64_t i = 0; i < sq; ++i) {
            const KeyRange r = visible_keys(i, sq, sk, left, right);
            EXPECT_LE(0, r.begin);
            EXPECT_LE(r.begin, r.end);
            EXPECT_LE(r.end, sk);
            for (int64_t j = 0; j < sk; ++j)
              ASSERT_EQ(j >= r.begin && j < r.end, literal_visible(i, j, sq, sk, left, right))
                  << "sq=" << sq << " sk=" << sk << " left=" << left << " right=" << right
                  << " i=" << i << " j=" << j;
          }
}

// The public flashattn::visible_keys takes the call's Options: causal sets right = 0 and keeps
// the left window (docs/SPEC.md, step 4); otherwise the window is used as given.
TEST(Mask, PublicVisibleKeysFollowTheOptions) {
  for (int64_t sq : {0, 1, 3, 7})
    for (int64_t sk : {0, 2, 5, 9})
      for (bool causal : {false, true})
        for (int left : {-1, 0, 2})
          for (int right : {-1, 0, 3})
            for (int64_t i = 0; i < sq; ++i) {
              Options options;
              options.causal = causal;
              options.window_left = left;
              options.window_right = right;
              const flashattn::KeyRange r = flashattn::visible_keys(i, sq, sk, options);
              for (int64_t j = 0; j < sk; ++j)
                ASSERT_EQ(j >= r.begin && j < r.end,
                          literal_visible(i, j, sq, sk, left, causal ? 0 : right))
                    << "sq=" << sq << " sk=" << sk << " causal=" << causal << " left=" << left
                    << " right=" << right << " i=" << i << " j=" << j;
            }
}

TEST(Mask, BlockSummariesAreExact) {
  for (int64_t sq : {1, 5, 13})
    for (int64_t sk : {1, 4, 13, 20})
      for (int left : {-1, 0, 2, 9})
        for (int right : {-1, 0, 3})
          for (int64_t i0 = 0; i0 < sq; ++i0)
            for (int64_t i1 = i0 + 1; i1 <= sq; ++i1) {
              // Union of the rows' visible keys.
              int64_t lo = sk, hi = 0;
              for (int64_t i = i0; i < i1; ++i)
                for (int64_t j = 0; j < sk; ++j)
                  if (literal_visible(i, j, sq, sk, left, right)) {
                    lo = std::min(lo, j);
                    hi = std::max(hi, j + 1);
                  }
              const KeyRange u = visible_keys_of_rows(i0, i1, sq, sk, left, right);
              for (int64_t j = lo; j < hi; ++j) ASSERT_TRUE(j >= u.begin && j < u.end);
              // Full visibility of every key block [j0, j1).
              for (int64_t j0 = 0; j0 < sk; ++j0)
                for (int64_t j1 = j0 + 1; j1 <= sk; ++j1) {
                  bool all = true;
                  for (int64_t i = i0; i < i1; ++i)
                    for (int64_t j = j0; j < j1; ++j)
                      all = all && literal_visible(i, j, sq, sk, left, right);
                  ASSERT_EQ(block_fully_visible(i0, i1, j0, j1, sq, sk, left, right), all)
                      << sq << " " << sk << " " << left << " " << right << " rows " << i0 << ".."
                      << i1 << " keys " << j0 << ".." << j1;
                }
            }
}

// The forward kernels skip the mask on the key blocks fully_visible_blocks names: exactly the
// blocks of block_n keys (from the rows' first visible key) that every row sees whole (a block
// wrongly inside would let masked keys through; one wrongly outside only costs the mask).
TEST(Mask, FullyVisibleKeyBlocksAreExact) {
  for (int64_t sq : {1, 5, 13, 20})
    for (int64_t sk : {1, 4, 13, 20, 33})
      for (int left : {-1, 0, 2, 9})
        for (int right : {-1, 0, 3, 30})
          for (int64_t block_n : {1, 2, 4, 8})
            for (int64_t i0 = 0; i0 < sq; i0 += 3)
              for (int64_t i1 = i0 + 1; i1 <= sq; i1 += 2) {
                const KeyRange keys = visible_keys_of_rows(i0, i1, sq, sk, left, right);
                if (keys.empty()) continue;
                const int64_t n_blocks = (keys.end - keys.begin + block_n - 1) / block_n;
                const KeyRange full =
                    fully_visible_blocks(i0, i1, keys.begin, block_n, n_blocks, sq, sk, left, right);
                for (int64_t n = 0; n < n_blocks; ++n) {
                  const int64_t j0 = keys.begin + n * block_n, j1 = j0 + block_n;
                  bool all = j1 <= sk;
                  for (int64_t i = i0; i < i1 && all; ++i)
                    for (int64_t j = j0; j < j1; ++j) all = all && literal_visible(i, j, sq, sk, left, right);
                  ASSERT_EQ(n >= full.begin && n < full.end, all)
                      << sq << " " << sk << " " << left << " " << right << " block_n " << block_n << " rows "
                      << i0 << ".." << i1 << " block " << n;
                }
              }
}

// The sm90 backward masks only the steps outside fully_visible_row_blocks: a block inside that
// is not seen whole would keep scores it must drop, one outside costs only time.
TEST(Mask, FullyVisibleRowBlocksAreExact) {
  for (int64_t sq : {1, 5, 13, 20})
    for (int64_t sk : {1, 4, 13, 20, 33})
      for (int left : {-1, 0, 2, 9})
        for (int right : {-1, 0, 3, 30})
          for (int64_t block_m : {1, 2, 4, 8})
            for (int64_t j0 = 0; j0 < sk; j0 += 2)
              for (int64_t j1 = j0 + 1; j1 <= sk + 3; j1 += 3) {  // past sk: the last key block
                const int64_t first_row = (j0 % 3) * block_m < sq ? (j0 % 3) * block_m : 0;
                const int64_t n_blocks = (sq - first_row + block_m - 1) / block_m;
                const KeyRange full =
                    fully_visible_row_blocks(first_row, block_m, n_blocks, j0, j1, sq, sk, left, right);
                for (int64_t m = 0; m < n_blocks; ++m) {
                  const int64_t i0 = first_row + m * block_m, i1 = std::min(i0 + block_m, sq);
                  bool all = j1 <= sk;
                  for (int64_t i = i0; i < i1 && all; ++i)
                    for (int64_t j = j0; j < j1; ++j) all = all && literal_visible(i, j, sq, sk, left, right);
                  ASSERT_EQ(m >= full.begin && m < full.end, all)
                      << sq << " " << sk << " " << left << " " << right << " block_m " << block_m << " keys "
                      << j0 << ".." << j1 << " first row " << first_row << " block " << m;
                }
              }
}

// The backward's key-parallel pass walks rows_seeing_keys: exactly the rows that see at least
// one key of the block (a row outside would lose its gradient, one inside that sees nothing
// would only cost time).
TEST(Mask, RowsSeeingAKeyBlockAreExact) {
  for (int64_t sq : {1, 5, 13, 20})
    for (int64_t sk : {1, 4, 13, 20})
      for (int left : {-1, 0, 2, 9})
        for (int right : {-1, 0, 3, 30})
          for (int64_t j0 = 0; j0 < sk; ++j0)
            for (int64_t j1 = j0 + 1; j1 <= sk; ++j1) {
              int64_t lo = sq, hi = 0;
              for (int64_t i = 0; i < sq; ++i)
                for (int64_t j = j0; j < j1; ++j)
                  if (literal_visible(i, j, sq, sk, left, right)) {
                    lo = std::min(lo, i);
                    hi = std::max(hi, i + 1);
                  }
              const KeyRange rows = rows_seeing_keys(j0, j1, sq, sk, left, right);
              if (lo >= hi) {
                // No row sees the block: the range may only hold rows that see nothing.
                for (int64_t i = rows.begin; i < rows.end; ++i)
                  for (int64_t j = j0; j < j1; ++j)
                    ASSERT_FALSE(literal_visible(i, j, sq, sk, left, right));
                continue;
              }
              ASSERT_EQ(rows.begin, lo) << sq << " " << sk << " " << left << " " << right
                                        << " keys " << j0 << ".." << j1;
              ASSERT_EQ(rows.end, hi) << sq << " " << sk << " " << left << " " << right
                                      << " keys " << j0 << ".." << j1;
            }
}

TEST(Mask, AlibiBiasIsMinusSlopeTimesDistanceFromTheDiagonal) {
  // diagonal = seqlen_k - seqlen_q: the call's own bottom-right alignment.
  EXPECT_FLOAT_EQ(alibi_bias(0.5f, 0, 3, 5 - 2), -0.5f * 0);   // d = 0 + 5 - 2 = 3
  EXPECT_FLOAT_EQ(alibi_bias(0.5f, 0, 0, 5 - 2), -0.5f * 3);
  EXPECT_FLOAT_EQ(alibi_bias(0.25f, 1, 4, 5 - 2), -0.25f * 0);
  EXPECT_FLOAT_EQ(alibi_bias(0.25f, 4, 0, 2 - 5), -0.25f * 1); // d = 4 + 2 - 5 = 1
  EXPECT_FLOAT_EQ(alibi_bias(1.0f, 0, 1, 2 - 5), -1.0f * 4);   // key after the diagonal
}

TEST(Mask, AlibiDiagonalIsBottomRightOrTheOffsetBetweenPositions) {
  ForwardParams p;
  SequenceView s;
  s.seqlen_q = 2;
  s.seqlen_k = 5;
  EXPECT_EQ(alibi_diagonal(p, s), 3);
  p.has_positions = true;
  p.query_position0 = 40;  // row i is token 40 + i, key j token 8 + j
  p.key_position0 = 8;
  EXPECT_EQ(alibi_diagonal(p, s), 32);
  EXPECT_FLOAT_EQ(alibi_bias(0.5f, 1, 30, alibi_diagonal(p, s)), -0.5f * 3);  // 41 - 38
}

}  // namespace
}  // namespace flashattn::detail

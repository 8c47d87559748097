// Dropout's generator and mask: Philox4x32-10 against Random123's published known answers,
// the keep rate within binomial bounds, independence across (b, h), offset and seed, and the
// mask the engine's forward and backward really apply, read back through the public API.
#include <cmath>
#include <cstring>

#include "common/philox.hpp"
#include "support.hpp"

namespace flashattn::testing {
namespace {

using detail::DropoutRng;
using detail::Philox4x32;

// Random123 1.14, tests/kat_vectors: "philox4x32 10 <counter x4> <key x2> <expected x4>".
TEST(Philox, KnownAnswers) {
  struct Kat {
    uint32_t counter[4], key[2], expected[4];
  };
  const Kat kats[] = {
      {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
      {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
       {0xffffffff, 0xffffffff},
       {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
      {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
       {0xa4093822, 0x299f31d0},
       {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
  };
  for (const Kat& k : kats) {
    const Philox4x32 r = detail::philox4x32_10(
        Philox4x32{{k.counter[0], k.counter[1], k.counter[2], k.counter[3]}}, k.key[0], k.key[1]);
    for (int n = 0; n < 4; ++n) EXPECT_EQ(r.x[n], k.expected[n]) << "word " << n;
  }
}

// Kept count over n draws within 5 binomial standard deviations of n (1 - p).
void expect_rate(int64_t kept, int64_t n, double p, const std::string& what) {
  const double mean = double(n) * (1 - p), sigma = std::sqrt(double(n) * p * (1 - p));
  EXPECT_LE(std::abs(double(kept) - mean), 5 * sigma)
      << what << ": kept " << kept << " of " << n << ", expected " << mean << " +- 5 x " << sigma;
}

TEST(DropoutMask, KeepRateWithinBinomialBounds) {
  for (float p : {0.01f, 0.1f, 0.17f, 0.5f, 0.9f}) {
    const DropoutRng rng = detail::make_dropout_rng(1234567, 89, p);
    int64_t kept = 0, n = 0;
    for (uint32_t b = 0; b < 2; ++b)
      for (uint32_t h = 0; h < 2; ++h)
        for (uint32_t i = 0; i < 512; ++i)
          for (uint32_t j = 0; j < 512; j += 4) {  // the four bits of one Philox call
            kept += __builtin_popcount(rng.keep_bits4(b, h, i, j / 4));
            n += 4;
          }
    ASSERT_GE(n, 1000000);
    expect_rate(kept, n, p, "p = " + std::to_string(p));
  }
}

TEST(DropoutMask, PureFunctionMatchesTheRowHelper) {
  const float p = 0.3f;
  const DropoutRng rng = detail::make_dropout_rng(42, 7, p);
  for (uint32_t j = 0; j < 37; ++j)
    EXPECT_EQ(detail::dropout_keep(42, 7, 1, 2, 3, j, p), rng.keep(1, 2, 3, j));
  // A mask with nothing dropped is the no-dropout mask.
  Options o;
  for (uint8_t bit : reference::dropout_mask(o, 0, 0, 5, 9)) EXPECT_EQ(bit, 1);
}

// Two masks that should be independent agree on a fraction (1-p)^2 + p^2 of the elements.
TEST(DropoutMask, IndependentAcrossBatchHeadOffsetAndSeed) {
  const float p = 0.5f;
  const int64_t Sq = 1024, Sk = 1024;
  Options base;
  base.dropout_p = p;
  base.dropout_seed = 2024;
  base.dropout_offset = 10;
  const std::vector<uint8_t> ref = reference::dropout_mask(base, 0, 0, Sq, Sk);
  Options other_offset = base, other_seed = base;
  other_offset.dropout_offset = 11;
  other_seed.dropout_seed = 2025;
  const struct {
    const char* name;
    std::vector<uint8_t> mask;
  } others[] = {{"h + 1", reference::dropout_mask(base, 0, 1, Sq, Sk)},
                {"b + 1", reference::dropout_mask(base, 1, 0, Sq, Sk)},
                {"offset + 1", reference::dropout_mask(other_offset, 0, 0, Sq, Sk)},
                {"seed + 1", reference::dropout_mask(other_seed, 0, 0, Sq, Sk)}};
  for (const auto& o : others) {
    int64_t agree = 0;
    for (size_t n = 0; n < ref.size(); ++n) agree += ref[n] == o.mask[n];
    // Agreement is Bernoulli(q) with q = (1-p)^2 + p^2: the same bound with "p" = 1 - q.
    const double q = (1 - p) * (1 - p) + p * p;
    expect_rate(agree, int64_t(ref.size()), 1 - q, o.name);
  }
  // Rows and columns are not copies of each other either (counter words i and j / 4).
  int64_t same_row = 0, same_col = 0;
  for (int64_t j = 0; j < Sk; ++j) same_row += ref[size_t(j)] == ref[size_t(Sk + j)];
  for (int64_t i = 0; i < Sq; ++i) same_col += ref[size_t(i * Sk)] == ref[size_t(i * Sk + 4)];
  expect_rate(same_row, Sk, 0.5, "row 0 vs row 1");
  expect_rate(same_col, Sq, 0.5, "column 0 vs column 4");
}

// A small problem whose out rows are the dropped probabilities: with v_j = e_j (Sk <= D),
// out_i = sum_j (P o M)_ij e_j. And whose dv rows are them too: with dout_i = e_i (Sq <= D),
// dv_j = sum_i (P o M)_ij e_i. So the public API shows the mask each pass applied.
struct OneHot {
  static constexpr int64_t B = 2, Sq = 40, Sk = 56, H = 3, D = 64;
  Buffer q{DType::Float32, B * Sq * H * D}, k{DType::Float32, B * Sk * H * D},
      v{DType::Float32, B * Sk * H * D}, out{DType::Float32, B * Sq * H * D},
      lse{DType::Float32, B * H * Sq}, dout{DType::Float32, B * Sq * H * D},
      dq{DType::Float32, B * Sq * H * D}, dk{DType::Float32, B * Sk * H * D},
      dv{DType::Float32, B * Sk * H * D};
  Options o;

  explicit OneHot(float p) {
    q.fill_random();
    k.fill_random();
    for (int64_t n = 0; n < v.count(); ++n) v.set(n, 0.0f);
    for (int64_t n = 0; n < dout.count(); ++n) dout.set(n, 0.0f);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t j = 0; j < Sk; ++j) v.set(((b * Sk + j) * H + h) * D + j, 1.0f);
        for (int64_t i = 0; i < Sq; ++i) dout.set(((b * Sq + i) * H + h) * D + i, 1.0f);
      }
    o.dropout_p = p;
    o.dropout_seed = rng()();
    o.dropout_offset = 3;
    o.window_left = 30;  // a window, so that blocks start off the 4-key groups
    o.window_right = 5;
  }
  float out_at(int64_t b, int64_t h, int64_t i, int64_t j) const {
    return reinterpret_cast<const float*>(out.bytes.data())[((b * Sq + i) * H + h) * D + j];
  }
  float dv_at(int64_t b, int64_t h, int64_t i, int64_t j) const {
    return reinterpret_cast<const float*>(dv.bytes.data())[((b * Sk + j) * H + h) * D + i];
  }
  void run() {
    forward(q.view({B, Sq, H, D}), k.view({B, Sk, H, D}), v.view({B, Sk, H, D}),
            out.view({B, Sq, H, D}), lse.view({B, H, Sq}), o);
    backward(q.view({B, Sq, H, D}), k.view({B, Sk, H, D}), v.view({B, Sk, H, D}),
             out.view({B, Sq, H, D}), dout.view({B, Sq, H, D}), lse.view({B, H, Sq}),
             dq.view({B, Sq, H, D}), dk.view({B, Sk, H, D}), dv.view({B, Sk, H, D}), o);
  }
};

TEST(DropoutMask, ForwardAndBackwardApplyTheReferenceMask) {
  OneHot t(0.4f);
  t.run();
  const std::vector<double> probs = reference::dropped_probabilities(
      t.q.view({t.B, t.Sq, t.H, t.D}), t.k.view({t.B, t.Sk, t.H, t.D}),
      t.v.view({t.B, t.Sk, t.H, t.D}), t.o);
  int64_t dropped = 0, kept = 0;
  for (int64_t b = 0; b < t.B; ++b)
    for (int64_t h = 0; h < t.H; ++h) {
      const std::vector<uint8_t> mask = reference::dropout_mask(t.o, b, h, t.Sq, t.Sk);
      for (int64_t i = 0; i < t.Sq; ++i)
        for (int64_t j = 0; j < t.Sk; ++j) {
          const double expected = probs[size_t(((b * t.H + h) * t.Sq + i) * t.Sk + j)];
          const float fwd = t.out_at(b, h, i, j), bwd = t.dv_at(b, h, i, j);
          SCOPED_TRACE("b=" + std::to_string(b) + " h=" + std::to_string(h) +
                       " i=" + std::to_string(i) + " j=" + std::to_string(j));
          // Dropped (or masked) exactly where the reference says, kept elsewhere.
          ASSERT_EQ(fwd == 0.0f, expected == 0.0);
          ASSERT_EQ(bwd == 0.0f, expected == 0.0);
          EXPECT_NEAR(fwd, expected, 1e-5);
          EXPECT_NEAR(bwd, expected, 1e-5);
          if (expected != 0.0) {
            EXPECT_EQ(mask[size_t(i * t.Sk + j)], 1);
          }
          (expected == 0.0 ? dropped : kept)++;
        }
    }
  EXPECT_GT(dropped, 0);
  EXPECT_GT(kept, 0);
}

// Positions (Options::positions): a call over rows [r0, r0 + n) of a whole self-attention,
// with all its keys, must give exactly the whole call's rows: the same keep bits (dropout at
// (r0 + i, j)) and the same ALiBi distances |(r0 + i) - j| (not the call's own bottom-right
// |i + Sk - n - j|, which differs by r0 + n - Sk). A block of keys too: its lse and gradients
// against the float64 reference, whose positions are checked against the whole mask here.
struct Whole {
  static constexpr int64_t B = 2, S = 48, H = 2, D = 16;
  Buffer q{DType::Float32, B * S * H * D}, k{DType::Float32, B * S * H * D},
      v{DType::Float32, B * S * H * D}, slopes{DType::Float32, H};
  Options o;
  Whole() {
    q.fill_random();
    k.fill_random();
    v.fill_random();
    slopes.set(0, 0.25f);
    slopes.set(1, 0.0625f);
    o.alibi_slopes = slopes.view({H});
    o.dropout_p = 0.3f;
    o.dropout_seed = rng()();
    o.dropout_offset = 5;
  }
  // Rows [r0, r0 + n) of a (B, S, H, D) buffer.
  static TensorView rows(Buffer& t, int64_t r0, int64_t n) {
    return t.view({B, n, H, D}, {S * H * D, H * D, D, 1}, r0 * H * D);
  }
};

TEST(Positions, RowBlockEqualsTheWholeCallsRows) {
  Whole w;
  const int64_t r0 = 16, n = 24;  // not at the end: bottom-right ALiBi would be off by 8
  Buffer out{DType::Float32, w.B * w.S * w.H * w.D}, lse{DType::Float32, w.B * w.H * w.S};
  forward(w.q.view({w.B, w.S, w.H, w.D}), w.k.view({w.B, w.S, w.H, w.D}),
          w.v.view({w.B, w.S, w.H, w.D}), out.view({w.B, w.S, w.H, w.D}),
          lse.view({w.B, w.H, w.S}), w.o);
  Options block = w.o;
  block.positions = Options::Positions{r0, 0};
  Buffer bout{DType::Float32, w.B * n * w.H * w.D}, blse{DType::Float32, w.B * w.H * n};
  forward(Whole::rows(w.q, r0, n), w.k.view({w.B, w.S, w.H, w.D}),
          w.v.view({w.B, w.S, w.H, w.D}), bout.view({w.B, n, w.H, w.D}),
          blse.view({w.B, w.H, n}), block);
  const float* o_whole = reinterpret_cast<const float*>(out.bytes.data());
  const float* o_block = reinterpret_cast<const float*>(bout.bytes.data());
  const float* l_whole = reinterpret_cast<const float*>(lse.bytes.data());
  const float* l_block = reinterpret_cast<const float*>(blse.bytes.data());
  for (int64_t b = 0; b < w.B; ++b)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < w.H; ++h) {
        ASSERT_NEAR(l_block[(b * w.H + h) * n + i], l_whole[(b * w.H + h) * w.S + r0 + i],
                    1e-5 * std::abs(l_whole[(b * w.H + h) * w.S + r0 + i]))
            << "lse b=" << b << " h=" << h << " i=" << i;
        for (int64_t d = 0; d < w.D; ++d)
          ASSERT_NEAR(o_block[((b * n + i) * w.H + h) * w.D + d],
                      o_whole[((b * w.S + r0 + i) * w.H + h) * w.D + d], 1e-5)
              << "out b=" << b << " h=" << h << " i=" << i << " d=" << d;
      }
}

TEST(Positions, KeyBlockMatchesTheReferenceForwardAndBackward) {
  Whole w;
  const int64_t r0 = 8, n = 24, c0 = 21, m = 23;  // c0 off the 4-key Philox groups
  Options block = w.o;
  block.positions = Options::Positions{r0, c0};
  block.window_left = 20;  // the call's own mask stays bottom-right aligned
  const TensorView q = Whole::rows(w.q, r0, n), k = Whole::rows(w.k, c0, m),
                   v = Whole::rows(w.v, c0, m);
  // The reference's keep bits of the block are the whole call's, moved by the positions.
  for (int64_t b = 0; b < w.B; ++b)
    for (int64_t h = 0; h < w.H; ++h) {
      const std::vector<uint8_t> whole = reference::dropout_mask(w.o, b, h, w.S, w.S);
      const std::vector<uint8_t> part = reference::dropout_mask(block, b, h, n, m);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < m; ++j)
          ASSERT_EQ(part[size_t(i * m + j)], whole[size_t((r0 + i) * w.S + c0 + j)]);
    }
  Buffer out{DType::Float32, w.B * n * w.H * w.D}, lse{DType::Float32, w.B * w.H * n},
      dout{DType::Float32, w.B * n * w.H * w.D}, dq{DType::Float32, w.B * n * w.H * w.D},
      dk{DType::Float32, w.B * m * w.H * w.D}, dv{DType::Float32, w.B * m * w.H * w.D};
  dout.fill_random();
  forward(q, k, v, out.view({w.B, n, w.H, w.D}), lse.view({w.B, w.H, n}), block);
  backward(q, k, v, out.view({w.B, n, w.H, w.D}), dout.view({w.B, n, w.H, w.D}),
           lse.view({w.B, w.H, n}), dq.view({w.B, n, w.H, w.D}), dk.view({w.B, m, w.H, w.D}),
           dv.view({w.B, m, w.H, w.D}), block);
  const reference::Result ref = reference::forward(q, k, v, block);
  const reference::Gradients g =
      reference::backward(q, k, v, dout.view({w.B, n, w.H, w.D}), block);
  const auto expect_close = [](const Buffer& got, const std::vector<double>& want,
                               const char* name) {
    double scale = 1.0, err = 0.0;
    for (double x : want) scale = std::max(scale, std::abs(x));
    const float* g = reinterpret_cast<const float*>(got.bytes.data());
    for (size_t n = 0; n < want.size(); ++n) err = std::max(err, std::abs(g[n] - want[n]));
    EXPECT_LE(err, 1e-5 * scale) << name;
  };
  expect_close(out, ref.out, "out");
  expect_close(lse, ref.lse, "lse");
  expect_close(dq, g.dq, "dq");
  expect_close(dk, g.dk, "dk");
  expect_close(dv, g.dv, "dv");
}

}  // namespace
}  // namespace flashattn::testing

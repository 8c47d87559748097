#include "cpu/kernels.hpp"

#include "cpu/exp_approx.hpp"

#include <cmath>
#include <cstring>
#include <limits>

#if defined(__SSE2__)
#include <immintrin.h>
#endif


namespace flashattn::detail::cpu {

FA_CPU_DISPATCH void convert_row(const float* src, float* dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) dst[i] = scale * src[i];
}

FA_CPU_DISPATCH void convert_row(const half_t* src, float* dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) dst[i] = scale * to_float(src[i]);
}

FA_CPU_DISPATCH void convert_row(const bfloat16_t* src, float* dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) dst[i] = scale * to_float(src[i]);
}

// In 4 x 4 blocks of registers: a row at a time, each float went to the tile by its own
// store, 64 (the head dim) stores a kBlockK floats apart per key, which with the copy before
// them was an eighth of the forward's time at head dim 64 (the store buffer filled up).
// SSE's 128-bit shuffles are baseline x86-64 and native on every AVX2 core (Zen 1 splits
// 256-bit lane-crossing ones into many micro-ops), so one version serves all.
void transpose_block(const float* src, int64_t row_stride, int cols, int width, float* dst,
                     int col0) {
  int j = 0;
#if defined(__SSE2__)
  for (; j + 4 <= cols; j += 4) {
    const float* s = src + j * row_stride;
    float* out = dst + col0 + j;
    int d = 0;
    for (; d + 4 <= width; d += 4) {
      __m128 r0 = _mm_loadu_ps(s + d), r1 = _mm_loadu_ps(s + row_stride + d),
             r2 = _mm_loadu_ps(s + 2 * row_stride + d), r3 = _mm_loadu_ps(s + 3 * row_stride + d);
      _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
      _mm_storeu_ps(out + static_cast<int64_t>(d) * kBlockK, r0);
      _mm_storeu_ps(out + static_cast<int64_t>(d + 1) * kBlockK, r1);
      _mm_storeu_ps(out + static_cast<int64_t>(d + 2) * kBlockK, r2);
      _mm_storeu_ps(out + static_cast<int64_t>(d + 3) * kBlockK, r3);
    }
    for (; d < width; ++d)  // head dims that are not multiples of 4
      for (int r = 0; r < 4; ++r) out[static_cast<int64_t>(d) * kBlockK + r] = s[r * row_stride + d];
  }
#endif
  for (; j < cols; ++j)  // the keys left (or every key without SSE)
    for (int d = 0; d < width; ++d)
      dst[static_cast<int64_t>(d) * kBlockK + col0 + j] = src[j * row_stride + d];
}

namespace {

// The two tile products, written once over a vector type V of W floats (GCC/Clang vector
// extensions) and a register block of R rows x C vectors, and instantiated per instruction
// set below with the block that fills its register file: the accumulators must stay in
// registers, and 16 AVX2 registers hold far fewer of them than 32 AVX-512 ones (one block
// shape for both spilled on AVX2).
#define FA_INLINE inline __attribute__((always_inline))

template <typename V>
FA_INLINE V load(const float* p) {
  V v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
template <typename V>
FA_INLINE void store(float* p, V v) {
  __builtin_memcpy(p, &v, sizeof v);
}
template <typename V>
constexpr int width = sizeof(V) / sizeof(float);

template <int Bytes>
struct IntVector;
template <>
struct IntVector<16> {
  using type = int32_t __attribute__((vector_size(16)));
};
template <>
struct IntVector<32> {
  using type = int32_t __attribute__((vector_size(32)));
};
template <>
struct IntVector<64> {
  using type = int32_t __attribute__((vector_size(64)));
};
template <typename V>
using IntOf = typename IntVector<sizeof(V)>::type;

template <typename V>
FA_INLINE V splat(float x) {
  return V{} + x;
}

// The exponentials of U vectors at once, each step of exp_in_range (exp_approx.hpp) taken
// for all U before the next: the steps of one vector form a chain of some 15 dependent
// operations (the polynomial alone 7 multiply-adds), so one vector at a time left the loop
// waiting on latency (about 32 cycles per 8 floats on Zen 1, 22 with U = 4, measured
// alone at 2.45 GHz). The same arithmetic, so the same results bit for bit, except that 2^n
// is built from the bits of the rounding sum t = x log2(e) + 1.5 * 2^23, whose low mantissa
// bits hold n, instead of converting n back to an integer (one operation fewer; the same n).
// kNonpositive: x <= 0 or -inf (exp_nonpositive), else any float (exp_approx).
template <typename V, int U, bool kNonpositive>
FA_INLINE void exp_lockstep(V (&x)[U]) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693145751953125f;
  constexpr float kLn2Lo = 1.42860682030941723e-6f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23
  using I = IntOf<V>;
  const V lo = splat<V>(-87.0f), hi = splat<V>(88.0f);
  V c[U], t[U], r[U], p[U];
  for (int u = 0; u < U; ++u) {
    if constexpr (kNonpositive)
      c[u] = x[u] >= lo ? x[u] : lo;
    else
      c[u] = x[u] >= lo ? (x[u] <= hi ? x[u] : hi) : lo;
  }
  for (int u = 0; u < U; ++u) t[u] = c[u] * kLog2e + kRound;
  for (int u = 0; u < U; ++u) {
    const V n = t[u] - kRound;
    r[u] = (c[u] - n * kLn2Hi) - n * kLn2Lo;
  }
  for (int u = 0; u < U; ++u) p[u] = r[u] * (1.0f / 5040.0f) + 1.0f / 720.0f;
  for (int u = 0; u < U; ++u) p[u] = p[u] * r[u] + 1.0f / 120.0f;
  for (int u = 0; u < U; ++u) p[u] = p[u] * r[u] + 1.0f / 24.0f;
  for (int u = 0; u < U; ++u) p[u] = p[u] * r[u] + 1.0f / 6.0f;
  for (int u = 0; u < U; ++u) p[u] = p[u] * r[u] + 0.5f;
  for (int u = 0; u < U; ++u) p[u] = p[u] * r[u] + 1.0f;
  for (int u = 0; u < U; ++u) p[u] = p[u] * r[u] + 1.0f;
  for (int u = 0; u < U; ++u) {
    I bits;
    __builtin_memcpy(&bits, &t[u], sizeof bits);
    bits = (bits + (127 - 0x4B400000)) << 23;  // (n + 127) << 23
    V scale;
    __builtin_memcpy(&scale, &bits, sizeof scale);
    const V result = p[u] * scale;
    if constexpr (kNonpositive) {
      x[u] = x[u] >= lo ? result : V{};
    } else {
      const V bounded = x[u] > hi ? splat<V>(std::numeric_limits<float>::infinity()) : result;
      x[u] = x[u] < lo ? V{} : (x[u] != x[u] ? x[u] : bounded);
    }
  }
}

// softmax_step (kernels.hpp) over vectors of W floats.
template <typename V>
FA_INLINE void softmax_row(float* scores, float* m, float* l, float* acc, int head_dim_v) {
  constexpr int W = width<V>;
  constexpr int U = 4;
  static_assert(kBlockK % (U * W) == 0, "a score row is a whole number of groups");
  constexpr float kInf = std::numeric_limits<float>::infinity();
  // One pass for the max (NaN skipped) and a probe sum, NaN if a score is NaN (or two are
  // opposite infinities): the fast exp below is wrong there.
  V vmax = splat<V>(-kInf), vprobe = V{};
  for (int j = 0; j < kBlockK; j += W) {
    const V x = load<V>(scores + j);
    vmax = x > vmax ? x : vmax;
    vprobe += x;
  }
  float block_max = -kInf, probe = 0.0f;
  for (int w = 0; w < W; ++w) {
    block_max = vmax[w] > block_max ? vmax[w] : block_max;
    probe += vprobe[w];
  }
  const float m_new = *m > block_max ? *m : block_max;
  // Nothing visible in this row yet: every probability is 0 and the row stays as it was.
  // The max skips NaN, so a block whose scores are all NaN (or NaN and masked) also lands
  // here: then the running sum becomes NaN, which poisons the row's out and lse, as in the
  // reference. (A block with some finite scores poisons the row through exp(NaN) below.)
  if (m_new == -kInf) {
    for (int j = 0; j < kBlockK; ++j) {
      if (scores[j] != scores[j]) *l = scores[j];
      scores[j] = 0.0f;
    }
    return;
  }
  V vsum[U] = {};
  const V shift = splat<V>(m_new);
  if (probe == probe && m_new != kInf) {
    // The common case: every score - m_new is <= 0 or -inf.
    for (int j = 0; j < kBlockK; j += U * W) {
      V x[U];
      for (int u = 0; u < U; ++u) x[u] = load<V>(scores + j + u * W) - shift;
      exp_lockstep<V, U, true>(x);
      for (int u = 0; u < U; ++u) {
        store(scores + j + u * W, x[u]);
        vsum[u] += x[u];
      }
    }
  } else {  // NaN (or inf - inf) poisons the row
    for (int j = 0; j < kBlockK; j += U * W) {
      V x[U];
      for (int u = 0; u < U; ++u) x[u] = load<V>(scores + j + u * W) - shift;
      exp_lockstep<V, U, false>(x);
      for (int u = 0; u < U; ++u) {
        store(scores + j + u * W, x[u]);
        vsum[u] += x[u];
      }
    }
  }
  const V total = (vsum[0] + vsum[1]) + (vsum[2] + vsum[3]);
  float sum = 0.0f;
  for (int w = 0; w < W; ++w) sum += total[w];
  const float alpha = exp_approx(*m - m_new);  // 0 when the row had seen nothing before
  *l = *l * alpha + sum;
  *m = m_new;
  if (alpha != 1.0f)
    for (int d = 0; d < head_dim_v; ++d) acc[d] *= alpha;
}

// backward_probabilities (kernels.hpp) over vectors of W floats.
template <typename V>
FA_INLINE void backward_probabilities_row(float* prob, float lse) {
  constexpr int W = width<V>;
  constexpr int U = 4;
  const V shift = splat<V>(lse);
  for (int j = 0; j < kBlockK; j += U * W) {
    V x[U];
    for (int u = 0; u < U; ++u) x[u] = load<V>(prob + j + u * W) - shift;
    exp_lockstep<V, U, false>(x);
    for (int u = 0; u < U; ++u) store(prob + j + u * W, x[u]);
  }
}

// The register block's rows for what is left after blocks of R rows: R / 2, except 4 after
// 6 (AVX2's block). 64 rows of a tile are 10 blocks of 6 and 4 rows: in blocks of 3 then 1,
// the single row's 2 chains of multiply-adds waited on the FMA latency (5 cycles on Zen 1),
// costing some 3 rows' time more; a 4-row block has 8 chains, enough for full speed.
constexpr int tail_rows(int R) { return R == 6 ? 4 : R / 2; }

// s[r][c0 + x] = sum_d q[r][d] * kt[d][c0 + x] for r < R, x < C * W.
template <typename V, int R, int C>
FA_INLINE void score_block(const float* q, const float* kt, float* s, int head_dim, int c0) {
  constexpr int W = width<V>;
  V a[R][C] = {};
  for (int d = 0; d < head_dim; ++d) {
    V k[C];
    for (int c = 0; c < C; ++c) k[c] = load<V>(kt + static_cast<int64_t>(d) * kBlockK + c0 + c * W);
    for (int r = 0; r < R; ++r) {
      // A scalar times a vector: the compiler broadcasts it straight from memory.
      const float x = q[static_cast<int64_t>(r) * head_dim + d];
      for (int c = 0; c < C; ++c) a[r][c] += x * k[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) store(s + static_cast<int64_t>(r) * kBlockK + c0 + c * W, a[r][c]);
}

template <typename V, int R, int C>
FA_INLINE void score_tile_blocked(const float* q, const float* kt, float* s, int rows,
                                  int head_dim) {
  constexpr int kCols = C * width<V>;
  static_assert(kBlockK % kCols == 0, "a score row is a whole number of column blocks");
  int i = 0;
  for (; i + R <= rows; i += R)
    for (int c0 = 0; c0 < kBlockK; c0 += kCols)
      score_block<V, R, C>(q + static_cast<int64_t>(i) * head_dim, kt,
                           s + static_cast<int64_t>(i) * kBlockK, head_dim, c0);
  // Fewer than R rows left (a short block, or decoding's few query heads per key head): in
  // blocks of fewer rows (tail_rows), down to single rows.
  if constexpr (R > 1)
    if (i < rows)
      score_tile_blocked<V, tail_rows(R), C>(q + static_cast<int64_t>(i) * head_dim, kt,
                                      s + static_cast<int64_t>(i) * kBlockK, rows - i, head_dim);
}

// acc[r][d0 + x] += sum_{j < cols, p[r][j] != 0} p[r][j] * v[j][d0 + x] for r < R,
// x < C * W. A probability of exactly 0 is a masked key (or one whose weight underflowed):
// such keys are skipped, as in the reference, so that a masked value row holding Inf or NaN
// cannot leak into the output. kSkipZeros: the rows hold a 0 somewhere (else the loop runs
// without the test: the common case, and what keeps the sums in registers).
template <typename V, int R, int C, bool kSkipZeros>
FA_INLINE void pv_block(Weights p, const float* v, int64_t v_row_stride, float* acc,
                        int64_t acc_row_stride, int cols, int d0) {
  constexpr int W = width<V>;
  V a[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      a[r][c] = load<V>(acc + r * acc_row_stride + d0 + c * W);
  for (int j = 0; j < cols; ++j) {
    V vj[C];
    for (int c = 0; c < C; ++c) vj[c] = load<V>(v + j * v_row_stride + d0 + c * W);
    for (int r = 0; r < R; ++r) {
      const float x = p.data[r * p.row_stride + j * p.col_stride];
      if (kSkipZeros && x == 0.0f) continue;
      for (int c = 0; c < C; ++c) a[r][c] += x * vj[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      store(acc + r * acc_row_stride + d0 + c * W, a[r][c]);
}

// The rows [i, i + R) of accumulate_pv over every output column: blocks of C vectors, then
// single vectors, then single floats (head dims that are not multiples of W).
template <typename V, int R, int C, bool kSkipZeros>
FA_INLINE void pv_columns(Weights p, const float* v, int64_t v_row_stride, float* acc,
                          int64_t acc_row_stride, int cols, int head_dim_v) {
  constexpr int W = width<V>;
  int d0 = 0;
  for (; d0 + C * W <= head_dim_v; d0 += C * W)
    pv_block<V, R, C, kSkipZeros>(p, v, v_row_stride, acc, acc_row_stride, cols, d0);
  for (; d0 + W <= head_dim_v; d0 += W)
    pv_block<V, R, 1, kSkipZeros>(p, v, v_row_stride, acc, acc_row_stride, cols, d0);
  for (int r = 0; r < R && d0 < head_dim_v; ++r) {
    float* out = acc + r * acc_row_stride;
    for (int j = 0; j < cols; ++j) {
      const float x = p.data[r * p.row_stride + j * p.col_stride];
      if (x == 0.0f) continue;
      const float* vj = v + j * v_row_stride;
      for (int d = d0; d < head_dim_v; ++d) out[d] += x * vj[d];
    }
  }
}

template <typename V, int R, int C>
FA_INLINE void pv_rows(Weights p, const float* v, int64_t v_row_stride, float* acc,
                       int64_t acc_row_stride, int cols, int head_dim_v) {
  int zeros = 0;  // a count, not a bool: an integer sum vectorises
  if (!p.no_zeros)  // else the caller knows that there are none (see Weights)
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < cols; ++j) zeros += p.data[r * p.row_stride + j * p.col_stride] == 0.0f;
  if (zeros != 0)
    pv_columns<V, R, C, true>(p, v, v_row_stride, acc, acc_row_stride, cols, head_dim_v);
  else
    pv_columns<V, R, C, false>(p, v, v_row_stride, acc, acc_row_stride, cols, head_dim_v);
}

template <typename V, int R, int C>
FA_INLINE void accumulate_pv_blocked(Weights p, const float* v, int64_t v_row_stride, float* acc,
                                     int64_t acc_row_stride, int rows, int cols,
                                     int head_dim_v) {
  const auto rows_from = [&](int i) {
    return Weights{p.data + i * p.row_stride, p.row_stride, p.col_stride, p.no_zeros};
  };
  int i = 0;
  for (; i + R <= rows; i += R)
    pv_rows<V, R, C>(rows_from(i), v, v_row_stride, acc + i * acc_row_stride, acc_row_stride,
                     cols, head_dim_v);
  if constexpr (R > 1)  // the rows left: as in score_tile_blocked
    if (i < rows)
      accumulate_pv_blocked<V, tail_rows(R), C>(rows_from(i), v, v_row_stride, acc + i * acc_row_stride,
                                         acc_row_stride, rows - i, cols, head_dim_v);
}

using Float4 = float __attribute__((vector_size(16)));
using Float8 = float __attribute__((vector_size(32)));
using Float16 = float __attribute__((vector_size(64)));

template <typename V>
void backward_probabilities_variant(float* prob, float lse) {
  backward_probabilities_row<V>(prob, lse);
}
template <typename V>
void softmax_step_variant(float* scores, float* m, float* l, float* acc, int head_dim_v) {
  softmax_row<V>(scores, m, l, acc, head_dim_v);
}

// The dot product in double over vectors VD of doubles: four accumulators, each lane a
// running sum of every (4 * lanes)-th product, added up at the end in a fixed order.
template <typename VD>
FA_INLINE double dot_double_blocked(const float* a, const float* b, int n) {
  constexpr int L = sizeof(VD) / sizeof(double);
  VD acc[4] = {};
  int d = 0;
  for (; d + 4 * L <= n; d += 4 * L)
    for (int u = 0; u < 4; ++u) {
      VD x, y;
      for (int l = 0; l < L; ++l) {
        x[l] = static_cast<double>(a[d + u * L + l]);
        y[l] = static_cast<double>(b[d + u * L + l]);
      }
      acc[u] += x * y;
    }
  const VD v = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  double sum = 0.0;
  for (int l = 0; l < L; ++l) sum += v[l];
  for (; d < n; ++d) sum += static_cast<double>(a[d]) * static_cast<double>(b[d]);
  return sum;
}

using Double2 = double __attribute__((vector_size(16)));
using Double4 = double __attribute__((vector_size(32)));
using Double8 = double __attribute__((vector_size(64)));

using ScoreTile = void (*)(const float*, const float*, float*, int, int);
using DotDouble = double (*)(const float*, const float*, int);
using BackwardProbabilities = void (*)(float*, float);
using SoftmaxStep = void (*)(float*, float*, float*, float*, int);
using AccumulatePv = void (*)(Weights, const float*, int64_t, float*, int64_t, int, int, int);

// One variant per instruction set, with the register block that fills its register file:
// AVX-512 8 rows x 2 vectors (16 of 32 registers hold sums), AVX2 6 x 2 (12 of 16), SSE2
// 4 x 2 (8 of 16).
template <typename V, int R, int C>
void score_tile_variant(const float* q, const float* kt, float* s, int rows, int head_dim) {
  score_tile_blocked<V, R, C>(q, kt, s, rows, head_dim);
}
template <typename V, int R, int C>
void accumulate_pv_variant(Weights p, const float* v, int64_t v_row_stride, float* acc,
                           int64_t acc_row_stride, int rows, int cols, int head_dim_v) {
  accumulate_pv_blocked<V, R, C>(p, v, v_row_stride, acc, acc_row_stride, rows, cols,
                                 head_dim_v);
}

template <typename VD>
double dot_double_variant(const float* a, const float* b, int n) {
  return dot_double_blocked<VD>(a, b, n);
}

struct TileProducts {
  ScoreTile score_tile;
  AccumulatePv accumulate_pv;
  BackwardProbabilities backward_probabilities;
  DotDouble dot_double;
  SoftmaxStep softmax_step;
};

#if defined(__x86_64__) && defined(__GNUC__) && !defined(FLASHATTN_NO_MULTIVERSION)
// Compiled for their instruction sets by the target attribute, chosen at the first call from
// what the processor reports. Not function multiversioning: its load-time resolvers (ifuncs)
// crash in sanitizer builds, where the resolver is instrumented before the sanitizer runs.
#define FA_TARGET(isa) __attribute__((target(isa)))
FA_TARGET("avx512f,avx2,fma")
void score_tile_avx512(const float* q, const float* kt, float* s, int rows, int head_dim) {
  score_tile_blocked<Float16, 8, 2>(q, kt, s, rows, head_dim);
}
FA_TARGET("avx512f,avx2,fma")
void accumulate_pv_avx512(Weights p, const float* v, int64_t v_row_stride, float* acc,
                          int64_t acc_row_stride, int rows, int cols, int head_dim_v) {
  accumulate_pv_blocked<Float16, 8, 2>(p, v, v_row_stride, acc, acc_row_stride, rows, cols,
                                       head_dim_v);
}
FA_TARGET("avx2,fma")
void score_tile_avx2(const float* q, const float* kt, float* s, int rows, int head_dim) {
  score_tile_blocked<Float8, 6, 2>(q, kt, s, rows, head_dim);
}
FA_TARGET("avx2,fma")
void accumulate_pv_avx2(Weights p, const float* v, int64_t v_row_stride, float* acc,
                        int64_t acc_row_stride, int rows, int cols, int head_dim_v) {
  accumulate_pv_blocked<Float8, 6, 2>(p, v, v_row_stride, acc, acc_row_stride, rows, cols,
                                      head_dim_v);
}

FA_TARGET("avx512f,avx2,fma")
void backward_probabilities_avx512(float* prob, float lse) {
  backward_probabilities_row<Float16>(prob, lse);
}
FA_TARGET("avx2,fma")
void backward_probabilities_avx2(float* prob, float lse) {
  backward_probabilities_row<Float8>(prob, lse);
}
FA_TARGET("avx512f,avx2,fma")
void softmax_step_avx512(float* scores, float* m, float* l, float* acc, int head_dim_v) {
  softmax_row<Float16>(scores, m, l, acc, head_dim_v);
}
FA_TARGET("avx2,fma")
void softmax_step_avx2(float* scores, float* m, float* l, float* acc, int head_dim_v) {
  softmax_row<Float8>(scores, m, l, acc, head_dim_v);
}

FA_TARGET("avx512f,avx2,fma")
double dot_double_avx512(const float* a, const float* b, int n) {
  return dot_double_blocked<Double8>(a, b, n);
}
FA_TARGET("avx2,fma")
double dot_double_avx2(const float* a, const float* b, int n) {
  return dot_double_blocked<Double4>(a, b, n);
}

TileProducts pick_tile_products() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f"))
    return {score_tile_avx512, accumulate_pv_avx512, backward_probabilities_avx512,
            dot_double_avx512, softmax_step_avx512};
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    return {score_tile_avx2, accumulate_pv_avx2, backward_probabilities_avx2, dot_double_avx2,
            softmax_step_avx2};
  return {score_tile_variant<Float4, 4, 2>, accumulate_pv_variant<Float4, 4, 2>,
          backward_probabilities_variant<Float4>, dot_double_variant<Double2>,
          softmax_step_variant<Float4>};
}
#else
TileProducts pick_tile_products() {
  return {score_tile_variant<Float4, 4, 2>, accumulate_pv_variant<Float4, 4, 2>,
          backward_probabilities_variant<Float4>, dot_double_variant<Double2>,
          softmax_step_variant<Float4>};
}
#endif

const TileProducts& tile_products() {
  static const TileProducts chosen = pick_tile_products();
  return chosen;
}

}  // namespace

void score_tile(const float* q, const float* kt, float* s, int rows, int head_dim) {
  tile_products().score_tile(q, kt, s, rows, head_dim);
}

double dot_double(const float* a, const float* b, int n) {
  return tile_products().dot_double(a, b, n);
}

void softmax_step(float* scores, float* m, float* l, float* acc, int head_dim_v) {
  tile_products().softmax_step(scores, m, l, acc, head_dim_v);
}

void backward_probabilities(float* prob, float lse) {
  tile_products().backward_probabilities(prob, lse);
}

void accumulate_pv(Weights p, const float* v, int64_t v_row_stride, float* acc,
                   int64_t acc_row_stride, int rows, int cols, int head_dim_v) {
  tile_products().accumulate_pv(p, v, v_row_stride, acc, acc_row_stride, rows, cols, head_dim_v);
}

}  // namespace flashattn::detail::cpu

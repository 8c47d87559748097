#include "cpu/kernels.hpp"

#include "cpu/avx512_math.hpp"
#include "cpu/exp_approx.hpp"

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__SSE2__)
#include <immintrin.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#endif
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
#if defined(__x86_64__) && defined(__GNUC__) && !defined(FLASHATTN_NO_MULTIVERSION)
namespace {
// AVX-512: 16 x 16 blocks, a 64-byte store per 16 floats (SSE's 4 x 4 blocks store 16 bytes per
// 4): the fp32 forward's key transposes were 7 % of its time at head dim 128.
__attribute__((target("avx512f"))) void transpose_block_avx512(const float* src, int64_t row_stride,
                                                              int cols, int width, float* dst,
                                                              int col0) {
  for (int j = 0; j + 16 <= cols; j += 16)
    for (int d = 0; d < width; d += 16) {
      __m512i r[16];
      avx512::load_transposed16(src + j * row_stride + d, row_stride, r);
      for (int k = 0; k < 16; ++k)
        _mm512_storeu_ps(dst + static_cast<int64_t>(d + k) * kBlockK + col0 + j,
                         _mm512_castsi512_ps(r[k]));
    }
}
bool has_avx512f() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  return has;
}
}  // namespace
#endif

void transpose_block(const float* src, int64_t row_stride, int cols, int width, float* dst,
                     int col0) {
  int j = 0;
#if defined(__x86_64__) && defined(__GNUC__) && !defined(FLASHATTN_NO_MULTIVERSION)
  if (width % 16 == 0 && cols >= 16 && has_avx512f()) {
    j = cols / 16 * 16;
    transpose_block_avx512(src, row_stride, j, width, dst, col0);
  }
#endif
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

// ---- Decode products (kernels.hpp): cache rows converted as they are loaded ----

#if defined(__x86_64__) && defined(__GNUC__) && !defined(FLASHATTN_NO_MULTIVERSION)
// F16C (every AVX2 processor) and AVX-512F convert 8 or 16 halves in one instruction. Functions
// of their own with the target attribute, inlined into the variants compiled for those targets
// (an intrinsic called from the generic template would be checked against the default target).
// Vectors pass through pointers: clang refuses a vector argument or result wider than the
// caller's default target allows (it would change the ABI), inlined or not.
__attribute__((target("avx512f"))) inline void halves16(const half_t* p, Float16* out) {
  // The zero-masked form: GCC 12 warns of the plain one's undefined pass-through operand.
  const __m512 x =
      _mm512_maskz_cvtph_ps(0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  __builtin_memcpy(out, &x, sizeof *out);
}
__attribute__((target("avx,f16c"))) inline void halves8(const half_t* p, Float8* out) {
  const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  __builtin_memcpy(out, &x, sizeof *out);
}
#endif

// W elements of an fp32 or fp16 cache row as fp32 lanes.
template <typename V>
FA_INLINE V load_as(const float* p) {
  return load<V>(p);
}
template <typename V>
FA_INLINE V load_as(const half_t* p) {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(FLASHATTN_NO_MULTIVERSION)
  // Only the variants compiled for AVX-512 and AVX2 + F16C instantiate these branches.
  V v;
  if constexpr (sizeof(V) == 64) {
    halves16(p, &v);
    return v;
  } else if constexpr (sizeof(V) == 32) {
    halves8(p, &v);
    return v;
  }
#else
  V v;
#endif
  for (int i = 0; i < width<V>; ++i) v[i] = to_float(p[i]);
  return v;
}

// W 32-bit lanes (GCC takes no vector_size that depends on a template argument, hence one
// specialisation per width).
template <int W>
struct WordLanes;
template <>
struct WordLanes<4> {
  using U32 = uint32_t __attribute__((vector_size(16)));
};
template <>
struct WordLanes<8> {
  using U32 = uint32_t __attribute__((vector_size(32)));
};
template <>
struct WordLanes<16> {
  using U32 = uint32_t __attribute__((vector_size(64)));
};

// 2W bf16 elements of a cache row as two vectors: the even-indexed elements and the
// odd-indexed ones. Each 32-bit lane holds an (even, odd) pair: even = the lane shifted up,
// odd = its high half masked. One instruction per W floats where widening takes two (on Zen 1
// the widening also competes with the multiply-adds for their pipes): +9 % for the scores'
// loop alone. The decode products keep bf16 in this order (decode_bf16_group).
template <typename V>
FA_INLINE void load_bf16_pairs(const bfloat16_t* p, V& even, V& odd) {
  using U32 = typename WordLanes<width<V>>::U32;
  U32 w;
  __builtin_memcpy(&w, p, sizeof w);
  const U32 e = w << 16, o = w & 0xFFFF0000u;
  __builtin_memcpy(&even, &e, sizeof even);
  __builtin_memcpy(&odd, &o, sizeof odd);
}

// out[k] = the sum of the lanes of a[k], k < K. AVX2: eight vectors at a time by a tree of
// horizontal adds (9 instructions for 8 sums, against some 5 per vector alone); AVX-512 folds
// each vector to 8 lanes first. Generic: lane by lane.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(FLASHATTN_NO_MULTIVERSION)
__attribute__((target("avx"))) inline void lane_sums8(const Float8* a, float* out) {
  __m256 x[8];
  __builtin_memcpy(x, a, sizeof x);
  const __m256 t0 = _mm256_hadd_ps(x[0], x[1]), t1 = _mm256_hadd_ps(x[2], x[3]);
  const __m256 t2 = _mm256_hadd_ps(x[4], x[5]), t3 = _mm256_hadd_ps(x[6], x[7]);
  // u0 = (a0 a1 a2 a3 of the low lanes | the same of the high lanes), u1 likewise for a4-a7;
  // their halves added by 128-bit extracts (Zen 1 splits a lane-crossing permute into 8 uops).
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(u0), _mm256_extractf128_ps(u0, 1)));
  _mm_storeu_ps(out + 4, _mm_add_ps(_mm256_castps256_ps128(u1), _mm256_extractf128_ps(u1, 1)));
}
__attribute__((target("avx"))) inline float lane_sum8(const Float8* a) {
  __m256 x;
  __builtin_memcpy(&x, a, sizeof x);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}
__attribute__((target("avx512f"))) inline void fold16(const Float16& a, Float8* out) {
  // The halves lane by lane (GCC makes one extract of it). Not intrinsics: GCC 12 warns inside
  // its own _mm512_castps512_ps256; not a copy through memory: with part of the caller's sums
  // read through their address, GCC kept every sum in memory in the multiply-add loop.
  const Float8 lo = {a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]};
  const Float8 hi = {a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15]};
  *out = lo + hi;
}
#endif

template <typename V, int K>
FA_INLINE void lane_sums(const V (&a)[K], float* out) {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(FLASHATTN_NO_MULTIVERSION)
  if constexpr (sizeof(V) == 32 || sizeof(V) == 64) {
    Float8 f[K];
    for (int k = 0; k < K; ++k) {
      if constexpr (sizeof(V) == 64)
        fold16(a[k], &f[k]);
      else
        f[k] = a[k];
    }
    int k = 0;
    for (; k + 8 <= K; k += 8) lane_sums8(f + k, out + k);
    for (; k < K; ++k) out[k] = lane_sum8(&f[k]);
    return;
  }
#endif
  for (int k = 0; k < K; ++k) {
    float sum = 0.0f;
    for (int w = 0; w < width<V>; ++w) sum += a[k][w];
    out[k] = sum;
  }
}

// Keeps v in a register: GCC otherwise folds the load of a query row into each of the N
// multiply-adds that use it, N loads where one does (on Zen 1 that made the scores' loop
// bound by its loads: two 128-bit loads a cycle, against one 256-bit multiply-add).
template <typename V>
FA_INLINE void in_register(V& v) {
#if defined(__x86_64__) && defined(__GNUC__)
  asm("" : "+v"(v));
#else
  (void)v;
#endif
}

// sums[r * n + x] += the products of q row r and key x over [d, head_dim).
template <typename T>
__attribute__((noinline)) void add_dot_tails(const float* q, int head_dim, const T* k,
                                             int64_t k_row_stride, int rows, int n, int d,
                                             float* sums) {
  for (int r = 0; r < rows; ++r)
    for (int x = 0; x < n; ++x)
      for (int e = d; e < head_dim; ++e)
        sums[r * n + x] += q[static_cast<int64_t>(r) * head_dim + e] * to_float(k[x * k_row_stride + e]);
}

// The scores of R query rows against N keys: R x N dot products, each along the head dim in
// W-wide partial sums (R x N chains of multiply-adds: enough to hide the FMA latency), then
// the lanes added, then the elements past the last whole vector.
template <typename V, typename T, int R, int N>
FA_INLINE void decode_dot_block(const float* q, int head_dim, const T* k, int64_t k_row_stride,
                                float* s, int64_t s_row_stride) {
  constexpr int W = width<V>;
  V a[R * N];
  for (int i = 0; i < R * N; ++i) a[i] = V{};
  int d = 0;
  if constexpr (std::is_same_v<T, bfloat16_t>) {
    // Groups of 2W: the query rows are in the even/odd order (decode_bf16_group).
    for (; d + 2 * W <= head_dim; d += 2 * W) {
      V even[N], odd[N];
      for (int x = 0; x < N; ++x) load_bf16_pairs(k + x * k_row_stride + d, even[x], odd[x]);
      for (int r = 0; r < R; ++r) {
        V qe = load<V>(q + static_cast<int64_t>(r) * head_dim + d);
        V qo = load<V>(q + static_cast<int64_t>(r) * head_dim + d + W);
        in_register(qe);
        in_register(qo);
        for (int x = 0; x < N; ++x) a[r * N + x] += qe * even[x];
        for (int x = 0; x < N; ++x) a[r * N + x] += qo * odd[x];
      }
    }
  } else {
    for (; d + W <= head_dim; d += W) {
      V kx[N];
      for (int x = 0; x < N; ++x) kx[x] = load_as<V>(k + x * k_row_stride + d);
      for (int r = 0; r < R; ++r) {
        V qr = load<V>(q + static_cast<int64_t>(r) * head_dim + d);
        in_register(qr);
        for (int x = 0; x < N; ++x) a[r * N + x] += qr * kx[x];
      }
    }
  }
  float sums[R * N];
  lane_sums(a, sums);
  if (d < head_dim)  // head dims that are not a multiple of W: out of line, to keep this short
    add_dot_tails(q, head_dim, k, k_row_stride, R, N, d, sums);
  for (int r = 0; r < R; ++r)
    for (int x = 0; x < N; ++x) s[r * s_row_stride + x] = sums[r * N + x];
}

// decode_scores over blocks of R rows x N keys; the rows left in blocks of R / 2 rows x 2N
// keys (as many chains), down to single rows.
template <typename V, typename T, int R, int N>
FA_INLINE void decode_scores_blocked(const float* q, int rows, int head_dim, const T* k,
                                     int64_t k_row_stride, int keys, float* s,
                                     int64_t s_row_stride) {
  int i = 0;
  for (; i + R <= rows; i += R) {
    const float* qi = q + static_cast<int64_t>(i) * head_dim;
    float* si = s + i * s_row_stride;
    int x = 0;
    for (; x + N <= keys; x += N)
      decode_dot_block<V, T, R, N>(qi, head_dim, k + x * k_row_stride, k_row_stride, si + x,
                                   s_row_stride);
    for (; x < keys; ++x)
      decode_dot_block<V, T, R, 1>(qi, head_dim, k + x * k_row_stride, k_row_stride, si + x,
                                   s_row_stride);
  }
  if constexpr (R > 1)
    if (i < rows)
      decode_scores_blocked<V, T, R / 2, N * 2>(q + static_cast<int64_t>(i) * head_dim, rows - i,
                                                head_dim, k, k_row_stride, keys,
                                                s + i * s_row_stride, s_row_stride);
}

// acc[r][d0 + x] += sum_j p[r][j] * v[j][d0 + x] for r < R, x < C * W (zero weights skipped
// when kSkipZeros), the R x C sums held in registers over all `keys` rows of v.
template <typename V, typename T, int R, int C, bool kSkipZeros>
FA_INLINE void decode_pv_block(const float* p, int64_t p_row_stride, const T* v,
                               int64_t v_row_stride, int keys, float* acc,
                               int64_t acc_row_stride, int d0) {
  constexpr int W = width<V>;
  V a[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = load<V>(acc + r * acc_row_stride + d0 + c * W);
  for (int j = 0; j < keys; ++j) {
    V vj[C];
    if constexpr (std::is_same_v<T, bfloat16_t>) {  // C / 2 groups in the even/odd order
      static_assert(C % 2 == 0, "bf16 columns come in even/odd pairs of vectors");
      for (int c = 0; c < C; c += 2)
        load_bf16_pairs(v + j * v_row_stride + d0 + c * W, vj[c], vj[c + 1]);
    } else {
      for (int c = 0; c < C; ++c) vj[c] = load_as<V>(v + j * v_row_stride + d0 + c * W);
    }
    for (int r = 0; r < R; ++r) {
      const float w = p[r * p_row_stride + j];
      if (kSkipZeros && w == 0.0f) continue;
      for (int c = 0; c < C; ++c) a[r][c] += w * vj[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) store(acc + r * acc_row_stride + d0 + c * W, a[r][c]);
}

template <typename V, typename T, int R, int C, bool kSkipZeros>
FA_INLINE void decode_pv_columns(const float* p, int64_t p_row_stride, const T* v,
                                 int64_t v_row_stride, int keys, float* acc,
                                 int64_t acc_row_stride, int head_dim_v) {
  constexpr int W = width<V>;
  // bf16 goes a group (two vectors) at a time: the accumulators are in its even/odd order.
  constexpr int kStep = std::is_same_v<T, bfloat16_t> ? 2 : 1;
  int d0 = 0;
  for (; d0 + C * W <= head_dim_v; d0 += C * W)
    decode_pv_block<V, T, R, C, kSkipZeros>(p, p_row_stride, v, v_row_stride, keys, acc,
                                            acc_row_stride, d0);
  for (; d0 + kStep * W <= head_dim_v; d0 += kStep * W)
    decode_pv_block<V, T, R, kStep, kSkipZeros>(p, p_row_stride, v, v_row_stride, keys, acc,
                                                acc_row_stride, d0);
  for (int r = 0; r < R && d0 < head_dim_v; ++r) {
    float* out = acc + r * acc_row_stride;
    for (int j = 0; j < keys; ++j) {
      const float w = p[r * p_row_stride + j];
      if (w == 0.0f) continue;
      const T* vj = v + j * v_row_stride;
      for (int d = d0; d < head_dim_v; ++d) out[d] += w * to_float(vj[d]);
    }
  }
}

// decode_accumulate_pv over blocks of R rows x C vectors; the rows left in blocks of R / 2
// rows x 2C vectors, down to single rows.
template <typename V, typename T, int R, int C>
FA_INLINE void decode_pv_blocked(const float* p, int64_t p_row_stride, int rows, const T* v,
                                 int64_t v_row_stride, int keys, float* acc,
                                 int64_t acc_row_stride, int head_dim_v) {
  int i = 0;
  for (; i + R <= rows; i += R) {
    const float* pi = p + i * p_row_stride;
    int zeros = 0;  // a count, not a bool: an integer sum vectorises
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < keys; ++j) zeros += pi[r * p_row_stride + j] == 0.0f;
    if (zeros != 0)
      decode_pv_columns<V, T, R, C, true>(pi, p_row_stride, v, v_row_stride, keys,
                                          acc + i * acc_row_stride, acc_row_stride, head_dim_v);
    else
      decode_pv_columns<V, T, R, C, false>(pi, p_row_stride, v, v_row_stride, keys,
                                           acc + i * acc_row_stride, acc_row_stride, head_dim_v);
  }
  if constexpr (R > 1)
    if (i < rows)
      decode_pv_blocked<V, T, R / 2, C * 2>(p + i * p_row_stride, p_row_stride, rows - i, v,
                                            v_row_stride, keys, acc + i * acc_row_stride,
                                            acc_row_stride, head_dim_v);
}

template <typename V, typename T, int R, int N>
void decode_scores_variant(const float* q, int rows, int head_dim, const T* k,
                           int64_t k_row_stride, int keys, float* s, int64_t s_row_stride) {
  decode_scores_blocked<V, T, R, N>(q, rows, head_dim, k, k_row_stride, keys, s, s_row_stride);
}
template <typename V, typename T, int R, int C>
void decode_pv_variant(const float* p, int64_t p_row_stride, int rows, const T* v,
                       int64_t v_row_stride, int keys, float* acc, int64_t acc_row_stride,
                       int head_dim_v) {
  decode_pv_blocked<V, T, R, C>(p, p_row_stride, rows, v, v_row_stride, keys, acc,
                                acc_row_stride, head_dim_v);
}

template <typename T>
using DecodeScores = void (*)(const float*, int, int, const T*, int64_t, int, float*, int64_t);
template <typename T>
using DecodePv = void (*)(const float*, int64_t, int, const T*, int64_t, int, float*, int64_t, int);

struct DecodeProducts {
  int bf16_group;  // decode_bf16_group: 2W of the variant
  DecodeScores<float> scores_f32;
  DecodeScores<bfloat16_t> scores_bf16;
  DecodeScores<half_t> scores_f16;
  DecodePv<float> pv_f32;
  DecodePv<bfloat16_t> pv_bf16;
  DecodePv<half_t> pv_f16;
};

// The portable variant: SSE2 (4 rows x 2 keys, 4 rows x 2 vectors: 8 of 16 registers hold
// sums).
DecodeProducts generic_decode_products() {
  return {8, decode_scores_variant<Float4, float, 4, 2>,      decode_scores_variant<Float4, bfloat16_t, 4, 2>,
          decode_scores_variant<Float4, half_t, 4, 2>,     decode_pv_variant<Float4, float, 4, 2>,
          decode_pv_variant<Float4, bfloat16_t, 4, 2>,     decode_pv_variant<Float4, half_t, 4, 2>};
}

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

// AVX-512: the exponential by exp2 and VSCALEFPS (cpu/avx512_math.hpp), a third fewer
// instructions than exp_lockstep's; rows with NaN or infinite scores keep the exact step.
FA_TARGET("avx512f,avx2,fma")
void backward_probabilities_avx512(float* prob, float lse) {
  avx512::probabilities(prob, lse, 1.0f);
}
FA_TARGET("avx2,fma")
void backward_probabilities_avx2(float* prob, float lse) {
  backward_probabilities_row<Float8>(prob, lse);
}
FA_TARGET("avx512f,avx2,fma")
void softmax_step_avx512(float* scores, float* m, float* l, float* acc, int head_dim_v) {
  if (!avx512::softmax_step(scores, m, l, acc, head_dim_v, 1.0f, scores))
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

// Decode products: AVX-512 4 rows x 4 keys and 4 rows x 4 vectors (16 of 32 registers hold
// sums); AVX2 4 x 2 and 4 x 2 (8 of 16: the keys' or values' vectors and a query row or
// weight take most of the rest). F16C converts fp16 caches (every AVX2 processor has it).
#define FA_DECODE_VARIANTS(isa, suffix, V, RS, NS, RP, CP)                                     \
  template <typename T>                                                                      \
  FA_TARGET(isa)                                                                             \
  void decode_scores_##suffix(const float* q, int rows, int head_dim, const T* k,            \
                              int64_t k_row_stride, int keys, float* s, int64_t s_row_stride) { \
    decode_scores_blocked<V, T, RS, NS>(q, rows, head_dim, k, k_row_stride, keys, s,         \
                                        s_row_stride);                                       \
  }                                                                                          \
  template <typename T>                                                                      \
  FA_TARGET(isa)                                                                             \
  void decode_pv_##suffix(const float* p, int64_t p_row_stride, int rows, const T* v,        \
                          int64_t v_row_stride, int keys, float* acc, int64_t acc_row_stride, \
                          int head_dim_v) {                                                  \
    decode_pv_blocked<V, T, RP, CP>(p, p_row_stride, rows, v, v_row_stride, keys, acc,       \
                                    acc_row_stride, head_dim_v);                             \
  }                                                                                          \
  DecodeProducts decode_products_##suffix() {                                                \
    return {2 * width<V>, decode_scores_##suffix<float>, decode_scores_##suffix<bfloat16_t>,               \
            decode_scores_##suffix<half_t>, decode_pv_##suffix<float>,                       \
            decode_pv_##suffix<bfloat16_t>, decode_pv_##suffix<half_t>};                     \
  }
FA_DECODE_VARIANTS("avx512f,avx2,fma,f16c", avx512, Float16, 4, 4, 4, 4)
FA_DECODE_VARIANTS("avx2,fma,f16c", avx2, Float8, 4, 2, 4, 2)
#undef FA_DECODE_VARIANTS

// F16C from CPUID leaf 1 (ECX bit 29): clang's __builtin_cpu_supports does not know "f16c".
bool has_f16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C) != 0;
}

DecodeProducts pick_decode_products() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return decode_products_avx512();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && has_f16c())
    return decode_products_avx2();
  return generic_decode_products();
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
DecodeProducts pick_decode_products() { return generic_decode_products(); }

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

const DecodeProducts& decode_products() {
  static const DecodeProducts chosen = pick_decode_products();
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

int decode_bf16_group() { return decode_products().bf16_group; }

void decode_scores(const float* q, int rows, int head_dim, const float* k, int64_t k_row_stride,
                   int keys, float* s, int64_t s_row_stride) {
  decode_products().scores_f32(q, rows, head_dim, k, k_row_stride, keys, s, s_row_stride);
}
void decode_scores(const float* q, int rows, int head_dim, const bfloat16_t* k,
                   int64_t k_row_stride, int keys, float* s, int64_t s_row_stride) {
  decode_products().scores_bf16(q, rows, head_dim, k, k_row_stride, keys, s, s_row_stride);
}
void decode_scores(const float* q, int rows, int head_dim, const half_t* k, int64_t k_row_stride,
                   int keys, float* s, int64_t s_row_stride) {
  decode_products().scores_f16(q, rows, head_dim, k, k_row_stride, keys, s, s_row_stride);
}

void decode_accumulate_pv(const float* p, int64_t p_row_stride, int rows, const float* v,
                          int64_t v_row_stride, int keys, float* acc, int64_t acc_row_stride,
                          int head_dim_v) {
  decode_products().pv_f32(p, p_row_stride, rows, v, v_row_stride, keys, acc, acc_row_stride,
                           head_dim_v);
}
void decode_accumulate_pv(const float* p, int64_t p_row_stride, int rows, const bfloat16_t* v,
                          int64_t v_row_stride, int keys, float* acc, int64_t acc_row_stride,
                          int head_dim_v) {
  decode_products().pv_bf16(p, p_row_stride, rows, v, v_row_stride, keys, acc, acc_row_stride,
                            head_dim_v);
}
void decode_accumulate_pv(const float* p, int64_t p_row_stride, int rows, const half_t* v,
                          int64_t v_row_stride, int keys, float* acc, int64_t acc_row_stride,
                          int head_dim_v) {
  decode_products().pv_f16(p, p_row_stride, rows, v, v_row_stride, keys, acc, acc_row_stride,
                           head_dim_v);
}

}  // namespace flashattn::detail::cpu

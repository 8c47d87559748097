// AMX bf16 tile products (cpu/amx.hpp). Compiled for the baseline like the rest of the
// library: only these functions carry the AMX and AVX-512 targets, and nothing calls them
// unless available() said the processor and the OS allow them.
#include "cpu/amx.hpp"

#include <cstring>
#include <limits>

#include "common/knobs.hpp"
#include "cpu/avx512_math.hpp"
#include "cpu/kernels.hpp"

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__) && !defined(FLASHATTN_NO_MULTIVERSION)
#define FLASHATTN_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace flashattn::detail::cpu::amx {

namespace {

constexpr int kTileWords = 256;  // a 16 x 16 tile of 32-bit words (16 rows x 64 bytes)

#ifdef FLASHATTN_AMX
bool tiles_allowed() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool amx_bf16 = (edx >> 22) & 1, amx_tile = (edx >> 24) & 1;
  if (!(amx_bf16 && amx_tile)) return false;
  // Linux hands out the 8 KiB of tile data state only on request, once per process.
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// AVX-512F and BW (with the OS saving the zmm state: __builtin_cpu_supports reads XCR0) and
// AVX512-BF16 (CPUID leaf 7, subleaf 1, EAX bit 5): the packing, the conversions and VDPBF16PS.
bool bf16_vectors_allowed() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  const bool avx512bf16 = __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && ((eax >> 5) & 1);
  return avx512bf16 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
}

Engine detect() {
  if (!bf16_vectors_allowed()) return Engine::None;
  return tiles_allowed() ? Engine::Tiles : Engine::DotProducts;
}
#endif

}  // namespace

Engine engine() {
#ifdef FLASHATTN_AMX
  static const Engine found = detect();  // the OS asked for the tile state once
  return found;
#else
  return Engine::None;
#endif
}

bool supported() { return engine() != Engine::None; }

bool available() { return supported() && knobs::cpu_amx_allowed(); }

void check_setting() { knobs::cpu_amx_allowed(); }

#ifdef FLASHATTN_AMX

// The tile instructions carry the AMX target; everything else (packing, conversions,
// VDPBF16PS) runs on either engine and carries only the AVX-512 ones.
#define FA_AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16")))
#define FA_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))

namespace {
struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");
}  // namespace

namespace {
FA_AMX_TARGET void load_tile_config() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = 16;
  }
  // LDTILECFG by hand: GCC 12's _tile_loadconfig names only 8 bytes of its operand as read,
  // so the stores that fill the other 56 were dropped (a #GP on a garbage configuration).
  asm volatile("ldtilecfg %0" : : "m"(config));
}

FA_AMX_TARGET void release_tile_state() { _tile_release(); }
}  // namespace

void configure_tiles() {
  if (engine() == Engine::Tiles) load_tile_config();
}

void release_tiles() {
  if (engine() == Engine::Tiles) release_tile_state();
}

FA_BF16_TARGET void pack_pairs_of_rows(const bfloat16_t* const* rows, int width, int outputs,
                                      uint16_t* dst) {
  const int groups = outputs / 16;
  for (int n0 = 0; n0 < outputs; n0 += 16)
    for (int c = 0; c < width / 32; ++c) {
      // The 16 outputs' pairs of chunk c, a row each; transposed, register k is the tile's row k.
      __m512i r[16];
      for (int n = 0; n < 16; ++n)
        r[n] = rows[n0 + n] != nullptr ? _mm512_loadu_si512(rows[n0 + n] + 32 * c)
                                       : _mm512_setzero_si512();
      avx512::transpose16(r);
      uint16_t* tile = dst + 2 * (c * groups + n0 / 16) * kTileWords;
      for (int k = 0; k < 16; ++k) _mm512_storeu_si512(tile + 32 * k, r[k]);
    }
}

FA_BF16_TARGET void pack_pairs_of_columns(const bfloat16_t* const* rows, int width, int reduced,
                                         uint16_t* dst) {
  const int groups = width / 16;
  // Word j of the result: element j of the even row, then element j of the odd row.
  alignas(64) static const uint16_t kLow[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i low = _mm512_load_si512(kLow);
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  for (int kp = 0; kp < reduced / 2; ++kp) {
    const bfloat16_t* even = rows[2 * kp];
    const bfloat16_t* odd = rows[2 * kp + 1];
    uint16_t* tile_row = dst + 2 * ((kp / 16) * groups * kTileWords + (kp % 16) * 16);
    for (int d = 0; d < width; d += 32) {
      const __m512i a = even != nullptr ? _mm512_loadu_si512(even + d) : _mm512_setzero_si512();
      const __m512i b = odd != nullptr ? _mm512_loadu_si512(odd + d) : _mm512_setzero_si512();
      // Columns d .. d + 15 are output group d / 16, d + 16 .. d + 31 the next one.
      _mm512_storeu_si512(tile_row + 2 * (d / 16) * kTileWords, _mm512_permutex2var_epi16(a, low, b));
      _mm512_storeu_si512(tile_row + 2 * (d / 16 + 1) * kTileWords, _mm512_permutex2var_epi16(a, high, b));
    }
  }
}

namespace {
// product() on tiles: 32 x 32 blocks of c in four accumulator tiles, two tiles of each
// operand per 32 reduced indices.
FA_AMX_TARGET void tile_product(const uint16_t* a, int64_t a_stride, const uint16_t* b, int rows,
                                int reduced, int outputs, float* c, int64_t c_stride,
                                bool accumulate, float scale) {
  const int groups = outputs / 16;
  const int64_t a_bytes = a_stride * 2, c_bytes = c_stride * 4;
  for (int r0 = 0; r0 < rows; r0 += 32) {
    for (int n0 = 0; n0 < outputs; n0 += 32) {
      float* c00 = c + r0 * c_stride + n0;
      float* c10 = c00 + 16 * c_stride;
      if (accumulate) {
        _tile_loadd(0, c00, c_bytes);
        _tile_loadd(1, c00 + 16, c_bytes);
        _tile_loadd(2, c10, c_bytes);
        _tile_loadd(3, c10 + 16, c_bytes);
      } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      }
      for (int k0 = 0; k0 < reduced; k0 += 32) {
        const uint16_t* b0 = b + 2 * ((k0 / 32) * groups + n0 / 16) * kTileWords;
        _tile_loadd(4, a + r0 * a_stride + k0, a_bytes);
        _tile_loadd(5, a + (r0 + 16) * a_stride + k0, a_bytes);
        _tile_loadd(6, b0, 64);
        _tile_loadd(7, b0 + 2 * kTileWords, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, c00, c_bytes);
      _tile_stored(1, c00 + 16, c_bytes);
      _tile_stored(2, c10, c_bytes);
      _tile_stored(3, c10 + 16, c_bytes);
      if (scale != 1.0f) {  // the 32 x 32 sums just stored, still in L1
        const __m512 factor = _mm512_set1_ps(scale);
        for (int r = 0; r < 32; ++r)
          for (int x = 0; x < 32; x += 16)
            _mm512_storeu_ps(c00 + r * c_stride + x,
                             _mm512_mul_ps(factor, _mm512_loadu_ps(c00 + r * c_stride + x)));
      }
    }
  }
}

// product() by VDPBF16PS (AVX512-BF16 without tiles): the packed operand's 32-bit words are
// already what the instruction takes, a pair of reduced indices per output lane, so a row of
// one 16 x 16 tile of words is the second operand of 16 outputs for one pair, and a's pair is
// broadcast to every lane. Blocks of 8 rows x 32 outputs: 16 accumulators, two loads of b
// and eight broadcasts of a (VPBROADCASTD from memory) per 16 dot products.
FA_BF16_TARGET void dot_product(const uint16_t* a, int64_t a_stride, const uint16_t* b, int rows,
                                int reduced, int outputs, float* c, int64_t c_stride,
                                bool accumulate, float scale) {
  constexpr int kRows = 8;
  const int groups = outputs / 16;
  const __m512 factor = _mm512_set1_ps(scale);
  for (int n0 = 0; n0 < outputs; n0 += 32)
    for (int r0 = 0; r0 < rows; r0 += kRows) {
      __m512 acc[kRows][2];
      float* c0 = c + r0 * c_stride + n0;
      // Every loop over the block unrolled, so that the accumulators stay in registers.
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 2
        for (int x = 0; x < 2; ++x)
          acc[r][x] = accumulate ? _mm512_loadu_ps(c0 + r * c_stride + 16 * x) : _mm512_setzero_ps();
      for (int k0 = 0; k0 < reduced; k0 += 32) {
        const uint16_t* b0 = b + 2 * ((k0 / 32) * groups + n0 / 16) * kTileWords;
        const uint16_t* a0 = a + r0 * a_stride + k0;
        for (int pair = 0; pair < 16; ++pair) {
          const __m512bh low = (__m512bh)_mm512_loadu_si512(b0 + 32 * pair);
          const __m512bh high = (__m512bh)_mm512_loadu_si512(b0 + 2 * kTileWords + 32 * pair);
#pragma GCC unroll 8
          for (int r = 0; r < kRows; ++r) {
            uint32_t word;
            std::memcpy(&word, a0 + r * a_stride + 2 * pair, sizeof word);
            const __m512bh broadcast = (__m512bh)_mm512_set1_epi32(static_cast<int>(word));
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], broadcast, low);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], broadcast, high);
          }
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 2
        for (int x = 0; x < 2; ++x)
          _mm512_storeu_ps(c0 + r * c_stride + 16 * x,
                           scale != 1.0f ? _mm512_mul_ps(factor, acc[r][x]) : acc[r][x]);
    }
}
}  // namespace

void product(const uint16_t* a, int64_t a_stride, const uint16_t* b, int rows, int reduced,
             int outputs, float* c, int64_t c_stride, bool accumulate, float scale) {
  if (engine() == Engine::Tiles)
    tile_product(a, a_stride, b, rows, reduced, outputs, c, c_stride, accumulate, scale);
  else
    dot_product(a, a_stride, b, rows, reduced, outputs, c, c_stride, accumulate, scale);
}

FA_BF16_TARGET void scale_to_bf16(const float* src, float factor, int n, uint16_t* dst) {
  const __m512 f = _mm512_set1_ps(factor);
  int i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_mul_ps(f, _mm512_loadu_ps(src + i)))));
  for (; i < n; ++i) {
    const bfloat16_t x = from_float<bfloat16_t>(factor * src[i]);
    dst[i] = x.bits;
  }
}

FA_BF16_TARGET void round_to_bf16(const float* src, int64_t n, uint16_t* dst) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i))));
  for (; i < n; ++i) {
    uint32_t x;
    std::memcpy(&x, src + i, sizeof x);
    dst[i] = static_cast<uint16_t>((x + 0x7FFF + ((x >> 16) & 1)) >> 16);
  }
}

FA_BF16_TARGET void transpose_to_bf16(const float* src, int64_t src_stride, int rows, int cols,
                                     uint16_t* dst, int64_t dst_stride) {
  for (int i0 = 0; i0 < rows; i0 += 16)
    for (int j0 = 0; j0 < cols; j0 += 16) {
      __m512i r[16];
      avx512::load_transposed16(src + i0 * src_stride + j0, src_stride, r);
      for (int j = 0; j < 16; ++j)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (j0 + j) * dst_stride + i0),
                            reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_castsi512_ps(r[j]))));
    }
}

FA_BF16_TARGET void probabilities_bf16(float* prob, float lse, float scale) {
  avx512::probabilities(prob, lse, scale);
}

FA_BF16_TARGET bool softmax_step_bf16(float* scores, float* m, float* l, float* acc, int head_dim_v,
                                     uint16_t* probabilities, float scale) {
  if (probabilities == nullptr) return avx512::softmax_step(scores, m, l, acc, head_dim_v, scale, scores);
  alignas(64) float row[kBlockK];
  if (!avx512::softmax_step(scores, m, l, acc, head_dim_v, scale, row)) return false;
  for (int j = 0; j < kBlockK; j += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(probabilities + j),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_load_ps(row + j))));
  return true;
}

// GCC 12 takes the _mm512_undefined_ps inside its own shuffle and extract intrinsics for
// uninitialised values (-Wmaybe-uninitialized); they are not (the shuffles' masks are full).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
namespace {
// acc[r * N + x] += the pair products of 32 elements (those of `mask`) of q row r and key x.
template <int R, int N>
FA_BF16_TARGET inline __attribute__((always_inline)) void decode_dot_step(
    __m512* acc, const bfloat16_t* q, int64_t q_row_stride, const bfloat16_t* k, int64_t k_row_stride,
    __mmask32 mask) {
  __m512bh kx[N];
#pragma GCC unroll 4
  for (int x = 0; x < N; ++x) kx[x] = (__m512bh)_mm512_maskz_loadu_epi16(mask, k + x * k_row_stride);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const __m512bh qr = (__m512bh)_mm512_maskz_loadu_epi16(mask, q + r * q_row_stride);
#pragma GCC unroll 4
    for (int x = 0; x < N; ++x) acc[r * N + x] = _mm512_dpbf16_ps(acc[r * N + x], qr, kx[x]);
  }
}

// R rows x N keys of decode_scores: R x N sums of 16 lanes, 32 elements (16 pairs) a step,
// the head dim's last partial step by masked loads (zeros add nothing).
template <int R, int N>
FA_BF16_TARGET inline __attribute__((always_inline)) void decode_dot_block(const bfloat16_t* q, int64_t q_row_stride, int head_dim,
                                            const bfloat16_t* k, int64_t k_row_stride, float scale,
                                            float* s, int64_t s_row_stride) {
  __m512 acc[R * N];
#pragma GCC unroll 16
  for (int i = 0; i < R * N; ++i) acc[i] = _mm512_setzero_ps();
  int d = 0;
  for (; d + 32 <= head_dim; d += 32)
    decode_dot_step<R, N>(acc, q + d, q_row_stride, k + d, k_row_stride, ~__mmask32{0});
  if (d < head_dim)
    decode_dot_step<R, N>(acc, q + d, q_row_stride, k + d, k_row_stride,
                          static_cast<__mmask32>((uint64_t{1} << (head_dim - d)) - 1));
  if constexpr (R == 4 && N == 4) {
    // The 16 sums by a tree of lane shuffles and adds (45 instructions where 16 separate
    // reductions take over 100): z[4 x + r] = sum of acc[r * 4 + x] (see the steps).
    __m512 c[8], e[4], g[2];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i)  // 128-bit lanes [a.L0+a.L2, a.L1+a.L3, b.L0+b.L2, b.L1+b.L3]
      c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0x44),
                           _mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0xEE));
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i)  // lane j: the 4 partial sums of acc[4 i + j]
      e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                           _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
#pragma GCC unroll 2
    for (int i = 0; i < 2; ++i)  // lane j: 2 halves of acc[8 i + j], then of acc[8 i + 4 + j]
      g[i] = _mm512_add_ps(_mm512_shuffle_ps(e[2 * i], e[2 * i + 1], 0x44),
                           _mm512_shuffle_ps(e[2 * i], e[2 * i + 1], 0xEE));
    // lane j: acc[j], acc[4 + j], acc[8 + j], acc[12 + j], i.e. z[4 x + r] for key x = j
    const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(g[0], g[1], 0x88), _mm512_shuffle_ps(g[0], g[1], 0xDD));
    // row r's four keys together: t[4 r + x] = z[4 x + r]
    const __m512i rows_first = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m512 t = _mm512_mul_ps(_mm512_set1_ps(scale), _mm512_permutexvar_ps(rows_first, z));
    _mm_storeu_ps(s, _mm512_extractf32x4_ps(t, 0));
    _mm_storeu_ps(s + s_row_stride, _mm512_extractf32x4_ps(t, 1));
    _mm_storeu_ps(s + 2 * s_row_stride, _mm512_extractf32x4_ps(t, 2));
    _mm_storeu_ps(s + 3 * s_row_stride, _mm512_extractf32x4_ps(t, 3));
  } else {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int x = 0; x < N; ++x) s[r * s_row_stride + x] = scale * _mm512_reduce_add_ps(acc[r * N + x]);
  }
}

template <int R>
FA_BF16_TARGET inline void decode_score_rows(const bfloat16_t* q, int64_t q_row_stride, int head_dim,
                                             const bfloat16_t* k, int64_t k_row_stride, int keys,
                                             float scale, float* s, int64_t s_row_stride) {
  int x = 0;
  for (; x + 4 <= keys; x += 4)
    decode_dot_block<R, 4>(q, q_row_stride, head_dim, k + x * k_row_stride, k_row_stride, scale, s + x,
                           s_row_stride);
  for (; x < keys; ++x)
    decode_dot_block<R, 1>(q, q_row_stride, head_dim, k + x * k_row_stride, k_row_stride, scale, s + x,
                           s_row_stride);
}
}  // namespace

FA_BF16_TARGET void decode_scores(const bfloat16_t* q, int64_t q_row_stride, int rows, int head_dim,
                                  const bfloat16_t* k, int64_t k_row_stride, int keys, float scale,
                                  float* s, int64_t s_row_stride) {
  int r = 0;
  for (; r + 4 <= rows; r += 4)
    decode_score_rows<4>(q + r * q_row_stride, q_row_stride, head_dim, k, k_row_stride, keys, scale,
                         s + r * s_row_stride, s_row_stride);
  for (; r < rows; ++r)
    decode_score_rows<1>(q + r * q_row_stride, q_row_stride, head_dim, k, k_row_stride, keys, scale,
                         s + r * s_row_stride, s_row_stride);
}
#pragma GCC diagnostic pop

#else  // no AMX in this build: available() is false and nothing calls these

void configure_tiles() {}
void release_tiles() {}
void pack_pairs_of_rows(const bfloat16_t* const*, int, int, uint16_t*) {}
void pack_pairs_of_columns(const bfloat16_t* const*, int, int, uint16_t*) {}
void product(const uint16_t*, int64_t, const uint16_t*, int, int, int, float*, int64_t, bool, float) {}
void round_to_bf16(const float*, int64_t, uint16_t*) {}
bool softmax_step_bf16(float*, float*, float*, float*, int, uint16_t*, float) { return false; }
void transpose_to_bf16(const float*, int64_t, int, int, uint16_t*, int64_t) {}
void probabilities_bf16(float*, float, float) {}
void scale_to_bf16(const float*, float, int, uint16_t*) {}
void decode_scores(const bfloat16_t*, int64_t, int, int, const bfloat16_t*, int64_t, int, float, float*,
                   int64_t) {}

#endif

}  // namespace flashattn::detail::cpu::amx

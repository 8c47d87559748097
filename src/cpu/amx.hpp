// The bf16 matrix products of the CPU engine, on one of two engines:
// - AMX tiles (Intel Sapphire Rapids and later): a TDPBF16PS multiplies a 16 x 32 bf16 tile by a
//   32 x 16 one into 16 x 16 fp32 sums, 16 times the work of an AVX-512 multiply-add;
// - AVX512-BF16 dot products where there are no tiles (AMD Zen 4 and later, Intel Cooper
//   Lake): a VDPBF16PS adds 16 lanes' products of two bf16 pairs into fp32, twice the
//   multiply-adds of an fp32 FMA of the same width.
// Where a processor has either (and the OS grants the registers), the bf16 forward and
// backward run their matrix products here and everything else (masks, softmax, dropout) as
// before on fp32 tiles; elsewhere they keep the fp32 products of kernels.hpp. Both engines
// round the same operands to bf16 and sum exact products in fp32, so they differ only in the
// order of the sums.
//
// The operands are staged in AMX's layouts, which VDPBF16PS reads as they are (one idea: the
// second operand holds pairs of consecutive elements of its reduction dimension in 32-bit
// words, "VNNI" order):
// - rows (A operand): row-major bf16, rows a multiple of 32, the reduced width a multiple of 32.
// - pairs (B operand): for each 32 reduced indices x 16 outputs, a 16 x 16 tile of 32-bit words
//   (element pair (2k, 2k+1) of output n at word k * 16 + n), tiles ordered by reduced chunk
//   and then by output group (pack_pairs_of_rows / pack_pairs_of_columns).
// Rows past the real ones and pairs past the real keys are zero, so that they add nothing.
#pragma once

#include <cstdint>

#include "common/numeric.hpp"

namespace flashattn::detail::cpu::amx {

enum class Engine {
  None,         // neither: the fp32 products
  Tiles,        // AMX-TILE and AMX-BF16, and the OS gave this process the tile data state
                // (Linux arch_prctl ARCH_REQ_XCOMP_PERM, asked once per process)
  DotProducts,  // AVX512-BF16 (with AVX-512F/BW) but no tiles
};
// Both engines need AVX-512F/BW and AVX512-BF16 (the packing and conversions use them).
Engine engine();
// True where engine() is not None and FLASHATTN_CPU_AMX is not "0" (common/knobs.hpp: the
// fp32 products, for comparison).
bool available();
// The processor and the OS part of available(), whatever FLASHATTN_CPU_AMX says.
bool supported();
// Reads FLASHATTN_CPU_AMX, throwing for a value that is not 0, 1 or empty: the CPU entry points
// call it first, so that a bad value is an error before anything is written (the kv-cache
// append included) and not inside the worker threads, where an exception cannot propagate.
void check_setting();

// The widths the tile products take: a reduced dimension of whole 32-element chunks and an
// output of whole 32-column pairs of tiles.
inline bool fits(int head_dim, int head_dim_v) {
  return head_dim % 32 == 0 && head_dim_v % 32 == 0;
}

// Configures this thread's tiles (eight of 16 rows x 64 bytes); before the products below on a
// thread, and released (release_tiles) when the thread is done with them. Nothing to do on
// the dot-product engine.
void configure_tiles();
void release_tiles();

// B operand whose outputs are rows of the source (keys for Q K^T): rows[n] is output n's row
// of `width` elements (a multiple of 32), packed as pairs along it; a null row is zeros.
// `outputs` (a multiple of 32) rows; dst holds outputs * width bf16.
void pack_pairs_of_rows(const bfloat16_t* const* rows, int width, int outputs, uint16_t* dst);
// B operand reduced over the rows of the source (values for P V: keys index the rows): rows[k]
// is row k of `width` elements (a multiple of 32); row pairs interleaved; a null row is zeros.
// `reduced` (a multiple of 32) rows; dst holds reduced * width bf16.
void pack_pairs_of_columns(const bfloat16_t* const* rows, int width, int reduced, uint16_t* dst);

// c[r][n] = sum_k a[r][k] b[k][n] for r < rows, n < outputs, k < reduced, with a in rows layout
// (row stride a_stride elements), b packed (pack_pairs_*); c fp32 with row stride c_stride.
// rows, reduced and outputs are multiples of 32. `accumulate` adds to c instead of writing it;
// otherwise c = scale * the products.
void product(const uint16_t* a, int64_t a_stride, const uint16_t* b, int rows, int reduced,
             int outputs, float* c, int64_t c_stride, bool accumulate, float scale = 1.0f);

// dst[j * dst_stride + i] = bf16(src[i * src_stride + j]) for i < rows, j < cols (multiples of
// 16): a tile of fp32 rows written transposed in bf16 (the backward's P^T and dS^T).
void transpose_to_bf16(const float* src, int64_t src_stride, int rows, int cols, uint16_t* dst,
                       int64_t dst_stride);

// softmax_step (cpu/kernels.hpp) for a row whose probabilities go to P V in bf16: the same
// running max, sum and rescale, exp by a cheaper polynomial (relative error below 3e-7, far
// under bf16's 2^-9). Writes the probabilities rounded to bf16 to `probabilities` when it is
// not null (the scores row is then left as it was), else as fp32 over the scores. Returns
// false, touching nothing, for a row softmax_step must take: NaN or infinite scores, or no
// visible key yet. The scores are those of softmax_step times `scale` (> 0): scale x for
// each x of the row (whose max is then scale times the row's), so that unmasked tiles need
// no pass of their own to scale.
bool softmax_step_bf16(float* scores, float* m, float* l, float* acc, int head_dim_v,
                       uint16_t* probabilities, float scale);

// backward_probabilities (cpu/kernels.hpp) for the AMX backward: prob[j] = exp(scale prob[j]
// - lse) for j < kBlockK by softmax_step_bf16's exponential; masked scores (-inf) give 0, NaN
// stays NaN.
void probabilities_bf16(float* prob, float lse, float scale);

// The decode path's scores (cpu/kvcache.cpp) by VDPBF16PS, where available(): s[r * s_row_stride
// + x] = scale * sum_{d < head_dim} q[r * q_row_stride + d] * k[x * k_row_stride + d] for r <
// rows, x < keys, q and k bf16 as stored (any head_dim): exact products summed in fp32 (in an
// order of the instruction's own), the scale applied to each sum once. Half the instructions
// of converting the keys to fp32 and multiplying by fp32 query rows.
void decode_scores(const bfloat16_t* q, int64_t q_row_stride, int rows, int head_dim,
                   const bfloat16_t* k, int64_t k_row_stride, int keys, float scale, float* s,
                   int64_t s_row_stride);

// dst[i] = bf16(factor * src[i]) rounded to nearest even (VCVTNEPS2BF16), for i < n: the
// forward's normalised output rows.
void scale_to_bf16(const float* src, float factor, int n, uint16_t* dst);

// dst[i] = bf16(src[i]) rounded to nearest even, for i < n (finite inputs).
void round_to_bf16(const float* src, int64_t n, uint16_t* dst);

}  // namespace flashattn::detail::cpu::amx

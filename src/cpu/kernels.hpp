// The CPU engine's inner loops over one tile. Each is compiled several times (baseline
// x86-64, AVX2+FMA, AVX-512) and the best one for the running processor is picked when the
// library loads, so one binary is both portable and fast. Keeping them as small non-inline
// functions over float tiles is what lets that dispatch happen once per tile, not per element.
#pragma once

#include <cstdint>

#include "common/numeric.hpp"

// Compile each inner loop for several instruction sets and pick at load time (GCC/Clang
// ifunc). x86-64-v3 is AVX2+FMA+F16C, x86-64-v4 adds AVX-512.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(FLASHATTN_NO_MULTIVERSION)
#define FA_CPU_DISPATCH \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FA_CPU_DISPATCH
#endif

namespace flashattn::detail::cpu {

// Query rows per forward work item: the keys and values it stages serve them all, so more
// rows make staging cheaper per score (128 over 64: a fifth faster at head dim 64; 256 over
// 128: +2 % at head dim 64 and +4 % at 128, 2k, 1 thread, +13 % at 4k, head dim 128, 2
// threads; causal 512 on 2 threads -3 %, fewer items to balance). The q and acc tiles are
// then 256 x D and 256 x Dv floats: 2 threads at head dim 64 hold ~450 KB (tests/
// test_memory.cpp asks for less than 512 KiB).
inline constexpr int kBlockQ = 256;
inline constexpr int kTileRows = 64;  // query rows per score tile (of a work item's kBlockQ)
// Keys per inner step (a tile row of scores is kBlockK floats). 128 over 64: the per-block
// work (the softmax's rescale of the accumulators, the P V product's loads and stores of
// them, one pass of the backward over the query rows per key block) is spread over twice the
// keys: +1.5-2 % forward and +4-5 % forward + backward at 2k, 1 thread (AVX2, Zen); causal
// forwards at 1k lose 3 % (more masked scores in the diagonal blocks).
inline constexpr int kBlockK = 128;

// dst[i] = scale * float(src[i]) for i < n.
void convert_row(const float* src, float* dst, int64_t n, float scale);
void convert_row(const half_t* src, float* dst, int64_t n, float scale);
void convert_row(const bfloat16_t* src, float* dst, int64_t n, float scale);

// dst[d * kBlockK + col0 + j] = src[j * row_stride + d] for j < cols, d < width: fp32 rows
// (keys or values) written transposed into columns of a width x kBlockK tile.
void transpose_block(const float* src, int64_t row_stride, int cols, int width, float* dst,
                     int col0);

// s[i][j] = sum_d q[i][d] * kt[d][j] for i < rows, j < kBlockK.
// q is rows x head_dim, kt is head_dim x kBlockK (keys transposed), s is rows x kBlockK.
void score_tile(const float* q, const float* kt, float* s, int rows, int head_dim);

// One online-softmax step for one row of scores (kBlockK entries, -inf where masked):
// updates the running max m and sum l, turns the scores into probabilities in place
// (relative to the new max) and rescales the row's output accumulator.
void softmax_step(float* scores, float* m, float* l, float* acc, int head_dim_v);

// prob[j] = exp(prob[j] - lse) for j < kBlockK (masked scores, -inf, give 0): the backward's
// recomputed probabilities of one row. Here, with the tile products' dispatch, rather than
// in backward.cpp, which is compiled for baseline x86-64 only: there the exp ran 4 floats
// wide without FMA, and was most of the backward's time outside the five tile products.
// 8 wide with FMA: +2 to +5 % fp32 forward + backward at 2k, 1 thread (AVX2, Zen 1). The
// gradients move by a few ulp (FMA rounds the polynomial differently).
void backward_probabilities(float* prob, float lse);

// sum_{d < n} double(a[d]) * double(b[d]), in a fixed order of its own (per instruction set):
// the backward's D_i = rowsum(dO_i o O_i). Vectorised: the scalar loop, a chain of dependent
// double adds, was a twentieth of fp32 forward + backward at head dim 64 (recomputed for every
// tile, Dv adds of 4 cycles each per query row).
double dot_double(const float* a, const float* b, int n);

// A tile of weights read as p(i, j) = data[i * row_stride + j * col_stride]: a score tile
// ({kBlockK, 1}) or, read transposed, its columns as rows ({1, kBlockK}; the backward's
// P^T dO and dS^T Q, without copying the transpose out).
struct Weights {
  const float* data;
  int64_t row_stride, col_stride;
  // The caller has checked that no weight that accumulate_pv reads is exactly 0, so it skips
  // its own check per register block of rows. That check runs over every weight with the
  // tile's strides unknown at compile time, so it stays scalar: in the backward (three
  // products per tile) it was a seventh of accumulate_pv's time at head dim 64, where a
  // vectorised scan of each tile row as it is written costs next to nothing (+4 to +7 %
  // fp32 forward + backward at 2k, 1 thread, AVX2 Zen 1; bitwise the same gradients).
  bool no_zeros = false;
};

// acc[i][:] += sum_{j < cols, p(i, j) != 0} p(i, j) * v[j][:] for i < rows; v is cols rows
// of head_dim_v floats at v_row_stride (a staged tile, or fp32 rows of the caller's tensor),
// acc rows < rows at acc_row_stride (a tile, or the caller's fp32 dq).
void accumulate_pv(Weights p, const float* v, int64_t v_row_stride, float* acc,
                   int64_t acc_row_stride, int rows, int cols, int head_dim_v);

// The common case: p is a rows x kBlockK score tile, v a packed cols x head_dim_v tile, acc
// a packed rows x head_dim_v tile.
inline void accumulate_pv(const float* p, const float* v, float* acc, int rows, int cols,
                          int head_dim_v) {
  accumulate_pv(Weights{p, kBlockK, 1}, v, head_dim_v, acc, head_dim_v, rows, cols, head_dim_v);
}

// ---- Decoding: the two products straight from a cache's rows ----------------------------
// A decode call has a few query rows per key/value head (Sq x H/Hk) and a long cache. Staging
// key blocks (converted, transposed) for so few rows costs more than the products, so the
// KV-cache engine's decode path (cpu/kvcache.cpp) multiplies by the cache rows where they lie,
// converting each element as it is loaded.

// The order of a bf16 cache's head dim in the decode products' query rows and accumulators:
// each whole group of decode_bf16_group() elements (from the first) is held as its even
// elements then its odd ones; elements past the last whole group in their own order. fp32 and
// fp16 caches: the natural order throughout.
int decode_bf16_group();

// s[r * s_row_stride + x] = sum_{d < head_dim} q[r * head_dim + d] * float(k[x * k_row_stride + d])
// for r < rows, x < keys: dot products along the head dim (each summed in an order of the
// instruction set's own). bf16: q in the order of decode_bf16_group.
void decode_scores(const float* q, int rows, int head_dim, const float* k, int64_t k_row_stride,
                   int keys, float* s, int64_t s_row_stride);
void decode_scores(const float* q, int rows, int head_dim, const bfloat16_t* k,
                   int64_t k_row_stride, int keys, float* s, int64_t s_row_stride);
void decode_scores(const float* q, int rows, int head_dim, const half_t* k, int64_t k_row_stride,
                   int keys, float* s, int64_t s_row_stride);

// acc[r * acc_row_stride + d] += sum_{x < keys, p(r, x) != 0} p(r, x) * float(v[x * v_row_stride + d])
// for r < rows, d < head_dim_v, with p(r, x) = p[r * p_row_stride + x]: accumulate_pv's rule
// (a weight of exactly 0 skips its value row, so that a masked row's Inf or NaN cannot leak).
// bf16: acc in the order of decode_bf16_group.
void decode_accumulate_pv(const float* p, int64_t p_row_stride, int rows, const float* v,
                          int64_t v_row_stride, int keys, float* acc, int64_t acc_row_stride,
                          int head_dim_v);
void decode_accumulate_pv(const float* p, int64_t p_row_stride, int rows, const bfloat16_t* v,
                          int64_t v_row_stride, int keys, float* acc, int64_t acc_row_stride,
                          int head_dim_v);
void decode_accumulate_pv(const float* p, int64_t p_row_stride, int rows, const half_t* v,
                          int64_t v_row_stride, int keys, float* acc, int64_t acc_row_stride,
                          int head_dim_v);

}  // namespace flashattn::detail::cpu

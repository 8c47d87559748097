// The CPU backward engine: FlashAttention-2's backward on the host, in two passes that each
// own what they write, so that the result is deterministic by construction.
//
// Both passes recompute a tile of probabilities from the forward's saved lse instead of
// storing P: P = exp(S - lse) with S recomputed exactly as the forward did (tiles.hpp), then
//   dP = (dO V^T) o M,   dS = P o (dP - D) [o (1 - tanh^2) with a softcap],
// where D_i = rowsum(dO_i o O_i) and M holds dropout's multipliers (0 or 1/(1-p)).
//
// Pass 1, work item = (batch, key/value head, block of kBlockK keys): walks the query heads
//   of the group and the query blocks that see the keys, accumulating
//   dV += (P o M)^T dO and dK += dS^T Q in the item's own tiles, then writes them once.
// Pass 2, work item = (batch, query head, block of kBackwardBlockQ query rows): walks the visible
//   key blocks, accumulating dQ += dS K in its own tile, then writes it once.
// No two work items write the same element and each sums in a fixed order, so the gradients
// are bitwise the same on every run and for every thread count, with no atomics and no
// partial buffers to reduce. The price is recomputing S, P and dP in pass 2 (7 tile matrix
// products per tile instead of 5). Working memory is a fixed set of tiles per thread.
//
// fp32, with at least one (batch, kv head) per processor, avoids that price: one work item
// per (batch, kv head) runs pass 1 over all its key blocks and adds dQ += dS K straight into
// the caller's fp32 dq rows of its query heads, which no other item touches (the fused
// backward: 5 products per tile). Which of the two runs depends on the shapes and the
// machine's processor count, never on num_threads, so the determinism above holds.
#include "cpu/backward.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "common/mask.hpp"
#include "common/numeric.hpp"
#include "cpu/amx.hpp"
#include "cpu/exp_approx.hpp"
#include "cpu/kernels.hpp"
#include "cpu/tiles.hpp"

namespace flashattn::detail::cpu {
namespace {

// Query rows per backward work item (and per tile: pass 1 walks query blocks of this size).
constexpr int kBackwardBlockQ = 64;
// Query rows per pass-2 item on the AMX products: two tiles of kBackwardBlockQ rows share each
// key block's packing (K twice, V once), which would otherwise be a fifth of that pass. Their
// q and dO rows fill the bf16 views of both halves of the q and dout tiles (pass 2 packs no
// pairs of them); lse and D hold this many rows.
constexpr int kAmxBlockQ = 2 * kBackwardBlockQ;
// Key blocks that the fused backward's pass 1 holds at once: each block of query rows it
// loads (q, dO and out for D: rows of the caller's tensors, a row stride apart, reloaded for
// every pass over the keys) then serves both. 2 over 1: +5 % fp32 forward + backward at head
// dim 64 and +6 % at 128 (2k, 1 thread, AVX2 Zen 1; bitwise the same gradients). The working
// memory grows by one block's five key tiles and no longer holds a tile of dropout
// multipliers (drawn a row at a time): 2 threads at head dim 64 hold 919 KB, under
// tests/test_memory.cpp's 1 MiB.
constexpr int kKeyBlocksPerPass = 2;

constexpr int64_t kAlignFloats = 16;  // 64-byte alignment for every tile

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// One thread's tiles, carved out of a single allocation (shared by both passes).
struct Tiles {
  float* q;     // kBackwardBlockQ x D, pre-multiplied by query_scale
  float* dout;  // kBackwardBlockQ x Dv
  // One block of keys: pass 1 holds kKeyBlocksPerPass of them (key[0] alone outside the fused
  // backward), pass 2 uses key[0].
  struct Keys {
    float* kt;     // D x kBlockK: keys transposed, zero beyond the last key
    float* k;      // kBlockK x D: keys (pass 2 and the fused dS K)
    float* vt;     // Dv x kBlockK: values transposed, zero beyond the last key
    float* acc;    // kBlockK x D: dK (pass 1) or kBackwardBlockQ x D: dQ (pass 2)
    float* acc_v;  // kBlockK x Dv: dV (pass 1)
  } key[kKeyBlocksPerPass];
  float* p;     // kBackwardBlockQ x kBlockK: scores, then P, then P o M
  float* ds;    // kBackwardBlockQ x kBlockK: dP, then dS
  float* grad;  // kBackwardBlockQ x kBlockK: softcap's derivative
  float* lse;   // kAmxBlockQ (kBackwardBlockQ outside the AMX pass 2)
  float* d;     // kAmxBlockQ: D_i = rowsum(dO o O)
  float* row;   // Dv: one row of out in fp32
  // Set by Pass::tile: no entry of P o M (of dS) that the products read is exactly 0, so
  // accumulate_pv may skip its own, scalar, check for zeros (Weights::no_zeros).
  bool p_no_zeros = false, ds_no_zeros = false;

  static int64_t floats(int head_dim, int head_dim_v, float* base = nullptr, Tiles* t = nullptr) {
    int64_t used = 0;
    const auto take = [&](float*& slot, int64_t n) {
      if (t) slot = base + used;
      used += round_up(n, kAlignFloats);
    };
    float* unused = nullptr;
    const int64_t tile = int64_t{kBackwardBlockQ} * kBlockK;
    take(t ? t->q : unused, int64_t{kBackwardBlockQ} * head_dim);
    take(t ? t->dout : unused, int64_t{kBackwardBlockQ} * head_dim_v);
    for (int x = 0; x < kKeyBlocksPerPass; ++x) {
      take(t ? t->key[x].kt : unused, int64_t{kBlockK} * head_dim);
      take(t ? t->key[x].k : unused, int64_t{kBlockK} * head_dim);
      take(t ? t->key[x].vt : unused, int64_t{kBlockK} * head_dim_v);
      take(t ? t->key[x].acc : unused, int64_t{kBlockK} * head_dim);
      take(t ? t->key[x].acc_v : unused, int64_t{kBlockK} * head_dim_v);
    }
    take(t ? t->p : unused, tile);
    take(t ? t->ds : unused, tile);
    take(t ? t->grad : unused, tile);
    take(t ? t->lse : unused, kAmxBlockQ);
    take(t ? t->d : unused, kAmxBlockQ);
    take(t ? t->row : unused, head_dim_v);
    return used;
  }
  Tiles(float* base, int head_dim, int head_dim_v) { floats(head_dim, head_dim_v, base, this); }

  // The bf16 operands of the AMX products (Pass::amx), in the storage of the fp32 tiles that
  // path leaves unused (a bf16 operand takes half of an fp32 tile; head dims of 64 or more).
  struct AmxViews {
    uint16_t* q;            // 64 x D rows: S = Q K^T
    uint16_t* q_pairs;      // 64 x D packed (pairs of columns): dK += dS^T Q
    uint16_t* dout;         // 64 x Dv rows: dP = dO V^T
    uint16_t* dout_pairs;   // 64 x Dv packed: dV += P^T dO
    uint16_t* key_pairs;    // kBlockK x D packed (pairs of rows): S
    uint16_t* key_columns;  // kBlockK x D packed (pairs of columns): dQ += dS K
    uint16_t* value_pairs;  // kBlockK x Dv packed (pairs of rows): dP
    uint16_t* p_t;          // kBlockK x 64: (P o M)^T
    uint16_t* ds_t;         // kBlockK x 64: dS^T
    uint16_t* ds;           // 64 x kBlockK: dS
  };
  // The key operands are those of key block `keys` (one of key[]); the per-tile ones (p_t,
  // ds_t, ds) live in key[0]'s spare halves whichever block a tile uses.
  AmxViews amx(int head_dim, int head_dim_v, const Keys& keys) const {
    const auto half = [](float* f) { return reinterpret_cast<uint16_t*>(f); };
    const Keys& k0 = key[0];
    return {half(q),
            half(q) + int64_t{kBackwardBlockQ} * head_dim,
            half(dout),
            half(dout) + int64_t{kBackwardBlockQ} * head_dim_v,
            half(keys.kt),
            half(keys.kt) + int64_t{kBlockK} * head_dim,
            half(keys.vt),
            half(k0.vt) + int64_t{kBlockK} * head_dim_v,
            half(k0.k),
            half(k0.k) + int64_t{kBlockK} * kBackwardBlockQ};
  }
};
static_assert(kBackwardBlockQ % 32 == 0, "AMX products take whole 32-row tiles");

// The query rows that pass 1 loads after the current tile (the next block of the head, or
// the first of the next head): tile() asks for their cache lines a row at a time while it
// works, so that load_queries and the fused dq product find them in cache.
template <typename T>
struct NextRows {
  const T* q = nullptr;
  const T* dout = nullptr;
  const T* out = nullptr;
  const T* dq = nullptr;  // the fused backward's dq rows (read and written), else null
  int64_t q_stride = 0, dout_stride = 0, out_stride = 0, dq_stride = 0;
  int rows = 0;
  void prefetch(int r, int D, int Dv) const {
    prefetch_row(q + r * q_stride, D);
    prefetch_row(dout + r * dout_stride, Dv);
    prefetch_row(out + r * out_stride, Dv);
    if (dq != nullptr) prefetch_row(dq + r * dq_stride, D);
  }
};

// Everything both passes need to know about one call.
template <typename T>
struct Pass {
  using NextRows = cpu::NextRows<T>;

  const BackwardParams& bp;
  const ForwardParams& p;
  const DropoutRng* dropout;
  // bf16 on a processor with AMX (cpu/amx.hpp): the five products on tiles, the rest as in
  // fp32. Head dims of 64 or more: the tiles' spare halves hold the transposed probabilities.
  bool amx = false;

  const T* at(const void* base, int64_t batch_stride, int64_t row_stride, int64_t head_stride,
              int32_t b, int64_t row, int32_t h) const {
    return static_cast<const T*>(base) + b * batch_stride + row * row_stride + h * head_stride;
  }
  T* at(void* base, int64_t batch_stride, int64_t row_stride, int64_t head_stride, int32_t b,
        int64_t row, int32_t h) const {
    return static_cast<T*>(base) + b * batch_stride + row * row_stride + h * head_stride;
  }

  float slope(int32_t b, int32_t h) const {
    return p.alibi_slopes != nullptr ? p.alibi_slopes[b * p.alibi_batch_stride + h] : 0.0f;
  }

  // Loads query rows [i0, i0+rows) of (b, h): q, dout, lse and D.
  void load_queries(const SequenceView& seq, int32_t b, int32_t h, int64_t i0, int rows,
                    Tiles& t) const {
    const int D = p.head_dim, Dv = p.head_dim_v;
    const int64_t row0 = seq.q_row0 + i0;
    if constexpr (std::is_same_v<T, bfloat16_t>) {
      if (amx) {
        load_queries_amx(b, h, row0, rows, true, t);
        return;
      }
    }
    load_rows(at(p.q, p.q_batch_stride, p.q_row_stride, p.q_head_stride, b, row0, h),
              p.q_row_stride, rows, D, query_scale(p), t.q);
    load_rows(at(bp.dout, bp.dout_batch_stride, bp.dout_row_stride, bp.dout_head_stride, b,
                 row0, h),
              bp.dout_row_stride, rows, Dv, 1.0f, t.dout);
    const T* out = at(p.out, p.out_batch_stride, p.out_row_stride, p.out_head_stride, b, row0, h);
    const float* lse = p.lse + b * p.lse_batch_stride + h * p.lse_head_stride + row0;
    for (int r = 0; r < rows; ++r) {
      t.lse[r] = lse[r];
      convert_row(out + r * p.out_row_stride, t.row, Dv, 1.0f);
      const float* dout = t.dout + static_cast<int64_t>(r) * Dv;
      // In double: where one key dominates a row, dS = P (dP - D) cancels, and D's rounding
      // error (a sum of Dv products as large as dP itself) is most of dq's and dk's. The
      // cost is Dv multiply-adds per row against the row's Sk x (D + Dv) of the products.
      t.d[r] = static_cast<float>(dot_double(dout, t.row, Dv));
    }
  }

  // load_queries for the AMX products: q and dO as bf16 rows (zero rows up to a whole tile)
  // and, for pass 1 (with_pairs, rows <= kBackwardBlockQ), packed as pairs of columns; lse,
  // and D from the bf16 dO and out rows. Pass 2 takes up to kAmxBlockQ rows.
  void load_queries_amx(int32_t b, int32_t h, int64_t row0, int rows, bool with_pairs,
                        Tiles& t) const {
    if constexpr (std::is_same_v<T, bfloat16_t>) {  // (only bf16 takes the AMX products)
      const int D = p.head_dim, Dv = p.head_dim_v;
      const Tiles::AmxViews a = t.amx(D, Dv, t.key[0]);
      const T* q = at(p.q, p.q_batch_stride, p.q_row_stride, p.q_head_stride, b, row0, h);
      const T* dout = at(bp.dout, bp.dout_batch_stride, bp.dout_row_stride, bp.dout_head_stride,
                         b, row0, h);
      const T* q_rows[kAmxBlockQ];
      const T* dout_rows[kAmxBlockQ];
      const int padded = static_cast<int>(round_up(rows, 32));
      for (int r = 0; r < padded; ++r) {
        q_rows[r] = r < rows ? q + r * p.q_row_stride : nullptr;
        dout_rows[r] = r < rows ? dout + r * bp.dout_row_stride : nullptr;
        uint16_t* q_dst = a.q + int64_t{r} * D;
        uint16_t* dout_dst = a.dout + int64_t{r} * Dv;
        if (r < rows) {
          std::memcpy(q_dst, q_rows[r], sizeof(uint16_t) * D);
          std::memcpy(dout_dst, dout_rows[r], sizeof(uint16_t) * Dv);
        } else {
          std::fill(q_dst, q_dst + D, uint16_t{0});
          std::fill(dout_dst, dout_dst + Dv, uint16_t{0});
        }
      }
      if (with_pairs) {
        amx::pack_pairs_of_columns(q_rows, D, padded, a.q_pairs);
        amx::pack_pairs_of_columns(dout_rows, Dv, padded, a.dout_pairs);
      }
      const T* out = at(p.out, p.out_batch_stride, p.out_row_stride, p.out_head_stride, b, row0, h);
      const float* lse = p.lse + b * p.lse_batch_stride + h * p.lse_head_stride + row0;
      float dout_row[256];  // head dims are at most 256
      for (int r = 0; r < rows; ++r) {
        t.lse[r] = lse[r];
        convert_row(out + r * p.out_row_stride, t.row, Dv, 1.0f);
        convert_row(dout_rows[r], dout_row, Dv, 1.0f);
        t.d[r] = static_cast<float>(dot_double(dout_row, t.row, Dv));  // as in load_queries
      }
    }
  }

  // Stages keys [j0, j0 + cols) of (b, hk) for the AMX products: K and V packed as the
  // outputs of S and dP, K packed once more as the reduced side of dQ += dS K (with_columns).
  void load_keys_amx(const SequenceView& seq, int32_t b, int32_t hk, int64_t j0, int cols,
                     bool with_columns, const Tiles& t, const Tiles::Keys& keys) const {
    if constexpr (std::is_same_v<T, bfloat16_t>) {  // (only bf16 takes the AMX products)
      const int D = p.head_dim, Dv = p.head_dim_v;
      const Tiles::AmxViews a = t.amx(D, Dv, keys);
      const int padded = static_cast<int>(round_up(cols, 32));
      const T* k = at(p.k, p.k_batch_stride, p.k_row_stride, p.k_head_stride, b, seq.k_row0 + j0, hk);
      const T* v = at(p.v, p.v_batch_stride, p.v_row_stride, p.v_head_stride, b, seq.k_row0 + j0, hk);
      const T* rows[kBlockK];
      for (int j = 0; j < padded; ++j) rows[j] = j < cols ? k + j * p.k_row_stride : nullptr;
      amx::pack_pairs_of_rows(rows, D, padded, a.key_pairs);
      if (with_columns) amx::pack_pairs_of_columns(rows, D, padded, a.key_columns);
      for (int j = 0; j < padded; ++j) rows[j] = j < cols ? v + j * p.v_row_stride : nullptr;
      amx::pack_pairs_of_rows(rows, Dv, padded, a.value_pairs);
    }
  }

  // One row of a tile once its probabilities are in `prob` and dP in `ds`: dS = P o (dP o M - D)
  // (times softcap's derivative `grad`, where there is one) into `ds`, zero past cols, and
  // P o M into `prob` (M: dropout's multipliers of row i, as in the forward).
  void row_gradient(int32_t b, int32_t h, int64_t i, int64_t j0, int cols, float d, float* prob,
                    float* ds, const float* grad) const {
    if (dropout != nullptr) {
      float m[kBlockK];
      dropout_multipliers(p, *dropout, b, h, i, j0, cols, m);
      for (int j = 0; j < cols; ++j) {
        ds[j] = prob[j] * (ds[j] * m[j] - d);
        prob[j] *= m[j];
      }
    } else {
      for (int j = 0; j < cols; ++j) ds[j] = prob[j] * (ds[j] - d);
    }
    for (int j = cols; j < kBlockK; ++j) ds[j] = 0.0f;
    if (p.softcap > 0.0f)
      for (int j = 0; j < cols; ++j) ds[j] *= grad[j];
  }

  // tile() on the AMX products: S and dP from the staged bf16 operands, then P (by
  // amx::probabilities_bf16, the scale in its exponent where modify_scores only masks) and
  // dS in fp32 as tile() makes them; no zero counts (the tile products do not skip zeros).
  // The tile's rows start at row `first` of the staged ones (q, dO, lse and D).
  void amx_tile(const SequenceView& seq, int32_t b, int32_t h, int64_t i0, int rows, int64_t j0,
                int cols, Tiles& t, const Tiles::Keys& keys, const NextRows* next,
                int first = 0) const {
    const int D = p.head_dim, Dv = p.head_dim_v;
    Tiles::AmxViews a = t.amx(D, Dv, keys);
    a.q += int64_t{first} * D;
    a.dout += int64_t{first} * Dv;
    const int padded_rows = static_cast<int>(round_up(rows, 32));
    const int padded_cols = static_cast<int>(round_up(cols, 32));
    const float scale = query_scale(p);
    const bool scale_in_exp = scale > 0.0f && p.softcap == 0.0f && p.alibi_slopes == nullptr;
    amx::product(a.q, D, a.key_pairs, padded_rows, D, padded_cols, t.p, kBlockK, false,
                 scale_in_exp ? 1.0f : scale);
    modify_scores(p, seq, slope(b, h), t.p, i0, rows, j0, cols, t.grad);
    amx::product(a.dout, Dv, a.value_pairs, padded_rows, Dv, padded_cols, t.ds, kBlockK, false);
    for (int r = 0; r < rows; ++r) {
      if (next != nullptr && r < next->rows) next->prefetch(r, p.head_dim, p.head_dim_v);
      float* prob = t.p + static_cast<int64_t>(r) * kBlockK;
      float* ds = t.ds + static_cast<int64_t>(r) * kBlockK;
      const float lse = t.lse[first + r], d = t.d[first + r];
      if (lse == -std::numeric_limits<float>::infinity()) {  // the row saw no key at all
        std::fill(prob, prob + kBlockK, 0.0f);
        std::fill(ds, ds + kBlockK, 0.0f);
        continue;
      }
      amx::probabilities_bf16(prob, lse, scale_in_exp ? scale : 1.0f);  // masked: 0
      row_gradient(b, h, i0 + r, j0, cols, d, prob, ds, t.grad + static_cast<int64_t>(r) * kBlockK);
    }
  }

  // The tile of rows [i0, i0+rows) x keys [j0, j0+cols): leaves P o M in t.p and dS in t.ds.
  // Needs t.q, t.dout, t.lse, t.d, keys.kt and keys.vt loaded.
  void tile(const SequenceView& seq, int32_t b, int32_t h, int64_t i0, int rows, int64_t j0,
            int cols, Tiles& t, const Tiles::Keys& keys,
            const NextRows* next = nullptr) const {
    const int D = p.head_dim, Dv = p.head_dim_v;
    int p_zeros = 0, ds_zeros = 0;  // counts, not bools: integer sums vectorise
    if (amx) {  // the same two products from the staged bf16 operands (q unscaled there)
      amx_tile(seq, b, h, i0, rows, j0, cols, t, keys, next);
      return;
    } else {
      score_tile(t.q, keys.kt, t.p, rows, D);
      modify_scores(p, seq, slope(b, h), t.p, i0, rows, j0, cols, t.grad);
      score_tile(t.dout, keys.vt, t.ds, rows, Dv);  // dO V^T
    }
    for (int r = 0; r < rows; ++r) {
      if (next != nullptr && r < next->rows) next->prefetch(r, p.head_dim, p.head_dim_v);
      float* prob = t.p + static_cast<int64_t>(r) * kBlockK;
      float* ds = t.ds + static_cast<int64_t>(r) * kBlockK;
      const float lse = t.lse[r], d = t.d[r];
      if (lse == -std::numeric_limits<float>::infinity()) {  // the row saw no key at all
        std::fill(prob, prob + kBlockK, 0.0f);
        std::fill(ds, ds + kBlockK, 0.0f);
        p_zeros += cols;
        ds_zeros += cols;
        continue;
      }
      backward_probabilities(prob, lse);  // masked: 0
      row_gradient(b, h, i0 + r, j0, cols, d, prob, ds, t.grad + static_cast<int64_t>(r) * kBlockK);
      // While the row is in L1: the zeros accumulate_pv would otherwise look for itself, in
      // every register block of rows of each of the tile's three (or one) products.
#pragma omp simd reduction(+ : p_zeros, ds_zeros)
      for (int j = 0; j < cols; ++j) {
        p_zeros += prob[j] == 0.0f;
        ds_zeros += ds[j] == 0.0f;
      }
    }
    t.p_no_zeros = p_zeros == 0;
    t.ds_no_zeros = ds_zeros == 0;
  }

  // Pass 1: dK and dV of key blocks [block, block + nb) (nb <= kKeyBlocksPerPass) of (b, kv
  // head hk). with_dq (fp32 only, the fused backward): also dQ += dS K into the caller's dq,
  // which must then belong to this thread for every query head of hk. Each element of dK,
  // dV and dq sums its terms in the same order whatever nb is (query blocks ascending for
  // dK and dV; key blocks ascending for dq).
  void keys(int32_t b, int32_t hk, int64_t block, int nb, Tiles& t, bool with_dq = false) const {
    const SequenceView seq = sequence_view(p, b);
    // Keys past seqused_k take no part but are still this item's to write (with 0).
    const int64_t stored_k = seq.rows_k;
    const int D = p.head_dim, Dv = p.head_dim_v;
    struct Block {
      int64_t j0;
      int stored, cols;
    } blocks[kKeyBlocksPerPass];
    int n = 0;
    for (int x = 0; x < nb && x < kKeyBlocksPerPass; ++x) {
      const int64_t j0 = (block + x) * kBlockK;
      if (j0 >= stored_k) break;
      blocks[n++] = {j0, static_cast<int>(std::min<int64_t>(kBlockK, stored_k - j0)),
                     static_cast<int>(std::clamp<int64_t>(seq.seqlen_k - j0, 0, kBlockK))};
    }
    bool any_cols = false;
    if (amx) amx::configure_tiles();
    for (int x = 0; x < n; ++x) {
      const Tiles::Keys& kx = t.key[x];
      const int64_t j0 = blocks[x].j0;
      const int cols = blocks[x].cols;
      std::fill(kx.acc, kx.acc + int64_t{kBlockK} * D, 0.0f);
      std::fill(kx.acc_v, kx.acc_v + int64_t{kBlockK} * Dv, 0.0f);
      if (cols == 0) continue;
      any_cols = true;
      if (amx) {
        load_keys_amx(seq, b, hk, j0, cols, false, t, kx);
        continue;
      }
      load_transposed(at(p.k, p.k_batch_stride, p.k_row_stride, p.k_head_stride, b,
                         seq.k_row0 + j0, hk),
                      p.k_row_stride, cols, D, kx.kt);
      load_transposed(at(p.v, p.v_batch_stride, p.v_row_stride, p.v_head_stride, b,
                         seq.k_row0 + j0, hk),
                      p.v_row_stride, cols, Dv, kx.vt);
      // dS K reads the keys' rows once per block of query rows: copied, not read where they
      // are, whose rows H * D elements apart (a multiple of 4 KiB at H * D = 1024) fall into
      // a few sets of the L1 cache (the forward's values, load_key_block, the same).
      if (with_dq)
        load_rows(at(p.k, p.k_batch_stride, p.k_row_stride, p.k_head_stride, b, seq.k_row0 + j0,
                     hk),
                  p.k_row_stride, cols, D, 1.0f, kx.k);
    }
    for (int32_t h = hk * p.group_size(); any_cols && h < (hk + 1) * p.group_size(); ++h) {
      for (int64_t i0 = 0; i0 < seq.seqlen_q; i0 += kBackwardBlockQ) {
        const int rows = static_cast<int>(std::min<int64_t>(kBackwardBlockQ, seq.seqlen_q - i0));
        const KeyRange seen = visible_keys_of_rows(i0, i0 + rows, seq.seqlen_q, seq.seqlen_k,
                                                   p.window_left, p.window_right);
        bool sees[kKeyBlocksPerPass] = {};
        bool any = false;
        for (int x = 0; x < n; ++x) {
          sees[x] = blocks[x].cols > 0 && seen.end > blocks[x].j0 &&
                    seen.begin < blocks[x].j0 + blocks[x].cols;
          any = any || sees[x];
        }
        if (!any) continue;
        load_queries(seq, b, h, i0, rows, t);
        // The block after this one (of this head, else the next head's first): likely the
        // next that this loop loads (a block that sees none of these keys is skipped).
        NextRows next;
        {
          int32_t nh = h;
          int64_t ni = i0 + kBackwardBlockQ;
          if (ni >= seq.seqlen_q) {
            ++nh;
            ni = 0;
          }
          if (nh < (hk + 1) * p.group_size() && ni < seq.seqlen_q) {
            const int64_t row = seq.q_row0 + ni;
            next.q = at(p.q, p.q_batch_stride, p.q_row_stride, p.q_head_stride, b, row, nh);
            next.dout = at(bp.dout, bp.dout_batch_stride, bp.dout_row_stride,
                           bp.dout_head_stride, b, row, nh);
            next.out = at(p.out, p.out_batch_stride, p.out_row_stride, p.out_head_stride, b,
                          row, nh);
            if (with_dq)
              next.dq = at(static_cast<const void*>(bp.dq), bp.dq_batch_stride,
                           bp.dq_row_stride, bp.dq_head_stride, b, row, nh);
            next.q_stride = p.q_row_stride;
            next.dout_stride = bp.dout_row_stride;
            next.out_stride = p.out_row_stride;
            next.dq_stride = bp.dq_row_stride;
            next.rows = static_cast<int>(std::min<int64_t>(kBackwardBlockQ, seq.seqlen_q - ni));
          }
        }
        bool prefetched = false;
        for (int x = 0; x < n; ++x) {
          if (!sees[x]) continue;
          const Tiles::Keys& kx = t.key[x];
          const int64_t j0 = blocks[x].j0;
          const int cols = blocks[x].cols;
          tile(seq, b, h, i0, rows, j0, cols, t, kx, prefetched ? nullptr : &next);
          prefetched = true;
          if (amx) {  // dV += (P o M)^T dO and dK += dS^T q from the tiles transposed in bf16
            const Tiles::AmxViews a = t.amx(D, Dv, kx);
            const int padded_rows = static_cast<int>(round_up(rows, 32));
            const int padded_cols = static_cast<int>(round_up(cols, 32));
            for (int r = rows; r < padded_rows; ++r) {
              std::fill_n(t.p + int64_t{r} * kBlockK, padded_cols, 0.0f);
              std::fill_n(t.ds + int64_t{r} * kBlockK, padded_cols, 0.0f);
            }
            amx::transpose_to_bf16(t.p, kBlockK, padded_rows, padded_cols, a.p_t, kBackwardBlockQ);
            amx::transpose_to_bf16(t.ds, kBlockK, padded_rows, padded_cols, a.ds_t, kBackwardBlockQ);
            amx::product(a.p_t, kBackwardBlockQ, a.dout_pairs, padded_cols, padded_rows, Dv,
                         kx.acc_v, Dv, true);
            amx::product(a.ds_t, kBackwardBlockQ, a.q_pairs, padded_cols, padded_rows, D, kx.acc,
                         D, true);
            continue;
          }
          // The tiles read transposed: row j of (P o M)^T is column j of P o M.
          const Weights pt{t.p, 1, kBlockK, t.p_no_zeros}, dst{t.ds, 1, kBlockK, t.ds_no_zeros};
          accumulate_pv(pt, t.dout, Dv, kx.acc_v, Dv, cols, rows, Dv);  // dV += (P o M)^T dO
          accumulate_pv(dst, t.q, D, kx.acc, D, cols, rows, D);  // dK += dS^T (q * query_scale)
          if constexpr (std::is_same_v<T, float>) {
            if (with_dq) {  // dQ += dS K, with the keys' rows copied above
              T* dq = at(bp.dq, bp.dq_batch_stride, bp.dq_row_stride, bp.dq_head_stride, b,
                         seq.q_row0 + i0, h);
              accumulate_pv(Weights{t.ds, kBlockK, 1, t.ds_no_zeros}, kx.k, D, dq,
                            bp.dq_row_stride, rows, cols, D);
            }
          }
        }
      }
    }
    if (amx) amx::release_tiles();
    // dK = scale dS^T q = (scale / query_scale) dS^T (q * query_scale); the AMX products
    // take q unscaled.
    const float k_scale = amx ? p.softmax_scale : p.softcap > 0.0f ? p.softcap : 1.0f;
    for (int x = 0; x < n; ++x) {
      const Tiles::Keys& kx = t.key[x];
      const int64_t j0 = blocks[x].j0;
      T* dk = at(bp.dk, bp.dk_batch_stride, bp.dk_row_stride, bp.dk_head_stride, b,
                 seq.k_row0 + j0, hk);
      T* dv = at(bp.dv, bp.dv_batch_stride, bp.dv_row_stride, bp.dv_head_stride, b,
                 seq.k_row0 + j0, hk);
      for (int j = 0; j < blocks[x].stored; ++j) {
        for (int d = 0; d < D; ++d)
          dk[j * bp.dk_row_stride + d] = from_float<T>(k_scale * kx.acc[int64_t{j} * D + d]);
        for (int d = 0; d < Dv; ++d)
          dv[j * bp.dv_row_stride + d] = from_float<T>(kx.acc_v[int64_t{j} * Dv + d]);
      }
    }
  }

  // The fused backward's work item (fp32): every key block of (b, kv head hk) through pass
  // 1 with dQ accumulated in the caller's dq rows of the group's query heads, which no other
  // item touches. Five tile products per tile instead of seven.
  void keys_and_queries(int32_t b, int32_t hk, int64_t key_blocks, Tiles& t) const {
    const SequenceView seq = sequence_view(p, b);
    const auto for_dq_rows = [&](auto&& f) {
      for (int32_t h = hk * p.group_size(); h < (hk + 1) * p.group_size(); ++h)
        for (int64_t i = 0; i < seq.seqlen_q; ++i)
          f(at(bp.dq, bp.dq_batch_stride, bp.dq_row_stride, bp.dq_head_stride, b,
               seq.q_row0 + i, h));
    };
    for_dq_rows([&](T* dq) { std::fill(dq, dq + p.head_dim, T{}); });
    for (int64_t block = 0; block < key_blocks; block += kKeyBlocksPerPass)
      keys(b, hk, block, kKeyBlocksPerPass, t, true);
    for_dq_rows([&](T* dq) {
      for (int d = 0; d < p.head_dim; ++d)
        dq[d] = from_float<T>(p.softmax_scale * to_float(dq[d]));
    });
  }

  // Pass 2: dQ of query rows [i0, i0 + kBackwardBlockQ) of (b, h).
  void queries(int32_t b, int32_t h, int64_t block, Tiles& t) const {
    const SequenceView seq = sequence_view(p, b);
    const int64_t i0 = block * kBackwardBlockQ;
    if (i0 >= seq.seqlen_q) return;
    const int rows = static_cast<int>(std::min<int64_t>(kBackwardBlockQ, seq.seqlen_q - i0));
    const int D = p.head_dim, Dv = p.head_dim_v;
    const int32_t hk = h / p.group_size();
    const Tiles::Keys& kx = t.key[0];
    std::fill(kx.acc, kx.acc + int64_t{kBackwardBlockQ} * D, 0.0f);
    const KeyRange keys = visible_keys_of_rows(i0, i0 + rows, seq.seqlen_q, seq.seqlen_k,
                                               p.window_left, p.window_right);
    if (!keys.empty()) load_queries(seq, b, h, i0, rows, t);
    for (int64_t j0 = keys.begin; j0 < keys.end; j0 += kBlockK) {
      const int cols = static_cast<int>(std::min<int64_t>(kBlockK, keys.end - j0));
      const T* k = at(p.k, p.k_batch_stride, p.k_row_stride, p.k_head_stride, b,
                      seq.k_row0 + j0, hk);
      load_transposed(k, p.k_row_stride, cols, D, kx.kt);
      // fp32 keys are read where they are for dS K; others are converted once.
      const float* k_rows = kx.k;
      int64_t k_row_stride = D;
      if constexpr (std::is_same_v<T, float>) {
        k_rows = k;
        k_row_stride = p.k_row_stride;
      } else {
        load_rows(k, p.k_row_stride, cols, D, 1.0f, kx.k);
      }
      load_transposed(at(p.v, p.v_batch_stride, p.v_row_stride, p.v_head_stride, b,
                         seq.k_row0 + j0, hk),
                      p.v_row_stride, cols, Dv, kx.vt);
      tile(seq, b, h, i0, rows, j0, cols, t, kx);
      // dQ += dS K
      accumulate_pv(Weights{t.ds, kBlockK, 1, t.ds_no_zeros}, k_rows, k_row_stride, kx.acc, D,
                    rows, cols, D);
    }
    store_dq(b, h, seq.q_row0 + i0, rows, kx.acc);
  }

  // dq rows [row0, row0 + rows) of (b, h) = softmax_scale * acc.
  void store_dq(int32_t b, int32_t h, int64_t row0, int rows, const float* acc) const {
    const int D = p.head_dim;
    T* dq = at(bp.dq, bp.dq_batch_stride, bp.dq_row_stride, bp.dq_head_stride, b, row0, h);
    for (int r = 0; r < rows; ++r)
      for (int d = 0; d < D; ++d)
        dq[r * bp.dq_row_stride + d] = from_float<T>(p.softmax_scale * acc[int64_t{r} * D + d]);
  }

  // Pass 2 on the AMX products: dQ of query rows [i0, i0 + kAmxBlockQ) of (b, h), each key
  // block packed once for both of its tiles of kBackwardBlockQ rows; dQ += dS K with dS
  // rounded to bf16. Each row sums its key blocks in the same order as queries().
  void queries_amx(int32_t b, int32_t h, int64_t block, Tiles& t) const {
    const SequenceView seq = sequence_view(p, b);
    const int64_t i0 = block * kAmxBlockQ;
    if (i0 >= seq.seqlen_q) return;
    const int rows = static_cast<int>(std::min<int64_t>(kAmxBlockQ, seq.seqlen_q - i0));
    const int D = p.head_dim, Dv = p.head_dim_v;
    const int32_t hk = h / p.group_size();
    const Tiles::Keys& kx = t.key[0];
    std::fill(kx.acc, kx.acc + int64_t{kAmxBlockQ} * D, 0.0f);  // acc holds kBlockK >= kAmxBlockQ rows
    static_assert(kBlockK >= kAmxBlockQ, "pass 2's dQ accumulates in a key block's dK tile");
    const KeyRange keys = visible_keys_of_rows(i0, i0 + rows, seq.seqlen_q, seq.seqlen_k,
                                               p.window_left, p.window_right);
    if (!keys.empty()) load_queries_amx(b, h, seq.q_row0 + i0, rows, false, t);
    amx::configure_tiles();
    const Tiles::AmxViews a = t.amx(D, Dv, kx);
    for (int64_t j0 = keys.begin; j0 < keys.end; j0 += kBlockK) {
      const int cols = static_cast<int>(std::min<int64_t>(kBlockK, keys.end - j0));
      const int padded_cols = static_cast<int>(round_up(cols, 32));
      load_keys_amx(seq, b, hk, j0, cols, true, t, kx);
      for (int first = 0; first < rows; first += kBackwardBlockQ) {
        const int n = std::min(kBackwardBlockQ, rows - first);
        const KeyRange seen = visible_keys_of_rows(i0 + first, i0 + first + n, seq.seqlen_q,
                                                   seq.seqlen_k, p.window_left, p.window_right);
        if (seen.end <= j0 || seen.begin >= j0 + cols) continue;
        amx_tile(seq, b, h, i0 + first, n, j0, cols, t, kx, nullptr, first);
        const int padded_n = static_cast<int>(round_up(n, 32));
        for (int r = 0; r < padded_n; ++r) {
          uint16_t* ds = a.ds + int64_t{r} * kBlockK;
          if (r < n)
            amx::round_to_bf16(t.ds + int64_t{r} * kBlockK, padded_cols, ds);
          else
            std::fill_n(ds, padded_cols, uint16_t{0});
        }
        amx::product(a.ds, kBlockK, a.key_columns, padded_n, padded_cols, D,
                     kx.acc + int64_t{first} * D, D, true);
      }
    }
    amx::release_tiles();
    store_dq(b, h, seq.q_row0 + i0, rows, kx.acc);
  }
};

template <typename T>
size_t backward_typed(const BackwardParams& bp) {
  const ForwardParams& p = bp.fwd;
  // Varlen: the grids follow the longest real sequences (the lengths are in host memory).
  int64_t longest_q = p.seqlen_q, longest_k = p.seqlen_k;
  if (p.is_varlen()) {
    longest_q = longest_k = 0;
    for (int32_t b = 0; b < p.batch; ++b) {
      longest_q = std::max<int64_t>(longest_q, p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b]);
      longest_k = std::max<int64_t>(longest_k, p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b]);
    }
  }
  const int64_t query_blocks = (longest_q + kBackwardBlockQ - 1) / kBackwardBlockQ;
  const int64_t key_blocks = (longest_k + kBlockK - 1) / kBlockK;
  const int64_t key_items = int64_t{p.batch} * p.heads_k * key_blocks;
  const int64_t query_items = int64_t{p.batch} * p.heads * query_blocks;
  const int64_t work_items = std::max(key_items, query_items);
  if (work_items == 0) return 0;
  const int64_t threads =
      std::min<int64_t>(p.num_threads > 0 ? p.num_threads : omp_get_max_threads(), work_items);
  const int64_t per_thread = Tiles::floats(p.head_dim, p.head_dim_v);
  const ScratchFloats workspace(threads * per_thread);  // (uninitialised: cpu/tiles.hpp)
  float* base = workspace.data();

  std::optional<DropoutRng> dropout;
  if (p.dropout_p > 0.0f)
    dropout = make_dropout_rng(p.dropout_seed, p.dropout_offset, p.dropout_p);
  const bool amx = std::is_same_v<T, bfloat16_t> && amx::available() &&
                   amx::fits(p.head_dim, p.head_dim_v) && p.head_dim >= 64 && p.head_dim_v >= 64;
  const Pass<T> pass{bp, p, dropout ? &*dropout : nullptr, amx};

  // fp32 with a (batch, kv head) for every processor: the fused backward, one item per
  // (batch, kv head). The choice depends on the machine, never on num_threads, so that a
  // call's gradients are the same for every thread count.
  const bool fused = std::is_same_v<T, float> &&
                     int64_t{p.batch} * p.heads_k >= int64_t{omp_get_num_procs()};

#pragma omp parallel num_threads(static_cast<int>(threads))
  {
    Tiles tiles(base + omp_get_thread_num() * per_thread, p.head_dim, p.head_dim_v);
    if (fused) {
#pragma omp for collapse(2) schedule(dynamic, 1)
      for (int32_t b = 0; b < p.batch; ++b)
        for (int32_t hk = 0; hk < p.heads_k; ++hk)
          pass.keys_and_queries(b, hk, key_blocks, tiles);
    } else {
      // Dynamic scheduling: with causal or window masks, blocks differ a lot in cost. Which
      // thread runs an item never changes what the item computes.
      // The AMX products take kKeyBlocksPerPass key blocks per item (each load of query rows,
      // converted and packed, then serves them all); the fp32 products one (more items for
      // the threads to balance).
      const int blocks_per_item = amx ? kKeyBlocksPerPass : 1;
      const int64_t key_items_per_head = (key_blocks + blocks_per_item - 1) / blocks_per_item;
#pragma omp for collapse(3) schedule(dynamic, 1)
      for (int32_t b = 0; b < p.batch; ++b)
        for (int32_t hk = 0; hk < p.heads_k; ++hk)
          for (int64_t item = 0; item < key_items_per_head; ++item)
            pass.keys(b, hk, item * blocks_per_item, blocks_per_item, tiles);
      const int64_t query_items_per_head =
          amx ? (longest_q + kAmxBlockQ - 1) / kAmxBlockQ : query_blocks;
#pragma omp for collapse(3) schedule(dynamic, 1)
      for (int32_t b = 0; b < p.batch; ++b)
        for (int32_t h = 0; h < p.heads; ++h)
          for (int64_t block = 0; block < query_items_per_head; ++block) {
            if (amx)
              pass.queries_amx(b, h, block, tiles);
            else
              pass.queries(b, h, block, tiles);
          }
    }
  }
  return workspace.bytes();
}

}  // namespace

size_t backward(const BackwardParams& params) {
  amx::check_setting();
  switch (params.fwd.dtype) {
    case DType::Float32:
      return backward_typed<float>(params);
    case DType::Float16:
      return backward_typed<half_t>(params);
    case DType::BFloat16:
      return backward_typed<bfloat16_t>(params);
    case DType::Int32:
    case DType::Float8E4M3:  // forward only: refused by validation
      break;
  }
  throw Error(ErrorCode::Internal, "dtype", "fp32, fp16 or bf16 after validation",
              dtype_name(params.fwd.dtype));
}

}  // namespace flashattn::detail::cpu

// forward_kvcache against the float64 reference, on the equivalent unpaged, unsplit problem.
// Compiled once per backend: test_kvcache_cpu, and test_kvcache_cuda (FLASHATTN_TEST_CUDA,
// label gpu; skipped without a GPU).
//
// Each case builds a cache (dense, dense picked by cache_batch_idx, or paged with a shuffled
// block table), fills the positions its sequences own with fresh random values and everything
// else with NaN (a backend that reads a row outside a sequence, or forgets to append one,
// turns the output NaN), runs the call with poisoned outputs, and checks
//   - out and lse under docs/SPEC.md's accuracy rule, against reference::forward run per sequence
//     on its dense key list (old cache rows + the appended rows, rotated here, literally, in
//     float64 and rounded to the dtype) with q rotated likewise;
//   - the cache after the call: appended v rows and unrotated dims of k rows are bit copies of
//     v_new/k_new, rotated dims are the float64 rotation correctly rounded up to fp32
//     arithmetic (see expect_cache_appended), every other byte of both caches is unchanged.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "sweep.hpp"

namespace flashattn::testing {
namespace {

enum class Rotary { Off, Interleaved, NeoX };

struct KvCase {
  std::string name;
  std::vector<int32_t> seqlens{37, 5};  // cache_seqlens before the append; B = its size
  int64_t seqlen_q = 1, seqlen_new = 1, heads = 4, heads_k = 2, head_dim = 64;
  DType dtype = DType::Float32;
  int64_t page_size = 0;  // 0: dense cache
  bool batch_idx = false;  // dense: sequences in a shuffled subset of B + 2 cache rows
  bool leftpad = false;    // random cache_leftpad in [0, cache_seqlens[b]]
  Rotary rotary = Rotary::Off;
  int64_t rotary_dim = 0;  // 0: D
  Mask mask = kMasks[0];
  float softcap = 0.0f;
  Case::Alibi alibi = Case::Alibi::Off;
  int32_t num_splits = 0;
  bool with_lse = true;
  bool empty_new = false;  // seqlen_new = 0 passed as empty k_new/v_new instead of none
  int32_t num_threads = 0;
  // fp8 e4m3 caches (q and k_new/v_new keep dtype) with random k_descale/v_descale (B, Hk).
  bool fp8_cache = false;

  DType cache_dtype() const { return fp8_cache ? DType::Float8E4M3 : dtype; }

  std::string describe() const {
    std::string s = name + ": B=" + std::to_string(seqlens.size()) + " seqlens=(";
    for (size_t i = 0; i < seqlens.size(); ++i) {
      if (i) s += ',';
      s += std::to_string(seqlens[i]);
    }
    s += ") Sq=" + std::to_string(seqlen_q) + " S_new=" + std::to_string(seqlen_new) +
         " H=" + std::to_string(heads) + " Hk=" + std::to_string(heads_k) +
         " D=" + std::to_string(head_dim) + " " + dtype_name(dtype) +
         (page_size ? " page_size=" + std::to_string(page_size) : std::string(" dense")) +
         (batch_idx ? " cache_batch_idx" : "") + (leftpad ? " leftpad" : "") +
         (rotary == Rotary::Off ? ""
                                : std::string(rotary == Rotary::Interleaved ? " rotary(interleaved"
                                                                            : " rotary(neox") +
                                      " dim " + std::to_string(rotary_dim ? rotary_dim : head_dim) +
                                      ")") +
         " mask=" + mask.name + (softcap > 0 ? " softcap" : "") +
         (alibi == Case::Alibi::PerHead ? " alibi(H)" : "") +
         (alibi == Case::Alibi::PerBatchHead ? " alibi(B,H)" : "") +
         " num_splits=" + std::to_string(num_splits) + (with_lse ? "" : " no-lse") +
         (fp8_cache ? " fp8-cache" : "") +
         " seed=" + std::to_string(test_seed());
    return s;
  }
};

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

std::vector<double> values_of(Buffer& b) {
  return reference::gather(TensorView::contiguous(b.data(), b.dtype, {b.count()}));
}

// One call's host tensors, built from a case.
struct KvProblem {
  KvCase c;
  int64_t B, Sq, Sn, H, Hk, D, rd = 0;
  int64_t cache_rows = 0, cache_dim1 = 0, capacity = 0, max_pages = 0;
  std::vector<int32_t> leftpad, batch_idx, table;
  Buffer q, k_cache, v_cache, k_new, v_new, cos, sin, seqlens_buf, leftpad_buf, batch_idx_buf,
      table_buf, slopes, out, lse, k_descale, v_descale;
  Options options;
  KvCache cache;
  TensorView q_view, out_view, lse_view;

  explicit KvProblem(const KvCase& kc) : c(kc) {
    c.dtype = backend_dtype(c.dtype);
    B = static_cast<int64_t>(c.seqlens.size());
    Sq = c.seqlen_q;
    Sn = c.seqlen_new;
    H = c.heads;
    Hk = c.heads_k;
    D = c.head_dim;
    if (c.rotary != Rotary::Off) rd = c.rotary_dim ? c.rotary_dim : D;
    int64_t longest = 0;
    for (int32_t n : c.seqlens) longest = std::max<int64_t>(longest, n + Sn);
    if (c.page_size == 0) {
      cache_dim1 = capacity = longest + 3;  // rows past every sequence: must stay untouched
      cache_rows = c.batch_idx ? B + 2 : B;
    } else {
      max_pages = ceil_div(longest + 1, c.page_size);
      capacity = max_pages * c.page_size;
      cache_rows = B * max_pages + 3;  // three pages no sequence uses
      cache_dim1 = c.page_size;
    }

    for (int64_t b = 0; b < B; ++b)
      leftpad.push_back(c.leftpad ? std::uniform_int_distribution<int32_t>(0, c.seqlens[size_t(b)])(rng())
                                  : 0);
    std::vector<int32_t> perm(static_cast<size_t>(cache_rows));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng());
    if (c.batch_idx) batch_idx.assign(perm.begin(), perm.begin() + B);
    if (c.page_size) table.assign(perm.begin(), perm.begin() + B * max_pages);

    // The cache: NaN everywhere but the positions the sequences own before the call.
    const int64_t row = Hk * D;
    k_cache = Buffer(c.cache_dtype(), cache_rows * cache_dim1 * row);
    v_cache = Buffer(c.cache_dtype(), cache_rows * cache_dim1 * row);
    k_cache.poison();
    v_cache.poison();
    // An fp8 cache holds values scaled by 1/descale: N(0, 64^2) spreads them over e4m3's
    // exponents (a few saturate at 448: what the format does).
    std::normal_distribution<float> normal(0.0f, c.fp8_cache ? 64.0f : 1.0f);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t pos = leftpad[size_t(b)]; pos < c.seqlens[size_t(b)]; ++pos)
        for (int64_t e = 0; e < row; ++e) {
          k_cache.set(storage_row(b, pos) * row + e, normal(rng()));
          v_cache.set(storage_row(b, pos) * row + e, normal(rng()));
        }

    q = Buffer(c.dtype, B * Sq * H * D);
    q.fill_random();
    q_view = q.view({B, Sq, H, D});
    cache.k_cache = k_cache.view({cache_rows, cache_dim1, Hk, D});
    cache.v_cache = v_cache.view({cache_rows, cache_dim1, Hk, D});
    seqlens_buf = int32_buffer(c.seqlens);
    cache.cache_seqlens = seqlens_buf.view({B});
    if (Sn > 0 || c.empty_new) {
      k_new = Buffer(c.dtype, B * Sn * Hk * D);
      v_new = Buffer(c.dtype, B * Sn * Hk * D);
      k_new.fill_random();
      v_new.fill_random();
      cache.k_new = k_new.view({B, Sn, Hk, D});
      cache.v_new = v_new.view({B, Sn, Hk, D});
    }
    if (rd > 0) {
      const int64_t rows = longest + Sq + 1;
      cos = Buffer(c.dtype, rows * (rd / 2));
      sin = Buffer(c.dtype, rows * (rd / 2));
      for (int64_t pos = 0; pos < rows; ++pos)
        for (int64_t i = 0; i < rd / 2; ++i) {
          const double angle = static_cast<double>(pos) * std::pow(10000.0, -2.0 * i / rd);
          cos.set(pos * (rd / 2) + i, static_cast<float>(std::cos(angle)));
          sin.set(pos * (rd / 2) + i, static_cast<float>(std::sin(angle)));
        }
      cache.rotary_cos = cos.view({rows, rd / 2});
      cache.rotary_sin = sin.view({rows, rd / 2});
      cache.rotary_interleaved = c.rotary == Rotary::Interleaved;
    }
    if (c.leftpad) {
      leftpad_buf = int32_buffer(leftpad);
      cache.cache_leftpad = leftpad_buf.view({B});
    }
    if (c.batch_idx) {
      batch_idx_buf = int32_buffer(batch_idx);
      cache.cache_batch_idx = batch_idx_buf.view({B});
    }
    if (c.page_size) {
      table_buf = int32_buffer(table);
      cache.block_table = table_buf.view({B, max_pages});
    }
    cache.num_splits = c.num_splits;

    Case shape;  // for options_of
    shape.batch = B;
    shape.heads = H;
    shape.causal = c.mask.causal;
    shape.window_left = c.mask.left;
    shape.window_right = c.mask.right;
    shape.softcap = c.softcap;
    shape.alibi = c.alibi;
    options = options_of(shape, slopes);
    if (c.fp8_cache) {
      std::uniform_real_distribution<float> factor(1.0f / 128, 1.0f / 16);
      k_descale = Buffer(DType::Float32, B * Hk);
      v_descale = Buffer(DType::Float32, B * Hk);
      for (int64_t i = 0; i < B * Hk; ++i) {
        k_descale.set(i, factor(rng()));
        v_descale.set(i, factor(rng()));
      }
      options.k_descale = k_descale.view({B, Hk});
      options.v_descale = v_descale.view({B, Hk});
    }

    out = Buffer(c.dtype, B * Sq * H * D);
    lse = Buffer(DType::Float32, B * H * Sq);
    out_view = out.view({B, Sq, H, D});
    lse_view = lse.view({B, H, Sq});
  }

  // Where cache position `pos` of sequence b lives: a row of the (dim0 * dim1) rows.
  int64_t storage_row(int64_t b, int64_t pos) const {
    if (c.page_size == 0) return (c.batch_idx ? batch_idx[size_t(b)] : b) * cache_dim1 + pos;
    return int64_t{table[size_t(b * max_pages + pos / c.page_size)]} * c.page_size +
           pos % c.page_size;
  }

  bool rotary_per_row() const { return c.mask.causal || c.mask.left >= 0 || c.mask.right >= 0; }
  std::optional<TensorView> lse_arg() const {
    return c.with_lse ? std::optional<TensorView>(lse_view) : std::nullopt;
  }
};

// Runs the call on the suite's backend with poisoned outputs; on CUDA every tensor is
// mirrored to the GPU and the outputs and both caches are copied back.
RunInfo run_on_backend(KvProblem& p, Execution execution = {}) {
  execution.backend = kTestBackend;
  if (p.c.num_threads) execution.num_threads = p.c.num_threads;
  p.out.poison();
  p.lse.poison();
#ifndef FLASHATTN_TEST_CUDA
  return forward_kvcache(p.q_view, p.cache, p.out_view, p.lse_arg(), p.options, execution);
#else
  const KvCache& h = p.cache;
  DeviceMirror mq(p.q_view), mk(h.k_cache), mv(h.v_cache), mseq(h.cache_seqlens),
      mout(p.out_view), mlse(p.lse_view);
  std::optional<DeviceMirror> mkn, mvn, mcos, msin, midx, mpad, mtable, mslopes;
  KvCache d = h;
  d.k_cache = mk.view();
  d.v_cache = mv.view();
  d.cache_seqlens = mseq.view();
  const auto mirror = [](std::optional<DeviceMirror>& m, const std::optional<TensorView>& host,
                         std::optional<TensorView>& device) {
    if (host) device = m.emplace(*host).view();
  };
  mirror(mkn, h.k_new, d.k_new);
  mirror(mvn, h.v_new, d.v_new);
  mirror(mcos, h.rotary_cos, d.rotary_cos);
  mirror(msin, h.rotary_sin, d.rotary_sin);
  mirror(midx, h.cache_batch_idx, d.cache_batch_idx);
  mirror(mpad, h.cache_leftpad, d.cache_leftpad);
  mirror(mtable, h.block_table, d.block_table);
  Options options = p.options;
  mirror(mslopes, p.options.alibi_slopes, options.alibi_slopes);
  std::optional<DeviceMirror> mkd, mvd;
  mirror(mkd, p.options.k_descale, options.k_descale);
  mirror(mvd, p.options.v_descale, options.v_descale);
  mout.poison();
  mlse.poison();
  std::optional<TensorView> lse;
  if (p.c.with_lse) lse = mlse.view();
  const RunInfo info = forward_kvcache(mq.view(), d, mout.view(), lse, options, execution);
  cuda_check(cudaDeviceSynchronize(), "kernel");
  mout.download();
  if (p.c.with_lse) mlse.download();
  mk.download();
  mv.download();
  return info;
#endif
}

// x (head_dim values) rotated at cache position `pos`, in float64, from docs/SPEC.md's definition.
std::vector<double> rotate(const std::vector<double>& x, const KvProblem& p,
                           const std::vector<double>& cos, const std::vector<double>& sin,
                           int64_t pos) {
  std::vector<double> y = x;
  const int64_t half = p.rd / 2;
  for (int64_t i = 0; i < half; ++i) {
    const int64_t a = p.c.rotary == Rotary::Interleaved ? 2 * i : i;
    const int64_t b = p.c.rotary == Rotary::Interleaved ? 2 * i + 1 : i + half;
    const double c = cos[size_t(pos * half + i)], s = sin[size_t(pos * half + i)];
    y[size_t(a)] = x[size_t(a)] * c - x[size_t(b)] * s;
    y[size_t(b)] = x[size_t(a)] * s + x[size_t(b)] * c;
  }
  return y;
}

std::vector<int64_t> every_sequence(const KvProblem& p) {
  std::vector<int64_t> all(static_cast<size_t>(p.B));
  std::iota(all.begin(), all.end(), 0);
  return all;
}

// A float64 value rounded (through fp32) to a storage dtype and back.
double round_to(DType dtype, double x) {
  Buffer one(dtype, 1);
  one.set(0, static_cast<float>(x));
  return values_of(one)[0];
}

// The float64 expectation of a call, from the cache as it was before it, for the given
// sequences' out and lse rows. With fp8 caches every key and value is its stored e4m3 value
// (the old rows from the caches before the call, the appended ones as the call stored them:
// expect_fp8_row_appended checks those) times the sequence's factor for its head, q is rotated
// in float64 and rounded to its dtype, all of it in fp32 buffers, and the result must meet the
// CPU engine's rule for dequantised inputs (fp32 arithmetic, out rounded once).
void expect_attention_matches(KvProblem& p, Buffer& k_before, Buffer& v_before,
                              const std::vector<int64_t>& sequences) {
  const bool fp8 = p.c.fp8_cache;
  const std::vector<double> q = values_of(p.q);
  const std::vector<double> cos = p.rd ? values_of(p.cos) : std::vector<double>{};
  const std::vector<double> sin = p.rd ? values_of(p.sin) : std::vector<double>{};
  const std::vector<double> k_new = p.Sn ? values_of(p.k_new) : std::vector<double>{};
  const std::vector<double> none;
  const std::vector<double> k_old = fp8 ? values_of(k_before) : none;
  const std::vector<double> v_old = fp8 ? values_of(v_before) : none;
  const std::vector<double> k_after = fp8 ? values_of(p.k_cache) : none;
  const std::vector<double> v_after = fp8 ? values_of(p.v_cache) : none;
  const std::vector<double> k_factor = fp8 ? values_of(p.k_descale) : none;
  const std::vector<double> v_factor = fp8 ? values_of(p.v_descale) : none;
  const DType buffers = fp8 ? DType::Float32 : p.c.dtype;  // of the reference's q, k and v
  const size_t elem = dtype_size(p.c.dtype);
  const int64_t D = p.D, row = p.Hk * D;
  std::vector<double> exact_out, exact_lse, low_out, low_lse, got_out, got_lse;
  const std::vector<double> all_out = reference::gather(p.out_view);
  const std::vector<double> all_lse = p.c.with_lse ? reference::gather(p.lse_view) : std::vector<double>{};
  const int64_t out_rows = p.Sq * p.H * D, lse_rows = p.H * p.Sq;  // per sequence
  for (const int64_t b : sequences) {
    got_out.insert(got_out.end(), all_out.begin() + b * out_rows, all_out.begin() + (b + 1) * out_rows);
    if (p.c.with_lse)
      got_lse.insert(got_lse.end(), all_lse.begin() + b * lse_rows, all_lse.begin() + (b + 1) * lse_rows);
    const int64_t filled = p.c.seqlens[size_t(b)], begin = p.leftpad[size_t(b)];
    const int64_t Sk = filled + p.Sn - begin;
    Buffer kb(buffers, Sk * row), vb(buffers, Sk * row), qb(buffers, p.Sq * p.H * D);
    for (int64_t j = 0; j < Sk; ++j) {
      const int64_t pos = begin + j;
      if (fp8) {  // the stored value times its factor
        const int64_t at = p.storage_row(b, pos) * row;
        const std::vector<double>& k_cache = pos >= filled ? k_after : k_old;
        const std::vector<double>& v_cache = pos >= filled ? v_after : v_old;
        for (int64_t hk = 0; hk < p.Hk; ++hk)
          for (int64_t d = 0; d < D; ++d) {
            const size_t e = size_t(at + hk * D + d);
            kb.set((j * p.Hk + hk) * D + d, static_cast<float>(k_cache[e] * k_factor[size_t(b * p.Hk + hk)]));
            vb.set((j * p.Hk + hk) * D + d, static_cast<float>(v_cache[e] * v_factor[size_t(b * p.Hk + hk)]));
          }
        continue;
      }
      if (pos < filled) {  // an old row, as stored
        std::memcpy(kb.bytes.data() + j * row * elem,
                    k_before.bytes.data() + p.storage_row(b, pos) * row * elem, row * elem);
        std::memcpy(vb.bytes.data() + j * row * elem,
                    v_before.bytes.data() + p.storage_row(b, pos) * row * elem, row * elem);
        continue;
      }
      const int64_t t = pos - filled;  // an appended row: k rotated and rounded, v as given
      std::memcpy(vb.bytes.data() + j * row * elem,
                  p.v_new.bytes.data() + (b * p.Sn + t) * row * elem, row * elem);
      for (int64_t hk = 0; hk < p.Hk; ++hk) {
        const size_t at = size_t(((b * p.Sn + t) * p.Hk + hk) * D);
        std::vector<double> x(k_new.begin() + at, k_new.begin() + at + D);
        if (p.rd) x = rotate(x, p, cos, sin, pos);
        for (int64_t d = 0; d < D; ++d)
          kb.set((j * p.Hk + hk) * D + d, static_cast<float>(x[size_t(d)]));
      }
    }
    for (int64_t t = 0; t < p.Sq; ++t)
      for (int64_t h = 0; h < p.H; ++h) {
        const size_t at = size_t(((b * p.Sq + t) * p.H + h) * D);
        std::vector<double> x(q.begin() + at, q.begin() + at + D);
        if (p.rd) x = rotate(x, p, cos, sin, filled + (p.rotary_per_row() ? t : 0));
        for (int64_t d = 0; d < D; ++d)
          qb.set((t * p.H + h) * D + d, static_cast<float>(fp8 ? round_to(p.c.dtype, x[size_t(d)]) : x[size_t(d)]));
      }
    Options o = p.options;
    o.k_descale.reset();  // fp8 caches: applied above
    o.v_descale.reset();
    if (o.alibi_slopes) {  // this sequence's slopes, (H)
      const int64_t offset = o.alibi_slopes->ndim == 2 ? b * p.H : 0;
      o.alibi_slopes = TensorView::contiguous(static_cast<float*>(p.slopes.data()) + offset,
                                              DType::Float32, {p.H});
    }
    const TensorView qv = qb.view({1, p.Sq, p.H, D}), kv = kb.view({1, Sk, p.Hk, D}),
                     vv = vb.view({1, Sk, p.Hk, D});
    const reference::Result exact = reference::forward(qv, kv, vv, o);
    exact_out.insert(exact_out.end(), exact.out.begin(), exact.out.end());
    exact_lse.insert(exact_lse.end(), exact.lse.begin(), exact.lse.end());
    if (!fp8 && p.c.dtype != DType::Float32) {
      const reference::Result low =
          reference::forward(qv, kv, vv, o, nullptr, reference::Arithmetic::InputDType);
      low_out.insert(low_out.end(), low.out.begin(), low.out.end());
      low_lse.insert(low_lse.end(), low.lse.begin(), low.lse.end());
    }
  }
  const auto check = [&](const std::vector<double>& got, const std::vector<double>& exact,
                         const std::vector<double>& low) {
    return fp8 ? reference::check_forward_dequantised(got, exact)
               : reference::check_forward(p.c.dtype, got, exact, low);
  };
  const reference::Check out_check = check(got_out, exact_out, low_out);
  EXPECT_TRUE(out_check.passed()) << "out: max abs error " << out_check.max_abs_error
                                  << " > tolerance " << out_check.tolerance;
  if (p.c.with_lse) {
    const reference::Check lse_check = check(got_lse, exact_lse, low_lse);
    EXPECT_TRUE(lse_check.passed()) << "lse: max abs error " << lse_check.max_abs_error
                                    << " > tolerance " << lse_check.tolerance;
  }
}

void expect_attention_matches(KvProblem& p, Buffer& k_before, Buffer& v_before) {
  expect_attention_matches(p, k_before, v_before, every_sequence(p));
}

// The unit roundoff of a dtype: half the distance from 1 to the next number.
double unit_roundoff(DType d) {
  return d == DType::Float32 ? 0x1p-24 : d == DType::Float16 ? 0x1p-11 : 0x1p-8;
}

// An appended row of an fp8 cache (storage row r, from row src = b * Sn + t of k_new/v_new,
// cache position pos): a v element, and a k element past rotary_dim, is e4m3(x / factor)
// bitwise (the quotient in fp32, rounded once, saturating); a rotated k element is within
// half an e4m3 step (2^-4 relative; 2^-10 among the subnormals) of the exact rotation over
// the factor (saturated), allowing for the rotation's own rounding to q's dtype as above.
void expect_fp8_row_appended(KvProblem& p, int64_t r, int64_t src, int64_t b, int64_t pos,
                             int64_t& copies_wrong, int64_t& rotations_wrong, std::string& first) {
  const int64_t D = p.D;
  const std::vector<double> k_new = values_of(p.k_new), v_new = values_of(p.v_new);
  const std::vector<double> cos = p.rd ? values_of(p.cos) : std::vector<double>{};
  const std::vector<double> sin = p.rd ? values_of(p.sin) : std::vector<double>{};
  const auto* k_stored = reinterpret_cast<const detail::float8_e4m3_t*>(p.k_cache.bytes.data());
  const auto* v_stored = reinterpret_cast<const detail::float8_e4m3_t*>(p.v_cache.bytes.data());
  const double u = unit_roundoff(p.c.dtype) + 4 * 0x1p-24;
  for (int64_t hk = 0; hk < p.Hk; ++hk) {
    const float kf = static_cast<float>(values_of(p.k_descale)[size_t(b * p.Hk + hk)]);
    const float vf = static_cast<float>(values_of(p.v_descale)[size_t(b * p.Hk + hk)]);
    const size_t in = size_t((src * p.Hk + hk) * D), at = size_t((r * p.Hk + hk) * D);
    for (int64_t d = 0; d < D; ++d) {
      const uint8_t v_want = detail::to_float8_e4m3(static_cast<float>(v_new[in + size_t(d)]) / vf).bits;
      if (v_stored[at + size_t(d)].bits != v_want && !copies_wrong++)
        first = "v element " + std::to_string(d) + " of sequence " + std::to_string(b) + " position " + std::to_string(pos);
      if (d < p.rd) continue;
      const uint8_t k_want = detail::to_float8_e4m3(static_cast<float>(k_new[in + size_t(d)]) / kf).bits;
      if (k_stored[at + size_t(d)].bits != k_want && !copies_wrong++)
        first = "unrotated k element " + std::to_string(d) + " of sequence " + std::to_string(b) + " position " + std::to_string(pos);
    }
    const std::vector<double> x(k_new.begin() + in, k_new.begin() + in + D);
    const std::vector<double> y = rotate(x, p, cos, sin, pos);
    const int64_t half = p.rd / 2;
    for (int64_t d = 0; d < p.rd; ++d) {
      const int64_t i = p.c.rotary == Rotary::Interleaved ? d / 2 : d % half;
      const int64_t partner = p.c.rotary == Rotary::Interleaved ? (d % 2 ? d - 1 : d + 1) : (d < half ? d + half : d - half);
      const double c = cos[size_t(pos * half + i)], s = sin[size_t(pos * half + i)];
      const double rounding = u * (std::abs(x[size_t(d)] * c) + std::abs(x[size_t(partner)] * s)) / kf;
      const double want = std::clamp(y[size_t(d)] / kf, -448.0, 448.0);
      const double got = detail::to_float(k_stored[at + size_t(d)]);
      if (!(std::abs(got - want) <= 0x1p-4 * std::abs(want) + 0x1p-10 + rounding) && !rotations_wrong++)
        first = "rotated k element " + std::to_string(d) + " of sequence " + std::to_string(b) +
                " position " + std::to_string(pos) + ": got " + std::to_string(got) +
                ", expected " + std::to_string(want);
    }
  }
}

// The caches after the call: the given sequences' appended rows where they belong, every
// other byte unchanged. A rotated element y = x0 c - x1 s (or x0 s + x1 c) must be the float64 value rounded to
// the dtype, allowing for fp32 arithmetic before that single rounding (fused or not):
//   |y - exact| <= (u_dtype + 4 u_fp32) (|x0 c| + |x1 s|)   (+ 2^-24 for fp16 subnormals).
void expect_cache_appended(KvProblem& p, Buffer& k_before, Buffer& v_before,
                           const std::vector<int64_t>& sequences) {
  const size_t elem = dtype_size(p.c.cache_dtype());
  const int64_t D = p.D, row = p.Hk * D;
  std::vector<int64_t> writer(size_t(p.cache_rows * p.cache_dim1), -1);  // b * Sn + t
  for (const int64_t b : sequences)
    for (int64_t t = 0; t < p.Sn; ++t)
      writer[size_t(p.storage_row(b, p.c.seqlens[size_t(b)] + t))] = b * p.Sn + t;
  const std::vector<double> k_after = values_of(p.k_cache);
  const std::vector<double> k_new = p.Sn ? values_of(p.k_new) : std::vector<double>{};
  const std::vector<double> cos = p.rd ? values_of(p.cos) : std::vector<double>{};
  const std::vector<double> sin = p.rd ? values_of(p.sin) : std::vector<double>{};
  const double u = unit_roundoff(p.c.dtype) + 4 * 0x1p-24;
  const double floor = p.c.dtype == DType::Float16 ? 0x1p-24 : 0.0;
  int64_t untouched_changed = 0, copies_wrong = 0, rotations_wrong = 0;
  std::string first;
  for (int64_t r = 0; r < int64_t(writer.size()); ++r) {
    const size_t offset = size_t(r * row) * elem;
    if (writer[size_t(r)] < 0) {
      if (std::memcmp(p.k_cache.bytes.data() + offset, k_before.bytes.data() + offset, row * elem) ||
          std::memcmp(p.v_cache.bytes.data() + offset, v_before.bytes.data() + offset, row * elem)) {
        if (!untouched_changed++) first = "cache row " + std::to_string(r) + " changed";
      }
      continue;
    }
    const int64_t src = writer[size_t(r)];
    const int64_t b = src / p.Sn, pos = p.c.seqlens[size_t(b)] + src % p.Sn;
    if (p.c.fp8_cache) {
      expect_fp8_row_appended(p, r, src, b, pos, copies_wrong, rotations_wrong, first);
      continue;
    }
    if (std::memcmp(p.v_cache.bytes.data() + offset, p.v_new.bytes.data() + size_t(src * row) * elem,
                    row * elem)) {
      if (!copies_wrong++) first = "v row of sequence " + std::to_string(b) + " position " + std::to_string(pos);
    }
    for (int64_t hk = 0; hk < p.Hk; ++hk) {
      const size_t in = size_t((src * p.Hk + hk) * D), at = size_t((r * p.Hk + hk) * D);
      // Dims past rotary_dim: bit copies.
      if (std::memcmp(p.k_cache.bytes.data() + (at + size_t(p.rd)) * elem,
                      p.k_new.bytes.data() + (in + size_t(p.rd)) * elem, size_t(D - p.rd) * elem)) {
        if (!copies_wrong++) first = "unrotated k dims of sequence " + std::to_string(b) + " position " + std::to_string(pos);
      }
      const int64_t half = p.rd / 2;
      for (int64_t i = 0; i < half; ++i) {
        const int64_t a = p.c.rotary == Rotary::Interleaved ? 2 * i : i;
        const int64_t bb = p.c.rotary == Rotary::Interleaved ? 2 * i + 1 : i + half;
        const double x0 = k_new[in + size_t(a)], x1 = k_new[in + size_t(bb)];
        const double c = cos[size_t(pos * half + i)], s = sin[size_t(pos * half + i)];
        const double ya = x0 * c - x1 * s, yb = x0 * s + x1 * c;
        const double ta = u * (std::abs(x0 * c) + std::abs(x1 * s)) + floor;
        const double tb = u * (std::abs(x0 * s) + std::abs(x1 * c)) + floor;
        const double ga = k_after[at + size_t(a)], gb = k_after[at + size_t(bb)];
        if (!(std::abs(ga - ya) <= ta) || !(std::abs(gb - yb) <= tb)) {
          if (!rotations_wrong++)
            first = "rotated k of sequence " + std::to_string(b) + " position " +
                    std::to_string(pos) + " head " + std::to_string(hk) + " pair " +
                    std::to_string(i) + ": got (" + std::to_string(ga) + ", " +
                    std::to_string(gb) + "), expected (" + std::to_string(ya) + ", " +
                    std::to_string(yb) + ")";
        }
      }
    }
  }
  EXPECT_EQ(untouched_changed, 0) << "cache rows outside the appended positions changed; first: " << first;
  EXPECT_EQ(copies_wrong, 0) << "appended rows are not bit copies of k_new/v_new; first: " << first;
  EXPECT_EQ(rotations_wrong, 0) << "rotated keys off by more than a rounding; first: " << first;
}

void expect_cache_appended(KvProblem& p, Buffer& k_before, Buffer& v_before) {
  expect_cache_appended(p, k_before, v_before, every_sequence(p));
}

RunInfo run_and_check(const KvCase& c) {
  SCOPED_TRACE(c.describe());
  KvProblem p(c);
  Buffer k_before = p.k_cache, v_before = p.v_cache;
  const RunInfo info = run_on_backend(p);
  EXPECT_EQ(info.backend, kTestBackend);
  if (c.num_splits > 0) {
    EXPECT_EQ(info.num_splits, c.num_splits);
  }
  EXPECT_GE(info.num_splits, 1);
  expect_attention_matches(p, k_before, v_before);
  expect_cache_appended(p, k_before, v_before);
  return info;
}

// ---- The grid ----------------------------------------------------------------------------
// Case n takes each axis's value from a hash of (n, axis): a fixed grid in which the axes
// vary independently (a shared cycle would lock axes of equal length together), and in which
// every value of every axis occurs (KvCacheGridCoverage checks).

struct Layout {
  const char* name;
  int64_t page_size;
  bool batch_idx;
};
constexpr Layout kLayouts[] = {{"dense", 0, false}, {"batchidx", 0, true}, {"page1", 1, false},
                               {"page3", 3, false}, {"page16", 16, false}, {"page256", 256, false}};
struct RotaryChoice {
  const char* name;
  Rotary rotary;
  int rotary_dim_eighths;  // of D; 0 = full
};
constexpr RotaryChoice kRotaries[] = {{"norope", Rotary::Off, 0},
                                      {"interleaved", Rotary::Interleaved, 0},
                                      {"neox", Rotary::NeoX, 0},
                                      {"neoxhalf", Rotary::NeoX, 4},
                                      {"interleavedquarter", Rotary::Interleaved, 2}};
struct Heads {
  int64_t heads, heads_k;
};
constexpr Heads kHeads[] = {{4, 4}, {8, 2}, {8, 1}, {6, 1}, {16, 2}};
constexpr int64_t kHeadDims[] = {64, 128, 40, 88, 256};
constexpr int64_t kSeqlenQ[] = {1, 3, 17, 70};  // 70: two query blocks
constexpr int64_t kSeqlenNew[] = {0, 1, 5, 66};  // 66: an append across key blocks
constexpr int32_t kSplits[] = {0, 1, 3, 64};
const std::vector<int32_t> kSeqlens[] = {{37, 5}, {0, 90, 12}, {150, 0}, {70, 131}, {3}};
constexpr int kGridSize = 140;

size_t pick(int n, size_t length, int axis) {
  uint64_t x = static_cast<uint64_t>(n) * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(axis);
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;  // splitmix64's finaliser
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return static_cast<size_t>((x ^ (x >> 31)) % length);
}

enum Axis { kLayoutAxis, kRotaryAxis, kMaskAxis, kDtypeAxis, kSeqlenQAxis, kSeqlenNewAxis,
            kHeadsAxis, kHeadDimAxis, kSplitsAxis, kSeqlensAxis, kExtrasAxis, kAxes };

KvCase grid_case(int n) {
  KvCase c;
  const Layout& layout = kLayouts[pick(n, std::size(kLayouts), kLayoutAxis)];
  const RotaryChoice& rotary = kRotaries[pick(n, std::size(kRotaries), kRotaryAxis)];
  const Mask& mask = kMasks[pick(n, std::size(kMasks), kMaskAxis)];
  const size_t dtype_index = pick(n, std::size(kDtypes), kDtypeAxis);
  c.page_size = layout.page_size;
  c.batch_idx = layout.batch_idx;
  c.rotary = rotary.rotary;
  c.mask = mask;
  c.dtype = kDtypes[dtype_index];
  c.seqlen_q = kSeqlenQ[pick(n, std::size(kSeqlenQ), kSeqlenQAxis)];
  c.seqlen_new = kSeqlenNew[pick(n, std::size(kSeqlenNew), kSeqlenNewAxis)];
  const Heads heads = kHeads[pick(n, std::size(kHeads), kHeadsAxis)];
  c.heads = heads.heads;
  c.heads_k = heads.heads_k;
  c.head_dim = kHeadDims[pick(n, std::size(kHeadDims), kHeadDimAxis)];
  if (rotary.rotary_dim_eighths) c.rotary_dim = c.head_dim * rotary.rotary_dim_eighths / 8 / 2 * 2;
  c.num_splits = kSplits[pick(n, std::size(kSplits), kSplitsAxis)];
  c.seqlens = kSeqlens[pick(n, std::size(kSeqlens), kSeqlensAxis)];
  // Extras: leftpad, no lse, softcap, ALiBi (H) and (B, H), each about a third of the time.
  const size_t extras = pick(n, 32, kExtrasAxis);
  c.leftpad = extras % 3 == 1;
  c.with_lse = extras % 4 != 3;
  c.softcap = extras / 4 % 3 == 2 ? 2.5f : 0.0f;
  c.alibi = extras / 12 == 1 ? Case::Alibi::PerHead
                             : extras / 12 == 2 ? Case::Alibi::PerBatchHead : Case::Alibi::Off;
  c.name = std::to_string(n) + "_" + layout.name + "_" + rotary.name + "_" + mask.name + "_" +
           dtype_name(c.dtype) + (dtype_index == 0 && c.dtype == DType::Float16 ? "_for_fp32" : "");
  return c;
}

class KvCacheGrid : public ::testing::TestWithParam<int> {};

TEST_P(KvCacheGrid, MatchesReferenceAndAppendsInPlace) { run_and_check(grid_case(GetParam())); }

INSTANTIATE_TEST_SUITE_P(Features, KvCacheGrid, ::testing::Range(0, kGridSize),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return grid_case(info.param).name;
                         });

// Every value of every axis occurs in the grid (a failed hash spread would silently drop one).
TEST(KvCacheGridCoverage, EveryAxisValueOccurs) {
  const size_t lengths[kAxes] = {std::size(kLayouts), std::size(kRotaries), std::size(kMasks),
                                 std::size(kDtypes),  std::size(kSeqlenQ),  std::size(kSeqlenNew),
                                 std::size(kHeads),   std::size(kHeadDims), std::size(kSplits),
                                 std::size(kSeqlens), 32};
  for (int axis = 0; axis < kAxes; ++axis) {
    std::vector<int> seen(lengths[axis]);
    for (int n = 0; n < kGridSize; ++n) ++seen[pick(n, lengths[axis], axis)];
    for (size_t v = 0; v < lengths[axis]; ++v)
      if (axis != kExtrasAxis) {
        EXPECT_GT(seen[v], 0) << "axis " << axis << " value " << v;
      }
  }
  int leftpad = 0, softcap = 0, alibi = 0, no_lse = 0;
  for (int n = 0; n < kGridSize; ++n) {
    const KvCase c = grid_case(n);
    leftpad += c.leftpad;
    softcap += c.softcap > 0;
    alibi += c.alibi != Case::Alibi::Off;
    no_lse += !c.with_lse;
  }
  EXPECT_GT(leftpad, 10);
  EXPECT_GT(softcap, 10);
  EXPECT_GT(alibi, 10);
  EXPECT_GT(no_lse, 10);
}

// ---- FP8 caches ----------------------------------------------------------------------------
// Every grid case again with fp8 e4m3 caches: against the float64 reference of the dequantised
// caches, and the append's quantisation. On CUDA the decode kernel runs them for head dims
// that are multiples of 16; other head dims are refused before anything is written.

constexpr int kFp8GridSize = 40;

KvCase fp8_grid_case(int n) {
  KvCase c = grid_case(n);
  c.fp8_cache = true;
  c.name += "_fp8cache";
  return c;
}

#ifdef FLASHATTN_TEST_CUDA
// The call refused with Unsupported naming k_cache (and `expected` in what it expected), the
// caches untouched.
void expect_fp8_refused(const KvCase& c, const std::string& expected) {
  SCOPED_TRACE(c.describe());
  KvProblem p(c);
  const Buffer k_before = p.k_cache, v_before = p.v_cache;
  try {
    run_on_backend(p);
    ADD_FAILURE() << "fp8 caches ran";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Unsupported) << e.what();
    EXPECT_EQ(e.argument(), "k_cache") << e.what();
    EXPECT_NE(e.expected().find(expected), std::string::npos) << e.what();
  }
  EXPECT_EQ(p.k_cache.bytes, k_before.bytes);
  EXPECT_EQ(p.v_cache.bytes, v_before.bytes);
}
#endif

class KvCacheFp8Grid : public ::testing::TestWithParam<int> {};

TEST_P(KvCacheFp8Grid, MatchesReferenceAndAppendsQuantised) {
  const KvCase c = fp8_grid_case(GetParam());
#ifdef FLASHATTN_TEST_CUDA
  if (c.head_dim % 16 != 0) return expect_fp8_refused(c, "multiple of 16");
#endif
  run_and_check(c);
}

INSTANTIATE_TEST_SUITE_P(Fp8, KvCacheFp8Grid, ::testing::Range(0, kFp8GridSize),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return fp8_grid_case(info.param).name;
                         });

// Without descales every factor is 1: the stored values are the values.
TEST(KvCacheFp8, AbsentDescalesAreOne) {
  KvProblem p(KvCase{.name = "no descales", .seqlens = {20, 3}, .seqlen_q = 2, .seqlen_new = 4,
                     .dtype = DType::BFloat16, .fp8_cache = true});
  p.options.k_descale.reset();
  p.options.v_descale.reset();
  for (int64_t i = 0; i < p.B * p.Hk; ++i) {
    p.k_descale.set(i, 1.0f);
    p.v_descale.set(i, 1.0f);
  }
  Buffer k_before = p.k_cache, v_before = p.v_cache;
  run_on_backend(p);
  expect_attention_matches(p, k_before, v_before);
  expect_cache_appended(p, k_before, v_before);
}

// Appended values beyond e4m3's range saturate at +-448 rather than turning into NaN, and a
// NaN stays NaN (docs/SPEC.md, "Decoding with a KV cache").
TEST(KvCacheFp8, AppendSaturatesAndKeepsNan) {
  KvProblem p(KvCase{.name = "saturation", .seqlens = {5}, .seqlen_q = 1, .seqlen_new = 1,
                     .heads = 1, .heads_k = 1, .head_dim = 64, .dtype = DType::Float32,
                     .fp8_cache = true});
  p.k_new.set(0, 1e6f);
  p.k_new.set(1, -1e6f);
  p.v_new.set(2, std::nanf(""));
  run_on_backend(p);
  const int64_t at = p.storage_row(0, 5) * p.D;
  const auto* k = reinterpret_cast<const detail::float8_e4m3_t*>(p.k_cache.bytes.data()) + at;
  const auto* v = reinterpret_cast<const detail::float8_e4m3_t*>(p.v_cache.bytes.data()) + at;
  EXPECT_EQ(detail::to_float(k[0]), 448.0f);
  EXPECT_EQ(detail::to_float(k[1]), -448.0f);
  EXPECT_TRUE(std::isnan(detail::to_float(v[2])));
}

// ---- Named cases -------------------------------------------------------------------------

TEST(KvCache, SequencesWithoutKeysGiveZeroOutAndMinusInfLse) {
  for (DType dt : kDtypes) {
    const KvCase c{.name = "no keys", .seqlens = {0, 9, 0}, .seqlen_q = 3, .seqlen_new = 0,
                   .dtype = dt, .num_splits = 2};
    SCOPED_TRACE(c.describe());
    KvProblem p(c);
    Buffer k_before = p.k_cache, v_before = p.v_cache;
    run_on_backend(p);
    expect_attention_matches(p, k_before, v_before);
    const std::vector<double> out = reference::gather(p.out_view);
    const auto* lse = static_cast<const float*>(p.lse.data());
    for (int64_t b : {0, 2})
      for (int64_t h = 0; h < p.H; ++h)
        for (int64_t i = 0; i < p.Sq; ++i) {
          EXPECT_EQ(lse[(b * p.H + h) * p.Sq + i], -std::numeric_limits<float>::infinity());
          for (int64_t d = 0; d < p.D; ++d)
            EXPECT_EQ(out[size_t(((b * p.Sq + i) * p.H + h) * p.D + d)], 0.0);
        }
  }
}

#ifndef FLASHATTN_TEST_CUDA
// FLASHATTN_CPU_AMX takes 0, 1 or nothing: anything else is an error naming it, raised before
// the append writes the cache (and not inside the worker threads, where it could not leave).
TEST(KvCache, BadCpuAmxSettingIsAnErrorBeforeTheAppend) {
  ScopedEnv bad("FLASHATTN_CPU_AMX", "2");
  KvProblem p(KvCase{.name = "bad setting", .dtype = DType::BFloat16});
  const Buffer k_before = p.k_cache, v_before = p.v_cache;
  Buffer out_poisoned = p.out;
  out_poisoned.poison();
  try {
    run_on_backend(p);
    ADD_FAILURE() << "FLASHATTN_CPU_AMX=2 was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
    EXPECT_EQ(e.argument(), "FLASHATTN_CPU_AMX") << e.what();
  }
  EXPECT_EQ(p.k_cache.bytes, k_before.bytes);
  EXPECT_EQ(p.v_cache.bytes, v_before.bytes);
  EXPECT_EQ(p.out.bytes, out_poisoned.bytes);
}
#endif

TEST(KvCache, EmptyNewKeysAreAccepted) {
  run_and_check({.name = "S_new = 0 given as tensors", .seqlen_new = 0, .rotary = Rotary::NeoX,
                 .mask = kMasks[1], .empty_new = true});
}

TEST(KvCache, EverySplitCountMatchesTheReference) {
  for (int32_t splits : {1, 2, 5, 17, 1024}) {
    run_and_check({.name = "splits", .seqlens = {400, 1, 257}, .seqlen_q = 2, .seqlen_new = 3,
                   .heads = 8, .heads_k = 2, .dtype = DType::BFloat16, .page_size = 16,
                   .mask = kMasks[2], .num_splits = splits});
  }
}

TEST(KvCache, AppendStraddlesPagesAndQueriesOutnumberKeys) {
  run_and_check({.name = "straddle",
                 .seqlens = {2, 0},
                 .seqlen_q = 17,  // causal: the first rows see no key at all
                 .seqlen_new = 7,
                 .dtype = DType::Float16,
                 .page_size = 3,
                 .leftpad = true,
                 .rotary = Rotary::Interleaved,
                 .mask = kMasks[1]});
}

TEST(KvCache, LongPagedDecode) {
  run_and_check({.name = "long decode", .seqlens = {2100, 777}, .seqlen_new = 1, .heads = 16,
                 .heads_k = 2, .head_dim = 128, .dtype = DType::BFloat16, .page_size = 16,
                 .rotary = Rotary::NeoX, .mask = kMasks[1]});
}

// The CPU engine packs the G query heads of a key/value head into one work item, position by
// position, in blocks of 64 packed rows: with G = 3 and Sq = 30 (90 rows) the second block
// starts mid-position (row 64 is head 1 of position 21), and every row keeps its own
// position (mask, ALiBi distance) and head (ALiBi slope) — on both backends.
TEST(KvCache, PackedQueryHeadsKeepTheirPositionsAndHeads) {
  for (const char* mask : {"causal", "band"}) {
    KvCase c{.name = "packed heads", .seqlens = {150, 91}, .seqlen_q = 30, .seqlen_new = 3,
             .heads = 6, .heads_k = 2, .head_dim = 40, .softcap = 5.0f,
             .alibi = Case::Alibi::PerBatchHead};
    for (const Mask& m : kMasks)
      if (std::string(m.name) == mask) c.mask = m;
    for (int32_t splits : {1, 3}) {
      c.num_splits = splits;
      run_and_check(c);
    }
  }
}

TEST(KvCache, OddHeadDims) {
  for (int64_t d : {8, 24, 40, 88, 136, 200, 256}) {
    run_and_check({.name = "head dim " + std::to_string(d), .seqlens = {65, 20}, .seqlen_q = 3,
                   .seqlen_new = 2, .head_dim = d, .dtype = kDtypes[size_t(d / 8) % 3],
                   .page_size = d % 3 ? 16 : 0,
                   .rotary = d % 16 ? Rotary::Interleaved : Rotary::NeoX,
                   .rotary_dim = d >= 16 ? d / 2 / 2 * 2 : 0,
                   .mask = kMasks[size_t(d / 8) % std::size(kMasks)]});
  }
}

// Head dims that are not multiples of 8. On CUDA the call runs on padded copies
// (cuda/head_dim_padding.hpp): q, k_new and v_new in, the positions each sequence holds
// copied from the caller's cache (dense, picked by cache_batch_idx, or paged) into a dense
// padded one, out and only the appended positions back, so every other cache byte must stay
// as it was (expect_cache_appended). Every dtype, with and without an append, rotary of an
// even rotary_dim below D (interleaved and not), masks, splits, leftpad, softcap, ALiBi.
TEST(KvCache, HeadDimsNotMultiplesOf8) {
  int n = 0;
  for (int64_t d : {1, 5, 59, 111, 250})
    for (DType dt : kDtypes) {
      const int64_t page_sizes[] = {0, 16, 3, 0};
      const int32_t splits[] = {0, 1, 3};
      const bool rotary = d >= 2 && n % 4 != 3;
      run_and_check({.name = "head dim " + std::to_string(d),
                     .seqlens = {65, 20, 0},
                     .seqlen_q = 1 + 2 * (n % 3),
                     .seqlen_new = n % 3 == 2 ? 0 : 1 + 4 * (n % 2),
                     .heads = 4,
                     .heads_k = n % 2 ? 1 : 2,
                     .head_dim = d,
                     .dtype = dt,
                     .page_size = page_sizes[n % 4],
                     .batch_idx = n % 4 == 3,
                     .leftpad = n % 5 == 1,
                     .rotary = !rotary ? Rotary::Off : n % 2 ? Rotary::Interleaved : Rotary::NeoX,
                     .rotary_dim = !rotary ? 0 : n % 2 ? d / 2 * 2 : d / 4 * 2 + 2,
                     .mask = kMasks[size_t(n) % std::size(kMasks)],
                     .softcap = n % 5 == 2 ? 2.5f : 0.0f,
                     .alibi = n % 7 == 3 ? Case::Alibi::PerHead : Case::Alibi::Off,
                     .num_splits = splits[n % 3]});
      ++n;
    }
}

// A plain decoding step (no append, rotary, softcap or ALiBi: the CUDA kernel's plain
// variant) over sequences of many key blocks, so that every shared-memory stage is reused
// several times, in each row addressing: dense with left padding, pages of 16
// (a lookup per row), pages of 64 and 256 without left padding (a lookup per 64-key block).
TEST(KvCachePlain, LongSequencesInEveryLayout) {
  struct PlainLayout {
    const char* name;
    int64_t page_size;
    bool leftpad;
  };
  for (const PlainLayout layout : {PlainLayout{"dense", 0, true}, PlainLayout{"page 16", 16, true},
                                   PlainLayout{"page 64", 64, false}, PlainLayout{"page 256", 256, false}}) {
    for (int64_t d : {40, 128, 256}) {
      for (int32_t splits : {1, 3}) {
        run_and_check({.name = std::string("plain ") + layout.name,
                       .seqlens = {700, 1000, 63},
                       .seqlen_new = 0,
                       .heads = 8,
                       .heads_k = 2,
                       .head_dim = d,
                       .dtype = d == 128 ? DType::Float16 : DType::BFloat16,
                       .page_size = layout.page_size,
                       .leftpad = layout.leftpad,
                       .mask = kMasks[splits == 1 ? 0 : 2],  // none, sliding
                       .num_splits = splits});
      }
    }
  }
}

// Plain decoding from cache rows picked by cache_batch_idx (more rows than sequences), with
// one kv head, bf16, a causal mask and 1 or 3 splits, at a head dim that fills its bucket
// (128) and one that leaves padding columns (112): sequences of many key blocks whose ends are
// not block-aligned, so that each CTA ends on a partial block.
TEST(KvCachePlain, PickedCacheRowsAndPartialBlocks) {
  for (int64_t d : {112, 128}) {
    for (int32_t splits : {1, 3}) {
      run_and_check({.name = "plain cache_batch_idx",
                     .seqlens = {650, 1001},
                     .seqlen_q = 2,
                     .seqlen_new = 0,
                     .heads = 4,
                     .heads_k = 1,
                     .head_dim = d,
                     .dtype = DType::BFloat16,
                     .batch_idx = true,
                     .mask = kMasks[1],  // causal
                     .num_splits = splits});
    }
  }
}

// A cache read (no append) may share rows between sequences: cache_batch_idx repeats, pages
// of a common prefix appear in several block-table rows.
TEST(KvCache, SharedRowsAndPagesWithoutAppend) {
  for (bool paged : {false, true}) {
    const KvCase c{.name = paged ? "shared pages" : "shared cache rows", .seqlens = {40, 40},
                   .seqlen_q = 2, .seqlen_new = 0, .page_size = paged ? 16 : 0,
                   .batch_idx = !paged, .mask = kMasks[1]};
    SCOPED_TRACE(c.describe());
    KvProblem p(c);
    // Sequence 1 reads what sequence 0 reads.
    if (paged) {
      for (int64_t s = 0; s < p.max_pages; ++s)
        p.table[size_t(p.max_pages + s)] = p.table[size_t(s)];
      std::memcpy(p.table_buf.data(), p.table.data(), p.table.size() * sizeof(int32_t));
    } else {
      p.batch_idx[1] = p.batch_idx[0];
      std::memcpy(p.batch_idx_buf.data(), p.batch_idx.data(), 2 * sizeof(int32_t));
    }
    Buffer k_before = p.k_cache, v_before = p.v_cache;
    run_on_backend(p);
    expect_attention_matches(p, k_before, v_before);
    EXPECT_EQ(p.k_cache.bytes, k_before.bytes);
    EXPECT_EQ(p.v_cache.bytes, v_before.bytes);
  }
}

// q and out through head-major views, k_new/v_new with padded rows, and a packed cache:
// k and v interleaved in one (B, S, 2, Hk, D) buffer, appended in place.
TEST(KvCache, StridedViewsAndPackedCache) {
  const KvCase c{.name = "strided", .seqlens = {30, 61}, .seqlen_q = 5, .seqlen_new = 4,
                 .heads = 4, .heads_k = 2, .head_dim = 32, .dtype = DType::Float16,
                 .rotary = Rotary::Interleaved, .mask = kMasks[3]};
  SCOPED_TRACE(c.describe());
  KvProblem p(c);
  const int64_t B = p.B, Sq = p.Sq, H = p.H, D = p.D, Hk = p.Hk, Sn = p.Sn, S = p.cache_dim1;
  // Packed cache: copy both caches into one buffer, then view it twice.
  Buffer packed(p.c.dtype, B * S * 2 * Hk * D);
  const size_t elem = dtype_size(p.c.dtype), row = size_t(Hk * D) * elem;
  for (int64_t r = 0; r < B * S; ++r) {
    std::memcpy(packed.bytes.data() + size_t(2 * r) * row, p.k_cache.bytes.data() + size_t(r) * row, row);
    std::memcpy(packed.bytes.data() + size_t(2 * r + 1) * row, p.v_cache.bytes.data() + size_t(r) * row, row);
  }
  p.cache.k_cache = packed.view({B, S, Hk, D}, {S * 2 * Hk * D, 2 * Hk * D, D, 1}, 0);
  p.cache.v_cache = packed.view({B, S, Hk, D}, {S * 2 * Hk * D, 2 * Hk * D, D, 1}, Hk * D);
  // Head-major q and out.
  Buffer q_hm(p.c.dtype, B * H * Sq * D), out_hm(p.c.dtype, B * H * Sq * D);
  p.q_view = q_hm.view({B, Sq, H, D}, {H * Sq * D, D, Sq * D, 1});
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < Sq; ++t)
      for (int64_t h = 0; h < H; ++h)
        std::memcpy(q_hm.bytes.data() + size_t(((b * H + h) * Sq + t) * D) * elem,
                    p.q.bytes.data() + size_t(((b * Sq + t) * H + h) * D) * elem, size_t(D) * elem);
  // Padded k_new / v_new rows.
  Buffer kn(p.c.dtype, B * Sn * Hk * (D + 8)), vn(p.c.dtype, B * Sn * Hk * (D + 8));
  for (int64_t r = 0; r < B * Sn * Hk; ++r) {
    std::memcpy(kn.bytes.data() + size_t(r * (D + 8)) * elem, p.k_new.bytes.data() + size_t(r * D) * elem, size_t(D) * elem);
    std::memcpy(vn.bytes.data() + size_t(r * (D + 8)) * elem, p.v_new.bytes.data() + size_t(r * D) * elem, size_t(D) * elem);
  }
  p.cache.k_new = kn.view({B, Sn, Hk, D}, {Sn * Hk * (D + 8), Hk * (D + 8), D + 8, 1});
  p.cache.v_new = vn.view({B, Sn, Hk, D}, {Sn * Hk * (D + 8), Hk * (D + 8), D + 8, 1});
  const TensorView out_view = out_hm.view({B, Sq, H, D}, {H * Sq * D, D, Sq * D, 1});
  Buffer k_before = p.k_cache, v_before = p.v_cache;
  out_hm.poison();
  p.lse.poison();
  Execution e;
  e.backend = kTestBackend;
#ifndef FLASHATTN_TEST_CUDA
  forward_kvcache(p.q_view, p.cache, out_view, p.lse_view, p.options, e);
#else
  DeviceMirror mq(p.q_view), mpk(p.cache.k_cache), mseq(p.cache.cache_seqlens), mkn(*p.cache.k_new),
      mvn(*p.cache.v_new), mcos(*p.cache.rotary_cos), msin(*p.cache.rotary_sin), mout(out_view),
      mlse(p.lse_view);
  KvCache d = p.cache;
  d.k_cache = mpk.view();
  d.v_cache = mpk.view();
  d.v_cache.data = static_cast<char*>(d.v_cache.data) + Hk * D * elem;
  d.cache_seqlens = mseq.view();
  d.k_new = mkn.view();
  d.v_new = mvn.view();
  d.rotary_cos = mcos.view();
  d.rotary_sin = msin.view();
  mout.poison();
  mlse.poison();
  forward_kvcache(mq.view(), d, mout.view(), mlse.view(), p.options, e);
  cuda_check(cudaDeviceSynchronize(), "kernel");
  mout.download();
  mlse.download();
  mpk.download();
#endif
  // Unpack the cache and the output back into the problem's own buffers for the checks.
  for (int64_t r = 0; r < B * S; ++r) {
    std::memcpy(p.k_cache.bytes.data() + size_t(r) * row, packed.bytes.data() + size_t(2 * r) * row, row);
    std::memcpy(p.v_cache.bytes.data() + size_t(r) * row, packed.bytes.data() + size_t(2 * r + 1) * row, row);
  }
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < Sq; ++t)
      for (int64_t h = 0; h < H; ++h)
        std::memcpy(p.out.bytes.data() + size_t(((b * Sq + t) * H + h) * D) * elem,
                    out_hm.bytes.data() + size_t(((b * H + h) * Sq + t) * D) * elem, size_t(D) * elem);
  expect_attention_matches(p, k_before, v_before);
  expect_cache_appended(p, k_before, v_before);
}

// A NaN in one query row makes that row NaN (out and lse) and no other, split or not: the
// merge must neither drop it (an empty chunk's -inf is not a NaN) nor spread it.
TEST(KvCache, NanInOneQueryRowStaysInThatRow) {
  for (int32_t splits : {1, 4}) {
    const KvCase c{.name = "nan row", .seqlens = {300, 80}, .seqlen_q = 3, .heads = 4,
                   .heads_k = 2, .mask = kMasks[1], .num_splits = splits};
    SCOPED_TRACE(c.describe());
    KvProblem p(c);
    p.q.set(((1 * p.Sq + 2) * p.H + 3) * p.D + 7, std::nanf(""));  // b 1, row 2, head 3
    Buffer k_before = p.k_cache, v_before = p.v_cache;
    run_on_backend(p);
    expect_attention_matches(p, k_before, v_before);
    const auto* lse = static_cast<const float*>(p.lse.data());
    EXPECT_TRUE(std::isnan(lse[(1 * p.H + 3) * p.Sq + 2]));
    EXPECT_FALSE(std::isnan(lse[(1 * p.H + 3) * p.Sq + 1]));
    EXPECT_FALSE(std::isnan(lse[(1 * p.H + 2) * p.Sq + 2]));
  }
}

#ifdef FLASHATTN_TEST_CUDA
// ---- CUDA: int32 values out of range ------------------------------------------------------
// On CUDA the int32 tensors live in device memory, where the kernels read them; they guard
// every index taken from them (docs/SPEC.md, "What each backend supports and checks"). Each
// case corrupts one value of sequence 0 on the device (the host copy the reference reads stays
// valid) and runs the call directly and replayed from a CUDA graph (no host check there),
// checking: no CUDA error; no byte changed in the canaries around either cache; a sequence
// out of range has NaN out and lse rows (written: the outputs start as a finite sentinel) and
// appends nothing; a page out of range that is only read holds keys of NaN (the reference with
// NaN keys there is matched, NaN for NaN); sequence 1 matches the reference and appends where
// it should; every other cache byte is unchanged. Directly, with a paged cache, cache_seqlens
// is checked on the host: those cases must be refused with an Error naming the argument,
// nothing written. scripts/gpu.sh runs KvCacheGuard.* under compute-sanitizer memcheck, where
// an access outside the tensors fails the run.

// The device values of the int32 tensors: the problem's own, then corrupted.
struct IndexValues {
  std::vector<int32_t> seqlens, leftpad, batch_idx, table;
};

// A contiguous cache copied to the middle of a device allocation, with kCanaryBytes of
// kCanary either side.
class CanaryMirror {
 public:
  static constexpr size_t kCanaryBytes = size_t{1} << 16;
  static constexpr unsigned char kCanary = 0xA5;
  explicit CanaryMirror(const TensorView& host) : host_(host), view_(host) {
    int device = 0;
    cuda_check(cudaGetDevice(&device), "cudaGetDevice");
    view_.device = {DeviceType::CUDA, device};
    bytes_ = static_cast<size_t>(host.numel()) * dtype_size(host.dtype);
    cuda_check(cudaMalloc(reinterpret_cast<void**>(&base_), bytes_ + 2 * kCanaryBytes), "cudaMalloc");
    cuda_check(cudaMemset(base_, kCanary, bytes_ + 2 * kCanaryBytes), "canaries");
    cuda_check(cudaMemcpy(base_ + kCanaryBytes, host.data, bytes_, cudaMemcpyHostToDevice), "upload");
    view_.data = base_ + kCanaryBytes;
  }
  CanaryMirror(const CanaryMirror&) = delete;
  CanaryMirror& operator=(const CanaryMirror&) = delete;
  ~CanaryMirror() { cudaFree(base_); }
  const TensorView& view() const { return view_; }
  // The cache back into the host view; returns the canary bytes that changed.
  int64_t download() {
    std::vector<unsigned char> all(bytes_ + 2 * kCanaryBytes);
    cuda_check(cudaMemcpy(all.data(), base_, all.size(), cudaMemcpyDeviceToHost), "download");
    std::memcpy(host_.data, all.data() + kCanaryBytes, bytes_);
    int64_t changed = 0;
    for (size_t i = 0; i < kCanaryBytes; ++i)
      changed += (all[i] != kCanary) + (all[kCanaryBytes + bytes_ + i] != kCanary);
    return changed;
  }

 private:
  TensorView host_, view_;
  unsigned char* base_ = nullptr;
  size_t bytes_ = 0;
};

// The finite byte pattern the outputs start with (0x5555: 85.3 in fp16, about 1.5e13 in bf16
// and fp32 lse): an output the kernels did not write is neither NaN nor near the reference.
constexpr unsigned char kUnwritten = 0x55;

struct GuardedRun {
  std::optional<Error> refused;
  int64_t canary_bytes_changed = 0;
};

// p's call on the GPU with `values` in its int32 tensors, directly or captured into a CUDA
// graph and replayed; the outputs and both caches are copied back either way (also after a
// refusal, to show that nothing was written).
GuardedRun run_guarded(KvProblem& p, const IndexValues& values, bool graph) {
  const KvCache& h = p.cache;
  Buffer seqlens = int32_buffer(values.seqlens);
  DeviceMirror mq(p.q_view), mseq(seqlens.view({p.B})), mout(p.out_view), mlse(p.lse_view);
  CanaryMirror mk(h.k_cache), mv(h.v_cache);
  std::optional<DeviceMirror> mkn, mvn, mcos, msin, mslopes, mpad, midx, mtable;
  KvCache d = h;
  d.k_cache = mk.view();
  d.v_cache = mv.view();
  d.cache_seqlens = mseq.view();
  const auto mirror = [](std::optional<DeviceMirror>& m, const std::optional<TensorView>& host,
                         std::optional<TensorView>& device) {
    if (host) device = m.emplace(*host).view();
  };
  mirror(mkn, h.k_new, d.k_new);
  mirror(mvn, h.v_new, d.v_new);
  mirror(mcos, h.rotary_cos, d.rotary_cos);
  mirror(msin, h.rotary_sin, d.rotary_sin);
  Options options = p.options;
  mirror(mslopes, p.options.alibi_slopes, options.alibi_slopes);
  std::optional<DeviceMirror> mkd, mvd;
  mirror(mkd, p.options.k_descale, options.k_descale);
  mirror(mvd, p.options.v_descale, options.v_descale);
  Buffer leftpad = int32_buffer(values.leftpad), batch_idx = int32_buffer(values.batch_idx),
         table = int32_buffer(values.table);
  if (h.cache_leftpad) d.cache_leftpad = mpad.emplace(leftpad.view({p.B})).view();
  if (h.cache_batch_idx) d.cache_batch_idx = midx.emplace(batch_idx.view({p.B})).view();
  if (h.block_table) d.block_table = mtable.emplace(table.view({p.B, p.max_pages})).view();
  cuda_check(cudaMemset(mout.view().data, kUnwritten, p.out.bytes.size()), "out sentinel");
  cuda_check(cudaMemset(mlse.view().data, kUnwritten, p.lse.bytes.size()), "lse sentinel");
  cuda_check(cudaDeviceSynchronize(), "uploads");

  cudaStream_t stream;
  cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  Execution e;
  e.backend = Backend::CUDA;
  e.stream = stream;
  std::optional<TensorView> lse;
  if (p.c.with_lse) lse = mlse.view();
  GuardedRun run;
  cudaGraph_t captured = nullptr;
  if (graph) cuda_check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "capture");
  try {
    forward_kvcache(mq.view(), d, mout.view(), lse, options, e);
  } catch (const Error& error) {
    run.refused = error;
  }
  if (graph) {
    cuda_check(cudaStreamEndCapture(stream, &captured), "the end of the capture");
    if (!run.refused) {
      cudaGraphExec_t replay = nullptr;
      cuda_check(cudaGraphInstantiate(&replay, captured, 0), "cudaGraphInstantiate");
      cuda_check(cudaGraphLaunch(replay, stream), "cudaGraphLaunch");
      cuda_check(cudaStreamSynchronize(stream), "the replay");
      cuda_check(cudaGraphExecDestroy(replay), "cudaGraphExecDestroy");
    }
    if (captured != nullptr) cuda_check(cudaGraphDestroy(captured), "cudaGraphDestroy");
  }
  cuda_check(cudaStreamSynchronize(stream), "the call's kernels");
  cuda_check(cudaGetLastError(), "no CUDA error");
  cuda_check(cudaStreamDestroy(stream), "cudaStreamDestroy");
  mout.download();
  mlse.download();
  run.canary_bytes_changed = mk.download() + mv.download();
  return run;
}

bool all_bytes_are(const Buffer& b, unsigned char byte) {
  return std::all_of(b.bytes.begin(), b.bytes.end(), [&](unsigned char x) { return x == byte; });
}

// Sequence b's out and lse rows are all NaN.
void expect_nan_rows(KvProblem& p, int64_t b) {
  const std::vector<double> out = reference::gather(p.out_view), lse = reference::gather(p.lse_view);
  const int64_t out_rows = p.Sq * p.H * p.D, lse_rows = p.H * p.Sq;
  int64_t not_nan = 0;
  for (int64_t i = b * out_rows; i < (b + 1) * out_rows; ++i) not_nan += !std::isnan(out[size_t(i)]);
  for (int64_t i = b * lse_rows; i < (b + 1) * lse_rows; ++i) not_nan += !std::isnan(lse[size_t(i)]);
  EXPECT_EQ(not_nan, 0) << "elements of sequence " << b << "'s out and lse that are not NaN";
}

// The cache layouts the guards are tried on: dense rows picked by cache_batch_idx with left
// padding (dense addressing, in the plain kernel and the general one), rotary tables (causal:
// q rotated per row), pages of 16 with left padding (a block-table lookup per row), pages of
// 64 (a lookup per 64-key block; the append in the third page) and one page of 256 (the
// append in the page the sequence reads).
enum class GuardBase { Dense, DenseRotary, Paged16, Paged64, Paged256 };

KvCase guard_case(GuardBase base, int64_t seqlen_new, int32_t splits, int64_t head_dim = 64) {
  KvCase c{.name = "guard", .seqlens = {37, 20}, .seqlen_q = 2, .seqlen_new = seqlen_new,
           .heads = 4, .heads_k = 2, .head_dim = head_dim, .dtype = DType::Float16,
           .num_splits = splits};
  switch (base) {
    case GuardBase::Dense:
      c.batch_idx = c.leftpad = true;
      break;
    case GuardBase::DenseRotary:
      c.rotary = Rotary::NeoX;
      c.mask = kMasks[1];
      break;
    case GuardBase::Paged16:
      c.page_size = 16;
      c.leftpad = true;
      break;
    case GuardBase::Paged64:
    case GuardBase::Paged256:
      c.page_size = base == GuardBase::Paged64 ? 64 : 256;
      c.seqlens = {150, 20};
      break;
  }
  return c;
}

// What a corruption did, and what it must give.
struct GuardExpectation {
  std::string what;                    // "cache_seqlens[0] = -1"
  bool sequence_out_of_range = false;  // sequence 0: NaN rows, nothing appended
  int64_t hole_slot = -1;              // >= 0: this slot of sequence 0's pages reads as NaN keys
  std::string refused_directly;        // the argument a direct call's host check names, if any
};

GuardExpectation out_of_range(std::string what) {
  GuardExpectation e;
  e.what = std::move(what);
  e.sequence_out_of_range = true;
  return e;
}

// Corruption number `which` (0 .. count - 1) of p's values (or its rotary tables).
using Corrupt = std::function<GuardExpectation(IndexValues& values, KvProblem& p, int which)>;
using MakeCase = std::function<KvCase(int64_t seqlen_new, int32_t splits)>;

// Every corruption on the cases make_case gives, with and without an append (or only the
// given S_new), one split and three; each run directly and from a graph, the first of each
// shape after the valid call (the control, and the kernels' one-time set-up outside a capture).
void check_guard(const MakeCase& make_case, int count, const Corrupt& corrupt,
                 const std::vector<int64_t>& seqlens_new = {0, 2}) {
  for (const int64_t sn : seqlens_new)
    for (const int32_t splits : {1, 3})
      for (int which = 0; which < count; ++which) {
        const KvCase c = make_case(sn, splits);
        KvProblem p(c);
        SCOPED_TRACE(c.describe());
        const Buffer k_initial = p.k_cache, v_initial = p.v_cache;
        IndexValues values{p.c.seqlens, p.leftpad, p.batch_idx, p.table};
        if (which == 0) {
          SCOPED_TRACE("the valid call");
          const GuardedRun run = run_guarded(p, values, false);
          ASSERT_FALSE(run.refused) << run.refused->what();
          EXPECT_EQ(run.canary_bytes_changed, 0) << "bytes written outside the caches";
          Buffer k_before = k_initial, v_before = v_initial;
          expect_attention_matches(p, k_before, v_before);
          expect_cache_appended(p, k_before, v_before);
        }
        const GuardExpectation expect = corrupt(values, p, which);
        SCOPED_TRACE(expect.what);
        for (const bool graph : {false, true}) {
          SCOPED_TRACE(graph ? "replayed from a CUDA graph" : "called directly");
          std::memcpy(p.k_cache.data(), k_initial.bytes.data(), k_initial.bytes.size());
          std::memcpy(p.v_cache.data(), v_initial.bytes.data(), v_initial.bytes.size());
          Buffer k_before = k_initial, v_before = v_initial;
          const GuardedRun run = run_guarded(p, values, graph);
          EXPECT_EQ(run.canary_bytes_changed, 0) << "bytes written outside the caches";
          if (!graph && !expect.refused_directly.empty()) {
            if (!run.refused) {
              ADD_FAILURE() << "accepted; expected a refusal naming " << expect.refused_directly;
              continue;
            }
            EXPECT_EQ(run.refused->argument(), expect.refused_directly) << run.refused->what();
            EXPECT_TRUE(all_bytes_are(p.out, kUnwritten) && all_bytes_are(p.lse, kUnwritten))
                << "out or lse written by a refused call";
            EXPECT_EQ(p.k_cache.bytes, k_before.bytes) << "k_cache written by a refused call";
            EXPECT_EQ(p.v_cache.bytes, v_before.bytes) << "v_cache written by a refused call";
            continue;
          }
          ASSERT_FALSE(run.refused) << run.refused->what();
          if (expect.sequence_out_of_range) {
            expect_nan_rows(p, 0);
            expect_attention_matches(p, k_before, v_before, {1});
            expect_cache_appended(p, k_before, v_before, {1});
            continue;
          }
          // A hole (or nothing): the reference reads NaN keys and zero values there.
          Buffer k_seen = k_before, v_seen = v_before;
          if (expect.hole_slot >= 0) {
            const int64_t page = p.table[size_t(expect.hole_slot)], row = p.Hk * p.D;
            for (int64_t i = page * p.c.page_size * row; i < (page + 1) * p.c.page_size * row; ++i) {
              k_seen.set(i, std::nanf(""));
              v_seen.set(i, 0.0f);
            }
          }
          expect_attention_matches(p, k_seen, v_seen);
          expect_cache_appended(p, k_before, v_before);
        }
      }
}

// head_dim 59: the CUDA backend runs the call on padded copies (cuda/head_dim_padding.cu),
// whose copy kernels apply the same guard.
MakeCase on(GuardBase base, int64_t head_dim = 64) {
  return [base, head_dim](int64_t sn, int32_t splits) {
    return guard_case(base, sn, splits, head_dim);
  };
}

constexpr int32_t kInt32Min = std::numeric_limits<int32_t>::min();
constexpr int32_t kInt32Max = std::numeric_limits<int32_t>::max();

std::string set_to(const char* name, int64_t at, int32_t value) {
  return std::string(name) + "[" + std::to_string(at) + "] = " + std::to_string(value);
}

// cache_seqlens[0] far out, negative, at the int32 limits, and one position past the capacity
// (S_cache, or max_pages * page_size) after the append. A direct call with a paged cache
// copies cache_seqlens to the host and refuses it (negative: cache_seqlens; past the block
// table: block_table).
const Corrupt corrupt_cache_seqlens = [](IndexValues& v, KvProblem& p, int which) {
  const int32_t values[] = {100000, -1, -100000, kInt32Max, kInt32Min,
                            static_cast<int32_t>(p.capacity - p.Sn + 1)};
  v.seqlens[0] = values[which];
  GuardExpectation e = out_of_range(set_to("cache_seqlens", 0, values[which]));
  if (p.c.page_size) e.refused_directly = values[which] < 0 ? "cache_seqlens" : "block_table";
  return e;
};

TEST(KvCacheGuard, CacheSeqlens) {
  for (GuardBase base : {GuardBase::Dense, GuardBase::Paged16, GuardBase::Paged256})
    check_guard(on(base), 6, corrupt_cache_seqlens);
}

TEST(KvCacheGuard, CacheLeftpad) {
  const Corrupt corrupt = [](IndexValues& v, KvProblem& p, int which) {
    const int32_t values[] = {-1, p.c.seqlens[0] + 1, 1000000, kInt32Min};
    v.leftpad[0] = values[which];
    return out_of_range(set_to("cache_leftpad", 0, values[which]));
  };
  for (GuardBase base : {GuardBase::Dense, GuardBase::Paged16}) check_guard(on(base), 4, corrupt);
}

const Corrupt corrupt_cache_batch_idx = [](IndexValues& v, KvProblem& p, int which) {
  const int32_t values[] = {static_cast<int32_t>(p.cache_rows), -1, 1000000, kInt32Min};
  v.batch_idx[0] = values[which];
  return out_of_range(set_to("cache_batch_idx", 0, values[which]));
};

TEST(KvCacheGuard, CacheBatchIdx) { check_guard(on(GuardBase::Dense), 4, corrupt_cache_batch_idx); }

// A page out of range in slot `slot` of sequence 0's block-table row: a hole (its keys NaN)
// where the sequence only reads, the whole sequence out of range where its append writes.
GuardExpectation bad_page(IndexValues& v, const KvProblem& p, int64_t slot, int32_t value) {
  v.table[size_t(slot)] = value;
  const int64_t filled = p.c.seqlens[0], ps = p.c.page_size;
  const bool appended_into = p.Sn > 0 && filled / ps <= slot && slot <= (filled + p.Sn - 1) / ps;
  GuardExpectation e = out_of_range(set_to("block_table[0]", slot, value));
  if (!appended_into) {
    e.sequence_out_of_range = false;
    e.hole_slot = slot;
  }
  return e;
}

const Corrupt corrupt_first_page_read = [](IndexValues& v, KvProblem& p, int which) {
  const int32_t values[] = {static_cast<int32_t>(p.cache_rows), -1, 1000000, kInt32Min};
  return bad_page(v, p, p.leftpad[0] / p.c.page_size, values[which]);
};
const Corrupt corrupt_page_appended_to = [](IndexValues& v, KvProblem& p, int which) {
  return bad_page(v, p, p.c.seqlens[0] / p.c.page_size, which == 0 ? 1000000 : -1);
};

TEST(KvCacheGuard, BlockTable) {
  for (GuardBase base : {GuardBase::Paged16, GuardBase::Paged64, GuardBase::Paged256}) {
    check_guard(on(base), 4, corrupt_first_page_read);
    check_guard(on(base), 2, corrupt_page_appended_to, {2});
  }
  // Slots past a sequence's positions are never read: any value, and a valid call. Sequence 1
  // (20 + S_new <= 22 positions) uses 2 of its 3 slots.
  check_guard(on(GuardBase::Paged16), 2, [](IndexValues& v, KvProblem& p, int which) {
    const int32_t value = which == 0 ? -7 : 99999;
    v.table[size_t(2 * p.max_pages - 1)] = value;
    GuardExpectation e;
    e.what = set_to("block_table[1]", p.max_pages - 1, value);
    return e;
  });
}

// The same guards with fp8 caches: a page out of range reads NaN keys
// (e4m3's all-ones bytes), a bad length or page for the append leaves sequence 0 NaN.
TEST(KvCacheGuard, Fp8Caches) {
  const auto fp8 = [](GuardBase base) -> MakeCase {
    return [base](int64_t sn, int32_t splits) {
      KvCase c = guard_case(base, sn, splits);
      c.fp8_cache = true;
      return c;
    };
  };
  check_guard(fp8(GuardBase::Paged64), 4, corrupt_first_page_read);
  check_guard(fp8(GuardBase::Paged16), 2, corrupt_page_appended_to, {2});
  check_guard(fp8(GuardBase::Dense), 2, corrupt_cache_seqlens);
}

// Rotary tables one row short of sequence 0's positions (cache_seqlens + S_new for k_new,
// cache_seqlens + Sq for the causal queries) that still cover sequence 1's: on CUDA with a
// dense cache no host check reads cache_seqlens, so the kernels' guard applies.
TEST(KvCacheGuard, RotaryTablesShorterThanThePositions) {
  check_guard(on(GuardBase::DenseRotary), 1, [](IndexValues&, KvProblem& p, int) {
    const int64_t rows = p.c.seqlens[0] + std::max(p.Sn, p.Sq) - 1;
    p.cache.rotary_cos->sizes[0] = p.cache.rotary_sin->sizes[0] = rows;
    return out_of_range("rotary tables of " + std::to_string(rows) + " rows");
  });
}

// The same values at a head dim that is not a multiple of 8: on CUDA the call runs on padded
// copies of the caches, whose copy kernels must not read or write through the bad values
// either, and whose results must follow the same rule (NaN rows, holes as NaN keys).
TEST(KvCacheGuard, HeadDimNotAMultipleOf8) {
  check_guard(on(GuardBase::Dense, 59), 6, corrupt_cache_seqlens);
  check_guard(on(GuardBase::Paged16, 59), 6, corrupt_cache_seqlens);
  check_guard(on(GuardBase::Dense, 59), 4, corrupt_cache_batch_idx);
  check_guard(on(GuardBase::Paged64, 59), 4, corrupt_first_page_read);
  check_guard(on(GuardBase::Paged16, 59), 2, corrupt_page_appended_to, {2});
}

// A hole reaches exactly the rows that attend to it: pages of one position, a causal window
// of 20 keys and three query rows (with S_new = 0, row t sees positions 58 + t .. 77 + t of
// 80), so that a hole at position 58 (59 with one appended: the plain kernel, then the general
// one) is seen by row 0 only, one at 70 by every row, one at 10 by none.
TEST(KvCacheGuard, PageHoleReachesTheRowsThatSeeIt) {
  const MakeCase hole_case = [](int64_t sn, int32_t splits) {
    return KvCase{.name = "hole", .seqlens = {80, 33}, .seqlen_q = 3, .seqlen_new = sn,
                  .heads = 4, .heads_k = 2, .head_dim = 64, .dtype = DType::BFloat16,
                  .page_size = 1, .mask = kMasks[2], .num_splits = splits};
  };
  check_guard(hole_case, 3, [](IndexValues& v, KvProblem& p, int which) {
    const int64_t slots[] = {58 + p.Sn, 70, 10};
    return bad_page(v, p, slots[which], 1000000);
  }, {0, 1});
}
#endif

#ifndef FLASHATTN_TEST_CUDA
// Automatic splitting on the CPU. Decoding (at most 16 query rows per key/value head): a work
// item is a sequence's key/value heads together, so one pass when there is an item per thread,
// else chunks of whole key blocks and at least 128 KiB of K and V, as many as the threads
// need. Otherwise (an item per key/value head and block of query rows): one pass when there
// is an item per thread, else chunks of at least four key blocks.
TEST(KvCacheCpu, AutomaticSplitsFillTheThreads) {
  KvCase c{.name = "auto splits", .seqlens = {4000}, .seqlen_new = 1, .heads = 1, .heads_k = 1,
           .num_threads = 8};
  EXPECT_EQ(run_and_check(c).num_splits, 8);  // 1 item, 8 threads, 2 MB of K and V
  c.seqlens = {300};
  EXPECT_EQ(run_and_check(c).num_splits, 1);  // 154 KB of K and V: one chunk
  c.seqlens = {4000};
  c.heads = 8;
  c.heads_k = 8;
  EXPECT_EQ(run_and_check(c).num_splits, 8);  // the 8 heads of a position read together: 1 item
  c.heads_k = 1;
  EXPECT_EQ(run_and_check(c).num_splits, 8);  // the 8 query heads packed into 1 item
  c.seqlens = {400, 300, 10, 10, 10, 10, 10, 10};
  EXPECT_EQ(run_and_check(c).num_splits, 1);  // 8 items for 8 threads
  c = KvCase{.name = "auto splits, not decoding", .seqlens = {2000}, .seqlen_q = 17,
             .seqlen_new = 1, .heads = 1, .heads_k = 1, .num_threads = 4};
  EXPECT_EQ(run_and_check(c).num_splits, 4);  // 1 item, 4 threads, 16 key blocks
  c.seqlens = {300};
  EXPECT_EQ(run_and_check(c).num_splits, 1);  // 3 key blocks: one chunk of >= 4
  c.seqlens = {2000};
  c.heads = 4;
  c.heads_k = 4;
  EXPECT_EQ(run_and_check(c).num_splits, 1);  // 4 items for 4 threads
}

// The decode path's key chunks (cpu/kvcache.cpp) at odd, unequal cache lengths: chunks that
// end mid-block, sequences of one key or none, the partial (out, lse) pairs merged exactly;
// chosen (3 threads, 1 sequence: 3 chunks) and asked for (7: more chunks than key blocks),
// dense and in pages of 7.
TEST(KvCacheCpu, DecodeChunksAtOddUnequalLengths) {
  for (DType dt : {DType::Float32, DType::BFloat16})
    for (int64_t page : {0, 7}) {
      KvCase c{.name = "decode chunks", .seqlens = {400}, .seqlen_new = 1, .heads = 8,
               .heads_k = 2, .head_dim = 128, .dtype = dt, .page_size = page,
               .num_threads = 3};
      EXPECT_EQ(run_and_check(c).num_splits, 3) << c.describe();
      c.seqlens = {400, 1, 129, 0, 333};
      c.seqlen_new = page ? 1 : 0;
      c.mask = kMasks[page ? 1 : 2];
      c.num_threads = 2;
      for (int32_t splits : {2, 7}) {
        c.num_splits = splits;
        run_and_check(c);
      }
    }
}

// The most query rows the decode path takes per key/value head (Sq x G = 4 x 4), at head dim
// 256: a work item's state then holds 3 key/value heads at most, so 5 of them come in groups
// of 3 and 2. Causal, paged, left padding, ALiBi, softcap, chunks.
TEST(KvCacheCpu, DecodeHeadGroups) {
  for (DType dt : {DType::Float32, DType::BFloat16})
    for (int32_t splits : {1, 2})
      run_and_check({.name = "decode head groups", .seqlens = {300, 45}, .seqlen_q = 4,
                     .seqlen_new = 2, .heads = 20, .heads_k = 5, .head_dim = 256, .dtype = dt,
                     .page_size = 16, .leftpad = true, .mask = kMasks[1], .softcap = 3.0f,
                     .alibi = Case::Alibi::PerHead, .num_splits = splits});
}

// A key masked for one query row but read for another (causal, two query positions: the
// last key is the second row's alone) holds +Inf values: the first row gives it weight 0,
// which must skip its value row rather than multiply it (0 x Inf = NaN: decode_accumulate_pv's
// rule), for fp32 and bf16 caches, split or not. (A P V by VDPBF16PS, pairs of keys per
// instruction, failed this until it made each row's pairs of the value rows it keeps.)
TEST(KvCacheCpu, MaskedValuesOfInfDoNotLeak) {
  for (DType dt : {DType::Float32, DType::BFloat16})
    for (int32_t splits : {1, 2}) {
      const KvCase c{.name = "masked inf", .seqlens = {200, 77}, .seqlen_q = 2, .seqlen_new = 0,
                     .heads = 8, .heads_k = 2, .head_dim = 64, .dtype = dt, .mask = kMasks[1],
                     .num_splits = splits};
      SCOPED_TRACE(c.describe());
      KvProblem p(c);
      const int64_t row = p.Hk * p.D;
      for (int64_t b = 0; b < p.B; ++b)
        for (int64_t e = 0; e < row; ++e)
          p.v_cache.set(p.storage_row(b, c.seqlens[size_t(b)] - 1) * row + e, INFINITY);
      run_on_backend(p);
      const auto out = [&](int64_t i) {
        return dt == DType::Float32 ? reinterpret_cast<const float*>(p.out.bytes.data())[i]
                                    : detail::to_float(reinterpret_cast<const detail::bfloat16_t*>(p.out.bytes.data())[i]);
      };
      for (int64_t b = 0; b < p.B; ++b)
        for (int64_t h = 0; h < p.H; ++h)
          for (int64_t d = 0; d < p.D; ++d) {
            EXPECT_TRUE(std::isfinite(out(((b * p.Sq + 0) * p.H + h) * p.D + d))) << b << " " << h << " " << d;
            EXPECT_FALSE(std::isfinite(out(((b * p.Sq + 1) * p.H + h) * p.D + d))) << b << " " << h << " " << d;
          }
    }
}

// A fixed split count gives the same bits whatever the thread count.
TEST(KvCacheCpu, BitwiseEqualForEveryThreadCount) {
  const KvCase c{.name = "threads", .seqlens = {500, 123}, .seqlen_q = 3, .seqlen_new = 2,
                 .dtype = DType::BFloat16, .page_size = 16, .rotary = Rotary::NeoX,
                 .num_splits = 3};
  KvProblem p(c);
  const Buffer k0 = p.k_cache, v0 = p.v_cache;
  std::vector<unsigned char> first_out, first_lse, first_k;
  for (int threads : {1, 2, 3, 7}) {
    std::memcpy(p.k_cache.data(), k0.bytes.data(), k0.bytes.size());
    std::memcpy(p.v_cache.data(), v0.bytes.data(), v0.bytes.size());
    Execution e;
    e.num_threads = threads;
    run_on_backend(p, e);
    if (first_out.empty()) {
      first_out = p.out.bytes;
      first_lse = p.lse.bytes;
      first_k = p.k_cache.bytes;
    } else {
      EXPECT_EQ(p.out.bytes, first_out) << threads << " threads";
      EXPECT_EQ(p.lse.bytes, first_lse) << threads << " threads";
      EXPECT_EQ(p.k_cache.bytes, first_k) << threads << " threads";
    }
  }
}
#endif

}  // namespace
}  // namespace flashattn::testing

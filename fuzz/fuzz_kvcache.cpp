// libFuzzer target for fa_forward_kvcache on the CPU backend (issue 34). The fuzzer's bytes
// decide the cache (dense, dense picked by cache_batch_idx, or paged through a block table),
// the positions each sequence holds, the appended k_new/v_new, rotary tables, the options and
// num_splits, and then damage the values of the index tensors: cache_seqlens negative or past
// the capacity, cache_leftpad negative or past cache_seqlens, cache_batch_idx outside
// [0, B_cache) or repeated, block_table pages outside [0, num_pages), repeated, or too few,
// rotary tables too short; plus the usual wrong dtypes, shapes, strides, null and misaligned
// pointers. Every buffer covers exactly what its view claims (AddressSanitizer sees any access
// outside it); cache positions that no sequence holds are NaN, so that a read of one shows in
// the output. Then:
//   - a rejected call leaves every buffer (out, lse, both caches, every input) byte for byte as
//     it was and sets a message;
//   - an accepted call was given index values that SPEC.md allows: on the CPU backend every
//     value is checked on the host (SPEC.md "Checks"), so no bad value may pass;
//   - it changed no byte of the caches but the appended positions, where v is a bit copy of
//     v_new and k of k_new, rotated dims within a rounding of the float64 rotation;
//   - out and lse match the float64 reference run per sequence on its dense key list (old
//     cache rows + appended rows rotated in float64 and rounded to the dtype), with q rotated
//     likewise (as tests/test_kvcache.cpp does).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <optional>
#include <utility>
#include <vector>

#include "fuzz_common.hpp"

namespace {

using fuzz::Buffer;
using fuzz::Bytes;
using fuzz::fail;
using fuzz::pick_dtype;
using fuzz::pick_float_dtype;

fuzz::Stats stats;

double unit_roundoff(int32_t dtype) {
  return dtype == FA_FLOAT32 ? 0x1p-24 : dtype == FA_FLOAT16 ? 0x1p-11 : 0x1p-8;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::target_name = "fuzz_kvcache";
  Bytes in(data, size);
  const int64_t B = in.between(0, 3), Sq = in.between(0, 4);
  const int64_t H = in.between(1, 4), Hk = in.flag(8) ? in.between(0, 4) : H / std::max<int64_t>(1, in.between(1, 2));
  const int64_t D = in.flag(16) ? in.between(0, 300) : in.between(1, 20);
  const int32_t dtype = pick_float_dtype(in);
  const int mode = static_cast<int>(in.below(3));  // 0 dense, 1 dense with cache_batch_idx, 2 paged
  const bool with_new = in.flag(3) == false, with_leftpad = in.flag(3), with_rotary = in.flag(3);
  const int64_t Sn = with_new ? in.between(0, 3) : 0;

  // The intended cache: positions filled before the call, and room for the appended ones.
  std::vector<int32_t> seqlens(static_cast<size_t>(B)), leftpad(static_cast<size_t>(B));
  int32_t longest = 0;
  for (int64_t b = 0; b < B; ++b) {
    seqlens[size_t(b)] = in.between(0, 9);
    leftpad[size_t(b)] = with_leftpad ? in.between(0, seqlens[size_t(b)]) : 0;
    longest = std::max<int32_t>(longest, seqlens[size_t(b)] + static_cast<int32_t>(Sn));
  }
  const int64_t page_size = mode == 2 ? in.between(1, 4) : 0;
  int64_t max_pages = mode == 2 ? (longest + page_size - 1) / page_size + in.between(0, 1) : 0;
  if (mode == 2 && in.flag(12)) max_pages = std::max<int64_t>(0, max_pages - 1);  // too few
  const int64_t cache_rows = mode == 2 ? B * max_pages + in.between(0, 2) - (in.flag(16) ? 1 : 0)
                                       : B + (mode == 1 ? in.between(0, 2) : (in.flag(16) ? -1 : 0));
  const int64_t cache_dim1 = mode == 2 ? page_size : longest + in.between(0, 2) - (in.flag(12) ? 1 : 0);
  // A shuffle of the cache rows (dense: the rows cache_batch_idx picks; paged: the pages).
  std::vector<int32_t> perm(static_cast<size_t>(std::max<int64_t>(cache_rows, 0)));
  for (size_t i = 0; i < perm.size(); ++i) perm[i] = static_cast<int32_t>(i);
  for (size_t i = perm.size(); i > 1; --i) std::swap(perm[i - 1], perm[in.below(static_cast<uint32_t>(i))]);
  std::vector<int32_t> batch_idx(static_cast<size_t>(B)), table(static_cast<size_t>(B * max_pages), 0);
  for (size_t i = 0; i < batch_idx.size(); ++i) batch_idx[i] = i < perm.size() ? perm[i] : static_cast<int32_t>(i);
  for (size_t i = 0; i < table.size(); ++i) table[i] = i < perm.size() ? perm[i] : static_cast<int32_t>(i);
  // Table entries past a sequence's last position are never looked at: garbage there.
  for (int64_t b = 0; mode == 2 && b < B; ++b)
    for (int64_t slot = (seqlens[size_t(b)] + Sn + page_size - 1) / page_size; slot < max_pages; ++slot)
      if (in.flag(3)) table[size_t(b * max_pages + slot)] = in.flag() ? -5 : 1 << 30;

  // The damage.
  fuzz::damage(in, seqlens, longest, 5);
  if (with_leftpad) fuzz::damage(in, leftpad, longest, 5);
  if (mode == 1) fuzz::damage(in, batch_idx, static_cast<int32_t>(cache_rows), 5);
  if (mode == 1 && B > 1 && in.flag(12)) batch_idx[1] = batch_idx[0];  // two sequences, one row
  if (mode == 2) fuzz::damage(in, table, static_cast<int32_t>(cache_rows), 5);
  if (mode == 2 && table.size() > 1 && in.flag(12)) table[1] = table[0];  // one page twice

  // The cache's tensors.
  const std::vector<int64_t> cache_shape{cache_rows, cache_dim1, Hk, D};
  const int layout = static_cast<int>(in.below(8) < 5 ? 0 : in.below(4));
  Buffer k_cache(in, dtype, cache_shape, layout, true);
  Buffer v_cache(in, in.flag(32) ? pick_dtype(in) : dtype, cache_shape, layout, true);
  Buffer q(in, dtype, {B, Sq, H, in.flag(32) ? D + 1 : D}, in.below(8) < 6 ? 0 : in.below(4), true);
  Buffer out(in, in.flag(32) ? pick_dtype(in) : dtype, {B, Sq, H, D}, in.flag(6) ? 3 : 0, true);
  const bool with_lse = !in.flag(4);
  Buffer lse(in, FA_FLOAT32, {B, H, in.flag(32) ? Sq + 1 : Sq}, in.flag(16) ? 3 : 0, false);
  Buffer k_new(in, dtype, {B, Sn, Hk, D}, in.flag(6) ? static_cast<int>(in.below(4)) : 0, true);
  Buffer v_new(in, in.flag(32) ? pick_dtype(in) : dtype, {B, in.flag(32) ? Sn + 1 : Sn, Hk, D}, in.flag(6) ? static_cast<int>(in.below(4)) : 0, true);
  Buffer seqlens_t = fuzz::index_tensor(in, seqlens, B, 32);
  Buffer leftpad_t = fuzz::index_tensor(in, leftpad, B, 32);
  Buffer batch_idx_t = fuzz::index_tensor(in, batch_idx, B, 32);
  // The block table, (B, max_pages), with the same kinds of damage.
  const int32_t table_dtype = in.flag(32) ? pick_dtype(in) : FA_INT32;
  const int64_t table_rows = in.flag(32) ? B + 1 : B;
  const int table_layout = in.flag(32) ? 3 : 0;
  Buffer table_t(in, table_dtype, {table_rows, max_pages}, table_layout, true);
  table_t.write_int32(table);
  // Rotary tables: (S_rotary, rotary_dim / 2), enough rows for every rotated position, now and
  // then one too few or a rotary_dim past D.
  const int64_t rot_half = in.flag(16) ? in.between(0, static_cast<int32_t>(D)) : std::max<int64_t>(1, in.between(1, static_cast<int32_t>(std::max<int64_t>(1, D / 2))));
  const int64_t rot_rows = longest + Sq + 1 - (in.flag(8) ? in.between(1, 4) : 0);
  Buffer cos_t(in, in.flag(32) ? pick_dtype(in) : dtype, {rot_rows, rot_half}, 0, true);
  Buffer sin_t(in, dtype, {rot_rows, in.flag(32) ? rot_half + 1 : rot_half}, 0, true);
  for (Buffer* t : {&cos_t, &sin_t}) {
    // (a misaligned table keeps its random bytes: a store there would be undefined, and the
    // call must refuse it anyway)
    if (t->t.data == nullptr || t->t.dtype == FA_INT32 || t->t.dtype == 7 ||
        reinterpret_cast<uintptr_t>(t->t.data) % fuzz::element_size(t->t.dtype) != 0)
      continue;
    std::vector<double> values(static_cast<size_t>(t->numel()));
    const int64_t cols = std::max<int64_t>(1, t->t.sizes[1]);
    for (size_t e = 0; e < values.size(); ++e) {
      const double angle = static_cast<double>(static_cast<int64_t>(e) / cols) * std::pow(10000.0, -2.0 * static_cast<double>(static_cast<int64_t>(e) % cols) / static_cast<double>(2 * cols));
      values[e] = t == &cos_t ? std::cos(angle) : std::sin(angle);
    }
    flashattn::reference::scatter(values, t->view());
  }
  q.fill_random(in);
  k_new.fill_random(in);
  v_new.fill_random(in);
  k_cache.fill_random(in);
  v_cache.fill_random(in);

  fa_options options;
  fa_options_init(&options);
  options.causal = in.flag();
  options.window_left = in.flag(3) ? in.between(-2, 6) : -1;
  options.window_right = in.flag(3) ? in.between(-2, 6) : -1;
  const float caps[] = {0.0f, 0.5f, 30.0f};
  options.softcap = in.flag(4) ? caps[in.below(3)] : 0.0f;
  options.dropout_p = in.flag(24) ? 0.25f : 0.0f;  // inference only: must be refused
  Buffer slopes(in, FA_FLOAT32, in.flag() ? std::vector<int64_t>{H} : std::vector<int64_t>{B, H}, 0, false);
  slopes.fill_slopes();
  if (in.flag(4)) options.alibi_slopes = &slopes.t;
  fa_execution execution;
  fa_execution_init(&execution);
  execution.backend = FA_BACKEND_CPU;
  execution.num_threads = static_cast<int32_t>(in.between(0, 2));

  fa_kvcache cache;
  fa_kvcache_init(&cache);
  cache.k_cache = &k_cache.t;
  cache.v_cache = &v_cache.t;
  cache.cache_seqlens = &seqlens_t.t;
  if (with_new) {
    cache.k_new = &k_new.t;
    cache.v_new = in.flag(32) ? nullptr : &v_new.t;  // both or neither
  }
  if (with_rotary) {
    cache.rotary_cos = &cos_t.t;
    cache.rotary_sin = in.flag(32) ? nullptr : &sin_t.t;
    cache.rotary_interleaved = in.flag();
  }
  if (with_leftpad) cache.cache_leftpad = &leftpad_t.t;
  if (mode == 1 || in.flag(48)) cache.cache_batch_idx = &batch_idx_t.t;  // with a table: refused
  if (mode == 2) cache.block_table = &table_t.t;
  const int32_t splits[] = {0, 1, 2, 3, 7, -1, 1025};
  cache.num_splits = splits[in.flag(4) ? in.below(7) : 0];

  // The positions each sequence holds before the call are the cache's only meaningful rows:
  // NaN everywhere else, as the values were meant (where damage moved them, the reference reads
  // the same memory, so the check stays fair).
  // (Not where strides alias elements: a NaN written for a free row would land on a held one.)
  if (k_cache.t.data != nullptr && v_cache.t.data != nullptr && cache_rows > 0 && cache_dim1 > 0 && Hk > 0 && D > 0 &&
      !k_cache.self_overlapping() && !v_cache.self_overlapping()) {
    std::vector<uint8_t> held(static_cast<size_t>(cache_rows * cache_dim1), 0);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t pos = std::max(leftpad[size_t(b)], 0); pos < std::min<int64_t>(seqlens[size_t(b)], int64_t{1} << 20); ++pos) {
        int64_t r = -1;
        if (mode == 2 && pos / page_size < max_pages) r = int64_t{table[size_t(b * max_pages + pos / page_size)]} * page_size + pos % page_size;
        if (mode != 2 && pos < cache_dim1) r = (mode == 1 ? int64_t{batch_idx[size_t(b)]} : b) * cache_dim1 + pos;
        if (r >= 0 && r < static_cast<int64_t>(held.size())) held[size_t(r)] = 1;
      }
    for (Buffer* c : {&k_cache, &v_cache})
      for (int64_t e = 0; e < c->numel(); ++e)
        if (!held[size_t(e / (Hk * D))]) c->write_nan(e);
  }

  Buffer* all[] = {&k_cache, &v_cache, &q, &out, &lse, &k_new, &v_new, &seqlens_t, &leftpad_t,
                   &batch_idx_t, &table_t, &cos_t, &sin_t, &slopes};
  std::vector<std::vector<uint8_t>> before;
  for (const Buffer* b : all) before.push_back(b->storage);
  fa_run_info info;
  fa_run_info_init(&info);
  const fa_status status = fa_forward_kvcache(&q.t, &cache, &out.t, with_lse ? &lse.t : nullptr, &options, &execution, &info);
  ++stats.calls;
  if (status != FA_OK) {
    for (size_t i = 0; i < std::size(all); ++i)
      if (all[i]->storage != before[i]) fail("a rejected call wrote into a buffer");
    if (std::strlen(fa_last_error()) == 0) fail("a rejected call set no message");
    return 0;
  }
  ++stats.accepted;
  if (info.backend != FA_BACKEND_CPU || info.num_splits < 1)
    fail("an accepted call reported another backend, or no key chunk");
  for (size_t i = 2; i < std::size(all); ++i)  // every input but the caches
    if (all[i] != &out && all[i] != &lse && all[i]->storage != before[i]) fail("an accepted call wrote into an input");

  // Accepted: the index values are ones SPEC.md allows.
  const bool paged = cache.block_table != nullptr;
  const std::vector<int32_t> sl = seqlens_t.int32_values();
  const std::vector<int32_t> lp = with_leftpad ? leftpad_t.int32_values() : std::vector<int32_t>(size_t(B), 0);
  const std::vector<int32_t> bi = cache.cache_batch_idx ? batch_idx_t.int32_values() : std::vector<int32_t>{};
  const std::vector<int32_t> tb = paged ? table_t.int32_values() : std::vector<int32_t>{};
  const int64_t pages_per_seq = paged ? table_t.t.sizes[1] : 0;
  const int64_t capacity = paged ? pages_per_seq * page_size : cache_dim1;
  const int64_t appended = cache.k_new ? k_new.t.sizes[1] : 0;
  const bool rotary_per_row = options.causal || options.window_left >= 0 || options.window_right >= 0;
  if (paged && cache.cache_batch_idx) fail("cache_batch_idx with a block_table was accepted");
  // Where position `pos` of sequence b lives: a row of the (dim0 * dim1) rows.
  const auto row_of = [&](int64_t b, int64_t pos) -> int64_t {
    if (paged) return int64_t{tb[size_t(b * pages_per_seq + pos / page_size)]} * page_size + pos % page_size;
    return (cache.cache_batch_idx ? int64_t{bi[size_t(b)]} : b) * cache_dim1 + pos;
  };
  std::vector<std::pair<int64_t, int64_t>> written;  // (cache row, b * Sn + t)
  int64_t rotated_rows = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t filled = sl[size_t(b)], begin = lp[size_t(b)], end = filled + appended;
    if (filled < 0) fail("a negative cache_seqlens was accepted");
    if (begin < 0 || begin > filled) fail("cache_leftpad outside [0, cache_seqlens] was accepted");
    if (end > capacity) fail("cache_seqlens + S_new past the capacity was accepted");
    if (!bi.empty() && (bi[size_t(b)] < 0 || bi[size_t(b)] >= cache_rows)) fail("cache_batch_idx outside [0, B_cache) was accepted");
    if (paged)
      for (int64_t slot = begin / page_size; begin < end && slot <= (end - 1) / page_size; ++slot)
        if (tb[size_t(b * pages_per_seq + slot)] < 0 || tb[size_t(b * pages_per_seq + slot)] >= cache_rows)
          fail("a block_table page outside [0, num_pages) was accepted");
    for (int64_t pos = filled; pos < end; ++pos) written.emplace_back(row_of(b, pos), b * appended + pos - filled);
    if (appended > 0) rotated_rows = std::max(rotated_rows, end);
    if (Sq > 0) rotated_rows = std::max(rotated_rows, filled + (rotary_per_row ? Sq : 1));
  }
  std::sort(written.begin(), written.end());
  for (size_t n = 1; n < written.size(); ++n)
    if (written[n].first == written[n - 1].first) fail("two appended positions in one cache row were accepted");
  if (with_rotary && cos_t.t.sizes[0] < rotated_rows) fail("rotary tables shorter than the rotated positions were accepted");
  const int64_t rd = with_rotary ? 2 * cos_t.t.sizes[1] : 0;
  const bool interleaved = cache.rotary_interleaved != 0;
  if (std::getenv("FUZZ_DEBUG") != nullptr) {  // to read a reproducer
    std::fprintf(stderr, "B=%lld Sq=%lld S_new=%lld H=%lld Hk=%lld D=%lld dtype=%d cache=(%lld, %lld) %s rotary_dim=%lld%s "
                 "causal=%d window=(%d,%d) softcap=%g alibi=%d num_splits=%d ran %d\n",
                 (long long)B, (long long)Sq, (long long)appended, (long long)H, (long long)Hk, (long long)D, dtype,
                 (long long)cache_rows, (long long)cache_dim1, paged ? "paged" : bi.empty() ? "dense" : "dense+batch_idx",
                 (long long)rd, interleaved ? " interleaved" : "", options.causal, options.window_left,
                 options.window_right, options.softcap, options.alibi_slopes != nullptr, cache.num_splits, info.num_splits);
    for (int64_t b = 0; b < B; ++b) {
      std::fprintf(stderr, "  b=%lld seqlens=%d leftpad=%d", (long long)b, sl[size_t(b)], lp[size_t(b)]);
      if (!bi.empty()) std::fprintf(stderr, " batch_idx=%d", bi[size_t(b)]);
      for (int64_t s = 0; s < pages_per_seq; ++s) std::fprintf(stderr, " %d", tb[size_t(b * pages_per_seq + s)]);
      std::fprintf(stderr, "\n");
    }
  }

  // The caches: every byte as before but the appended positions' elements.
  // (k_new and v_new only when given: otherwise their buffers were never checked)
  const std::vector<double> kn = cache.k_new ? flashattn::reference::gather(k_new.view()) : std::vector<double>{};
  const std::vector<double> vn = cache.k_new ? flashattn::reference::gather(v_new.view()) : std::vector<double>{};
  const std::vector<double> cos = with_rotary ? flashattn::reference::gather(cos_t.view()) : std::vector<double>{};
  const std::vector<double> sin = with_rotary ? flashattn::reference::gather(sin_t.view()) : std::vector<double>{};
  const auto rotate = [&](std::vector<double> x, int64_t pos) {  // x: D values, SPEC.md's rotation
    const int64_t half = rd / 2;
    const std::vector<double> x0 = x;
    for (int64_t i = 0; i < half; ++i) {
      const int64_t a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half;
      const double c = cos[size_t(pos * half + i)], s = sin[size_t(pos * half + i)];
      x[size_t(a)] = x0[size_t(a)] * c - x0[size_t(b)] * s;
      x[size_t(b)] = x0[size_t(a)] * s + x0[size_t(b)] * c;
    }
    return x;
  };
  const int64_t row = Hk * D;
  const size_t elem = fuzz::element_size(dtype);
  const std::vector<double> k_after = flashattn::reference::gather(k_cache.view());
  for (Buffer* c : {&k_cache, &v_cache}) {
    const std::vector<uint8_t>& old = before[c == &k_cache ? 0 : 1];
    std::vector<uint8_t> mine(c->storage.size(), 0);
    const auto base = static_cast<const uint8_t*>(c->t.data) - c->storage.data();
    for (const auto& [r, src] : written) {
      const int64_t b = src / appended, pos = sl[size_t(b)] + src % appended;
      for (int64_t e = 0; e < row; ++e) {
        const size_t at = static_cast<size_t>(base + c->offset_of(r * row + e) * static_cast<int64_t>(elem));
        std::fill(mine.begin() + static_cast<int64_t>(at), mine.begin() + static_cast<int64_t>(at + elem), 1);
        const Buffer& from = c == &k_cache ? k_new : v_new;
        const uint8_t* given = static_cast<const uint8_t*>(from.t.data) + from.offset_of(src * row + e) * static_cast<int64_t>(elem);
        const int64_t d = e % D;
        if (c == &v_cache || d >= rd) {
          if (std::memcmp(c->storage.data() + at, given, elem) != 0) fail("an appended element is not a bit copy of k_new/v_new");
          continue;
        }
        // A rotated element: the float64 rotation rounded to the dtype, allowing for fp32
        // arithmetic before that one rounding (the tests' rule).
        const int64_t half = rd / 2, i = interleaved ? d / 2 : d % half;
        const int64_t a = interleaved ? 2 * i : i, bb = interleaved ? 2 * i + 1 : i + half;
        const int64_t first = (src * row + e) - d;
        const double x0 = kn[size_t(first + a)], x1 = kn[size_t(first + bb)];
        const double cs = cos[size_t(pos * half + i)], sn = sin[size_t(pos * half + i)];
        const bool is_a = d == a;
        const double want = is_a ? x0 * cs - x1 * sn : x0 * sn + x1 * cs;
        const double tol = (unit_roundoff(dtype) + 4 * 0x1p-24) * (is_a ? std::abs(x0 * cs) + std::abs(x1 * sn) : std::abs(x0 * sn) + std::abs(x1 * cs)) +
                           (dtype == FA_FLOAT16 ? 0x1p-24 : 0.0);
        if (!(std::abs(k_after[size_t(r * row + e)] - want) <= tol)) fail("an appended key is not k_new rotated");
      }
    }
    for (size_t i = 0; i < mine.size(); ++i)
      if (!mine[i] && c->storage[i] != old[i]) fail("an accepted call changed a cache byte outside the appended positions");
  }

  // out and lse against the reference, per sequence.
  // The old positions as the cache holds them after the call: SPEC.md appends k_new "before
  // attending", so where a block table lists a page twice and an appended position lands on a
  // row that an old position of the call also names, the keys read there are the appended
  // ones. (Elsewhere the old rows are unchanged, as checked above.)
  const std::vector<double> qv = flashattn::reference::gather(q.view());
  const std::vector<double>& kc = k_after;
  const std::vector<double> vc = flashattn::reference::gather(v_cache.view());
  const std::vector<double> all_out = flashattn::reference::gather(out.view());
  const std::vector<double> all_lse = with_lse ? flashattn::reference::gather(lse.view()) : std::vector<double>{};
  std::vector<double> got_out, exact_out, low_out, got_lse, exact_lse;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t filled = sl[size_t(b)], begin = lp[size_t(b)], Sk = filled + appended - begin;
    std::vector<double> keys, values, queries;
    for (int64_t pos = begin; pos < filled + appended; ++pos) {
      if (pos < filled) {
        const int64_t r = row_of(b, pos);
        keys.insert(keys.end(), kc.begin() + r * row, kc.begin() + (r + 1) * row);
        values.insert(values.end(), vc.begin() + r * row, vc.begin() + (r + 1) * row);
        continue;
      }
      const int64_t src = b * appended + pos - filled;
      values.insert(values.end(), vn.begin() + src * row, vn.begin() + (src + 1) * row);
      for (int64_t hk = 0; hk < Hk; ++hk) {
        std::vector<double> x(kn.begin() + src * row + hk * D, kn.begin() + src * row + (hk + 1) * D);
        if (rd > 0) x = rotate(x, pos);
        keys.insert(keys.end(), x.begin(), x.end());
      }
    }
    for (int64_t t = 0; t < Sq; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t at = ((b * Sq + t) * H + h) * D;
        std::vector<double> x(qv.begin() + at, qv.begin() + at + D);
        if (rd > 0) x = rotate(x, filled + (rotary_per_row ? t : 0));
        queries.insert(queries.end(), x.begin(), x.end());
      }
    const fuzz::Dense qb(dtype, {1, Sq, H, D}, queries), kb(dtype, {1, Sk, Hk, D}, keys), vb(dtype, {1, Sk, Hk, D}, values);
    flashattn::Options o = fuzz::reference_options(options, nullptr);
    std::optional<fuzz::Dense> slopes_b;
    if (options.alibi_slopes != nullptr) {  // this sequence's slopes, (H)
      const std::vector<double> s = flashattn::reference::gather(slopes.view());
      const int64_t first = slopes.t.ndim == 2 ? b * H : 0;
      o.alibi_slopes = slopes_b.emplace(FA_FLOAT32, std::vector<int64_t>{H}, std::vector<double>(s.begin() + first, s.begin() + first + H)).v;
    }
    const flashattn::reference::Result exact = flashattn::reference::forward(qb.v, kb.v, vb.v, o);
    exact_out.insert(exact_out.end(), exact.out.begin(), exact.out.end());
    exact_lse.insert(exact_lse.end(), exact.lse.begin(), exact.lse.end());
    if (dtype != FA_FLOAT32) {
      const flashattn::reference::Result low =
          flashattn::reference::forward(qb.v, kb.v, vb.v, o, nullptr, flashattn::reference::Arithmetic::InputDType);
      low_out.insert(low_out.end(), low.out.begin(), low.out.end());
    }
    got_out.insert(got_out.end(), all_out.begin() + b * Sq * H * D, all_out.begin() + (b + 1) * Sq * H * D);
    if (with_lse) got_lse.insert(got_lse.end(), all_lse.begin() + b * H * Sq, all_lse.begin() + (b + 1) * H * Sq);
  }
  fuzz::expect_output(dtype, got_out, exact_out, low_out, "out");
  if (with_lse) fuzz::expect_lse(got_lse, exact_lse);
  return 0;
}

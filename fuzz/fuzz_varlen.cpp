// libFuzzer target for the varlen forward on the CPU backend (issue 34): fa_forward_varlen, and
// fa_forward_varlen_paged with k and v in pages picked by a block table. The fuzzer's bytes
// decide the sequence lengths, then damage the index tensors: cu_seqlens_q/k that do not start
// at 0, decrease, go negative or past the rows of q/k; a wrong dtype, length or stride for
// them; max_seqlen_q/k that lie (too small, negative, 2^31 and beyond); seqused_k past its
// sequence or negative; block tables with pages outside [0, num_pages), too few pages, and
// garbage in the entries past a sequence's keys (never read: SPEC.md "Shapes and layouts").
// Shapes, dtypes, strides, null and misaligned pointers and the options vary as in
// fuzz_forward. Every buffer covers exactly what its view claims (AddressSanitizer sees any
// access outside it); rows of k and v no sequence uses hold NaN, so that a read of one shows
// in the output. Then:
//   - a rejected call leaves out and lse byte for byte as they were and sets a message;
//   - an accepted call was given index values that SPEC.md allows ("Checks": on the CPU
//     backend the values of index tensors are checked on the host, so no bad value may pass),
//     left the rows of out and the columns of lse past cu_seqlens_q[B] untouched, and matches
//     the float64 reference (paged: on the same keys gathered into a packed k and v).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "fuzz_common.hpp"

namespace {

using fuzz::Buffer;
using fuzz::Bytes;
using fuzz::fail;
using fuzz::pick_dtype;
using fuzz::pick_float_dtype;

fuzz::Stats stats;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::target_name = "fuzz_varlen";
  Bytes in(data, size);
  const int64_t B = in.between(0, 4);
  const int64_t H = in.between(1, 4), Hk = in.flag(8) ? in.between(0, 4) : H / std::max<int64_t>(1, in.between(1, 2));
  const int64_t D = in.flag(16) ? in.between(0, 300) : in.between(1, 24);
  const int32_t dtype = pick_float_dtype(in);
  const bool paged = in.flag(3);
  const bool with_seqused = in.flag(3);

  // The intended batch: lengths, seqused_k within them, and rows past the last sequence.
  std::vector<int32_t> len_q(static_cast<size_t>(B)), len_k(static_cast<size_t>(B)), used(static_cast<size_t>(B));
  std::vector<int32_t> cu_q{0}, cu_k{0};
  for (int64_t b = 0; b < B; ++b) {
    len_q[size_t(b)] = in.between(0, 9);
    len_k[size_t(b)] = in.between(0, 11);
    used[size_t(b)] = in.between(0, len_k[size_t(b)]);
    cu_q.push_back(cu_q.back() + len_q[size_t(b)]);
    cu_k.push_back(cu_k.back() + len_k[size_t(b)]);
  }
  const int32_t total_q = cu_q.back() + in.between(0, 3), total_k = cu_k.back() + in.between(0, 3);
  int32_t longest_q = 0, longest_k = 0;
  for (int64_t b = 0; b < B; ++b) {
    longest_q = std::max(longest_q, len_q[size_t(b)]);
    longest_k = std::max(longest_k, len_k[size_t(b)]);
  }
  // Paged: keys in (num_pages, page_size, Hk, D), each sequence's pages a shuffled slice.
  const int64_t page_size = paged ? in.between(1, 5) : 1;
  int64_t max_pages = paged ? (longest_k + page_size - 1) / page_size : 0;
  if (paged && in.flag(8)) max_pages += in.between(-1, 2);
  max_pages = std::max<int64_t>(max_pages, 0);
  int64_t num_pages = B * max_pages + (paged ? in.between(0, 2) : 0);
  if (paged && in.flag(16)) num_pages = std::max<int64_t>(0, num_pages - 1 - in.between(0, 2));
  std::vector<int32_t> table(static_cast<size_t>(B * max_pages));
  for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<int32_t>(i);
  for (size_t i = table.size(); i > 1; --i) std::swap(table[i - 1], table[in.below(static_cast<uint32_t>(i))]);
  // Entries past a sequence's keys are never read: garbage there must change nothing.
  for (int64_t b = 0; b < B; ++b) {
    const int64_t keys = with_seqused ? used[size_t(b)] : len_k[size_t(b)];
    for (int64_t slot = (keys + page_size - 1) / page_size; slot < max_pages; ++slot)
      if (in.flag(3)) table[size_t(b * max_pages + slot)] = in.flag() ? -1 : 1 << 30;
  }
  if (in.flag(8) && !table.empty()) table[in.below(static_cast<uint32_t>(table.size()))] = in.between(-2, static_cast<int32_t>(num_pages) + 2);

  // Then the damage: bad values, bad tensors, lies.
  fuzz::damage(in, cu_q, total_q, 6);
  fuzz::damage(in, cu_k, total_k, 6);
  if (with_seqused) fuzz::damage(in, used, longest_k, 6);
  int64_t max_q = longest_q, max_k = longest_k;
  const int64_t lies[] = {-1, 0, 1, 2147483647LL, 2147483648LL, INT64_MIN, INT64_MAX};
  if (in.flag(8)) max_q = in.flag() ? longest_q - 1 : lies[in.below(7)];
  if (in.flag(8)) max_k = in.flag() ? longest_k - 1 : lies[in.below(7)];
  if (in.flag(12) && max_q >= 0 && max_q < 2147483647LL) max_q += in.between(1, 5);  // larger than needed is allowed
  Buffer cu_q_t = fuzz::index_tensor(in, cu_q, B + 1, 24);
  Buffer cu_k_t = fuzz::index_tensor(in, cu_k, B + 1, 24);
  Buffer used_t = fuzz::index_tensor(in, used, B, 24);
  // The block table, (B, max_pages), with Buffer's usual choices (another dtype, batch size or
  // strides, a null or misaligned pointer).
  Buffer table_t(in, in.flag(24) ? pick_dtype(in) : FA_INT32, {in.flag(24) ? B + 1 : B, max_pages},
                 in.flag(16) ? 3 : 0, true);
  table_t.write_int32(table);

  const auto dims = [&](int64_t rows, int64_t h) { return std::vector<int64_t>{rows, h, D}; };
  const int layout = static_cast<int>(in.below(8) < 5 ? 0 : in.below(4));
  Buffer q(in, dtype, dims(total_q, H), layout, true);
  Buffer k(in, dtype, paged ? std::vector<int64_t>{num_pages, page_size, Hk, D} : dims(total_k, Hk), layout, true);
  Buffer v(in, in.flag(32) ? pick_dtype(in) : dtype, paged ? std::vector<int64_t>{num_pages, page_size, Hk, D} : dims(total_k, Hk), layout, true);
  Buffer out(in, in.flag(32) ? pick_dtype(in) : dtype, dims(total_q, H), in.flag(6) ? 3 : 0, true);
  const bool with_lse = !in.flag(4);
  Buffer lse(in, FA_FLOAT32, {H, in.flag(32) ? total_q + 1 : total_q}, in.flag(16) ? 3 : 0, false);
  q.fill_random(in);
  k.fill_random(in);
  v.fill_random(in);

  fa_options options;
  fa_options_init(&options);
  options.causal = in.flag();
  options.window_left = in.flag(3) ? in.between(-2, 6) : -1;
  options.window_right = in.flag(3) ? in.between(-2, 6) : -1;
  const float caps[] = {0.0f, 0.5f, 30.0f};
  options.softcap = in.flag(4) ? caps[in.below(3)] : 0.0f;
  const float drops[] = {0.0f, 0.25f, 0.9f};
  options.dropout_p = in.flag(4) ? drops[in.below(3)] : 0.0f;
  options.dropout_seed = in.below(1000);
  Buffer slopes(in, FA_FLOAT32, in.flag() ? std::vector<int64_t>{H} : std::vector<int64_t>{B, H}, 0, false);
  slopes.fill_slopes();
  if (in.flag(4)) options.alibi_slopes = &slopes.t;
  fa_execution execution;
  fa_execution_init(&execution);
  execution.backend = FA_BACKEND_CPU;
  execution.num_threads = static_cast<int32_t>(in.between(0, 2));

  // Rows of k and v that no sequence uses hold NaN (as the values were meant: when a damaged
  // value still passes, the reference reads the same memory, so the check stays fair).
  const bool plain_ints = cu_k_t.t.dtype == FA_INT32 && cu_k_t.t.data != nullptr && cu_k_t.numel() == B + 1 &&
                          (!paged || (table_t.t.dtype == FA_INT32 && table_t.t.data != nullptr));
  // (Not where strides alias elements: a NaN written for an unused row would land on a used one,
  // and the engine skips the value rows of dropped keys where the reference multiplies them
  // by 0: with NaN there the two differ; see the report of issue 34.)
  if (plain_ints && k.t.data != nullptr && v.t.data != nullptr && k.t.dtype == v.t.dtype && k.t.ndim == v.t.ndim &&
      !k.self_overlapping() && !v.self_overlapping()) {
    const int64_t row = Hk * D;
    std::vector<uint8_t> needed(static_cast<size_t>(paged ? num_pages * page_size : total_k), 0);
    const std::vector<int32_t> ck = cu_k_t.int32_values();
    const std::vector<int32_t> tb = paged ? table_t.int32_values() : std::vector<int32_t>{};
    for (int64_t b = 0; b < B; ++b) {
      const int64_t keys = with_seqused ? used[size_t(b)] : int64_t{ck[size_t(b) + 1]} - ck[size_t(b)];
      for (int64_t p = 0; p < std::min<int64_t>(keys, static_cast<int64_t>(needed.size())); ++p) {
        int64_t r = ck[size_t(b)] + p;
        if (paged) {
          const int64_t slot = p / page_size;
          if (slot >= max_pages || table_t.t.sizes[0] <= b) break;
          r = int64_t{tb[size_t(b * table_t.t.sizes[1] + slot)]} * page_size + p % page_size;
        }
        if (r >= 0 && r < static_cast<int64_t>(needed.size())) needed[size_t(r)] = 1;
      }
    }
    for (int64_t e = 0; e < std::min(k.numel(), v.numel()); ++e)
      if (row > 0 && !needed[size_t(e / row)]) {
        k.write_nan(e);
        v.write_nan(e);
      }
  }

  const fa_tensor* seqused_arg = with_seqused ? &used_t.t : nullptr;
  const fa_status status =
      paged ? fa_forward_varlen_paged(&q.t, &k.t, &v.t, &out.t, with_lse ? &lse.t : nullptr, &cu_q_t.t, &cu_k_t.t,
                                      max_q, max_k, seqused_arg, &table_t.t, &options, &execution, nullptr)
            : fa_forward_varlen(&q.t, &k.t, &v.t, &out.t, with_lse ? &lse.t : nullptr, &cu_q_t.t, &cu_k_t.t, max_q,
                                max_k, seqused_arg, &options, &execution, nullptr);
  ++stats.calls;
  if (status != FA_OK) {
    if (!out.untouched() || !lse.untouched()) fail("a rejected call wrote its outputs");
    if (std::strlen(fa_last_error()) == 0) fail("a rejected call set no message");
    return 0;
  }
  ++stats.accepted;
  // Accepted: the index values are ones SPEC.md allows (the CPU backend checks them all).
  const std::vector<int32_t> cq = cu_q_t.int32_values(), ck = cu_k_t.int32_values();
  const std::vector<int32_t> su = with_seqused ? used_t.int32_values() : std::vector<int32_t>{};
  if (std::getenv("FUZZ_DEBUG") != nullptr) {  // to read a reproducer
    std::fprintf(stderr, "B=%lld H=%lld Hk=%lld D=%lld dtype=%d total_q=%d total_k=%d max_seqlen=(%lld, %lld) %s",
                 (long long)B, (long long)H, (long long)Hk, (long long)D, dtype, total_q, total_k, (long long)max_q,
                 (long long)max_k, paged ? "paged" : "packed");
    if (paged)
      std::fprintf(stderr, " k (%lld, %lld) table (%lld, %lld)", (long long)k.t.sizes[0], (long long)k.t.sizes[1],
                   (long long)table_t.t.sizes[0], (long long)table_t.t.sizes[1]);
    std::fprintf(stderr, "\n  cu_seqlens_q");
    for (int32_t x : cq) std::fprintf(stderr, " %d", x);
    std::fprintf(stderr, "\n  cu_seqlens_k");
    for (int32_t x : ck) std::fprintf(stderr, " %d", x);
    std::fprintf(stderr, "\n  seqused_k");
    for (int32_t x : su) std::fprintf(stderr, " %d", x);
    std::fprintf(stderr, "\n  block_table");
    for (int32_t x : paged ? table_t.int32_values() : std::vector<int32_t>{}) std::fprintf(stderr, " %d", x);
    std::fprintf(stderr, "\n");
  }
  // The call's batch is what cu_seqlens_q's length says (docs/SPEC.md); the fuzzer may have
  // given it another length than the intended B + 1, which is a valid call of that batch when
  // every tensor with a batch dimension agrees (both cu_seqlens of length 1: an empty batch).
  if (cq.empty() || ck.size() != cq.size()) fail("cu_seqlens of different lengths were accepted");
  const int64_t Bc = static_cast<int64_t>(cq.size()) - 1;
  if (with_seqused && su.size() != static_cast<size_t>(Bc)) fail("seqused_k of another length than B was accepted");
  if (paged && table_t.t.sizes[0] != Bc) fail("a block table of another batch than B was accepted");
  if (options.alibi_slopes != nullptr && slopes.t.ndim == 2 && slopes.t.sizes[0] != Bc)
    fail("ALiBi slopes of another batch than B were accepted");
  if (cq[0] != 0 || ck[0] != 0) fail("cu_seqlens not starting at 0 were accepted");
  if (max_q < 0 || max_k < 0 || max_q > 2147483647LL || max_k > 2147483647LL)
    fail("a max_seqlen outside [0, 2^31) was accepted");
  for (int64_t b = 0; b < Bc; ++b) {
    const int64_t lq = int64_t{cq[size_t(b) + 1]} - cq[size_t(b)], lk = int64_t{ck[size_t(b) + 1]} - ck[size_t(b)];
    if (lq < 0 || lk < 0) fail("decreasing cu_seqlens were accepted");
    if (lq > max_q || lk > max_k) fail("a sequence longer than max_seqlen was accepted");
    if (with_seqused && (su[size_t(b)] < 0 || su[size_t(b)] > lk)) fail("seqused_k outside [0, its key length] was accepted");
  }
  if (cq[size_t(Bc)] > q.t.sizes[0]) fail("cu_seqlens_q past the rows of q was accepted");
  if (!paged && ck[size_t(Bc)] > k.t.sizes[0]) fail("cu_seqlens_k past the rows of k was accepted");
  const std::vector<int32_t> tb = paged ? table_t.int32_values() : std::vector<int32_t>{};
  if (paged) {
    for (int64_t b = 0; b < Bc; ++b) {
      const int64_t keys = with_seqused ? su[size_t(b)] : int64_t{ck[size_t(b) + 1]} - ck[size_t(b)];
      if (keys > table_t.t.sizes[1] * page_size) fail("a sequence with more keys than its pages hold was accepted");
      for (int64_t slot = 0; slot * page_size < keys; ++slot) {
        const int32_t page = tb[size_t(b * table_t.t.sizes[1] + slot)];
        if (page < 0 || page >= k.t.sizes[0]) fail("a block table page outside [0, num_pages) was accepted");
      }
    }
  }
  // Rows past cu_seqlens_q[B] are neither read nor written: out's and lse's stay poison.
  const int64_t rows_done = cq[size_t(Bc)];
  for (int64_t e = rows_done * H * D; e < out.numel(); ++e)
    if (!out.element_untouched(e)) fail("an accepted call wrote a row of out past cu_seqlens_q[B]");
  if (with_lse)
    for (int64_t e = 0; e < lse.numel(); ++e)
      if (e % total_q >= rows_done && !lse.element_untouched(e)) fail("an accepted call wrote lse past cu_seqlens_q[B]");

  // The reference, on the sequences' rows. Paged keys are first gathered into a packed k and v
  // (sequence b's keys at rows packed[b] ..), with cu_seqlens_k their prefix sums.
  const flashattn::Options o = fuzz::reference_options(options, &slopes);
  flashattn::Varlen varlen;
  varlen.cu_seqlens_q = cu_q_t.view();
  varlen.cu_seqlens_k = cu_k_t.view();
  varlen.max_seqlen_q = max_q;
  varlen.max_seqlen_k = max_k;
  if (with_seqused) varlen.seqused_k = used_t.view();
  flashattn::TensorView kv = k.view(), vv = v.view();
  std::vector<int32_t> packed{0};
  std::vector<double> k_rows, v_rows;
  if (paged) {
    const std::vector<double> kp = flashattn::reference::gather(k.view()), vp = flashattn::reference::gather(v.view());
    const int64_t row = Hk * D;
    for (int64_t b = 0; b < Bc; ++b) {
      const int64_t keys = with_seqused ? su[size_t(b)] : int64_t{ck[size_t(b) + 1]} - ck[size_t(b)];
      for (int64_t p = 0; p < keys; ++p) {
        const int64_t r = int64_t{tb[size_t(b * table_t.t.sizes[1] + p / page_size)]} * page_size + p % page_size;
        k_rows.insert(k_rows.end(), kp.begin() + r * row, kp.begin() + (r + 1) * row);
        v_rows.insert(v_rows.end(), vp.begin() + r * row, vp.begin() + (r + 1) * row);
      }
      packed.push_back(packed.back() + static_cast<int32_t>(keys));
    }
  }
  std::optional<fuzz::Dense> k_packed, v_packed, cu_packed;
  if (paged) {
    kv = k_packed.emplace(dtype, std::vector<int64_t>{packed.back(), Hk, D}, k_rows).v;
    vv = v_packed.emplace(dtype, std::vector<int64_t>{packed.back(), Hk, D}, v_rows).v;
    varlen.cu_seqlens_k = cu_packed.emplace(FA_INT32, std::vector<int64_t>{Bc + 1}, std::vector<double>(packed.begin(), packed.end())).v;
    varlen.seqused_k.reset();  // the packed rows are exactly the keys used
  }
  const flashattn::reference::Result exact = flashattn::reference::forward(q.view(), kv, vv, o, &varlen);
  std::vector<double> low;
  if (dtype != FA_FLOAT32)
    low = flashattn::reference::forward(q.view(), kv, vv, o, &varlen, flashattn::reference::Arithmetic::InputDType).out;
  // Only the rows of the sequences count (the reference leaves the others 0).
  const size_t out_rows = static_cast<size_t>(rows_done * H * D);
  std::vector<double> got = flashattn::reference::gather(out.view());
  got.resize(out_rows);
  std::vector<double> want(exact.out.begin(), exact.out.begin() + static_cast<int64_t>(out_rows));
  if (!low.empty()) low.resize(out_rows);
  fuzz::expect_output(dtype, got, want, low, "out");
  if (with_lse) {
    std::vector<double> got_lse, want_lse;
    const std::vector<double> all = flashattn::reference::gather(lse.view());
    for (size_t e = 0; e < all.size(); ++e)
      if (static_cast<int64_t>(e) % total_q < rows_done) {
        got_lse.push_back(all[e]);
        want_lse.push_back(exact.lse[e]);
      }
    fuzz::expect_lse(got_lse, want_lse);
  }
  return 0;
}

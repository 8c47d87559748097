// The CPU forward for FP8 (e4m3) inputs: the semantics of docs/SPEC.md ("FP8 inputs"), not
// speed. Each sequence's rows are dequantised exactly (e4m3 value times its descale factor,
// both exact in fp32 up to the product's one rounding) into packed fp32 tensors, the fp32
// engine runs on them as a varlen batch, and its out is rounded to the caller's bf16 out.
//
// Packing every batch as varlen, one sequence after another, handles dense, varlen and paged
// keys alike: a page that several sequences share (with their own descales) is dequantised
// once per sequence, and seqused_k's unused keys are left out. The (b, h, i, j) positions
// that masks, ALiBi and dropout see are those of the caller's call.
#include "cpu/fp8.hpp"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "common/numeric.hpp"
#include "cpu/forward.hpp"

namespace flashattn::detail::cpu {

namespace {

const float8_e4m3_t* e4m3_at(const void* base, int64_t offset) {
  return static_cast<const float8_e4m3_t*>(base) + offset;
}

// Writes `rows` rows of `heads` heads of an fp8 tensor, dequantised, into the packed fp32
// (rows, heads, dim) block `to`. row_offset(r) is the element offset of row r (head 0);
// dim_stride that between a row's columns (not 1 only for v given (d, seqlen)-major).
template <typename RowOffset>
void dequantise_rows(const void* from, int64_t head_stride, const Descale& descale, int32_t b,
                     int32_t heads, int32_t group, int64_t rows, int32_t dim,
                     RowOffset row_offset, float* to, int64_t dim_stride = 1) {
  for (int64_t r = 0; r < rows; ++r)
    for (int32_t h = 0; h < heads; ++h) {
      const float factor = descale.at(b, h / group, r);
      const float8_e4m3_t* x = e4m3_at(from, row_offset(r) + h * head_stride);
      float* y = to + (r * heads + h) * dim;
      for (int32_t d = 0; d < dim; ++d) y[d] = to_float(x[d * dim_stride]) * factor;
    }
}

}  // namespace

size_t forward_fp8(const ForwardParams& p) {
  const int32_t B = p.batch, H = p.heads, Hk = p.heads_k, D = p.head_dim, Dv = p.head_dim_v;

  // The packed batch: sequence b's queries and (used) keys, one sequence after another.
  // Its prefix sums are int32, as every varlen batch's.
  std::vector<SequenceView> seqs(static_cast<size_t>(B));
  std::vector<int32_t> cu_q(static_cast<size_t>(B) + 1, 0), cu_k(static_cast<size_t>(B) + 1, 0);
  int64_t longest_q = 0, longest_k = 0, rows_q = 0, rows_k = 0;
  for (int32_t b = 0; b < B; ++b) {
    const SequenceView s = sequence_view(p, b);
    seqs[size_t(b)] = s;
    rows_q += s.seqlen_q;
    rows_k += s.seqlen_k;
    if (rows_q > INT32_MAX || rows_k > INT32_MAX)
      throw Error(ErrorCode::Unsupported, rows_q > INT32_MAX ? "q" : "k",
                  "fewer than 2^31 rows in all for fp8_e4m3 inputs on the cpu backend",
                  std::to_string(std::max(rows_q, rows_k)) + " rows in the first " +
                      std::to_string(b + 1) + " sequences");
    cu_q[size_t(b) + 1] = static_cast<int32_t>(rows_q);
    cu_k[size_t(b) + 1] = static_cast<int32_t>(rows_k);
    longest_q = std::max(longest_q, s.seqlen_q);
    longest_k = std::max(longest_k, s.seqlen_k);
  }
  const int64_t total_q = cu_q.back(), total_k = cu_k.back();
  std::vector<float> q(size_t(total_q * H * D)), k(size_t(total_k * Hk * D)),
      v(size_t(total_k * Hk * Dv)), out(size_t(total_q * H * Dv)),
      lse(p.lse != nullptr ? size_t(total_q * H) : 0);

  for (int32_t b = 0; b < B; ++b) {
    const SequenceView& s = seqs[size_t(b)];
    const int64_t q_row0 = b * p.q_batch_stride + s.q_row0 * p.q_row_stride;
    dequantise_rows(p.q, p.q_head_stride, p.q_descale, b, H, H / Hk, s.seqlen_q, D,
                    [&](int64_t i) { return q_row0 + i * p.q_row_stride; },
                    q.data() + int64_t{cu_q[size_t(b)]} * H * D);
    // Key j of sequence b: in its pages, or at row k_row0 + j of its batch entry.
    const auto key_row = [&](int64_t batch_stride, int64_t row_stride) {
      return [&p, &s, b, batch_stride, row_stride](int64_t j) {
        if (!p.is_paged()) return b * batch_stride + (s.k_row0 + j) * row_stride;
        const PagedRow at = paged_row(p, b, j);
        return at.page * batch_stride + at.row * row_stride;
      };
    };
    dequantise_rows(p.k, p.k_head_stride, p.k_descale, b, Hk, 1, s.seqlen_k, D,
                    key_row(p.k_batch_stride, p.k_row_stride),
                    k.data() + int64_t{cu_k[size_t(b)]} * Hk * D);
    dequantise_rows(p.v, p.v_head_stride, p.v_descale, b, Hk, 1, s.seqlen_k, Dv,
                    key_row(p.v_batch_stride, p.v_row_stride),
                    v.data() + int64_t{cu_k[size_t(b)]} * Hk * Dv, p.v_dim_stride);
  }

  ForwardParams f = p;
  f.dtype = DType::Float32;
  f.q = q.data();
  f.k = k.data();
  f.v = v.data();
  f.out = out.data();
  f.lse = p.lse != nullptr ? lse.data() : nullptr;
  f.seqlen_q = longest_q;
  f.seqlen_k = longest_k;
  f.total_q = total_q;
  f.total_k = total_k;
  f.cu_seqlens_q = cu_q.data();
  f.cu_seqlens_k = cu_k.data();
  f.seqused_k = nullptr;
  f.block_table = nullptr;
  f.q_batch_stride = f.k_batch_stride = f.v_batch_stride = f.out_batch_stride = 0;
  f.q_row_stride = int64_t{H} * D;
  f.k_row_stride = int64_t{Hk} * D;
  f.v_row_stride = int64_t{Hk} * Dv;
  f.out_row_stride = int64_t{H} * Dv;
  f.q_head_stride = f.k_head_stride = D;
  f.v_head_stride = f.out_head_stride = Dv;
  f.lse_batch_stride = 0;  // varlen lse: (H, total_q)
  f.lse_head_stride = total_q;
  f.v_dim_stride = 1;  // the packed copy is row-major
  f.q_descale = f.k_descale = f.v_descale = Descale{};
  const size_t engine_bytes = forward(f);

  // Back into the caller's layout: out rounded to bf16, lse as computed.
  auto* caller_out = static_cast<bfloat16_t*>(p.out);
  for (int32_t b = 0; b < B; ++b) {
    const SequenceView& s = seqs[size_t(b)];
    for (int64_t i = 0; i < s.seqlen_q; ++i) {
      const int64_t packed_row = cu_q[size_t(b)] + i;
      for (int32_t h = 0; h < H; ++h) {
        const float* from = out.data() + (packed_row * H + h) * Dv;
        bfloat16_t* to = caller_out + b * p.out_batch_stride +
                         (s.q_row0 + i) * p.out_row_stride + h * p.out_head_stride;
        for (int32_t d = 0; d < Dv; ++d) to[d] = to_bfloat16(from[d]);
        if (p.lse != nullptr)
          p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + s.q_row0 + i] =
              lse[size_t(h * total_q + packed_row)];
      }
    }
  }
  const size_t copies = q.size() + k.size() + v.size() + out.size() + lse.size();
  return engine_bytes + copies * sizeof(float);
}

}  // namespace flashattn::detail::cpu

// What only the CUDA path has: device-side checks, stream handling, and the padded copies of
// head dims that are not multiples of 8 (their workspace, alignment rule and graph capture).
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "support.hpp"

namespace flashattn::testing {
namespace {

struct DeviceProblem {
  Case c;
  Inputs in;
  Buffer out_buf, lse_buf;
  DeviceProblem() {
    c.seqlen_q = 70;
    c.seqlen_k = 90;
    c.heads = 4;
    c.heads_k = 2;
    c.head_dim = 64;
    c.dtype = DType::BFloat16;
    in = make_inputs(c);
    out_buf = Buffer(c.dtype, 70 * 4 * 64);
    lse_buf = Buffer(DType::Float32, 4 * 70);
  }
  TensorView out() { return out_buf.view({1, 70, 4, 64}); }
  TensorView lse() { return lse_buf.view({1, 4, 70}); }
};

Execution cuda_execution() {
  Execution e;
  e.backend = Backend::CUDA;
  return e;
}

TEST(CudaBackend, MisalignedRowsAreRejectedBeforeAnyWrite) {
  DeviceProblem p;
  DeviceMirror q(p.in.q), k(p.in.k), v(p.in.v), out(p.out());
  TensorView shifted = q.view();
  shifted.data = static_cast<char*>(shifted.data) + 2;  // one bf16 element in
  out.poison();
  try {
    forward(shifted, k.view(), v.view(), out.view(), std::nullopt, {}, cuda_execution());
    ADD_FAILURE() << "a misaligned q was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "q") << e.what();
    EXPECT_NE(e.expected().find("16-byte aligned"), std::string::npos) << e.what();
  }
}

TEST(CudaBackend, HostPointerClaimedToBeOnTheGpuIsRejected) {
  DeviceProblem p;
  DeviceMirror k(p.in.k), v(p.in.v), out(p.out());
  TensorView host_q = p.in.q;
  host_q.device = {DeviceType::CUDA, 0};
  try {
    forward(host_q, k.view(), v.view(), out.view(), std::nullopt, {}, cuda_execution());
    ADD_FAILURE() << "a host q was accepted as GPU memory";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "q") << e.what();
    EXPECT_NE(e.given().find("host memory"), std::string::npos) << e.what();
  }
}

TEST(CudaBackend, GpuPointerClaimedToBeOnTheHostIsRejected) {
  DeviceProblem p;
  DeviceMirror q(p.in.q);
  TensorView claimed_host = q.view();
  claimed_host.device = {DeviceType::CPU, 0};
  try {
    forward(claimed_host, p.in.k, p.in.v, p.out(), std::nullopt, {});
    ADD_FAILURE() << "a GPU q was handed to the CPU engine";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "q") << e.what();
  }
}

TEST(CudaBackend, Fp32IsRejectedClearly) {
  Case c;
  c.dtype = DType::Float32;
  c.seqlen_q = 8;
  c.seqlen_k = 8;
  Inputs in = make_inputs(c);
  Buffer out(DType::Float32, 8 * 64);
  DeviceMirror q(in.q), k(in.k), v(in.v), o(out.view({1, 8, 1, 64}));
  try {
    forward(q.view(), k.view(), v.view(), o.view(), std::nullopt, {}, cuda_execution());
    ADD_FAILURE() << "fp32 was accepted on CUDA";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Unsupported) << e.what();
    EXPECT_NE(e.expected().find("fp16 or bf16"), std::string::npos) << e.what();
  }
}

TEST(CudaBackend, RunsOnTheGivenStream) {
  DeviceProblem p;
  DeviceMirror q(p.in.q), k(p.in.k), v(p.in.v), out(p.out()), lse(p.lse());
  cudaStream_t stream;
  cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  out.poison();
  lse.poison();
  Execution e = cuda_execution();
  e.stream = stream;
  Options o;
  o.causal = true;
  forward(q.view(), k.view(), v.view(), out.view(), lse.view(), o, e);
  cuda_check(cudaStreamSynchronize(stream), "sync");
  cuda_check(cudaStreamDestroy(stream), "destroy");
  out.download();
  lse.download();
  const TensorView host_lse = p.lse();
  expect_matches_reference(p.in.q, p.in.k, p.in.v, o, nullptr, p.out(), &host_lse, "stream");
}

// A head dim that is not a multiple of 8 runs on zero-padded copies (cuda/head_dim_padding.hpp):
// one copy of q, k, v and out each, round_up(D, 8) elements a row, each copy starting on a
// 256-byte boundary, all reported as workspace; a multiple of 8 allocates nothing.
size_t padded_copy_bytes(int64_t rows, int64_t head_dim) {
  const int64_t bytes = rows * ((head_dim + 7) / 8 * 8) * 2;
  return static_cast<size_t>((bytes + 255) / 256 * 256);
}

TEST(CudaBackend, OddHeadDimRunsOnPaddedCopiesAndReportsThem) {
  for (const int64_t d : {59, 64}) {
    Case c{.batch = 2, .seqlen_q = 70, .seqlen_k = 90, .heads = 4, .heads_k = 2, .head_dim = d,
           .dtype = DType::BFloat16, .causal = true};
    SCOPED_TRACE(c.describe());
    Inputs in = make_inputs(c);
    Buffer out(c.dtype, 2 * 70 * 4 * d), lse(DType::Float32, 2 * 4 * 70);
    const TensorView host_out = out.view({2, 70, 4, d}), host_lse = lse.view({2, 4, 70});
    DeviceMirror q(in.q), k(in.k), v(in.v), o(host_out), l(host_lse);
    o.poison();
    l.poison();
    Options opts;
    opts.causal = true;
    const RunInfo info = forward(q.view(), k.view(), v.view(), o.view(), l.view(), opts,
                                 cuda_execution());
    cuda_check(cudaDeviceSynchronize(), "kernel");
    o.download();
    l.download();
    const size_t expected = d % 8 == 0 ? 0
                                       : 2 * padded_copy_bytes(2 * 70 * 4, d) +
                                             2 * padded_copy_bytes(2 * 90 * 2, d);
    EXPECT_EQ(info.workspace_bytes, expected);
    expect_matches_reference(in.q, in.k, in.v, opts, nullptr, host_out, &host_lse, "padded");
  }
}

// The padded copies read and write the caller's rows element by element: rows that are not
// 16-byte aligned are fine at such a head dim (a pointer one bf16 element in), a pointer that
// is not even element-aligned is refused before anything runs.
TEST(CudaBackend, OddHeadDimNeedsOnlyElementAlignedRows) {
  const int64_t Sq = 33, Sk = 47, H = 2, D = 37;
  Case c{.seqlen_q = Sq, .seqlen_k = Sk, .heads = H, .heads_k = H, .head_dim = D,
         .dtype = DType::BFloat16};
  Inputs in = make_inputs(c);
  // q one element into a larger device buffer.
  void* raw = nullptr;
  cuda_check(cudaMalloc(&raw, (Sq * H * D + 2) * 2), "cudaMalloc");
  cuda_check(cudaMemcpy(static_cast<char*>(raw) + 2, in.q.data, Sq * H * D * 2,
                        cudaMemcpyHostToDevice),
             "upload");
  TensorView q = in.q;
  q.device = {DeviceType::CUDA, 0};
  q.data = static_cast<char*>(raw) + 2;
  Buffer out(c.dtype, Sq * H * D);
  const TensorView host_out = out.view({1, Sq, H, D});
  DeviceMirror k(in.k), v(in.v), o(host_out);
  o.poison();
  EXPECT_NO_THROW(forward(q, k.view(), v.view(), o.view(), std::nullopt, {}, cuda_execution()));
  cuda_check(cudaDeviceSynchronize(), "kernel");
  o.download();
  expect_matches_reference(in.q, in.k, in.v, {}, nullptr, host_out, nullptr, "q 2 bytes in");

  q.data = static_cast<char*>(raw) + 1;
  out.poison();
  o.poison();
  try {
    forward(q, k.view(), v.view(), o.view(), std::nullopt, {}, cuda_execution());
    ADD_FAILURE() << "a q misaligned by one byte was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "q") << e.what();
    EXPECT_NE(e.expected().find("element-aligned"), std::string::npos) << e.what();
  }
  cuda_check(cudaDeviceSynchronize(), "sync");
  o.download();
  for (double x : reference::gather(host_out)) ASSERT_TRUE(std::isnan(x)) << "out was written";
  cuda_check(cudaFree(raw), "cudaFree");
}

// The padded copies are allocated, filled and copied back on the call's stream with no host
// synchronisation, so a forward at such a head dim captures into a CUDA graph and replays.
TEST(CudaBackend, OddHeadDimCapturesInACudaGraph) {
  Case c{.batch = 2, .seqlen_q = 65, .seqlen_k = 80, .heads = 4, .heads_k = 1, .head_dim = 111,
         .dtype = DType::Float16, .causal = true};
  Inputs in = make_inputs(c);
  Buffer out(c.dtype, 2 * 65 * 4 * 111), lse(DType::Float32, 2 * 4 * 65);
  const TensorView host_out = out.view({2, 65, 4, 111}), host_lse = lse.view({2, 4, 65});
  DeviceMirror q(in.q), k(in.k), v(in.v), o(host_out), l(host_lse);
  cudaStream_t stream;
  cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  Execution e = cuda_execution();
  e.stream = stream;
  Options opts;
  opts.causal = true;
  cudaGraph_t graph;
  cuda_check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "begin capture");
  forward(q.view(), k.view(), v.view(), o.view(), l.view(), opts, e);
  cuda_check(cudaStreamEndCapture(stream, &graph), "end capture");
  cudaGraphExec_t exec;
  cuda_check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  for (int replay = 0; replay < 2; ++replay) {
    o.poison();
    l.poison();
    cuda_check(cudaGraphLaunch(exec, stream), "replay");
    cuda_check(cudaStreamSynchronize(stream), "sync");
    o.download();
    l.download();
    expect_matches_reference(in.q, in.k, in.v, opts, nullptr, host_out, &host_lse,
                             "graph replay " + std::to_string(replay));
  }
  cuda_check(cudaGraphExecDestroy(exec), "destroy exec");
  cuda_check(cudaGraphDestroy(graph), "destroy graph");
  cuda_check(cudaStreamDestroy(stream), "destroy stream");
}

// --- Device-resident varlen values (docs/SPEC.md: "On CUDA these tensors live on the GPU")

// A ragged batch of three sequences on the GPU, dense or paged, whose integer tensors a test
// may corrupt: q lengths (40, 70, 25), k lengths (90, 130, 60), H=4, Hk=2, D=64, bf16.
struct DeviceVarlen {
  static constexpr int64_t B = 3, H = 4, Hk = 2, D = 64, total_q = 135, total_k = 280;
  static constexpr int64_t kGuard = 4096;  // elements after out and lse that must stay intact
  std::vector<int32_t> cu_q{0, 40, 110, 135}, cu_k{0, 90, 220, 280};
  Buffer q{DType::BFloat16, total_q * H * D}, k{DType::BFloat16, total_k * Hk * D},
      v{DType::BFloat16, total_k * Hk * D};
  Buffer out{DType::BFloat16, total_q * H * D + kGuard},
      lse{DType::Float32, H * total_q + kGuard};
  DeviceVarlen() {
    q.fill_random();
    k.fill_random();
    v.fill_random();
  }
  TensorView qv() { return q.view({total_q, H, D}); }
  TensorView kv() { return k.view({total_k, Hk, D}); }
  TensorView vv() { return v.view({total_k, Hk, D}); }

  // Runs the call with out and lse inside larger device buffers filled with a byte pattern,
  // and returns whether the pattern past them survived; out and lse come back to the host.
  bool run(const TensorView& keys, const TensorView& values, const std::vector<int32_t>& cq,
           const std::vector<int32_t>& ck, const std::optional<TensorView>& table,
           const Options& options = {}) {
    Buffer cq_buf = int32_buffer(cq), ck_buf = int32_buffer(ck);
    DeviceMirror dq(qv()), dk(keys), dv(values), dcq(cq_buf.view({B + 1})),
        dck(ck_buf.view({B + 1})), dout(out.view({out.count()})), dlse(lse.view({lse.count()}));
    std::optional<DeviceMirror> dtable;
    cuda_check(cudaMemset(const_cast<void*>(dout.view().data), 0x5a, out.bytes.size()), "fill");
    cuda_check(cudaMemset(const_cast<void*>(dlse.view().data), 0x5a, lse.bytes.size()), "fill");
    Varlen varlen;
    varlen.cu_seqlens_q = dcq.view();
    varlen.cu_seqlens_k = dck.view();
    varlen.max_seqlen_q = 70;
    varlen.max_seqlen_k = 130;
    if (table) varlen.block_table = dtable.emplace(*table).view();
    TensorView o = dout.view(), l = dlse.view();
    o = TensorView::contiguous(o.data, o.dtype, {total_q, H, D}, o.device);
    l = TensorView::contiguous(l.data, l.dtype, {H, total_q}, l.device);
    forward_varlen(dq.view(), dk.view(), dv.view(), o, l, varlen, options, cuda_execution());
    cuda_check(cudaDeviceSynchronize(), "kernel");
    dout.download();
    dlse.download();
    bool intact = true;
    for (size_t i = size_t(total_q * H * D) * 2; i < out.bytes.size(); ++i)
      intact &= out.bytes[i] == 0x5a;
    for (size_t i = size_t(H * total_q) * 4; i < lse.bytes.size(); ++i)
      intact &= lse.bytes[i] == 0x5a;
    return intact;
  }

  // The rows [row0, row1) of out against the reference of the dense batch (same rows).
  void expect_rows_match(int64_t row0, int64_t row1, const Options& options, const char* what) {
    Buffer cq_buf = int32_buffer(cu_q), ck_buf = int32_buffer(cu_k);
    Varlen varlen;
    varlen.cu_seqlens_q = cq_buf.view({B + 1});
    varlen.cu_seqlens_k = ck_buf.view({B + 1});
    varlen.max_seqlen_q = 70;
    varlen.max_seqlen_k = 130;
    const reference::Result exact = reference::forward(qv(), kv(), vv(), options, &varlen);
    const reference::Result low = reference::forward(qv(), kv(), vv(), options, &varlen,
                                                     reference::Arithmetic::InputDType);
    const std::vector<double> got = reference::gather(out.view({total_q, H, D}));
    const auto rows = [&](const std::vector<double>& all) {
      return std::vector<double>(all.begin() + row0 * H * D, all.begin() + row1 * H * D);
    };
    const reference::Check c =
        reference::check_forward(DType::BFloat16, rows(got), rows(exact.out), rows(low.out));
    EXPECT_TRUE(c.passed()) << what << ": rows " << row0 << ".." << row1 - 1 << " error "
                            << c.max_abs_error << " > " << c.tolerance;
  }
};

// A page index outside [0, num_pages) in device memory is never dereferenced: the rows of
// the query blocks that would read it come out NaN (out and lse), the other sequences are
// exact, and nothing past out or lse is written. (Under compute-sanitizer the call also reads
// nothing outside the pages and the table.)
// Pages of 16 (the sm80 kernel on Hopper) and 64 (the TMA kernel, which loads NaN keys there).
TEST(CudaVarlenGuards, PageIndexOutOfRangeGivesNaNRows) {
  for (const auto& [page_size, slot] : {std::pair{16, 2}, std::pair{64, 0}})
    for (const int32_t bad : {-5, 1 << 30}) {
      SCOPED_TRACE("pages of " + std::to_string(page_size) + ", block_table[1][" +
                   std::to_string(slot) + "] = " + std::to_string(bad));
      DeviceVarlen p;
      PagedKeys pages = page_keys(p.kv(), p.vv(), p.cu_k, nullptr, page_size, false);
      // Keys 32..47 (16) or 0..63 (64) of sequence 1, which every one of its rows sees.
      static_cast<int32_t*>(pages.block_table.data)[1 * pages.max_pages + slot] = bad;
      EXPECT_TRUE(p.run(pages.k, pages.v, p.cu_q, p.cu_k, pages.block_table));
      const auto* out = reinterpret_cast<const detail::bfloat16_t*>(p.out.data());
      const auto* lse = static_cast<const float*>(p.lse.data());
      for (int64_t i = 40 * p.H * p.D; i < 110 * p.H * p.D; ++i)
        ASSERT_TRUE(std::isnan(detail::to_float(out[i]))) << "out element " << i;
      for (int64_t h = 0; h < p.H; ++h)
        for (int64_t r = 40; r < 110; ++r) ASSERT_TRUE(std::isnan(lse[h * p.total_q + r]));
      p.expect_rows_match(0, 40, {}, "sequence 0");
      p.expect_rows_match(110, 135, {}, "sequence 2");
    }
}

// cu_seqlens past the tensors' rows (or negative, or lengths past the pages): every range is
// held inside q/out and k/v (common/params.hpp, sequence_view), so the call completes and
// writes nothing past out and lse, and sequences whose values, held in range, are their own
// are exact.
TEST(CudaVarlenGuards, CuSeqlensPastTheTensorsStayInside) {
  DeviceVarlen p;
  Options causal;
  causal.causal = true;
  // Held at total_q = 135 and total_k = 280: exactly the batch.
  EXPECT_TRUE(
      p.run(p.kv(), p.vv(), {0, 40, 110, 5000}, {0, 90, 220, 100000}, std::nullopt, causal));
  p.expect_rows_match(0, p.total_q, causal, "dense, ends past the rows");
  // Negative entries: sequence 2 then spans rows 0 .. 134 (what it writes is not checked).
  EXPECT_TRUE(p.run(p.kv(), p.vv(), {0, 40, -7, 135}, {0, 90, -3, 280}, std::nullopt, causal));
  PagedKeys pages = page_keys(p.kv(), p.vv(), p.cu_k, nullptr, 7, true);
  // Sequence 2 of negative length: no keys.
  EXPECT_TRUE(p.run(pages.k, pages.v, p.cu_q, {0, 90, 220, -3}, pages.block_table, causal));
  p.expect_rows_match(0, 110, causal, "paged, sequences 0 and 1");
  // Sequence 1 of about 2^31 keys: held at its pages' width, whose slots past its keys hold
  // indices out of range (page_keys), so its rows are NaN; sequence 2 keeps its 60 keys.
  EXPECT_TRUE(p.run(pages.k, pages.v, p.cu_q, {0, 90, 2147483000, 2147483060},
                    pages.block_table, causal));
  p.expect_rows_match(0, 40, causal, "paged, sequence 0");
  p.expect_rows_match(110, p.total_q, causal, "paged, sequence 2");
}

}  // namespace
}  // namespace flashattn::testing

// What only the CUDA path has: device-side checks, stream handling, and the padded copies of
// head dims that are not multiples of 8 (their workspace, alignment rule and graph capture).
#include <cmath>
#include <string>

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

}  // namespace
}  // namespace flashattn::testing

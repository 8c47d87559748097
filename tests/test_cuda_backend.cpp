// What only the CUDA path has: device-side checks and stream handling.
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

}  // namespace
}  // namespace flashattn::testing

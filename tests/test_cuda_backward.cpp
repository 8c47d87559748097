// What only the CUDA backward has: its two modes (deterministic runs bitwise equal, the
// default mode within rounding of it), its dropout mask against the CPU's bit for bit, the
// workspace it reports, the caller's stream, and the validation rules of the CUDA path.
// Compiled into test_backward_cuda only.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>

#include "support.hpp"

namespace flashattn::testing {
namespace {

Execution on(Backend backend) {
  Execution e;
  e.backend = backend;
  return e;
}

// One dense problem: host inputs, the CPU engine's forward (out, lse), host gradients, and
// device mirrors of all of them.
struct GpuProblem {
  Case c;
  Options o;
  Inputs in;
  Buffer out, lse, dout, dq, dk, dv;

  GpuProblem(Case shape, Options options) : c(shape), o(options) {
    in = make_inputs(c);
    const int64_t B = c.batch, Sq = c.seqlen_q, Sk = c.seqlen_k, H = c.heads, Hk = c.heads_k,
                  D = c.head_dim;
    out = Buffer(c.dtype, B * Sq * H * D);
    lse = Buffer(DType::Float32, B * H * Sq);
    dout = Buffer(c.dtype, B * Sq * H * D);
    dq = Buffer(c.dtype, B * Sq * H * D);
    dk = Buffer(c.dtype, B * Sk * Hk * D);
    dv = Buffer(c.dtype, B * Sk * Hk * D);
    dout.fill_random();
    forward(in.q, in.k, in.v, out_view(), lse_view(), o, on(Backend::CPU));
  }
  TensorView out_view() { return out.view({c.batch, c.seqlen_q, c.heads, c.head_dim}); }
  TensorView dout_view() { return dout.view({c.batch, c.seqlen_q, c.heads, c.head_dim}); }
  TensorView lse_view() { return lse.view({c.batch, c.heads, c.seqlen_q}); }
  TensorView dq_view() { return dq.view({c.batch, c.seqlen_q, c.heads, c.head_dim}); }
  TensorView dk_view() { return dk.view({c.batch, c.seqlen_k, c.heads_k, c.head_dim}); }
  TensorView dv_view() { return dv.view({c.batch, c.seqlen_k, c.heads_k, c.head_dim}); }
};

// Device copies of a problem's tensors, for calls made directly (not through
// backward_on_backend).
struct DeviceTensors {
  DeviceMirror q, k, v, out, dout, lse, dq, dk, dv;
  explicit DeviceTensors(GpuProblem& p)
      : q(p.in.q), k(p.in.k), v(p.in.v), out(p.out_view()), dout(p.dout_view()),
        lse(p.lse_view()), dq(p.dq_view()), dk(p.dk_view()), dv(p.dv_view()) {}
  RunInfo backward(const Options& o, Execution e = on(Backend::CUDA)) {
    dq.poison();
    dk.poison();
    dv.poison();
    const RunInfo info = flashattn::backward(q.view(), k.view(), v.view(), out.view(),
                                             dout.view(), lse.view(), dq.view(), dk.view(),
                                             dv.view(), o, e);
    cuda_check(cudaDeviceSynchronize(), "kernel");
    dq.download();
    dk.download();
    dv.download();
    return info;
  }
};

// GQA 6/2, causal with Sq != Sk, dropout, lengths off every tile size.
Case odd_gqa_case() {
  Case c;
  c.batch = 2;
  c.seqlen_q = 173;
  c.seqlen_k = 211;
  c.heads = 6;
  c.heads_k = 2;
  c.head_dim = 72;
  c.dtype = DType::BFloat16;
  c.causal = true;
  return c;
}

Options dropout_options(const Case& c, bool deterministic) {
  Options o;
  o.causal = c.causal;
  o.dropout_p = 0.15f;
  o.dropout_seed = 0x1234abcd5678ull;
  o.dropout_offset = 977;
  o.deterministic = deterministic;
  return o;
}

void expect_gradients_match_reference(GpuProblem& p, const std::string& what) {
  const reference::Gradients exact =
      reference::backward(p.in.q, p.in.k, p.in.v, p.dout_view(), p.o);
  const reference::Gradients low = reference::backward(p.in.q, p.in.k, p.in.v, p.dout_view(),
                                                       p.o, nullptr,
                                                       reference::Arithmetic::InputDType);
  const double largest = reference::largest_magnitude(exact);
  using reference::Gradient;
  const struct {
    const char* name;
    Gradient which;
    TensorView actual;
    const std::vector<double>& exact;
    const std::vector<double>& low;
  } grads[] = {{"dq", Gradient::dQ, p.dq_view(), exact.dq, low.dq},
               {"dk", Gradient::dK, p.dk_view(), exact.dk, low.dk},
               {"dv", Gradient::dV, p.dv_view(), exact.dv, low.dv}};
  for (const auto& g : grads) {
    const reference::Check check = reference::check_backward(
        p.c.dtype, reference::gather(g.actual), g.exact, g.low, largest,
        reference::floor_scale(g.which, p.o, p.c.head_dim));
    EXPECT_TRUE(check.passed()) << what << " " << g.name << ": max abs error "
                                << check.max_abs_error << " > tolerance " << check.tolerance;
  }
}

// A process that drives two GPUs: each call runs on the GPU its tensors live on, whichever
// one the caller has current, and leaves the caller's current; each GPU gets the kernels'
// shared-memory opt-in (CUDA keeps it per device: head dim 128's forward and backward tiles
// need more than 48 KiB). The tensors go to cuda:1 first, so that cuda:0 is never the one
// set up first. Skipped with fewer than two GPUs.
TEST(CudaMultiGpu, EachCallRunsOnItsTensorsGpu) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count < 2) {
    cudaGetLastError();
    GTEST_SKIP() << "needs two GPUs; this machine has " << count;
  }
  Case c = odd_gqa_case();
  c.head_dim = 128;
  Options o;
  o.causal = c.causal;
  for (const int device : {1, 0}) {
    const int other = 1 - device;
    SCOPED_TRACE("tensors on cuda:" + std::to_string(device) + ", cuda:" + std::to_string(other) +
                 " current at each call");
    cuda_check(cudaSetDevice(device), "cudaSetDevice");
    GpuProblem p(c, o);
    DeviceTensors d(p);  // on `device`
    d.out.poison();
    d.lse.poison();
    d.dq.poison();
    d.dk.poison();
    d.dv.poison();

    // Runs `call` with the other GPU current, checks that it is current after, then waits
    // for the tensors' GPU.
    const auto from_the_other_gpu = [&](const char* what, const auto& call) {
      cuda_check(cudaSetDevice(other), "cudaSetDevice");
      call();
      int current = -1;
      cuda_check(cudaGetDevice(&current), "cudaGetDevice");
      EXPECT_EQ(current, other) << "the caller's current GPU after the " << what;
      cuda_check(cudaSetDevice(device), "cudaSetDevice");
      cuda_check(cudaDeviceSynchronize(), what);
    };

    from_the_other_gpu("forward", [&] {
      forward(d.q.view(), d.k.view(), d.v.view(), d.out.view(), d.lse.view(), o, on(Backend::CUDA));
    });
    d.out.download();
    d.lse.download();
    const TensorView lse = p.lse_view();
    expect_matches_reference(p.in.q, p.in.k, p.in.v, o, nullptr, p.out_view(), &lse, "forward");

    from_the_other_gpu("backward", [&] {
      backward(d.q.view(), d.k.view(), d.v.view(), d.out.view(), d.dout.view(), d.lse.view(), d.dq.view(),
               d.dk.view(), d.dv.view(), o, on(Backend::CUDA));
    });
    d.dq.download();
    d.dk.download();
    d.dv.download();
    expect_gradients_match_reference(p, "backward");
  }
}

// The odd GQA case with dropout, and (on Hopper: the TMA kernel's turns, key blocks adding to
// each dQ tile in their order) a longer causal one with a sliding window and softcap at head dim
// 64, where 9 key blocks add to a tile and the first block differs from tile to tile.
TEST(CudaBackward, DeterministicModeIsBitwiseReproducible) {
  Case windowed;
  windowed.batch = 2;
  windowed.seqlen_q = 1000;
  windowed.seqlen_k = 1100;
  windowed.heads = 4;
  windowed.heads_k = 2;
  windowed.head_dim = 64;
  windowed.dtype = DType::BFloat16;
  windowed.causal = true;
  windowed.window_left = 700;
  windowed.softcap = 20.0f;
  for (const Case& c : {odd_gqa_case(), windowed}) {
    SCOPED_TRACE(c.describe());
    Options o = dropout_options(c, true);
    if (c.window_left >= 0) {
      o.dropout_p = 0.0f;
      o.window_left = c.window_left;
      o.softcap = c.softcap;
    }
    GpuProblem p(c, o);
    DeviceTensors d(p);
    std::vector<unsigned char> first[3];
    for (int run = 0; run < 50; ++run) {
      const RunInfo info = d.backward(p.o);
      EXPECT_TRUE(info.deterministic);
      const Buffer* grads[] = {&p.dq, &p.dk, &p.dv};
      for (int g = 0; g < 3; ++g) {
        if (run == 0)
          first[g] = grads[g]->bytes;
        else
          ASSERT_EQ(grads[g]->bytes, first[g]) << "gradient " << "qkv"[g] << ", run " << run;
      }
    }
    expect_gradients_match_reference(p, "deterministic");
  }
}

TEST(CudaBackward, DefaultModeAgreesWithDeterministicMode) {
  const Case c = odd_gqa_case();
  SCOPED_TRACE(c.describe());
  GpuProblem p(c, dropout_options(c, false));
  DeviceTensors d(p);
  const RunInfo info = d.backward(p.o);
  EXPECT_FALSE(info.deterministic);  // dQ is summed with atomics in no fixed order
  expect_gradients_match_reference(p, "default");
  const std::vector<double> dq = reference::gather(p.dq_view());
  const std::vector<unsigned char> dk = p.dk.bytes, dv = p.dv.bytes;
  Options deterministic = p.o;
  deterministic.deterministic = true;
  d.backward(deterministic);
  // dK and dV come from the same kernel summing in the same order in both modes.
  EXPECT_EQ(p.dk.bytes, dk);
  EXPECT_EQ(p.dv.bytes, dv);
  // dQ differs only by the order of fp32 additions before one rounding to bf16: at most an
  // ulp or two of the largest element.
  const std::vector<double> dq_det = reference::gather(p.dq_view());
  double largest = 0, worst = 0;
  for (size_t n = 0; n < dq.size(); ++n) {
    largest = std::max(largest, std::abs(dq_det[n]));
    worst = std::max(worst, std::abs(dq[n] - dq_det[n]));
  }
  EXPECT_GT(largest, 0.0);
  EXPECT_LE(worst, std::ldexp(largest, -6)) << "largest |dq| " << largest;
}

// More blocks than a CUDA grid's y extent (65535): the kernels then take the blocks from x
// and the heads from y (cuda/common/tile_order.cuh). Query blocks in the deterministic mode
// (its dQ kernel; 65536 64-row blocks and a partial one) and key blocks in the default mode
// (the dK/dV kernel; 65536 128-key blocks and a partial one), GQA 2/1. Head dim 8 keeps the
// reference, which runs over every row, to seconds.
TEST(CudaBackward, MoreBlocksThanTheGridsYExtent) {
  for (const bool long_keys : {false, true}) {
    Case c;
    c.seqlen_q = long_keys ? 5 : 65536LL * 64 + 77;
    c.seqlen_k = long_keys ? 65536LL * 128 + 77 : 24;
    c.heads = 2;
    c.heads_k = 1;
    c.head_dim = 8;
    c.dtype = DType::BFloat16;
    SCOPED_TRACE(c.describe());
    Options o;
    o.deterministic = !long_keys;
    GpuProblem p(c, o);
    DeviceTensors d(p);
    EXPECT_EQ(d.backward(p.o).deterministic, o.deterministic);
    expect_gradients_match_reference(p, o.deterministic ? "deterministic" : "default");
  }
}

// With v_j = e_j and dout_i = e_i (see test_dropout.cpp's OneHot), dv_j[i] = (P o M)_ij: the
// zeros of dv are exactly the dropped (or masked) elements. The CUDA backward's zeros must be
// the CPU backward's, element for element, in both modes, over several (b, h) counters and a
// window that starts blocks off the 4-key Philox groups, and with positions whose key is on
// them (the Hopper TMA kernel) and off them (the sm80 kernels).
TEST(CudaBackward, DropoutKeepBitsEqualTheCpuBitForBit) {
  constexpr int64_t B = 2, Sq = 60, Sk = 150, H = 3, D = 64;
  for (DType dt : {DType::BFloat16, DType::Float16})
    for (bool deterministic : {false, true})
      for (int key : {0, 8, 7}) {  // positions (13, key): none, on the 4-key groups, off them
        SCOPED_TRACE(std::string(dtype_name(dt)) + (deterministic ? " deterministic" : " default") +
                     (key ? " positions (13, " + std::to_string(key) + ")" : std::string()) +
                     " seed=" + std::to_string(test_seed()));
        Buffer q(dt, B * Sq * H * D), k(dt, B * Sk * H * D), v(dt, B * Sk * H * D),
            out(dt, B * Sq * H * D), lse(DType::Float32, B * H * Sq), dout(dt, B * Sq * H * D),
            dq(dt, B * Sq * H * D), dk(dt, B * Sk * H * D), dv(dt, B * Sk * H * D),
            dv_cpu(dt, B * Sk * H * D), dq_cpu(dt, B * Sq * H * D), dk_cpu(dt, B * Sk * H * D);
        q.fill_random(0.5f);
        k.fill_random(0.5f);
        for (int64_t n = 0; n < v.count(); ++n) v.set(n, 0.0f);
        for (int64_t n = 0; n < dout.count(); ++n) dout.set(n, 0.0f);
        for (int64_t b = 0; b < B; ++b)
          for (int64_t h = 0; h < H; ++h) {
            for (int64_t j = 0; j < Sk; ++j) v.set(((b * Sk + j) * H + h) * D + j % D, 1.0f);
            for (int64_t i = 0; i < Sq; ++i) dout.set(((b * Sq + i) * H + h) * D + i, 1.0f);
          }
        Options o;
        o.dropout_p = 0.4f;
        o.dropout_seed = rng()();
        o.dropout_offset = rng()() >> 16;
        o.window_left = 37;
        o.window_right = 9;
        o.deterministic = deterministic;
        if (key) o.positions = Options::Positions{13, key};
        const TensorView qv = q.view({B, Sq, H, D}), kv = k.view({B, Sk, H, D}),
                         vv = v.view({B, Sk, H, D}), ov = out.view({B, Sq, H, D}),
                         lv = lse.view({B, H, Sq}), dov = dout.view({B, Sq, H, D});
        forward(qv, kv, vv, ov, lv, o, on(Backend::CPU));
        backward(qv, kv, vv, ov, dov, lv, dq_cpu.view({B, Sq, H, D}), dk_cpu.view({B, Sk, H, D}),
                 dv_cpu.view({B, Sk, H, D}), o, on(Backend::CPU));
        const RunInfo info =
            backward_on_backend(qv, kv, vv, ov, dov, lv, dq.view({B, Sq, H, D}),
                                dk.view({B, Sk, H, D}), dv.view({B, Sk, H, D}), o);
        ASSERT_EQ(info.backend, Backend::CUDA);
        const std::vector<double> gpu = reference::gather(dv.view({B, Sk, H, D}));
        const std::vector<double> cpu = reference::gather(dv_cpu.view({B, Sk, H, D}));
        int64_t kept = 0, dropped = 0;
        for (int64_t b = 0; b < B; ++b)
          for (int64_t h = 0; h < H; ++h) {
            const std::vector<uint8_t> mask = reference::dropout_mask(o, b, h, Sq, Sk);
            for (int64_t j = 0; j < Sk; ++j)
              for (int64_t i = 0; i < Sq; ++i) {
                const size_t at = size_t(((b * Sk + j) * H + h) * D + i);
                ASSERT_EQ(gpu[at] == 0.0, cpu[at] == 0.0)
                    << "b=" << b << " h=" << h << " i=" << i << " j=" << j;
                ASSERT_FALSE(std::isnan(gpu[at]));
                if (gpu[at] != 0.0) {
                  ASSERT_EQ(mask[size_t(i * Sk + j)], 1) << "kept where the reference drops";
                  ++kept;
                } else if (mask[size_t(i * Sk + j)] == 0) {
                  ++dropped;
                }
              }
          }
        EXPECT_GT(kept, 1000);
        EXPECT_GT(dropped, 1000);
      }
}


// Positions (Options::positions; docs/SPEC.md): a block of a longer self-attention gets the
// whole sequence's dropout bits and ALiBi distances on every CUDA kernel that takes those
// options: the Hopper kernels (TMA forward and backward, where the machine has them) and the
// sm80 ones (FLASHATTN_CUDA_FORWARD/BACKWARD=sm80), forward and backward against the float64
// reference, with a key position on the groups of 4 keys a Philox call covers and off them.
TEST(CudaPositions, DropoutAndAlibiMatchTheReferenceOnEveryKernel) {
  struct Family {
    const char* name;
    const char* forced;  // FLASHATTN_CUDA_FORWARD and _BACKWARD, or null: as dispatched
  } families[] = {{"dispatched", nullptr}, {"sm80", "sm80"}};
  struct Features {
    const char* name;
    bool alibi, dropout;
  } features[] = {{"alibi", true, false}, {"dropout", false, true}, {"alibi+dropout", true, true}};
  struct At {
    int64_t query, key;
  } positions[] = {{37, 21}, {256, 64}, {0, 1003}};
  for (const Family& family : families)
    for (int64_t head_dim : {64, 128, 40, 256})
      for (DType dt : {DType::BFloat16, DType::Float16})
        for (const Features& f : features)
          for (const At& at : positions) {
            std::optional<ScopedEnv> fwd, bwd;
            if (family.forced) {
              fwd.emplace("FLASHATTN_CUDA_FORWARD", family.forced);
              bwd.emplace("FLASHATTN_CUDA_BACKWARD", family.forced);
            }
            Case c;
            c.batch = 2;
            c.seqlen_q = 97;
            c.seqlen_k = 150;
            c.heads = 4;
            c.heads_k = 2;
            c.head_dim = head_dim;
            c.dtype = dt;
            c.alibi = f.alibi ? Case::Alibi::PerBatchHead : Case::Alibi::Off;
            c.dropout_p = f.dropout ? 0.2f : 0.0f;
            // The call's own mask stays bottom-right aligned on its rows and keys.
            c.window_left = at.key == 64 ? 70 : -1;
            c.window_right = at.key == 64 ? 3 : -1;
            const std::string what = std::string(family.name) + " " + f.name + " positions (" +
                                     std::to_string(at.query) + ", " + std::to_string(at.key) +
                                     ") " + c.describe();
            SCOPED_TRACE(what);
            Buffer slopes;
            Options o = options_of(c, slopes);
            o.positions = Options::Positions{at.query, at.key};

            Inputs in = make_inputs(c);
            Buffer out(dt, c.batch * c.seqlen_q * c.heads * head_dim),
                lse(DType::Float32, c.batch * c.heads * c.seqlen_q);
            const TensorView out_view = out.view({c.batch, c.seqlen_q, c.heads, head_dim});
            const TensorView lse_view = lse.view({c.batch, c.heads, c.seqlen_q});
            const RunInfo info = forward_on_backend(in.q, in.k, in.v, out_view, lse_view, o);
            ASSERT_EQ(info.backend, Backend::CUDA);
            expect_matches_reference(in.q, in.k, in.v, o, nullptr, out_view, &lse_view, what);

            GpuProblem p(c, o);  // the CPU engine's forward (out, lse) feeds the backward
            backward_on_backend(p.in.q, p.in.k, p.in.v, p.out_view(), p.dout_view(), p.lse_view(),
                                p.dq_view(), p.dk_view(), p.dv_view(), p.o);
            expect_gradients_match_reference(p, what);
            if (::testing::Test::HasFailure()) return;  // one failing combination is enough to read
          }
}

// The default mode's stats: D indexed like lse (rows floats), or, where the Hopper TMA kernel
// takes the call (dense calls at buckets 64 and 128 on an sm_90a build), D and
// lse log2(e) per (batch, head) in rows rounded up to 64 (cuda/backward.cu).
size_t default_stats_bytes(size_t rows, size_t batch_heads, size_t seqlen_q, bool tma) {
  return tma ? 2 * batch_heads * ((seqlen_q + 63) / 64 * 64) * 4 : rows * 4;
}
// The deterministic mode's: D alone on the other kernels (their dQ kernel writes dq); on the
// TMA kernel its default-mode workspace (the accumulator, of `bucket` floats a row) and a turn
// counter per 64-row step and (batch, head).
size_t deterministic_bytes(size_t rows, size_t batch_heads, size_t seqlen_q, size_t bucket, bool tma) {
  return tma ? rows * 4 * bucket + default_stats_bytes(rows, batch_heads, seqlen_q, true) +
                   batch_heads * ((seqlen_q + 63) / 64) * 4
             : rows * 4;
}

TEST(CudaBackward, RunsOnTheGivenStreamAndReportsItsWorkspace) {
  Case c;
  c.batch = 2;
  c.seqlen_q = 100;
  c.seqlen_k = 90;
  c.heads = 4;
  c.heads_k = 1;
  c.head_dim = 40;  // bucket 64
  c.dtype = DType::Float16;
  Options o;
  o.window_left = 20;
  o.window_right = 20;
  o.alibi_slopes = std::nullopt;
  GpuProblem p(c, o);
  DeviceTensors d(p);
  cudaStream_t stream;
  cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  Execution e = on(Backend::CUDA);
  e.stream = stream;
  const size_t rows = 2 * 4 * 100;
  for (const char* loads : {"cp.async", "tma"}) {
    ScopedEnv forced("FLASHATTN_SM90_BACKWARD_LOADS", loads);
    for (bool deterministic : {false, true}) {
      p.o.deterministic = deterministic;
      const RunInfo info = d.backward(p.o, e);
      if (deterministic) {
        // cp.async forced: the sm80 kernels' mode; else the TMA kernel's on an H100/H200.
        if (loads[0] == 'c')
          EXPECT_EQ(info.workspace_bytes, deterministic_bytes(rows, 8, 100, 64, false));
        else
          EXPECT_TRUE(info.workspace_bytes == deterministic_bytes(rows, 8, 100, 64, false) ||
                      info.workspace_bytes == deterministic_bytes(rows, 8, 100, 64, true))
              << info.workspace_bytes;
      } else {
        const size_t accum = rows * 4 * 64, cp_async = accum + default_stats_bytes(rows, 8, 100, false),
                     tma = accum + default_stats_bytes(rows, 8, 100, true);
        // cp.async forced: never the TMA kernel's; else that one on an H100/H200.
        if (loads[0] == 'c')
          EXPECT_EQ(info.workspace_bytes, cp_async) << loads;
        else
          EXPECT_TRUE(info.workspace_bytes == cp_async || info.workspace_bytes == tma) << info.workspace_bytes;
      }
      EXPECT_EQ(info.deterministic, deterministic);
      expect_gradients_match_reference(p, std::string(loads) + (deterministic ? " deterministic" : " default"));
    }
  }
  cuda_check(cudaStreamSynchronize(stream), "sync");
  cuda_check(cudaStreamDestroy(stream), "destroy");
}

// A head dim that is not a multiple of 8 (37: rows of 40, bucket 64) adds the padded copies
// of q, k, v, out and dout (in) and dq, dk, dv (back) to the workspace, each on a 256-byte
// boundary (cuda/head_dim_padding.hpp).
TEST(CudaBackward, OddHeadDimReportsItsPaddedCopies) {
  Case c;
  c.batch = 2;
  c.seqlen_q = 100;
  c.seqlen_k = 90;
  c.heads = 4;
  c.heads_k = 1;
  c.head_dim = 37;
  c.dtype = DType::BFloat16;
  Options o;
  o.causal = true;
  GpuProblem p(c, o);
  DeviceTensors d(p);
  const auto copy = [](size_t rows) { return (rows * 40 * 2 + 255) / 256 * 256; };
  const size_t query_rows = 2 * 100 * 4, key_rows = 2 * 90 * 1;
  const size_t copies = 4 * copy(query_rows) + 4 * copy(key_rows);  // q out dout dq, k v dk dv
  for (bool deterministic : {false, true}) {
    p.o.deterministic = deterministic;
    const RunInfo info = d.backward(p.o);
    if (deterministic) {
      EXPECT_TRUE(info.workspace_bytes == copies + deterministic_bytes(query_rows, 8, 100, 64, false) ||
                  info.workspace_bytes == copies + deterministic_bytes(query_rows, 8, 100, 64, true))
          << info.workspace_bytes;
    } else {
      const size_t accum = copies + query_rows * 4 * 64;
      EXPECT_TRUE(info.workspace_bytes == accum + default_stats_bytes(query_rows, 8, 100, false) ||
                  info.workspace_bytes == accum + default_stats_bytes(query_rows, 8, 100, true))
          << info.workspace_bytes;
    }
    expect_gradients_match_reference(p, deterministic ? "deterministic" : "default");
  }
}

// --- Validation of the CUDA path: each rule names the argument and writes nothing ----------

struct ErrorProblem : GpuProblem {
  ErrorProblem() : GpuProblem(small(), Options{}) {}
  static Case small() {
    Case c;
    c.seqlen_q = 40;
    c.seqlen_k = 50;
    c.heads = 2;
    c.heads_k = 2;
    c.head_dim = 32;
    c.dtype = DType::BFloat16;
    return c;
  }
};

// Calls backward with one tensor replaced and expects an error naming `argument` whose
// expected (or given) text holds `text`; the device gradients must still be all NaN.
void expect_rejected(ErrorProblem& p, const std::string& replace, const TensorView& with,
                     const std::string& argument, const std::string& text) {
  DeviceTensors d(p);
  d.dq.poison();
  d.dk.poison();
  d.dv.poison();
  TensorView views[] = {d.q.view(),    d.k.view(),   d.v.view(),  d.out.view(), d.dout.view(),
                        d.lse.view(),  d.dq.view(),  d.dk.view(), d.dv.view()};
  const char* names[] = {"q", "k", "v", "out", "dout", "lse", "dq", "dk", "dv"};
  for (int n = 0; n < 9; ++n)
    if (replace == names[n]) views[n] = with;
  try {
    backward(views[0], views[1], views[2], views[3], views[4], views[5], views[6], views[7],
             views[8], p.o, on(Backend::CUDA));
    ADD_FAILURE() << "accepted a bad " << replace;
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
    EXPECT_TRUE(e.expected().find(text) != std::string::npos ||
                e.given().find(text) != std::string::npos)
        << e.what();
  }
  cuda_check(cudaDeviceSynchronize(), "sync");
  d.dq.download();
  d.dk.download();
  d.dv.download();
  for (const Buffer* g : {&p.dq, &p.dk, &p.dv})
    for (double x : reference::gather(TensorView::contiguous(
             const_cast<unsigned char*>(g->bytes.data()), g->dtype, {g->count()})))
      ASSERT_TRUE(std::isnan(x)) << "a gradient was written by a rejected call";
}

TEST(CudaBackwardErrors, MisalignedDoutIsRejectedBeforeAnyWrite) {
  ErrorProblem p;
  DeviceMirror dout(p.dout_view());
  TensorView shifted = dout.view();
  shifted.data = static_cast<char*>(shifted.data) + 2;  // one bf16 element in
  expect_rejected(p, "dout", shifted, "dout", "16-byte aligned");
}

TEST(CudaBackwardErrors, GradientRowStrideOffSixteenBytesIsRejected) {
  ErrorProblem p;
  // dk viewed with rows of 36 elements (72 bytes) in a larger buffer.
  Buffer wide(p.c.dtype, 50 * 2 * 36);
  DeviceMirror dk(wide.view({1, 50, 2, 32}, {50 * 2 * 36, 2 * 36, 36, 1}));
  expect_rejected(p, "dk", dk.view(), "dk", "16-byte aligned");
}

TEST(CudaBackwardErrors, HostGradientClaimedToBeOnTheGpuIsRejected) {
  ErrorProblem p;
  TensorView host_dq = p.dq_view();
  host_dq.device = {DeviceType::CUDA, 0};
  expect_rejected(p, "dq", host_dq, "dq", "host memory");
}

TEST(CudaBackwardErrors, GradientOnAnotherDeviceTypeIsRejected) {
  ErrorProblem p;
  expect_rejected(p, "dv", p.dv_view(), "dv", "the device of");
}

TEST(CudaBackwardErrors, Fp32IsRejectedClearly) {
  Case c = ErrorProblem::small();
  c.dtype = DType::Float32;
  GpuProblem p(c, Options{});
  DeviceTensors d(p);
  try {
    backward(d.q.view(), d.k.view(), d.v.view(), d.out.view(), d.dout.view(), d.lse.view(),
             d.dq.view(), d.dk.view(), d.dv.view(), {}, on(Backend::CUDA));
    ADD_FAILURE() << "fp32 was accepted by the CUDA backward";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Unsupported) << e.what();
    EXPECT_EQ(e.argument(), "q") << e.what();
  }
}


// A kernel-family override that names no family is an error naming the variable, before any
// kernel runs (a typo would otherwise silently measure or test the default kernels).
TEST(CudaBackwardErrors, UnknownKernelFamilyOverrideIsRejected) {
  GpuProblem p(ErrorProblem::small(), Options{});
  DeviceTensors d(p);
  {
    ScopedEnv forced("FLASHATTN_CUDA_FORWARD", "sm89");
    d.out.poison();
    try {
      flashattn::forward(d.q.view(), d.k.view(), d.v.view(), d.out.view(), d.lse.view(), {},
                         on(Backend::CUDA));
      ADD_FAILURE() << "FLASHATTN_CUDA_FORWARD=sm89 was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::InvalidArgument) << e.what();
      EXPECT_EQ(e.argument(), "FLASHATTN_CUDA_FORWARD") << e.what();
      EXPECT_EQ(e.given(), "sm89") << e.what();
    }
    cuda_check(cudaDeviceSynchronize(), "sync");
    d.out.download();
    for (size_t n = 0; n < p.out.bytes.size(); ++n) ASSERT_EQ(p.out.bytes[n], 0xff) << "out written at byte " << n;
  }
  {
    ScopedEnv forced("FLASHATTN_SM90_BACKWARD_LOADS", "bulk");
    d.dq.poison();
    try {
      flashattn::backward(d.q.view(), d.k.view(), d.v.view(), d.out.view(), d.dout.view(),
                          d.lse.view(), d.dq.view(), d.dk.view(), d.dv.view(), {},
                          on(Backend::CUDA));
      ADD_FAILURE() << "FLASHATTN_SM90_BACKWARD_LOADS=bulk was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::InvalidArgument) << e.what();
      EXPECT_EQ(e.argument(), "FLASHATTN_SM90_BACKWARD_LOADS") << e.what();
      EXPECT_EQ(e.given(), "bulk") << e.what();
    }
    cuda_check(cudaDeviceSynchronize(), "sync");
    d.dq.download();
    for (size_t n = 0; n < p.dq.bytes.size(); ++n) ASSERT_EQ(p.dq.bytes[n], 0xff) << "dq written at byte " << n;
  }
  {
    ScopedEnv forced("FLASHATTN_CUDA_BACKWARD", "sm90");  // the backward can force sm80 only
    d.dq.poison();
    try {
      flashattn::backward(d.q.view(), d.k.view(), d.v.view(), d.out.view(), d.dout.view(),
                          d.lse.view(), d.dq.view(), d.dk.view(), d.dv.view(), {},
                          on(Backend::CUDA));
      ADD_FAILURE() << "FLASHATTN_CUDA_BACKWARD=sm90 was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::InvalidArgument) << e.what();
      EXPECT_EQ(e.argument(), "FLASHATTN_CUDA_BACKWARD") << e.what();
    }
    cuda_check(cudaDeviceSynchronize(), "sync");
    d.dq.download();
    for (size_t n = 0; n < p.dq.bytes.size(); ++n) ASSERT_EQ(p.dq.bytes[n], 0xff) << "dq written at byte " << n;
  }
}

// Where no tile shape of a head dim fits the GPU's shared memory per block (here the limit
// is lowered to an sm_86/sm_89 GPU's 99 KiB: the backward's smallest hdim-256 tile needs
// 107 KiB), the call is a clear Unsupported error naming head_dim, raised before any kernel
// runs, so the gradients stay as they were.
TEST(CudaSharedMemory, NoFittingBackwardTileIsAClearError) {
  ScopedEnv limit("FLASHATTN_CUDA_SMEM_LIMIT", "101376");
  Case c = ErrorProblem::small();
  c.head_dim = 256;
  GpuProblem p(c, Options{});
  DeviceTensors d(p);
  d.dq.poison();
  try {
    flashattn::backward(d.q.view(), d.k.view(), d.v.view(), d.out.view(), d.dout.view(),
                        d.lse.view(), d.dq.view(), d.dk.view(), d.dv.view(), {},
                        on(Backend::CUDA));
    ADD_FAILURE() << "the backward ran with tiles larger than the allowed shared memory";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Unsupported) << e.what();
    EXPECT_EQ(e.argument(), "head_dim") << e.what();
    EXPECT_NE(std::string(e.what()).find("101376 bytes"), std::string::npos) << e.what();
  }
  cuda_check(cudaDeviceSynchronize(), "sync");
  d.dq.download();
  for (size_t n = 0; n < p.dq.bytes.size(); ++n)  // still the poison's all-ones bytes
    ASSERT_EQ(p.dq.bytes[n], 0xff) << "dq written at byte " << n;
}

// The same for the forward, with a limit below its smallest hdim-256 tile (99 KiB).
TEST(CudaSharedMemory, NoFittingForwardTileIsAClearError) {
  ScopedEnv limit("FLASHATTN_CUDA_SMEM_LIMIT", "65536");
  Case c = ErrorProblem::small();
  c.head_dim = 256;
  GpuProblem p(c, Options{});
  DeviceTensors d(p);
  d.out.poison();
  try {
    flashattn::forward(d.q.view(), d.k.view(), d.v.view(), d.out.view(), d.lse.view(), {},
                       on(Backend::CUDA));
    ADD_FAILURE() << "the forward ran with tiles larger than the allowed shared memory";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Unsupported) << e.what();
    EXPECT_EQ(e.argument(), "head_dim") << e.what();
  }
}

TEST(CudaBackwardErrors, AutoPicksCudaForGpuTensorsAndCpuForHostOnes) {
  ErrorProblem p;
  DeviceTensors d(p);
  EXPECT_EQ(d.backward(p.o, Execution{}).backend, Backend::CUDA);
  const RunInfo cpu = backward(p.in.q, p.in.k, p.in.v, p.out_view(), p.dout_view(), p.lse_view(),
                               p.dq_view(), p.dk_view(), p.dv_view(), p.o, Execution{});
  EXPECT_EQ(cpu.backend, Backend::CPU);
}

}  // namespace
}  // namespace flashattn::testing

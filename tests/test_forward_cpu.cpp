#include "support.hpp"

namespace flashattn::testing {
namespace {

TEST(ForwardCpuSmoke, Basic) {
  for (DType dt : {DType::Float32, DType::Float16, DType::BFloat16}) {
    Case c;
    c.batch = 2; c.seqlen_q = 97; c.seqlen_k = 113; c.heads = 4; c.heads_k = 2; c.head_dim = 40;
    c.dtype = dt;
    run_dense_case(c);
    c.causal = true; c.window_left = 16; c.softcap = 5; c.alibi = Case::Alibi::PerBatchHead;
    c.layout = Layout::HeadMajor;
    run_dense_case(c);
  }
}

}  // namespace
}  // namespace flashattn::testing

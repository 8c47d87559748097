// The feature grid shared by the forward and backward suites: every mask x softcap x ALiBi x
// dtype combination, each placed on a different geometry and memory layout, so the grid also
// walks through shapes.
#pragma once

#include <string>
#include <vector>

#include "support.hpp"

namespace flashattn::testing {

struct Mask {
  const char* name;
  bool causal;
  int32_t left, right;
};
inline constexpr Mask kMasks[] = {
    {"none", false, -1, -1},       {"causal", true, -1, -1},   {"sliding", true, 19, -1},
    {"band", false, 23, 7},        {"rightonly", false, -1, 3}, {"diagonal", false, 0, 0},
};

// fp32 becomes fp16 on CUDA (backend_dtype), so the grid keeps its shape on both backends.
inline const DType kDtypes[] = {backend_dtype(DType::Float32), DType::Float16, DType::BFloat16};

struct Geometry {
  int64_t batch, seqlen_q, seqlen_k, heads, heads_k, head_dim;
};

struct FeatureCase {
  int mask, softcap, alibi, dtype;
};

inline std::vector<FeatureCase> feature_grid() {
  std::vector<FeatureCase> grid;
  for (int m = 0; m < int(std::size(kMasks)); ++m)
    for (int s = 0; s < 2; ++s)
      for (int a = 0; a < 3; ++a)
        for (int d = 0; d < 3; ++d) grid.push_back({m, s, a, d});
  return grid;
}

// Grid point n on its geometry (cycling through `geometries`) and memory layout.
template <size_t N>
Case grid_case(int n, const Geometry (&geometries)[N]) {
  const FeatureCase f = feature_grid()[size_t(n)];
  const Geometry g = geometries[size_t(n) % N];
  Case c;
  c.batch = g.batch;
  c.seqlen_q = g.seqlen_q;
  c.seqlen_k = g.seqlen_k;
  c.heads = g.heads;
  c.heads_k = g.heads_k;
  c.head_dim = g.head_dim;
  c.dtype = kDtypes[f.dtype];
  c.causal = kMasks[f.mask].causal;
  c.window_left = kMasks[f.mask].left;
  c.window_right = kMasks[f.mask].right;
  c.softcap = f.softcap ? 2.5f : 0.0f;  // small enough that tanh bends the scores
  c.alibi = static_cast<Case::Alibi>(f.alibi);
  const bool packable = c.seqlen_q == c.seqlen_k && c.heads == c.heads_k;
  const Layout layouts[] = {Layout::Contiguous, Layout::HeadMajor, Layout::Padded,
                            packable ? Layout::Packed : Layout::Contiguous};
  c.layout = layouts[size_t(n / 3) % 4];
  return c;
}

// A readable test name for grid point n, e.g. "sliding_softcap_alibiBH_bf16".
inline std::string grid_name(int n) {
  const FeatureCase f = feature_grid()[size_t(n)];
  return std::string(kMasks[f.mask].name) + (f.softcap ? "_softcap" : "") +
         (f.alibi == 1 ? "_alibiH" : f.alibi == 2 ? "_alibiBH" : "") + "_" +
         dtype_name(kDtypes[f.dtype]) +
         (kDtypes[f.dtype] == DType::Float16 && f.dtype == 0 ? "_for_fp32" : "");
}

}  // namespace flashattn::testing

#include "cuda/fp8_values.hpp"

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/stream_allocation.hpp"

namespace flashattn::detail::cuda {
namespace {

// The copy pays for itself where each key is read by at least this many query rows
// (queries per key/value head x seqlen_q): at 2048 the copy (reading and writing v once) is
// about 5 % of the attention's time at head dim 128, and the kernel it enables 1.39x faster
// there (2k, no mask: docs/PERFORMANCE.md "FP8").
constexpr int64_t kMinQueriesPerKey = 2048;
constexpr int kTileKeys = 64, kTileDims = 64;  // one block's tile of v: 4 KiB
// A thread's load or store: 16 bytes (fp8 elements). The head dim must be whole chunks, and each
// column of the copy starts at a multiple of one (the kernel's TMA boxes need that).
constexpr int kChunk = 16;

int64_t copy_keys(const ForwardParams& p) { return (p.seqlen_k + kChunk - 1) / kChunk * kChunk; }

// Block (b h, dims tile, keys tile) of the copy: its 64 keys x 64 dims of v loaded as rows
// (16-byte loads: the validator has every v row and stride at 16 bytes, and the head dim here is
// whole chunks), then stored as columns (16 keys per store). Keys past seqlen_k, up to the
// copy's multiple of 16, are written as zeros (never read: the kernel's tensor map ends at
// seqlen_k).
__global__ void __launch_bounds__(256) copy_values_seqlen_major(const unsigned char* v, int64_t batch_stride,
                                                                  int64_t row_stride, int64_t head_stride,
                                                                  int heads_k, int64_t seqlen_k, int dims,
                                                                  unsigned char* copy, int64_t keys) {
  __shared__ unsigned char tile[kTileKeys][kTileDims + 4];  // (+4: the column reads spread over banks)
  const int b = static_cast<int>(blockIdx.x) / heads_k, h = static_cast<int>(blockIdx.x) % heads_k;
  const int d0 = static_cast<int>(blockIdx.y) * kTileDims;
  const int64_t key0 = int64_t{blockIdx.z} * kTileKeys;
  const int t = static_cast<int>(threadIdx.x);
  {
    const int row = t / 4, d = kChunk * (t % 4);  // a key of the tile, its chunk of dims from d
    uint4 x = make_uint4(0, 0, 0, 0);
    if (key0 + row < seqlen_k && d0 + d < dims)
      x = *reinterpret_cast<const uint4*>(v + b * batch_stride + (key0 + row) * row_stride + h * head_stride + d0 + d);
    const uint32_t words[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) *reinterpret_cast<uint32_t*>(&tile[row][d + 4 * i]) = words[i];
  }
  __syncthreads();
  const int column = t / 4, key = kChunk * (t % 4);  // a dim of the tile, its chunk of keys from key
  if (d0 + column < dims && key0 + key < keys) {
    uint32_t words[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      words[i] = uint32_t{tile[key + 4 * i][column]} | uint32_t{tile[key + 4 * i + 1][column]} << 8 |
                 uint32_t{tile[key + 4 * i + 2][column]} << 16 | uint32_t{tile[key + 4 * i + 3][column]} << 24;
    *reinterpret_cast<uint4*>(copy + ((int64_t{b} * heads_k + h) * dims + d0 + column) * keys + key0 + key) =
        make_uint4(words[0], words[1], words[2], words[3]);
  }
}

}  // namespace

bool copies_values_seqlen_major(const ForwardParams& p) {
  const int64_t blocks_of_keys = (copy_keys(p) + kTileKeys - 1) / kTileKeys;
  return p.dtype == DType::Float8E4M3 && !p.is_varlen() && !p.values_seqlen_major() && p.seqlen_k > 0 &&
         p.head_dim_v % kChunk == 0 && int64_t{p.heads / p.heads_k} * p.seqlen_q >= kMinQueriesPerKey &&
         blocks_of_keys <= 65535 && int64_t{p.batch} * p.heads_k <= INT32_MAX;  // the grid's extents
}

size_t seqlen_major_values_bytes(const ForwardParams& p) {
  return static_cast<size_t>(p.batch) * static_cast<size_t>(p.heads_k) * static_cast<size_t>(p.head_dim_v) *
         static_cast<size_t>(copy_keys(p));
}

ForwardParams with_seqlen_major_values(const ForwardParams& p, void* copy) {
  const int64_t keys = copy_keys(p);
  const dim3 grid(static_cast<unsigned>(p.batch * p.heads_k), static_cast<unsigned>((p.head_dim_v + kTileDims - 1) / kTileDims),
                  static_cast<unsigned>((keys + kTileKeys - 1) / kTileKeys));
  copy_values_seqlen_major<<<grid, 256, 0, static_cast<cudaStream_t>(p.stream)>>>(
      static_cast<const unsigned char*>(p.v), p.v_batch_stride, p.v_row_stride, p.v_head_stride, p.heads_k,
      p.seqlen_k, p.head_dim_v, static_cast<unsigned char*>(copy), keys);
  throw_if_failed(cudaGetLastError(), "a successful launch of the (d, seqlen)-major copy of v");
  ForwardParams t = p;
  t.v = copy;
  t.v_dim_stride = keys;
  t.v_row_stride = 1;
  t.v_head_stride = p.head_dim_v * keys;
  t.v_batch_stride = int64_t{p.heads_k} * p.head_dim_v * keys;
  return t;
}

}  // namespace flashattn::detail::cuda

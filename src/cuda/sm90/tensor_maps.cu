#include "cuda/sm90/tensor_maps.hpp"

#include <cuda_runtime.h>
#include <cudaTypedefs.h>

namespace flashattn::detail::cuda::sm90 {
namespace {

// The driver's encoder, looked up through the runtime once (the library links the static
// runtime, not libcuda); null where the driver lacks it.
PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 found = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult status{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000, cudaEnableDefault,
                                         &status) != cudaSuccess ||
        status != cudaDriverEntryPointSuccess) {
      cudaGetLastError();  // the failed lookup must not surface as a later call's error
      function = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(function);
  }();
  return found;
}

// All bits set: a NaN in fp16 and in bf16. Constant-initialised (a constexpr constructor), so
// the module's image holds it and no call has to write it.
struct NanRows {
  uint16_t bits[128 * 64];
  constexpr NanRows() : bits() {
    for (uint16_t& b : bits) b = 0xFFFF;
  }
};
__device__ const NanRows nan_rows;

}  // namespace

bool encode_nan_rows(CUtensorMap& map, DType dtype, int box_rows) {
  void* rows = nullptr;
  if (cudaGetSymbolAddress(&rows, nan_rows) != cudaSuccess) {
    cudaGetLastError();  // a failed lookup must not surface as a later call's error
    return false;
  }
  // 128 rows of 128 bytes: 64 16-bit NaNs, or 128 e4m3 ones (0xFF is NaN there too).
  const int64_t cols = 128 / element_bytes(dtype);
  return encode_tiled(map, TiledTensor{rows, dtype, cols, 128, 1, 1, cols, 128 * cols, 128 * cols}, box_rows);
}

bool encode_tiled(CUtensorMap& map, const TiledTensor& t, int box_rows) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = encoder();
  if (encode == nullptr || t.rows <= 0 || t.cols <= 0 || t.heads <= 0 || t.batch <= 0) return false;
  const int64_t bytes = element_bytes(t.dtype);
  // A stride of a dimension of extent 1 is never used; TMA still wants a valid one.
  const auto stride_bytes = [bytes](int64_t extent, int64_t stride, int64_t fallback) -> cuuint64_t {
    return static_cast<cuuint64_t>((extent > 1 ? stride : fallback) * bytes);
  };
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(t.cols), static_cast<cuuint64_t>(t.rows),
                              static_cast<cuuint64_t>(t.heads), static_cast<cuuint64_t>(t.batch)};
  const cuuint64_t strides[3] = {stride_bytes(t.rows, t.row_stride, t.cols),
                                 stride_bytes(t.heads, t.head_stride, t.rows * t.row_stride),
                                 stride_bytes(t.batch, t.batch_stride, t.heads * t.head_stride)};
  for (const cuuint64_t s : strides)
    if (s == 0 || s % 16 != 0 || s >= (cuuint64_t{1} << 40)) return false;
  if (reinterpret_cast<uintptr_t>(t.base) % 16 != 0) return false;
  const cuuint32_t box[4] = {static_cast<cuuint32_t>(128 / bytes), static_cast<cuuint32_t>(box_rows), 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUtensorMapDataType type = t.dtype == DType::BFloat16     ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                   : t.dtype == DType::Float8E4M3 ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                                                  : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const CUresult result =
      encode(&map, type,
             4, const_cast<void*>(t.base), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
             CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return result == CUDA_SUCCESS;
}

}  // namespace flashattn::detail::cuda::sm90

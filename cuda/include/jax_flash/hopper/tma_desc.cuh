// Host side shared by the Hopper kernels' launchers (prefill and backward): whether their sm_90a
// code runs here, and the TMA descriptors (CUtensorMap) over their packed
// [rows, heads, cols] tensors, encoded through the driver entry point.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cstdint>

#include "jax_flash/dtype.h"

namespace jax_flash::hopper {

// Whether the Hopper kernels can run on the current device: a build with sm_90a code (CMake
// defines JAX_FLASH_HAS_SM90A when "90a" is among the CUDA architectures) and a device of
// compute capability 9.0 (sm_90a code runs there only).
inline bool sm90a_code_runs_here() {
#if defined(JAX_FLASH_HAS_SM90A)
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess)
    return false;
  return major == 9 && minor == 0;
#else
  return false;
#endif
}

// The driver's cuTensorMapEncodeTiled (null when the driver has none).
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult res;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &res) != cudaSuccess ||
        res != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// A 3-d tensor map over a packed [rows, heads, cols] tensor of `elem_bytes`-byte elements
// (row stride `row_stride` elements, heads contiguous), boxes of box_cols columns x 1 head x
// box_rows rows, 128-byte swizzled (box_cols * elem_bytes must be 128 at most); elements past the
// tensor read as zeros (and are skipped by stores and reductions). False when the driver
// rejects it.
inline bool make_tensor_map_3d(CUtensorMap* map, const void* ptr, CUtensorMapDataType type,
                               int elem_bytes, int cols, int heads, int rows, int64_t row_stride,
                               int box_cols, int box_rows) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(cols) * elem_bytes,
                                 static_cast<cuuint64_t>(row_stride) * elem_bytes};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(box_cols), 1,
                             static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  return encode(map, type, 3, const_cast<void*>(ptr), dims, strides, box, elem_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// A 3-d tensor map over `planes` float32 planes of `rows` rows of `cols` values (rows
// `row_stride` values apart, planes rows * row_stride apart; row_stride a multiple of 4 and the
// base 16-byte aligned, as TMA's strides and base must be), boxes of box_cols values (a multiple
// of 4, at most 256) of one row in every plane, unswizzled; values past a row's `cols` read as
// zeros. A box's first column must be a multiple of 4 (16 bytes; TMA faults on others). False
// when the driver rejects it.
inline bool make_tensor_map_rows_f32(CUtensorMap* map, const float* ptr, int64_t cols, int rows,
                                     int planes, int64_t row_stride, int box_cols) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr || cols <= 0 || rows <= 0) return false;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows),
                              static_cast<cuuint64_t>(planes)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(row_stride) * 4,
                                 static_cast<cuuint64_t>(row_stride) * rows * 4};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(box_cols), 1,
                             static_cast<cuuint32_t>(planes)};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 3, const_cast<float*>(ptr), dims, strides,
                box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                CU_TENSOR_MAP_L2_PROMOTION_NONE,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The 16-bit q / k / v / o tensors' map: boxes of one 64-column panel (128 bytes) x box_rows.
inline bool make_tensor_map(CUtensorMap* map, const void* ptr, DType dtype, int cols, int heads,
                            int rows, int64_t row_stride, int box_rows) {
  const CUtensorMapDataType type = dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                             : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  return make_tensor_map_3d(map, ptr, type, 2, cols, heads, rows, row_stride, 64, box_rows);
}

}  // namespace jax_flash::hopper

// Element types of the kernels and their generic helpers, shared by every op (CPU and CUDA):
// the DType enum the FFI handlers fill in, element sizes, and the JAX_FLASH_HD qualifier of
// functions that run on host and device. Host-only compilers can include it (no CUDA headers);
// the device conversions for these types are in jax_flash/dtype.cuh.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define JAX_FLASH_HD __host__ __device__ __forceinline__
#else
#define JAX_FLASH_HD inline
#endif

namespace jax_flash {

// Element type of q/k/v/o (attention), x (rope), logits (sampling) and new keys/values (append).
enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Bytes of one element.
JAX_FLASH_HD constexpr int32_t dtype_size(DType t) { return t == DType::kFloat32 ? 4 : 2; }

}  // namespace jax_flash

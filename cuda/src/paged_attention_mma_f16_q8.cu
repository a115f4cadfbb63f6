// Explicit instantiations of the tensor-core paged decode attention launcher for q of type
// __half with int8 and float8 e4m3 caches (per-head or per-token scales), head dims 64, 128
// and 256.
#include "jax_flash/paged_attention_mma.cuh"

namespace jax_flash {
#define JAX_FLASH_PAGED_MMA_Q8(D, TC) \
  template cudaError_t paged::launch_paged_attention_mma<__half, D, TC>( \
      const PagedAttentionParams&, cudaStream_t);
JAX_FLASH_PAGED_MMA_Q8(64, int8_t)
JAX_FLASH_PAGED_MMA_Q8(128, int8_t)
JAX_FLASH_PAGED_MMA_Q8(256, int8_t)
JAX_FLASH_PAGED_MMA_Q8(64, __nv_fp8_e4m3)
JAX_FLASH_PAGED_MMA_Q8(128, __nv_fp8_e4m3)
JAX_FLASH_PAGED_MMA_Q8(256, __nv_fp8_e4m3)
#undef JAX_FLASH_PAGED_MMA_Q8
}  // namespace jax_flash

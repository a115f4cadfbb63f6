// Explicit instantiations of the paged decode attention launcher for q of type __half and
// cache elements int8_t and __nv_fp8_e4m3, head dims 64, 128 and 256.
#include "jax_flash/paged_attention.cuh"

namespace jax_flash {
#define JAX_FLASH_PAGED_INSTANTIATE(TQ, TC, D) \
  template cudaError_t paged::launch_paged_attention<TQ, TC, D>(const PagedAttentionParams&, \
                                                                cudaStream_t);
JAX_FLASH_PAGED_FOR_EACH_D(JAX_FLASH_PAGED_INSTANTIATE, __half, int8_t)
JAX_FLASH_PAGED_FOR_EACH_D(JAX_FLASH_PAGED_INSTANTIATE, __half, __nv_fp8_e4m3)
#undef JAX_FLASH_PAGED_INSTANTIATE
}  // namespace jax_flash

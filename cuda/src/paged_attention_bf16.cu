// Explicit instantiations of the paged decode attention launcher for q of type __nv_bfloat16 and
// cache elements __nv_bfloat16, head dims 64, 128 and 256.
#include "jax_flash/paged_attention.cuh"

namespace jax_flash {
#define JAX_FLASH_PAGED_INSTANTIATE(TQ, TC, D) \
  template cudaError_t paged::launch_paged_attention<TQ, TC, D>(const PagedAttentionParams&, \
                                                                cudaStream_t);
JAX_FLASH_PAGED_FOR_EACH_D(JAX_FLASH_PAGED_INSTANTIATE, __nv_bfloat16, __nv_bfloat16)
#undef JAX_FLASH_PAGED_INSTANTIATE
}  // namespace jax_flash

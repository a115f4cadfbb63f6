// Explicit instantiations of the paged decode attention launcher for q of type __half and
// cache elements __half, head dims 64, 128 and 256.
#include "jax_flash/paged_attention.cuh"

namespace jax_flash {
#define JAX_FLASH_PAGED_INSTANTIATE(TQ, TC, D) \
  template cudaError_t paged::launch_paged_attention<TQ, TC, D>(const PagedAttentionParams&, \
                                                                cudaStream_t);
JAX_FLASH_PAGED_FOR_EACH_D(JAX_FLASH_PAGED_INSTANTIATE, __half, __half)
#undef JAX_FLASH_PAGED_INSTANTIATE
}  // namespace jax_flash

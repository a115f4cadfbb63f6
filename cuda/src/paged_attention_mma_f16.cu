// Explicit instantiations of the tensor-core paged decode attention launcher for q and cache
// elements of type __half, head dims 64, 128 and 256.
#include "jax_flash/paged_attention_mma.cuh"

namespace jax_flash {
template cudaError_t paged::launch_paged_attention_mma<__half, 64>(const PagedAttentionParams&,
                                                              cudaStream_t);
template cudaError_t paged::launch_paged_attention_mma<__half, 128>(const PagedAttentionParams&,
                                                               cudaStream_t);
template cudaError_t paged::launch_paged_attention_mma<__half, 256>(const PagedAttentionParams&,
                                                               cudaStream_t);
}  // namespace jax_flash

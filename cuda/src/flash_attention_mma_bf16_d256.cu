// Tensor-core prefill attention, __nv_bfloat16, head dim 256.
#include "jax_flash/flash_attention_mma.cuh"

namespace jax_flash {
template cudaError_t run_flash_attention_mma<__nv_bfloat16, 256>(const FlashParams&, cudaStream_t);
}  // namespace jax_flash

// Explicit instantiation of the SIMT prefill-attention launcher for __nv_bfloat16, head dims <= 256.
#include "jax_flash/flash_attention_simt.cuh"

namespace jax_flash {
template cudaError_t run_flash_attention_simt<__nv_bfloat16, 256>(const FlashParams&, cudaStream_t);
}  // namespace jax_flash

// Explicit instantiation of the SIMT prefill-attention launcher for float, head dims <= 256.
#include "jax_flash/flash_attention_simt.cuh"

namespace jax_flash {
template cudaError_t run_flash_attention_simt<float, 256>(const FlashParams&, cudaStream_t);
}  // namespace jax_flash

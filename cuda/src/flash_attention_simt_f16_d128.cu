// Explicit instantiation of the SIMT prefill-attention launcher for __half, head dims <= 128.
#include "jax_flash/flash_attention_simt.cuh"

namespace jax_flash {
template cudaError_t run_flash_attention_simt<__half, 128>(const FlashParams&, cudaStream_t);
}  // namespace jax_flash

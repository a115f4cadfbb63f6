// CPU FlashAttention kernel (packed / varlen form). Semantics: see jax_flash/flash_params.h.
#pragma once

#include "jax_flash/flash_params.h"

namespace jax_flash {

// Computes o and lse for every (sequence, query head, query row) that p describes.
//
// Tiled over keys with an online softmax (float32 accumulation for every dtype), never
// materialising the score matrix. Work is split over (sequence, head, block of query rows) and
// run on the process-wide CPU thread pool (thread_pool.h: created on first use, size
// std::thread::hardware_concurrency() or JAX_FLASH_CPU_THREADS); the calling thread takes part
// in the work. On x86-64 an AVX2 or AVX-512 code path is picked at run time
// from what the CPU supports; JAX_FLASH_CPU_ISA=generic|avx2 caps that choice.
//
// Thread-safe and reentrant: several threads may call it at once. Never throws. Parameters
// that cannot describe a valid call (num_heads % num_heads_k != 0, non-positive head counts or
// head dims, negative totals) make it return without touching o or lse.
void flash_attention_cpu(const FlashParams& p);

}  // namespace jax_flash

// CPU paged decode attention over a paged KV cache. Semantics: see jax_flash/paged_params.h.
#pragma once

#include "jax_flash/paged_params.h"

namespace jax_flash {

// Computes o [B, Sq, Hq, Dv] and lse [B, Hq, Sq] (natural log) for every sequence of p.
//
// One work item is (sequence, kv head, range of keys): the Hq / Hkv query heads of the kv head's
// GQA group times the Sq query rows are processed together, so every K / V row is read (and
// dequantised) once for all of them. Keys are visited in tiles gathered through the block table,
// with an online softmax and float32 accumulation. When batch * Hkv is small the key range of a
// sequence is cut into several items whose results are merged by their LSE; the cut depends only
// on the shapes and kv_lens (not on the thread count), so results are reproducible. p.num_splits,
// p.o_partial and p.lse_partial are ignored.
//
// Work runs on the shared CPU thread pool (cpu/thread_pool.h; JAX_FLASH_CPU_THREADS). On x86-64
// an AVX2 or AVX-512 code path is picked at run time (JAX_FLASH_CPU_ISA=generic|avx2 caps it).
// Thread-safe, never throws. Parameters that cannot describe a valid call (head counts, head
// dims or page size < 1, num_heads % num_heads_k != 0, seqlen_q < 1, a quantized cache without
// scales) make it return without writing.
void paged_attention_cpu(const PagedAttentionParams& p);

}  // namespace jax_flash

// CPU FlashAttention backward kernel (packed / varlen form). Semantics:
// jax_flash/flash_bwd_params.h (and jax_flash/flash_params.h for the forward's masking).
#pragma once

#include "jax_flash/flash_bwd_params.h"

namespace jax_flash {

// Writes dq, dk and dv for every (sequence, head, row) that p describes, and zeros on every row
// no sequence owns.
//
// Recomputes the probabilities from the forward's lse in tiles (float32 accumulation for every
// dtype); extra memory is Delta ([Hq, Tq] float32) plus per-thread tiles, never [Sq, Sk].
// Deterministic by construction, whatever p.deterministic says: every output element is summed
// by one thread in a fixed order (dK/dV per (kv head, key block) looping over the group's query
// heads and row blocks; dQ per (query head, row block) looping over key blocks), with block sizes
// that depend on nothing but the build. Runs on the process-wide CPU thread pool (thread_pool.h)
// with the ISA choice of the forward kernel (isa.h).
//
// Returns nullptr on success, or a message saying why nothing sensible could be written
// (parameters that cannot describe a valid call, or memory that could not be allocated).
// Thread-safe and reentrant; never throws.
const char* flash_attention_bwd_cpu(const FlashBwdParams& p);

}  // namespace jax_flash

// CPU kernel of apply_rope. Semantics: jax_flash/rope_params.h.
#pragma once

#include <cstdint>

#include "jax_flash/rope_params.h"

namespace jax_flash {

// Writes p.out: x with the first rotary_dim features of every head rotated by the angles of the
// token's position, the rest copied. cos/sin are computed once per (token, pair) in float32
// (std::cos / std::sin) and shared by all heads. Blocks of tokens run in parallel on the shared
// CPU thread pool (cpu/thread_pool.h). Never throws; parameters that cannot describe a valid call
// make it return without writing.
void apply_rope_cpu(const RopeParams& p);

// apply_rope_cpu over the tokens [t0, t1) only, on the calling thread. The one place that
// rotates on the CPU: apply_rope_cpu runs it per block of tokens, and the fused RoPE + cache
// append (kv_cache.h: append_kv_rope_cpu) runs it per token on its own work items, so that both
// produce the same bits.
void apply_rope_cpu_range(const RopeParams& p, int64_t t0, int64_t t1);

}  // namespace jax_flash

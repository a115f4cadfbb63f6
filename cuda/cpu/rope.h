// CPU kernel of apply_rope. Semantics: jax_flash/rope_params.h.
#pragma once

#include "jax_flash/rope_params.h"

namespace jax_flash {

// Writes p.out: x with the first rotary_dim features of every head rotated by the angles of the
// token's position, the rest copied. cos/sin are computed once per (token, pair) in float32
// (std::cos / std::sin) and shared by all heads. Blocks of tokens run in parallel on the shared
// CPU thread pool (cpu/thread_pool.h). Never throws; parameters that cannot describe a valid call
// make it return without writing.
void apply_rope_cpu(const RopeParams& p);

}  // namespace jax_flash

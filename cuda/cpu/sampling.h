// CPU kernels of the sampling ops. Semantics, and every numeric decision they share with the
// CUDA kernel (so that both give the same tokens for the same seeds): jax_flash/sampling_params.h.
#pragma once

#include "jax_flash/sampling_params.h"

namespace jax_flash {

// Writes p.tokens[b] for every row b: a token drawn from the filtered, renormalised distribution
// of the row (argmax for temperature <= 0; -1 for a row with no finite logit).
//
// Per row: one pass for the order keys and the argmax; top-k by std::nth_element over the keys;
// top-p by a weighted quickselect over the tokens at or above top_p_mass_floor (a few, except for
// flat distributions); the Gumbel-max draw in one pass, vectorised in blocks of 64 tokens. Rows
// run in parallel on the shared CPU thread pool (cpu/thread_pool.h). Never throws; parameters
// that cannot describe a valid call make it return without writing.
void sample_cpu(const SamplingParams& p);

// Writes p.masked: logits / temperature where a token is kept, -inf elsewhere (the logit itself
// for the argmax of a greedy row). Same selection as sample_cpu.
void top_k_top_p_filter_cpu(const SamplingParams& p);

}  // namespace jax_flash

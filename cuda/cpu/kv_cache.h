// CPU kernels of the paged KV-cache writes: append_kv and copy_pages. Semantics and the
// bit-exact quantisation rules: see jax_flash/paged_params.h (shared with the CUDA kernels
// through jax_flash/numeric.h).
#pragma once

#include "jax_flash/kv_cache_rope_params.h"
#include "jax_flash/paged_params.h"

namespace jax_flash {

// Writes token t's K and V rows (every kv head) into cache slot slot_mapping[t], quantising for
// int8 / e4m3 caches (per-head scales are read, per-token scales written for the slots written).
// Slots outside [0, num_pages * page_size) are skipped. When several tokens map to one slot the
// last of them wins. Work is spread over the shared CPU thread pool (cpu/thread_pool.h).
// Never throws; parameters that cannot describe a valid call make it return without writing.
void append_kv_cpu(const AppendKVParams& p);

// The fused RoPE + cache write (jax_flash/kv_cache_rope_params.h): rotates the queries with
// apply_rope_cpu (when p.rope.heads > 0), then writes as append_kv_cpu, each written token's K
// row first rotated by apply_rope_cpu_range (cpu/rope.h) into a scratch row of its work item.
// Both run apply_rope's own code, so the results equal apply_rope then append_kv bit for bit.
// Packed rows (p.qkv_group > 0) are first copied apart into the three arrays. Never throws;
// parameters that are not rope_append_consistent make it return without writing.
void append_kv_rope_cpu(const AppendKVRopeParams& p);

// Copies page src[i] to page dst[i] (K, V and, when k_scale / v_scale are set, the per-token
// scales), skipping pairs with an id outside [0, num_pages) and pairs with src == dst.
void copy_pages_cpu(const CopyPagesParams& p);

}  // namespace jax_flash

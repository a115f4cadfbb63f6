// Parameters of the fused RoPE + cache write (append_kv with positions and rope), shared by the
// CPU and CUDA kernels.
//
// One call does what apply_rope followed by append_kv does, with the same bits:
//   k_rot = apply_rope(k_new, positions)    rounded to k_new's dtype, as apply_rope stores it
//   cache[slot_mapping[t]] = k_rot[t], v_new[t]   (quantised from k_rot for int8 / e4m3 caches)
//   q_out = apply_rope(q, positions)        for every token, skipped slots included
// The rotation is rope_params.h's (same style, rotary_dim, inv_freq, float32 cos/sin computed in
// the kernel) and the write is paged_params.h's append_kv (skipped slots, quantisation, per-head
// or per-token scales). The rotated keys are never written anywhere but the cache.
//
// No XLA headers here.
#pragma once

#include "jax_flash/paged_params.h"
#include "jax_flash/rope_params.h"

namespace jax_flash {

struct AppendKVRopeParams {
  // The cache write; kv.k_new holds the keys before the rotation.
  AppendKVParams kv;
  // The rotation: rope.positions [T] int32 (any values; only ever used as numbers), style,
  // rotary_dim, inv_freq, head_dim (= kv.head_dim), dtype (= kv.dtype), tokens (= T). It also
  // describes the queries: rope.x = q [T, Hq, D], rope.out = q_out [T, Hq, D], rope.heads = Hq
  // (a multiple of kv.num_heads_k; 0 when no queries are rotated, then x and out are unused).
  RopeParams rope;
};

// Whether p describes a call the kernels can run (the FFI handlers check it with messages; the
// kernels check again and do nothing otherwise).
inline bool rope_append_consistent(const AppendKVRopeParams& p) {
  const RopeParams& r = p.rope;
  return r.tokens == p.kv.num_tokens && r.head_dim == p.kv.head_dim && r.dtype == p.kv.dtype &&
         r.rotary_dim >= 2 && r.rotary_dim % 2 == 0 && r.rotary_dim <= r.head_dim &&
         r.rotary_dim <= kMaxRotaryDim && r.heads >= 0 && p.kv.num_heads_k > 0 &&
         r.heads % p.kv.num_heads_k == 0 &&
         (r.style == RopeStyle::kNeox || r.style == RopeStyle::kGptj) &&
         (p.kv.num_tokens == 0 || r.positions != nullptr) &&
         (r.heads == 0 || p.kv.num_tokens == 0 || (r.x != nullptr && r.out != nullptr));
}

}  // namespace jax_flash

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
  // Where the new rows come from. 0: the three arrays above (kv.k_new, kv.v_new, rope.x). G > 0:
  // one packed array rope.x [T, Hkv, G + 2, D] (a fused q/k/v projection's output grouped by kv
  // head: its G query heads, then its key row, then its value row; D == Dv, rope.heads = G *
  // Hkv); kv.k_new and kv.v_new are unused. The results are the same bits either way.
  int32_t qkv_group;
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
         (r.heads == 0 || p.kv.num_tokens == 0 || (r.x != nullptr && r.out != nullptr)) &&
         (p.qkv_group == 0 || (p.qkv_group > 0 && r.heads == p.qkv_group * p.kv.num_heads_k &&
                               p.kv.head_dim_v == r.head_dim));
}

// Where token t's new rows lie, for either layout (qkv_group), in elements: query head h at
// q_src + t * q_token + q_head(h); kv head h's key row at k_src + t * k_token + h * k_head, its
// value row at v_src + t * v_token + h * v_head.
struct NewRowLayout {
  const void* q_src;
  const void* k_src;
  const void* v_src;
  int64_t q_token, q_group_stride, k_token, k_head, v_token, v_head;
  int32_t group, head_dim;

  JAX_FLASH_HD int64_t q_head(int32_t h) const {
    return (h / group) * q_group_stride + int64_t(h % group) * head_dim;
  }
};

inline NewRowLayout new_row_layout(const AppendKVRopeParams& p) {
  const int64_t H = p.kv.num_heads_k, D = p.kv.head_dim, Dv = p.kv.head_dim_v;
  const int32_t G = p.rope.heads > 0 ? static_cast<int32_t>(p.rope.heads / H) : 1;
  NewRowLayout l;
  l.group = G;
  l.head_dim = static_cast<int32_t>(D);
  l.q_src = p.rope.x;
  if (p.qkv_group > 0) {
    const int64_t row = (G + 2) * D;  // one kv head's rows: G queries, its key, its value
    const int64_t elem = dtype_size(p.kv.dtype);
    l.k_src = static_cast<const char*>(p.rope.x) + G * D * elem;
    l.v_src = static_cast<const char*>(p.rope.x) + (G + 1) * D * elem;
    l.q_token = l.k_token = l.v_token = H * row;
    l.q_group_stride = l.k_head = l.v_head = row;
  } else {
    l.k_src = p.kv.k_new;
    l.v_src = p.kv.v_new;
    l.q_token = int64_t(p.rope.heads) * D;
    l.q_group_stride = G * D;
    l.k_token = H * D;
    l.k_head = D;
    l.v_token = H * Dv;
    l.v_head = Dv;
  }
  return l;
}

}  // namespace jax_flash

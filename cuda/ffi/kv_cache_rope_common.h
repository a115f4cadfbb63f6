// Decoding of the fused RoPE + cache write (append_kv with positions and rope; FFI targets
// jax_flash_append_kv_rope_{cpu,cuda}) into AppendKVRopeParams, shared by the CPU and CUDA
// handlers: the cache part is append_kv's decoding (paged_common.h), the rotation and the
// queries apply_rope's (rope_common.h), so that both check exactly what their own ops check.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "jax_flash/kv_cache_rope_params.h"
#include "paged_common.h"
#include "rope_common.h"

namespace jax_flash::paged_ffi {

// args  k_pages, v_pages, k_scale, v_scale, k_new [T,Hkv,D], v_new [T,Hkv,Dv], slot_mapping [T],
//       positions [T] int32, q [T,Hq,D] (k_new's dtype; Hq = 0: no queries)
// rets  k_pages, v_pages, k_scale, v_scale (aliased to args 0..3), q_out [T,Hq,D]
// attrs scale_mode, style (0 NeoX, 1 GPT-J), rotary_dim, inv_freq [rotary_dim / 2] float32
inline ffi::Error make_append_rope_params(
    ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, ffi::Buffer<ffi::F32> k_scale,
    ffi::Buffer<ffi::F32> v_scale, ffi::AnyBuffer k_new, ffi::AnyBuffer v_new,
    ffi::Buffer<ffi::S32> slot_mapping, ffi::Buffer<ffi::S32> positions, ffi::AnyBuffer q,
    const ffi::AnyBuffer& k_out, const ffi::AnyBuffer& v_out, const ffi::Buffer<ffi::F32>& ks_out,
    const ffi::Buffer<ffi::F32>& vs_out, const ffi::AnyBuffer& q_out, int32_t scale_mode,
    int32_t style, int32_t rotary_dim, ffi::Span<const float> inv_freq, AppendKVRopeParams* p) {
  constexpr const char* op = "append_kv";
  ffi::Error err = make_append_params(k_pages, v_pages, k_scale, v_scale, k_new, v_new,
                                      slot_mapping, k_out, v_out, ks_out, vs_out, scale_mode,
                                      &p->kv);
  if (err.failure()) return err;
  const int64_t T = p->kv.num_tokens, Hkv = p->kv.num_heads_k, D = p->kv.head_dim;
  const auto qd = q.dimensions();
  if (qd.size() != 3 || qd[0] != T || qd[2] != D)
    return invalid(op, "q has shape " + dims_str(qd) + ", expected [T, Hq, D] with T = " +
                           std::to_string(T) + ", D = " + std::to_string(D));
  if (q.element_type() != k_new.element_type())
    return invalid(op, std::string("q has dtype ") + dtype_name(q.element_type()) +
                           ", expected k_new's " + dtype_name(k_new.element_type()));
  if (qd[1] % Hkv != 0)
    return invalid(op, "q has " + std::to_string(qd[1]) + " heads, expected a multiple of Hkv = " +
                           std::to_string(Hkv) + " (0: no queries)");
  if ((err = expect_dims(op, "positions", positions.dimensions(), "[T]", {T})).failure())
    return err;
  return ffi_impl::make_rope_params(q, positions, q_out, style, rotary_dim, inv_freq, &p->rope,
                                    op);
}

template <typename Binding>
auto append_kv_rope_binding(Binding binding) {
  return cache_results_binding(cache_args_binding(std::move(binding))
                                   .template Arg<ffi::AnyBuffer>()          // k_new
                                   .template Arg<ffi::AnyBuffer>()          // v_new
                                   .template Arg<ffi::Buffer<ffi::S32>>()   // slot_mapping
                                   .template Arg<ffi::Buffer<ffi::S32>>()   // positions
                                   .template Arg<ffi::AnyBuffer>())         // q
      .template Ret<ffi::AnyBuffer>()  // q_out
      .template Attr<int32_t>("scale_mode")
      .template Attr<int32_t>("style")
      .template Attr<int32_t>("rotary_dim")
      .template Attr<ffi::Span<const float>>("inv_freq");
}

}  // namespace jax_flash::paged_ffi

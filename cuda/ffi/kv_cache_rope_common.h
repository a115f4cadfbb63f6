// Decoding of the fused RoPE + cache write (append_kv with positions and rope, and append_qkv;
// FFI targets jax_flash_append_kv_rope_{cpu,cuda}, jax_flash_append_qkv_rope_{cpu,cuda}) into
// AppendKVRopeParams, shared by the CPU and CUDA handlers: the cache part is append_kv's
// decoding (paged_common.h), the rotation and the queries apply_rope's (rope_common.h), so that
// both check exactly what their own ops check.
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
  p->qkv_group = 0;
  return ffi_impl::make_rope_params(q, positions, q_out, style, rotary_dim, inv_freq, &p->rope,
                                    op);
}

// append_qkv (the same call with the new rows packed in one array, as a fused q/k/v projection
// writes them):
// args  k_pages, v_pages, k_scale, v_scale, qkv [T,Hkv,G+2,D] (per kv head: G query rows, its
//       key row, its value row; D == Dv), slot_mapping [T], positions [T] int32
// rets  k_pages, v_pages, k_scale, v_scale (aliased to args 0..3), q_out [T,G*Hkv,D]
// attrs as append_kv_rope
inline ffi::Error make_append_qkv_rope_params(
    ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, ffi::Buffer<ffi::F32> k_scale,
    ffi::Buffer<ffi::F32> v_scale, ffi::AnyBuffer qkv, ffi::Buffer<ffi::S32> slot_mapping,
    ffi::Buffer<ffi::S32> positions, const ffi::AnyBuffer& k_out, const ffi::AnyBuffer& v_out,
    const ffi::Buffer<ffi::F32>& ks_out, const ffi::Buffer<ffi::F32>& vs_out,
    const ffi::AnyBuffer& q_out, int32_t scale_mode, int32_t style, int32_t rotary_dim,
    ffi::Span<const float> inv_freq, AppendKVRopeParams* p) {
  constexpr const char* op = "append_qkv";
  DType dt;
  if (!float_dtype(qkv.element_type(), &dt))
    return invalid(op, std::string("qkv has dtype ") + dtype_name(qkv.element_type()) +
                           ", expected float32, float16 or bfloat16");
  const ffi::DataType nt = qkv.element_type();
  CacheGeom g;
  ffi::Error err = check_cache(op, k_pages, v_pages, k_scale, v_scale, scale_mode, &nt, &g);
  if (err.failure()) return err;
  if (g.head_dim_v != g.head_dim)
    return invalid(op, "packed q/k/v rows need D == Dv, got the pages' D = " +
                           std::to_string(g.head_dim) + ", Dv = " + std::to_string(g.head_dim_v));
  const auto d = qkv.dimensions();
  if (d.size() != 4 || !fits_i32(d[0]) || d[2] < 3 || d[2] > INT32_MAX / 2)
    return invalid(op, "qkv has shape " + dims_str(d) + ", expected [T, Hkv, G + 2, D] = [T, " +
                           std::to_string(g.num_heads_k) + ", G + 2, " +
                           std::to_string(g.head_dim) + "] with G >= 1");
  const int64_t T = d[0], G = d[2] - 2, Hq = G * g.num_heads_k;
  if ((err = expect_dims(op, "qkv", d, "[T, Hkv, G + 2, D]",
                         {T, g.num_heads_k, G + 2, g.head_dim}))
          .failure())
    return err;
  if ((err = expect_dims(op, "slot_mapping", slot_mapping.dimensions(), "[T]", {T})).failure())
    return err;
  if (Hq > INT32_MAX) return invalid(op, "more than 2^31-1 query heads");
  if ((err = expect_dims(op, "q_out", q_out.dimensions(), "[T, G * Hkv, D]",
                         {T, Hq, g.head_dim}))
          .failure())
    return err;
  if (q_out.element_type() != qkv.element_type())
    return invalid(op, std::string("q_out has dtype ") + dtype_name(q_out.element_type()) +
                           ", expected qkv's " + dtype_name(qkv.element_type()));
  if ((err = check_cache_results(op, k_pages, v_pages, k_scale, v_scale, k_out, v_out, ks_out,
                                 vs_out))
          .failure())
    return err;
  fill_append_cache(g, dt, T, slot_mapping, k_out, v_out, ks_out, vs_out, scale_mode, &p->kv);
  RopeParams& r = p->rope;
  if ((err = ffi_impl::make_rope_rotation(positions, T, g.head_dim, style, rotary_dim, inv_freq,
                                          &r, op))
          .failure())
    return err;
  r.x = qkv.untyped_data();
  r.out = q_out.untyped_data();
  r.tokens = T;
  r.heads = static_cast<int32_t>(Hq);
  r.head_dim = static_cast<int32_t>(g.head_dim);
  r.dtype = dt;
  p->qkv_group = static_cast<int32_t>(G);
  return ffi::Error::Success();
}

template <typename Binding>
auto append_qkv_rope_binding(Binding binding) {
  return cache_results_binding(cache_args_binding(std::move(binding))
                                   .template Arg<ffi::AnyBuffer>()          // qkv
                                   .template Arg<ffi::Buffer<ffi::S32>>()   // slot_mapping
                                   .template Arg<ffi::Buffer<ffi::S32>>())  // positions
      .template Ret<ffi::AnyBuffer>()  // q_out
      .template Attr<int32_t>("scale_mode")
      .template Attr<int32_t>("style")
      .template Attr<int32_t>("rotary_dim")
      .template Attr<ffi::Span<const float>>("inv_freq");
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

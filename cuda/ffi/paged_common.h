// Decoding and validation of the paged KV-cache FFI calls (paged_attention, append_kv,
// copy_pages) into the structs of jax_flash/paged_params.h, shared by the CPU and CUDA handlers.
// Every check names the buffer, the shape (or dtype) seen and the one expected.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "ffi_error.h"
#include "jax_flash/paged_params.h"
#include "xla/ffi/api/ffi.h"

namespace jax_flash::paged_ffi {

namespace ffi = xla::ffi;

inline const char* dtype_name(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::F8E4M3FN: return "float8_e4m3fn";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::F64: return "float64";
    default: return "an unsupported dtype";
  }
}

inline bool same_dims(ffi::Span<const int64_t> d, std::initializer_list<int64_t> e) {
  if (d.size() != e.size()) return false;
  size_t i = 0;
  for (int64_t x : e)
    if (d[i++] != x) return false;
  return true;
}

// "<name> has shape <seen>, expected <what> = <expected>" unless the dims match.
inline ffi::Error expect_dims(const char* op, const char* name, ffi::Span<const int64_t> d,
                              const char* what, std::initializer_list<int64_t> e) {
  if (same_dims(d, e)) return ffi::Error::Success();
  return invalid(op, std::string(name) + " has shape " + dims_str(d) + ", expected " + what +
                         " = " + dims_str(e));
}

inline bool float_dtype(ffi::DataType t, DType* out) {
  switch (t) {
    case ffi::DataType::F32: *out = DType::kFloat32; return true;
    case ffi::DataType::F16: *out = DType::kFloat16; return true;
    case ffi::DataType::BF16: *out = DType::kBFloat16; return true;
    default: return false;
  }
}

inline bool cache_dtype(ffi::DataType t, CacheDType* out) {
  switch (t) {
    case ffi::DataType::F32: *out = CacheDType::kFloat32; return true;
    case ffi::DataType::F16: *out = CacheDType::kFloat16; return true;
    case ffi::DataType::BF16: *out = CacheDType::kBFloat16; return true;
    case ffi::DataType::S8: *out = CacheDType::kInt8; return true;
    case ffi::DataType::F8E4M3FN: *out = CacheDType::kFloat8E4M3; return true;
    default: return false;
  }
}

inline bool is_quantized(CacheDType t) {
  return t == CacheDType::kInt8 || t == CacheDType::kFloat8E4M3;
}

inline bool fits_i32(int64_t x) { return x >= 0 && x <= INT32_MAX; }

// Geometry of a paged cache, checked: k_pages [P, page, Hkv, D], v_pages [P, page, Hkv, Dv] of
// one dtype; scales by scale_mode ([0], [Hkv] or [P, page, Hkv] float32); scale_mode agreeing
// with the cache dtype. `float_dtype`, when given, is the dtype an unquantized cache must have.
struct CacheGeom {
  int64_t num_pages, page_size, num_heads_k, head_dim, head_dim_v;
  CacheDType cache_dtype;
  ScaleMode scale_mode;
};

inline ffi::Error check_cache(const char* op, const ffi::AnyBuffer& k_pages,
                              const ffi::AnyBuffer& v_pages, const ffi::Buffer<ffi::F32>& k_scale,
                              const ffi::Buffer<ffi::F32>& v_scale, int32_t scale_mode,
                              const ffi::DataType* float_dtype, CacheGeom* g) {
  const auto kd = k_pages.dimensions(), vd = v_pages.dimensions();
  if (kd.size() != 4)
    return invalid(op, "k_pages has shape " + dims_str(kd) +
                           ", expected [num_pages, page_size, Hkv, D]");
  if (vd.size() != 4 || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2])
    return invalid(op, "v_pages has shape " + dims_str(vd) + ", expected [num_pages, page_size, Hkv, Dv] = " +
                           dims_str({kd[0], kd[1], kd[2], vd.size() == 4 ? vd[3] : -1}) +
                           " (k_pages is " + dims_str(kd) + ")");
  if (kd[1] < 1) return invalid(op, "page_size (k_pages dim 1) must be >= 1, got " + dims_str(kd));
  if (kd[2] < 1 || kd[3] < 1 || vd[3] < 1)
    return invalid(op, "Hkv, D and Dv must be >= 1, got k_pages " + dims_str(kd) + ", v_pages " +
                           dims_str(vd));
  for (int i = 0; i < 4; ++i)
    if (!fits_i32(kd[i]) || !fits_i32(vd[i]))
      return invalid(op, "k_pages / v_pages dimensions must be < 2^31, got " + dims_str(kd));
  if (!fits_i32(kd[0] * kd[1]))
    return invalid(op, "num_pages * page_size must be < 2^31, got k_pages " + dims_str(kd));
  if (k_pages.element_type() != v_pages.element_type())
    return invalid(op, std::string("k_pages is ") + dtype_name(k_pages.element_type()) +
                           " but v_pages is " + dtype_name(v_pages.element_type()) +
                           "; expected one dtype");
  if (!cache_dtype(k_pages.element_type(), &g->cache_dtype))
    return invalid(op, std::string("k_pages has dtype ") + dtype_name(k_pages.element_type()) +
                           ", expected float32, float16, bfloat16, int8 or float8_e4m3fn");
  if (scale_mode < 0 || scale_mode > 2)
    return invalid(op, "scale_mode must be 0, 1 or 2, got " + std::to_string(scale_mode));
  g->scale_mode = static_cast<ScaleMode>(scale_mode);
  const bool quantized = is_quantized(g->cache_dtype);
  if (quantized && scale_mode == 0)
    return invalid(op, std::string("a ") + dtype_name(k_pages.element_type()) +
                           " cache needs scale_mode 1 (per head) or 2 (per token), got 0");
  if (!quantized && scale_mode != 0)
    return invalid(op, std::string("a ") + dtype_name(k_pages.element_type()) +
                           " cache takes scale_mode 0, got " + std::to_string(scale_mode));
  if (!quantized && float_dtype != nullptr && k_pages.element_type() != *float_dtype)
    return invalid(op, std::string("an unquantized cache must have dtype ") +
                           dtype_name(*float_dtype) + ", got k_pages " +
                           dtype_name(k_pages.element_type()));
  for (auto [name, s] : {std::pair<const char*, const ffi::Buffer<ffi::F32>*>{"k_scale", &k_scale},
                         {"v_scale", &v_scale}}) {
    const auto sd = s->dimensions();
    ffi::Error err = ffi::Error::Success();
    if (scale_mode == 0) {
      if (s->element_count() != 0)
        err = invalid(op, std::string(name) + " has shape " + dims_str(sd) +
                              ", expected [0] for scale_mode 0");
    } else if (scale_mode == 1) {
      err = expect_dims(op, name, sd, "[Hkv]", {kd[2]});
    } else {
      err = expect_dims(op, name, sd, "[num_pages, page_size, Hkv]", {kd[0], kd[1], kd[2]});
    }
    if (err.failure()) return err;
  }
  g->num_pages = kd[0];
  g->page_size = kd[1];
  g->num_heads_k = kd[2];
  g->head_dim = kd[3];
  g->head_dim_v = vd[3];
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// paged_attention
//   args  q [B,Sq,Hq,D], k_pages, v_pages, k_scale, v_scale, block_tables [B,max_pages] int32,
//         kv_lens [B] int32
//   rets  o [B,Sq,Hq,Dv] (q's dtype), lse [B,Hq,Sq] f32, o_partial, lse_partial f32
//   attrs softmax_scale, softcap (f32), window_left, window_right, num_splits, scale_mode,
//         kernel (PagedKernel), pdl, merge_pdl (0 / 1) (i32; the last three: PagedLaunch, read
//         by the CUDA launchers only)
// check_partials: require o_partial [num_splits,B,Sq,Hq,Dv] and lse_partial [num_splits,B,Hq,Sq]
// when num_splits > 1 (the CUDA kernel uses them; the CPU kernel does not).
inline ffi::Error make_paged_attention_params(
    ffi::AnyBuffer q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, ffi::Buffer<ffi::F32> k_scale,
    ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> kv_lens,
    ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::Buffer<ffi::F32>> lse,
    ffi::Result<ffi::Buffer<ffi::F32>> o_partial, ffi::Result<ffi::Buffer<ffi::F32>> lse_partial,
    float softmax_scale, float softcap, int32_t window_left, int32_t window_right,
    int32_t num_splits, int32_t scale_mode, int32_t kernel, int32_t pdl, int32_t merge_pdl,
    bool check_partials, PagedAttentionParams* p) {
  constexpr const char* op = "paged_attention";
  if (kernel < 0 || kernel > 2)
    return invalid(op, "kernel must be 0 (auto), 1 (CUDA cores) or 2 (tensor cores), got " +
                           std::to_string(kernel));
  const auto qd = q.dimensions();
  if (qd.size() != 4) return invalid(op, "q has shape " + dims_str(qd) + ", expected [B, Sq, Hq, D]");
  DType dt;
  if (!float_dtype(q.element_type(), &dt))
    return invalid(op, std::string("q has dtype ") + dtype_name(q.element_type()) +
                           ", expected float32, float16 or bfloat16");
  const ffi::DataType qt = q.element_type();
  CacheGeom g;
  ffi::Error err = check_cache(op, k_pages, v_pages, k_scale, v_scale, scale_mode, &qt, &g);
  if (err.failure()) return err;
  const int64_t B = qd[0], Sq = qd[1], Hq = qd[2], D = qd[3];
  for (int i = 0; i < 4; ++i)
    if (!fits_i32(qd[i])) return invalid(op, "q dimensions must be < 2^31, got " + dims_str(qd));
  if (D != g.head_dim)
    return invalid(op, "k_pages has shape " + dims_str(k_pages.dimensions()) +
                           ", expected head dim D = " + std::to_string(D) + " of q " + dims_str(qd));
  if (Hq < 1 || Hq % g.num_heads_k != 0)
    return invalid(op, "q has " + std::to_string(Hq) + " heads (shape " + dims_str(qd) +
                           "), expected a positive multiple of Hkv = " +
                           std::to_string(g.num_heads_k));
  const auto bd = block_tables.dimensions();
  if (bd.size() != 2 || bd[0] != B || !fits_i32(bd[1]))
    return invalid(op, "block_tables has shape " + dims_str(bd) + ", expected [B, max_pages] with B = " +
                           std::to_string(B));
  if ((err = expect_dims(op, "kv_lens", kv_lens.dimensions(), "[B]", {B})).failure()) return err;
  const int64_t Dv = g.head_dim_v;
  if ((err = expect_dims(op, "o", o->dimensions(), "[B, Sq, Hq, Dv]", {B, Sq, Hq, Dv})).failure())
    return err;
  if (o->element_type() != q.element_type())
    return invalid(op, std::string("o has dtype ") + dtype_name(o->element_type()) +
                           ", expected q's dtype " + dtype_name(q.element_type()));
  if ((err = expect_dims(op, "lse", lse->dimensions(), "[B, Hq, Sq]", {B, Hq, Sq})).failure())
    return err;
  if (check_partials) {
    if (num_splits < 1)
      return invalid(op, "num_splits must be >= 1, got " + std::to_string(num_splits));
    if (num_splits > 1) {
      if ((err = expect_dims(op, "o_partial", o_partial->dimensions(),
                             "[num_splits, B, Sq, Hq, Dv]", {num_splits, B, Sq, Hq, Dv}))
              .failure())
        return err;
      if ((err = expect_dims(op, "lse_partial", lse_partial->dimensions(),
                             "[num_splits, B, Hq, Sq]", {num_splits, B, Hq, Sq}))
              .failure())
        return err;
    }
  }

  p->q = q.untyped_data();
  p->k_pages = k_pages.untyped_data();
  p->v_pages = v_pages.untyped_data();
  p->k_scale = scale_mode == 0 ? nullptr : k_scale.typed_data();
  p->v_scale = scale_mode == 0 ? nullptr : v_scale.typed_data();
  p->block_tables = block_tables.typed_data();
  p->kv_lens = kv_lens.typed_data();
  p->o = o->untyped_data();
  p->lse = lse->typed_data();
  p->o_partial = o_partial->typed_data();
  p->lse_partial = lse_partial->typed_data();
  p->batch = static_cast<int32_t>(B);
  p->seqlen_q = static_cast<int32_t>(Sq);
  p->num_heads = static_cast<int32_t>(Hq);
  p->num_heads_k = static_cast<int32_t>(g.num_heads_k);
  p->head_dim = static_cast<int32_t>(D);
  p->head_dim_v = static_cast<int32_t>(Dv);
  p->num_pages = static_cast<int32_t>(g.num_pages);
  p->page_size = static_cast<int32_t>(g.page_size);
  p->max_pages = static_cast<int32_t>(bd[1]);
  p->num_splits = num_splits < 1 ? 1 : num_splits;
  p->softmax_scale = softmax_scale;
  p->softcap = softcap;
  p->window_left = window_left;
  p->window_right = window_right;
  p->dtype = dt;
  p->cache_dtype = g.cache_dtype;
  p->scale_mode = g.scale_mode;
  p->launch.kernel = static_cast<PagedKernel>(kernel);
  p->launch.pdl = pdl != 0;
  p->launch.merge_pdl = merge_pdl != 0;
  return ffi::Error::Success();
}

template <typename Binding>
auto paged_attention_binding(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // q
      .template Arg<ffi::AnyBuffer>()                      // k_pages
      .template Arg<ffi::AnyBuffer>()                      // v_pages
      .template Arg<ffi::Buffer<ffi::F32>>()               // k_scale
      .template Arg<ffi::Buffer<ffi::F32>>()               // v_scale
      .template Arg<ffi::Buffer<ffi::S32>>()               // block_tables
      .template Arg<ffi::Buffer<ffi::S32>>()               // kv_lens
      .template Ret<ffi::AnyBuffer>()                      // o
      .template Ret<ffi::Buffer<ffi::F32>>()               // lse
      .template Ret<ffi::Buffer<ffi::F32>>()               // o_partial
      .template Ret<ffi::Buffer<ffi::F32>>()               // lse_partial
      .template Attr<float>("softmax_scale")
      .template Attr<float>("softcap")
      .template Attr<int32_t>("window_left")
      .template Attr<int32_t>("window_right")
      .template Attr<int32_t>("num_splits")
      .template Attr<int32_t>("scale_mode")
      .template Attr<int32_t>("kernel")
      .template Attr<int32_t>("pdl")
      .template Attr<int32_t>("merge_pdl");
}

// ---------------------------------------------------------------------------------------------
// append_kv / copy_pages: args 0..3 (k_pages, v_pages, k_scale, v_scale) are aliased to the four
// results; the kernels read and write the result buffers only.

// The four result buffers must have the shapes and dtypes of the cache arguments.
inline ffi::Error check_cache_results(const char* op, const ffi::AnyBuffer& k_pages,
                                      const ffi::AnyBuffer& v_pages,
                                      const ffi::Buffer<ffi::F32>& k_scale,
                                      const ffi::Buffer<ffi::F32>& v_scale,
                                      const ffi::AnyBuffer& k_out, const ffi::AnyBuffer& v_out,
                                      const ffi::Buffer<ffi::F32>& ks_out,
                                      const ffi::Buffer<ffi::F32>& vs_out) {
  struct Pair {
    const char* name;
    ffi::Span<const int64_t> in, out;
    ffi::DataType tin, tout;
  };
  const Pair pairs[] = {
      {"k_pages", k_pages.dimensions(), k_out.dimensions(), k_pages.element_type(),
       k_out.element_type()},
      {"v_pages", v_pages.dimensions(), v_out.dimensions(), v_pages.element_type(),
       v_out.element_type()},
      {"k_scale", k_scale.dimensions(), ks_out.dimensions(), ffi::DataType::F32,
       ffi::DataType::F32},
      {"v_scale", v_scale.dimensions(), vs_out.dimensions(), ffi::DataType::F32,
       ffi::DataType::F32},
  };
  for (const Pair& pr : pairs) {
    bool same = pr.in.size() == pr.out.size() && pr.tin == pr.tout;
    for (size_t i = 0; same && i < pr.in.size(); ++i) same = pr.in[i] == pr.out[i];
    if (!same)
      return invalid(op, std::string("result ") + pr.name + " has shape " + dims_str(pr.out) +
                             " (" + dtype_name(pr.tout) + "), expected the argument's " +
                             dims_str(pr.in) + " (" + dtype_name(pr.tin) + ")");
  }
  return ffi::Error::Success();
}

// Everything of an append's params but the new rows' pointers, once the call is checked: the
// cache geometry (checked by check_cache), T new rows of dtype dt, their slots, and the result
// buffers the kernels write (aliased to the cache arguments).
inline void fill_append_cache(const CacheGeom& g, DType dt, int64_t T,
                              const ffi::Buffer<ffi::S32>& slot_mapping,
                              const ffi::AnyBuffer& k_out, const ffi::AnyBuffer& v_out,
                              const ffi::Buffer<ffi::F32>& ks_out,
                              const ffi::Buffer<ffi::F32>& vs_out, int32_t scale_mode,
                              AppendKVParams* p) {
  p->k_new = nullptr;
  p->v_new = nullptr;
  p->slot_mapping = slot_mapping.typed_data();
  p->k_pages = k_out.untyped_data();
  p->v_pages = v_out.untyped_data();
  p->k_scale = scale_mode == 0 ? nullptr : ks_out.typed_data();
  p->v_scale = scale_mode == 0 ? nullptr : vs_out.typed_data();
  p->num_tokens = static_cast<int32_t>(T);
  p->num_heads_k = static_cast<int32_t>(g.num_heads_k);
  p->head_dim = static_cast<int32_t>(g.head_dim);
  p->head_dim_v = static_cast<int32_t>(g.head_dim_v);
  p->num_pages = static_cast<int32_t>(g.num_pages);
  p->page_size = static_cast<int32_t>(g.page_size);
  p->dtype = dt;
  p->cache_dtype = g.cache_dtype;
  p->scale_mode = g.scale_mode;
}

// append_kv: args k_pages, v_pages, k_scale, v_scale, k_new [T,Hkv,D], v_new [T,Hkv,Dv],
// slot_mapping [T]; rets the four cache buffers; attr scale_mode. Pointers of p refer to the
// results.
inline ffi::Error make_append_params(ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                                     ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                                     ffi::AnyBuffer k_new, ffi::AnyBuffer v_new,
                                     ffi::Buffer<ffi::S32> slot_mapping, const ffi::AnyBuffer& k_out,
                                     const ffi::AnyBuffer& v_out,
                                     const ffi::Buffer<ffi::F32>& ks_out,
                                     const ffi::Buffer<ffi::F32>& vs_out, int32_t scale_mode,
                                     AppendKVParams* p) {
  constexpr const char* op = "append_kv";
  const auto nd = k_new.dimensions(), nvd = v_new.dimensions();
  DType dt;
  if (!float_dtype(k_new.element_type(), &dt))
    return invalid(op, std::string("k_new has dtype ") + dtype_name(k_new.element_type()) +
                           ", expected float32, float16 or bfloat16");
  if (v_new.element_type() != k_new.element_type())
    return invalid(op, std::string("v_new has dtype ") + dtype_name(v_new.element_type()) +
                           ", expected k_new's " + dtype_name(k_new.element_type()));
  const ffi::DataType nt = k_new.element_type();
  CacheGeom g;
  ffi::Error err = check_cache(op, k_pages, v_pages, k_scale, v_scale, scale_mode, &nt, &g);
  if (err.failure()) return err;
  if (nd.size() != 3 || !fits_i32(nd[0]))
    return invalid(op, "k_new has shape " + dims_str(nd) + ", expected [T, Hkv, D] = [T, " +
                           std::to_string(g.num_heads_k) + ", " + std::to_string(g.head_dim) + "]");
  const int64_t T = nd[0];
  if ((err = expect_dims(op, "k_new", nd, "[T, Hkv, D]", {T, g.num_heads_k, g.head_dim})).failure())
    return err;
  if ((err = expect_dims(op, "v_new", nvd, "[T, Hkv, Dv]", {T, g.num_heads_k, g.head_dim_v}))
          .failure())
    return err;
  if ((err = expect_dims(op, "slot_mapping", slot_mapping.dimensions(), "[T]", {T})).failure())
    return err;
  if ((err = check_cache_results(op, k_pages, v_pages, k_scale, v_scale, k_out, v_out, ks_out,
                                 vs_out))
          .failure())
    return err;
  fill_append_cache(g, dt, T, slot_mapping, k_out, v_out, ks_out, vs_out, scale_mode, p);
  p->k_new = k_new.untyped_data();
  p->v_new = v_new.untyped_data();
  return ffi::Error::Success();
}

// copy_pages: args k_pages, v_pages, k_scale, v_scale, src [N], dst [N]; rets the four cache
// buffers; attr scale_mode.
inline ffi::Error make_copy_params(ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                                   ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                                   ffi::Buffer<ffi::S32> src, ffi::Buffer<ffi::S32> dst,
                                   const ffi::AnyBuffer& k_out, const ffi::AnyBuffer& v_out,
                                   const ffi::Buffer<ffi::F32>& ks_out,
                                   const ffi::Buffer<ffi::F32>& vs_out, int32_t scale_mode,
                                   CopyPagesParams* p) {
  constexpr const char* op = "copy_pages";
  CacheGeom g;
  ffi::Error err = check_cache(op, k_pages, v_pages, k_scale, v_scale, scale_mode, nullptr, &g);
  if (err.failure()) return err;
  const auto sd = src.dimensions();
  if (sd.size() != 1 || !fits_i32(sd[0]))
    return invalid(op, "src has shape " + dims_str(sd) + ", expected [N]");
  if ((err = expect_dims(op, "dst", dst.dimensions(), "[N] like src", {sd[0]})).failure())
    return err;
  if ((err = check_cache_results(op, k_pages, v_pages, k_scale, v_scale, k_out, v_out, ks_out,
                                 vs_out))
          .failure())
    return err;
  const int64_t eb = cache_elem_bytes(g.cache_dtype);
  p->k_pages = k_out.untyped_data();
  p->v_pages = v_out.untyped_data();
  const bool per_token = scale_mode == 2;
  p->k_scale = per_token ? ks_out.typed_data() : nullptr;
  p->v_scale = per_token ? vs_out.typed_data() : nullptr;
  p->src = src.typed_data();
  p->dst = dst.typed_data();
  p->num_copies = static_cast<int32_t>(sd[0]);
  p->page_bytes_k = g.page_size * g.num_heads_k * g.head_dim * eb;
  p->page_bytes_v = g.page_size * g.num_heads_k * g.head_dim_v * eb;
  p->scale_per_page = per_token ? static_cast<int32_t>(g.page_size * g.num_heads_k) : 0;
  p->num_pages = static_cast<int32_t>(g.num_pages);
  return ffi::Error::Success();
}

// FFI signatures of append_kv and copy_pages (the CUDA handlers bind the stream context first),
// built from the cache buffers that every cache update takes and returns (aliased), in one order.
template <typename Binding>
auto cache_args_binding(Binding&& binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // k_pages
      .template Arg<ffi::AnyBuffer>()                      // v_pages
      .template Arg<ffi::Buffer<ffi::F32>>()               // k_scale
      .template Arg<ffi::Buffer<ffi::F32>>();              // v_scale
}

template <typename Binding>
auto cache_results_binding(Binding&& binding) {
  return std::move(binding).template Ret<ffi::AnyBuffer>()  // k_pages (aliased)
      .template Ret<ffi::AnyBuffer>()                      // v_pages
      .template Ret<ffi::Buffer<ffi::F32>>()               // k_scale
      .template Ret<ffi::Buffer<ffi::F32>>();              // v_scale
}

template <typename Binding>
auto append_kv_binding(Binding binding) {
  return cache_results_binding(cache_args_binding(std::move(binding))
                                   .template Arg<ffi::AnyBuffer>()           // k_new
                                   .template Arg<ffi::AnyBuffer>()           // v_new
                                   .template Arg<ffi::Buffer<ffi::S32>>())  // slot_mapping
      .template Attr<int32_t>("scale_mode");
}

template <typename Binding>
auto copy_pages_binding(Binding binding) {
  return cache_results_binding(cache_args_binding(std::move(binding))
                                   .template Arg<ffi::Buffer<ffi::S32>>()   // src
                                   .template Arg<ffi::Buffer<ffi::S32>>())  // dst
      .template Attr<int32_t>("scale_mode");
}

// Cache arguments whose result buffer is not the argument buffer itself (XLA always aliases
// them; this only guards against a caller that does not): (from, to, bytes) to copy first.
struct AliasCopy {
  const void* from;
  void* to;
  size_t bytes;
};
inline int unaliased(const ffi::AnyBuffer& k_pages, const ffi::AnyBuffer& v_pages,
                     const ffi::Buffer<ffi::F32>& k_scale, const ffi::Buffer<ffi::F32>& v_scale,
                     const ffi::AnyBuffer& k_out, const ffi::AnyBuffer& v_out,
                     const ffi::Buffer<ffi::F32>& ks_out, const ffi::Buffer<ffi::F32>& vs_out,
                     AliasCopy out[4]) {
  int n = 0;
  auto add = [&](const void* from, void* to, size_t bytes) {
    if (from != to && bytes > 0) out[n++] = {from, to, bytes};
  };
  add(k_pages.untyped_data(), k_out.untyped_data(), k_pages.size_bytes());
  add(v_pages.untyped_data(), v_out.untyped_data(), v_pages.size_bytes());
  add(k_scale.untyped_data(), ks_out.untyped_data(), k_scale.size_bytes());
  add(v_scale.untyped_data(), vs_out.untyped_data(), v_scale.size_bytes());
  return n;
}

}  // namespace jax_flash::paged_ffi

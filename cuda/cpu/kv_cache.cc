// CPU append_kv / copy_pages. See kv_cache.h and jax_flash/paged_params.h.
#include "kv_cache.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "jax_flash/numeric.h"
#include "rope.h"  // apply_rope_cpu, apply_rope_cpu_range
#include "thread_pool.h"

namespace jax_flash {
namespace {

namespace nm = numeric;

template <DType DT>
struct In;
template <>
struct In<DType::kFloat32> {
  using T = float;
  static float load(T x) { return x; }
};
template <>
struct In<DType::kFloat16> {
  using T = uint16_t;
  static float load(T x) { return nm::half_to_float(x); }
};
template <>
struct In<DType::kBFloat16> {
  using T = uint16_t;
  static float load(T x) { return nm::bf16_to_float(x); }
};

template <CacheDType CT>
struct Quant;
template <>
struct Quant<CacheDType::kInt8> {
  using T = int8_t;
  static constexpr float kMax = nm::kInt8Max;
  static T quantize(float x, float scale) { return nm::quantize_int8(x, scale); }
};
template <>
struct Quant<CacheDType::kFloat8E4M3> {
  using T = uint8_t;
  static constexpr float kMax = nm::kE4M3Max;
  static T quantize(float x, float scale) { return nm::quantize_e4m3(x, scale); }
};

// Quantises one head row of n values. per_token: computes and stores *scale_io; else reads it.
template <DType DT, CacheDType CT>
void quantize_row(const typename In<DT>::T* src, typename Quant<CT>::T* dst, int n,
                  float* scale_io, bool per_token) {
  using Q = Quant<CT>;
  float scale;
  if (per_token) {
    float amax = 0.0f;
    for (int d = 0; d < n; ++d) amax = nm::amax_step(amax, In<DT>::load(src[d]));
    scale = nm::per_token_scale(amax, Q::kMax);
    *scale_io = scale;
  } else {
    scale = *scale_io;
  }
  if (scale == 0.0f) {
    std::memset(dst, 0, static_cast<size_t>(n) * sizeof(*dst));
    return;
  }
  for (int d = 0; d < n; ++d) dst[d] = Q::quantize(In<DT>::load(src[d]), scale);
}

// Writes token t into slot s (validated), every kv head, K and V. k_row is token t's K row
// [Hkv, D] in the input dtype: k_new's own, or its rotated copy (append_kv_rope_cpu).
template <DType DT, CacheDType CT>
void write_token_quantized(const AppendKVParams& p, const void* k_row, int64_t t, int64_t s) {
  using TI = typename In<DT>::T;
  using TQ = typename Quant<CT>::T;
  const bool per_token = p.scale_mode == ScaleMode::kPerToken;
  const int64_t H = p.num_heads_k, D = p.head_dim, Dv = p.head_dim_v;
  const TI* k = static_cast<const TI*>(k_row);
  const TI* v = static_cast<const TI*>(p.v_new) + t * H * Dv;
  TQ* kc = static_cast<TQ*>(p.k_pages) + s * H * D;
  TQ* vc = static_cast<TQ*>(p.v_pages) + s * H * Dv;
  for (int64_t h = 0; h < H; ++h) {
    float* ks = per_token ? p.k_scale + s * H + h : p.k_scale + h;
    float* vs = per_token ? p.v_scale + s * H + h : p.v_scale + h;
    quantize_row<DT, CT>(k + h * D, kc + h * D, static_cast<int>(D), ks, per_token);
    quantize_row<DT, CT>(v + h * Dv, vc + h * Dv, static_cast<int>(Dv), vs, per_token);
  }
}

void write_token_plain(const AppendKVParams& p, const void* k_row, int64_t t, int64_t s) {
  const int64_t eb = cache_elem_bytes(p.cache_dtype);
  const int64_t kb = int64_t(p.num_heads_k) * p.head_dim * eb;
  const int64_t vb = int64_t(p.num_heads_k) * p.head_dim_v * eb;
  std::memcpy(static_cast<char*>(p.k_pages) + s * kb, k_row, static_cast<size_t>(kb));
  std::memcpy(static_cast<char*>(p.v_pages) + s * vb,
              static_cast<const char*>(p.v_new) + t * vb, static_cast<size_t>(vb));
}

using WriteFn = void (*)(const AppendKVParams&, const void*, int64_t, int64_t);

template <DType DT>
WriteFn pick_quantized(CacheDType ct) {
  return ct == CacheDType::kInt8 ? &write_token_quantized<DT, CacheDType::kInt8>
                                 : &write_token_quantized<DT, CacheDType::kFloat8E4M3>;
}

bool is_quantized(CacheDType ct) {
  return ct == CacheDType::kInt8 || ct == CacheDType::kFloat8E4M3;
}

bool same_type(DType d, CacheDType c) {
  return (d == DType::kFloat32 && c == CacheDType::kFloat32) ||
         (d == DType::kFloat16 && c == CacheDType::kFloat16) ||
         (d == DType::kBFloat16 && c == CacheDType::kBFloat16);
}

int64_t in_elem_bytes(DType d) { return d == DType::kFloat32 ? 4 : 2; }

// append_kv, with the keys rotated first when `rope` is given (then rope->heads is ignored:
// each token's K row [Hkv, D] is rotated into a scratch row by apply_rope_cpu_range, the code
// apply_rope runs, and written from there).
void append(const AppendKVParams& p, const RopeParams* rope) {
  if (p.num_tokens <= 0 || p.num_heads_k <= 0 || p.head_dim <= 0 || p.head_dim_v <= 0 ||
      p.num_pages <= 0 || p.page_size <= 0)
    return;
  const bool quantized = is_quantized(p.cache_dtype);
  if (quantized != (p.scale_mode != ScaleMode::kNone)) return;
  if (!quantized && !same_type(p.dtype, p.cache_dtype)) return;
  if (quantized && (p.k_scale == nullptr || p.v_scale == nullptr)) return;

  WriteFn write = &write_token_plain;
  if (quantized) {
    switch (p.dtype) {
      case DType::kFloat32: write = pick_quantized<DType::kFloat32>(p.cache_dtype); break;
      case DType::kFloat16: write = pick_quantized<DType::kFloat16>(p.cache_dtype); break;
      case DType::kBFloat16: write = pick_quantized<DType::kBFloat16>(p.cache_dtype); break;
    }
  }

  const int64_t num_slots = int64_t(p.num_pages) * p.page_size;
  const int64_t T = p.num_tokens;
  const int64_t k_row_bytes = int64_t(p.num_heads_k) * p.head_dim * in_elem_bytes(p.dtype);
  // Work item w writes the tokens whose slot is w modulo the item count, in token order: every
  // slot is written by one thread, in order, so the last token of a slot wins however the work
  // is spread.
  const int64_t elems = T * p.num_heads_k * (int64_t(p.head_dim) + p.head_dim_v);
  const int64_t per_item = quantized || rope != nullptr ? 16384 : 65536;
  const int64_t items = std::max<int64_t>(
      1, std::min<int64_t>({elems / per_item, 4 * int64_t(cpu::ThreadPool::get().num_threads()),
                            num_slots}));
  auto body = [&](int64_t w) {
    std::vector<unsigned char> rotated;  // this item's scratch K row (rope only)
    RopeParams rk{};
    if (rope != nullptr) {
      rotated.resize(static_cast<size_t>(k_row_bytes));
      rk = *rope;
      rk.heads = p.num_heads_k;
      rk.tokens = 1;
      rk.out = rotated.data();
    }
    for (int64_t t = 0; t < T; ++t) {
      const int64_t s = p.slot_mapping[t];
      if (s < 0 || s >= num_slots || s % items != w) continue;
      const void* k_row = static_cast<const char*>(p.k_new) + t * k_row_bytes;
      if (rope != nullptr) {
        rk.x = k_row;
        rk.positions = rope->positions + t;
        apply_rope_cpu_range(rk, 0, 1);
        k_row = rotated.data();
      }
      write(p, k_row, t, s);
    }
  };
  if (items == 1)
    body(0);
  else
    cpu::parallel_for(items, body);
}

}  // namespace

void append_kv_cpu(const AppendKVParams& p) { append(p, nullptr); }

void append_kv_rope_cpu(const AppendKVRopeParams& p) {
  if (!rope_append_consistent(p) || p.kv.num_tokens <= 0) return;
  if (p.qkv_group > 0) {
    // Packed rows: copied apart into the three arrays of the other layout (a copy of the
    // inputs; the call then runs the same code on the same values).
    const int64_t T = p.kv.num_tokens, H = p.kv.num_heads_k, D = p.kv.head_dim;
    const int64_t G = p.qkv_group, elem = dtype_size(p.kv.dtype);
    std::vector<char> q(static_cast<size_t>(T * H * G * D * elem));
    std::vector<char> k(static_cast<size_t>(T * H * D * elem)), v(k.size());
    const char* src = static_cast<const char*>(p.rope.x);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        const char* row = src + (t * H + h) * (G + 2) * D * elem;  // kv head h's G + 2 rows
        std::memcpy(q.data() + (t * H + h) * G * D * elem, row, static_cast<size_t>(G * D * elem));
        std::memcpy(k.data() + (t * H + h) * D * elem, row + G * D * elem,
                    static_cast<size_t>(D * elem));
        std::memcpy(v.data() + (t * H + h) * D * elem, row + (G + 1) * D * elem,
                    static_cast<size_t>(D * elem));
      }
    }
    AppendKVRopeParams u = p;
    u.qkv_group = 0;
    u.rope.x = q.data();
    u.kv.k_new = k.data();
    u.kv.v_new = v.data();
    append_kv_rope_cpu(u);
    return;
  }
  if (p.rope.heads > 0) apply_rope_cpu(p.rope);  // the queries: apply_rope itself
  append(p.kv, &p.rope);
}

void copy_pages_cpu(const CopyPagesParams& p) {
  if (p.num_copies <= 0 || p.num_pages <= 0 || p.page_bytes_k < 0 || p.page_bytes_v < 0 ||
      p.scale_per_page < 0)
    return;
  const bool scales = p.k_scale != nullptr && p.v_scale != nullptr && p.scale_per_page > 0;
  auto body = [&](int64_t i) {
    const int64_t s = p.src[i], d = p.dst[i];
    if (s < 0 || s >= p.num_pages || d < 0 || d >= p.num_pages || s == d) return;
    char* k = static_cast<char*>(p.k_pages);
    char* v = static_cast<char*>(p.v_pages);
    std::memcpy(k + d * p.page_bytes_k, k + s * p.page_bytes_k, static_cast<size_t>(p.page_bytes_k));
    std::memcpy(v + d * p.page_bytes_v, v + s * p.page_bytes_v, static_cast<size_t>(p.page_bytes_v));
    if (scales) {
      const int64_t n = p.scale_per_page;
      std::memcpy(p.k_scale + d * n, p.k_scale + s * n, static_cast<size_t>(n) * sizeof(float));
      std::memcpy(p.v_scale + d * n, p.v_scale + s * n, static_cast<size_t>(n) * sizeof(float));
    }
  };
  const int64_t bytes = int64_t(p.num_copies) * (p.page_bytes_k + p.page_bytes_v);
  if (bytes < (int64_t(1) << 20)) {
    for (int64_t i = 0; i < p.num_copies; ++i) body(i);
  } else {
    cpu::parallel_for(p.num_copies, body);
  }
}

}  // namespace jax_flash

// CPU paged decode attention. See paged_attention.h and jax_flash/paged_params.h.
//
// Work item: (sequence b, kv head hk, key range [kb, ke)). Its M = G * Sq query rows (G = Hq /
// Hkv query heads of the group times Sq query positions; row r = i * G + g) are kept as float32,
// pre-multiplied by the softmax scale (and the per-head K scale). Keys are visited in tiles of
// kTileN gathered through the block table: per tile a row pointer per key is built (pointing into
// the cache itself for float32 pages whose head dim is a multiple of the vector width, otherwise
// into a per-thread float32 copy made by dequantising / widening the tile once), then
//   S = Q K^T      dot-product form, vectorised over the head dim; the partial sums of W keys
//                  are reduced together by a shuffle tree, giving W scores per vector,
//   per-token K scale, softcap, mask; online softmax (float32 m, l, accumulator),
//   acc += P V     vectorised over Dv, a block of rows x vectors of acc held in registers.
// One K/V row read thus serves every query row of its GQA group. Items that split a sequence's
// key range write float32 partial results that a second pass merges by LSE.
// Plain C++ with GCC/Clang generic vector types (no intrinsics); on x86-64 with GCC, copies
// compiled for AVX2+FMA and AVX-512F are picked at run time.
#include "paged_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "cpu_math.h"  // JF_INLINE, JF_RESTRICT, exp_approx, tanh_approx, round_up
#include "jax_flash/numeric.h"
#include "thread_pool.h"

#if defined(__GNUC__)
#define JF_VECTOR 1  // GCC vector extensions
#else
#define JF_VECTOR 0
#endif

#include "isa.h"  // cuda/cpu: JF_TARGET_*, detect_isa

#if defined(__GNUC__) && !defined(__clang__)
// Vector-typed helpers are always inlined into functions of one ISA; their nominal ABI is moot.
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace jax_flash {
namespace {

namespace nm = numeric;

#ifndef JAX_FLASH_PAGED_TILE_N
#define JAX_FLASH_PAGED_TILE_N 32
#endif
constexpr int kTileN = JAX_FLASH_PAGED_TILE_N;  // keys per tile
static_assert(kTileN % 16 == 0, "kTileN must be a multiple of the widest vector");
constexpr int kMinSplitKeys = 256;  // a split item covers at least this many keys
constexpr int kTargetItems = 64;    // split sequences until there are about this many items
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

JF_INLINE int64_t ceil_div(int64_t x, int64_t m) { return (x + m - 1) / m; }

using cpu::exp_approx;
using cpu::round_up;
using cpu::tanh_approx;

// ---------------------------------------------------------------------------------------------
// Cache element -> float32 (before the scale).

template <CacheDType CT>
struct CacheElem;
template <>
struct CacheElem<CacheDType::kFloat32> {
  using T = float;
  static JF_INLINE float load(T x) { return x; }
};
template <>
struct CacheElem<CacheDType::kFloat16> {
  using T = uint16_t;
  static JF_INLINE float load(T x) { return nm::half_to_float(x); }
};
template <>
struct CacheElem<CacheDType::kBFloat16> {
  using T = uint16_t;
  static JF_INLINE float load(T x) { return nm::bf16_to_float(x); }
};
template <>
struct CacheElem<CacheDType::kInt8> {
  using T = int8_t;
  static JF_INLINE float load(T x) { return static_cast<float>(x); }
};
template <>
struct CacheElem<CacheDType::kFloat8E4M3> {
  using T = uint8_t;
  static JF_INLINE float load(T x) { return nm::e4m3_to_float(x); }
};

float load_q(DType dt, const void* base, int64_t i) {
  switch (dt) {
    case DType::kFloat32: return static_cast<const float*>(base)[i];
    case DType::kFloat16: return nm::half_to_float(static_cast<const uint16_t*>(base)[i]);
    default: return nm::bf16_to_float(static_cast<const uint16_t*>(base)[i]);
  }
}

void store_o(DType dt, void* base, int64_t i, float x) {
  switch (dt) {
    case DType::kFloat32: static_cast<float*>(base)[i] = x; break;
    case DType::kFloat16: static_cast<uint16_t*>(base)[i] = nm::float_to_half(x); break;
    default: static_cast<uint16_t*>(base)[i] = nm::float_to_bf16(x); break;
  }
}

// ---------------------------------------------------------------------------------------------
// Micro-kernels. W: floats per vector. MB: query rows per block (1, 2, 4 or 8).

#if JF_VECTOR
template <int W>
struct VecT {
  typedef float type __attribute__((vector_size(W * sizeof(float))));
};
template <int W>
using Vec = typename VecT<W>::type;

template <int W>
JF_INLINE Vec<W> loadv(const float* p) {
  Vec<W> v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <int W>
JF_INLINE void storev(float* p, const Vec<W>& v) {
  std::memcpy(p, &v, sizeof(v));
}

// Max / sum of s[0..nw), nw a positive multiple of W (float reductions do not auto-vectorise
// without reassociation flags).
template <int W>
JF_INLINE float row_max(const float* s, int nw) {
  Vec<W> m = loadv<W>(s);
  for (int j = W; j < nw; j += W) {
    const Vec<W> x = loadv<W>(s + j);
    m = x > m ? x : m;
  }
  float r = m[0];
  for (int w = 1; w < W; ++w) r = m[w] > r ? m[w] : r;
  return r;
}
template <int W>
JF_INLINE float row_sum(const float* s, int nw) {
  Vec<W> a = loadv<W>(s);
  for (int j = W; j < nw; j += W) a += loadv<W>(s + j);
  float r = a[0];
  for (int w = 1; w < W; ++w) r += a[w];
  return r;
}

// One level of the reduction tree. x and y each hold W / S keys in segments of S lanes; the
// result holds the 2W / S keys (x's, then y's) in segments of S / 2 lanes, each the sum of the
// two halves of its segment. Lane r of the result reads lanes lo(r) and lo(r) + S/2 of the
// concatenation (x, y), lo(r) = (r / (S/2)) * S + r % (S/2).
template <int W, int S, size_t... R>
JF_INLINE Vec<W> combine(const Vec<W>& x, const Vec<W>& y, std::index_sequence<R...>) {
  return __builtin_shufflevector(x, y, static_cast<int>((R / (S / 2)) * S + R % (S / 2))...) +
         __builtin_shufflevector(x, y,
                                 static_cast<int>((R / (S / 2)) * S + R % (S / 2) + S / 2)...);
}
template <int W, int S>
JF_INLINE void reduce_level(Vec<W>* v) {
  for (int k = 0; k < S / 2; ++k)
    v[k] = combine<W, S>(v[2 * k], v[2 * k + 1], std::make_index_sequence<W>());
}
// v[j] holds W partial sums of key j (j < W); returns the vector whose lane j is key j's total.
// Overwrites v.
template <int W>
JF_INLINE Vec<W> tree_reduce(Vec<W>* v) {
  if constexpr (W >= 16) reduce_level<W, 16>(v);
  if constexpr (W >= 8) reduce_level<W, 8>(v);
  if constexpr (W >= 4) reduce_level<W, 4>(v);
  reduce_level<W, 2>(v);
  return v[0];
}

// S[i, 0:W] = Q[i, :] . K[j] for the W keys K[0..W) and MB rows of Q (row stride ldq), all of
// length nchunks * W. KB keys at a time: MB * KB independent accumulator chains.
template <int W, int MB, int KB>
JF_INLINE void qk_block(const float* JF_RESTRICT Q, int64_t ldq, const float* const* K,
                        int nchunks, float* JF_RESTRICT S, int64_t lds) {
  using V = Vec<W>;
  static_assert(W % KB == 0, "KB must divide W");
  V part[MB][W];
  for (int j0 = 0; j0 < W; j0 += KB) {
    V acc[KB][MB];
    const float* kp[KB];
    for (int kb = 0; kb < KB; ++kb) {
      kp[kb] = K[j0 + kb];
      for (int i = 0; i < MB; ++i) acc[kb][i] = V{};
    }
    for (int c = 0; c < nchunks; ++c) {
      V kv[KB];
      for (int kb = 0; kb < KB; ++kb) kv[kb] = loadv<W>(kp[kb] + c * W);
      for (int i = 0; i < MB; ++i) {
        const V q = loadv<W>(Q + i * ldq + c * W);
        for (int kb = 0; kb < KB; ++kb) acc[kb][i] += q * kv[kb];
      }
    }
    for (int kb = 0; kb < KB; ++kb)
      for (int i = 0; i < MB; ++i) part[i][j0 + kb] = acc[kb][i];
  }
  for (int i = 0; i < MB; ++i) storev<W>(S + i * lds, tree_reduce<W>(part[i]));
}

// Acc[i, c*W : (c+NV)*W] += sum_{j < n} P[i, j] V[j][c*W : (c+NV)*W] for MB rows, chunks
// [c0, c1) in blocks of NV vectors (then smaller blocks for the rest).
template <int W, int MB, int NV>
JF_INLINE void pv_range(const float* JF_RESTRICT P, int64_t ldp, const float* const* Vr, int n,
                        float* JF_RESTRICT Acc, int64_t lda, int c0, int c1) {
  using V = Vec<W>;
  int c = c0;
  for (; c + NV <= c1; c += NV) {
    V acc[MB][NV];
    for (int i = 0; i < MB; ++i)
      for (int v = 0; v < NV; ++v) acc[i][v] = loadv<W>(Acc + i * lda + (c + v) * W);
    for (int j = 0; j < n; ++j) {
      const float* vp = Vr[j] + c * W;
      V vv[NV];
      for (int v = 0; v < NV; ++v) vv[v] = loadv<W>(vp + v * W);
      for (int i = 0; i < MB; ++i) {
        const float pij = P[i * ldp + j];
        for (int v = 0; v < NV; ++v) acc[i][v] += pij * vv[v];
      }
    }
    for (int i = 0; i < MB; ++i)
      for (int v = 0; v < NV; ++v) storev<W>(Acc + i * lda + (c + v) * W, acc[i][v]);
  }
  if constexpr (NV > 1) {
    if (c < c1) pv_range<W, MB, NV / 2>(P, ldp, Vr, n, Acc, lda, c, c1);
  }
}

#else  // portable scalar fallback

template <int W>
inline float row_max(const float* s, int nw) {
  float r = s[0];
  for (int j = 1; j < nw; ++j) r = s[j] > r ? s[j] : r;
  return r;
}
template <int W>
inline float row_sum(const float* s, int nw) {
  float r = 0.0f;
  for (int j = 0; j < nw; ++j) r += s[j];
  return r;
}

template <int W, int MB, int KB>
inline void qk_block(const float* Q, int64_t ldq, const float* const* K, int nchunks, float* S,
                     int64_t lds) {
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < W; ++j) {
      float s = 0.0f;
      for (int d = 0; d < nchunks * W; ++d) s += Q[i * ldq + d] * K[j][d];
      S[i * lds + j] = s;
    }
}

template <int W, int MB, int NV>
inline void pv_range(const float* P, int64_t ldp, const float* const* Vr, int n, float* Acc,
                     int64_t lda, int c0, int c1) {
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < n; ++j) {
      const float pij = P[i * ldp + j];
      for (int d = c0 * W; d < c1 * W; ++d) Acc[i * lda + d] += pij * Vr[j][d];
    }
}

#endif

// ---------------------------------------------------------------------------------------------
// Plan of one call.

struct Item {
  int32_t b, hk, kb, ke;  // sequence, kv head, key range
  int64_t part;           // index of its partial result, or -1: writes o / lse directly
  int64_t cost;
};

struct TileCursor;
struct TileBuffers;

struct Plan {
  const PagedAttentionParams* p;
  int G, M;                  // query heads per kv head; rows per item (G * Sq)
  int Mp;                    // rows rounded up to the row block
  int Dp, Dvp;               // head dims rounded up to the vector width
  bool k_direct, v_direct;   // float32 pages read in place
  int cache_elem_bytes;
  // Tile gather for the cache dtype (see gather_impl).
  void (*gather)(const Plan&, const Item&, int, TileCursor*, const TileBuffers&);
  float* o_part;             // [parts, M, Dv]
  float* lse_part;           // [parts, M]
};

// Floats of per-thread scratch for one item.
int64_t scratch_floats(const Plan& pl) {
  return int64_t(pl.Mp) * pl.Dp        // Q
         + int64_t(kTileN) * pl.Dp     // K tile
         + int64_t(kTileN) * pl.Dvp    // V tile
         + int64_t(pl.Mp) * kTileN     // S / P
         + int64_t(pl.Mp) * pl.Dvp     // accumulator
         + pl.Dp                       // zero row (padding keys)
         + 6 * int64_t(pl.Mp)          // m, l, tile max, tile sum, reference max, alpha
         + 2 * kTileN;                 // per-token scales of the tile
}

// Visible key range of query position i of a sequence with k_len keys (paged_params.h),
// clamped to [0, k_len]; empty when lo >= hi.
JF_INLINE void visible(const PagedAttentionParams& p, int64_t i, int64_t k_len, int64_t* lo,
                       int64_t* hi) {
  const int64_t diag = i + k_len - p.seqlen_q;
  int64_t l = 0, h = k_len;
  if (p.window_left >= 0 && diag - p.window_left > l) l = diag - p.window_left;
  if (p.window_right >= 0 && diag + p.window_right + 1 < h) h = diag + p.window_right + 1;
  *lo = l;
  *hi = h < l ? l : h;
}

// Output row r (= i * G + g) of sequence b, kv head hk: element offsets of o and lse.
JF_INLINE int64_t o_offset(const PagedAttentionParams& p, const Plan& pl, int b, int hk, int r) {
  const int i = r / pl.G, g = r % pl.G;
  return ((int64_t(b) * p.seqlen_q + i) * p.num_heads + int64_t(hk) * pl.G + g) * p.head_dim_v;
}
JF_INLINE int64_t lse_offset(const PagedAttentionParams& p, const Plan& pl, int b, int hk,
                             int r) {
  const int i = r / pl.G, g = r % pl.G;
  return (int64_t(b) * p.num_heads + int64_t(hk) * pl.G + g) * p.seqlen_q + i;
}

// Writes the rows of an item (or its partial result) from per-row values.
void write_item_rows(const Plan& pl, const Item& it, const float* acc, int64_t lda,
                     const float* m, const float* l, float v_head_scale) {
  const PagedAttentionParams& p = *pl.p;
  const int Dv = p.head_dim_v;
  for (int r = 0; r < pl.M; ++r) {
    float scale, lse;
    if (!(m[r] == m[r]) || !(l[r] == l[r])) {
      scale = kNaN;
      lse = kNaN;
    } else if (m[r] == kNegInf) {
      scale = 0.0f;
      lse = kNegInf;
    } else {
      scale = v_head_scale / l[r];
      lse = m[r] + std::log(l[r]);
    }
    const float* a = acc + int64_t(r) * lda;
    if (it.part >= 0) {
      float* dst = pl.o_part + (it.part * pl.M + r) * Dv;
      for (int d = 0; d < Dv; ++d) dst[d] = scale == 0.0f ? 0.0f : a[d] * scale;
      pl.lse_part[it.part * pl.M + r] = lse;
    } else {
      const int64_t off = o_offset(p, pl, it.b, it.hk, r);
      for (int d = 0; d < Dv; ++d) store_o(p.dtype, p.o, off + d, scale == 0.0f ? 0.0f : a[d] * scale);
      p.lse[lse_offset(p, pl, it.b, it.hk, r)] = lse;
    }
  }
}

// Marks an item failed (no scratch): nan rows.
void fail_item(const Plan& pl, const Item& it) {
  const PagedAttentionParams& p = *pl.p;
  for (int r = 0; r < pl.M; ++r) {
    if (it.part >= 0) {
      float* dst = pl.o_part + (it.part * pl.M + r) * p.head_dim_v;
      for (int d = 0; d < p.head_dim_v; ++d) dst[d] = kNaN;
      pl.lse_part[it.part * pl.M + r] = kNaN;
    } else {
      const int64_t off = o_offset(p, pl, it.b, it.hk, r);
      for (int d = 0; d < p.head_dim_v; ++d) store_o(p.dtype, p.o, off + d, kNaN);
      p.lse[lse_offset(p, pl, it.b, it.hk, r)] = kNaN;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Tile gather: row pointers (and per-token scales) of keys [t0, t0 + n) of an item, converting
// to float32 where the pages cannot be read in place. Walks the block table from (pidx, off).

struct TileCursor {
  int64_t pidx;  // block-table column of the next key
  int32_t off;   // offset of the next key in its page
};

struct TileBuffers {
  float* Kf;  // [kTileN, Dp] float32 copy of the K tile (padding columns zero)
  float* Vf;  // [kTileN, Dvp]
  float* ks;  // [kTileN] per-token scales
  float* vs;
  const float** krow;  // [kTileN] row pointers
  const float** vrow;
  const void** pf_k;   // [kTileN] cache rows of the next tile (to prefetch)
  const void** pf_v;
  int* pf_count;
};

template <CacheDType CT>
JF_INLINE void gather_impl(const Plan& pl, const Item& it, int n, TileCursor* cur,
                           const TileBuffers& tb) {
  using T = typename CacheElem<CT>::T;
  const PagedAttentionParams& p = *pl.p;
  const int D = p.head_dim, Dv = p.head_dim_v, Dp = pl.Dp, Dvp = pl.Dvp;
  const int Hkv = p.num_heads_k, ps = p.page_size, hk = it.hk;
  const bool per_token = p.scale_mode == ScaleMode::kPerToken;
  const T* kc = static_cast<const T*>(p.k_pages);
  const T* vc = static_cast<const T*>(p.v_pages);
  const int32_t* bt = p.block_tables + int64_t(it.b) * p.max_pages;
  int64_t pidx = cur->pidx;
  int32_t off = cur->off;
  for (int j = 0; j < n; ++j) {
    const int64_t row = (int64_t(bt[pidx]) * ps + off) * Hkv + hk;  // [page, offset, head]
    const T* ksrc = kc + row * D;
    const T* vsrc = vc + row * Dv;
    if (pl.k_direct) {
      tb.krow[j] = reinterpret_cast<const float*>(ksrc);
    } else {
      float* JF_RESTRICT dst = tb.Kf + int64_t(j) * Dp;
      for (int d = 0; d < D; ++d) dst[d] = CacheElem<CT>::load(ksrc[d]);
      for (int d = D; d < Dp; ++d) dst[d] = 0.0f;
      tb.krow[j] = dst;
    }
    if (pl.v_direct) {
      tb.vrow[j] = reinterpret_cast<const float*>(vsrc);
    } else {
      float* JF_RESTRICT dst = tb.Vf + int64_t(j) * Dvp;
      for (int d = 0; d < Dv; ++d) dst[d] = CacheElem<CT>::load(vsrc[d]);
      for (int d = Dv; d < Dvp; ++d) dst[d] = 0.0f;
      tb.vrow[j] = dst;
    }
    if (per_token) {
      tb.ks[j] = p.k_scale[row];
      tb.vs[j] = p.v_scale[row];
    }
    if (++off == ps) {
      off = 0;
      ++pidx;
    }
  }
  cur->pidx = pidx;
  cur->off = off;
  // Addresses of the next tile's rows, prefetched by the item loop while it computes this
  // tile's scores (rows of consecutive keys lie Hkv * D elements apart and pages anywhere,
  // beyond what the hardware prefetcher follows; spreading the prefetches over the compute
  // keeps them from stalling on full miss buffers).
  const int next = static_cast<int>(std::min<int64_t>(kTileN, it.ke - (pidx * ps + off)));
  *tb.pf_count = next < 0 ? 0 : next;
  for (int j = 0; j < next; ++j) {
    const int64_t row = (int64_t(bt[pidx]) * ps + off) * Hkv + hk;
    tb.pf_k[j] = kc + row * D;
    tb.pf_v[j] = vc + row * Dv;
    if (++off == ps) {
      off = 0;
      ++pidx;
    }
  }
}

using GatherFn = void (*)(const Plan&, const Item&, int, TileCursor*, const TileBuffers&);

template <CacheDType CT>
void gather_generic(const Plan& pl, const Item& it, int n, TileCursor* cur, const TileBuffers& tb) {
  gather_impl<CT>(pl, it, n, cur, tb);
}
#if JF_X86_DISPATCH
template <CacheDType CT>
JF_TARGET_AVX2 void gather_avx2(const Plan& pl, const Item& it, int n, TileCursor* cur,
                                const TileBuffers& tb) {
  gather_impl<CT>(pl, it, n, cur, tb);
}
template <CacheDType CT>
JF_TARGET_AVX512 void gather_avx512(const Plan& pl, const Item& it, int n, TileCursor* cur,
                                    const TileBuffers& tb) {
  gather_impl<CT>(pl, it, n, cur, tb);
}
#endif

// Prefetches cache rows [j0, j1) of the next tile (K and V).
JF_INLINE void prefetch_rows(const void* const* pk, const void* const* pv, int j0, int j1,
                             int64_t kbytes, int64_t vbytes) {
#if defined(__GNUC__)
  for (int j = j0; j < j1; ++j) {
    const char* k = static_cast<const char*>(pk[j]);
    const char* v = static_cast<const char*>(pv[j]);
    for (int64_t x = 0; x < kbytes; x += 64) __builtin_prefetch(k + x);
    for (int64_t x = 0; x < vbytes; x += 64) __builtin_prefetch(v + x);
  }
#else
  (void)pk, (void)pv, (void)j0, (void)j1, (void)kbytes, (void)vbytes;
#endif
}

// ---------------------------------------------------------------------------------------------
// One work item.

template <int W, int MB>
JF_INLINE void item_impl(const Plan& pl, const Item& it, float* JF_RESTRICT scratch,
                         int64_t* JF_RESTRICT range) {
  constexpr int KB = std::min(W, std::max(1, (W >= 16 ? 8 : 4) / MB));
  // acc += P V keeps MB x NV vectors of acc in registers: 16 of the 32 AVX-512 registers, 8 of
  // the 16 of SSE / AVX2.
  constexpr int NV = std::max(1, std::min(8, (W >= 16 ? 16 : 8) / MB));
  const PagedAttentionParams& p = *pl.p;
  const int G = pl.G, M = pl.M, Mp = pl.Mp, Dp = pl.Dp, Dvp = pl.Dvp;
  const int D = p.head_dim, Sq = p.seqlen_q;
  const int ps = p.page_size;
  const int b = it.b, hk = it.hk;
  const int64_t k_len = p.kv_lens[b];
  const bool per_token = p.scale_mode == ScaleMode::kPerToken;
  const bool per_head = p.scale_mode == ScaleMode::kPerHead;

  float* JF_RESTRICT Q = scratch;
  float* JF_RESTRICT Kf = Q + int64_t(Mp) * Dp;
  float* JF_RESTRICT Vf = Kf + int64_t(kTileN) * Dp;
  float* JF_RESTRICT S = Vf + int64_t(kTileN) * Dvp;
  float* JF_RESTRICT Acc = S + int64_t(Mp) * kTileN;
  float* JF_RESTRICT zero = Acc + int64_t(Mp) * Dvp;
  float* JF_RESTRICT mrow = zero + Dp;
  float* JF_RESTRICT lrow = mrow + Mp;
  float* JF_RESTRICT tmax = lrow + Mp;
  float* JF_RESTRICT tsum = tmax + Mp;
  float* JF_RESTRICT muse = tsum + Mp;
  float* JF_RESTRICT alpha = muse + Mp;
  float* JF_RESTRICT ks = alpha + Mp;
  float* JF_RESTRICT vs = ks + kTileN;

  // Visible ranges per query position, clamped to the item's keys.
  int64_t* lo = range;
  int64_t* hi = range + Sq;
  for (int i = 0; i < Sq; ++i) {
    int64_t l, h;
    visible(p, i, k_len, &l, &h);
    l = std::max<int64_t>(l, it.kb);
    h = std::min<int64_t>(h, it.ke);
    if (l >= h) l = h = it.kb;
    lo[i] = l;
    hi[i] = h;
  }

  // Q rows, scaled; padding (columns D..Dp, rows M..Mp) zero.
  const float q_scale = p.softmax_scale * (per_head ? p.k_scale[hk] : 1.0f);
  for (int i = 0; i < Sq; ++i) {
    const int64_t src = ((int64_t(b) * Sq + i) * p.num_heads + int64_t(hk) * G) * D;
    for (int g = 0; g < G; ++g) {
      float* dst = Q + int64_t(i * G + g) * Dp;
      for (int d = 0; d < D; ++d) dst[d] = load_q(p.dtype, p.q, src + int64_t(g) * D + d) * q_scale;
      for (int d = D; d < Dp; ++d) dst[d] = 0.0f;
    }
  }
  std::fill(Q + int64_t(M) * Dp, Q + int64_t(Mp) * Dp, 0.0f);
  std::fill(zero, zero + Dp, 0.0f);
  std::fill(Acc, Acc + int64_t(Mp) * Dvp, 0.0f);
  std::fill(ks, ks + 2 * kTileN, 0.0f);  // ks and vs: padding keys read finite values
  for (int r = 0; r < Mp; ++r) {
    mrow[r] = kNegInf;
    lrow[r] = 0.0f;
  }

  const bool use_cap = p.softcap > 0.0f;
  const float cap = p.softcap, inv_cap = use_cap ? 1.0f / p.softcap : 0.0f;
  const float* krow[kTileN];
  const float* vrow[kTileN];
  const void* pf_k[kTileN];
  const void* pf_v[kTileN];
  int pf_count = 0;
  const TileBuffers tb{Kf, Vf, ks, vs, krow, vrow, pf_k, pf_v, &pf_count};
  const int64_t row_bytes_k = int64_t(D) * pl.cache_elem_bytes;
  const int64_t row_bytes_v = int64_t(p.head_dim_v) * pl.cache_elem_bytes;
  TileCursor cur{it.kb / ps, static_cast<int32_t>(it.kb % ps)};
  for (int64_t t0 = it.kb; t0 < it.ke; t0 += kTileN) {
    const int n = static_cast<int>(std::min<int64_t>(kTileN, it.ke - t0));
    const int nw = static_cast<int>(round_up(n, W));
    pl.gather(pl, it, n, &cur, tb);

    // Scores: S[r, j] for rows in blocks of MB, keys in blocks of W (padding keys read zeros).
    const float* kblk[W];
    const int pf_per_block = (pf_count + nw / W - 1) / (nw / W);
    for (int j0 = 0, jb = 0; j0 < nw; j0 += W, ++jb) {
      for (int j = 0; j < W; ++j) kblk[j] = j0 + j < n ? krow[j0 + j] : zero;
      for (int r0 = 0; r0 < Mp; r0 += MB)
        qk_block<W, MB, KB>(Q + int64_t(r0) * Dp, Dp, kblk, Dp / W, S + int64_t(r0) * kTileN + j0,
                            kTileN);
      prefetch_rows(pf_k, pf_v, jb * pf_per_block, std::min(pf_count, (jb + 1) * pf_per_block),
                    row_bytes_k, row_bytes_v);
    }

    // Softmax bookkeeping per row, over whole vectors of keys (nw): padding keys n..nw are
    // masked to -inf (the last tile ends at it.ke, so hi <= t0 + n there).
    for (int r = 0; r < M; ++r) {
      const int i = r / G;
      float* JF_RESTRICT s = S + int64_t(r) * kTileN;
      if (per_token)
        for (int j = 0; j < nw; ++j) s[j] *= ks[j];
      if (use_cap)
        for (int j = 0; j < nw; ++j) s[j] = cap * tanh_approx(s[j] * inv_cap);
      if (lo[i] > t0 || hi[i] < t0 + nw) {
        const int32_t jl = static_cast<int32_t>(lo[i] - t0), jh = static_cast<int32_t>(hi[i] - t0);
        for (int j = 0; j < nw; ++j) s[j] = (j >= jl && j < jh) ? s[j] : kNegInf;
      }
      tmax[r] = row_max<W>(s, nw);
    }
    for (int r = 0; r < M; ++r) {
      const float m_new = tmax[r] > mrow[r] ? tmax[r] : mrow[r];
      const float mu = m_new == kNegInf ? 0.0f : m_new;  // no key yet: exp(-inf - 0) = 0
      muse[r] = mu;
      alpha[r] = exp_approx(mrow[r] - mu);
      mrow[r] = m_new;
    }
    for (int r = 0; r < M; ++r) {
      float* JF_RESTRICT s = S + int64_t(r) * kTileN;
      const float mu = muse[r];
      for (int j = 0; j < nw; ++j) s[j] = exp_approx(s[j] - mu);
      tsum[r] = row_sum<W>(s, nw);
      if (per_token)
        for (int j = 0; j < nw; ++j) s[j] *= vs[j];
    }
    for (int r = 0; r < M; ++r) {
      lrow[r] = lrow[r] * alpha[r] + tsum[r];
      if (alpha[r] != 1.0f) {
        float* JF_RESTRICT a = Acc + int64_t(r) * Dvp;
        const float al = alpha[r];
        for (int d = 0; d < Dvp; ++d) a[d] *= al;
      }
    }
    // Padding rows (M..Mp) get zero probabilities (their accumulators are never read).
    for (int r = M; r < Mp; ++r)
      std::fill(S + int64_t(r) * kTileN, S + int64_t(r) * kTileN + n, 0.0f);

    // acc += P V. A key a row cannot see must contribute nothing, not 0 * V (NaN for a NaN or
    // inf in V): a block of rows of which one sees only part of the tile's keys (causal or
    // window edge) adds each row's visible keys [lo - t0, hi - t0) alone.
    for (int r0 = 0; r0 < Mp; r0 += MB) {
      bool partial = false;
      for (int r = r0; r < std::min(r0 + MB, M); ++r)
        partial |= lo[r / G] > t0 || hi[r / G] < t0 + n;
      if (!partial) {
        pv_range<W, MB, NV>(S + int64_t(r0) * kTileN, kTileN, vrow, n, Acc + int64_t(r0) * Dvp,
                            Dvp, 0, Dvp / W);
        continue;
      }
      // Padding rows (M..Mp) are skipped: their accumulators are never read.
      for (int r = r0; r < std::min(r0 + MB, M); ++r) {
        const int jl = static_cast<int>(std::clamp<int64_t>(lo[r / G] - t0, 0, n));
        const int jh = static_cast<int>(std::clamp<int64_t>(hi[r / G] - t0, 0, n));
        if (jl < jh)
          pv_range<W, 1, NV>(S + int64_t(r) * kTileN + jl, kTileN, vrow + jl, jh - jl,
                             Acc + int64_t(r) * Dvp, Dvp, 0, Dvp / W);
      }
    }
  }

  write_item_rows(pl, it, Acc, Dvp, mrow, lrow, per_head ? p.v_scale[hk] : 1.0f);
}

using ItemFn = void (*)(const Plan&, const Item&, float*, int64_t*);

template <int W, int MB>
void item_generic(const Plan& pl, const Item& it, float* s, int64_t* r) {
  item_impl<W, MB>(pl, it, s, r);
}
#if JF_X86_DISPATCH
template <int W, int MB>
JF_TARGET_AVX2 void item_avx2(const Plan& pl, const Item& it, float* s, int64_t* r) {
  item_impl<W, MB>(pl, it, s, r);
}
template <int W, int MB>
JF_TARGET_AVX512 void item_avx512(const Plan& pl, const Item& it, float* s, int64_t* r) {
  item_impl<W, MB>(pl, it, s, r);
}
#endif

using cpu::Isa;
using cpu::detect_isa;

template <int W>
ItemFn pick_item(Isa isa, int mb) {
  const int i = mb == 1 ? 0 : mb == 2 ? 1 : mb == 4 ? 2 : 3;
  const ItemFn generic[] = {&item_generic<W, 1>, &item_generic<W, 2>, &item_generic<W, 4>,
                            &item_generic<W, 8>};
#if JF_X86_DISPATCH
  const ItemFn avx2[] = {&item_avx2<W, 1>, &item_avx2<W, 2>, &item_avx2<W, 4>, &item_avx2<W, 8>};
  const ItemFn avx512[] = {&item_avx512<W, 1>, &item_avx512<W, 2>, &item_avx512<W, 4>,
                           &item_avx512<W, 8>};
  if (isa == Isa::kAvx512) return avx512[i];
  if (isa == Isa::kAvx2) return avx2[i];
#endif
  return generic[i];
}

template <CacheDType CT>
GatherFn pick_gather_ct(Isa isa) {
#if JF_X86_DISPATCH
  if (isa == Isa::kAvx512) return &gather_avx512<CT>;
  if (isa == Isa::kAvx2) return &gather_avx2<CT>;
#endif
  (void)isa;
  return &gather_generic<CT>;
}

GatherFn pick_gather(Isa isa, CacheDType ct) {
  switch (ct) {
    case CacheDType::kFloat32: return pick_gather_ct<CacheDType::kFloat32>(isa);
    case CacheDType::kFloat16: return pick_gather_ct<CacheDType::kFloat16>(isa);
    case CacheDType::kBFloat16: return pick_gather_ct<CacheDType::kBFloat16>(isa);
    case CacheDType::kInt8: return pick_gather_ct<CacheDType::kInt8>(isa);
    case CacheDType::kFloat8E4M3: return pick_gather_ct<CacheDType::kFloat8E4M3>(isa);
  }
  return nullptr;
}

// ---------------------------------------------------------------------------------------------

// Every row of sequence b: o = value, lse = lse_value.
void fill_sequence(const PagedAttentionParams& p, int b, float value, float lse_value) {
  const int64_t rows = int64_t(p.seqlen_q) * p.num_heads;
  const int64_t o0 = int64_t(b) * rows * p.head_dim_v;
  for (int64_t x = 0; x < rows * p.head_dim_v; ++x) store_o(p.dtype, p.o, o0 + x, value);
  float* lse = p.lse + int64_t(b) * rows;
  for (int64_t x = 0; x < rows; ++x) lse[x] = lse_value;
}

// The header's bad-data rule: kv_lens[b] outside [0, max_pages * page_size] or a block-table
// entry among the first ceil(kv_lens[b] / page_size) outside [0, num_pages).
bool sequence_is_bad(const PagedAttentionParams& p, int b) {
  const int64_t len = p.kv_lens[b];
  if (len < 0 || len > int64_t(p.max_pages) * p.page_size) return true;
  const int32_t* bt = p.block_tables + int64_t(b) * p.max_pages;
  const int64_t pages = ceil_div(len, p.page_size);
  for (int64_t j = 0; j < pages; ++j)
    if (bt[j] < 0 || bt[j] >= p.num_pages) return true;
  return false;
}

struct Group {  // (b, hk) whose key range is split over `count` items with parts [first, ...)
  int32_t b, hk;
  int64_t first;
  int32_t count;
};

void merge_group(const Plan& pl, const Group& g) {
  const PagedAttentionParams& p = *pl.p;
  const int Dv = p.head_dim_v;
  for (int r = 0; r < pl.M; ++r) {
    float mx = kNegInf;
    bool nan = false;
    for (int s = 0; s < g.count; ++s) {
      const float l = pl.lse_part[(g.first + s) * pl.M + r];
      nan = nan || !(l == l);
      mx = l > mx ? l : mx;
    }
    const int64_t off = o_offset(p, pl, g.b, g.hk, r);
    float* lse = p.lse + lse_offset(p, pl, g.b, g.hk, r);
    if (nan || mx == kNegInf) {
      const float v = nan ? kNaN : 0.0f;
      for (int d = 0; d < Dv; ++d) store_o(p.dtype, p.o, off + d, v);
      *lse = nan ? kNaN : kNegInf;
      continue;
    }
    float w[64];
    float sum = 0.0f;
    // count <= kTargetItems (64) by construction.
    for (int s = 0; s < g.count; ++s) {
      w[s] = std::exp(pl.lse_part[(g.first + s) * pl.M + r] - mx);
      sum += w[s];
    }
    const float inv = 1.0f / sum;
    for (int d = 0; d < Dv; ++d) {
      float acc = 0.0f;
      for (int s = 0; s < g.count; ++s) acc += w[s] * pl.o_part[((g.first + s) * pl.M + r) * Dv + d];
      store_o(p.dtype, p.o, off + d, acc * inv);
    }
    *lse = mx + std::log(sum);
  }
}

void run(const PagedAttentionParams& p) {
  const int B = p.batch, Hkv = p.num_heads_k;
  Plan pl{};
  pl.p = &p;
  pl.G = p.num_heads / Hkv;
  pl.M = pl.G * p.seqlen_q;
  const int mb = pl.M <= 1 ? 1 : pl.M <= 2 ? 2 : pl.M <= 4 ? 4 : 8;
  pl.Mp = static_cast<int>(round_up(pl.M, mb));

  const Isa isa = detect_isa();
  const int W = isa == Isa::kAvx512 ? 16 : isa == Isa::kAvx2 ? 8 : 4;
  const ItemFn fn = W == 16 ? pick_item<16>(isa, mb)
                    : W == 8 ? pick_item<8>(isa, mb)
                             : pick_item<4>(isa, mb);
  pl.gather = pick_gather(isa, p.cache_dtype);
  if (pl.gather == nullptr) return;
  pl.Dp = static_cast<int>(round_up(p.head_dim, W));
  pl.Dvp = static_cast<int>(round_up(p.head_dim_v, W));
  pl.cache_elem_bytes = cache_elem_bytes(p.cache_dtype);
  pl.k_direct = p.cache_dtype == CacheDType::kFloat32 && p.head_dim % W == 0;
  pl.v_direct = p.cache_dtype == CacheDType::kFloat32 && p.head_dim_v % W == 0;

  // Items. Sequences with bad data get nan, those where no row sees a key zeros / -inf.
  const int64_t bh = int64_t(B) * Hkv;
  const int64_t want_splits = bh >= kTargetItems ? 1 : ceil_div(kTargetItems, bh);
  std::vector<Item> items;
  std::vector<Group> groups;
  int64_t parts = 0;
  for (int b = 0; b < B; ++b) {
    if (sequence_is_bad(p, b)) {
      fill_sequence(p, b, kNaN, kNaN);
      continue;
    }
    const int64_t k_len = p.kv_lens[b];
    int64_t lo0, hi0, lo1, hi1;
    visible(p, 0, k_len, &lo0, &hi0);
    visible(p, p.seqlen_q - 1, k_len, &lo1, &hi1);
    const int64_t ulo = std::min<int64_t>(lo0, k_len), uhi = std::max<int64_t>(hi1, 0);
    if (ulo >= uhi) {
      fill_sequence(p, b, 0.0f, kNegInf);
      continue;
    }
    const int64_t range = uhi - ulo;
    int64_t ns = std::max<int64_t>(1, std::min(want_splits, range / kMinSplitKeys));
    const int64_t chunk = round_up(ceil_div(range, ns), kTileN);
    ns = ceil_div(range, chunk);
    for (int hk = 0; hk < Hkv; ++hk) {
      if (ns > 1) groups.push_back({b, hk, parts, static_cast<int32_t>(ns)});
      for (int64_t s = 0; s < ns; ++s) {
        const int64_t kb = ulo + s * chunk, ke = std::min(uhi, kb + chunk);
        items.push_back({b, hk, static_cast<int32_t>(kb), static_cast<int32_t>(ke),
                         ns > 1 ? parts++ : -1, (ke - kb) * pl.M + 64});
      }
    }
  }
  if (items.empty()) return;
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& x, const Item& y) { return x.cost > y.cost; });
  std::vector<float> o_part(static_cast<size_t>(parts * pl.M * p.head_dim_v));
  std::vector<float> lse_part(static_cast<size_t>(parts * pl.M));
  pl.o_part = o_part.data();
  pl.lse_part = lse_part.data();

  const int64_t scratch_size = scratch_floats(pl);
  auto body = [&](int64_t idx) {
    const Item& it = items[idx];
    thread_local std::vector<float> scratch;
    thread_local std::vector<int64_t> ranges;
    try {
      if (static_cast<int64_t>(scratch.size()) < scratch_size) {
        scratch.clear();
        scratch.shrink_to_fit();
        scratch.resize(scratch_size);
      }
      if (static_cast<int64_t>(ranges.size()) < 2 * int64_t(p.seqlen_q)) ranges.resize(2 * p.seqlen_q);
    } catch (...) {
      fail_item(pl, it);
      return;
    }
    fn(pl, it, scratch.data(), ranges.data());
  };
  cpu::parallel_for(static_cast<int64_t>(items.size()), body);

  if (!groups.empty()) {
    auto merge = [&](int64_t g) { merge_group(pl, groups[g]); };
    cpu::parallel_for(static_cast<int64_t>(groups.size()), merge);
  }
}

}  // namespace

void paged_attention_cpu(const PagedAttentionParams& p) {
  if (p.batch <= 0 || p.seqlen_q <= 0 || p.num_heads <= 0 || p.num_heads_k <= 0 ||
      p.num_heads % p.num_heads_k != 0 || p.head_dim <= 0 || p.head_dim_v <= 0 ||
      p.page_size <= 0 || p.num_pages < 0 || p.max_pages < 0)
    return;
  const bool quantized =
      p.cache_dtype == CacheDType::kInt8 || p.cache_dtype == CacheDType::kFloat8E4M3;
  if (quantized != (p.scale_mode != ScaleMode::kNone)) return;
  if (quantized && (p.k_scale == nullptr || p.v_scale == nullptr)) return;
  try {
    run(p);
  } catch (...) {
    // Only the plan's allocations can throw: report failure as nan everywhere.
    for (int b = 0; b < p.batch; ++b) fill_sequence(p, b, kNaN, kNaN);
  }
}

}  // namespace jax_flash

// What the two paged decode kernels (paged/cuda_core.cuh and paged_attention_mma.cuh) share:
// the sequence, page-table and output helpers, and the steps of their prologue and epilogue
// (CTA coordinates, key range, query row addresses, first rows of the page-table ring, pipeline
// prime, block-table scan, the warps' final max / sum, the normalised store). Every function is
// __forceinline__: each kernel compiles to the code it had with these steps written inline.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "jax_flash/dtype.cuh"  // store4_from_float
#include "jax_flash/paged/ptx.cuh"
#include "jax_flash/paged_params.h"

namespace jax_flash {
namespace paged {

// A kv length outside [0, max_pages * page_size] makes the whole sequence bad (NaN).
__device__ __forceinline__ bool paged_klen_bad(const PagedAttentionParams& p, int32_t klen) {
  return klen < 0 || static_cast<int64_t>(klen) > static_cast<int64_t>(p.max_pages) * p.page_size;
}

// Visible keys [lo, hi) of query position i (0 <= i < Sq) of a sequence of klen keys (bottom-right
// aligned window, paged_params.h); non-decreasing in i; hi >= lo.
__device__ __forceinline__ void paged_visible(const PagedAttentionParams& p, int32_t klen, int i,
                                              int32_t* lo, int32_t* hi) {
  const int64_t diag = static_cast<int64_t>(i) + klen - p.seqlen_q;
  int64_t l = 0, h = klen;
  if (p.window_left >= 0 && diag - p.window_left > l) l = diag - p.window_left;
  if (p.window_right >= 0 && diag + p.window_right + 1 < h) h = diag + p.window_right + 1;
  if (h < l) h = l;
  *lo = static_cast<int32_t>(l);
  *hi = static_cast<int32_t>(h);
}

// Page id and in-page offset of key t of a sequence (bt: its block-table row), loaded ahead of
// use: the id is checked only when the row is placed (paged_row_index).
struct PagedRowRef {
  int32_t page;
  int32_t off;
  bool valid;  // active and t < ke
};

__device__ __forceinline__ PagedRowRef paged_row_ref(const int32_t* bt, int64_t t, int32_t ke,
                                                     int32_t ps, bool active) {
  PagedRowRef r;
  r.valid = active && t < ke;
  r.page = 0;
  r.off = 0;
  if (r.valid) {  // 0 <= t < ke <= 2^31 - 1: 32-bit division
    const uint32_t t32 = static_cast<uint32_t>(t);
    const uint32_t pidx = t32 / static_cast<uint32_t>(ps);
    r.off = static_cast<int32_t>(t32 - pidx * static_cast<uint32_t>(ps));
    r.page = __ldg(bt + pidx);
  }
  return r;
}

// Whether a prefetched key has a row to read: it is in range and its page id is valid; a key in
// range behind an invalid id sets `bad`.
__device__ __forceinline__ bool paged_row_ok(const PagedRowRef& r, const PagedAttentionParams& p,
                                             int& bad) {
  const bool ok = r.page >= 0 && r.page < p.num_pages;
  bad |= r.valid && !ok;
  return r.valid && ok;
}

// Cache row ((page * page_size + off) * Hkv + kvh) of a prefetched key, or -1 for a key past the
// range or behind an invalid page id (never read through; it sets `bad`).
__device__ __forceinline__ int64_t paged_row_index(const PagedRowRef& r,
                                                   const PagedAttentionParams& p, int kvh,
                                                   int& bad) {
  return paged_row_ok(r, p, bad)
             ? (static_cast<int64_t>(r.page) * p.page_size + r.off) * p.num_heads_k + kvh
             : int64_t(-1);
}

// 16-byte chunk `byte_off` of cache row `ri` (rows of row_bytes) of `base` into shared memory;
// ri < 0 zero-fills the 16 bytes without reading.
__device__ __forceinline__ void paged_copy16(void* smem, const char* base, int64_t ri,
                                             int row_bytes, int byte_off) {
  cp_async16(smem, ri >= 0 ? base + ri * row_bytes + byte_off : base, ri >= 0 ? 16 : 0);
}

// Whole-sequence check of the first ceil(klen / page_size) block-table entries by kNT threads
// (each returns its own flag; OR them over the CTA).
template <int kNT>
__device__ __forceinline__ int paged_block_table_bad(const PagedAttentionParams& p,
                                                     const int32_t* bt, int32_t klen, int tid) {
  const int32_t ps = p.page_size;
  const int32_t npg = klen / ps + (klen % ps != 0);
  int bad = 0;
  for (int i0 = 0; i0 < npg; i0 += 8 * kNT) {
    int32_t id[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int i = i0 + k * kNT + tid;
      id[k] = i < npg ? __ldg(bt + i) : 0;
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) bad |= (id[k] < 0) | (id[k] >= p.num_pages);
  }
  return bad;
}

// Stores 4 output columns [4 * q4, 4 * q4 + 4) of group row gm (query position gm / G, head
// kvh * G + gm % G) of sequence b, and its LSE when write_lse: to o / lse, or with split-KV to
// this split's o_partial / lse_partial. dv: the output's head dim (p.head_dim_v; a kernel that
// knows it at compile time passes the constant).
template <typename TQ>
__device__ __forceinline__ void paged_store_out(const PagedAttentionParams& p, int dv, int b,
                                                int kvh, int split, int G, int gm, int q4,
                                                float4 v, bool write_lse, float lse) {
  const int i = gm / G;
  const int h = kvh * G + (gm - i * G);
  const int Sq = p.seqlen_q, Hq = p.num_heads;
  const bool split_out = p.num_splits > 1;
  const int64_t bb = split_out ? static_cast<int64_t>(split) * p.batch + b : b;
  const int64_t o_off = ((bb * Sq + i) * Hq + h) * dv + 4 * q4;
  const int64_t l_off = (bb * Hq + h) * Sq + i;
  if (split_out) {
    *reinterpret_cast<float4*>(p.o_partial + o_off) = v;
    if (write_lse) p.lse_partial[l_off] = lse;
  } else {
    store4_from_float<TQ>(static_cast<TQ*>(p.o) + o_off, v.x, v.y, v.z, v.w);
    if (write_lse) p.lse[l_off] = lse;
  }
}

// ---------------------------------------------------------------------------------------------
// Prologue and epilogue steps
// ---------------------------------------------------------------------------------------------

// A CTA's place in the grid and its sequence. blockIdx.x = ((b * Hkv + kvh) * num_splits +
// split) * num_chunks + chunk (< 2^31); the CTA holds group rows [m0, m0 + mvalid) of kRows.
struct PagedCta {
  int chunk, split, kvh, b;
  int G;       // query heads per kv head
  int m0;      // first group row (row m = i * G + g: query position i, head g of the group)
  int mvalid;  // rows of this CTA that exist (the rest is padding)
  int32_t klen;        // kv length of sequence b (not yet checked: paged_klen_bad)
  const int32_t* bt;   // block-table row of sequence b
};

template <int kRows>
__device__ __forceinline__ PagedCta paged_cta(const PagedAttentionParams& p, int32_t num_chunks) {
  PagedCta c;
  uint32_t bid = blockIdx.x;
  c.chunk = static_cast<int>(bid % static_cast<uint32_t>(num_chunks));
  bid /= static_cast<uint32_t>(num_chunks);
  c.split = static_cast<int>(bid % static_cast<uint32_t>(p.num_splits));
  bid /= static_cast<uint32_t>(p.num_splits);
  c.kvh = static_cast<int>(bid % static_cast<uint32_t>(p.num_heads_k));
  c.b = static_cast<int>(bid / static_cast<uint32_t>(p.num_heads_k));
  c.G = p.num_heads / p.num_heads_k;
  c.m0 = c.chunk * kRows;
  c.mvalid = min(kRows, c.G * p.seqlen_q - c.m0);
  c.klen = __ldg(p.kv_lens + c.b);
  c.bt = p.block_tables + static_cast<int64_t>(c.b) * p.max_pages;
  return c;
}

// NaN in every output column (dv of them) and LSE of the CTA's rows (a sequence with bad data),
// by kNT threads.
template <typename TQ, int kNT>
__device__ __forceinline__ void paged_store_nan(const PagedAttentionParams& p, int dv,
                                                const PagedCta& c, int tid) {
  const float nan = qnan();
  const int dq = dv / 4;
  for (int idx = tid; idx < c.mvalid * dq; idx += kNT) {
    const int q4 = idx % dq;
    paged_store_out<TQ>(p, dv, c.b, c.kvh, c.split, c.G, c.m0 + idx / dq, q4,
                        make_float4(nan, nan, nan, nan), q4 == 0, nan);
  }
}

// A kv length outside [0, max_pages * page_size] makes the whole sequence bad: NaN in the CTA's
// rows, and true (the kernel returns; klen is the same for every thread: no barrier needed).
template <typename TQ, int kNT>
__device__ __forceinline__ bool paged_reject_bad_klen(const PagedAttentionParams& p, int dv,
                                                      const PagedCta& c, int tid) {
  if (!paged_klen_bad(p, c.klen)) return false;
  paged_store_nan<TQ, kNT>(p, dv, c, tid);
  return true;
}

// Keys of a CTA: the union of its rows' visible keys within its split, [kb, ke) in ntiles tiles
// of kTK; the visible ranges of its first and last rows (rows are ordered by query position and
// the ranges are non-decreasing in it).
struct PagedKeyRange {
  int32_t lo_first, hi_first, lo_last, hi_last;
  int32_t kb, ke;
  int ntiles;
};

template <int kTK>
__device__ __forceinline__ PagedKeyRange paged_key_range(const PagedAttentionParams& p,
                                                         const PagedCta& c) {
  PagedKeyRange r;
  paged_visible(p, c.klen, c.m0 / c.G, &r.lo_first, &r.hi_first);
  paged_visible(p, c.klen, (c.m0 + c.mvalid - 1) / c.G, &r.lo_last, &r.hi_last);
  split_range(c.klen, p.page_size, p.num_splits, c.split, &r.kb, &r.ke);
  r.kb = max(r.kb, r.lo_first);
  r.ke = min(r.ke, r.hi_last);
  r.ntiles = r.ke > r.kb
                 ? static_cast<int>((static_cast<int64_t>(r.ke) - r.kb + kTK - 1) / kTK)
                 : 0;
  return r;
}

// Visible keys [lo, hi) of CTA row r; a padding row (r >= mvalid) sees none.
__device__ __forceinline__ void paged_row_visible(const PagedAttentionParams& p,
                                                  const PagedCta& c, int r, int32_t* lo,
                                                  int32_t* hi) {
  *lo = 0;
  *hi = 0;
  if (r < c.mvalid) paged_visible(p, c.klen, (c.m0 + r) / c.G, lo, hi);
}

// Element offset in q (head dim d: p.head_dim, or its compile-time value) of column `col` of
// group row gm (query position gm / G, head kvh * G + gm % G).
__device__ __forceinline__ int64_t paged_q_offset(const PagedAttentionParams& p, int d,
                                                  const PagedCta& c, int gm, int col) {
  const int i = gm / c.G;
  const int h = c.kvh * c.G + (gm - i * c.G);
  return ((static_cast<int64_t>(c.b) * p.seqlen_q + i) * p.num_heads + h) * d + col;
}

// Places the rows of the first kS tiles (those < ntiles) into the slots of the page-table ring
// from their prefetched page ids ref0[0..kS-1] (threads tid < kTK; store_row(slot) reads pf),
// and leaves pf holding tile kS's.
template <int kS, int kTK, typename StoreRow>
__device__ __forceinline__ void paged_place_first_rows(int tid, int ntiles,
                                                       const PagedRowRef (&ref0)[kS + 1],
                                                       PagedRowRef& pf, StoreRow&& store_row) {
  if (tid < kTK) {
#pragma unroll
    for (int T = 0; T < kS; ++T) {
      pf = ref0[T];
      if (T < ntiles) store_row(T);
    }
    pf = ref0[kS];
  }
}

// Issues the copies of the first kS - 1 tiles (one commit group each, empty past ntiles).
template <int kS, typename Issue>
__device__ __forceinline__ void paged_prime_pipeline(int ntiles, Issue&& issue) {
#pragma unroll
  for (int T = 0; T < kS - 1; ++T) {
    if (T < ntiles) issue(T);
    cp_async_commit();
  }
}

// Whole-sequence check of the page ids (run under the first copies). With split-KV only split 0
// scans: its NaN partial makes the merged output NaN.
template <int kNT>
__device__ __forceinline__ void paged_scan_block_table(const PagedAttentionParams& p,
                                                       const PagedCta& c, int tid, int& bad) {
  if (c.split == 0) bad |= paged_block_table_bad<kNT>(p, c.bt, c.klen, tid);
}

// The CTA's reference max of row r from the kW warps' wm_s[w * kStride + r] (0 where all are
// -inf: nothing to subtract), and the row's sum rescaled to it.
template <int kW, int kStride>
__device__ __forceinline__ float paged_final_max(const float* wm_s, int r) {
  float mf = neg_inf();
#pragma unroll
  for (int w = 0; w < kW; ++w) mf = fmaxf(mf, wm_s[w * kStride + r]);
  return mf == neg_inf() ? 0.f : mf;
}

template <int kW, int kStride>
__device__ __forceinline__ float paged_final_sum(const float* wm_s, const float* wl_s, int r,
                                                 float mref) {
  float l = 0.f;
#pragma unroll
  for (int w = 0; w < kW; ++w) l += fast_exp2(wm_s[w * kStride + r] - mref) * wl_s[w * kStride + r];
  return l;
}

// Epilogue store by kNT threads: row m (< mvalid) of the output (its first dv columns) is the
// sum of its kParts partial rows red_s[(part * kRows + m) * kStride + ...], divided by the final
// sum fl_s[m] and times vscale_head; its LSE (natural log) from fm_s[m] (log2 units) and fl_s[m].
template <typename TQ, int kParts, int kRows, int kStride, int kNT>
__device__ __forceinline__ void paged_store_rows(const PagedAttentionParams& p, int dv,
                                                 const PagedCta& c, int tid, const float* red_s,
                                                 const float* fm_s, const float* fl_s,
                                                 float vscale_head) {
  constexpr float kLn2 = 0.6931471805599453f;
  const int dq = dv / 4;
  for (int idx = tid; idx < c.mvalid * dq; idx += kNT) {
    const int m = idx / dq;
    const int q4 = idx - m * dq;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < kParts; ++w) {
      const float4 v = *reinterpret_cast<const float4*>(red_s + (w * kRows + m) * kStride + 4 * q4);
      acc.x += v.x;
      acc.y += v.y;
      acc.z += v.z;
      acc.w += v.w;
    }
    const float l = fl_s[m];
    const float inv = (l == 0.f ? 0.f : 1.f / l) * vscale_head;
    const float lse = l == 0.f ? neg_inf() : (fm_s[m] + log2f(l)) * kLn2;
    paged_store_out<TQ>(p, dv, c.b, c.kvh, c.split, c.G, c.m0 + m, q4,
                           make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv),
                           q4 == 0, lse);
  }
}

}  // namespace paged
}  // namespace jax_flash

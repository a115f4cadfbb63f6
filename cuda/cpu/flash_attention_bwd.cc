// CPU FlashAttention backward kernel. See flash_attention_bwd.h and jax_flash/flash_bwd_params.h.
//
// Two kinds of work item, run together on the thread pool (they write disjoint outputs):
//   dK/dV item (sequence b, kv head, block of up to kBlockN keys): K and V of the block stay in
//     float32 scratch; for every query head of the group and every block of up to kBlockM query
//     rows that sees one of the keys: recompute P^T and dZ^T of the tile (below), then
//     dV += P^T dO and dK += dZ^T Q (accumulators [keys, Dv] / [keys, D], float32).
//   dQ item (sequence b, query head, block of up to kBlockM rows): for every key tile the rows
//     see, recompute the tile and accumulate dQ += dZ K.
// A tile (keys x rows, transposed as in the forward kernel so that the K tile is the row-major
// A operand and the per-row bookkeeping is elementwise):
//   S^T = K (scale Q)^T, softcap, P^T = exp(S^T - lse) (0 where masked),
//   dP^T = V dO^T, dS^T = P^T (dP^T - Delta), dZ^T = dS^T (1 - tanh^2) with a softcap.
// Delta = rowsum(dO * O) - dLSE is computed once per (head, row) before the items run. dQ is
// computed apart from dK/dV (two more GEMMs per tile than one fused pass) so that no output is
// summed by two threads: no atomics, and the order of every sum is fixed.
// Rows with lse = -inf (they see no key) are treated as fully masked, so they neither receive
// nor give gradient; masked entries are cleared with selects, never by multiplying with 0 (an
// inf in V at a masked key then stays harmless, as in the forward).
#include "flash_attention_bwd.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_math.h"  // cuda/cpu: exp_approx, round_up, JF_INLINE
#include "dtype_io.h"
#include "gemm.h"  // cuda/cpu: the float32 GEMM micro-kernel
#include "isa.h"   // cuda/cpu: JF_TARGET_*, detect_isa
#include "thread_pool.h"

namespace jax_flash {
namespace {

#ifndef JAX_FLASH_CPU_BWD_BLOCK_M
#define JAX_FLASH_CPU_BWD_BLOCK_M 64
#endif
#ifndef JAX_FLASH_CPU_BWD_BLOCK_N
#define JAX_FLASH_CPU_BWD_BLOCK_N 64
#endif
constexpr int kBlockM = JAX_FLASH_CPU_BWD_BLOCK_M;  // query rows per tile
constexpr int kBlockN = JAX_FLASH_CPU_BWD_BLOCK_N;  // keys per tile
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

using cpu::Elem;
using cpu::exp_approx;
using cpu::gemm;
using cpu::round_up;

// The micro-kernel shapes (gemm.h), each with the tile extents padded for it.
using Tiles = cpu::PaddedTiles<kBlockM, kBlockN>;

// Per-thread scratch of one work item (floats). Head dims padded to NR: Dp, Dvp.
struct Scratch {
  float* qt;     // [D, RC]    scale * Q^T of the row block (padding columns zero)
  float* qr;     // [RC, Dp]   Q of the row block, row-major (dK/dV items)
  float* dot;    // [Dv, RC]   dO^T (padding columns zero)
  float* dor;    // [RC, Dvp]  dO, row-major (dK/dV items)
  float* k;      // [KR, Dp]   K tile (padding rows and columns zero)
  float* v;      // [KR, Dvp]  V tile
  float* dk;     // [KR, Dp]   dK accumulator (dK/dV items)
  float* dv;     // [KR, Dvp]  dV accumulator (dK/dV items)
  float* dq;     // [RC, Dp]   dQ accumulator (dQ items)
  float* pt;     // [KR, RC]   S^T, then P^T
  float* dpt;    // [KR, RC]   dP^T, then dZ^T
  float* lse;    // [RC]
  float* delta;  // [RC]
};

struct Dims {
  int D, Dv, Dp, Dvp;
};

template <class C>
int64_t scratch_floats(const Dims& d) {
  constexpr int64_t RC = C::RC, KR = C::KR;
  return d.D * RC + RC * d.Dp + d.Dv * RC + RC * d.Dvp + 2 * KR * d.Dp + 2 * KR * d.Dvp +
         RC * d.Dp + 2 * KR * RC + 2 * RC;
}

template <class C>
Scratch carve(float* f, const Dims& d) {
  constexpr int64_t RC = C::RC, KR = C::KR;
  Scratch s;
  s.qt = f;
  s.qr = s.qt + d.D * RC;
  s.dot = s.qr + RC * d.Dp;
  s.dor = s.dot + d.Dv * RC;
  s.k = s.dor + RC * d.Dvp;
  s.v = s.k + KR * d.Dp;
  s.dk = s.v + KR * d.Dvp;
  s.dv = s.dk + KR * d.Dp;
  s.dq = s.dv + KR * d.Dvp;
  s.pt = s.dq + RC * d.Dp;
  s.dpt = s.pt + KR * RC;
  s.lse = s.dpt + KR * RC;
  s.delta = s.lse + RC;
  return s;
}

// Visible keys [lo, hi) of row i, clamped into [0, k_len]; lo <= hi, and both are non-decreasing
// in i (so the rows that see a key block are one contiguous range).
JF_INLINE void row_keys(const FlashParams& p, const SeqExtent& e, int i, int32_t* lo,
                        int32_t* hi) {
  int32_t l, u;
  visible_keys(p, i, e.q_len, e.k_len, &l, &u);
  l = std::min(std::max(l, 0), e.k_len);
  u = std::min(std::max(u, l), e.k_len);
  *lo = l;
  *hi = u;
}

// Loads rows [i0, i0 + m) of query head h: scaled Q^T, dO^T (and row-major Q, dO with
// `row_major`), lse and Delta, and each row's visible keys (empty for a row with lse = -inf).
template <DType DT, class C>
JF_INLINE void load_rows(const FlashBwdParams& bp, const SeqExtent& e, const float* delta, int h,
                         int i0, int m, bool row_major, const Dims& d, const Scratch& s,
                         int32_t* lo, int32_t* hi) {
  using T = typename Elem<DT>::T;
  constexpr int RC = C::RC;
  const FlashParams& p = bp.fwd;
  const T* q = static_cast<const T*>(p.q);
  const T* dout = static_cast<const T*>(bp.dout);
  const float scale = p.softmax_scale;
  const int m_s = static_cast<int>(round_up(m, C::NR));
  for (int i = 0; i < m; ++i) {
    const int64_t r = static_cast<int64_t>(e.q_start) + i0 + i;
    const T* qs = q + r * p.q_row_stride + static_cast<int64_t>(h) * d.D;
    const T* ds = dout + r * bp.dout_row_stride + static_cast<int64_t>(h) * d.Dv;
    for (int x = 0; x < d.D; ++x)
      s.qt[static_cast<int64_t>(x) * RC + i] = Elem<DT>::load(qs[x]) * scale;
    for (int x = 0; x < d.Dv; ++x)
      s.dot[static_cast<int64_t>(x) * RC + i] = Elem<DT>::load(ds[x]);
    if (row_major) {
      float* qd = s.qr + static_cast<int64_t>(i) * d.Dp;
      float* dd = s.dor + static_cast<int64_t>(i) * d.Dvp;
      for (int x = 0; x < d.D; ++x) qd[x] = Elem<DT>::load(qs[x]);
      for (int x = d.D; x < d.Dp; ++x) qd[x] = 0.0f;
      for (int x = 0; x < d.Dv; ++x) dd[x] = Elem<DT>::load(ds[x]);
      for (int x = d.Dv; x < d.Dvp; ++x) dd[x] = 0.0f;
    }
    const int64_t hr = static_cast<int64_t>(h) * p.total_q + r;
    const float l = p.lse[hr];
    row_keys(p, e, i0 + i, &lo[i], &hi[i]);
    if (!(l > kNegInf)) lo[i] = hi[i] = 0;  // -inf (sees no key) or nan: no gradient
    s.lse[i] = lo[i] < hi[i] ? l : 0.0f;
    s.delta[i] = delta[hr];
  }
  for (int x = 0; x < d.D; ++x)
    for (int i = m; i < m_s; ++i) s.qt[static_cast<int64_t>(x) * RC + i] = 0.0f;
  for (int x = 0; x < d.Dv; ++x)
    for (int i = m; i < m_s; ++i) s.dot[static_cast<int64_t>(x) * RC + i] = 0.0f;
}

// Loads keys [kb, kb + nk) of kv head hk into the K and V tiles (float32, padding zero).
template <DType DT, class C>
JF_INLINE void load_keys(const FlashParams& p, const SeqExtent& e, int hk, int kb, int nk,
                         const Dims& d, const Scratch& s) {
  using T = typename Elem<DT>::T;
  const int nk_r = static_cast<int>(round_up(nk, C::MR));
  const T* kp = static_cast<const T*>(p.k);
  const T* vp = static_cast<const T*>(p.v);
  for (int j = 0; j < nk; ++j) {
    const int64_t r = static_cast<int64_t>(e.k_start) + kb + j;
    const T* ks = kp + r * p.k_row_stride + static_cast<int64_t>(hk) * d.D;
    const T* vs = vp + r * p.v_row_stride + static_cast<int64_t>(hk) * d.Dv;
    float* kd = s.k + static_cast<int64_t>(j) * d.Dp;
    float* vd = s.v + static_cast<int64_t>(j) * d.Dvp;
    for (int x = 0; x < d.D; ++x) kd[x] = Elem<DT>::load(ks[x]);
    for (int x = d.D; x < d.Dp; ++x) kd[x] = 0.0f;
    for (int x = 0; x < d.Dv; ++x) vd[x] = Elem<DT>::load(vs[x]);
    for (int x = d.Dv; x < d.Dvp; ++x) vd[x] = 0.0f;
  }
  std::fill(s.k + static_cast<int64_t>(nk) * d.Dp, s.k + static_cast<int64_t>(nk_r) * d.Dp, 0.0f);
  std::fill(s.v + static_cast<int64_t>(nk) * d.Dvp, s.v + static_cast<int64_t>(nk_r) * d.Dvp,
            0.0f);
}

// P^T and dZ^T [nk_r, RC] of the loaded rows (m) and keys [kb, kb + nk). Columns [m, RC) of
// both are zero (the dQ product reads columns up to round_up(m, MR)); rows past nk are finite
// and never used.
template <class C>
JF_INLINE void tile_grads(const FlashParams& p, int m, int kb, int nk, const int32_t* lo,
                          const int32_t* hi, const Dims& d, const Scratch& s) {
  constexpr int RC = C::RC;
  const int nk_r = static_cast<int>(round_up(nk, C::MR));
  const int m_s = static_cast<int>(round_up(m, C::NR));
  float* JF_RESTRICT pt = s.pt;
  float* JF_RESTRICT dpt = s.dpt;
  const float* JF_RESTRICT lse = s.lse;
  const float* JF_RESTRICT delta = s.delta;
  // S^T[j, i] = k_j . (scale q_i), as the forward computes it; dP^T[j, i] = v_j . do_i.
  gemm<C::W, C::MR, C::NV, false>(nk_r, m_s, d.D, s.k, d.Dp, 1, s.qt, RC, pt, RC);
  gemm<C::W, C::MR, C::NV, false>(nk_r, m_s, d.Dv, s.v, d.Dvp, 1, s.dot, RC, dpt, RC);

  bool full = true;  // every row sees every key of the tile
  for (int i = 0; i < m; ++i) full = full && lo[i] <= kb && hi[i] >= kb + nk;
  const bool use_cap = p.softcap > 0.0f;
  const float cap = p.softcap, inv_cap = use_cap ? 1.0f / p.softcap : 0.0f;
  for (int j = 0; j < nk; ++j) {
    float* JF_RESTRICT sj = pt + static_cast<int64_t>(j) * RC;
    float* JF_RESTRICT dj = dpt + static_cast<int64_t>(j) * RC;
    if (use_cap) {
      for (int i = 0; i < m; ++i) {
        const float t = std::tanh(sj[i] * inv_cap);
        const float pij = exp_approx(cap * t - lse[i]);
        sj[i] = pij;
        dj[i] = pij * (dj[i] - delta[i]) * (1.0f - t * t);
      }
    } else {
      for (int i = 0; i < m; ++i) {
        const float pij = exp_approx(sj[i] - lse[i]);
        sj[i] = pij;
        dj[i] = pij * (dj[i] - delta[i]);
      }
    }
    if (!full) {
      const int32_t key = kb + j;
      for (int i = 0; i < m; ++i) {
        const bool seen = key >= lo[i] && key < hi[i];
        sj[i] = seen ? sj[i] : 0.0f;
        dj[i] = seen ? dj[i] : 0.0f;
      }
    }
    for (int i = m; i < RC; ++i) sj[i] = dj[i] = 0.0f;
  }
}

// Stores rows of a float32 accumulator [n, ld] times `mul` into dst (row stride `rs`, head
// offset `col`).
template <DType DT>
JF_INLINE void store_rows(void* dst_base, int64_t r0, int64_t rs, int64_t col, int n, int width,
                          const float* acc, int64_t ld, float mul) {
  using T = typename Elem<DT>::T;
  T* base = static_cast<T*>(dst_base);
  for (int j = 0; j < n; ++j) {
    T* dst = base + (r0 + j) * rs + col;
    const float* a = acc + static_cast<int64_t>(j) * ld;
    for (int x = 0; x < width; ++x) dst[x] = Elem<DT>::store(a[x] * mul);
  }
}

// dK/dV item: keys [kb, kb + nk) of kv head hk, against rows [r0, r1) of every query head of
// the group.
template <DType DT, class C>
JF_INLINE void dkv_impl(const FlashBwdParams& bp, const SeqExtent& e, const float* delta, int hk,
                        int kb, int nk, int r0, int r1, const Dims& d, float* scratch) {
  const FlashParams& p = bp.fwd;
  constexpr int RC = C::RC;
  const Scratch s = carve<C>(scratch, d);
  const int nk_r = static_cast<int>(round_up(nk, C::MR));
  load_keys<DT, C>(p, e, hk, kb, nk, d, s);
  std::fill(s.dk, s.dk + static_cast<int64_t>(nk_r) * d.Dp, 0.0f);
  std::fill(s.dv, s.dv + static_cast<int64_t>(nk_r) * d.Dvp, 0.0f);
  const int group = p.num_heads / p.num_heads_k;
  int32_t lo[RC], hi[RC];
  for (int h = hk * group; h < (hk + 1) * group; ++h) {
    for (int i0 = r0; i0 < r1; i0 += kBlockM) {
      const int m = std::min(kBlockM, r1 - i0);
      load_rows<DT, C>(bp, e, delta, h, i0, m, true, d, s, lo, hi);
      tile_grads<C>(p, m, kb, nk, lo, hi, d, s);
      // dV += P^T dO, dK += dZ^T Q (K extent: the m rows).
      gemm<C::W, C::MR, C::NV, true>(nk_r, d.Dvp, m, s.pt, RC, 1, s.dor, d.Dvp, s.dv, d.Dvp);
      gemm<C::W, C::MR, C::NV, true>(nk_r, d.Dp, m, s.dpt, RC, 1, s.qr, d.Dp, s.dk, d.Dp);
    }
  }
  const int64_t row = static_cast<int64_t>(e.k_start) + kb;
  store_rows<DT>(bp.dk, row, bp.dk_row_stride, static_cast<int64_t>(hk) * d.D, nk, d.D, s.dk,
                 d.Dp, p.softmax_scale);
  store_rows<DT>(bp.dv, row, bp.dv_row_stride, static_cast<int64_t>(hk) * d.Dv, nk, d.Dv, s.dv,
                 d.Dvp, 1.0f);
}

// dQ item: rows [i0, i0 + m) of query head h, over every key tile they see.
template <DType DT, class C>
JF_INLINE void dq_impl(const FlashBwdParams& bp, const SeqExtent& e, const float* delta, int h,
                       int i0, int m, const Dims& d, float* scratch) {
  const FlashParams& p = bp.fwd;
  constexpr int RC = C::RC;
  const Scratch s = carve<C>(scratch, d);
  const int m_o = static_cast<int>(round_up(m, C::MR));
  const int hk = h / (p.num_heads / p.num_heads_k);
  int32_t lo[RC], hi[RC];
  load_rows<DT, C>(bp, e, delta, h, i0, m, false, d, s, lo, hi);
  int klo = e.k_len, khi = 0;
  for (int i = 0; i < m; ++i)
    if (lo[i] < hi[i]) {
      klo = std::min(klo, static_cast<int>(lo[i]));
      khi = std::max(khi, static_cast<int>(hi[i]));
    }
  std::fill(s.dq, s.dq + static_cast<int64_t>(m_o) * d.Dp, 0.0f);
  for (int kb = klo; kb < khi; kb += kBlockN) {
    const int nk = std::min(kBlockN, khi - kb);
    load_keys<DT, C>(p, e, hk, kb, nk, d, s);
    tile_grads<C>(p, m, kb, nk, lo, hi, d, s);
    // dQ += dZ K: dZ[i, j] = dZ^T[j, i] (strided A operand, M extent m_o, K extent nk).
    gemm<C::W, C::MR, C::NV, true>(m_o, d.Dp, nk, s.dpt, 1, RC, s.k, d.Dp, s.dq, d.Dp);
  }
  store_rows<DT>(bp.dq, static_cast<int64_t>(e.q_start) + i0, bp.dq_row_stride,
                 static_cast<int64_t>(h) * d.D, m, d.D, s.dq, d.Dp, p.softmax_scale);
}

// One work item of either kind.
struct WorkItem {
  bool dq;        // dQ item, else dK/dV item
  int32_t b;      // sequence
  int32_t head;   // query head (dQ) or kv head (dK/dV)
  int32_t start;  // first row (dQ) or key (dK/dV) of the block
  int32_t count;  // rows (dQ) or keys (dK/dV) of the block
  int32_t r0, r1; // dK/dV: the rows that see the block
  int64_t cost;
};

using ItemFn = void (*)(const FlashBwdParams&, const SeqExtent&, const float*, const WorkItem&,
                        const Dims&, float*);

template <DType DT, class C>
JF_INLINE void item_impl(const FlashBwdParams& bp, const SeqExtent& e, const float* delta,
                         const WorkItem& it, const Dims& d, float* scratch) {
  if (it.dq)
    dq_impl<DT, C>(bp, e, delta, it.head, it.start, it.count, d, scratch);
  else
    dkv_impl<DT, C>(bp, e, delta, it.head, it.start, it.count, it.r0, it.r1, d, scratch);
}

template <DType DT>
void item_generic(const FlashBwdParams& bp, const SeqExtent& e, const float* delta,
                  const WorkItem& it, const Dims& d, float* scratch) {
  item_impl<DT, Tiles::Generic>(bp, e, delta, it, d, scratch);
}

#if JF_X86_DISPATCH
template <DType DT>
JF_TARGET_AVX2 void item_avx2(const FlashBwdParams& bp, const SeqExtent& e, const float* delta,
                              const WorkItem& it, const Dims& d, float* scratch) {
  item_impl<DT, Tiles::Avx2>(bp, e, delta, it, d, scratch);
}
template <DType DT>
JF_TARGET_AVX512 void item_avx512(const FlashBwdParams& bp, const SeqExtent& e,
                                  const float* delta, const WorkItem& it, const Dims& d,
                                  float* scratch) {
  item_impl<DT, Tiles::Avx512>(bp, e, delta, it, d, scratch);
}
#endif

// First row i in [0, q_len) for which pred(i) holds, pred monotone (false then true); q_len if
// none.
template <typename Pred>
int32_t first_row(int32_t q_len, Pred pred) {
  int32_t a = 0, b = q_len;
  while (a < b) {
    const int32_t mid = a + (b - a) / 2;
    if (pred(mid))
      b = mid;
    else
      a = mid + 1;
  }
  return a;
}

// Delta = rowsum(dO * O) - dLSE for every (head, row), and zeros in dq, dk, dv (rows that the
// items write are overwritten; the rest, owned by no sequence, stay zero).
template <DType DT>
void prepare(const FlashBwdParams& bp, float* delta) {
  using T = typename Elem<DT>::T;
  const FlashParams& p = bp.fwd;
  constexpr int64_t kRows = 128;
  const int64_t q_chunks = (static_cast<int64_t>(p.total_q) + kRows - 1) / kRows;
  const int64_t k_chunks = (static_cast<int64_t>(p.total_k) + kRows - 1) / kRows;
  const int64_t H = p.num_heads, Dv = p.head_dim_v;
  auto body = [&](int64_t c) {
    const T zero = Elem<DT>::store(0.0f);
    if (c < q_chunks) {
      const int64_t r0 = c * kRows, r1 = std::min<int64_t>(r0 + kRows, p.total_q);
      const T* o = static_cast<const T*>(p.o);
      const T* dout = static_cast<const T*>(bp.dout);
      for (int64_t h = 0; h < H; ++h)
        for (int64_t r = r0; r < r1; ++r) {
          const T* orow = o + r * p.o_row_stride + h * Dv;
          const T* drow = dout + r * bp.dout_row_stride + h * Dv;
          float acc = 0.0f;
          for (int64_t x = 0; x < Dv; ++x) acc += Elem<DT>::load(orow[x]) * Elem<DT>::load(drow[x]);
          delta[h * p.total_q + r] = acc - bp.dlse[h * p.total_q + r];
        }
      T* dq = static_cast<T*>(bp.dq);
      const int64_t width = H * p.head_dim;
      for (int64_t r = r0; r < r1; ++r)
        std::fill(dq + r * bp.dq_row_stride, dq + r * bp.dq_row_stride + width, zero);
    } else {
      const int64_t r0 = (c - q_chunks) * kRows, r1 = std::min<int64_t>(r0 + kRows, p.total_k);
      T* dk = static_cast<T*>(bp.dk);
      T* dv = static_cast<T*>(bp.dv);
      const int64_t wk = static_cast<int64_t>(p.num_heads_k) * p.head_dim;
      const int64_t wv = static_cast<int64_t>(p.num_heads_k) * p.head_dim_v;
      for (int64_t r = r0; r < r1; ++r) {
        std::fill(dk + r * bp.dk_row_stride, dk + r * bp.dk_row_stride + wk, zero);
        std::fill(dv + r * bp.dv_row_stride, dv + r * bp.dv_row_stride + wv, zero);
      }
    }
  };
  cpu::parallel_for(q_chunks + k_chunks, body);
}

template <DType DT>
const char* run(const FlashBwdParams& bp) {
  const FlashParams& p = bp.fwd;
  std::vector<float> delta;
  std::vector<SeqExtent> ext;
  std::vector<WorkItem> items;
  try {
    delta.resize(static_cast<size_t>(p.num_heads) * static_cast<size_t>(p.total_q));
    ext.resize(static_cast<size_t>(std::max(p.batch, 0)));
  } catch (...) {
    return "out of memory (Delta buffer)";
  }
  prepare<DT>(bp, delta.data());

  const int group = p.num_heads / p.num_heads_k;
  try {
    for (int32_t b = 0; b < std::max(p.batch, 0); ++b) {
      const SeqExtent e = seq_extent(p, p.q_starts[b], p.q_ends[b], p.k_starts[b], p.k_ends[b]);
      ext[b] = e;
      if (e.q_len <= 0 || e.k_len <= 0) continue;  // no row sees a key: all gradients zero
      for (int32_t i0 = 0; i0 < e.q_len; i0 += kBlockM) {
        const int32_t m = std::min(kBlockM, e.q_len - i0);
        int32_t lo0, hi0, lo1, hi1;
        row_keys(p, e, i0, &lo0, &hi0);
        row_keys(p, e, i0 + m - 1, &lo1, &hi1);
        const int64_t keys = std::max<int64_t>(0, static_cast<int64_t>(hi1) - lo0);
        for (int32_t h = 0; h < p.num_heads; ++h)
          items.push_back({true, b, h, i0, m, 0, 0, keys * m + 1});
      }
      for (int32_t kb = 0; kb < e.k_len; kb += kBlockN) {
        const int32_t nk = std::min(kBlockN, e.k_len - kb);
        // Rows whose visible range reaches into [kb, kb + nk): hi > kb and lo < kb + nk.
        const int32_t r0 = first_row(e.q_len, [&](int32_t i) {
          int32_t l, u;
          row_keys(p, e, i, &l, &u);
          return u > kb;
        });
        const int32_t r1 = first_row(e.q_len, [&](int32_t i) {
          int32_t l, u;
          row_keys(p, e, i, &l, &u);
          return l >= kb + nk;
        });
        const int64_t rows = std::max(r1 - r0, 0);
        for (int32_t hk = 0; hk < p.num_heads_k; ++hk)
          items.push_back({false, b, hk, kb, nk, r0, std::max(r0, r1),
                           rows * nk * group + 1});
      }
    }
  } catch (...) {
    return "out of memory (work list)";
  }
  std::sort(items.begin(), items.end(),
            [](const WorkItem& x, const WorkItem& y) { return x.cost > y.cost; });

  Dims d;
  d.D = p.head_dim;
  d.Dv = p.head_dim_v;
  ItemFn fn = &item_generic<DT>;
  int nr = Tiles::Generic::NR;
  int64_t (*floats)(const Dims&) = &scratch_floats<Tiles::Generic>;
#if JF_X86_DISPATCH
  switch (cpu::detect_isa()) {
    case cpu::Isa::kAvx512:
      fn = &item_avx512<DT>;
      nr = Tiles::Avx512::NR;
      floats = &scratch_floats<Tiles::Avx512>;
      break;
    case cpu::Isa::kAvx2:
      fn = &item_avx2<DT>;
      nr = Tiles::Avx2::NR;
      floats = &scratch_floats<Tiles::Avx2>;
      break;
    case cpu::Isa::kGeneric:
      break;
  }
#endif
  d.Dp = static_cast<int>(round_up(d.D, nr));
  d.Dvp = static_cast<int>(round_up(d.Dv, nr));
  const int64_t scratch_size = floats(d);
  std::atomic<bool> failed{false};
  auto body = [&](int64_t idx) {
    const WorkItem& it = items[idx];
    if (float* scratch = cpu::thread_scratch(scratch_size))
      fn(bp, ext[it.b], delta.data(), it, d, scratch);
    else
      failed.store(true, std::memory_order_relaxed);
  };
  cpu::parallel_for(static_cast<int64_t>(items.size()), body);
  return failed.load() ? "out of memory (per-thread scratch)" : nullptr;
}

}  // namespace

const char* flash_attention_bwd_cpu(const FlashBwdParams& p) {
  const FlashParams& f = p.fwd;
  if (f.num_heads <= 0 || f.num_heads_k <= 0 || f.num_heads % f.num_heads_k != 0 ||
      f.head_dim <= 0 || f.head_dim_v < 0 || f.total_q < 0 || f.total_k < 0)
    return "invalid parameters (head counts, head dims or row totals)";
  switch (f.dtype) {
    case DType::kFloat32: return run<DType::kFloat32>(p);
    case DType::kFloat16: return run<DType::kFloat16>(p);
    case DType::kBFloat16: return run<DType::kBFloat16>(p);
  }
  return "unsupported dtype";
}

}  // namespace jax_flash
